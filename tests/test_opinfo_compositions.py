"""Compositions of transforms over PyTorch's OpInfo database, against references.

For every OpInfo that supports autograd, the first float64 CPU samples. The forward
OpInfo sweep (test_opinfo_vmap.py) and the single-transform sweep
(test_opinfo_autodiff.py) do not reach the batching rules of backward kernels nor
forward AD run over another level; these do. Four tests:

- Per-example gradients: ``vmap(grad)`` of a weighted sum of the op's outputs over a
  batch of three perturbed copies of the sample's differentiated inputs, and ``grad`` of
  its sum over a ``vmap``, against torch.autograd in a Python loop (they found cdist's
  backward failing when an example's own batch dims differ in rank, and batching rules
  whose pieces differentiate unlike the op).
- Per-example Hessian-vector products: ``vmap(jvp(grad))`` over the first three samples
  against torch.func's ``jvp(grad)`` of each example (it found backward formulas whose
  shortcuts were taken when they must not be).
- Second-order Jacobians through forward mode: ``jacrev(jacfwd)``, ``jacfwd(jacfwd)``
  and ``jacfwd(jacrev)`` of the weighted sum in the first differentiated input (samples
  of at most 12 elements), against plain autograd's double backward (it found an
  in-place op under no_grad cutting history, ZeroTensor tangents reaching vmap's rules,
  and layer_norm's batched backward reading its saved statistics as constants).
- Jacobians with autograd outside: ``jacrev`` in one argument (float64 and complex128)
  while autograd outside tracks the others, which the function captures, against plain
  autograd's backward passes recorded with create_graph (it found complex linalg.solve's
  backward losing the graph outside to a conj view).

Each checks two things per sample: wherever torch.func matches the reference,
torchlevels does too; wherever torchlevels runs, it matches (the reference, or torch.func
where the two references legitimately differ): no silently wrong number. Random ops are
left out (a loop reseeded per example is no reference for one batched draw).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import pytest
import torch
import torch.func as tf
from opinfo_harness import _RandomOpSpy
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_unflatten
from vmap_reference import seeded

import torchlevels as tl

pytestmark = pytest.mark.cpu_only("an OpInfo sweep, whose samples and counts are the CPU's")

BATCH = 3
SAMPLES = 12
HVP_SAMPLES = 3
MAX_NUMEL = 2000


def _weighted_sum(out) -> torch.Tensor:
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
            and o.is_floating_point()]
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum()
               for o in outs)


def _samples(supported: str, count: int):
    """(name, index, the weighted sum as a function of the differentiated inputs, those
    inputs) for the first ``count`` samples of each OpInfo with ``supported`` set."""
    for op in op_db:
        if not getattr(op, supported) or torch.float64 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=True))
        except Exception:  # an OpInfo that cannot make samples here
            continue
        for index, sample in enumerate(samples[:count]):
            flat, spec = tree_flatten((sample.input, sample.args))
            diff = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
                    and t.requires_grad and t.is_floating_point() and t.numel() < MAX_NUMEL]
            if not diff:
                continue

            def f(*xs, flat=flat, spec=spec, diff=diff, sample=sample, op=op):
                leaves = list(flat)
                for i, x in zip(diff, xs):
                    leaves[i] = x
                inp, args = tree_unflatten(leaves, spec)
                return _weighted_sum(sample.output_process_fn_grad(op(inp, *args, **sample.kwargs)))

            name = f"{op.name}.{op.variant_test_name} sample {index}"
            yield name, index, f, [flat[i] for i in diff]


def _cases(forward_over_reverse: bool = False):
    """(name, function of the differentiated inputs, their batched copies) per sample."""
    supported = "supports_fwgrad_bwgrad" if forward_over_reverse else "supports_autograd"
    count = HVP_SAMPLES if forward_over_reverse else SAMPLES
    for name, index, f, inputs in _samples(supported, count):
        gen = seeded(index)
        batched = [torch.stack([x.detach() + 0.01 * k * torch.randn(
            x.shape, generator=gen, dtype=x.dtype) for k in range(BATCH)]) for x in inputs]
        yield name, f, batched


def _loop(f, batched) -> list | None:
    rows = []
    with _RandomOpSpy() as spy:
        for k in range(BATCH):
            xs = [b[k].clone().requires_grad_() for b in batched]
            grads = torch.autograd.grad(f(*xs), xs, allow_unused=True)
            rows.append([torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)])
    if spy.random:
        return None
    return [torch.stack(column) for column in zip(*rows)]


def _per_example(lib, order: str, f, n: int):
    """Per-example gradients by ``vmap(grad)``, or by ``grad`` of the sum over a ``vmap``
    (each example's gradient too, since examples do not interact)."""
    argnums = tuple(range(n))
    if order == "vmap(grad)":
        return lib.vmap(lib.grad(f, argnums=argnums))
    return lib.grad(lambda *xs: lib.vmap(f)(*xs).sum(), argnums=argnums)


def _matches(lib, order: str, f, batched, expected) -> bool | None:
    """Whether lib's per-example gradients match the loop; None when it raises."""
    try:
        got = _per_example(lib, order, f, len(batched))(*batched)
    except Exception:
        return None
    return all(torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
               for g, e in zip(got, expected))


# torch.autograd's derivative of as_strided_scatter in its input is wrong (it fails
# gradcheck; tests/test_rules_core.py checks both that and that torchlevels' batching
# rule differentiates right), so grad(vmap) cannot match the loop there.
AUTOGRAD_WRONG = ("as_strided_scatter.",)


@pytest.mark.parametrize("order", ["vmap(grad)", "grad(vmap)"])
def test_per_example_gradients_of_every_opinfo_match_a_loop(order):
    """``grad(vmap)`` differentiates the batching rules themselves: a rule's pieces must
    differentiate as the op does (``_safe_softmax`` of a fully masked row gave NaN, a
    per-example ``index_fill`` value counted a repeated index twice)."""
    warnings.simplefilter("ignore")
    behind, wrong, checked = [], [], 0
    for name, f, batched in _cases():
        if order == "grad(vmap)" and name.startswith(AUTOGRAD_WRONG):
            continue
        try:
            expected = _loop(f, batched)
        except Exception:  # the op rejects its perturbed sample: nothing to compare
            continue
        if expected is None:
            continue
        checked += 1
        ours = _matches(tl, order, f, batched, expected)
        if ours is False:
            wrong.append(name)
        elif ours is None and _matches(tf, order, f, batched, expected):
            behind.append(name)
    assert checked > 500  # the sweep did run
    assert not wrong, f"wrong per-example gradients: {wrong}"
    assert not behind, f"torch.func gets these right and torchlevels raises: {behind}"


def _tangents(xs) -> tuple:
    return tuple(x.cos() for x in xs)


def _hvp(lib, f, n: int):
    """Forward over reverse: the Hessian-vector product of ``f`` along fixed tangents."""
    return lambda *xs: lib.jvp(lib.grad(f, argnums=tuple(range(n))), xs, _tangents(xs))[1]


# torch.func's product is wrong here (forward mode over triangular_solve's backward reads
# the whole matrix); torchlevels' matches finite differences, checked in
# test_compositions.py::test_second_derivatives_through_linalg_ops
TORCH_FUNC_HVP_WRONG = ("triangular_solve.",)


def test_per_example_hessian_vector_products_of_every_opinfo_match_torch_func():
    """vmap(jvp(grad)) over the first samples against torch.func's jvp(grad) of each
    example: backward formulas that take a shortcut unless their pass is recorded
    (linalg.solve's LU factors) gave wrong products here."""
    warnings.simplefilter("ignore")
    behind, wrong, checked = [], [], 0
    for name, f, batched in _cases(forward_over_reverse=True):
        if name.startswith(TORCH_FUNC_HVP_WRONG):
            continue
        n = len(batched)
        try:
            with _RandomOpSpy() as spy:
                rows = [_hvp(tf, f, n)(*(b[k] for b in batched)) for k in range(BATCH)]
        except Exception:  # torch.func cannot take this example: no reference
            continue
        if spy.random:
            continue
        expected = [torch.stack(column) for column in zip(*rows)]
        checked += 1
        try:
            got = tl.vmap(_hvp(tl, f, n))(*batched)
        except Exception:
            try:
                tf.vmap(_hvp(tf, f, n))(*batched)
            except Exception:
                continue
            behind.append(name)
            continue
        if not all(torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
                   for g, e in zip(got, expected)):
            wrong.append(name)
    assert checked > 300
    assert not wrong, f"wrong per-example Hessian-vector products: {wrong}"
    assert not behind, f"torch.func's vmap runs these and torchlevels raises: {behind}"


SECOND_ORDER = {  # name: (outer, inner)
    "jacrev(jacfwd)": ("jacrev", "jacfwd"),
    "jacfwd(jacfwd)": ("jacfwd", "jacfwd"),
    "jacfwd(jacrev)": ("jacfwd", "jacrev"),
}
SECOND_ORDER_SCAN = 6  # look this far for a small sample of each op ...
SECOND_ORDER_NUMEL = 12  # ... whose first differentiated input has at most this many elements


def _first_input_only(f, rest: list, x: torch.Tensor) -> torch.Tensor:
    return f(x, *rest)


def _second_order(lib, composition: str, f, x) -> torch.Tensor | None:
    """``lib``'s Hessian of ``f`` at ``x`` by ``composition``; None if it raises. (No
    dispatch mode here: torch.func's jacrev(jacfwd) of addmm under one crashes.)"""
    outer, inner = SECOND_ORDER[composition]
    try:
        return getattr(lib, outer)(getattr(lib, inner)(f))(x)
    except Exception:
        return None


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is not None and b is not None and a.shape == b.shape
            and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))


