"""The pointwise family: every op tagged ``torch.Tag.pointwise``, plus copy_, the *_like ops and
a few elementwise ops PyTorch leaves untagged (hardswish, floor_divide, rsub, fill).

Batch dims go first and batched tensors get size-1 dims after the batch dim so that
logical shapes broadcast as they would unbatched. In-place ops write into the batched
``self`` and refuse an unbatched ``self`` that would receive batched values.
"""

from __future__ import annotations

import torch
from torch._prims import _prim_elementwise_meta
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from torchlevels.batching.dims import (
    example_meta,
    logical_shape,
    materialize,
    pad_to_rank,
    to_front,
)
from torchlevels.batching.registry import (
    batch_size,
    out_of_place,
    raise_inplace_unbatched_self,
    register,
    register_family,
    writes_first_argument,
)

aten = torch.ops.aten
DEFAULT_PROMOTION = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT


def pointwise_rule(func, args, dims, kwargs):
    """Batch any op whose outputs are elementwise functions of broadcast inputs."""
    batched_rank = -1  # logical rank of the batched tensors, if they all agree
    rank = 0  # the largest logical rank of any tensor argument
    fast = True
    scalar_batched = False
    dtypes = set()
    for a, d in zip(args, dims):
        if isinstance(a, torch.Tensor):
            r = a.dim() - (d is not None)
            rank = max(rank, r)
            if d is not None:
                fast = fast and d == 0 and batched_rank in (-1, r)
                batched_rank = r
                scalar_batched = scalar_batched or r == 0
            dtypes.add(a.dtype)
        elif d is not None:
            raise NotImplementedError(f"vmap: {func} got a batched list; no pointwise rule for it")
    fast = fast and rank == batched_rank  # no unbatched tensor outranks the batched ones
    written = writes_first_argument(func)
    if dims[0] is None and written:
        raise_inplace_unbatched_self(func)
    if not fast and written:
        _check_written_shape(args, dims)
    promote = scalar_batched and len(dtypes) > 1
    if fast and not promote:
        return broadcasting(func, args, kwargs), 0
    phys = [pad_to_rank(to_front(a, d), rank) if d is not None else a for a, d in zip(args, dims)]
    if not promote:
        return broadcasting(func, phys, kwargs), 0
    logical = example_meta(args, dims)
    try:  # one example's output dtype, and the error of an op that refuses mixed dtypes
        example = func(*logical, **kwargs)
    except NotImplementedError:  # no meta kernel
        example = None
    except RuntimeError:  # a meta kernel stricter than the real one (bool << int8 tensors)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        example = func(*(torch.ones(t.shape, dtype=t.dtype, device=device)
                         if isinstance(t, torch.Tensor) else t for t in logical), **kwargs)
    out_dtype = example.dtype if isinstance(example, torch.Tensor) else None
    dtype = _computation_dtype(logical, out_dtype)
    phys = _promote_batched_scalars(phys, dims, logical, dtype, written)
    if (written and logical[0].dim() == 0 and phys[0].dtype != dtype
            and torch.can_cast(dtype, phys[0].dtype)):
        # each example computes in the dtype its 0-dim tensors promote to and casts the
        # result into self (uint8 4 %= an int64 -3 is 254); self, batched, has a dim, so
        # the kernel alone would compute in self's dtype (4 % 253). A cast self's dtype
        # refuses (a bool self times an int64) is left to the kernel, which raises it
        return phys[0].copy_(func(phys[0].to(dtype), *phys[1:], **kwargs)), 0
    out = broadcasting(func, phys, kwargs)
    if isinstance(example, torch.Tensor) and out.dtype != example.dtype:
        out = out.to(example.dtype)  # an op that keeps one input's dtype (masked_fill)
    return out, 0


def _check_written_shape(args, dims) -> None:
    """Raise each example's error when an in-place op's other tensors broadcast to more
    than its ``self``: padded to their rank, ``self`` would take the op's result and
    silently change shape (a 0-dim example times a 1-element vector, in place)."""
    shapes = [logical_shape(a, d) for a, d in zip(args, dims) if isinstance(a, torch.Tensor)]
    broadcast = torch.broadcast_shapes(*shapes)
    if broadcast != shapes[0]:
        raise RuntimeError(f"output with shape {list(shapes[0])} doesn't match the broadcast "
                           f"shape {list(broadcast)}")


