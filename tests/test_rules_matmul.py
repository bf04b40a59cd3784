"""The matmul family (torchlevels/batching/matmul.py) against torch.func.vmap and a loop.

Each check runs a function three ways on the same inputs: torchlevels' vmap,
torch.func.vmap, and a Python loop over the examples stacked with torch.stack. It fails
if any op fell to the slow per-example loop.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from vmap_reference import check_vmap, loop_reference, vmap_without_slow_loop

from torchlevels import grad, vmap
from torchlevels.batching import registry

aten = torch.ops.aten
B = 3


def batched(shape, dim, dtype=torch.float64):
    """A random tensor of logical ``shape`` with a batch of ``B`` at ``dim`` (None: none)."""
    if dim is None:
        return torch.randn(shape, dtype=dtype)
    x = torch.randn((B, *shape), dtype=dtype)
    return x.movedim(0, dim)


# vmap(f) == torch.func.vmap(f) == the loop, no slow loop; returns vmap(f)'s result
check = functools.partial(check_vmap, atol=1e-8, rtol=1e-6)


def dim_combos(ranks):
    """Every assignment of a batch dim (or None) to operands of ``ranks``, not all None."""
    choices = [[None, *range(r + 1)] for r in ranks]
    return [c for c in itertools.product(*choices) if any(d is not None for d in c)]


# -- the plain products ------------------------------------------------------------------


@pytest.mark.parametrize("dims", dim_combos((2, 2)))
def test_mm(dims):
    a, b = batched((4, 5), dims[0]), batched((5, 2), dims[1])
    check(torch.mm, a, b, in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((3, 3)))
def test_bmm(dims):
    a, b = batched((2, 4, 5), dims[0]), batched((2, 5, 3), dims[1])
    check(torch.bmm, a, b, in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((2, 1)))
def test_mv(dims):
    check(torch.mv, batched((4, 5), dims[0]), batched((5,), dims[1]), in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((1, 1)))
@pytest.mark.parametrize("op", [torch.dot, torch.vdot, torch.inner, torch.outer])
def test_vector_products(op, dims):
    check(op, batched((5,), dims[0]), batched((5,), dims[1]), in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((1, 1)))
def test_vdot_conjugates_complex(dims):
    a, b = batched((5,), dims[0], torch.complex128), batched((5,), dims[1], torch.complex128)
    got = check(torch.vdot, a, b, in_dims=dims)
    assert got.dtype == torch.complex128


@pytest.mark.parametrize("op", [torch.mm, torch.matmul])
@pytest.mark.cpu_only("CUDA has no integer matmul kernels")
def test_integer_matmul(op):
    a = torch.randint(-5, 5, (B, 3, 4))
    w = torch.randint(-5, 5, (4, 2))
    assert check(op, a, w, in_dims=(0, None)).dtype == torch.int64


@pytest.mark.parametrize("shapes", [((0, 5), (5, 2)), ((4, 0), (0, 2)), ((4, 5), (5, 0))],
                         ids=str)
@pytest.mark.parametrize("dims", [(0, None), (None, 0), (0, 0)])
def test_empty_matrices(shapes, dims):
    a, b = batched(shapes[0], dims[0]), batched(shapes[1], dims[1])
    check(torch.mm, a, b, in_dims=dims)
    check(torch.bmm, a.unsqueeze(-3), b.unsqueeze(-3), in_dims=dims)
    check(lambda s, a, b: torch.addmm(s, a, b), batched((shapes[1][1],), None), a, b,
          in_dims=(None, *dims))


# -- the fused add forms -----------------------------------------------------------------

SCALINGS = [{}, {"beta": 0.5, "alpha": 2.0}, {"beta": 0.0}]


@pytest.mark.parametrize("self_shape", [(), (3,), (1, 3), (4, 3)])
@pytest.mark.parametrize("dims", dim_combos((2, 2, 2)))
@pytest.mark.parametrize("scale", SCALINGS)
def test_addmm(self_shape, dims, scale):
    s = batched(self_shape, min(dims[0], len(self_shape)) if dims[0] is not None else None)
    sdim = None if dims[0] is None else min(dims[0], len(self_shape))
    a, b = batched((4, 5), dims[1]), batched((5, 3), dims[2])
    check(lambda s, a, b: torch.addmm(s, a, b, **scale), s, a, b, in_dims=(sdim, *dims[1:]))


def test_addmm_beta_zero_ignores_nan():
    s = torch.full((3,), float("nan"), dtype=torch.float64)
    a, w = batched((4, 5), 0), batched((5, 3), None)
    # torch.func.vmap propagates the NaN here, unlike torch.addmm itself: compare to the loop
    got = check(lambda s, a, w: torch.addmm(s, a, w, beta=0), s, a, w, in_dims=(None, 0, None),
                against_func=False)
    assert not got.isnan().any()


@pytest.mark.parametrize("self_shape", [(3,), (4, 3), (2, 4, 3)])
@pytest.mark.parametrize("dims", dim_combos((1, 3, 3)))
@pytest.mark.parametrize("scale", SCALINGS[:2])
def test_baddbmm(self_shape, dims, scale):
    sdim = None if dims[0] is None else min(dims[0], len(self_shape))
    s = batched(self_shape, sdim)
    a, b = batched((2, 4, 5), dims[1]), batched((2, 5, 3), dims[2])
    check(lambda s, a, b: torch.baddbmm(s, a, b, **scale), s, a, b, in_dims=(sdim, *dims[1:]))


@pytest.mark.parametrize("dims", dim_combos((2, 3, 3)))
@pytest.mark.parametrize("scale", SCALINGS[:2])
def test_addbmm(dims, scale):
    s = batched((4, 3), dims[0])
    a, b = batched((2, 4, 5), dims[1]), batched((2, 5, 3), dims[2])
    check(lambda s, a, b: torch.addbmm(s, a, b, **scale), s, a, b, in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((1, 2, 1)))
@pytest.mark.parametrize("scale", SCALINGS)
def test_addmv(dims, scale):
    s, a, v = batched((4,), dims[0]), batched((4, 5), dims[1]), batched((5,), dims[2])
    check(lambda s, a, v: torch.addmv(s, a, v, **scale), s, a, v, in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((2, 1, 1)))
@pytest.mark.parametrize("scale", SCALINGS)
def test_addr(dims, scale):
    s, u, v = batched((4, 5), dims[0]), batched((4,), dims[1]), batched((5,), dims[2])
    check(lambda s, u, v: torch.addr(s, u, v, **scale), s, u, v, in_dims=dims)


@pytest.mark.parametrize("dims", dim_combos((2, 1, 1)))
@pytest.mark.parametrize("beta, alpha", [(True, True), (False, True), (True, False)])
def test_boolean_addr(dims, beta, alpha):
    """``(beta and s) or (alpha and outer(u, v))`` (before: no rule)."""
    s, u, v = (batched(shape, d) > 0 for shape, d in zip(((4, 5), (4,), (5,)), dims))
    check(lambda s, u, v: torch.addr(s, u, v, beta=beta, alpha=alpha), s, u, v, in_dims=dims)


# -- composites that reach vmap as the ops above -------------------------------------------

MATMUL_SHAPES = [
    ((4, 5), (5, 3)), ((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,)), ((2, 4, 5), (5, 3)),
    ((4, 5), (2, 5, 3)), ((2, 4, 5), (2, 5, 3)), ((2, 4, 5), (1, 5, 3)), ((5,), (2, 5, 3)),
    ((2, 4, 5), (5,)), ((2, 1, 4, 5), (3, 5, 2)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dims", [(0, None), (None, 0), (0, 0), (1, -1)])
def test_matmul(shapes, dims):
    dims = tuple(None if d is None else d % (len(s) + 1) for d, s in zip(dims, shapes))
    check(torch.matmul, batched(shapes[0], dims[0]), batched(shapes[1], dims[1]), in_dims=dims)


@pytest.mark.parametrize("x_shape", [(5,), (4, 5), (2, 4, 5)])
@pytest.mark.parametrize("dims", [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0),
                                  (1, None, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(x_shape, dims, bias):
    if dims[0] is not None:
        dims = (min(dims[0], len(x_shape)), *dims[1:])
    x, w = batched(x_shape, dims[0]), batched((3, 5), dims[1])
    if bias:
        b = batched((3,), dims[2])
        check(F.linear, x, w, b, in_dims=dims)
    elif dims[:2] != (None, None):
        check(F.linear, x, w, in_dims=dims[:2])


def test_einsum_tensordot_multi_dot():
    a, b, c = batched((4, 5), 0), batched((5, 3), None), batched((3, 2), 1)
    check(lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c), a, b, c, in_dims=(0, None, 1))
    check(lambda a, b: torch.tensordot(a, b, 1), a, b, in_dims=(0, None))
    check(lambda a, b, c: torch.linalg.multi_dot([a, b, c]), a, b, c, in_dims=(0, None, 1))
    check(lambda a, b: torch.einsum("bij,bjk->bik", a, b),
          batched((2, 4, 5), 0), batched((2, 5, 3), 2), in_dims=(0, 2))


# -- nesting, autograd, errors ---------------------------------------------------------------


@pytest.mark.parametrize("inner", [(0, None), (None, 0), (0, 0), (1, 1)])
@pytest.mark.parametrize("outer", [(0, None), (None, 0), (0, 0), (2, 1)])
def test_nested_mm(inner, outer):
    shapes = [(4, 5), (5, 3)]
    args = []
    for shape, di, do in zip(shapes, inner, outer):
        x = batched(shape, di)  # inner batch of B
        if do is not None:
            x = torch.stack([x + i for i in range(2)], do)  # outer batch of 2
        args.append(x)
    got = vmap(vmap(torch.mm, inner), outer)(*args)
    want = torch.func.vmap(torch.func.vmap(torch.mm, inner), outer)(*args)
    torch.testing.assert_close(got, want)
    looped = loop_reference(lambda *a: loop_reference(torch.mm, a, inner), args, outer)
    torch.testing.assert_close(got, looped)


@pytest.mark.parametrize("dims", [(0, None, None), (None, 0, None), (0, 0, 0)])
def test_linear_backward(dims):
    x, w, b = batched((5,), dims[0]), batched((3, 5), dims[1]), batched((3,), dims[2])
    for t in (x, w, b):
        t.requires_grad_()
    f = vmap(lambda x, w, b: torch.tanh(F.linear(x, w, b)), dims)
    grads = torch.autograd.grad(f(x, w, b).square().sum(), (x, w, b))
    g = torch.func.vmap(lambda x, w, b: torch.tanh(F.linear(x, w, b)), dims)
    want = torch.autograd.grad(g(x, w, b).square().sum(), (x, w, b))
    torch.testing.assert_close(grads, want)


@pytest.mark.parametrize("op,shapes", [
    (torch.mm, ((4,), (4, 3))), (torch.mm, ((2, 4), (4,))), (torch.bmm, ((4, 5), (2, 5, 3))),
    (torch.mv, ((4, 5), (4, 5))), (torch.dot, ((4, 5), (5,))),
])
def test_wrong_ranks_raise_like_torch(op, shapes):
    a, b = batched(shapes[0], 0), batched(shapes[1], None)
    with pytest.raises(RuntimeError):
        torch.func.vmap(op, (0, None))(a, b)
    with pytest.raises(RuntimeError):
        vmap(op, (0, None))(a, b)


# -- one kernel: the weight is never expanded or copied --------------------------------------


def kernels(f, *args):
    """Names of the aten ops that ran on plain tensors (not on vmap's wrappers)."""
    with torch.profiler.profile() as prof:
        f(*args)
    return [e.name for e in prof.events()]


@pytest.mark.parametrize("x_shape,op", [((5,), F.linear), ((4, 5), F.linear),
                                        ((4, 5), lambda x, w: x @ w.T)])
def test_batched_times_weight_is_one_mm(x_shape, op):
    x, w = batched(x_shape, 0, torch.float32), torch.randn(3, 5)
    names = kernels(vmap(op, (0, None)), x, w)
    assert "aten::bmm" not in names and "aten::baddbmm" not in names, names
    assert not {"aten::copy_", "aten::clone", "aten::contiguous"} & set(names), names
    # linear and matmul are caught before they decompose: one kernel on the plain tensors
    assert sum(n in ("aten::mm", "aten::addmm") for n in names) == 1, names


def test_weight_times_batched_columns_is_one_mm():
    w, x = torch.randn(3, 5), torch.randn(5, B, 4)  # the batch sits next to the columns
    names = kernels(vmap(torch.mm, (None, 1)), w, x)
    assert names.count("aten::mm") == 2 and "aten::bmm" not in names, names
    # one copy puts each example's product in the layout one example's mm gives, so a
    # .view of it works as in a loop (folded into the columns, each example was strided)
    assert names.count("aten::copy_") <= 1, names
    out = vmap(lambda x: torch.mm(w, x).view(-1), (1,))(x)
    torch.testing.assert_close(out, torch.stack([(w @ x[:, b]).view(-1) for b in range(B)]))


def test_registered_as_own_rules():
    for op in [aten.mm.default, aten.bmm.default, aten.mv.default, aten.dot.default,
               aten.vdot.default, aten.addmm.default, aten.baddbmm.default,
               aten.addbmm.default, aten.addmv.default, aten.addr.default]:
        assert registry.resolve(op).how is registry.How.OWN, op


@pytest.mark.parametrize("dims", [c for c in itertools.product((None, 0, -1), repeat=3)
                                  if any(d is not None for d in c)])
@pytest.mark.parametrize("n", [(5,), ()])
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # torch.func's
def test_bilinear_and_its_gradients(dims, n):
    """F.bilinear runs aten._trilinear; its derivatives run _trilinear again."""
    x1, x2, w = (batched(shape, d) for shape, d in zip(((*n, 4), (*n, 6), (7, 4, 6)), dims))
    bias = torch.randn(7, dtype=torch.float64)
    check(lambda x1, x2, w: F.bilinear(x1, x2, w, bias), x1, x2, w, in_dims=dims)

    def loss(x1, x2, w):
        return F.bilinear(x1, x2, w, bias).sin().sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))
    ours = vmap_without_slow_loop(grad(loss, argnums=(0, 1, 2)), x1, x2, w, in_dims=dims)
    torch.testing.assert_close(ours, torch.func.vmap(grads, in_dims=dims)(x1, x2, w))


