"""Linear-algebra rules (torchlevels/batching/linalg.py) against torch.func.vmap and a loop.

Each check runs a function three ways on the same inputs: torchlevels' vmap,
torch.func.vmap, and a Python loop over the examples stacked with torch.stack. It fails
if any op fell to the slow per-example loop. Inputs are float64 and well conditioned,
so LAPACK gives the same factorization batched or one matrix at a time.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from vmap_reference import check_vmap, vmap_without_slow_loop

from torchlevels import grad, jacrev, vmap
from torchlevels.batching import registry

aten = torch.ops.aten
B = 3
N = 4
linalg = torch.linalg


def at(x, dim):
    """A batch of ``B`` examples ``x`` (shape (B, ...)) moved to ``dim`` (None: example 0)."""
    return x[0] if dim is None else x.movedim(0, dim)


def rand(*shape, dtype=torch.float64):
    return torch.randn(B, *shape, dtype=dtype)


def spd(*batch, n=N):
    """Symmetric positive definite matrices (B, *batch, n, n)."""
    a = torch.randn(B, *batch, n, n, dtype=torch.float64)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


def general(*batch, n=N):
    """Well-conditioned general square matrices (B, *batch, n, n)."""
    return torch.randn(B, *batch, n, n, dtype=torch.float64) + 3 * n * torch.eye(n)


def triangular(*batch, n=N, upper=False):
    a = general(*batch, n=n)
    return a.triu() if upper else a.tril()


# vmap(f) == the loop and torch.func.vmap(f), no slow loop; returns vmap(f)'s result. With
# ``against_func=False`` only the loop is the reference: torch.func.vmap rejects some valid
# broadcasts (linalg.solve with A (2, n, n) and B (n, k)) and batches LAPACK's empty
# placeholder outputs differently from a loop.
check = functools.partial(check_vmap, atol=1e-7, rtol=1e-6)


DIMS1 = [0, 1, -1]  # where the batch dim of a single input sits


# -- one matrix in -------------------------------------------------------------------------

SINGLE = {
    "inv": (linalg.inv, general),
    "inv_ex": (linalg.inv_ex, general),
    "inverse": (torch.inverse, general),
    "cholesky": (linalg.cholesky, spd),
    "cholesky_upper": (lambda a: linalg.cholesky(a, upper=True), spd),
    "cholesky_ex": (linalg.cholesky_ex, spd),
    "det": (linalg.det, general),
    "slogdet": (linalg.slogdet, general),
    "logdet": (torch.logdet, spd),
    "lu_factor": (linalg.lu_factor, general),
    "lu_factor_ex": (linalg.lu_factor_ex, general),
    "lu": (linalg.lu, general),
    "qr": (linalg.qr, general),
    "qr_r": (lambda a: linalg.qr(a, mode="r"), general),
    "qr_complete": (lambda a: linalg.qr(a, mode="complete"), general),
    "eigh": (linalg.eigh, spd),
    "eigvalsh": (linalg.eigvalsh, spd),
    "eig": (linalg.eig, spd),
    "eigvals": (linalg.eigvals, spd),
    "svd": (linalg.svd, general),
    "svd_reduced": (lambda a: linalg.svd(a, full_matrices=False), general),
    "svdvals": (linalg.svdvals, general),
    "torch_svd": (torch.svd, general),
    "cholesky_inverse": (torch.cholesky_inverse, triangular),
    "matrix_exp": (lambda a: linalg.matrix_exp(a / 10), general),
    "pinv": (linalg.pinv, general),
    "pinv_hermitian": (lambda a: linalg.pinv(a, hermitian=True), spd),
    "pinv_atol": (lambda a: linalg.pinv(a, atol=0.1), general),
    "trace": (torch.trace, general),
    "tril": (torch.tril, general),
    "triu": (lambda a: torch.triu(a, 1), general),
    "tril_neg": (lambda a: torch.tril(a, -1), general),
    "diag": (torch.diag, general),
    "matrix_norm": (linalg.matrix_norm, general),
    "matrix_norm_nuc": (lambda a: linalg.matrix_norm(a, "nuc"), general),
    "matrix_norm_2": (lambda a: linalg.matrix_norm(a, 2), general),
    "cond": (linalg.cond, general),
    "matrix_rank": (linalg.matrix_rank, general),
    "matrix_power": (lambda a: linalg.matrix_power(a, 3), general),
    "matrix_power_neg": (lambda a: linalg.matrix_power(a, -2), general),
    "ldl_factor": (linalg.ldl_factor, spd),
    "geqrf": (torch.geqrf, general),
}


@pytest.mark.parametrize("name", SINGLE)
@pytest.mark.parametrize("dim", DIMS1)
def test_single_matrix(name, dim):
    f, make = SINGLE[name]
    check(f, at(make(), dim), in_dims=dim, against_func=name != "qr_r")


@pytest.mark.parametrize("name", ["inv", "det", "slogdet", "eigh", "svd", "qr", "cholesky",
                                  "lu", "matrix_exp", "tril", "pinv"])
def test_single_matrix_with_own_batch_dims(name):
    f, make = SINGLE[name]
    check(f, at(make(2), 1), in_dims=1)
    check(f, at(make(2, 3), -1), in_dims=-1)


@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (-1, -1)])
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_lu_unpack(dims, flags):
    lu, pivots = linalg.lu_factor(general(2))
    # torch.func.vmap leaves the empty placeholder outputs unbatched; the loop stacks them
    check(lambda lu, p: torch.lu_unpack(lu, p, *flags), at(lu, dims[0]), at(pivots, dims[1]),
          in_dims=dims, against_func=all(flags))


@pytest.mark.parametrize("shape,rest", [((2, 3), ()), ((5,), (1,)), ((2, 3), (0, 0, 2)),
                                        ((2, 3), (-1, 1, 2)), ((2, 3), (1, -1, 0))])
@pytest.mark.parametrize("dim", [0, 1])
def test_diag_embed(shape, rest, dim):
    check(lambda x: torch.diag_embed(x, *rest), at(rand(*shape), dim), in_dims=dim)


@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, -1)])
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
@pytest.mark.parametrize("batches", [((), ()), ((2,), (2,)), ((), (2,)), ((1,), (2,)),
                                     ((2,), ()), ((), (0,))])
def test_cdist_and_its_gradients(dims, p, batches):
    # an example's own batch dims may differ in rank or broadcast (the backward kernel
    # needs them of one rank), or be empty
    x1, x2 = at(rand(*batches[0], 4, 3), dims[0]), at(rand(*batches[1], 5, 3), dims[1])
    check_vmap(lambda a, b: torch.cdist(a, b, p=p), x1, x2, in_dims=dims)

    def loss(a, b):
        return torch.cdist(a, b, p=p).sin().sum()

    ours = vmap_without_slow_loop(grad(loss, argnums=(0, 1)), x1, x2, in_dims=dims)
    torch.testing.assert_close(ours, torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)),
                                                     in_dims=dims)(x1, x2))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("rows", [1, 2, 6])
def test_pdist_and_its_gradients(dim, p, rows):
    x = at(rand(rows, 3), dim)
    check_vmap(lambda v: torch.nn.functional.pdist(v, p), x, in_dims=dim)

    def loss(v):
        return torch.nn.functional.pdist(v, p).sin().sum()

    ours = vmap_without_slow_loop(grad(loss), x, in_dims=dim)
    torch.testing.assert_close(ours, torch.func.vmap(torch.func.grad(loss), in_dims=dim)(x))


def test_pdist_gradient_batched_by_its_weights_only():
    """The gradient is batched, the points are not: pairs' gradients of one shared x."""
    x, ws = rand(5, 3)[0], rand(10)

    def per_weight(grad):
        return lambda w: grad(lambda v: (torch.nn.functional.pdist(v) * w).sum())(x)

    torch.testing.assert_close(vmap_without_slow_loop(per_weight(grad), ws),
                               torch.func.vmap(per_weight(torch.func.grad))(ws))


