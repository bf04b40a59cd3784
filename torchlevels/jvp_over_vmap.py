"""A pointwise op of a jvp level right inside a vmap level, run once on the physical duals.

Under ``vmap(jvp(f))`` (``jacfwd``, and ``jacfwd(jacrev(f))``) the primal and the tangent of
each of the jvp level's tensors are batched tensors of the vmap level around it. Run the
usual way, one pointwise op makes its dual tensors, runs, and unpacks them through that
vmap level: the op, each op of its forward-AD formula, and the dual's alias and layout
checks each cross it, about seven trips through Python where the op itself is one.

For a pointwise op whose tensors are all batched at dim 0, each with its tangent, the
result is the same op on the physical tensors: their duals are made, the op runs once
with forward AD doing the formula in C++, and the primal and tangent come back as batched
tensors at dim 0, as the vmap level's pointwise rule gives them (examples of fewer dims
get size-1 dims after the batch dim, so that they broadcast as they would unbatched).
Anything else takes the usual way: a tensor without a tangent or a number where the op
takes a tensor (forward AD would give it a ZeroTensor tangent, which the usual way
avoids), a batch dim elsewhere, a tensor autograd outside tracks, 0-dim examples.
"""

from __future__ import annotations

import torch

from torchlevels._level import (
    LevelTensor,
    autograd_on,
    new_wrapper,
    requires_grad_flag,
    show_lazy_bits,
)
from torchlevels.batching.dims import pad_to_rank
from torchlevels.batching.registry import per_op

_make_dual, _unpack_dual = torch._VF._make_dual, torch._VF._unpack_dual
_set_grad_enabled = torch._C._set_grad_enabled
_NUMBERS = (int, float, bool)


@per_op
def tensor_positions(func) -> frozenset[int] | None:
    """The positions of ``func``'s tensor arguments, if it is a pointwise op that writes
    nothing and returns one tensor; else None."""
    schema = func._schema
    if (torch.Tag.pointwise not in func.tags or schema.is_mutable
            or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor"):
        return None
    return frozenset(i for i, a in enumerate(schema.arguments) if str(a.type) == "Tensor")


def pointwise_on_batches(cls: type[LevelTensor], func, args: tuple, kwargs: dict,
                         level: int) -> tuple[LevelTensor, LevelTensor] | None:
    """The primal and tangent, as tensors of the vmap level around jvp level ``cls``, of
    pointwise ``func`` run on the physical duals; None to take the usual way."""
    positions = tensor_positions(func)
    batch = cls.__base__
    if positions is None or kwargs or getattr(batch.__dict__.get("_level"), "kind", "") != "vmap":
        return None
    primals, tangents = [], []
    rank = low = 0  # the most and the fewest dims of the physical tensors
    for i, a in enumerate(args):
        if type(a) is cls:
            p, t = a._inner, a._tangent
            if type(p) is not batch or type(t) is not batch or p._bdim or t._bdim:
                return None
            p, t = p._inner, t._inner
            if (type(p) is not torch.Tensor or type(t) is not torch.Tensor
                    or requires_grad_flag(p) or requires_grad_flag(t) or p.shape != t.shape):
                return None  # a level's tensors inside, or tracked by autograd outside
            r = p.dim()
            rank, low = max(rank, r), min(low, r) if low else r
            primals.append(p)
            tangents.append(t)
        elif i in positions or not isinstance(a, _NUMBERS):
            return None
        else:
            primals.append(a)
            tangents.append(None)
    if low < 2:  # no tensor of ours, or 0-dim examples (whose dtype promotes differently)
        return None
    with autograd_on():  # (forward AD runs at autograd's keys)
        duals = [p if t is None else
                 _make_dual(pad_to_rank(p, rank - 1), pad_to_rank(t, rank - 1), level=level)
                 for p, t in zip(primals, tangents)]
        enabled = torch.is_grad_enabled()
        _set_grad_enabled(False)  # forward AD alone
        try:
            out = func._op(*duals)
        finally:
            _set_grad_enabled(enabled)
        primal, tangent = _unpack_dual(out, level)
    if tangent is None or tangent._is_zerotensor():
        return None  # (a known zero, sgn's derivative: the usual way makes it no tangent)
    return _batched(batch, primal), _batched(batch, tangent)


def _batched(batch: type[LevelTensor], physical: torch.Tensor) -> LevelTensor:
    out = new_wrapper(batch, physical, 0)
    out._inner = physical
    out._bdim = 0
    show_lazy_bits(out, physical)
    return out
