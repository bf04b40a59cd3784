"""The benchmark groups: one function per group, each returning its benchmarks.

To add a group, write a function returning a list of :class:`Benchmark` and add a
:class:`Group` for it to ``GROUPS``. Every benchmark has the torch.func and the
torchlevels implementation of the same computation, each a zero-argument callable with its
inputs already bound, and any number of reference implementations (keys of
``REFERENCES``: the plain batched call, a Python loop, Opacus, ...), shown as extra
columns and bars. All of them are checked against torch.func before timing.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import nn

import torchlevels
from torchlevels._level import autograd_on

PLAIN, TORCH_FUNC, TORCHLEVELS = "plain (no vmap)", "torch.func", "torchlevels"
FLOOR = "minimal subclass"  # optional: the cheapest possible per-op __torch_dispatch__
FUNCTION_FLOOR = "minimal __torch_function__"  # optional: the cheapest per-call Python hook
TWO_LEVEL_FLOOR = "minimal two levels"  # optional: the cheapest grad level over a batch level
LOOP = "Python loop"  # one torch.autograd call per example, stacked
OPACUS = "Opacus"  # opacus.GradSampleModule: per-sample gradients by backward hooks
EAGER = "torchlevels (eager)"  # the uncompiled torchlevels composition, beside compiled ones
FUNCTORCH_DIM = "functorch.dim"  # the dims group's programs written with functorch.dim
POLARS, PANDAS = "Polars", "pandas"  # the TPC-H group's dataframe libraries
CONTIGUOUS_POOL = "torchlevels, contiguous max pool"  # without the channels-last max pool


@dataclass(frozen=True)
class Reference:
    """A reference implementation: not a transform under test, an extra column and bar."""

    name: str
    color: str
    note: str  # what it is, for the Method section of BENCHMARKS.md


# The reference columns, in the order they are shown (each benchmark has any subset).
REFERENCES: dict[str, Reference] = {r.name: r for r in (
    Reference(PLAIN, "#999999", "the same computation written batched by hand, without "
              "vmap (for the autodiff rows: one batched autograd call where the examples "
              "are independent): the floor any transform could reach"),
    Reference(FLOOR, "#c4ad66", "a minimal `__torch_dispatch__` subclass that only "
              "unwraps, calls and rewraps (`_MinimalBatched`): the floor for any design "
              "that dispatches each op through Python"),
    Reference(FUNCTION_FLOOR, "#d9c78c", "a minimal `__torch_function__` subclass that "
              "only unwraps, calls and rewraps each call before the dispatcher "
              "(`_MinimalFunction`): the floor for any design that handles each call in "
              "Python, as torchlevels' shortcuts do"),
    Reference(TWO_LEVEL_FLOOR, "#b8a060", "in the grad-overhead group, two minimal "
              "`__torch_dispatch__` subclasses nested as vmap(grad) nests its levels: an "
              "outer one that runs each op on its inner tensors with autograd recording, "
              "over one that only unwraps, calls and rewraps (`_RecordingLevel` over "
              "`_PassThrough`): the floor for any design with two Python levels per op"),
    Reference(LOOP, "#55a868", "a Python `for` loop over the examples calling "
              "`torch.autograd.grad` on each and stacking the results: what one writes "
              "without per-sample transforms"),
    Reference(OPACUS, "#8172b3", "Opacus' `GradSampleModule` (per-sample gradients from "
              "backward hooks, `loss_reduction=\"sum\"`, one batched forward and "
              "backward): the tool a DP-SGD user would pick"),
    Reference(EAGER, "#e8b48f", "in the compiled groups, the same torchlevels composition "
              "run eagerly, op by op through its levels"),
    Reference(FUNCTORCH_DIM, "#c44e52", "in the first-class dimensions group, the same "
              "program written with `functorch.dim` (its pure-Python port, shipped in "
              "torch 2.13): the anchor the issue names"),
    Reference(CONTIGUOUS_POOL, "#f0c8a8", "in the CNN groups, torchlevels with its max "
              "pool on the contiguous input, as torch.func runs it, instead of in "
              "channels-last layout (torchlevels/batching/max_pool.py): what the row "
              "measures without that kernel choice, i.e. the cost of the levels alone"),
    Reference(POLARS, "#64b5cd", "in the TPC-H group, the query written with Polars' lazy "
              "API on in-memory DataFrames (benchmarks/tpch_reference.py)"),
    Reference(PANDAS, "#8c8c8c", "in the TPC-H group, the query written with pandas on "
              "in-memory DataFrames (strings as categories)"),
)}
IMPL_COLORS = {TORCH_FUNC: "#4c72b0", TORCHLEVELS: "#dd8452",
               **{name: r.color for name, r in REFERENCES.items()}}


@dataclass(frozen=True)
class Benchmark:
    """One computation, several ways: ``impls`` maps TORCH_FUNC, TORCHLEVELS and any
    ``REFERENCES`` names to zero-argument calls."""

    name: str
    impls: dict[str, Callable[[], torch.Tensor]]
    target: float | None  # the largest acceptable torchlevels / torch.func ratio
    transform: Callable[[object], Callable] | None = None  # lib -> the composed function
    args: tuple = ()  # its inputs
    notes: tuple[str, ...] = ()  # lines for BENCHMARKS.md under the group's figures


@dataclass(frozen=True)
class Group:
    """A section of BENCHMARKS.md: a title, what it measures, and how to build it."""

    title: str
    description: str
    build: Callable[[], list[Benchmark]]
    labels: tuple[str, str] = (TORCH_FUNC, TORCHLEVELS)  # what the two timed columns are
    threads: int | None = None  # torch threads for this group (None: the runner's)


def _three_ways(name, fn, plain_fn, args, target, in_dims=0) -> Benchmark:
    """A benchmark of ``fn`` vmapped over ``args`` (built once) and ``plain_fn(*args)``."""
    tf = torch.func.vmap(fn, in_dims=in_dims)
    tl = torchlevels.vmap(fn, in_dims=in_dims)
    return Benchmark(name, {
        PLAIN: lambda: plain_fn(*args),
        TORCH_FUNC: lambda: tf(*args),
        TORCHLEVELS: lambda: tl(*args),
    }, target)


def _contiguous_max_pool(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with torchlevels' max pools run on the contiguous input (CONTIGUOUS_POOL)."""
    from torchlevels.batching import max_pool

    def run():
        with mock.patch.object(max_pool, "faster_in_channels_last", lambda x: False):
            return call()

    return run