@pytest.mark.parametrize("f, message", [
    (lambda v: torch.nn.functional.pdist(v, -1.0), "non-negative p"),
    (lambda v: torch.nn.functional.pdist(v.unsqueeze(0)), "only supports 2D"),
])
def test_pdist_errors_are_torchs(f, message):
    with pytest.raises(RuntimeError, match=message):
        vmap(f)(rand(4, 3))


def test_diag_of_vector():
    check(torch.diag, rand(N), in_dims=0)
    check(lambda v: torch.diag(v, 1), rand(N), in_dims=0)


@pytest.mark.parametrize("op", [linalg.inv, linalg.det, torch.trace, torch.tril, linalg.svd])
def test_vector_input_raises_like_torch(op):
    x = rand(N)
    with pytest.raises(RuntimeError):
        op(x[0])  # (torch.func.vmap lets tril of a vector through)
    with pytest.raises(RuntimeError):
        vmap(op)(x)


@pytest.mark.parametrize("name", ["lstsq", "geqrf"])
def test_vector_input_raises_torchs_error_where_the_op_has_no_meta_kernel(name):
    """The error each example's call raises (torch.func's for lstsq), not the missing meta
    kernel's of the check that runs one example's call."""
    x, rhs = rand(N), rand(N, 2)[0]
    op = {"lstsq": lambda a: linalg.lstsq(a, rhs), "geqrf": torch.geqrf}[name]
    with pytest.raises(RuntimeError) as eager:
        op(x[0])
    message = re.escape(str(eager.value))
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        vmap(op)(x)
    if name != "geqrf":  # (torch.func's rule raises an error of its own)
        with pytest.raises(RuntimeError, match=f"^{message}$"):
            torch.func.vmap(op)(x)


