"""Own rules for indexing ops: index, index_put, gather, scatter, index_select, embedding...

Three ideas cover them all. A batched ``self`` indexed by unbatched indices gets a
leading full slice (``None``) so the batch dim is carried along. Batched indices into a
batched ``self`` get a leading ``arange(B)`` index that pairs each example's indices
with its own slice of ``self``. Ops that take one index vector along ``dim`` (index_add,
index_copy, ...) with a batched index fold the batch into ``dim`` and offset each
example's indices by ``b * self.size(dim)``.

In-place variants write through a view of the batched ``self`` and refuse an unbatched
``self`` that would receive batched values. Ops whose output shape depends on the
values (nonzero, unique, masked_select over a batched mask) run where all examples, of
every vmap level, give as many values, and raise otherwise; torch.func always raises.
Indexing with a batched bool mask raises, as torch.func does.
"""

from __future__ import annotations

import math

import torch

from torchlevels._level import LevelTensor, autograd_records, memory_of
from torchlevels.batching.dims import (
    example_meta,
    logical_rank,
    logical_shape,
    materialize,
    pad_to_rank,
    rows,
    to_front,
    wrap_dim,
)
from torchlevels.batching.pointwise import pointwise_rule
from torchlevels.batching.registry import (
    batch_size,
    loop_rule,
    out_of_place,
    raise_inplace_unbatched_self,
    register,
    writes_first_argument,
)

aten = torch.ops.aten
MASK_DTYPES = (torch.bool, torch.uint8)


def _dynamic_shape_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"vmap: We do not support batching operators that can output dynamic shape. "
        f"Attempted to vmap over {what}: each example would give a differently shaped result."
    )


def _arange(size: int, rank: int, device) -> torch.Tensor:
    """``arange(size)`` shaped ``(size, 1, ..., 1)`` to broadcast against ``rank`` index dims."""
    return torch.arange(size, device=device).view(size, *(1,) * rank)


def _offset(index: torch.Tensor, length: int, wraps: bool = False) -> torch.Tensor:
    """Batch-first ``index`` into examples of ``length`` entries, offset by ``b * length``
    into their fold. An index out of an example's range (which the kernel refuses for one
    example) goes past them all, where the kernel refuses it too, instead of into another
    example's entries. ``wraps``: the op takes a negative index from the end (index_fill)."""
    if wraps:
        index = torch.where(index < 0, index + length, index)
    size = index.shape[0]
    offset = index + _arange(size, index.dim() - 1, index.device) * length
    return torch.where((index < 0) | (index >= length), size * length, offset)


def _move_block(x: torch.Tensor, n: int, src: int, dst: int) -> torch.Tensor:
    """Move the ``n`` consecutive dims starting at ``src`` so they start at ``dst``."""
    if n == 0 or src == dst:
        return x
    return x.movedim(tuple(range(src, src + n)), tuple(range(dst, dst + n)))


# -- advanced indexing: index.Tensor and index_put -------------------------------------------


def _block_position(indices: list) -> int | None:
    """Where the advanced-index result dims go: the first index's position when the
    non-None indices are adjacent, else None (numpy rules put them first)."""
    used = [i for i, t in enumerate(indices) if t is not None]
    if used and used[-1] - used[0] + 1 == len(used):
        return used[0]
    return None


def _index_rank(indices: list, index_dims: tuple) -> int:
    """The logical rank of the broadcast indices (a bool mask gives one dim)."""
    return max(
        (1 if t.dtype in MASK_DTYPES else logical_rank(t, d)
         for t, d in zip(indices, index_dims) if t is not None),
        default=0,
    )


def _indexed_rank(self_rank: int, indices: list) -> int:
    """The logical rank of ``self[indices]``, given the broadcast index rank."""
    consumed = sum(t.dim() if t.dtype in MASK_DTYPES else 1 for t in indices if t is not None)
    return self_rank - consumed


def _index_args(args, dims):
    """(self, self bdim, indices, index bdims), refusing batched bool masks."""
    self, indices = args[0], args[1]
    index_dims = dims[1] or (None,) * len(indices)
    for t, d in zip(indices, index_dims):
        if d is not None and t.dtype in MASK_DTYPES:
            raise _dynamic_shape_error("indexing with a batched boolean mask")
    return self, dims[0], indices, index_dims


def _batched_indices(indices, index_dims, rank):
    """Indices with batch dims first, padded so they broadcast with each other."""
    return [
        t if d is None else pad_to_rank(to_front(t, d), rank)
        for t, d in zip(indices, index_dims)
    ]