# -- (a) per-op overhead: a long chain of small pointwise ops ---------------------------

# Ten ops, repeated ten times; the mix keeps values bounded (exp only after tanh).
POINTWISE_OPS = [
    lambda x, y: torch.mul(x, y),
    lambda x, y: torch.sin(x),
    lambda x, y: torch.add(x, y),
    lambda x, y: torch.tanh(x),
    lambda x, y: torch.exp(x),
    lambda x, y: torch.sub(x, y),
    lambda x, y: torch.cos(x),
    lambda x, y: torch.sigmoid(x),
    lambda x, y: torch.mul(x, 0.5),
    lambda x, y: torch.maximum(x, y),
]


def pointwise_chain(x: torch.Tensor, y: torch.Tensor, length: int = 100) -> torch.Tensor:
    """``length`` pointwise ops (one aten op each) cycling through ``POINTWISE_OPS``."""
    for i in range(length):
        x = POINTWISE_OPS[i % len(POINTWISE_OPS)](x, y)
    return x


def overhead_group() -> list[Benchmark]:
    """(a) 100-op pointwise chain on (8, 16) inputs: measures dispatch overhead per op."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    bench = _three_ways("pointwise chain, 100 ops, (8, 16)", pointwise_chain, pointwise_chain,
                        (x, y), target=1.5)
    bench.impls[FLOOR] = lambda: _MinimalBatched.run(pointwise_chain, x, y)
    bench.impls[FUNCTION_FLOOR] = lambda: _MinimalFunction.run(pointwise_chain, x, y)
    return [bench]


class _MinimalBatched(torch.Tensor):
    """The floor for any per-op design: unwrap, call, rewrap; no levels, checks or rules.

    Correct only for this benchmark (pointwise ops, batch dim 0, equal shapes, float32 on
    the CPU: the wrapper takes the default dtype and device, with no keywords to parse).
    """

    __slots__ = ("inner",)  # as quick to read and write as an attribute can be
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.inner if type(a) is cls else a for a in args], **(kwargs or {}))
        return cls.wrap(out)

    @classmethod
    def wrap(cls, inner):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape[1:])
        out.inner = inner
        return out

    @classmethod
    def run(cls, fn, *args):
        return fn(*map(cls.wrap, args)).inner


class _MinimalFunction(_MinimalBatched):
    """The floor for a per-call ``__torch_function__`` design: unwrap, call, rewrap before
    the dispatcher. Correct only for this benchmark, like ``_MinimalBatched``."""

    # the same body as the parent's hook (the two hooks take the same arguments)
    __torch_function__ = _MinimalBatched.__dict__["__torch_dispatch__"]


# -- (b) an MLP forward ---------------------------------------------------------------------


def _frozen(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters as plain tensors (no autograd: these are forward benchmarks)."""
    return [p.detach() for p in module.parameters()]


def mlp_group() -> list[Benchmark]:
    """(b) MLP 784-256-256-10 forward at batch 64, vmapped over single examples."""
    torch.manual_seed(0)
    w1, b1 = _frozen(nn.Linear(784, 256))
    w2, b2 = _frozen(nn.Linear(256, 256))
    w3, b3 = _frozen(nn.Linear(256, 10))

    def mlp(x):
        x = F.relu(F.linear(x, w1, b1))
        x = F.relu(F.linear(x, w2, b2))
        return F.linear(x, w3, b3)

    x = torch.randn(64, 784)
    return [_three_ways("MLP 784-256-256-10, batch 64", mlp, mlp, (x,), target=1.1)]