@pytest.mark.parametrize("op", ["addmv", "addmm", "baddbmm", "addbmm"])
@pytest.mark.cpu_only("CUDA has no integer matmul kernels")
def test_integer_products_read_float_scalars_as_their_kernels_do(op):
    """An integer kernel truncates a float beta or alpha (``beta=0.2`` ignores self);
    scaling self by it in Python would promote the result to float."""
    shapes = {"addmv": ((5,), (5, 4), (4,)), "addmm": ((5, 3), (5, 4), (4, 3)),
              "baddbmm": ((2, 5, 3), (2, 5, 4), (2, 4, 3)),
              "addbmm": ((5, 3), (2, 5, 4), (2, 4, 3))}
    f = functools.partial(getattr(torch, op), beta=1.7, alpha=2.6)
    args = [torch.randint(-5, 5, (3, *s)) for s in shapes[op]]
    for in_dims in [(0, 0, 0), (0, None, 0), (0, 0, None)]:
        batched = [a if d is not None else a[0] for a, d in zip(args, in_dims)]
        # torch.func promotes to float32 here: against the loop only
        assert check_vmap(f, *batched, in_dims=in_dims, against_func=False).dtype == torch.int64


def test_integer_addr_refuses_float_scalars_as_its_kernel_does():
    x, v = torch.randint(-5, 5, (3, 4, 4)), torch.randint(-5, 5, (3, 4))
    for kwargs in ({"beta": 1.5}, {"alpha": 0.5}):
        with pytest.raises(RuntimeError, match="must not be a floating point number"):
            vmap(functools.partial(torch.addr, **kwargs))(x, v, v)
    check_vmap(functools.partial(torch.addr, beta=2, alpha=3), x, v, v)
