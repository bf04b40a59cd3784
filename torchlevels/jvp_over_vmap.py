"""A pointwise op of a jvp level right inside a vmap level, run once on the physical duals.

Under ``vmap(jvp(f))`` with a primal and a tangent per example, the primal and the tangent
of each of the jvp level's tensors are batched tensors of the vmap level around it. Run
the usual way, one pointwise op makes its dual tensors, runs, and unpacks them through
that vmap level: the op, each op of its forward-AD formula, and the dual's alias and
layout checks each cross it, about seven trips through Python where the op itself is one.

For a pointwise op whose tensors are batched at dim 0 (each with its tangent, or a
constant of the jvp level) or not batched at all (a captured bias), the result is the
same op on the physical tensors: their duals are made (a constant's tangent an explicit
zero, as forward AD's ZeroTensor would cost a trip through Python references), the op
runs once with forward AD doing its formula in C++, and the primal and tangent come back
batched at dim 0, as the vmap level's pointwise rule gives them (examples of fewer dims
get size-1 dims after the batch dim, so that they broadcast as they would unbatched). A
number where the op takes a tensor (``x * 0.5``) makes the op its Scalar overload, as the
usual way does, whose formula needs no tangent for it.

``jacfwd``'s primal is one for all its basis tangents: the vmap level does not batch it.
Where the tangents have few elements, the op runs on one copy of the primal per tangent
and keeps the first copy of the primal's result, still unbatched (Python control flow and
``has_aux`` read it). Past that size the copies would cost more than the trips they save.

Anything else takes the usual way: a batch dim elsewhere, a tensor autograd outside
tracks, an expanded primal (make_dual refuses its shared memory), 0-dim examples, a
primal batched by a vmap level further out (``vmap(jacfwd(f))``)."""

from __future__ import annotations

import torch

from torchlevels._level import LevelTensor, autograd_on, requires_grad_flag
from torchlevels.batching.dims import pad_to_rank
from torchlevels.batching.registry import per_op
from torchlevels.vmap import BatchLevel, wrap_batched
from torchlevels.zero_tangents import SCALAR_OVERLOADS

_make_dual, _unpack_dual = torch._VF._make_dual, torch._VF._unpack_dual
_set_grad_enabled = torch._C._set_grad_enabled
_NUMBERS = (int, float, bool)  # (a complex number takes the usual way)
# the most elements of a tangent whose unbatched primal is run on one copy per example
_EXPANDED_PRIMAL_LIMIT = 1 << 13


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
    if positions is None or not isinstance(batch.__dict__.get("_level"), BatchLevel) or (
            kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values())):
        return None  # (keyword arguments such as alpha or rounding_mode go along as they are)
    duals = []  # (physical primal, its tangent or None, whether batched at dim 0)
    primal_batched = False  # whether a primal is a tensor of the vmap level
    rank = low = 0  # the most and the fewest dims of the batched physical tensors
    others = 0  # one more than the most dims of a tensor without a batch dim
    for i, a in enumerate(args):
        if type(a) is cls and a._tangent is None:  # a constant of the jvp level
            if "_view_of" in a.__dict__:  # (a view that may get its base's tangent)
                return None
            a = a._inner
        if type(a) is cls:  # with a tangent batched at the vmap level
            p, t = a._inner, a._tangent
            if type(t) is not batch or t._bdim:
                return None
            t = t._inner
            if type(p) is batch and not p._bdim:
                p = p._inner
                primal_batched = True
                if not _primal(p):
                    return None
            elif type(p) is torch.Tensor and t.numel() <= _EXPANDED_PRIMAL_LIMIT:
                # a primal the vmap level does not batch (jacfwd's): run on copies of it,
                # one per example (few elements), and keep one of the primal's results
                if p.shape != t.shape[1:] or not _primal(p):
                    return None
                p = p.expand(t.shape).contiguous()  # (a dual holds no overlapping memory)
            else:
                return None
            if not _plain(t) or p.shape != t.shape:
                return None
        elif type(a) is batch:  # batched, with no tangent
            p = a._inner
            if a._bdim or not _primal(p):
                return None
            primal_batched = True
            t = _zero_tangent(p)
        elif type(a) is torch.Tensor:  # batched by neither level (a captured bias)
            if not _primal(a):
                return None
            others = max(others, a.dim() + 1)
            duals.append((a, _zero_tangent(a), False))
            continue
        elif type(a) not in _NUMBERS:  # a list, None...
            return None
        else:
            if i in positions:  # a number where the op takes a tensor (x * 0.5)
                if i != 1 or func not in SCALAR_OVERLOADS:
                    return None  # (forward AD would give it a ZeroTensor tangent)
                func = SCALAR_OVERLOADS[func]  # whose formula has no second tangent
            duals.append((a, None, False))
            continue
        r = p.dim()
        rank, low = max(rank, r), min(low, r) if low else r
        duals.append((p, t, True))
    if low < 2 or others > rank:
        # no batched tensor, 0-dim examples (whose dtype promotes differently), or a
        # tensor of more dims than the examples: the vmap level's rule decides
        return None
    with autograd_on():  # (forward AD runs at autograd's keys)
        args = []
        for p, t, batched in duals:
            if batched:  # examples of fewer dims broadcast as they would unbatched
                p = pad_to_rank(p, rank - 1)
                t = None if t is None else pad_to_rank(t, rank - 1)
            args.append(p if t is None else _make_dual(p, t, level=level))
        enabled = torch.is_grad_enabled()
        _set_grad_enabled(False)  # forward AD alone
        try:
            out = func._op(*args, **kwargs)
        finally:
            _set_grad_enabled(enabled)
        primal, tangent = _unpack_dual(out, level)
    if tangent is None or tangent._is_zerotensor():
        return None  # (a known zero, sgn's derivative: the usual way makes it no tangent)
    primal = wrap_batched(batch, primal, 0) if primal_batched else primal[0].clone()
    return primal, wrap_batched(batch, tangent, 0)


def _zero_tangent(t: torch.Tensor) -> torch.Tensor | None:
    """An explicit zero tangent for constant ``t``, if it can have one (a mask cannot)."""
    if t.is_floating_point() or t.is_complex():
        return t.new_zeros(()).expand(t.shape)
    return None


def _primal(t: torch.Tensor) -> bool:
    """Whether ``t`` can be the primal of a dual tensor made here: plain, not a ZeroTensor,
    and with no elements sharing memory (an expanded tensor, which make_dual refuses)."""
    return _plain(t) and not t._is_zerotensor() and torch._debug_has_internal_overlap(t) == 0


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain tensor no autograd outside tracks, with no lazy bits."""
    return (type(t) is torch.Tensor and not requires_grad_flag(t) and not t.is_conj()
            and not t.is_neg())

