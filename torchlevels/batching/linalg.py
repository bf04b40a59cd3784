"""Own rules for linear algebra, mostly the family of ops that already take leading batch dims.

Most torch.linalg functions are composite and reach vmap as a handful of ops
(``linalg_inv_ex``, ``_linalg_solve_ex``, ``_linalg_svd``, ...) that accept ``(*, n, n)``
inputs. For those the batch dim just goes first: :func:`leading_batch_dims` declares
them, given the core rank of each tensor argument (2 for a matrix, 1 for a vector).
"""

from __future__ import annotations

import functools

import torch

from torchlevels.batching.dims import (
    example_meta,
    example_zeros,
    logical_rank,
    logical_shape,
    materialize,
    pad_to_rank,
    to_front,
    wrap_dim,
)
from torchlevels.batching.registry import batch_size, loop_rule, register

aten = torch.ops.aten


def out_dims(out, size):
    """Batch dims of outputs computed with the batch first; empty placeholders are unbatched."""
    if isinstance(out, torch.Tensor):
        return None if out.shape == (0,) and size != 0 else 0
    return tuple(out_dims(o, size) for o in out)


def check_ranks(func, args, dims, cores, kwargs) -> None:
    """Raise torch's own error if a logical operand has fewer dims than its core rank: the
    op's on one example, as meta tensors, or as zeros for an op without a meta kernel
    (its kernel checks the ranks before computing), unseen by any level or mode."""
    tensors = [(a, d) for a, d in zip(args, dims) if isinstance(a, torch.Tensor)]
    if all(logical_rank(a, d) >= core for (a, d), core in zip(tensors, cores)):
        return
    try:
        try:
            func(*example_meta(args, dims), **kwargs)
        except NotImplementedError:  # no meta kernel
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                func(*example_zeros(args, dims), **kwargs)
    except Exception as e:  # some meta kernels raise AssertionError: keep torch's type
        raise RuntimeError(str(e)) from None
    raise RuntimeError(f"{func}: expected inputs with at least {cores} dims")


def batch_first(func, args, dims, kwargs, cores, equal=False):
    """Run ``func`` with every batched tensor argument's batch dim first.

    ``cores`` are the core ranks of the tensor arguments in order. Batched tensors get
    size-1 dims after the batch dim so that all share one number of batch dims, and
    unbatched ones then broadcast against them; with ``equal`` (ops that need equal
    batch shapes, or whose outputs come from only some inputs) they are expanded too.
    """
    check_ranks(func, args, dims, cores, kwargs)
    size = batch_size(args, dims)
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    batch_rank = max(logical_rank(args[i], dims[i]) - c for i, c in zip(tensors, cores))
    phys = list(args)
    for i, core in zip(tensors, cores):
        if dims[i] is not None or equal:
            phys[i] = pad_to_rank(materialize(args[i], dims[i], size), batch_rank + core)
    out = func(*phys, **kwargs)
    return out, out_dims(out, size)


def leading_batch_dims(*ops, cores=(2,), equal=False) -> None:
    """Declare ``ops`` as taking leading batch dims on tensor arguments of rank ``cores``."""
    register(*ops)(functools.partial(_leading_batch_dims_rule, cores=cores, equal=equal))


def _leading_batch_dims_rule(func, args, dims, kwargs, cores, equal):
    return batch_first(func, args, dims, kwargs, cores, equal)


# One matrix in, any number of (*, ...) outputs out.
leading_batch_dims(
    aten.linalg_inv_ex.default, aten.linalg_cholesky_ex.default, aten.cholesky.default,
    aten._linalg_det.default, aten._linalg_slogdet.default, aten.linalg_lu_factor_ex.default,
    aten.linalg_lu.default, aten.linalg_qr.default, aten._linalg_eigh.default,
    aten.linalg_eig.default, aten._linalg_svd.default, aten.cholesky_inverse.default,
    aten.geqrf.default,
    aten.linalg_ldl_factor_ex.default, aten.tril.default, aten.triu.default,
)
# Several inputs whose batch shapes broadcast, one output.
leading_batch_dims(aten.cholesky_solve.default, aten.linalg_solve_triangular.default,
                   cores=(2, 2))
leading_batch_dims(aten.linalg_pinv.rcond_tensor, cores=(2, 0))
# Several inputs, outputs that need the full batch or inputs that need equal batch shapes.
leading_batch_dims(aten.triangular_solve.default, cores=(2, 2), equal=True)
leading_batch_dims(aten.linalg_householder_product.default, cores=(2, 1), equal=True)
leading_batch_dims(aten.ormqr.default, cores=(2, 1, 2), equal=True)
leading_batch_dims(aten.lu_unpack.default, cores=(2, 1), equal=True)
leading_batch_dims(aten._cdist_forward.default, cores=(2, 2), equal=True)


