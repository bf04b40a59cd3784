"""Ops that forward-mode AD calls by itself (make_dual's layout checks) on batched tensors."""

from __future__ import annotations

import torch

from torchlevels._level import LevelTensor, autograd_on
from torchlevels.batching.dims import logical_shape, materialize, span
from torchlevels.batching.registry import batch_size, register

aten = torch.ops.aten


@register(aten._has_same_storage_numel)
def has_same_storage_numel(func, args, dims, kwargs):
    """Compare the storage each example sees (see :func:`example_storage_numel`).

    Examples with no elements count as alike: their layouts are arbitrary (the slab an
    empty view of one example sees differs with its tangent's batching), and forward AD
    compares a view's primal with its tangent this way before it accepts the tangent.
    """
    (a, b), (da, db) = args, dims
    if not a.numel() and not b.numel():
        return True, None
    return example_storage_numel(a, da) == example_storage_numel(b, db), None


def example_storage_numel(t: torch.Tensor, bdim: int | None) -> int:
    """The storage size one example of ``t`` sees.

    A batched tensor whose batch dim is outermost in its storage gives each example a
    slab of ``stride(bdim)`` elements. Examples interleaved in storage (a batch dim that is
    not outermost, say ``in_dims=1``) each see the whole storage. Wrappers of other levels
    see their inner storage. :func:`new_zeros_with_same_feature_meta` lays tangents out
    from examples of exactly this size, so such a tangent compares equal to its primal.
    """
    n = _storage_numel(t)
    if bdim is None:
        return n
    size, stride = t.shape[bdim], t.stride(bdim)
    return stride if size > 0 and stride * size == n else n


def _storage_numel(t: torch.Tensor) -> int:
    if isinstance(t, LevelTensor):
        return example_storage_numel(t._inner, getattr(t, "_bdim", None))
    return t.untyped_storage().nbytes() // t.element_size()


@register(aten._new_zeros_with_same_feature_meta)
def new_zeros_with_same_feature_meta(func, args, dims, kwargs):
    """Zeros with ``other``'s (logical) layout after ``self``'s batch dims, plus ours first."""
    self, other = args
    size = batch_size(args, dims)
    sample = other if dims[1] is None else _example(other, dims[1])
    n = kwargs.get("self_num_batch_dims", 0)
    return func(materialize(self, dims[0], size), sample, self_num_batch_dims=n + 1), 0


def _example(t: torch.Tensor, bdim: int) -> torch.Tensor:
    """A tensor laid out as one example of ``t`` (sizes, strides, offset) whose storage is
    the one that example sees (:func:`example_storage_numel`), for ops that read it."""
    sizes, strides = logical_shape(t, bdim), t.stride()[:bdim] + t.stride()[bdim + 1:]
    numel, offset, reach = example_storage_numel(t, bdim), t.storage_offset(), span(sizes, strides)
    if reach and offset + reach > numel:  # a layout that does not fit is taken as it is
        return t.select(bdim, 0)
    # a plain tensor, also for another level's: only its layout is read
    return torch.empty(numel, dtype=t.dtype, device=t.device).as_strided(sizes, strides, offset)


@register(aten._fw_primal)
def fw_primal(func, args, dims, kwargs):
    """The primal of a batched dual tensor: the physical tensor's primal, batched alike."""
    with autograd_on():  # the op only exists with autograd on
        return func(*args, **kwargs), dims[0]