def broadcasting(func, args, kwargs):
    """``func(*args)``, its tensors expanded to one shape where the kernel rejects
    broadcasting them (float32 gelu_backward on the CPU, through oneDNN). Not where a
    kernel is missing for the dtype: expanded, a 0-dim tensor would promote as a
    dimensioned one, and the retry would run in another dtype than the op's."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if (writes_first_argument(func) or isinstance(error, NotImplementedError)
                or len({t.shape for t in tensors}) < 2):
            raise
        try:
            expanded = _broadcast(args)
        except RuntimeError:
            raise error from None
        return func(*expanded, **kwargs)


def _broadcast(args) -> list:
    """``args`` with their tensors expanded to their one broadcast shape."""
    tensors = iter(torch.broadcast_tensors(*(a for a in args if isinstance(a, torch.Tensor))))
    return [next(tensors) if isinstance(a, torch.Tensor) else a for a in args]


def _computation_dtype(logical, out_dtype) -> torch.dtype:
    """The dtype one example's tensors ``logical`` promote to: the result dtype, not the
    computation dtype (float32 for bfloat16 inputs), as the kernel computes in that
    itself. An op that computes integers as floats (div, atan2) gives its float dtype
    ``out_dtype``."""
    _, dtype = elementwise_dtypes(*(t for t in logical if isinstance(t, torch.Tensor)),
                                  type_promotion_kind=DEFAULT_PROMOTION)
    if out_dtype is not None and out_dtype.is_floating_point and not (
            dtype.is_floating_point or dtype.is_complex):
        return out_dtype
    return dtype


def _promote_batched_scalars(phys, dims, logical, dtype, written: bool):
    """Cast batched 0-dim tensors to ``dtype``, the one the unbatched op's inputs promote
    to (see :func:`_computation_dtype`).

    Physically a batched 0-dim tensor has a dim, so it would take part in type promotion
    as a dimensioned tensor (float64 "scalar" + float32 vector giving float64). A float
    "scalar" in a complex result takes the result's real dtype (float64 "scalar" *
    complex64 vector is complex64). An in-place op's ``self`` keeps its dtype
    (``written``). An op that computes integers as floats casts each straight to its float
    dtype: an int8 -3 "scalar" is not made the 253 of a uint8 vector's dtype on the way.
    Where every tensor of an example has 0 dims, the unbatched ones are cast too: each
    takes part in the example's promotion as fully as the batched ones (lerp of three
    such tensors wants them in one dtype).
    """
    scalars = all(t.dim() == 0 for t in logical if isinstance(t, torch.Tensor))
    return [
        _as_scalar_of(p, dtype) if (isinstance(t, torch.Tensor) and t.dim() == 0
                                    and (d is not None or scalars)
                                    and not (written and k == 0)) else p
        for k, (p, d, t) in enumerate(zip(phys, dims, logical))
    ]


def _as_scalar_of(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Batched 0-dim ``p`` in the dtype of its category that promotes to ``dtype``."""
    if p.dtype == dtype or p.dtype == torch.bool:
        return p
    if (p.is_floating_point(), p.is_complex()) == (dtype.is_floating_point, dtype.is_complex):
        return p.to(dtype)
    if p.is_floating_point() and dtype.is_complex:
        return p.to(dtype.to_real())
    return p


def _is_pointwise(func) -> bool:
    if torch.Tag.pointwise in func.tags:
        return True
    # in-place variants PyTorch leaves untagged (abs_, copysign_): as their own op is
    functional = out_of_place(func) if writes_first_argument(func) else None
    return functional is not None and torch.Tag.pointwise in functional.tags


register_family("pointwise", _is_pointwise, pointwise_rule)
register(aten.copy_.default)(pointwise_rule)


@register(aten.complex, aten.polar)
def complex_parts(func, args, dims, kwargs):
    """``torch.complex``, ``torch.polar``: pointwise, of two tensors of one dtype, which
    their meta kernels do not check (torch's error: examples of 0 dims would promote)."""
    first, second = (a.dtype for a in args[:2])
    if first != second:
        raise RuntimeError(f"Expected object of scalar type {_NAMES[first]} but got scalar "
                           f"type {_NAMES[second]} for second argument")
    return pointwise_rule(func, args, dims, kwargs)


@register(aten.heaviside.default, aten.heaviside_.default)
def heaviside(func, args, dims, kwargs):
    """``torch.heaviside``: pointwise, of two tensors of one dtype, which its meta kernel
    does not check (and batched 0-dim tensors, promoted, would come to one dtype)."""
    if args[0].dtype != args[1].dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different "
                           "dtypes.")
    return pointwise_rule(func, args, dims, kwargs)


_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
          torch.float64: "Double"}
# elementwise ops PyTorch leaves untagged, which would otherwise decompose into several
register(aten.hardswish.default, aten.hardswish_.default, aten.floor_divide.default,
         aten.floor_divide.Scalar, aten.floor_divide_.Tensor, aten.floor_divide_.Scalar,
         aten.rsub.Tensor, aten.fill.Scalar)(pointwise_rule)