@register(aten.index.Tensor)
def index(func, args, dims, kwargs):
    """``self[indices]`` with a batched self and/or batched index tensors."""
    self, self_bdim, indices, index_dims = _index_args(args, dims)
    pos = _block_position(indices)
    rank = _index_rank(indices, index_dims)
    if all(d is None for d in index_dims):
        out = func(to_front(self, self_bdim), [None, *indices])
        # indices apart from each other put their result dims before the batch dim
        return out, 0 if pos is not None else rank
    phys = _batched_indices(indices, index_dims, rank)
    if self_bdim is None:
        # the batch dim of the indices lands where the indexed dims go
        return func(self, phys), pos or 0
    size = batch_size(args, dims)
    out = func(to_front(self, self_bdim), [_arange(size, rank, self.device), *phys])
    # the leading arange put [B, index dims] first; adjacent indices want them at `pos`
    return _move_block(out, rank, 1, 1 + (pos or 0)), 0


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(func, args, dims, kwargs):
    """``self[indices] = values`` (accumulate or not), out of place or in place."""
    self, self_bdim, indices, index_dims = _index_args(args, dims)
    values, rest = args[2], args[3:]
    inplace = writes_first_argument(func)
    if inplace and self_bdim is None:
        raise_inplace_unbatched_self(func)
    size = batch_size(args, dims)
    pos = _block_position(indices)
    rank = _index_rank(indices, index_dims)
    phys = [_arange(size, rank, self.device), *_batched_indices(indices, index_dims, rank)]
    # With the arange first, the indexed region is [B, index dims, other dims] whatever
    # the indices; values are given in the logical layout, so line them up with it.
    target = rank + _indexed_rank(logical_rank(self, self_bdim), indices)
    pos = pos or 0
    if dims[2] is None:
        if values.dim() == 0 and values.device != self.device:  # `x[i] = 1.0`: a CPU scalar
            values = values.to(self.device)
        values = values.reshape((1,) * (target - values.dim()) + values.shape)
        values = _move_block(values, rank, pos, 0)
    else:
        values = _move_block(pad_to_rank(to_front(values, dims[2]), target), rank, 1 + pos, 1)
    out = func(materialize(self, self_bdim, size), phys, values, *rest, **kwargs)
    return (self, self_bdim) if inplace else (out, 0)


# -- gather and scatter: index has the rank of self -----------------------------------------


def _with_dim(x, bdim, size, rank):
    """``x`` batched first, with a real dim when its logical rank is 0 (gather/scatter
    treat a 0-dim tensor as having one dim of size 1)."""
    x = materialize(x, bdim, size)
    return x.unsqueeze(-1) if rank == 0 else x


@register(aten.gather.default)
def gather(func, args, dims, kwargs):
    """gather along ``dim``: both tensors batched first, ``dim`` shifted by one."""
    self, dim, index, *rest = args
    size = batch_size(args, dims)
    self_rank, index_rank = logical_rank(self, dims[0]), logical_rank(index, dims[2])
    out = func(_with_dim(self, dims[0], size, self_rank), wrap_dim(dim, self_rank) + 1,
               _with_dim(index, dims[2], size, index_rank), *rest, **kwargs)
    return (out.squeeze(-1) if index_rank == 0 else out), 0


@register(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
          aten.scatter_.src, aten.scatter_.value, aten.scatter_.reduce, aten.scatter_.value_reduce,
          aten.scatter_add.default, aten.scatter_add_.default,
          aten.scatter_reduce.two, aten.scatter_reduce_.two)
def scatter(func, args, dims, kwargs):
    """scatter/scatter_add/scatter_reduce (and in place): all tensors batched first."""
    self, dim, index, src, *rest = args
    inplace = writes_first_argument(func)
    if inplace and dims[0] is None:
        raise_inplace_unbatched_self(func)
    size = batch_size(args, dims)
    self_rank = logical_rank(self, dims[0])
    if isinstance(src, torch.Tensor):
        src = _with_dim(src, dims[3], size, logical_rank(src, dims[3]))
    # for a 0-dim self, unsqueeze gives a view, so in-place ops still write into self
    out = func(_with_dim(self, dims[0], size, self_rank), wrap_dim(dim, self_rank) + 1,
               _with_dim(index, dims[2], size, logical_rank(index, dims[2])), src, *rest,
               **kwargs)
    if inplace:
        return self, dims[0]
    return (out.squeeze(-1) if self_rank == 0 else out), 0


# -- ops taking one index vector along dim ----------------------------------------------------


@register(aten.index_select.default)
def index_select(func, args, dims, kwargs):
    """index_select: slice along dim+1, or gather when the index is batched."""
    self, dim, index = args
    rank = logical_rank(self, dims[0])
    d = wrap_dim(dim, rank)
    if rank == 0:  # one entry: a one-entry vector's, whose index torch checks, and 0-dim again
        one = self.unsqueeze(0) if dims[0] is None else to_front(self, dims[0]).unsqueeze(1)
        one_dims = (None if dims[0] is None else 0, None, dims[2])
        out, _ = index_select(func, (one, 0, index), one_dims, kwargs)  # [B, entries]
        if out.shape[1] != 1:
            raise RuntimeError("index_select(): Index to scalar can have only 1 value, got "
                               f"{out.shape[1]} value(s)")
        return out.squeeze(1), 0
    if dims[2] is None:
        return func(to_front(self, dims[0]), d + 1, index), 0
    if index.dim() > 2:  # each example's index: torch's error
        raise IndexError("index_select(): Index is supposed to be a vector")
    size = batch_size(args, dims)
    index = rows(to_front(index, dims[2]))  # a 0-dim index acts as one entry
    if dims[0] is None:
        # one index_select for all examples; its output dim d splits into (B, n), moved to
        # the front and copied so each example is contiguous, as one example's output is
        # (a .view of it then works as in a loop)
        out = func(self, d, index.reshape(-1)).unflatten(d, index.shape)
        return out.movedim(d, 0).contiguous(), 0
    x = to_front(self, dims[0])
    shape = list(x.shape)
    shape[d + 1] = index.shape[1]
    index = index.view(size, *(1,) * d, index.shape[1], *(1,) * (rank - d - 1)).expand(shape)
    return x.gather(d + 1, index), 0


