"""Module functions of ``torchlevels.dim``: ``softmax``, ``stack``, ``cat``, ``split`` and
``index`` with dims."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim, DimensionBindError, DimList
from torchlevels.dim._getitem import getitem
from torchlevels.dim._ops import Tensor, batched, find, order, reorder, storage, union, wrap
from torchlevels.dim._ops import index as _index


def softmax(input: Any, dim: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.nn.functional.softmax`` where ``dim`` may be a first-class dim.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims, softmax
        >>> i, j = dims(2)
        >>> x = torch.rand(3, 4)
        >>> torch.allclose(softmax(x[i, j], dim=j).order(i, j), x.softmax(1))
        True
    """
    out = torch.nn.functional.softmax(input, dim, *args, **kwargs)
    # over a positional dim, the dims stay in order (functorch.dim's softmax is a method's)
    return reorder(out, input._dims) if isinstance(input, Tensor) else out


def stack(tensors: Sequence[Any], new_dim: Dim, dim: int | Dim = 0) -> Any:
    """Stack ``tensors`` along a new dim bound to ``new_dim``: at positional ``dim``, or,
    when ``dim`` is a first-class dim of the tensors, just before it.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims, stack
        >>> i, s = dims(2)
        >>> a, b = torch.rand(3), torch.rand(3)
        >>> torch.equal(stack([a[i], b[i]], s).order(s, i), torch.stack([a, b]))
        True
        >>> t = dims(1)
        >>> stack([a[i], b[i]], t, i).dims
        (t, i)
    """
    tensors = list(tensors)
    # functorch.dim's order: the union of the tensors' dims, with the new dim before the
    # first-class ``dim``, first when it stacks at positional dim 0 (else after them: it
    # goes where positional ``dim`` is, and the positional dims follow the first-class ones)
    dims = union(tensors)[0]
    if isinstance(dim, Dim):
        at = find(dims, dim)
        if at < 0:
            raise TypeError(f"stack: dim {dim!r} is not a dim of the tensors (their dims: "
                            f"{dims})")
        return reorder(stack(tensors, new_dim), (*dims[:at], new_dim, *dims[at:]))
    t = torch.stack(tensors, dim)
    out = getitem(t, (*[slice(None)] * (dim % t.ndim), new_dim))
    return reorder(out, (new_dim, *dims) if dim == 0 else (*dims, new_dim))


def cat(tensors: Sequence[Any], dim: Any, new_dim: Dim) -> Any:
    """Concatenate ``tensors`` along their first-class (or positional) ``dim`` into the
    new dim ``new_dim``, whose size is the sum of theirs.

    Example::

        >>> import torch
        >>> from torchlevels.dim import cat, dims
        >>> i, j, k = dims(3)
        >>> a, b = torch.rand(2, 3), torch.rand(4, 3)
        >>> torch.equal(cat([a[i, k], b[j, k]], [i, j], (n := dims(1))).order(n, k),
        ...             torch.cat([a, b]))
        True
    """
    dims = dim if isinstance(dim, (list, tuple)) else [dim] * len(tensors)
    if len(dims) != len(tensors):
        raise ValueError(f"cat: {len(tensors)} tensors but {len(dims)} dims")
    parts = [order(t, (d,)) if isinstance(t, _Tensor) else t.movedim(d, 0)
             for t, d in zip(tensors, dims)]
    out = getitem(torch.cat(parts, 0), (new_dim,))
    # functorch.dim's order (cat is stack then index): the union of the tensors' dims with
    # the new dim where the concatenated dim is, first for positional dim 0, else last
    union_dims = union(tensors)[0]
    if isinstance(dim, int):
        return reorder(out, (new_dim, *union_dims) if dim == 0 else (*union_dims, new_dim))
    at = min((k for k, d in enumerate(union_dims) if any(d is e for e in dims)), default=0)
    return reorder(out, (*union_dims[:at], new_dim, *union_dims[at:]))


def stack_positional(tensors: Sequence[Any], dim: Any = 0, **kwargs: Any) -> Any:
    """``torch.stack`` on tensors with dims; a Dim as ``dim`` makes a first-class dim."""
    if isinstance(dim, Dim):
        return stack(tensors, dim, 0)
    return batched(torch.stack, (tensors, dim), kwargs)


