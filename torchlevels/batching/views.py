"""Own rules for views and shape ops: the batch dim goes first and every dim shifts by one."""

from __future__ import annotations

import math

import torch

from torchlevels.batching.dims import (
    logical_shape,
    materialize,
    pad_to_rank,
    rows,
    span,
    to_front,
    wrap_dim,
)
from torchlevels.batching.reductions import dim_rule
from torchlevels.batching.registry import batch_size, register

aten = torch.ops.aten


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten._reshape_alias.default, aten.view_copy.default)
def view(func, args, dims, kwargs):
    x = to_front(args[0], dims[0])
    shape = args[1]
    if x.shape[0] == 0 and -1 in shape:  # no examples: -1 is ambiguous in [0, ..., -1, ...]
        known = math.prod(s for s in shape if s != -1)
        if known:
            shape = [math.prod(x.shape[1:]) // known if s == -1 else s for s in shape]
    # view stays view: with the batch in front, the batch views as [B, *shape] exactly when
    # every example views as shape, so an example that a loop could not view fails here too
    # (a copy would let a write through the "view" miss the base)
    # view_copy copies, so (as in eager) an example that cannot be viewed is reshaped
    if func is aten.view_copy.default:
        return x.reshape(x.shape[0], *shape).clone(memory_format=torch.contiguous_format), 0
    op = x.view if func is aten.view.default else x.reshape
    return op(x.shape[0], *shape), 0


@register(aten.view_as_real, aten.view_as_complex)
def view_as_real_or_complex(func, args, dims, kwargs):
    """The batch dim goes first, out of the way of the trailing (real, imag) dim."""
    return func(to_front(args[0], dims[0]), **kwargs), 0


@register(aten.view.dtype)
def view_dtype(func, args, dims, kwargs):
    x = to_front(args[0], dims[0])
    if x.dim() == 1:  # 0-dim examples: torch's error if the element size changes
        func(torch.empty((), dtype=x.dtype, device="meta"), args[1])
    return x.view(args[1]), 0


@register(aten.permute.default)
def permute(func, args, dims, kwargs):
    x, order = args
    rank = x.dim() - 1
    return to_front(x, dims[0]).permute(0, *(wrap_dim(d, rank) + 1 for d in order)), 0


@register(aten.transpose.int)
def transpose(func, args, dims, kwargs):
    x, d0, d1 = args
    rank = x.dim() - 1
    if rank == 0:
        wrap_dim(d0, 0), wrap_dim(d1, 0)  # torch's error for a dim a 0-dim example lacks
        return x, dims[0]
    return to_front(x, dims[0]).transpose(wrap_dim(d0, rank) + 1, wrap_dim(d1, rank) + 1), 0


@register(aten.t.default)
def t(func, args, dims, kwargs):
    x = to_front(args[0], dims[0])
    if x.dim() > 3:
        raise RuntimeError(f"{func._opname}() expects a tensor with <= 2 dimensions, but self "
                           f"is {x.dim() - 1}D")  # torch's error, for one example
    return (x.transpose(1, 2) if x.dim() == 3 else x), 0


@register(aten.expand.default)
def expand(func, args, dims, kwargs):
    x, size = args[0], args[1]
    x = pad_to_rank(to_front(x, dims[0]), len(size))
    return x.expand(x.shape[0], *size), 0


@register(aten.squeeze.default)
def squeeze(func, args, dims, kwargs):
    x = to_front(args[0], dims[0])
    ones = [d for d in range(1, x.dim()) if x.shape[d] == 1]
    return (x.squeeze(ones) if ones else x), 0


@register(aten.unsqueeze.default)
def unsqueeze(func, args, dims, kwargs):
    x, d = args
    return to_front(x, dims[0]).unsqueeze(wrap_dim(d, x.dim()) + 1), 0


@register(aten.select.int)
def select(func, args, dims, kwargs):
    x, d, index = args
    return to_front(x, dims[0]).select(wrap_dim(d, x.dim() - 1) + 1, index), 0


@register(aten.slice.Tensor)
def slice_(func, args, dims, kwargs):
    x, d, *rest = (*args, 0) if len(args) == 1 else args
    return func(to_front(x, dims[0]), wrap_dim(d, x.dim() - 1) + 1, *rest, **kwargs), 0


@register(aten.diagonal.default)
def diagonal(func, args, dims, kwargs):
    x, offset, d1, d2 = (list(args) + [0, 0, 1][len(args) - 1 :])[:4]
    rank = x.dim() - 1
    return to_front(x, dims[0]).diagonal(offset, wrap_dim(d1, rank) + 1,
                                         wrap_dim(d2, rank) + 1), 0


@register(aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default,
          aten.tensor_split.sections, aten.tensor_split.indices, aten.chunk.default)
def split(func, args, dims, kwargs):
    x, *rest = args
    if func is aten.unbind.int:
        sizes, d = [], (rest[0] if rest else 0)
    else:
        sizes, d = rest[:1], (rest[1] if len(rest) > 1 else 0)
    outs = func(to_front(x, dims[0]), *sizes, wrap_dim(d, x.dim() - 1) + 1, **kwargs)
    return outs, type(outs)(0 for _ in outs)


@register(aten.cat.default)
def cat(func, args, dims, kwargs):
    tensors, d = args[0], (args[1] if len(args) > 1 else 0)
    size = batch_size(args, dims)
    # cat skips 1-D empty tensors whatever the rank of the others (legacy behaviour): such
    # a tensor goes in as a 1-D empty tensor, which torch.cat skips too, while its dtype
    # and autograd's graph keep it, as each example's call does
    legacy = [logical_shape(t, td) == (0,) for t, td in zip(tensors, dims[0])]
    if all(legacy):
        legacy = [False] * len(tensors)
    rank = next(len(logical_shape(t, td)) for t, td, skip in zip(tensors, dims[0], legacy)
                if not skip)
    return torch.cat([t.reshape(0) if skip else materialize(t, td, size)
                      for t, td, skip in zip(tensors, dims[0], legacy)],
                     wrap_dim(d, rank) + 1), 0


@register(aten.stack.default)
def stack(func, args, dims, kwargs):
    tensors, d = args[0], (args[1] if len(args) > 1 else 0)
    size = batch_size(args, dims)
    first = tensors[0]
    rank = first.dim() - (dims[0][0] is not None)
    phys = [materialize(t, td, size) for t, td in zip(tensors, dims[0])]
    return torch.stack(phys, wrap_dim(d, rank + 1) + 1), 0


@register(aten.unfold.default)
def unfold(func, args, dims, kwargs):
    x, d, size, step = args
    x = to_front(x, dims[0])
    if x.dim() == 1:  # a 0-dim tensor unfolds as if it had one dim of size 1
        return x.unsqueeze(1).unfold(1, size, step).squeeze(1), 0
    return x.unfold(wrap_dim(d, x.dim() - 1) + 1, size, step), 0


@register(aten.diagonal_scatter, aten.select_scatter, aten.slice_scatter)
def scatter_view(func, args, dims, kwargs):
    """Write ``src`` into a view of ``input``: both batched first, the view's dims shift."""
    x, src, *rest = args
    size = batch_size(args, dims)
    x, src = materialize(x, dims[0], size), materialize(src, dims[1], size)
    rank = x.dim() - 1
    if func.overloadpacket is aten.diagonal_scatter:
        offset, d1, d2 = (list(rest) + [0, 0, 1][len(rest):])[:3]
        return func(x, src, offset, wrap_dim(d1, rank) + 1, wrap_dim(d2, rank) + 1), 0
    d, *more = rest or [0]
    return func(x, src, wrap_dim(d, rank) + 1, *more, **kwargs), 0


@register(aten.select_backward.default, aten.slice_backward.default,
          aten.diagonal_backward.default)
def view_backward(func, args, dims, kwargs):
    """The gradient of a view's input: the op itself on the gradient batched first, with
    the batch prepended to ``input_sizes`` and the view's dims shifted by one (one kernel,
    where the decomposition makes zeros and scatters into them op by op)."""
    grad, sizes, *rest = args
    grad = to_front(grad, dims[0])
    rank = len(sizes)
    if func is aten.diagonal_backward.default:
        offset, d1, d2 = rest
        rest = [offset, wrap_dim(d1, rank) + 1, wrap_dim(d2, rank) + 1]
    else:
        rest[0] = wrap_dim(rest[0], rank) + 1
    return func(grad, [grad.shape[0], *sizes], *rest, **kwargs), 0


@register(aten.repeat.default)
def repeat(func, args, dims, kwargs):
    x, repeats = args
    x = pad_to_rank(to_front(x, dims[0]), len(repeats))
    return x.repeat(1, *repeats), 0


@register(aten.roll.default)
def roll(func, args, dims, kwargs):
    x, shifts, *rest = args
    d = rest[0] if rest else []
    x = to_front(x, dims[0])
    if not d:  # roll the flattened tensor
        return rows(x).roll(shifts, 1).reshape(x.shape), 0
    return x.roll(shifts, [wrap_dim(i, x.dim() - 1) + 1 for i in d]), 0


# In-place view ops: the physical result of the out-of-place op becomes the wrapper's
# new inner tensor (the vmap level updates the wrapper's logical shape).
register(aten.squeeze_.default)(squeeze)
register(aten.unsqueeze_.default)(unsqueeze)


@register(aten.squeeze_.dim, aten.squeeze_.dims)
def squeeze_dims_(func, args, dims, kwargs):
    x, d = args
    return dim_rule(aten.squeeze.dims, (x, [d] if isinstance(d, int) else d), dims, kwargs)


register(aten.transpose_.default)(transpose)
register(aten.t_.default)(t)


@register(aten.as_strided.default)
def as_strided(func, args, dims, kwargs):
    """Each example's sizes, strides and storage offset are relative to its own storage,
    which starts one batch stride after the previous example's (as functorch reads it)."""
    x, size, stride, *rest = args
    offset = rest[0] if rest and rest[0] is not None else x.storage_offset()
    d = dims[0]
    if len(size) == len(stride):  # (else as_strided's own error below)
        check_within_example(x, d, size, stride, offset)
    return x.as_strided([x.shape[d], *size], [x.stride(d), *stride], offset), 0


def check_within_example(x, d, size, stride, offset) -> None:
    """Raise torch.func's error where ``as_strided(size, stride, offset)`` of example 0
    (and so, one batch stride on, of every example) reaches memory outside the range its
    own elements span: there the batched view would read another example's memory, or
    memory of no example, where each example's call reads its own."""
    reach = span(size, stride)
    if not reach:  # the result holds no elements
        return
    shape, strides = logical_shape(x, d), x.stride()[:d] + x.stride()[d + 1 :]
    first, own = x.storage_offset(), span(shape, strides)
    if first <= offset and offset + reach <= first + own:
        return
    where = (f"`tensor` can only access some memory in range [{first}, {first + own}]"
             if own else "`tensor` has no storage")
    raise RuntimeError(
        f"result = tensor.as_strided({list(size)}, {list(stride)}, {offset}) can access "
        f"memory outside of `tensor`. `result` can access some memory in range [{offset}, "
        f"{offset + reach}], but {where}. This is not supported inside of vmap, please "
        "try to rewrite the `as_strided` call as a sequence of PyTorch view operations"
    )


@register(aten.as_strided_scatter.default)
def as_strided_scatter(func, args, dims, kwargs):
    """Each example's result is a clone of its input (a storage of its own, in the input's
    layout when that is dense) with ``src`` written through ``as_strided`` of that storage:
    lay the clones out one block per example and write through one batched ``as_strided``.
    (A loop over the examples would address the batch's shared storage instead.)"""
    x, src, size, stride, *rest = args
    offset = (rest[0] if rest else kwargs.get("storage_offset")) or 0
    n = batch_size(args, dims)
    x, src = materialize(x, dims[0], n), materialize(src, dims[1], n)
    if list(src.shape[1:]) != list(size):
        raise RuntimeError(
            "expected src to have a size equal to the slice of self. "
            f"src size = {list(src.shape[1:])}, slice size = {list(size)}"
        )
    shape = x.shape[1:]
    layout = torch.empty_strided(shape, x.stride()[1:], device="meta").clone().stride()
    extent = max(span(shape, layout), 1)
    out = x.new_empty_strided((n, *shape), (extent, *layout))
    out.copy_(x)
    out.as_strided((n, *size), (extent, *stride), offset).copy_(src)
    return out, 0


@register(aten.new_empty_strided.default)
def new_empty_strided(func, args, dims, kwargs):
    """Batched: one block of storage per example, laid out with the given strides (as
    torch.func's, none for examples of no elements: a batch stride of 0)."""
    x, size, stride = args
    return func(x, [x.shape[dims[0]], *size], [span(size, stride), *stride], **kwargs), 0


register(aten.as_strided_.default)(as_strided)  # out of place: the wrapper takes the view


@register(aten.resize_)
def inplace_resize(func, args, dims, kwargs):
    """Each example resized on its own, as a loop would: it keeps the first elements of
    its block of storage (on growing, the new ones are uninitialized, as eager's).

    Where each block holds the new size, the wrapper takes a view of it (no element moves,
    and views of the tensor keep seeing its memory); otherwise the examples move to new
    storage, one block each, which views taken before no longer share (eager grows one
    storage that they share). Where the batch interleaves the examples' elements (a
    layout of vmap's making), each keeps its elements in memory order, as its own tensor
    would. (torch.func resizes the batch as one tensor, so that its examples take one
    another's elements.)"""
    x, size = args[:2]
    memory_format = kwargs.get("memory_format")
    if memory_format not in (None, torch.contiguous_format):
        raise RuntimeError(
            f"vmap: {func} with memory_format={memory_format} is not supported: only the "
            "contiguous format can be batched. Resize, then call .contiguous(memory_format=...)."
        )
    if x.requires_grad:
        raise RuntimeError("cannot resize variables that require grad")
    if tuple(size) == logical_shape(x, dims[0]):
        return x, dims[0]  # eager changes nothing, not even the strides
    x = to_front(x, dims[0])
    b, n, start = x.shape[0], math.prod(size), x.storage_offset()
    if b == 0:
        return x.new_empty((0, *size)), 0
    step = x.stride(0) if b > 1 else 0
    if type(x) is torch.Tensor and (b == 1 or step >= span(x.shape[1:], x.stride()[1:])):
        # each example has a block of storage: the memory up to the next one's
        last = x.untyped_storage().nbytes() // x.element_size() - start - (b - 1) * step
        block = max(0, min(step, last) if b > 1 else last)
        if block >= n:
            layout = torch.empty(size, device="meta").stride()
            return x.as_strided((b, *size), (step, *layout), start), 0
        kept = x.as_strided((b, block), (step, 1), start)
    else:  # a level's tensor (no storage of its own), or interleaved examples
        order = sorted(range(1, x.dim()), key=lambda d: -x.stride(d))  # memory order
        kept = x.permute(0, *order).reshape(b, -1)[:, :n]
    out = x.new_empty((b, *size))
    out.view(b, n)[:, :kept.shape[1]] = kept
    return out, 0


@register(aten.resize_as_.default)
def inplace_resize_as(func, args, dims, kwargs):
    """``resize_`` to the template's size, the same for every example: an unbatched tensor
    is resized once, as a loop would resize it again and again."""
    x, template = args[:2]
    size = logical_shape(template, dims[1])
    if dims[0] is None:
        return aten.resize_.default(x, size, **kwargs), None
    return inplace_resize(aten.resize_.default, (x, size), dims[:1], kwargs)
