"""Property tests: random compositions of transforms over random small functions.

Hypothesis draws a function (a chain of one to three ops from :data:`OPS`, on an input
of a small random shape, with captured tensors drawn from a seed), a chain of one to
three transforms (vmap with random in_dims/out_dims, grad, jvp, vjp, jacrev, jacfwd)
and an input, then runs the composition with torchlevels and with torch.func. Only
disagreements fail: a case torch.func itself rejects (raises on, or gives a non-finite
result for) is skipped with ``assume``. Every choice is a drawn value, so a failure
shrinks to a minimal function, shape and chain; the falsifying example prints them.

``derandomize=True`` and bounded ``max_examples`` keep CI deterministic and short.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.func as ft
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from vmap_reference import seeded

import torchlevels as tl

DTYPE = torch.float64
SETTINGS = settings(
    max_examples=300, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
MAX_JACOBIAN_NUMEL = 48  # inputs bigger than this are not differentiated by jacrev/jacfwd

# -- the pool of ops: each maps a tensor of the base shape to one of the same shape ------

UNARY: dict[str, Callable] = {
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "square": lambda x: x * x,
    "abs": torch.abs,
    "detach_mul": lambda x: x * x.detach().cos(),  # a gradient stop inside
    # complex intermediates: their backward formulas multiply by conj views
    "complex_mul": lambda x: (torch.complex(x, x.sin()) * torch.complex(x.cos(), x)).real,
}
BINARY: dict[str, Callable] = {
    "mul": torch.mul,
    "add": torch.add,
    "sub": lambda x, c: c - x,
    "div": lambda x, c: x / (1 + c * c),
    "pow": lambda x, c: (x * x + 1) ** c,
}
INPLACE = ("mul_", "narrow_write", "transpose_write", "unsqueeze_write")
VIEWS = ("flatten", "transpose", "expand", "select_stack", "narrow_cat")
FINAL: dict[str, Callable] = {
    "none": lambda x: x,
    "sum": lambda x: x.sum(),
    "mean0": lambda x: x.mean(0),
    "logsumexp": lambda x: torch.logsumexp(x, 0),
}


@dataclass(frozen=True)
class Op:
    """One op of a drawn function; ``dim`` and ``index`` are used by the ops that need them."""

    kind: str  # unary, binary, reduce, matmul, softmax, index, inplace, view
    name: str = ""
    dim: int = 0
    index: tuple[int, ...] = ()

    def build(self, shape: tuple[int, ...], gen: torch.Generator,
              in_place_views: bool = True) -> Callable:
        """The op as a function; with ``in_place_views`` False, an in-place view op
        (``transpose_``) is its out-of-place view op, for torch.func: PyTorch's forward AD
        gets writes through a view changed in place wrong."""
        if self.kind == "inplace":
            return self._in_place(shape, gen, in_place_views)
        if self.kind == "view":
            return self._view(shape)
        if self.kind == "unary":
            return UNARY[self.name]
        if self.kind == "binary":
            c = torch.randn(shape[self.dim:], dtype=DTYPE, generator=gen)  # broadcast
            return lambda x: BINARY[self.name](x, c)
        if self.kind == "reduce":
            if self.name == "sum":
                return lambda x: x * x.sum(self.dim, keepdim=True)
            return lambda x: x - x.mean(self.dim, keepdim=True)
        if self.kind == "matmul":
            m = torch.randn(shape[-1], shape[-1], dtype=DTYPE, generator=gen) / shape[-1]
            return lambda x: x @ m
        if self.kind == "softmax":
            return lambda x: torch.softmax(x, self.dim)
        if self.kind == "index":
            key = (slice(None),) * self.dim + (torch.tensor(self.index),)
            return lambda x: x[key]
        raise AssertionError(self.kind)

    def _view(self, shape) -> Callable:
        d, n = self.dim, shape[self.dim]
        if self.name == "flatten":
            return lambda x: x.reshape(-1).cos().reshape(x.shape)
        if self.name == "transpose":
            return lambda x: (x.transpose(0, -1) * 2).transpose(0, -1)
        if self.name == "expand":
            return lambda x: x.unsqueeze(0).expand(2, *x.shape).sum(0)
        if self.name == "select_stack":
            return lambda x: torch.stack([x.select(d, i).sin() for i in range(n)], d)
        return lambda x: torch.cat([x.narrow(d, 1, n - 1), x.narrow(d, 0, 1)], d)  # narrow_cat

    def _in_place(self, shape, gen, in_place_views: bool) -> Callable:
        d = self.dim
        if self.name == "mul_":
            c = torch.randn(shape[d:], dtype=DTYPE, generator=gen)
            return lambda x: x.clone().mul_(c)

        def view_op(v, name, *args):
            return getattr(v, name + "_" if in_place_views else name)(*args)

        def f(x):
            y = x.clone()
            if self.name == "narrow_write":
                y.narrow(d, 0, 1).add_(x.narrow(d, shape[d] - 1, 1).sin())
            elif self.name == "transpose_write":
                view_op(y[...], "transpose", 0, -1).mul_(x.transpose(0, -1).cos())
            else:  # unsqueeze_write
                view_op(y.narrow(d, 0, 1), "unsqueeze", 0).add_(x.narrow(d, 0, 1).exp())
            return y

        return f


@st.composite
def ops(draw, shape: tuple[int, ...]) -> Op:
    kind = draw(st.sampled_from(
        ["unary", "binary", "reduce", "matmul", "softmax", "index", "inplace", "view"]))
    dim = draw(st.integers(0, len(shape) - 1))
    if kind == "inplace":
        return Op(kind, draw(st.sampled_from(INPLACE)), dim)
    if kind == "view":
        return Op(kind, draw(st.sampled_from(VIEWS)), dim)
    if kind == "unary":
        return Op(kind, draw(st.sampled_from(sorted(UNARY))))
    if kind == "binary":
        return Op(kind, draw(st.sampled_from(sorted(BINARY))), dim)
    if kind == "reduce":
        return Op(kind, draw(st.sampled_from(["sum", "mean"])), dim)
    if kind == "index":
        size = shape[dim]
        return Op(kind, dim=dim, index=tuple(draw(
            st.lists(st.integers(0, size - 1), min_size=size, max_size=size))))
    return Op(kind, dim=dim)


@dataclass(frozen=True)
class Program:
    """A drawn function of one tensor of shape ``shape``, and the seed of its constants."""

    shape: tuple[int, ...]
    ops: tuple[Op, ...]
    final: str
    seed: int

    def build(self, in_place_views: bool = True) -> Callable:
        gen = seeded(self.seed)
        steps = [op.build(self.shape, gen, in_place_views) for op in self.ops]
        final = FINAL[self.final]

        def f(x):
            for step in steps:
                x = step(x)
            return final(x)

        return f


@st.composite
def programs(draw) -> Program:
    shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    body = tuple(draw(st.lists(ops(shape), min_size=1, max_size=3)))
    final = draw(st.sampled_from(list(FINAL)))
    return Program(shape, body, final, draw(st.integers(0, 2 ** 16)))


# -- transforms: how to apply each to a function of one tensor, for either library ------

@dataclass(frozen=True)
class Transform:
    name: str  # vmap, grad, jvp, vjp, jacrev, jacfwd
    in_dim: int = 0
    out_dim: int = 0
    size: int = 0  # vmap's batch size

    def apply(self, lib, f: Callable) -> Callable:
        if self.name == "vmap":
            return lib.vmap(f, in_dims=self.in_dim, out_dims=self.out_dim)
        if self.name == "grad":
            return lib.grad(lambda x: f(x).sum())
        if self.name == "jvp":
            return lambda x: lib.jvp(f, (x,), (_tangent(x),))[1]
        if self.name == "vjp":
            def vjp_ones(x):
                out, vjp_fn = lib.vjp(f, x)
                return vjp_fn(torch.ones_like(out))[0]

            return vjp_ones
        return getattr(lib, self.name)(f)

    def __repr__(self) -> str:
        if self.name == "vmap":
            return f"vmap(in_dims={self.in_dim}, out_dims={self.out_dim}, size={self.size})"
        return self.name


def _tangent(x: torch.Tensor) -> torch.Tensor:
    # not all ones, so a tangent mixed up with another one shows; same recipe for both libs
    return torch.ones_like(x) * 0.5 + x * 0.25


@st.composite
def chains(draw, shape: tuple[int, ...]) -> tuple[tuple[Transform, ...], tuple[int, ...]]:
    """Transforms, outermost first, and the shape of the outermost input."""
    names = draw(st.lists(st.sampled_from(["vmap", "grad", "jvp", "vjp", "jacrev", "jacfwd"]),
                          min_size=1, max_size=3))
    inner_first = []
    for name in reversed(names):
        if name == "vmap":
            rank = len(shape) + 1
            in_dim = draw(st.integers(-rank, rank - 1))
            size = draw(st.integers(1, 3))
            pos = in_dim % rank
            shape = shape[:pos] + (size,) + shape[pos:]
            inner_first.append(Transform(name, in_dim, draw(st.sampled_from([0, -1])), size))
        else:
            if name in ("jacrev", "jacfwd"):
                assume(_numel(shape) <= MAX_JACOBIAN_NUMEL)
            inner_first.append(Transform(name))
    return tuple(reversed(inner_first)), shape


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def compose(lib, chain: tuple[Transform, ...], f: Callable) -> Callable:
    for t in reversed(chain):
        f = t.apply(lib, f)
    return f


def torch_func_result(chain, f, x):
    """torch.func's answer, or ``assume(False)`` where it rejects the case."""
    try:
        expected = compose(ft, chain, f)(x)
    except Exception:
        assume(False)
    assume_sane(expected)
    return expected