def test_singular_example_raises():
    a = general()
    a[1] = 0
    with pytest.raises(linalg.LinAlgError, match="Batch element 1"):
        vmap(linalg.inv)(a)
    info = check(lambda a: linalg.inv_ex(a).info, a)
    assert info.tolist()[0] == info.tolist()[2] == 0 and info[1] > 0


# -- solves: batched and unbatched operands, vector right-hand sides -----------------------


SOLVE_CASES = [
    # (A's logical batch shape, B's logical shape)
    ((), (N, 2)), ((), (N,)), ((2,), (2, N, 3)), ((2,), (N, 3)), ((), (2, N, 3)),
    ((2,), (2, N)), ((2,), (N,)), ((1,), (2, N, 1)),
]


@pytest.mark.parametrize("a_batch,b_shape", SOLVE_CASES, ids=str)
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, -1)])
@pytest.mark.parametrize("left", [True, False])
def test_solve(a_batch, b_shape, dims, left):
    vector = len(b_shape) == 1 or b_shape == (*a_batch, N)
    if not left and vector:
        pytest.skip("torch has no vector right-hand side for X A = B")
    if not left:
        b_shape = (*b_shape[:-2], b_shape[-1], b_shape[-2])  # X A = B: B is (*, k, n)
    a = at(general(*a_batch), dims[0])
    b = at(rand(*b_shape), dims[1])
    solve = functools.partial(linalg.solve, left=left)
    try:  # torch.func.vmap rejects some of these valid broadcasts; the loop does not
        torch.func.vmap(solve, dims)(a, b)
        func_ok = True
    except RuntimeError:
        func_ok = False
    check(solve, a, b, in_dims=dims, against_func=func_ok)
    # torch.func.vmap gives info the broadcast batch shape; torch gives it A's
    check(lambda a, b: linalg.solve_ex(a, b, left=left), a, b, in_dims=dims, against_func=False)


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("a_batch", [(), (2,)])
def test_solve_unbatched_rhs_shaped_like_a_batch_of_vectors(left, a_batch):
    # with n == B, an unbatched B of shape (n, B) passed on as is beside the physical A
    # (B, n, n) is what torch reads as a batch of vectors: wrong shape or an error before
    a = general(*a_batch, n=B)
    b = torch.randn(B, B, dtype=torch.float64)
    solve = functools.partial(linalg.solve, left=left)
    # torch.func.vmap rejects the broadcast of B against A's own batch dim; the loop does not
    check(solve, a, b, in_dims=(0, None), against_func=not a_batch)


def test_solve_unbatched_matrix_is_one_factorization():
    a, b = general()[0], rand(N, 2)
    with torch.profiler.profile(record_shapes=True) as prof:
        vmap(linalg.solve, (None, 0))(a, b)
    # one LU of the (n, n) matrix for the whole batch, not B of them
    sizes = [e.input_shapes for e in prof.events() if e.name == "aten::linalg_lu_factor_ex"]
    assert sizes and all(s[0] == [N, N] for s in sizes), sizes


@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, 2)])
@pytest.mark.parametrize("a_batch", [(), (2,)])
def test_two_matrix_solves(dims, a_batch):
    a = at(triangular(*a_batch), dims[0])
    u = at(triangular(*a_batch, upper=True), dims[0])
    b = at(rand(N, 3), dims[1])
    check(lambda a, b: torch.cholesky_solve(b, a), a, b, in_dims=dims)
    check(lambda a, b: torch.cholesky_solve(b, a, upper=True), u, b, in_dims=dims)
    check(lambda a, b: linalg.solve_triangular(a, b, upper=False), a, b, in_dims=dims)
    check(lambda a, b: linalg.solve_triangular(a, b.mT, upper=False, left=False), a, b,
          in_dims=dims)
    check(lambda a, b: torch.triangular_solve(b, a, upper=False), a, b, in_dims=dims)
    check(lambda a, b: torch.triangular_solve(b, a, transpose=True), u, b, in_dims=dims)