@register(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)
def fill_(func, args, dims, kwargs):
    """``fill_``, ``zero_``: the kernel on the batch in whatever layout it has. Like it, a
    fill with a number writes every element, also those an expanded tensor shares (the
    decomposition's ``copy_`` refuses those, as PyTorch does for a fill with a tensor)."""
    if dims[0] is None:
        raise_inplace_unbatched_self(func)
    if len(dims) < 2 or dims[1] is None:
        return func(*args, **kwargs), dims[0]
    x = to_front(args[0], dims[0])  # a view: the writes reach args[0]
    x.copy_(to_front(args[1], dims[1]).view(-1, *[1] * (x.dim() - 1)).expand_as(x))
    return args[0], dims[0]


@register(torch.ops.prims.where.default)
def prims_where(func, args, dims, kwargs):
    """``prims.where(pred, a, b)``: elementwise, but its tensors must have one shape (no
    broadcasting), so every one is batched at the front and expanded to the same shape."""
    size = batch_size(args, dims)
    rank = max(a.dim() - (d is not None) for a, d in zip(args, dims)
               if isinstance(a, torch.Tensor))
    phys = [pad_to_rank(materialize(a, d, size), rank) if isinstance(a, torch.Tensor) else a
            for a, d in zip(args, dims)]
    return func(*_broadcast(phys), **kwargs), 0


@register(aten.copy.default)
def copy(func, args, dims, kwargs):
    """``copy(self, src)``: src broadcast into self's shape, so self needs the batch dim."""
    self, src, *rest = args
    size = batch_size(args, dims)
    rank = self.dim() - (dims[0] is not None)
    src = pad_to_rank(to_front(src, dims[1]), rank) if dims[1] is not None else src
    return func(materialize(self, dims[0], size), src, *rest, **kwargs), 0


@register(aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full)
def new_factory(func, args, dims, kwargs):
    """``x.new_zeros(size)`` with a batched ``x`` is batched (later writes may be batched)."""
    x, size, *rest = args
    return func(x, [x.shape[dims[0]], *size], *rest, **kwargs), 0


@register(
    aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.clone,
    aten._to_copy, aten.alias, aten.detach, aten.lift_fresh, aten._conj, aten._neg_view,
    aten.conj_physical, aten.resolve_conj, aten.resolve_neg,
)
def like_rule(func, args, dims, kwargs):
    """Ops whose output has the input's shape: run on the physical tensor as it is."""
    memory_format = kwargs.get("memory_format")
    if memory_format in _CHANNELS_LAST:
        return _channels_last(func, args, dims, kwargs, memory_format)
    if memory_format is torch.contiguous_format and dims[0]:  # contiguous examples too
        return func(to_front(args[0], dims[0]), *args[1:], **kwargs), 0
    return func(*args, **kwargs), dims[0]


_CHANNELS_LAST = {torch.channels_last: 4, torch.channels_last_3d: 5}


def _channels_last(func, args, dims, kwargs, memory_format):
    """Each example laid out channels-last: the batch dim outermost, channels innermost."""
    x = to_front(args[0], dims[0])
    out = func(x, *args[1:], **{**kwargs, "memory_format": torch.contiguous_format})
    if out.dim() != _CHANNELS_LAST[memory_format] + 1:
        # torch's rank error, as one example's call raises it (the batch, one dim more,
        # may have the rank the layout takes)
        func(*example_meta(args, dims), **kwargs)
    last = out.dim() - 1
    order = [0, 1, *range(3, last + 1), 2]  # (B, N, C, *spatial) -> (B, N, *spatial, C)
    back = [0, 1, last, *range(2, last)]
    return out.permute(order).contiguous().permute(back), 0


def elementwise_prim_rule(func, args, dims, kwargs):
    """prims.* elementwise ops (from torch._refs decompositions) need equal shapes, but
    for 0-dim CPU tensors, which the refs leave unbroadcast: each operand expanded to the
    batch of the examples' broadcast shape (a batched 0-dim example is no longer 0-dim)."""
    size = batch_size(args, dims)
    tensors = [materialize(a, d, size) for a, d in zip(args, dims)
               if isinstance(a, torch.Tensor)]
    shape = torch.broadcast_shapes(*(t.shape[1:] for t in tensors))
    expanded = iter(t if t.shape[1:] == shape else pad_to_rank(t, len(shape)).expand(
        size, *shape) for t in tensors)
    return func(*[next(expanded) if isinstance(a, torch.Tensor) else a for a in args],
                **kwargs), 0


def _is_elementwise_prim(func) -> bool:
    meta = getattr(func, "prim_meta_impl", None)
    return func.namespace == "prims" and getattr(meta, "func", None) is _prim_elementwise_meta


register_family("elementwise prim", _is_elementwise_prim, elementwise_prim_rule)