def assume_sane(expected: torch.Tensor) -> None:
    """Skip cases where torch.func's answer is non-finite or has a garbage shape (seen:
    vmap(grad(grad(abs)), out_dims=-1) gives a dim of size 34359738369)."""
    assume(expected.numel() <= 10 ** 6)
    assume(bool(torch.isfinite(expected).all()))


@st.composite
def cases(draw):
    program = draw(programs())
    chain, shape = draw(chains(program.shape))
    gen = seeded(program.seed)
    x = torch.randn(shape, dtype=DTYPE, generator=gen)
    return program, chain, x * 0.8


@SETTINGS
@given(cases())
def test_composition_matches_torch_func(case):
    program, chain, x = case
    expected = torch_func_result(chain, program.build(in_place_views=False), x)
    actual = compose(tl, chain, program.build())(x)
    assert type(actual) is torch.Tensor, type(actual)
    torch.testing.assert_close(actual, expected)


@settings(SETTINGS, max_examples=80)
@given(programs(), st.data())
def test_vmap_of_transform_with_unbatched_argument(program, data):
    """vmap over two arguments with random in_dims (one may be None) of a transform of
    ``f(x) * y``-style functions: the second argument is captured by the inner transform."""
    transform = data.draw(st.sampled_from(["grad", "jvp", "vjp", "jacrev", "jacfwd"]))
    rank = len(program.shape) + 1
    dx = data.draw(st.integers(-rank, rank - 1))
    dy = data.draw(st.one_of(st.none(), st.integers(-rank, rank - 1)))
    size = data.draw(st.integers(1, 3))
    gen = seeded(program.seed)

    def batched(d):
        shape = list(program.shape)
        if d is not None:
            shape.insert(d % rank, size)
        return torch.randn(shape, dtype=DTYPE, generator=gen)

    x, y = batched(dx), batched(dy)
    inner = Transform(transform)

    def run(lib):
        f = program.build(in_place_views=lib is tl)

        def per_example(a, b):
            return inner.apply(lib, lambda t: f(t * b.cos()) + (t * b).sum())(a)

        return lib.vmap(per_example, in_dims=(dx, dy))(x, y)

    try:
        expected = run(ft)
    except Exception:
        assume(False)
    assume_sane(expected)
    torch.testing.assert_close(run(tl), expected)


