"""Own rules for the matmul family: mm, bmm, mv, dot, vdot and their fused ``add*`` forms.

Composite ops (matmul, linear, einsum, tensordot, outer, inner, multi_dot) reach vmap
already decomposed into these. Each rule issues one kernel where it can: a batched
matrix times an unbatched one folds the batch into the rows (one mm on ``(B*n, k)``),
an unbatched matrix times a batched one folds it into the columns, and two batched
operands use bmm. Only the batch dim of the output moves, never a copy of the weight.
"""

from __future__ import annotations

import torch

from torchlevels.batching.dims import (
    example_meta,
    logical_shape,
    materialize,
    pad_to_rank,
    to_front,
)
from torchlevels.batching.registry import batch_size, register

aten = torch.ops.aten


def _check_ranks(func, args, dims, ranks) -> None:
    """Raise torch's own error when a logical operand's rank is not in ``ranks`` (None: any)."""
    if all(r is None or a.dim() - (d is not None) in r for a, d, r in zip(args, dims, ranks)):
        return
    try:
        func(*example_meta(args, dims))
    except Exception as e:  # some meta kernels raise AssertionError: keep torch's type
        raise RuntimeError(str(e)) from None
    raise RuntimeError(f"{func}: expected operands of ranks {ranks}")


def _next_to(x, bdim, d):
    """``x`` with its batch dim at ``d`` or ``d + 1`` (moved to ``d`` unless already there).

    Then dims ``d`` and ``d + 1`` can be merged into one, without a copy when contiguous.
    """
    if bdim == d or bdim == d + 1:
        return x, bdim
    return x.movedim(bdim, d), d


def _contiguous_examples(out, bdim):
    """``out`` with the batch first and each example contiguous, as the kernel's output
    is for one example (so a ``.view`` of it works where a loop's does); a copy only when
    the batch was folded elsewhere than in front."""
    return to_front(out, bdim).contiguous(), 0


def matrix_product(a, da, b, db):
    """``(a @ b, bdim)`` for logical matrices ``a`` (n, k) and ``b`` (k, m)."""
    if da is None and db is None:
        return torch.mm(a, b), None
    if db is None:  # (B*n, k) @ (k, m)
        a, bdim = _next_to(a, da, 0)
        p, q, k = a.shape
        return _contiguous_examples(torch.mm(a.reshape(p * q, k), b).view(p, q, b.shape[1]), bdim)
    if da is None:  # (n, k) @ (k, B*m)
        b, bdim = _next_to(b, db, 1)
        k, p, q = b.shape
        return _contiguous_examples(torch.mm(a, b.reshape(k, p * q)).view(a.shape[0], p, q), bdim)
    return torch.bmm(to_front(a, da), to_front(b, db)), 0


def batch_matrix_product(a, da, b, db):
    """``(bmm(a, b), bdim)`` for logical batches of matrices ``a`` (N, n, k), ``b`` (N, k, m)."""
    if da is None and db is None:
        return torch.bmm(a, b), None
    if db is None:  # (N, B*n, k) @ (N, k, m)
        a, bdim = _next_to(a, da, 1)
        n, p, q, k = a.shape
        out = torch.bmm(a.reshape(n, p * q, k), b).view(n, p, q, b.shape[2])
        return _contiguous_examples(out, bdim)
    if da is None:  # (N, n, k) @ (N, k, B*m)
        b, bdim = _next_to(b, db, 2)
        n, k, p, q = b.shape
        out = torch.bmm(a, b.reshape(n, k, p * q)).view(n, a.shape[1], p, q)
        return _contiguous_examples(out, bdim)
    a, b = to_front(a, da), to_front(b, db)  # fold the vmap batch into bmm's batch
    p, q, n, k = a.shape
    m = b.shape[-1]
    return torch.bmm(a.reshape(p * q, n, k), b.reshape(p * q, k, m)).view(p, q, n, m), 0


def matrix_vector_product(a, da, v, dv):
    """``(a @ v, bdim)`` for a logical matrix ``a`` (n, k) and vector ``v`` (k,)."""
    if da is None and dv is None:
        return torch.mv(a, v), None
    if dv is None:  # (B*n, k) @ (k,)
        a, bdim = _next_to(a, da, 0)
        p, q, k = a.shape
        return torch.mv(a.reshape(p * q, k), v).view(p, q), bdim
    if da is None:
        if dv == 1:
            return torch.mm(a, v), 1  # (n, k) @ (k, B)
        return torch.mm(v, a.t()), 0  # (B, k) @ (k, n)
    return torch.bmm(to_front(a, da), to_front(v, dv).unsqueeze(2)).squeeze(2), 0


