"""Module functions of ``torchlevels.dim``: ``softmax``, ``stack`` and ``cat`` with dims."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim
from torchlevels.dim._getitem import getitem
from torchlevels.dim._ops import batched, order


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
    return torch.nn.functional.softmax(input, dim, *args, **kwargs)


def stack(tensors: Sequence[Any], new_dim: Dim, dim: int = 0) -> Any:
    """Stack ``tensors`` along positional ``dim`` and bind that dim to ``new_dim``.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims, stack
        >>> i, s = dims(2)
        >>> a, b = torch.rand(3), torch.rand(3)
        >>> torch.equal(stack([a[i], b[i]], s).order(s, i), torch.stack([a, b]))
        True
    """
    t = torch.stack(list(tensors), dim)
    return getitem(t, (*[slice(None)] * (dim % t.ndim), new_dim))


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
    return getitem(torch.cat(parts, 0), (new_dim,))


def stack_positional(tensors: Sequence[Any], dim: Any = 0, **kwargs: Any) -> Any:
    """``torch.stack`` on tensors with dims; a Dim as ``dim`` makes a first-class dim."""
    if isinstance(dim, Dim):
        return stack(tensors, dim, 0)
    return batched(torch.stack, (tensors, dim), kwargs)