@pytest.mark.parametrize("composition", list(SECOND_ORDER))
def test_second_order_jacobians_of_every_opinfo_match_autograd(composition):
    """The Hessian of the weighted sum in the first differentiated input, one small sample
    per op, against plain autograd's double backward. Where the two orders of
    differentiation legitimately differ (a point that is not twice differentiable),
    torch.func's number for the same composition is accepted too."""
    warnings.simplefilter("ignore")
    behind, wrong, checked, done = [], [], 0, set()
    for name, _, f, inputs in _samples("supports_forward_ad", SECOND_ORDER_SCAN):
        op = name.split(" ")[0]
        x = inputs[0].detach()
        if op in done or not 0 < x.numel() <= SECOND_ORDER_NUMEL:
            continue
        g = functools.partial(_first_input_only, f, inputs[1:])
        try:
            with _RandomOpSpy() as spy:
                expected = torch.autograd.functional.hessian(g, x)
        except Exception:  # the op has no double backward here: no reference
            continue
        if spy.random:
            continue
        done.add(op)
        checked += 1
        ours, theirs = _second_order(tl, composition, g, x), _second_order(tf, composition, g, x)
        if ours is None:
            if _close(theirs, expected):
                behind.append(name)
        elif not (_close(ours, expected) or _close(ours, theirs)):
            wrong.append(name)
    assert checked > 250
    assert not wrong, f"wrong {composition}: {wrong}"
    assert not behind, f"torch.func gets these right and torchlevels raises: {behind}"