def split(tensor: Any, split_size_or_sections: Any, dim: Any = None) -> tuple:
    """``torch.split`` where the sections may be dims: ``dim`` (positional, default 0, or
    first-class) is cut into one piece per dim, each bound to it. Bound dims keep their
    sizes; unbound ones share what is left, the first ones taking the larger shares.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims, split
        >>> i, a, b = dims(3)
        >>> x = torch.arange(12.).reshape(2, 6)
        >>> p, q = split(x[i], [a, b], dim=0)
        >>> p.dims, a.size, torch.equal(q.order(i, b), x[:, 3:])
        ((i, a), 3, True)
    """
    sections = split_size_or_sections
    if isinstance(sections, int) or not any(isinstance(s, Dim) for s in sections):
        if isinstance(dim, Dim):
            raise TypeError("split: when dim is a Dim, the split sizes must be dims too")
        return batched(torch.Tensor.split, (tensor, sections), {"dim": 0 if dim is None else dim})
    if not all(isinstance(s, Dim) for s in sections):
        raise TypeError(f"split: the sizes must be all ints or all dims, got {list(sections)}")
    own = tensor._dims if isinstance(tensor, _Tensor) else ()
    base = storage(tensor, None) if isinstance(tensor, _Tensor) else tensor
    if isinstance(dim, Dim):
        axis = find(own, dim)
        if axis < 0:
            raise TypeError(f"split: the tensor has no dim {dim!r} (its dims: {own})")
    else:
        ndim = base.ndim - len(own)
        p = 0 if dim is None else dim
        if not -ndim <= p < ndim:
            raise IndexError(f"split: dim {p} is out of range for {ndim} positional dims")
        axis = len(own) + p % ndim
    sizes = _section_sizes(sections, base.shape[axis])
    pieces = []
    for piece, d in zip(base.split(sizes, axis), sections):
        if isinstance(dim, Dim):
            pieces.append(wrap(piece, own[:axis] + (d,) + own[axis + 1:]))
        else:
            pieces.append(wrap(piece.movedim(axis, len(own)), own + (d,)))
    return tuple(pieces)


class SectionsError(DimensionBindError, TypeError):
    """split's section dims do not add up to the split dim's size: functorch.dim raises a
    TypeError there, so this is one too."""


def _section_sizes(sections: Sequence[Dim], total: int) -> list[int]:
    """The size of each section dim, binding the unbound ones to share the rest."""
    taken = sum(d.size for d in sections if d.is_bound)
    unbound = [d for d in sections if not d.is_bound]
    if not unbound and taken != total:
        raise SectionsError(f"split: the section dims {list(sections)} add up to {taken}, "
                            f"not the split dim's size {total}")
    if taken > total:
        raise SectionsError(f"split: the bound section dims add up to {taken}, more than "
                            f"the split dim's size {total}")
    left = total - taken
    share = -(-left // len(unbound)) if unbound else 0
    for d in unbound:
        d.size = min(share, left)
        left -= d.size
    return [d.size for d in sections]


def index(self: Any, positions: Any, dims: Any) -> Any:
    """Bind positional dims ``positions`` of ``self`` (a plain tensor or one with dims) to
    first-class ``dims``, as functorch.dim's ``index`` does (``x.index(...)`` for a tensor
    with dims).

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims, index
        >>> i, j = dims(2)
        >>> A = torch.rand(3, 4, 5)
        >>> torch.equal(index(A, (0, 2), (i, j)).order(i, j), A.permute(0, 2, 1))
        True
    """
    return _index(self if isinstance(self, _Tensor) else Tensor(self, ()), positions, dims)


def _index_method(original: Callable) -> Callable:
    """``torch.Tensor.index`` that sends calls with this library's dims (or on its tensors)
    to :func:`index`, and every other call to ``original``."""

    @functools.wraps(original)
    def index_method(self: Any, positions: Any, dims: Any) -> Any:
        if _has_dims((self, positions, dims)):
            return index(self, positions, dims)
        return original(self, positions, dims)

    return index_method


def _has_dims(x: Any) -> bool:
    """Whether ``x`` (nested tuples and lists) holds this library's dims or tensors."""
    if isinstance(x, (tuple, list)):
        return any(_has_dims(e) for e in x)
    return isinstance(x, (_Tensor, DimList))


# torch.Tensor.index on a plain tensor always calls functorch.dim's index (torch/_tensor.py),
# which cannot read this library's dims
torch.Tensor.index = _index_method(torch.Tensor.index)