@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, -1)])
@pytest.mark.parametrize("a_batch", [(), (2,)])
def test_lu_and_ldl_solve(dims, a_batch):
    a = at(general(*a_batch), dims[0])
    s = at(spd(*a_batch), dims[0])
    b = at(rand(N, 2), dims[1])
    check(lambda a, b: linalg.lu_solve(*linalg.lu_factor(a), b), a, b, in_dims=dims)
    check(lambda a, b: linalg.lu_solve(*linalg.lu_factor(a), b.mT, left=False), a, b,
          in_dims=dims)
    check(lambda a, b: linalg.lu_solve(*linalg.lu_factor(a), b, adjoint=True), a, b,
          in_dims=dims)
    check(lambda a, b: linalg.ldl_solve(*linalg.ldl_factor(a), b), s, b, in_dims=dims)


@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0)])
def test_householder_and_ormqr(dims):
    a = at(rand(5, 3), dims[0])
    tau = at(rand(3), dims[1])
    c = rand(5, 2)
    check(linalg.householder_product, a, tau, in_dims=dims)
    check(lambda a, t, c: torch.ormqr(a, t, c), a, tau, c, in_dims=(*dims, 0))
    check(lambda a, t, c: torch.ormqr(a, t, c, transpose=True), a, tau, c[0],
          in_dims=(*dims, None))


@pytest.mark.parametrize("b_shape", [(6, 2), (6,)], ids=str)
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0)])
@pytest.mark.parametrize("driver", ["gelsy", "gelsd"])
@pytest.mark.cpu_only("CUDA's lstsq has the gels driver alone")
def test_lstsq(b_shape, dims, driver):
    a = at(rand(6, 3), dims[0])
    b = at(rand(*b_shape), dims[1])
    # torch.func.vmap rejects a vector right-hand side here
    check(lambda a, b: linalg.lstsq(a, b, driver=driver), a, b, in_dims=dims,
          against_func=len(b_shape) == 2)


@pytest.mark.parametrize("dims", [(0, None), (0, 0)])
@pytest.mark.parametrize("size", [2, 3])
def test_lstsq_of_a_right_hand_side_one_dim_short_that_is_no_vector(dims, size):
    # torch reads B (n, k) against A (1, n, n) its own way (the solution is (n, n, k)); a
    # loop gives that, where the vector rule of solve gave (1, n, k) before
    a = (torch.randn(size, 1, 2, 2, dtype=torch.float64)
         + 4 * torch.eye(2, dtype=torch.float64))
    b = at(torch.randn(size, 2, 3, dtype=torch.float64), dims[1])
    ours = vmap(linalg.lstsq, dims)(a, b).solution
    torch.testing.assert_close(ours, torch.stack([
        linalg.lstsq(a[i], b if dims[1] is None else b[i]).solution for i in range(size)]))


@pytest.mark.parametrize("dims", [(0, None), (None, 0), (0, 0)])
def test_tensorsolve_and_tensorinv(dims):
    a = at(general(), dims[0])
    b = at(rand(N), dims[1])
    check(linalg.tensorsolve, a, b, in_dims=dims)
    check(lambda a: linalg.tensorinv(a, ind=1), general(), in_dims=0)


def test_pinv_with_tensor_tolerance():
    rtol = torch.rand(2, dtype=torch.float64)
    check(lambda a: linalg.pinv(a, rtol=rtol), general(2), in_dims=0)


@pytest.mark.parametrize("op", [linalg.pinv, torch.pinverse])
def test_complex_pinv(op):
    """pinv's kernel conjugates a view it makes (``U.mH``): PyTorch switches the conjugate
    fallback off while a subclass handles an op, and the rule used to get wrong values."""
    a = torch.randn(B, 5, N, dtype=torch.complex128)
    check(op, a, in_dims=0)


@pytest.mark.parametrize("in_dims", [(0, 0, None), (None, 0, 0), (0, None, 0), (1, 0, 0)])
def test_pinv_with_batched_tolerances(in_dims):
    """``atol``/``rtol`` are keyword-only tensors: batched ones are each example's own,
    broadcast against a batch of matrices inside each example too."""
    a = torch.randn(B, 2, 5, N, dtype=torch.float64).movedim(0, in_dims[0] or 0)
    atol = torch.rand(B, 2, dtype=torch.float64)
    rtol = torch.rand(B, 1, dtype=torch.float64) * 0.5

    def f(a, atol, rtol):
        return linalg.pinv(a, atol=atol, rtol=rtol)

    check(f, a if in_dims[0] is not None else a[0], atol, rtol, in_dims=in_dims)


# -- nesting and autograd ----------------------------------------------------------------