def attention_group() -> list[Benchmark]:
    """(b') A pre-norm transformer block, and PyTorch's fused attention, vmapped over single
    sequences."""
    torch.manual_seed(0)
    d, heads, seq = 64, 4, 32
    qkv, proj = _frozen(nn.Linear(d, 3 * d)), _frozen(nn.Linear(d, d))
    up, down = _frozen(nn.Linear(d, 4 * d)), _frozen(nn.Linear(4 * d, d))
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)

    def block(x):  # written for one (seq, d) sequence; its dims count from the end
        q, k, v = F.linear(F.layer_norm(x, (d,)), *qkv).unflatten(-1, (3, heads, -1)).unbind(-3)
        scores = torch.einsum("...qhc,...khc->...hqk", q, k) / (d // heads) ** 0.5
        att = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + F.linear(torch.einsum("...hqk,...khc->...qhc", att, v).flatten(-2), *proj)
        return x + F.linear(F.gelu(F.linear(F.layer_norm(x, (d,)), *up)), *down)

    def loss(x):  # of one sequence
        return block(x).square().mean()

    def plain_grads(xs):  # the sequences are independent: one backward gives every row
        xs = xs.detach().requires_grad_()
        return torch.autograd.grad(block(xs).square().mean((-2, -1)).sum(), xs)[0]

    def attention(q, k, v):  # PyTorch's fused attention, per sequence
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    xs = torch.randn(16, seq, d)
    per_head = [torch.randn(16, heads, seq, d // heads) for _ in range(3)]
    return [
        _three_ways("transformer block (32, 64), 4 heads, batch 16", block, block, (xs,),
                    target=None),
        _three_ways("scaled_dot_product_attention (4, 32, 16), causal, batch 16", attention,
                    attention, per_head, target=None),
        _autodiff("grad of the block, one sequence (32, 64)", lambda lib: lib.grad(loss),
                  (xs[0],), {PLAIN: lambda: plain_grads(xs[:1])[0]}, target=None),
        _autodiff("vmap(grad) of the block, batch 16", lambda lib: lib.vmap(lib.grad(loss)),
                  (xs,), {PLAIN: lambda: plain_grads(xs)}, target=None),
    ]


# -- (b'') everyday calls, one per vmap call -----------------------------------------------


def calls_group() -> list[Benchmark]:
    """(b'') One everyday call per vmap call, on 16 examples of shape (8, 32)."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 8, 32), torch.randn(16, 8, 32)
    calls = {
        "F.mse_loss(x, y)": F.mse_loss,
        "F.smooth_l1_loss(x, y)": F.smooth_l1_loss,
        "F.cosine_similarity(x, y, dim=-1)": lambda x, y: F.cosine_similarity(x, y, dim=-1),
        "torch.outer(x[0], y[0])": lambda x, y: torch.outer(x[0], y[0]),
        "torch.zeros_like(x)": lambda x, y: torch.zeros_like(x),
        "x.new_zeros(4, 32)": lambda x, y: x.new_zeros(4, 32),
        "F.pad(x, (1, 1))": lambda x, y: F.pad(x, (1, 1)),
        "x.transpose(0, 1).contiguous()": lambda x, y: x.transpose(0, 1).contiguous(),
        "x.flip(-1)": lambda x, y: x.flip(-1),
        "x.triu()": lambda x, y: x.triu(),
    }
    return [_one_call(name, f, x, y) for name, f in calls.items()]


def _one_call(name: str, f: Callable, x: torch.Tensor, y: torch.Tensor) -> Benchmark:
    """``f`` vmapped over ``x`` and ``y`` by torch.func and by torchlevels."""
    theirs, ours = torch.func.vmap(f), torchlevels.vmap(f)
    return Benchmark(name, {TORCH_FUNC: lambda: theirs(x, y), TORCHLEVELS: lambda: ours(x, y)},
                     None)


# -- (c) a small CNN forward ------------------------------------------------------------------


def cnn_group() -> list[Benchmark]:
    """(c) small CNN forward at batch 32 on 1x28x28 examples, vmapped over single examples."""
    torch.manual_seed(0)
    c1, cb1 = _frozen(nn.Conv2d(1, 16, 3))
    c2, cb2 = _frozen(nn.Conv2d(16, 32, 3))
    w, b = _frozen(nn.Linear(32 * 5 * 5, 10))

    def features(x):  # works on (1, 28, 28) and on (N, 1, 28, 28)
        x = F.max_pool2d(F.relu(F.conv2d(x, c1, cb1)), 2)
        return F.max_pool2d(F.relu(F.conv2d(x, c2, cb2)), 2)

    def cnn(x):  # one example
        return F.linear(features(x).flatten(), w, b)

    def cnn_batched(x):
        return F.linear(features(x).flatten(1), w, b)

    x = torch.randn(32, 1, 28, 28)
    benchmark = _three_ways("CNN conv16-conv32-linear, batch 32", cnn, cnn_batched, (x,),
                            target=1.1)
    benchmark.impls[CONTIGUOUS_POOL] = _contiguous_max_pool(benchmark.impls[TORCHLEVELS])
    return [benchmark]


# -- the max pool layout of the CNN groups --------------------------------------------------


def max_pool_group() -> list[Benchmark]:
    """The batched max pool of vmap's rules (torchlevels/batching/max_pool.py), in
    channels-last layout, against PyTorch's max pool of the same contiguous input."""
    from torchlevels.batching.max_pool import max_pool

    torch.manual_seed(0)
    cases = [  # (input shape, kernel, stride, padding, dtype)
        ((32, 16, 26, 26), 2, 2, 0, torch.float32),
        ((32, 32, 11, 11), 2, 2, 0, torch.float32),
        ((32, 4, 28, 28), 2, 2, 0, torch.float32),
        ((8, 64, 56, 56), 3, 2, 1, torch.float32),
        ((8, 64, 56, 56), 3, 2, 1, torch.bfloat16),
        ((8, 16, 16, 16, 16), 2, 2, 0, torch.float32),
    ]
    out = []
    for shape, k, stride, pad, dtype in cases:
        x = torch.randn(shape).to(dtype)
        n = x.dim() - 2
        op = getattr(torch.ops.aten, f"max_pool{n}d_with_indices")
        args = ([k] * n, [stride] * n, [pad] * n)
        name = f"max pool {k}x{k}{'' if n == 2 else f'x{k}'} stride {stride}, {tuple(shape)}"
        out.append(Benchmark(name + ("" if dtype is torch.float32 else f", {dtype}"), {
            TORCH_FUNC: lambda op=op, x=x, args=args: op(x, *args),
            TORCHLEVELS: lambda op=op, x=x, args=args: max_pool(op, x, *args),
        }, None))
    return out


# -- (d)-(g) autodiff: per-sample gradients, batched Hessians, grad overhead ----------------

AUTODIFF_TARGET = 1.2


def _autodiff(name: str, transform: Callable[[object], Callable], args: tuple,
              references: dict[str, Callable[[], object]], target: float = AUTODIFF_TARGET,
              ) -> Benchmark:
    """``transform(lib)(*args)`` with lib = torch.func and lib = torchlevels, plus references.

    ``transform`` gets the library module and returns the composed function, so both sides
    run exactly the same composition (e.g. ``lib.vmap(lib.grad(loss), ...)``).
    """
    tf, tl = transform(torch.func), transform(torchlevels)
    return Benchmark(name, {
        **references,
        TORCH_FUNC: lambda: tf(*args),
        TORCHLEVELS: lambda: tl(*args),
    }, target, transform, args)


# -- compiled: the autodiff workloads traced once and replayed ------------------------------

CHAIN = "vmap(grad), pointwise chain, 60 ops, (8, 16)"


def _autodiff_workloads() -> list[Benchmark]:
    return [*mlp_grad_group(), *cnn_grad_group(), *hessian_group(), *grad_overhead_group()]


def compiled_group() -> list[Benchmark]:
    """(h) torchlevels.compile (graph replay, no backend) against torch.func eager."""
    out = []
    for b in _autodiff_workloads():
        tf, eager = b.transform(torch.func), b.transform(torchlevels)
        ours = torchlevels.compile(eager)
        out.append(Benchmark(b.name, {
            TORCH_FUNC: lambda tf=tf, a=b.args: tf(*a),
            TORCHLEVELS: lambda ours=ours, a=b.args: ours(*a),
            EAGER: lambda eager=eager, a=b.args: eager(*a),
        }, 0.5 if b.name == CHAIN else 1.0))
    return out


def _torch_compile_failure(name: str) -> str:
    """The exception torch.compile(torch.func ...) raises on workload ``name``
    in a fresh process ('' if it compiles). In this process a failed compile leaves
    dynamo's functorch state broken, so later recompiles of the other anchors fail too."""
    code = ("import torch; from benchmarks.groups import _autodiff_workloads; "
            f"b = next(b for b in _autodiff_workloads() if b.name == {name!r}); "
            "torch.compile(b.transform(torch.func), backend='inductor', dynamic=False)(*b.args)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode == 0:
        return ""
    raised = [ln for ln in done.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception)\b", ln)]
    return raised[-1].split(":")[0].rsplit(".", 1)[-1] if raised else f"exit {done.returncode}"


def inductor_group() -> list[Benchmark]:
    """(i) torchlevels.compile(backend="inductor") against torch.compile(torch.func ...)."""
    out = []
    for b in _autodiff_workloads():
        anchor = b.transform(torch.func)
        failure = _torch_compile_failure(b.name)
        if failure and b.name == HESSIAN:
            # the same Hessian through reverse-over-reverse, which torch.compile takes
            f = _hessian_problem()[0]
            anchor = torch.func.vmap(torch.func.jacrev(torch.func.jacrev(f)))
            print(f"  {b.name}: torch.compile(torch.func.hessian) fails on this PyTorch "
                  f"({failure}): anchored on torch.func's jacrev(jacrev(f))", file=sys.stderr)
        elif failure:
            print(f"  {b.name}: torch.compile(torch.func ...) fails on this PyTorch "
                  f"({failure}): row left out", file=sys.stderr)
            continue
        theirs = torch.compile(anchor, backend="inductor", dynamic=False)
        ours = torchlevels.compile(b.transform(torchlevels), backend="inductor")
        out.append(Benchmark(b.name, {
            TORCH_FUNC: lambda theirs=theirs, a=b.args: theirs(*a),
            TORCHLEVELS: lambda ours=ours, a=b.args: ours(*a),
        }, 1.1))
    return out


def _per_sample_loss(lib, model: nn.Module, loss_fn: Callable = F.cross_entropy
                     ) -> Callable:
    """The loss of one example (cross-entropy unless given), as a function of the
    parameter dict."""

    def loss(params, x, y):
        out = lib.functional_call(model, params, (x.unsqueeze(0),))
        return loss_fn(out, y.unsqueeze(0))

    return loss


def _loop_per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                           loss_fn: Callable) -> Callable:
    """The Python-loop baseline: one forward and ``torch.autograd.grad`` per example."""
    names, params = zip(*model.named_parameters())

    def run():
        rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
                for i in range(x.shape[0])]
        return {n: torch.stack(g) for n, g in zip(names, zip(*rows))}

    return run


def _opacus_per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                             loss_fn: Callable) -> Callable | None:
    """Opacus' per-sample gradients (``None`` when opacus is not installed)."""
    try:
        from opacus import GradSampleModule
    except ImportError:
        return None
    gsm = GradSampleModule(model, loss_reduction="sum")  # each example's own loss gradient
    named = list(model.named_parameters())

    def run():
        gsm.zero_grad(set_to_none=True)  # clears .grad_sample too
        # the sum of each example's loss: a mean over one example's outputs stays one
        loss_fn(gsm(x), y, reduction="none").reshape(len(x), -1).mean(1).sum().backward()
        return {n: p.grad_sample for n, p in named}

    return run


def _per_sample_benchmark(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          loss_fn: Callable = F.cross_entropy,
                          target: float | None = AUTODIFF_TARGET) -> Benchmark:
    """``vmap(grad(loss), in_dims=(None, 0, 0))`` over ``model``'s parameters, with the
    Python-loop and Opacus references, each on its own copy of the model (Opacus adds
    hooks and attributes to the parameters it wraps)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    refs = {LOOP: _loop_per_sample_grads(copy.deepcopy(model), x, y, loss_fn)}
    opacus = _opacus_per_sample_grads(copy.deepcopy(model), x, y, loss_fn)
    if opacus is not None:
        refs[OPACUS] = opacus
    return _autodiff(
        name,
        lambda lib: lib.vmap(lib.grad(_per_sample_loss(lib, model, loss_fn)),
                             in_dims=(None, 0, 0)),
        (params, x, y), refs, target,
    )


def mlp_grad_group() -> list[Benchmark]:
    """(d) per-sample gradients of an MLP 784-256-256-10, batch 64, cross-entropy loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    return [_per_sample_benchmark("per-sample grads, MLP 784-256-256-10, batch 64",
                                  model, x, y)]


def cnn_grad_group() -> list[Benchmark]:
    """(e) per-sample gradients of the CNN of group (c), batch 32, cross-entropy loss."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 10),
    )
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    benchmark = _per_sample_benchmark("per-sample grads, CNN conv16-conv32-linear, batch 32",
                                      model, x, y)
    benchmark.impls[CONTIGUOUS_POOL] = _contiguous_max_pool(benchmark.impls[TORCHLEVELS])
    return [benchmark]


def norm_grad_group() -> list[Benchmark]:
    """(e') per-sample gradients of models with layer norm and group norm."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64),
                        nn.Flatten(), nn.Linear(8 * 64, 10))
    x, y = torch.randn(64, 8, 32), torch.randint(0, 10, (64,))
    cnn = nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 5 * 5, 10),
    )
    images, labels = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    return [
        _per_sample_benchmark("per-sample grads, layer-norm MLP on (8, 32), batch 64",
                              mlp, x, y),
        _per_sample_benchmark("per-sample grads, group-norm CNN, batch 32", cnn, images,
                              labels),
    ]