CAPTURED_SAMPLES = 3
CAPTURED_NUMEL = 30  # elements of each argument, and of the output


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


@dataclasses.dataclass
class _Captured:
    """An op's sample with argument ``var`` differentiated and arguments ``captured``
    captured; real numbers in and out (complex ones as pairs)."""

    op: object
    sample: object
    leaves: list
    var: int
    captured: list[int]

    def function(self, tracked: list[torch.Tensor]):
        """The op's first output of the sample's dtype in argument ``var``, with the
        ``tracked`` tensors for the captured arguments."""

        def f(xr):
            args = list(self.leaves)
            args[self.var] = torch.view_as_complex(xr) if xr.dtype != self.dtype else xr
            for i, t in zip(self.captured, tracked):
                args[i] = t
            outs = [o for o in tree_flatten(self.op(*args, **self.sample.kwargs))[0]
                    if isinstance(o, torch.Tensor) and o.dtype == self.dtype]
            return _real(outs[0])

        return f

    @property
    def dtype(self) -> torch.dtype:
        return self.leaves[self.var].dtype


def _captured_cases(dtype: torch.dtype):
    """(name, case) for the first samples of each OpInfo, each of its first two
    ``dtype`` arguments in turn the one differentiated, the other ``dtype`` ones
    captured."""
    for op in op_db:
        if not op.supports_autograd or dtype not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(itertools.islice(op.sample_inputs("cpu", dtype), CAPTURED_SAMPLES))
        except Exception:  # an OpInfo that cannot make samples here
            continue
        for index, sample in enumerate(samples):
            leaves = [sample.input, *sample.args]
            ours = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)
                    and a.dtype == dtype and 0 < a.numel() <= CAPTURED_NUMEL]
            for var in ours[:2]:
                captured = [i for i in ours if i != var]
                if captured:
                    yield (f"{op.name}.{op.variant_test_name} sample {index} argument {var}",
                           _Captured(op, sample, leaves, var, captured))