@register(aten.index_add.default, aten.index_add_.default, aten.index_copy.default,
          aten.index_copy_.default, aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar,
          aten.index_fill.int_Tensor, aten.index_fill_.int_Tensor, aten.index_reduce.default,
          aten.index_reduce_.default)
def index_update(func, args, dims, kwargs):
    """index_add/index_copy/index_fill/index_reduce (and in place) along ``dim``."""
    self, dim, index, source, *rest = args
    inplace = writes_first_argument(func)
    if inplace and dims[0] is None:
        raise_inplace_unbatched_self(func)
    size = batch_size(args, dims)
    rank = logical_rank(self, dims[0])
    d = wrap_dim(dim, rank) + 1
    x = materialize(self, dims[0], size)
    if rank == 0:  # a 0-dim self acts as one entry; unsqueeze keeps in-place writes in self
        x = x.unsqueeze(-1)
    fill = func.overloadpacket in (aten.index_fill, aten.index_fill_)
    source_bdim = None  # a fill value shared by all examples
    if fill and dims[3] is not None:
        if source.dim() != 1:  # each example's value: torch's error
            raise RuntimeError("index_fill_ only supports a 0-dimensional value tensor, but "
                               f"got tensor with {source.dim() - 1} dimension(s).")
        # a different fill value per example: a where over the filled entries (copying an
        # expanded value in would count a repeated index twice in the value's gradient)
        mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        if dims[2] is None:
            mask = mask.index_fill_(d, index, True)
        else:
            mask = _folded_update(aten.index_fill.int_Scalar, mask, d, index, dims[2], True,
                                  None, [], {})
        value = to_front(source, dims[3]).to(x.dtype).view(size, *(1,) * (x.dim() - 1))
        out = torch.where(mask, value, x)
        if inplace:
            x.copy_(out)
            return self, dims[0]
        return (out.squeeze(-1) if rank == 0 else out), 0
    if not fill:
        source, source_bdim = materialize(source, dims[3], size), 0
        if source.dim() < x.dim():  # a 0-dim source for a 0-dim self or index
            source = source.unsqueeze(-1)
    if dims[2] is None:
        out = func(x, d, index, source, *rest, **kwargs)
    else:
        out = _folded_update(out_of_place(func) if inplace else func, x, d, index, dims[2],
                             source, source_bdim, rest, kwargs)
        if inplace:
            x.copy_(out)
        else:
            out = out.contiguous()  # folding left each example strided, unlike one's own
    if inplace:
        return self, dims[0]
    return (out.squeeze(-1) if rank == 0 else out), 0


def _folded_update(func, x, d, index, index_bdim, source, source_bdim, rest, kwargs):
    """Run an index_* op with a batched index once: fold the batch into dim ``d`` and
    offset each example's indices by ``b * x.size(d)``, so examples stay apart."""
    size, length = x.shape[0], x.shape[d]
    wraps = func.overloadpacket in (aten.index_fill, aten.index_fill_)
    index = _offset(rows(to_front(index, index_bdim)), length, wraps).reshape(-1)
    folded = x.movedim(d, 1).flatten(0, 1)
    if source_bdim is not None:
        source = source.movedim(d, 1).flatten(0, 1)
    out = func(folded, 0, index, source, *rest, **kwargs)
    return out.unflatten(0, (size, length)).movedim(1, d)


# -- take, masked ops, data-dependent shapes --------------------------------------------------


@register(aten.take.default)
def take(func, args, dims, kwargs):
    """take: index each example's flattened self with a gather."""
    self, index = args
    size = batch_size(args, dims)
    flat = rows(materialize(self, dims[0], size))
    index = materialize(index, dims[1], size)
    flat_index = rows(index)
    # take accepts negative indices, gather does not (gather still checks the bounds)
    flat_index = torch.where(flat_index < 0, flat_index + flat.shape[1], flat_index)
    return flat.gather(1, flat_index).view(index.shape), 0