def regression_grad_group() -> list[Benchmark]:
    """(e'') per-sample gradients of a small regression MLP: the overhead-bound regime."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Linear(32, 32),
                          nn.Hardswish(), nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    return [
        _per_sample_benchmark(f"per-sample grads, MLP 16-32-32-4, {name} loss, batch 64",
                              model, x, y, loss_fn, target=None)
        for name, loss_fn in (("MSE", F.mse_loss), ("Huber", F.huber_loss))
    ]


HESSIAN = "vmap(hessian(f)), 32-dim, batch 16"


def _hessian_problem() -> tuple[Callable, torch.Tensor, torch.Tensor]:
    """The scalar function of one (32,) example, its batch of 16, and its matrix."""
    torch.manual_seed(0)
    a = torch.randn(32, 32) / 32 ** 0.5

    def f(x):
        return x.tanh() @ (a @ x.sin()) + x.pow(2).sum()

    return f, torch.randn(16, 32), a


def hessian_group() -> list[Benchmark]:
    """(f) vmap(hessian(f)) of a 32-dim scalar function over a batch of 16."""
    f, x, a = _hessian_problem()

    def f_batched(x):  # (N, 32) -> (N,)
        return (x.tanh() * (x.sin() @ a.T)).sum(-1) + x.pow(2).sum(-1)

    def plain(x):
        # examples are independent: row j of every example's Hessian is the gradient of
        # the sum over the batch of the j-th gradient entries; 1 + 32 batched backwards
        x = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(f_batched(x).sum(), x, create_graph=True)
        rows = [torch.autograd.grad(g[:, j].sum(), x, retain_graph=True)[0]
                for j in range(x.shape[1])]
        return torch.stack(rows, 1)

    def loop(xs):
        out = []
        for x in xs:
            x = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(f(x), x, create_graph=True)
            out.append(torch.stack([torch.autograd.grad(g[j], x, retain_graph=True)[0]
                                    for j in range(x.shape[0])]))
        return torch.stack(out)

    return [_autodiff(HESSIAN,
                      lambda lib: lib.vmap(lib.hessian(f)), (x,),
                      {PLAIN: lambda: plain(x), LOOP: lambda: loop(x)})]


def forward_group() -> list[Benchmark]:
    """(f') forward mode: jacfwd and jvp of functions with captured weights and numbers."""
    torch.manual_seed(0)
    w1, b1 = torch.randn(64, 16) / 4, torch.randn(64)
    w2, b2 = torch.randn(8, 64) / 8, torch.randn(8)

    def mlp(x):  # one (16,) example, or a batch of them (the rows are independent)
        h = torch.tanh(x @ w1.T + b1) * 0.5 + 0.5
        return torch.tanh(h @ w2.T + b2) * 2 - 1

    x, xs = torch.randn(16), torch.randn(64, 16)
    t = torch.randn(8, 16)
    y = torch.randn(8, 16)

    def jacobians(xs):  # forward AD by hand: one dual per input direction, every example
        n, d = xs.shape
        eye = torch.eye(d).expand(n, d, d).contiguous()
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(xs[:, None, :].expand(n, d, d).contiguous(), eye)
            return forward_ad.unpack_dual(mlp(dual)).tangent.transpose(1, 2)

    def chain_jvp(x, t):
        with forward_ad.dual_level():
            out = pointwise_chain(forward_ad.make_dual(x, t), y, length=60)
            return tuple(forward_ad.unpack_dual(out))

    x_chain = torch.randn(8, 16)
    xs_chain, ts_chain = torch.randn(16, 8, 16), torch.randn(16, 8, 16)
    return [
        _autodiff("jacfwd, MLP 16-64-8 (tanh), one example", lambda lib: lib.jacfwd(mlp),
                  (x,), {PLAIN: lambda: jacobians(x[None])[0]}, target=None),
        _autodiff("vmap(jacfwd), MLP 16-64-8 (tanh), batch 64",
                  lambda lib: lib.vmap(lib.jacfwd(mlp)), (xs,),
                  {PLAIN: lambda: jacobians(xs)}, target=None),
        _autodiff("jvp, pointwise chain, 60 ops, (8, 16)",
                  lambda lib: lambda x, t: lib.jvp(
                      lambda x: pointwise_chain(x, y, length=60), (x,), (t,)),
                  (x_chain, t), {PLAIN: lambda: chain_jvp(x_chain, t)}, target=None),
        _autodiff("vmap(jvp), pointwise chain, 60 ops, 16 examples of (8, 16)",
                  lambda lib: lib.vmap(lambda x, t: lib.jvp(
                      lambda x: pointwise_chain(x, y, length=60), (x,), (t,))),
                  (xs_chain, ts_chain), {PLAIN: lambda: chain_jvp(xs_chain, ts_chain)},
                  target=None),
    ]


def grad_overhead_group() -> list[Benchmark]:
    """(g) vmap(grad) of a 60-op chain of tiny pointwise ops: per-op cost of two levels."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)

    def loss(x, y):
        return pointwise_chain(x, y, length=60).sum()

    def plain():  # the examples are independent: one batched backward gives every row
        xr = x.detach().requires_grad_()
        return torch.autograd.grad(loss(xr, y), xr)[0]

    def loop():
        rows = []
        for i in range(x.shape[0]):
            xi = x[i].detach().requires_grad_()
            rows.append(torch.autograd.grad(loss(xi, y[i]), xi)[0])
        return torch.stack(rows)

    def two_levels():  # the examples are independent: the gradient of the sum over all
        leaf = _PassThrough.wrap(x, requires_grad=True)
        out = loss(_RecordingLevel.wrap(leaf), _PassThrough.wrap(y))
        return torch.autograd.grad(out.inner, leaf)[0].inner

    return [_autodiff(CHAIN,
                      lambda lib: lib.vmap(lib.grad(loss)), (x, y),
                      {PLAIN: plain, TWO_LEVEL_FLOOR: two_levels, LOOP: loop})]


class _PassThrough(torch.Tensor):
    """The floor of a level that only forwards: unwrap, call, rewrap, shapes as they are
    (the batch stays in the shape: correct for the grad-overhead chain only, whose float32
    CPU tensors the wrapper's default dtype and device describe)."""

    __slots__ = ("inner",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.inner if type(a) is cls else a for a in args], **(kwargs or {}))
        return cls.wrap(out) if isinstance(out, torch.Tensor) else out

    @classmethod
    def wrap(cls, inner, requires_grad=False):
        if requires_grad:
            out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, requires_grad=True)
        else:
            out = torch.Tensor._make_wrapper_subclass(cls, inner.shape)
        out.inner = inner
        return out