@settings(SETTINGS, max_examples=120)
@given(cases())
def test_autograd_outside_a_composition_matches_torch_func(case):
    """Autograd on top of a random composition: its input and a tensor the function
    captures require grad outside, and the gradients of a weighted sum of the result
    with respect to both agree with torch.func's (no history counts as zero)."""
    program, chain, x0 = case
    _check_with_autograd_outside(program, chain, x0, lambda f: compose(tl, chain, f))


def _check_with_autograd_outside(program: Program, chain: tuple[Transform, ...],
                                 x0: torch.Tensor, ours: Callable) -> None:
    """``ours(f)`` against torch.func's ``chain`` of ``f``, both with autograd outside."""
    try:
        expected = _with_autograd_outside(ft, program, x0, lambda f: compose(ft, chain, f))
    except Exception:
        assume(False)
    for t in expected:
        assume_sane(t)
    torch.testing.assert_close(_with_autograd_outside(tl, program, x0, ours), expected)


def _with_autograd_outside(lib, program: Program, x0: torch.Tensor, composed: Callable
                           ) -> tuple:
    """``composed(f)(x)`` for the drawn ``f`` of ``t * c.cos()``, with ``x`` and the
    captured ``c`` requiring grad, and the gradients of a weighted sum of it in both."""
    c0 = torch.randn(program.shape, dtype=DTYPE, generator=seeded(program.seed + 1))
    x, c = x0.clone().requires_grad_(), c0.clone().requires_grad_()
    f = program.build(in_place_views=lib is tl)
    out = composed(lambda t: f(t * c.cos()))(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=DTYPE).view(out.shape)
    if not out.requires_grad:
        return out.detach(), torch.zeros_like(x), torch.zeros_like(c)
    grads = torch.autograd.grad((out * weights).sum(), (x, c), allow_unused=True)
    return out.detach(), *(torch.zeros_like(t) if g is None else g
                           for g, t in zip(grads, (x, c)))