@register(aten.linalg_pinv.atol_rtol_tensor, keyword_dims=True)
def pinv_tolerances(func, args, dims, kwargs, kw_dims=None):
    """``pinv`` whose keyword-only ``atol``/``rtol`` tensors broadcast against the
    matrices' batch shape: :func:`batch_first` with them as arguments of core rank 0."""
    kw_dims = kw_dims or {}
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    options = {k: v for k, v in kwargs.items() if k not in names}

    def call(matrices, *tolerances):
        return func(matrices, **options, **dict(zip(names, tolerances)))

    return batch_first(call, (args[0], *(kwargs[k] for k in names)),
                       (dims[0], *map(kw_dims.get, names)), {}, (2, *[0] * len(names)))


@register(aten.linalg_lu_solve.default, aten.linalg_ldl_solve.default)
def solve_with_factors(func, args, dims, kwargs):
    """``lu_solve``/``ldl_solve`` with the batch first, the factors and pivots copied to a
    fresh layout where the batch has a dim of size 1: PyTorch's kernels misread
    column-major factors whose size-1 batch dim has a stride other than a whole matrix's
    (``LU.unsqueeze(0)`` of ``lu_factor``'s result) and give wrong values; a batch of one
    example under an outer vmap makes such a layout."""

    def call(factors, pivots, b, **options):
        if 1 in factors.shape[:-2]:
            factors, pivots = (t.clone(memory_format=torch.contiguous_format)
                               for t in (factors, pivots))
        return func(factors, pivots, b, **options)

    return batch_first(call, args, dims, kwargs, (2, 1, 2), equal=True)


@register(aten._cdist_backward.default)
def cdist_backward(func, args, dims, kwargs):
    """Leading batch dims of one rank, contiguous, as the kernel requires: an example's
    ``x1`` of shape (n, m) beside an ``x2`` of (b, r, m) goes in as (1, n, m)."""
    size = batch_size(args, dims)
    grad, x1, x2, p, dist = (a if d is None and not isinstance(a, torch.Tensor)
                             else materialize(a, d, size) for a, d in zip(args, dims))
    if grad.numel() == 0:  # an empty batch shape: the kernel gives zeros shaped like x1
        return torch.zeros_like(x1), 0
    rank = max(t.dim() for t in (grad, x1, x2, dist)) - 1
    grad, x1, x2, dist = (pad_to_rank(t, rank).contiguous() for t in (grad, x1, x2, dist))
    return func(grad, x1, x2, p, dist, **kwargs), 0


@register(aten._pdist_forward.default)
def pdist(func, args, dims, kwargs):
    """Each example's distances between its rows ``i < j``: the upper triangle of
    ``cdist(x, x, p)`` computed pair by pair (no matrix-product shortcut), as pdist does."""
    x, p = (*args, 2.0)[:2]
    func(*example_meta(args, dims), **kwargs)  # torch's errors
    x = to_front(x, dims[0]).contiguous()
    if x.shape[1] < 2:  # no pairs: pdist answers before its kernel's dtype check, cdist not
        return x.flatten(1)[:, :0].clone(), 0  # (from x: autograd outside sees the graph)
    i, j = torch.triu_indices(x.shape[1], x.shape[1], offset=1, device=x.device)
    return aten._cdist_forward(x, x, p, 2)[:, i, j], 0  # 2: never through a matrix product


@register(aten._pdist_backward.default)
def pdist_backward(func, args, dims, kwargs):
    """Through cdist's backward: row ``i``'s gradient collects pair ``(i, j)``'s from both
    sides, so the pairs' gradients go in as a symmetric ``(n, n)`` matrix."""
    size = batch_size(args, dims)
    grad, x, p, dist = (materialize(a, d, size) if isinstance(a, torch.Tensor) else a
                        for a, d in zip(args, dims))
    x = x.contiguous()
    n = x.shape[1]
    i, j = torch.triu_indices(n, n, offset=1, device=x.device)
    full_grad = grad.new_zeros(size, n, n)
    full_dist = dist.new_zeros(size, n, n)
    full_grad[:, i, j] = full_grad[:, j, i] = grad
    full_dist[:, i, j] = full_dist[:, j, i] = dist
    return aten._cdist_backward(full_grad, x, x, p, full_dist), 0


@register(aten.tril_.default, aten.triu_.default)
def triangle_inplace(func, args, dims, kwargs):
    """In place on the last two dims of every example (the decomposition goes through
    prims.where, which an enclosing grad level cannot differentiate)."""
    x, *rest = args
    func(to_front(x, dims[0]), *rest, **kwargs)
    return x, dims[0]


@register(aten.linalg_matrix_exp.default)
def matrix_exp(func, args, dims, kwargs):
    """matrix_exp of a contiguous input: torch's kernel fails on some strided batches."""
    check_ranks(func, args, dims, (2,), kwargs)
    return func(to_front(args[0], dims[0]).contiguous()), 0


