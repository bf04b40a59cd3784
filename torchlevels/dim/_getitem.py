"""Binding dims by indexing: ``A[i, :, (j, k)]``, ``emb[words[seq], feat]``, ``a[i + 1]``.

Dims, slices, ints and ``None`` only need views (a dim used twice takes a diagonal).
Indices that are tensors (with dims or not) run one advanced-indexing gather, with every
dim of every index broadcast by Rule 1 and ints placed as torch places them; so does a dim
the tensor has already that indexes a dim of another size (it is the tensor of its
values, Rule 3: ``A[i][i]``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchlevels.dim import _lookup
from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim, DimensionBindError, DimList
from torchlevels.dim._ops import Tensor, align, find, reorder, storage, union, wrap

_SPLIT = "split"


def getitem(x: Any, index: Any) -> Any:
    """``x[index]`` where ``x`` or ``index`` holds first-class dims."""
    if type(index) is list and _list_is_tuple(index):
        index = tuple(index)
    t, own = (storage(x, None), x._dims) if isinstance(x, _Tensor) else (x, ())
    fast = _bind_all(t, own, index)
    if fast is not None:
        return fast
    t, items = _parse(t, own, index)
    if any(_is_advanced(i) for i in items) or _own_dim_indexes_another_size(t, own, items):
        lookup = _lookup.delayed(t, own, items, lambda: _gather(t, own, items))
        if lookup is not None:
            return lookup
        return reorder(_gather(t, own, items), functorch_order([*own, *items]))
    out = _view(t, own, items)
    if isinstance(out, Tensor) and len(out._dims) < len(own) + sum(
            type(i) is Dim for i in items):  # a dim named twice: a diagonal
        return reorder(out, functorch_order([*own, *items]))
    return out


def functorch_order(entries: list) -> tuple:
    """The order functorch.dim gives the dims of ``x[entries]``, with one entry per axis
    of ``x`` (its dims, then its positional dims: a dim, a tensor index, an int, a slice
    or None). A dim used once stays where it is; the dims of the tensor indices, and those
    used more than once (indices too), go together, in order of first use, where the first
    tensor index is, if the tensor indices are adjacent, else first (as torch places the
    positional dims of the indices)."""
    flat = [d for e in entries
            for d in (e if isinstance(e, (tuple, list)) and e and all(
                type(x) is Dim for x in e) else (e,))]
    uses: dict = {}
    for e in flat:
        for d in (e,) if type(e) is Dim else e._dims if isinstance(e, _Tensor) else ():
            uses[id(d)] = uses.get(id(d), 0) + 1
    kept: list = []
    indices: list = []
    level = 0  # result axes so far, dims and positional
    insert, at = -1, 0

    def mark() -> None:
        nonlocal insert, at
        if insert == -1:
            insert, at = level, len(kept)
        elif insert != level:
            insert, at = 0, 0

    for e in flat:
        if type(e) is Dim and uses[id(e)] == 1:
            kept.append(e)
            level += 1
        elif type(e) is Dim or _is_advanced(e):
            mark()
            for d in (e,) if type(e) is Dim else e._dims if isinstance(e, _Tensor) else ():
                if find(tuple(indices), d) < 0:
                    indices.append(d)
        elif not isinstance(e, int):
            level += 1  # a slice or None: a positional axis
    return (*kept[:at], *indices, *kept[at:])


def _bind_all(t: torch.Tensor, own: tuple, index: Any) -> Tensor | None:
    """The common case, fast: new dims for all positional dims (``A[i, k]``)."""
    if type(index) is not tuple:
        index = (index,)
    if len(index) + len(own) != t.ndim:
        return None
    for k, d in enumerate(index):
        if type(d) is not Dim or find(own, d) >= 0 or find(index[:k], d) >= 0:
            return None
    for d, size in zip(index, t.shape[len(own):]):
        d.size = size
    return Tensor(t, own + index)


def setitem(x: Any, index: Any, value: Any) -> None:
    """``x[index] = value``: writes through the view that ``x[index]`` would be."""
    if type(index) is list and _list_is_tuple(index):
        index = tuple(index)
    t, own = (storage(x, None), x._dims) if isinstance(x, _Tensor) else (x, ())
    t, items = _parse(t, own, index)
    if any(_is_advanced(i) for i in items) or _own_dim_indexes_another_size(t, own, items):
        _scatter(t, own, items, value)
        return
    view = _view(t, own, items)
    if not isinstance(view, Tensor):
        view[...] = value
        return
    if isinstance(value, _Tensor):
        _check_value_dims(value, view._dims)
        value = align(value, view._dims, view.ndim, view._tensor.device)
    view._tensor[...] = value


# -- parsing ----------------------------------------------------------------------------
def _list_is_tuple(index: list) -> bool:
    """Whether torch reads the list ``x[index]`` as a tuple of indices (its rule for a
    short list holding a tensor, a dim, a sequence, a slice, ``...`` or ``None``), so that
    ``x[[i, j]]`` is ``x[i, j]``, as in functorch.dim; a list of ints stays one index."""
    return len(index) < 32 and any(
        isinstance(e, (torch.Tensor, _Tensor, DimList, list, tuple, slice))
        or e is Ellipsis or e is None for e in index
    )


def _parse(t: torch.Tensor, own: tuple, index: Any) -> tuple[torch.Tensor, list]:
    """``t`` with split dims unflattened, and one index entry per positional dim."""
    items = _expand(list(index) if isinstance(index, tuple) else [index], t.ndim - len(own),
                    t.shape[len(own):])
    return _split(t, len(own), items)


def _is_split(item: Any) -> bool:
    return isinstance(item, tuple) or (
        isinstance(item, list) and any(isinstance(e, (Dim, DimList)) for e in item)
    )


def _is_advanced(item: Any) -> bool:
    return isinstance(item, (torch.Tensor, list)) or (
        isinstance(item, _Tensor) and type(item) is not Dim
    )


def _own_dim_indexes_another_size(t: torch.Tensor, own: tuple, items: list) -> bool:
    """Whether a dim of ``own`` indexes a positional dim of another size (``A[i][i]`` for
    a 3x4 ``A``): as a tensor index of its values (Rule 3) it gathers; with the same size
    it takes a diagonal, a view."""
    axis = len(own)
    for i in items:
        if type(i) is Dim and find(own, i) >= 0 and i.size != t.shape[axis]:
            return True
        axis += i is not None
    return False


def _mask_indices(mask: torch.Tensor, shape: torch.Size, at: int) -> tuple:
    """A boolean mask over the dims ``shape`` (from positional dim ``at``) as the index
    tensors of its true entries, as torch reads it."""
    if mask.ndim == 0 or tuple(mask.shape) != tuple(shape):
        raise IndexError(
            f"the shape of the boolean mask {tuple(mask.shape)} at index {at} does not match "
            f"the shape {tuple(shape)} of the dims it indexes"
            + (" (a 0-dim mask is not supported with first-class dims)" if mask.ndim == 0
               else "")
        )
    return mask.nonzero().unbind(1)


def _expand(items: list, ndim: int, shape: torch.Size) -> list:
    """One entry per positional dim (or ``None``): Ellipsis and dim lists expanded, boolean
    masks as index tensors, splits marked, trailing dims filled with ``:``. ``shape`` is
    the positional shape."""
    fill = [i for i in items if i is Ellipsis or (isinstance(i, DimList) and not i.is_bound)]
    if len(fill) > 1:
        raise DimensionBindError(
            f"an index can hold one '...' or one unbound dim list, got {fill}"
        )
    used = 0
    for i in items:
        if i is None or i is Ellipsis or (isinstance(i, DimList) and not i.is_bound):
            continue
        if isinstance(i, DimList):
            used += len(i)
        elif isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            used += i.ndim
        else:
            used += 1
    if used > ndim:
        raise ValueError(
            f"at least {used} indices were supplied but the tensor only has {ndim} dimensions"
        )
    out: list = []
    for i in items:
        if i is Ellipsis:
            out.extend([slice(None)] * (ndim - used))
        elif isinstance(i, DimList):
            if not i.is_bound:
                i.bind_len(ndim - used)
            out.extend(i)
        elif _is_split(i):
            out.append((_SPLIT, [d for e in i for d in (e if isinstance(e, DimList) else [e])]))
        elif isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            at = sum(1 for e in out if e is not None)  # positional dims indexed so far
            out.extend(_mask_indices(i, shape[at:at + i.ndim], at))
        else:
            out.append(i)
    if not fill:
        out.extend([slice(None)] * (ndim - used))
    return out


def _split(t: torch.Tensor, nb: int, items: list) -> tuple[torch.Tensor, list]:
    """Unflatten the dims that tuples of dims split; sizes are bound or inferred, left to
    right (a split may bind a dim that a later one needs: ``x[(a, b), (b, c)]``)."""
    axes = []
    axis = nb
    for i in items:
        axes.append(axis)
        axis += i is not None
    splits = [(i[1], axis) for i, axis in zip(items, axes)
              if isinstance(i, tuple) and i[0] is _SPLIT]
    for group, axis in splits:
        _bind_split(group, t.shape[axis])
    for group, axis in reversed(splits):  # (from the right: the axes before stay put)
        t = t.unflatten(axis, [d.size for d in group])
    out = [e for i in items
           for e in (i[1] if isinstance(i, tuple) and i[0] is _SPLIT else (i,))]
    return t, out


def _bind_split(group: tuple, total: int) -> None:
    """Check the dims that split a dim of size ``total`` and infer the one unbound."""
    for d in group:
        if not isinstance(d, Dim):
            raise TypeError(f"a split index holds only dims, got {type(d).__name__}")
    for k, d in enumerate(group):
        if find(tuple(group[:k]), d) >= 0:
            raise DimensionBindError(f"dim {d} appears twice in the split {tuple(group)}")
    unbound = [d for d in group if not d.is_bound]
    known = math.prod(d.size for d in group if d.is_bound)
    if len(unbound) > 1:
        raise DimensionBindError(
            f"cannot infer the sizes of {tuple(unbound)} when splitting a dim of size "
            f"{total}: at most one dim of a split may be unbound; set the others' .size"
        )
    if unbound:
        if known == 0 or total % known:
            raise DimensionBindError(
                f"a dim of size {total} cannot be split into {tuple(group)}: the bound "
                f"sizes multiply to {known}, which does not divide {total}"
            )
        unbound[0].size = total // known
    elif known != total:
        raise DimensionBindError(
            f"dims {tuple(group)} of sizes {tuple(d.size for d in group)} (product "
            f"{known}) cannot split a dim of size {total}"
        )


# -- views --------------------------------------------------------------------------------
def _view(t: torch.Tensor, own: tuple, items: list) -> Any:
    basic = [slice(None) if isinstance(i, Dim) else i for i in items]
    if any(not (isinstance(i, slice) and i == slice(None)) for i in basic):
        t = t[(*[slice(None)] * len(own), *basic)]
    labels: list = list(own)
    for i in items:
        if isinstance(i, Dim):
            labels.append(i)
        elif not isinstance(i, int):
            labels.append(None)  # a positional dim: ':' or a slice or None
    for k, d in enumerate(labels):
        if d is not None:
            d.size = t.shape[k]  # binds, or names both sizes if they conflict
    return _finish(t, labels)


def _finish(t: torch.Tensor, labels: list) -> Any:
    """Take diagonals where a dim labels two axes, then put the dims first."""
    while True:
        dup = next(
            ((p, q) for q, d in enumerate(labels) if d is not None
             for p in range(q) if labels[p] is d),
            None,
        )
        if dup is None:
            break
        p, q = dup
        d = labels[p]
        t = t.diagonal(0, p, q)
        labels = [e for k, e in enumerate(labels) if k not in dup] + [d]
    dim_axes = [k for k, d in enumerate(labels) if d is not None]
    positional = [k for k, d in enumerate(labels) if d is None]
    perm = dim_axes + positional
    if perm != list(range(len(labels))):
        t = t.permute(perm)
    return wrap(t, tuple(labels[k] for k in dim_axes))


# -- gathers ------------------------------------------------------------------------------
def _gather_plan(t: torch.Tensor, own: tuple, items: list) -> tuple:
    """How advanced indexing reads: ``base[indices].permute(perm)`` is the result, its
    axes labelled ``labels`` (a dim, or None for a positional axis); ``base`` is a view of
    ``t``, so assigning to ``base[indices]`` writes ``t``."""
    index_dims, _, _ = union([i for i in items if _is_advanced(i)])
    repeated = {id(i) for k, i in enumerate(items) if isinstance(i, Dim)
                and (find(tuple(items[:k]), i) >= 0 or find(tuple(items[k + 1:]), i) >= 0)}

    def gathers(i: Any) -> bool:
        return _is_advanced(i) or (
            isinstance(i, Dim)
            and (id(i) in repeated or find(index_dims, i) >= 0 or find(own, i) >= 0)
        )

    # basic indexing first: slices and None; gathered entries keep their axis
    basic = [slice(None) if gathers(i) or isinstance(i, Dim) else i for i in items]
    t = t[(*[slice(None)] * len(own), *basic)]
    labels: list = []  # per axis of t: a Dim, None (positional) or ("gather", index)
    for d in own:  # gathered with the indices it is in (or is), so that they pair up
        indexes = find(index_dims, d) >= 0 or find(tuple(items), d) >= 0
        labels.append(("gather", d) if indexes else d)
    # where torch places the index's positional dims: in the loop model a dim is an int,
    # and torch selects ints (and 0-dim tensors) first; the tensor indices with dims of
    # their own go where they stand if adjacent once those are gone, else first
    kept = [i for i in items
            if not (isinstance(i, (int, Dim)) or (_is_advanced(i) and _ndim(i) == 0))]
    advanced_at = [k for k, i in enumerate(kept) if _is_advanced(i)]
    for i in items:
        if gathers(i):
            labels.append(("gather", i))
        elif isinstance(i, Dim):
            labels.append(i)
        elif not isinstance(i, int):
            labels.append(None)
    for k, d in enumerate(labels):
        if isinstance(d, Dim):
            d.size = t.shape[k]
    gathered = [k for k, e in enumerate(labels) if isinstance(e, tuple)]
    # a dim used as an index binds to the axis it indexes, unless the tensor has it
    # already: then it indexes by its values (Rule 3)
    for k in gathered:
        i = labels[k][1]
        if type(i) is Dim and find(own, i) < 0:
            i.size = t.shape[k]
    indices = [_as_index(labels[k][1], t.device) for k in gathered]
    dims, ndim, _ = union(indices)
    indices = [align(i, dims, ndim, t.device) if isinstance(i, _Tensor) else i for i in indices]
    rest = [k for k in range(len(labels)) if k not in gathered]
    base = t.permute(*gathered, *rest)
    # base[indices] is: the index dims, the index positional dims, then the rest's axes
    rest_labels = [labels[k] for k in rest]
    n_index = len(dims)
    contiguous = bool(advanced_at) and advanced_at[-1] - advanced_at[0] == len(advanced_at) - 1
    insert_at = advanced_at[0] if contiguous else 0
    # positional order: rest's positional axes, with the index's positional block placed
    # where torch places it (at the first tensor index if they are adjacent, else first)
    rest_positional = [n_index + ndim + k for k, e in enumerate(rest_labels) if e is None]
    before = sum(1 for i in kept[:insert_at] if i is None or isinstance(i, slice))
    block = list(range(n_index, n_index + ndim))
    positional = rest_positional[:before] + block + rest_positional[before:]
    rest_dims = [n_index + ndim + k for k, e in enumerate(rest_labels) if e is not None]
    perm = list(range(n_index)) + rest_dims + positional
    labels = list(dims) + [rest_labels[k - n_index - ndim] for k in rest_dims]
    return base, tuple(indices), perm, labels + [None] * len(positional)


def _gather(t: torch.Tensor, own: tuple, items: list) -> Any:
    """Advanced indexing: every tensor index (and every dim that also appears in one, or
    twice) gathers; the other dims and slices stay views."""
    base, indices, perm, labels = _gather_plan(t, own, items)
    return _finish(base[indices].permute(perm), labels)


def _scatter(t: torch.Tensor, own: tuple, items: list, value: Any) -> None:
    """``t[items] = value`` with advanced indices: writes where :func:`_gather` reads."""
    base, indices, perm, labels = _gather_plan(t, own, items)
    dims = tuple(d for d in labels if d is not None)  # labels are the dims, then positional
    positional = len(labels) - len(dims)
    if isinstance(value, _Tensor):
        _check_value_dims(value, dims)
        value = align(value, dims, positional, t.device)
    elif isinstance(value, torch.Tensor):
        value = value.reshape((1,) * (len(labels) - value.ndim) + tuple(value.shape))
    else:
        base[indices] = value
        return
    inverse = sorted(range(len(perm)), key=perm.__getitem__)
    base[indices] = value.permute(inverse)


def _check_value_dims(value: _Tensor, dims: tuple) -> None:
    """A value assigned to ``x[index]`` may not have dims the indexed tensor lacks."""
    value_dims, _, _ = union([value])
    missing = [d for d in value_dims if find(dims, d) < 0]
    if missing:
        raise DimensionBindError(
            f"cannot assign a value with dims {value._dims} to a tensor indexed with dims "
            f"{dims}: {tuple(missing)} are not among them"
        )


def _ndim(i: Any) -> int:
    """Positional dims of an index (a list of ints has one, or more if nested)."""
    return torch.tensor(i).ndim if isinstance(i, list) else i.ndim


def _as_index(i: Any, device: torch.device) -> Any:
    return torch.tensor(i, device=device) if isinstance(i, list) else i