class _RecordingLevel(_PassThrough):
    """The floor of a grad level: each op run on the inner tensors with autograd recording
    (torchlevels' ``autograd_on``, the least a dispatch-level wrapper needs for that)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with autograd_on():
            out = func(*[a.inner if type(a) is cls else a for a in args], **(kwargs or {}))
        return cls.wrap(out) if isinstance(out, torch.Tensor) else out


# -- first-class dimensions: torchlevels.dim against plain PyTorch and functorch.dim ------

# Each program takes the dims module ``D`` (torchlevels.dim or functorch.dim) first.


def _dims_mm(D, A, B):
    i, j, k = D.dims(3)
    return (A[i, k] * B[k, j]).sum(k).order(i, j)


def _dims_attention(D, K, Q, V):
    batch, channel, key, query = D.dims(4)
    k = K[batch, channel, key]
    q = Q[batch, channel, query]
    v = V[batch, channel, key]
    a = (k * q).sum(channel)
    a = D.softmax(a * (channel.size ** -0.5), dim=key)
    r = (v * a).sum(key)
    return torch.cat((r.order(batch, channel, query), Q), dim=1)


def _plain_attention(K, Q, V):
    a = (K.transpose(1, 2) @ Q) * K.shape[1] ** -0.5  # (batch, key, query)
    return torch.cat((V @ a.softmax(dim=1), Q), dim=1)


def _dims_pixel_shuffle(D, img):
    h2, w2, c, b, h, w = D.dims(6)
    h2.size = w2.size = 2
    return img[b, (c, h2, w2), h, w].order(b, c, (h, h2), (w, w2))


def _dims_embedding_bag(D, input, W):
    batch, sequence, features = D.dims(3)
    return W[input[batch, sequence], features].sum(sequence).order(batch, features)


def _dims_benchmark(name: str, program: Callable, plain: Callable, args: tuple,
                    target: float | None) -> Benchmark:
    """``program(D, *args)`` with D = torchlevels.dim and functorch.dim, ``plain(*args)``
    the anchor."""
    import functorch.dim as functorch_dim

    import torchlevels.dim as torchlevels_dim

    return Benchmark(name, {
        TORCH_FUNC: lambda: plain(*args),
        TORCHLEVELS: lambda: program(torchlevels_dim, *args),
        FUNCTORCH_DIM: lambda: program(functorch_dim, *args),
    }, target)


def dims_group() -> list[Benchmark]:
    """(j) torchlevels.dim against plain PyTorch, with functorch.dim as a reference."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    A, B = randn(512, 512), randn(512, 512)
    a, b = randn(64, 64), randn(64, 64)
    K, Q, V = randn(8, 64, 256), randn(8, 64, 256), randn(8, 64, 256)
    img = randn(8, 64, 32, 32)
    W, ids = randn(10000, 128), torch.randint(0, 10000, (64, 32), generator=gen)
    return [
        _dims_benchmark("mm 512x512", _dims_mm, torch.matmul, (A, B), 1.2),
        _dims_benchmark("mm 64x64", _dims_mm, torch.matmul, (a, b), None),
        _dims_benchmark("attention (8, 64, 256)", _dims_attention, _plain_attention,
                        (K, Q, V), 1.5),
        _dims_benchmark("pixel shuffle (8, 64, 32, 32), r=2", _dims_pixel_shuffle,
                        lambda x: F.pixel_shuffle(x, 2), (img,), None),
        _dims_benchmark("embedding bag (batch 64, sequence 32, table 10000x128)",
                        _dims_embedding_bag, lambda i, w: F.embedding_bag(i, w, mode="sum"),
                        (ids, W), None),
    ]