# -- tools (levels too) anywhere in a composition change nothing --------------------------

TOOLS: dict[str, Callable] = {
    "count_flops": tl.count_flops,
    "log_ops": lambda f: tl.log_ops(f, file=io.StringIO()),
    "compile": tl.compile,  # (outside every transform only: it traces from there)
}


@st.composite
def tool_cases(draw):
    """A case and where tools go: at position ``i`` a tool wraps what ``chain[i]``
    transforms (``len(chain)``: the function itself)."""
    program, chain, x = draw(cases())
    where = draw(st.lists(st.integers(0, len(chain)), min_size=1, max_size=2, unique=True))
    tools = {i: draw(st.sampled_from(list(TOOLS) if i == 0 else ["count_flops", "log_ops"]))
             for i in where}
    return program, chain, x, tools


def compose_with_tools(chain: tuple[Transform, ...], tools: dict[int, str], f: Callable
                       ) -> Callable:
    f = TOOLS[tools[len(chain)]](f) if len(chain) in tools else f
    for i in reversed(range(len(chain))):
        f = chain[i].apply(tl, f)
        f = TOOLS[tools[i]](f) if i in tools else f
    return f


@settings(SETTINGS, max_examples=100)
@given(tool_cases())
def test_tools_anywhere_in_a_composition_change_nothing(case):
    """count_flops, log_ops and compile at random places in a random composition, with
    autograd outside: values and outer gradients are torch.func's without the tools."""
    program, chain, x0, tools = case
    _check_with_autograd_outside(program, chain, x0,
                                 lambda f: compose_with_tools(chain, tools, f))