@register(aten.put.default)
def put(func, args, dims, kwargs):
    """put: scatter into each example's flattened self (scatter checks every index
    against its own example, where offsetting into one flat tensor would not)."""
    self, index, source, *rest = args
    accumulate = bool(rest[0]) if rest else kwargs.get("accumulate", False)
    size = batch_size(args, dims)
    x = materialize(self, dims[0], size)
    flat = rows(x)
    flat_index = rows(materialize(index, dims[1], size))
    flat_index = torch.where(flat_index < 0, flat_index + flat.shape[1], flat_index)
    flat_source = rows(materialize(source, dims[2], size))
    if flat_index.shape != flat_source.shape:  # torch's own message, from one example
        func(self.select(dims[0], 0) if dims[0] is not None else self,
             index.select(dims[1], 0) if dims[1] is not None else index,
             source.select(dims[2], 0) if dims[2] is not None else source, *rest, **kwargs)
    scatter = flat.scatter_add if accumulate else flat.scatter
    return scatter(1, flat_index, flat_source).view(x.shape), 0


@register(aten.masked_fill.Tensor, aten.masked_fill_.Scalar, aten.masked_fill_.Tensor)
def masked_fill(func, args, dims, kwargs):
    """masked_fill: pointwise, except a batched fill value becomes a ``where``."""
    self, mask, value = args
    inplace = writes_first_argument(func)
    if inplace and dims[0] is None:
        raise_inplace_unbatched_self(func)
    value_batched = dims[2] is not None
    if value_batched and value.dim() != 1:  # each example's value: torch's error
        raise RuntimeError("masked_fill_ only supports a 0-dimensional value tensor, but got "
                           f"tensor with {value.dim() - 1} dimension(s).")
    if not inplace and not value_batched:
        return pointwise_rule(func, args, dims, kwargs)
    rank = max(logical_rank(self, dims[0]), logical_rank(mask, dims[1]))
    mask = mask if dims[1] is None else pad_to_rank(to_front(mask, dims[1]), rank)
    x = to_front(self, dims[0])
    if value_batched:
        value = to_front(value, dims[2])
        if value.dtype != self.dtype and value.numel():
            _check_convertible(value, self.dtype)
            if value.is_complex() and not self.dtype.is_complex:
                value = value.real  # its imaginary parts are 0: checked
        value = pad_to_rank(value.to(self.dtype), rank)
    if inplace:
        x = pad_to_rank(x, rank)  # the mask may not be bigger in place: torch raises then
        if value_batched:
            x.copy_(torch.where(mask, value, x))
        else:
            x.masked_fill_(mask, value)
        return self, dims[0]
    x = x if dims[0] is None else pad_to_rank(x, rank)
    return torch.where(mask, value, x), 0


@register(aten.sparse_mask.default)
def sparse_mask(func, args, dims, kwargs):
    """A batched dense ``self`` where an unbatched sparse COO ``mask`` stores an element,
    else 0: each example's ``self.sparse_mask(mask)``, kept dense, which is the same
    value (a batch of sparse tensors has no strides for a level to view). Autograd
    calls it for the gradient of ``to_dense``; under ``jacrev`` that gradient is batched."""
    self, mask = args
    if dims[1] is not None or mask.layout is not torch.sparse_coo or (
            self.layout is not torch.strided):
        return loop_rule(func, args, dims, kwargs)
    x = to_front(self, dims[0])
    indices = mask._indices()  # (no in-place write: they may be an outer level's tensor)
    stored = torch.sparse_coo_tensor(
        indices, torch.ones(indices.shape[1], dtype=torch.bool, device=x.device),
        mask.shape[:mask.sparse_dim()]).to_dense()
    stored = stored.view(stored.shape + (1,) * mask.dense_dim())
    return torch.where(stored, x, torch.zeros((), dtype=x.dtype, device=x.device)), 0