def vector_dot(a, da, b, db):
    """``(a . b, bdim)`` for logical vectors (no conjugation)."""
    if db is None:
        return torch.mv(to_front(a, da), b), 0
    if da is None:
        return torch.mv(to_front(b, db), a), 0
    a, b = to_front(a, da), to_front(b, db)
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0]), 0


def _scalars_of(t: torch.Tensor, *scalars):
    """The scalars as a kernel of ``t``'s dtype reads them: an integer kernel truncates
    a float ``beta`` or ``alpha`` to an integer (``addmv(x, m, v, beta=0.2)`` of int64
    tensors ignores ``x``), where ``s * beta`` would promote to float."""
    if t.is_floating_point() or t.is_complex():
        return scalars
    return tuple(int(c) for c in scalars)


def add_scaled(s, ds, prod, dp, rank, beta=1, alpha=1):
    """``beta * s + alpha * prod`` with batch dims first; ``s`` ignored when ``beta == 0``."""
    beta, alpha = _scalars_of(prod, beta, alpha)
    if ds is not None:
        s = pad_to_rank(to_front(s, ds), rank)
    prod = to_front(prod, dp)
    if beta == 0:
        s = torch.zeros_like(s)  # addmm ignores self (even NaN) when beta is 0
    elif beta != 1:
        s = s * beta
    # contiguous per example, as the fused kernel's output is (the add follows its inputs'
    # layout, where a self batched off the front would leave each example strided)
    return torch.add(s, prod, alpha=alpha).contiguous(), 0


@register(aten.mm.default)
def mm(func, args, dims, kwargs):
    """mm: one mm with the batch folded into rows or columns, or one bmm."""
    _check_ranks(func, args, dims, ((2,), (2,)))
    return matrix_product(args[0], dims[0], args[1], dims[1])


@register(aten.bmm.default)
def bmm(func, args, dims, kwargs):
    """bmm: one bmm with the vmap batch folded into rows, columns or bmm's own batch."""
    _check_ranks(func, args, dims, ((3,), (3,)))
    if logical_shape(args[0], dims[0])[0] != logical_shape(args[1], dims[1])[0]:
        func(*example_meta(args, dims))  # bmm does not broadcast its batch: torch's error
    return batch_matrix_product(args[0], dims[0], args[1], dims[1])


@register(aten.mv.default)
def mv(func, args, dims, kwargs):
    """mv: mv on folded rows, or mm when only the vector is batched."""
    _check_ranks(func, args, dims, ((2,), (1,)))
    return matrix_vector_product(args[0], dims[0], args[1], dims[1])


@register(aten.dot.default)
def dot(func, args, dims, kwargs):
    """dot: an mv when one side is unbatched, else a bmm of (1, k) @ (k, 1)."""
    _check_ranks(func, args, dims, ((1,), (1,)))
    return vector_dot(args[0], dims[0], args[1], dims[1])


@register(aten.vdot.default)
def vdot(func, args, dims, kwargs):
    """vdot: dot with the first operand conjugated."""
    _check_ranks(func, args, dims, ((1,), (1,)))
    a = args[0]
    # conj_physical: inside __torch_dispatch__ kernels ignore a lazy conj bit
    return vector_dot(a.conj_physical() if a.is_complex() else a, dims[0], args[1], dims[1])


@register(aten.addmm.default)
def addmm(func, args, dims, kwargs):
    """addmm: one addmm on folded rows when self broadcasts over them (linear's case)."""
    s, a, b = args
    ds, da, db = dims
    if a.dim() - (da is not None) != 2 or b.dim() - (db is not None) != 2 or s.dim() > 2 + (
        ds is not None
    ):
        _check_ranks(func, args, dims, ((0, 1, 2), (2,), (2,)))
    if ds is None and db is None and (s.dim() < 2 or s.shape[0] == 1):
        a, bdim = _next_to(a, da, 0)  # self broadcasts over the folded rows
        p, q, k = a.shape
        return torch.addmm(s, a.reshape(p * q, k), b, **kwargs).view(p, q, b.shape[1]), bdim
    if da is not None and db is not None:
        s = pad_to_rank(to_front(s, ds), 2) if ds is not None else s
        return torch.baddbmm(s, to_front(a, da), to_front(b, db), **kwargs), 0
    prod, dp = matrix_product(a, da, b, db)
    return add_scaled(s, ds, prod, dp, 2, **kwargs)