def _numbers(result) -> torch.Tensor:
    """A query result's numeric values as one float64 tensor (for the cross-check)."""
    import numpy as np

    if isinstance(result, float):
        return torch.tensor(result, dtype=torch.float64)
    if not hasattr(result, "to_numpy"):  # a torchlevels Table
        result = result.to_pandas()
    if hasattr(result, "select_dtypes"):  # pandas
        frame = result.select_dtypes("number").to_numpy(dtype=np.float64)
    else:  # polars
        import polars as pl

        frame = result.select(pl.selectors.numeric()).to_numpy().astype(np.float64)
    return torch.from_numpy(np.ascontiguousarray(frame))


TPCH_SCALE = 1  # tests/test_benchmarks.py builds the group at a small scale


def tpch_group() -> list[Benchmark]:
    """(k) TPC-H Q1, Q3, Q6 at scale 1: torchlevels.relational against DuckDB, Polars and
    pandas on in-memory tables, all on every core."""
    import os
    import sys
    import time

    import duckdb

    from benchmarks import tpch_reference as ref

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import tpch

    folder = tpch.generate(TPCH_SCALE)

    def timed(load):
        start = time.perf_counter()
        out = load()
        return out, time.perf_counter() - start

    ours, t_ours = timed(lambda: tpch.load(folder))
    con = duckdb.connect()

    def duck_load():
        for t in tpch.COLUMNS:
            con.execute(f"create table {t} as select * from read_parquet("
                        f"'{os.path.join(folder, t + '.parquet')}')")

    _, t_duck = timed(duck_load)
    frames_pl, t_pl = timed(lambda: ref.load_polars(folder, ref.COLUMNS))
    frames_pd, t_pd = timed(lambda: ref.load_pandas(folder, ref.COLUMNS))
    load_note = (f"Load into memory (once, not timed per query): torchlevels {t_ours:.1f} s "
                 f"(all columns the five example queries read), DuckDB {t_duck:.1f} s (every "
                 f"column), Polars {t_pl:.1f} s, pandas {t_pd:.1f} s (the columns of Q1, Q3, "
                 "Q6).")

    def duck(name):
        sql = tpch.SQL[name]
        return lambda: _numbers(con.execute(sql).df() if name != "q6" else
                                float(con.execute(sql).fetchone()[0]))

    def on(query, tables):
        return lambda: _numbers(query(tables))

    benchmarks = []
    for name in ("q1", "q3", "q6"):
        _, first = timed(lambda name=name: tpch.run(name, ours))
        notes = (load_note,) if name == "q1" else ()
        notes += (f"torchlevels' first call (compiling its fused kernels, once per process): "
                  f"{first:.1f} s.",)
        benchmarks.append(Benchmark(f"TPC-H {name.upper()} (SF{TPCH_SCALE:g})", {
            TORCH_FUNC: duck(name),
            TORCHLEVELS: on(lambda t, name=name: tpch.run(name, t), ours),
            POLARS: on(getattr(ref, f"polars_{name}"), frames_pl),
            PANDAS: on(getattr(ref, f"pandas_{name}"), frames_pd),
        }, 1.5, notes=notes))
    return benchmarks