@register(aten._linalg_check_errors.default)
def check_errors(func, args, dims, kwargs):
    """Check every example's ``info``; returns nothing."""
    info, api_name = args[:2]
    func(to_front(info, dims[0]), api_name, is_matrix=False)
    return None, None


@register(aten.trace.default)
def trace(func, args, dims, kwargs):
    """trace as the sum of the diagonal."""
    x = args[0]
    check_ranks(func, args, dims, (2,), kwargs)
    if logical_rank(x, dims[0]) != 2:
        func(torch.empty(logical_shape(x, dims[0]), device="meta"))
    if x.dtype == torch.bool:  # the kernel's error (the sum would count the True entries)
        raise NotImplementedError(""""trace" not implemented for 'Bool'""")
    return to_front(x, dims[0]).diagonal(0, 1, 2).sum(-1), 0


@register(aten.diag_embed.default)
def diag_embed(func, args, dims, kwargs):
    """diag_embed with its output dims shifted past the batch dim."""
    x, offset, dim1, dim2 = (list(args) + [0, -2, -1][len(args) - 1 :])[:4]
    rank = logical_rank(x, dims[0]) + 1
    dim1, dim2 = wrap_dim(dim1, rank) + 1, wrap_dim(dim2, rank) + 1
    return torch.diag_embed(to_front(x, dims[0]), offset, dim1, dim2), 0


def _is_vector_rhs(a_shape, b_shape) -> bool:
    """torch's rule for solve-like ops: is B a (batch of) vector(s) rather than matrices?"""
    return len(b_shape) == 1 or (len(b_shape) == len(a_shape) - 1 and b_shape == a_shape[:-1])


@register(aten._linalg_solve_ex.default)
def linalg_solve(func, args, dims, kwargs):
    """linalg.solve; with ``A`` unbatched the batch folds into ``B``'s columns (one LU)."""
    a, b = args
    da, db = dims
    check_ranks(func, args, dims, (2, 1), kwargs)
    vector = _is_vector_rhs(logical_shape(a, da), logical_shape(b, db))
    if vector:  # torch solves for one column (whatever ``left`` says), then drops it
        b = to_front(b, db).unsqueeze(-1)
        db = None if db is None else 0
    if da is None:
        x, lu, pivots, info = _solve_folded(func, a, b, db, kwargs)
        out_dims = (0, None, None, None)
    else:
        a_batch, b_batch = logical_rank(a, da) - 2, b.dim() - (db is not None) - 2
        rank = max(a_batch, b_batch) + 2
        a = pad_to_rank(to_front(a, da), rank)
        # an unbatched B gets a size-1 batch dim too, or torch could read B of shape
        # (size, n) against A of shape (size, n, n) as a batch of vectors
        if db is None:
            b = b.reshape((1,) * (rank + 1 - b.dim()) + b.shape)
        else:
            b = pad_to_rank(to_front(b, db), rank)
        x, lu, pivots, info = func(a, b, **kwargs)
        if b_batch > a_batch:  # LU, pivots and info keep A's own batch shape
            lu, pivots, info = (t.flatten(0, b_batch - a_batch) for t in (lu, pivots, info))
        out_dims = (0, 0, 0, 0)
    return (x.squeeze(-1) if vector else x, lu, pivots, info), out_dims


def _solve_folded(func, a, b, db, kwargs):
    """Solve with an unbatched ``A``: the batch of ``B`` becomes extra columns (or rows)."""
    if kwargs.get("left", True):
        b = b.movedim(db, -1)  # (*, n, k, batch)
        x, *rest = func(a, b.flatten(-2), **kwargs)
        return x.unflatten(-1, b.shape[-2:]).movedim(-1, 0), *rest
    b = b.movedim(db, -3)  # (*, batch, k, n)
    x, *rest = func(a, b.flatten(-3, -2), **kwargs)
    return x.unflatten(-2, b.shape[-3:-1]).movedim(-3, 0), *rest


@register(aten.linalg_lstsq.default)
def linalg_lstsq(func, args, dims, kwargs):
    """linalg.lstsq: batch first, with torch's vector right-hand-side rule on logical shapes."""
    a, b, *rest = args
    da, db = dims[:2]
    check_ranks(func, args, dims, (2, 1), kwargs)
    a_shape, b_shape = logical_shape(a, da), logical_shape(b, db)
    vector = _is_vector_rhs(a_shape, b_shape)
    if len(b_shape) == len(a_shape) - 1 and not vector:
        # torch reads such a B its own way (A (1, n, n), B (n, k) gives (n, n, k)): one
        # example at a time, as it would
        return loop_rule(func, args, dims, kwargs)
    if vector:
        b = to_front(b, db).unsqueeze(-1)
        db = None if db is None else 0
    out, bdims = batch_first(func, (a, b, *rest), (da, db, *dims[2:]), kwargs, (2, 2), True)
    if vector:
        out = (out[0].squeeze(-1), *out[1:])  # torch keeps the residuals' column
    return out, bdims