def _check_convertible(values: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise torch's error if a fill value among ``values`` overflows ``dtype``, as each
    example's fill would (its value read as a number): the values that overflow form no
    interval inside one, so checking the least and the greatest is enough. The values
    are read under the levels outside this one (nested vmap), where every example's are."""
    values = memory_of(values)
    if values.is_complex():
        if dtype.is_complex:
            return
        imaginary = values.imag != 0
        if imaginary.any():  # a real tensor refuses these: raise its error
            torch.empty((), dtype=dtype).fill_(values[imaginary][0].item())
        values = values.real
    for v in (values.min(), values.max()):
        torch.empty((), dtype=dtype, device=values.device).fill_(v.item())


@register(aten.masked_select.default)
def masked_select(func, args, dims, kwargs):
    """masked_select with a shared mask; with a batched mask, only where every example
    selects as many elements (shapes otherwise differ per example), as a loop stacks them."""
    self, mask = args
    if dims[1] is not None or isinstance(mask, LevelTensor):  # batched here or outside
        x, mask = _broadcast_with_mask(self, mask, dims, batch_size(args, dims))
        x, mask = rows(x), rows(mask)  # a 0-dim example is a 1-element one
        n = _common_count(mask.sum(1), RuntimeError(
            "vmap: Attempted to vmap over `mask` in torch.masked_select(self, mask), and "
            "the examples select different numbers of elements, so each would return a "
            "differently shaped Tensor. Use torch.where(mask, self, 0) instead, which keeps "
            "the shape."))
        return x.gather(1, _true_first(mask)[:, :n]), 0
    x = to_front(self, dims[0])
    rank = max(x.dim() - 1, mask.dim(), 1)  # a 0-dim example is a 1-element one
    shape = torch.broadcast_shapes(x.shape[1:], mask.shape, (1,) * rank)
    x = pad_to_rank(x, rank).expand(x.shape[0], *shape)
    return aten.index.Tensor(x, [None, mask.expand(shape)]), 0


def _common_count(counts: torch.Tensor, error: Exception) -> int:
    """The count all examples have, of their ``counts`` (``[batch]``), else raise
    ``error``. The counts are read under the levels outside this one (nested vmap), where
    every example's are: all must agree for the examples' results to stack."""
    counts = memory_of(counts)
    if counts.numel() == 0:
        return 0
    first = counts.flatten()[0]
    if bool((counts != first).any()):
        raise error
    return int(first)


def _true_first(mask: torch.Tensor) -> torch.Tensor:
    """For ``[batch, n]`` bools, each row's positions with its True ones first, in order:
    a stable sort, which a vmap level outside batches (indexing by the mask would give
    each of that level's examples a differently shaped result)."""
    return torch.sort(~mask, dim=1, stable=True).indices


def _broadcast_with_mask(x: torch.Tensor, mask: torch.Tensor, dims: tuple, size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``mask`` (masked_scatter's ``self`` or its gradient, and its mask), both
    front-batched and broadcast to the shape of their examples together."""
    rank = max(logical_rank(x, dims[0]), logical_rank(mask, dims[1]))
    x = pad_to_rank(materialize(x, dims[0], size), rank)
    mask = pad_to_rank(materialize(mask, dims[1], size), rank)
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    return x.expand(shape), mask.expand(shape)


@register(aten.masked_scatter.default, aten.masked_scatter_.default)
def masked_scatter(func, args, dims, kwargs):
    """masked_scatter: the k-th True of each example's mask takes its source's k-th value."""
    self, mask, source = args
    inplace = writes_first_argument(func)
    if inplace and dims[0] is None:
        raise_inplace_unbatched_self(func)
    if self.dtype != source.dtype:
        raise RuntimeError(
            f"masked_scatter: expected self and source to have same dtypes but got "
            f"{self.dtype} and {source.dtype}"
        )
    size = batch_size(args, dims)
    x, m = _broadcast_with_mask(self, mask, dims, size)
    shape = m.shape
    flat_source = rows(materialize(source, dims[2], size))
    if flat_source.shape[1] == 0:  # nothing to gather from: keep gather's index in range
        flat_source = flat_source.new_zeros(size, 1)
    # the running count of Trues numbers the source value each position takes
    position = (rows(m).cumsum(1) - 1).clamp(min=0)
    out = torch.where(m, flat_source.gather(1, position).view(shape), x)
    if inplace:
        to_front(self, dims[0]).copy_(out.view(to_front(self, dims[0]).shape))
        return self, dims[0]
    return out, 0


@register(aten.masked_scatter_backward.default)
def masked_scatter_backward(func, args, dims, kwargs):
    """The gradient of masked_scatter's source: each example's k-th True position gives
    its gradient to the k-th value of the source; the values no True reached get zero."""
    grad, mask, sizes = args
    size = batch_size(args, dims)
    g, m = map(rows, _broadcast_with_mask(grad, mask, dims, size))
    numel = math.prod(sizes)
    # the running count of Trues numbers the source value each position feeds, one column
    # after a spare one that the False positions feed (dropped after); more Trues than
    # source values index past the end and raise, as PyTorch's op does
    position = torch.where(m, m.cumsum(1), 0)
    out = g.new_zeros(size, numel + 1).scatter_add(1, position, g)
    return out[:, 1:].reshape(size, *sizes), 0


@register(aten.nonzero.default)
def nonzero(func, args, dims, kwargs):
    """Each example's nonzero indices, as ``nonzero_static`` gives them with the count that
    all examples must share."""
    x = to_front(args[0], dims[0])
    n = _common_count(rows(x).ne(0).sum(1), _dynamic_shape_error(str(func)))
    return _first_nonzero(x, n, -1), 0


@register(aten.nonzero_static.default)
def nonzero_static(func, args, dims, kwargs):
    """Each example's first ``size`` nonzero indices, padded with ``fill_value``."""
    return _first_nonzero(to_front(args[0], dims[0]), kwargs["size"],
                          kwargs.get("fill_value", -1)), 0


def _first_nonzero(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """The first ``size`` nonzero indices of each example of batch-first ``x``, padded with
    ``fill``: a stable sort of each example's flat positions puts its nonzero ones first."""
    nonzero = rows(x) != 0
    positions = _true_first(nonzero)[:, :size]
    shape = x.shape[1:]
    if shape:
        index = torch.stack(torch.unravel_index(positions, shape), dim=-1)
    else:  # 0-d examples: an index has no coordinates
        index = positions.new_empty(positions.shape + (0,))
    index = index.masked_fill(~nonzero.gather(1, positions).unsqueeze(-1), fill)
    padding = size - positions.shape[1]  # more rows asked for than elements
    return torch.nn.functional.pad(index, (0, 0, 0, padding), value=fill)


@register(aten._unique2.default)
def unique(func, args, dims, kwargs):
    """Sorted unique values per example, by one batched sort; examples must agree on the count."""
    x, *flags = args
    return_inverse, return_counts = (list(flags[1:]) + [False, False])[:2]
    x = to_front(x, dims[0])
    flat = rows(x)
    values, order = flat.sort(1)
    first = torch.ones_like(values, dtype=torch.bool)  # where a new value starts
    first[:, 1:] = values[:, 1:] != values[:, :-1]
    n = _common_count(first.sum(1), _dynamic_shape_error(str(func)))
    group = first.cumsum(1) - 1  # the unique value each sorted element belongs to
    out = values.gather(1, _true_first(first)[:, :n])
    inverse = (torch.empty_like(order).scatter_(1, order, group).reshape(x.shape)
               if return_inverse else flat.new_empty((flat.shape[0], 0), dtype=torch.long))
    counts = (torch.zeros(flat.shape[0], n, dtype=torch.long, device=x.device).scatter_add(
        1, group, torch.ones_like(group)) if return_counts
              else flat.new_empty((flat.shape[0], 0), dtype=torch.long))
    return (out, inverse, counts), (0, 0, 0)


# -- sorted search --------------------------------------------------------------------------


@register(aten.searchsorted.Tensor, aten.searchsorted.Scalar, aten.bucketize.Tensor,
          keyword_dims=True)
def searchsorted(func, args, dims, kwargs, kw_dims=None):
    """Search batched values in shared boundaries directly; batched boundaries, or shared
    ones each example sorts with its own ``sorter``, go per row."""
    sorter_dim = (kw_dims or {}).get("sorter")
    size = batch_size(args, dims, kwargs, kw_dims)
    if func is aten.bucketize.Tensor:  # bucketize(values, boundaries) = searchsorted(b, v)
        (values, boundaries), (vd, bd), rest = args[:2], dims[:2], args[2:]
        out_int32, right = (list(rest) + [kwargs.get("out_int32", False),
                                          kwargs.get("right", False)][len(rest):])[:2]
        kwargs = {"out_int32": out_int32, "right": right}
    else:
        (boundaries, values), (bd, vd), rest = args[:2], dims[:2], args[2:]
    if bd is None and boundaries.dim() == 1 and sorter_dim is None:
        if not isinstance(values, torch.Tensor):
            return torch.searchsorted(boundaries, values, *rest, **kwargs), None
        return torch.searchsorted(boundaries, to_front(values, vd), *rest, **kwargs), 0
    boundaries = materialize(boundaries, bd, size)
    if not isinstance(values, torch.Tensor):
        values = torch.full((size, 1), values, dtype=boundaries.dtype, device=boundaries.device)
        return torch.searchsorted(boundaries, values, *rest, **kwargs).squeeze(-1), 0
    values = materialize(values, vd, size)
    if kwargs.get("sorter") is not None:  # the sorter indexes the (now batched) boundaries
        sorter = kwargs["sorter"]
        sorter = sorter.expand(boundaries.shape) if sorter_dim is None else to_front(
            sorter, sorter_dim)
        kwargs = {**kwargs, "sorter": sorter}
    if boundaries.dim() == 2:  # one sorted row per example: flatten each example's values
        flat_values = values.flatten(1) if values.dim() > 1 else values.unsqueeze(1)
    else:  # rows of boundaries pair with rows of values
        flat_values, boundaries = values.flatten(0, -2), boundaries.flatten(0, -2)
        if kwargs.get("sorter") is not None:
            kwargs = {**kwargs, "sorter": kwargs["sorter"].flatten(0, -2)}
    return torch.searchsorted(boundaries, flat_values, *rest, **kwargs).reshape(values.shape), 0


@register(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin(func, args, dims, kwargs):
    """isin: each example's elements against its own test elements, in one comparison
    (PyTorch's decomposition, which vmap would take, skips the kernel's dtype check)."""
    elements, test = args
    func(*example_meta(args, dims), **kwargs)  # torch's errors (dtypes)
    if dims[1] is None:  # shared test elements: elementwise in the elements
        return func(elements, test, **kwargs), dims[0]
    size = batch_size(args, dims)
    test = rows(to_front(test, dims[1]))
    if not isinstance(elements, torch.Tensor):
        elements = torch.tensor(elements, device=test.device)
    elements = materialize(elements, dims[0], size)
    found = (rows(elements).unsqueeze(-1) == test.unsqueeze(1)).any(-1).view(elements.shape)
    return found.logical_not() if kwargs.get("invert", False) else found, 0


# -- embedding ------------------------------------------------------------------------------


@register(aten.embedding_renorm_.default)
def embedding_renorm_(func, args, dims, kwargs):
    """Renormalize the rows any example looks up (renorming a row twice changes nothing)."""
    weight, indices, *rest = args
    if dims[0] is None:
        func(weight, indices.flatten(), *rest, **kwargs)
        return weight, None
    weight = to_front(weight, dims[0])
    size, table_rows = weight.shape[0], weight.shape[1]
    indices = rows(materialize(indices, dims[1], size))
    flat = weight.flatten(0, 1)  # a copy when weight is not contiguous
    func(flat, _offset(indices, table_rows).flatten(), *rest, **kwargs)
    if not weight.is_contiguous():
        weight.copy_(flat.view(weight.shape))
    return weight, 0


@register(aten.embedding.default)
def embedding(func, args, dims, kwargs):
    """embedding: batched indices look up as they are; a batched weight is folded."""
    weight, indices, *rest = args
    weight_bdim, indices_bdim = dims[0], dims[1]
    if weight_bdim is None:
        return func(weight, indices, *rest, **kwargs), indices_bdim
    size = weight.shape[weight_bdim]
    if indices_bdim is None:
        # [V, B*D]: one lookup serves every example, and padding_idx keeps its meaning
        folded = weight.movedim(weight_bdim, 1).flatten(1, 2)
        out = func(folded, indices, *rest, **kwargs).unflatten(-1, (size, -1))
        return out, out.dim() - 2
    # [B*V, D] with indices offset by b * V, then the padding row's gradient stops by hand
    weight = to_front(weight, weight_bdim)
    indices = to_front(indices, indices_bdim)
    padding_idx = rest[0] if rest else -1
    out = func(weight.flatten(0, 1), _offset(indices, weight.shape[1]), -1, *rest[1:], **kwargs)
    if padding_idx >= 0:
        out = torch.where((indices == padding_idx).unsqueeze(-1), out.detach(), out)
    return out, 0


@register(aten.embedding_dense_backward.default)
def embedding_dense_backward(func, args, dims, kwargs):
    """The gradient of embedding for batched grads and/or indices."""
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = args
    size = batch_size(args, dims)
    if dims[1] is None:
        # fold the batch into the embedding dim: one backward for all examples
        grad = to_front(grad, dims[0]).movedim(0, -2).flatten(-2, -1)
        out = func(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
        return out.unflatten(-1, (size, -1)), 1
    indices = to_front(indices, dims[1])
    grad = materialize(grad, dims[0], size)
    out = func(grad, _offset(indices, num_weights), size * num_weights, -1, scale_grad_by_freq)
    out = out.unflatten(0, (size, num_weights))
    if padding_idx >= 0:
        out[:, padding_idx] = 0  # a fresh tensor: zero the padding row of every example
    return out, 0


_BAG_OPTIONS = ("scale_grad_by_freq", "mode", "sparse", "per_sample_weights",
                "include_last_offset", "padding_idx")
_BAG_DEFAULTS = (False, 0, False, None, False, -1)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(func, args, dims, kwargs):
    """embedding_bag: a batched weight alone folds the batch into the features (one lookup
    serves every example); batched indices, offsets or per-sample weights make the bags
    of all examples one list of bags (a batched weight is then flattened and each
    example's indices offset into its rows)."""
    weight, indices, offsets = args[:3]
    opts = {**dict(zip(_BAG_OPTIONS, _BAG_DEFAULTS)), **dict(zip(_BAG_OPTIONS, args[3:])),
            **kwargs}
    mode, padding_idx = opts["mode"], opts["padding_idx"]
    psw_dim = dims[6] if len(dims) > 6 else None
    if func is aten._embedding_bag_forward_only.default and autograd_records() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (weight, opts["per_sample_weights"])):
        # picked for the level's tensors, which require no grad; the forward-only kernel
        # refuses the plain tensors under them that autograd tracks (stacked module params)
        func = aten._embedding_bag.default
    if dims[1] is None and dims[2] is None and psw_dim is None:
        size = weight.shape[dims[0]]
        output, offset2bag, bag_size, max_indices = func(
            weight.movedim(dims[0], 1).flatten(1, 2), indices, offsets, **opts)
        # [bags, B, D] to [B, bags, D]: each example contiguous, as one example's output is
        output = output.unflatten(-1, (size, -1)).movedim(-2, 0).contiguous()
        if mode == 2:  # max: per-feature rows of the table, the same for every example
            max_indices = max_indices.unflatten(-1, (size, -1)).movedim(-2, 0).contiguous()
            return (output, offset2bag, bag_size, max_indices), (0, None, None, 0)
        return (output, offset2bag, bag_size, max_indices), (0, None, None, None)
    size = batch_size(args, dims)
    weight, rows = _flat_weight(weight, dims[0])  # each example's indices into its rows
    length = logical_shape(indices, dims[1])[0]
    bags = logical_shape(offsets, dims[2])[0] - opts["include_last_offset"]
    index, starts = _flat_bags(size, bags, indices, offsets, dims[1:3], rows, padding_idx)
    if opts["per_sample_weights"] is not None:
        opts["per_sample_weights"] = materialize(opts["per_sample_weights"], psw_dim,
                                                 size).flatten()
    output, offset2bag, bag_size, max_indices = func(weight, index, starts, **opts)
    output = output.unflatten(0, (size, bags))
    shift = _arange(size, 1, output.device)
    offset2bag_dim = None
    if offset2bag.numel():  # each example's bags counted from 0
        offset2bag, offset2bag_dim = offset2bag.view(size, length) - shift * bags, 0
    bag_size = _per_example_bags(bag_size, size, bags)
    if not max_indices.numel():  # CUDA leaves it empty but in max mode
        return (output, offset2bag, bag_size, max_indices), (0, offset2bag_dim, 0, None)
    max_indices = _per_example_bags(max_indices, size, bags)
    if mode == 2 and rows:  # back to each example's rows (empty bags: 0)
        max_indices = torch.where(bag_size[:, :bags].unsqueeze(-1) > 0,
                                  max_indices - shift.unsqueeze(-1) * rows, max_indices)
    return (output, offset2bag, bag_size, max_indices), (0, offset2bag_dim, 0, 0)


def _per_example_bags(t, size, bags):
    """A per-bag output of one embedding_bag call over every example's bags, as
    ``[B, bags, ...]``. Some kernels give one entry per offset instead (CUDA's bag sizes,
    the CPU forward-only kernel in sum mode), so with include_last_offset one more, which
    they leave unset: each example then gets one more entry, zero."""
    extra = t.shape[0] - size * bags
    per_example = t[: size * bags].unflatten(0, (size, bags))
    if not extra:
        return per_example
    return torch.cat([per_example, per_example.new_zeros(size, extra, *t.shape[1:])], 1)


def _flat_bags(size, bags, indices, offsets, dims, rows, padding_idx):
    """Every example's bags as one list: indices (offset by ``b * rows`` when ``rows``,
    padding kept) and offsets, flattened. ``offsets`` may hold a last offset per example
    (include_last_offset), which the next example's start then replaces."""
    index = materialize(indices, dims[0], size)
    shift = _arange(size, 1, index.device)
    if rows:
        shifted = _offset(index, rows)
        index = shifted if padding_idx < 0 else torch.where(index == padding_idx, index, shifted)
    starts = materialize(offsets, dims[1], size) + shift * index.shape[1]
    if starts.shape[1] == bags + 1:
        starts = torch.cat([starts[:, :-1].flatten(), starts[-1, -1:]])
    return index.flatten(), starts.flatten()


def _flat_weight(weight, bdim):
    """A batched table as ``[B * V, D]`` and its ``V``; an unbatched one as is, and 0."""
    if bdim is None:
        return weight, 0
    weight = to_front(weight, bdim)
    return weight.flatten(0, 1), weight.shape[1]


def _flat_offset2bag(offset2bag, bdim, size, bags):
    """Each example's offset2bag counted on from the previous example's bags, flattened
    (left empty when the kernel left it empty: it recomputes it)."""
    if not offset2bag.numel():
        return offset2bag
    return (materialize(offset2bag, bdim, size) + _arange(size, 1, offset2bag.device) * bags
            ).flatten()


@register(aten._embedding_bag_backward.default)
def embedding_bag_backward(func, args, dims, kwargs):
    """The weight gradient of every example at once: its bags' indices offset into its
    own block of ``num_weights`` rows of one ``[B * num_weights, D]`` gradient."""
    (grad, indices, offsets, offset2bag, bag_size, max_indices, rows, scale, mode, sparse,
     per_sample_weights, *rest) = args
    padding_idx = rest[0] if rest else kwargs.get("padding_idx", -1)
    size = batch_size(args, dims)
    if sparse:
        return loop_rule(func, args, dims, kwargs)
    grad = materialize(grad, dims[0], size)
    bags = grad.shape[1]
    index, starts = _flat_bags(size, bags, indices, offsets, dims[1:3], rows, padding_idx)
    offset2bag = _flat_offset2bag(offset2bag, dims[3], size, bags)
    bag_size = materialize(bag_size, dims[4], size)[:, :bags]  # see _per_example_bags
    max_indices = materialize(max_indices, dims[5], size)
    if mode == 2:  # rows of each example's block (empty bags keep 0)
        shift = _arange(size, 2, grad.device)
        max_indices = torch.where(bag_size.unsqueeze(-1) > 0, max_indices + shift * rows,
                                  max_indices)
    if per_sample_weights is not None:
        per_sample_weights = materialize(per_sample_weights, dims[10], size).flatten()
    out = func(grad.flatten(0, 1), index, starts, offset2bag, bag_size.flatten(),
               max_indices.flatten(0, 1), size * rows, scale, mode, sparse, per_sample_weights,
               padding_idx)
    return out.unflatten(0, (size, rows)), 0


@register(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(func, args, dims, kwargs):
    """The per-sample weights' gradient, every example's bags as one list."""
    grad, weight, indices, offsets, offset2bag, mode, *rest = args
    padding_idx = rest[0] if rest else kwargs.get("padding_idx", -1)
    size = batch_size(args, dims)
    grad = materialize(grad, dims[0], size)
    bags = grad.shape[1]
    weight, rows = _flat_weight(weight, dims[1])
    index, starts = _flat_bags(size, bags, indices, offsets, dims[2:4], rows, padding_idx)
    offset2bag = _flat_offset2bag(offset2bag, dims[4], size, bags)
    out = func(grad.flatten(0, 1), weight, index, starts, offset2bag, mode, padding_idx)
    return out.unflatten(0, (size, -1)), 0