@register(aten.baddbmm.default)
def baddbmm(func, args, dims, kwargs):
    """baddbmm: one baddbmm when both batches are batched and self broadcasts over them."""
    s, a, b = args
    ds, da, db = dims
    _check_ranks(func, args, dims, ((0, 1, 2, 3), (3,), (3,)))
    if ds is None and s.dim() < 3 and da is not None and db is not None:
        a, b = to_front(a, da), to_front(b, db)
        p, q, n, k = a.shape
        m = b.shape[-1]
        out = torch.baddbmm(s, a.reshape(p * q, n, k), b.reshape(p * q, k, m), **kwargs)
        return out.view(p, q, n, m), 0
    prod, dp = batch_matrix_product(a, da, b, db)
    return add_scaled(s, ds, prod, dp, 3, **kwargs)


@register(aten.addbmm.default)
def addbmm(func, args, dims, kwargs):
    """addbmm as an addmm: sum_i b1[i] @ b2[i] == [b1[0] .. b1[N-1]] @ [b2[0]; ..; b2[N-1]]."""
    s, b1, b2 = args
    ds, d1, d2 = dims
    _check_ranks(func, args, dims, ((0, 1, 2), (3,), (3,)))
    if d1 is None:
        rows = b1.transpose(0, 1).flatten(1, 2)  # (n, N*k)
    else:
        rows = to_front(b1, d1).transpose(1, 2).flatten(2, 3)
    cols = b2.flatten(0, 1) if d2 is None else to_front(b2, d2).flatten(1, 2)  # (N*k, m)
    front = (ds, None if d1 is None else 0, None if d2 is None else 0)
    return addmm(aten.addmm.default, (s, rows, cols), front, kwargs)


@register(aten.addmv.default)
def addmv(func, args, dims, kwargs):
    """addmv: the batched matrix-vector product plus the scaled self."""
    s, a, v = args
    ds, da, dv = dims
    _check_ranks(func, args, dims, ((0, 1), (2,), (1,)))
    prod, dp = matrix_vector_product(a, da, v, dv)
    return add_scaled(s, ds, prod, dp, 1, **kwargs)


@register(aten.addr.default)
def addr(func, args, dims, kwargs):
    """addr: ``beta * self + alpha * v1 v2^T`` as one broadcast addcmul."""
    s, v1, v2 = args
    ds, d1, d2 = dims
    _check_ranks(func, args, dims, ((0, 1, 2), (1,), (1,)))
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if not (v1.is_floating_point() or v1.is_complex()):  # as the kernel checks
        for name, c in (("beta", beta), ("alpha", alpha)):
            if isinstance(c, float):
                raise RuntimeError(f"For integral input tensors, argument {name} must not be "
                                   "a floating point number.")
    s = pad_to_rank(to_front(s, ds), 2) if ds is not None else s
    col = to_front(v1, d1).unsqueeze(-1)  # (B, n, 1) or (n, 1)
    row = to_front(v2, d2).unsqueeze(-2)  # (B, 1, m) or (1, m)
    if s.dtype == col.dtype == row.dtype == torch.bool:  # (beta and s) or (alpha and v1 v2^T)
        outer = col & row
        return (outer if alpha else outer & False) | (s if beta else s & False), 0
    if beta == 0:
        s = torch.zeros_like(s)
    elif beta != 1:
        s = s * beta
    # contiguous per example, as the kernel's output is (a .view of it works as in a loop)
    return torch.addcmul(s, col, row, value=alpha).contiguous(), 0


@register(aten._trilinear.default)
def trilinear(func, args, dims, kwargs):
    """``F.bilinear``'s kernel: the batch becomes a leading dim of all three operands
    (expanded for the unbatched ones), so every dim argument moves up by one."""
    i1, i2, i3, *dim_lists = args
    size = batch_size(args, dims)
    phys = [materialize(t, d, size) for t, d in zip((i1, i2, i3), dims)]
    expand1, expand2, expand3, sumdim, *unroll = dim_lists
    shifted = [[d + 1 for d in ds] for ds in (expand1, expand2, expand3, sumdim)]
    return func(*phys, *shifted, *(u + 1 for u in unroll), **kwargs), 0