def test_nested_solve_and_det():
    a = general(2).movedim(1, 0)  # (2, B, n, n): outer batch 2, inner batch B
    b = rand(N)[0]
    f = vmap(vmap(linalg.solve, (0, None)), (0, None))
    g = torch.func.vmap(torch.func.vmap(linalg.solve, (0, None)), (0, None))
    torch.testing.assert_close(f(a, b), g(a, b))
    torch.testing.assert_close(vmap(vmap(linalg.det))(a), linalg.det(a))


@pytest.mark.parametrize("name", ["inv", "det", "slogdet", "cholesky", "eigh", "solve"])
def test_backward(name):
    fns = {
        "inv": (lambda a: linalg.inv(a).sum(), general),
        "det": (lambda a: linalg.det(a), general),
        "slogdet": (lambda a: linalg.slogdet(a)[1], general),
        "cholesky": (lambda a: linalg.cholesky(a).sum(), spd),
        "eigh": (lambda a: linalg.eigvalsh(a).square().sum(), spd),
        "solve": (lambda a: linalg.solve(a, torch.ones(N, dtype=a.dtype)).sum(), general),
    }
    f, make = fns[name]
    a = make().requires_grad_()
    (got,) = torch.autograd.grad(vmap(f)(a).sum(), a)
    (want,) = torch.autograd.grad(torch.func.vmap(f)(a).sum(), a)
    torch.testing.assert_close(got, want)


def test_registered_as_own_rules():
    for op in [aten.linalg_inv_ex.default, aten._linalg_solve_ex.default, aten._linalg_svd.default,
               aten._linalg_eigh.default, aten.linalg_lstsq.default, aten.trace.default,
               aten.diag_embed.default, aten.tril.default, aten._linalg_check_errors.default]:
        assert registry.resolve(op).how is registry.How.OWN, op


@pytest.mark.parametrize("op", ["tril_", "triu_"])
def test_triangle_in_place_under_vmap_and_grad(op):
    """In place on each example's last two dims, and differentiable by an enclosing grad
    (the decomposition went through prims.where, which has no derivative)."""
    a = torch.randn(4, 3, dtype=torch.float64)
    vs = torch.randn(2, 4, 3, dtype=torch.float64)

    def body(a, v):
        out = a * v
        getattr(out[:, :2], op)(-1 if op == "tril_" else 1)  # on a view, in place
        return out.pow(2)

    check(lambda v: body(a, v), vs, in_dims=0)
    ours = grad(lambda a: vmap(lambda v: body(a, v))(vs).sum())(a)
    theirs = torch.func.grad(lambda a: torch.func.vmap(lambda v: body(a, v))(vs).sum())(a)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("solve", ["lu", "ldl"])
@pytest.mark.parametrize("adjoint", [False, True])
def test_solve_with_factors_in_a_batch_of_one_under_another_vmap(solve, adjoint):
    # the factors come column-major from lu_factor/ldl_factor; a vmap of one example
    # inside another gives them a size-1 batch dim that PyTorch's kernels misread
    a = torch.randn(2, N, N, dtype=torch.float64)
    a = a @ a.mT + N * torch.eye(N, dtype=torch.float64)
    b = torch.randn(2, 1, N, 2, dtype=torch.float64)
    factor = linalg.lu_factor if solve == "lu" else linalg.ldl_factor
    options = {"adjoint": adjoint} if solve == "lu" else {"hermitian": adjoint}

    def f(a, b):  # a: (N, N), b: (1, N, 2)
        lu, pivots = factor(a)
        run = linalg.lu_solve if solve == "lu" else linalg.ldl_solve
        return vmap(lambda b: run(lu, pivots, b, **options))(b)

    ours = vmap(f)(a, b)
    loop = [[(linalg.lu_solve if solve == "lu" else linalg.ldl_solve)(
        *factor(a[i]), b[i, j], **options) for j in range(1)] for i in range(2)]
    torch.testing.assert_close(ours, torch.stack([torch.stack(r) for r in loop]))


def test_vmap_of_jacrev_of_det():
    # jacrev's vmap over the one basis vector of a scalar output is such a batch of one:
    # det's backward solves with its LU factors
    a = torch.randn(3, N, N, dtype=torch.float64)
    a = a @ a.mT + N * torch.eye(N, dtype=torch.float64)
    for f in (linalg.det, torch.logdet):
        ours = vmap(jacrev(f))(a)
        torch.testing.assert_close(ours, torch.func.vmap(torch.func.jacrev(f))(a))
        torch.testing.assert_close(ours, torch.stack([
            torch.autograd.grad(f(x), x)[0] for x in a.clone().requires_grad_().unbind()]))