GROUPS: dict[str, Group] = {
    "overhead": Group(
        "Per-op overhead",
        "A chain of 100 small pointwise ops (mul, sin, add, tanh, exp, sub, cos, sigmoid, "
        "mul by a scalar, maximum), vmapped over 8 examples of shape (16,). The ops are "
        "tiny, so this measures the Python cost of dispatching one op through a vmap level. "
        "Target from the issue: ratio <= 1.5.",
        overhead_group,
    ),
    "mlp": Group(
        "MLP forward",
        "`F.linear`/`F.relu` MLP 784-256-256-10 with unbatched weights, vmapped over a batch "
        "of 64 single examples of shape (784,). Target: ratio <= 1.1.",
        mlp_group,
    ),
    "attention": Group(
        "Transformer block forward",
        "A pre-norm transformer block written for one sequence with everyday calls "
        "(`F.layer_norm`, `F.linear`, `unflatten`/`unbind`, `einsum`, `masked_fill` with a "
        "causal mask, `softmax`, `F.gelu`, residual adds), unbatched weights, vmapped over "
        "16 sequences of shape (32, 64): the cost of the calls that are not pointwise math "
        "or `F.linear`. Most are answered in vmap's `__torch_function__` "
        "(torchlevels/batching/shortcuts.py), and under `grad` in the grad level's "
        "(torchlevels/grad_shortcuts.py). Also the gradient of the mean square of the "
        "block's output, for one sequence and per sequence, and PyTorch's fused attention "
        "(`F.scaled_dot_product_attention`, causal) on each sequence's (4, 32, 16) query, "
        "key and value, where torch.func loops over the examples. No target.",
        attention_group,
    ),
    "cnn": Group(
        "CNN forward",
        "conv 1->16 3x3, relu, maxpool 2, conv 16->32 3x3, relu, maxpool 2, flatten, linear "
        "800->10, unbatched weights, vmapped over a batch of 32 examples of shape "
        "(1, 28, 28). Target: ratio <= 1.1.",
        cnn_group,
    ),
    "max_pool": Group(
        "Max pool layout",
        "The max pool inside vmap's batching rules and shortcuts (torchlevels/batching/"
        "max_pool.py): vmap folds the batch into N of a contiguous `[N, C, *spatial]` "
        "input; on the CPU, from 4 channels up (8 for 16-bit floats), torchlevels runs the "
        "max pool on a channels-last copy of it, where PyTorch's kernel is vectorised "
        "over channels, and copies the outputs back to the contiguous layout. Anchor: "
        "PyTorch's `max_pool{2,3}d_with_indices` of the same contiguous input (ratio = "
        "torchlevels / PyTorch); values and indices are equal. This is what makes the CNN "
        "rows faster than torch.func and than the hand-batched call: their columns "
        "'torchlevels, contiguous max pool' show them without it. No target.",
        max_pool_group,
        ("PyTorch (contiguous)", "torchlevels (channels-last)"),
    ),
    "calls": Group(
        "Everyday calls",
        "One call per `vmap` call, on 16 examples of shape (8, 32) (and on (32,) rows for "
        "`outer`): each time includes the vmap call itself (about 30 us either way). These "
        "calls are answered in vmap's `__torch_function__` (torchlevels/batching/"
        "shortcuts.py); through the dispatcher, `cosine_similarity` is ten ops and `outer` "
        "two. No target.",
        calls_group,
    ),
    "grad_overhead": Group(
        "Grad overhead",
        "`vmap(grad(loss))` of a chain of 60 small pointwise ops (the ops of the per-op "
        "overhead group) summed to a scalar, over 8 examples of shape (16,): the Python cost "
        "of an op passing a grad level and a vmap level, forward and backward. References: "
        "one batched `torch.autograd.grad` (the examples are independent), and a Python loop "
        "over the examples. Target: ratio <= 1.2.",
        grad_overhead_group,
    ),
    "mlp_grad": Group(
        "MLP per-sample gradients",
        "Per-sample gradients of the cross-entropy loss of an `nn.Sequential` MLP "
        "784-256-256-10 (ReLU) with respect to all its parameters, batch 64: "
        "`vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)` where `loss` runs the "
        "module with `functional_call` on one example. References: a Python loop of "
        "`torch.autograd.grad` per example, and Opacus' `GradSampleModule`. "
        "Target: ratio <= 1.2.",
        mlp_grad_group,
    ),
    "cnn_grad": Group(
        "CNN per-sample gradients",
        "Per-sample gradients, as for the MLP, of the CNN of the CNN forward group as an "
        "`nn.Sequential` (conv 1->16 3x3, relu, maxpool 2, conv 16->32 3x3, relu, "
        "maxpool 2, flatten, linear 800->10), batch 32 of (1, 28, 28). References: the "
        "Python loop and Opacus. Target: ratio <= 1.2.",
        cnn_grad_group,
    ),
    "norm_grad": Group(
        "Norm per-sample gradients",
        "Per-sample gradients, as for the MLP, of (1) LayerNorm(32), linear 32->64, GELU, "
        "LayerNorm(64), flatten, linear 512->10 on examples of shape (8, 32), batch 64, "
        "and (2) the CNN of the CNN forward group with a GroupNorm after each conv "
        "(4 and 8 groups), batch 32. The norms' backwards have batching rules of their own "
        "(torchlevels/batching/nn.py). References: the Python loop and Opacus. "
        "Target: ratio <= 1.2.",
        norm_grad_group,
    ),
    "regression_grad": Group(
        "Small-model per-sample gradients",
        "Per-sample gradients, as for the MLP, of a small regression MLP (linear 16->32, "
        "Hardswish, linear 32->32, Hardswish, linear 32->4) under the mean squared error "
        "and the Huber loss, batch 64: about 40 small ops per call, so the cost of each op "
        "passing the levels in Python dominates, as in the grad overhead group. The "
        "losses' backwards and Hardswish have batching rules of their own. References: the "
        "Python loop and Opacus. No target.",
        regression_grad_group,
    ),
    "forward": Group(
        "Forward mode",
        "`jacfwd` of a small MLP (linear 16->64, tanh, scaled and shifted by numbers, "
        "linear 64->8, tanh) for one example and under `vmap` for 64, and `jvp` of the "
        "60-op pointwise chain of the grad overhead group, alone and under `vmap` for 16 "
        "examples, each with its own tangent (where the jvp level runs a pointwise op "
        "once on the physical duals, torchlevels/jvp_over_vmap.py). The weights, biases and the "
        "chain's second operand are captured, so they have no tangent: forward AD gives "
        "them a ZeroTensor one, whose arithmetic finds its result's shape through "
        "PyTorch's Python references (100-300 us an op). torchlevels' jvp level runs "
        "arithmetic with a number as its Scalar overload and a sum with a captured tensor "
        "with an explicit zero tangent (torchlevels/autodiff.py, `_without_zero_tangents`); "
        "a product with a captured tensor (the chain's `mul` and `maximum`) still takes "
        "PyTorch's path, except on the physical duals, where it has an explicit zero "
        "tangent too. Reference: plain forward AD (`torch.autograd.forward_ad`), the MLP's "
        "Jacobian columns as one batch of duals, and the chain's examples as one dual. "
        "No target.",
        forward_group,
    ),
    "hessian": Group(
        "Batched Hessians",
        "`vmap(hessian(f))` over 16 examples of shape (32,), with "
        "f(x) = x.tanh() @ (A @ x.sin()) + x.pow(2).sum(): torch.func's hessian is "
        "jacfwd(jacrev(f)), torchlevels' is jacrev(jacrev(f)) (the same blocks, see its "
        "docstring), so three transforms deep under vmap either way. References: the "
        "Hessians by hand with batched double backward (1 + 32 `torch.autograd.grad` calls "
        "over the whole batch), and a Python loop doing the same per example. "
        "Target: ratio <= 1.2.",
        hessian_group,
    ),
    "compiled": Group(
        "Compiled replay",
        "`torchlevels.compile(f)` (no backend: the `torch.fx` graph of plain aten ops that "
        "`trace` records through the levels, replayed from the cache) against torch.func "
        "eager on the four autodiff workloads above: per-sample gradients of the MLP and "
        "the CNN, `vmap(hessian)`, and `vmap(grad)` of the 60-op chain. Extra column: the "
        "same torchlevels composition eager. Target from the issue: at least 2x faster "
        "than torch.func eager on the chain (ratio <= 0.5), never slower elsewhere "
        "(ratio <= 1.0).",
        compiled_group,
        ("torch.func eager", "torchlevels.compile"),
    ),
    "inductor": Group(
        "Compiled with inductor",
        "`torchlevels.compile(f, backend=\"inductor\")` (the traced graph compiled by "
        "inductor's `compile_fx`; torchlevels' own cache guards the inputs) against "
        "`torch.compile(torch.func composition)` on the same four workloads; both compiled "
        "before timing. Target: ratio <= 1.1. On torch 2.13 `torch.compile` over "
        "`torch.func.vmap(torch.func.hessian(f))` fails (an INTERNAL ASSERT in "
        "`_fw_primal`, reached with autograd skipped under the tracing mode), so the "
        "`vmap(hessian)` row's anchor is `torch.compile` over "
        "`torch.func.vmap(torch.func.jacrev(torch.func.jacrev(f)))`, the same Hessian.",
        inductor_group,
        ("torch.compile(torch.func)", "torchlevels.compile inductor"),
    ),
    "dims": Group(
        "First-class dimensions (torchlevels.dim)",
        "Programs written with first-class dimensions (`torchlevels.dim`) against the same "
        "computation in plain PyTorch (the anchor: ratio = torchlevels.dim / plain): "
        "`(A[i, k] * B[k, j]).sum(k).order(i, j)` against `A @ B` at 512x512 and at "
        "64x64 (where the fixed cost of binding and ordering dims dominates); attention "
        "over K, Q, V of shape (8, 64, 256) (batch, channel, key/query; scores summed over "
        "channel, `softmax` over key, the result concatenated with Q) against "
        "`K.transpose(1, 2) @ Q`, `softmax` and `V @ a`; pixel shuffle of (8, 64, 32, 32) "
        "by 2 against `F.pixel_shuffle`; an embedding bag (indices (64, 32) into a "
        "10000x128 table, summed over the sequence) against `F.embedding_bag(mode=\"sum\")`. "
        "In torchlevels.dim a product summed over a shared dim runs as one mm or batched "
        "matmul, and a lookup summed over its ids as one `embedding_bag` (the full "
        "product or gather never exists). Reference: the same programs (one function taking "
        "the dims module) run with `functorch.dim`, the pure-Python port in torch 2.13. "
        "Targets from the issue: ratio <= 1.2 for the 512x512 matmul, <= 1.5 for "
        "attention; none for the others.",
        dims_group,
        ("plain PyTorch", "torchlevels.dim"),
    ),
    "tpch": Group(
        "Relational queries: TPC-H (torchlevels.relational)",
        "TPC-H Q1 (filter, group by two string keys, eight aggregates over 6M line items), "
        "Q3 (customer-orders-lineitem joins with filters, group by three keys, top 10) and "
        "Q6 (five filters, one sum) at scale factor 1, generated by `tpchgen-cli`. Each "
        "engine queries tables already in memory (load times below) and runs on both cores "
        "(torch with 2 threads here, unlike the other groups). The anchor is DuckDB running "
        "the SQL in `examples/tpch.py` (ratio = torchlevels / DuckDB); torchlevels runs the "
        "functions of `examples/tpch.py`; Polars and pandas run "
        "`benchmarks/tpch_reference.py`. Before timing, the numeric columns of every "
        "engine's result are checked against DuckDB's. In torchlevels, column ops record "
        "expressions; an aggregate over 1M+ rows runs its expression, the filter's mask "
        "and (for up to 16 groups) the group ids as one torch.compile'd kernel, compiled "
        "on the first call (the warm-up, not timed; the compile times are in the note "
        "below); joins look keys up in a position table. Target from the issue: ratio "
        "<= 1.5 on each, faster than Polars and pandas.",
        tpch_group,
        ("DuckDB", "torchlevels"),
        threads=2,
    ),
}