def _rows(case: _Captured, jacobian) -> tuple[torch.Tensor, tuple]:
    """The Jacobian rows of ``case`` by ``jacobian(f, x)``, and the gradient of a
    nonlinear function of them in each captured tensor (zeros where they do not depend
    on it: a lost graph shows as zeros)."""
    tracked = [case.leaves[i].detach().clone().requires_grad_() for i in case.captured]
    rows = jacobian(case.function(tracked), _real(case.leaves[case.var]).detach())
    if not rows.requires_grad:
        return rows, tuple(torch.zeros_like(t) for t in tracked)
    return rows.detach(), torch.autograd.grad((rows * rows.cos()).sum(), tracked,
                                              allow_unused=True, materialize_grads=True)


def _by_autograd(f, x: torch.Tensor) -> torch.Tensor:
    """Jacobian rows by plain autograd, one backward pass per output element, recorded
    for autograd outside."""
    x = x.clone().requires_grad_()
    out = f(x)
    if out.numel() > CAPTURED_NUMEL:
        raise ValueError("too many rows")
    return torch.stack([torch.autograd.grad(out, x, row.view(out.shape), create_graph=True,
                                            allow_unused=True, materialize_grads=True)[0]
                        for row in torch.eye(out.numel(), dtype=out.dtype)])


def _rows_or_none(case: _Captured, lib):
    """:func:`_rows` by ``lib.jacrev``, or None if it raises."""
    try:
        return _rows(case, lambda f, x: lib.jacrev(f)(x).flatten(0, -1 - x.dim()))
    except Exception:
        return None


def _agree(got, expected) -> bool:
    (rows, grads), (want_rows, want_grads) = got, expected
    return _close(rows, want_rows) and all(_close(g, w) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
def test_jacobians_of_every_opinfo_keep_the_graph_of_a_captured_tracked_argument(dtype):
    """``jacrev`` in one argument of each op while autograd outside tracks its other
    arguments, which the function captures: the Jacobian and the gradient of a function
    of it in those arguments, against plain autograd's backward passes recorded with
    create_graph, or torch.func's where the two differ legitimately. (Complex linalg.solve
    lost the graph outside: its backward solves with ``A.mH``, a conj view; torch.func's
    gradient of a layer norm's weight Jacobian in its input is wrong.)"""
    warnings.simplefilter("ignore")
    behind, wrong, checked = [], [], 0
    for name, case in _captured_cases(dtype):
        if name.startswith(AUTOGRAD_WRONG):
            continue
        try:
            with _RandomOpSpy() as spy:
                expected = _rows(case, _by_autograd)
        except Exception:  # no output of the dtype, too many, or no double backward
            continue
        if spy.random:
            continue
        checked += 1
        ours = _rows_or_none(case, tl)
        if ours is not None and _agree(ours, expected):
            continue
        theirs = _rows_or_none(case, tf)
        if ours is None:
            if theirs is not None and _agree(theirs, expected):
                behind.append(name)
        # (torch.func's answer is taken where the reference's is not one: complex lstsq,
        # pinv of singular matrices)
        elif theirs is None or not _agree(ours, theirs):
            wrong.append(name)
    assert checked > 150
    assert not wrong, f"wrong Jacobians or gradients outside: {wrong}"
    assert not behind, f"torch.func gets these right and torchlevels raises: {behind}"
