"""First-class dimensions: a drop-in for ``functorch.dim`` on this project's levels.

``dims()`` makes dimension objects; indexing a tensor with them binds them
(``A[i, k]``); every op batches over the union of its inputs' dims (Rule 1); a dim works
wherever torch takes a ``dim`` (Rule 2); a dim is the tensor of its own indices (Rule 3);
``.order(...)`` turns dims back into positional dims. A product summed over a shared dim
runs as one matmul. Ops that are not pointwise run under one vmap level per dim.

Example::

    >>> import torch
    >>> from torchlevels.dim import dims
    >>> def mm(A, B):
    ...     i, j, k = dims(3)
    ...     return (A[i, k] * B[k, j]).sum(k).order(i, j)
    >>> A, B = torch.rand(3, 4), torch.rand(4, 5)
    >>> torch.allclose(mm(A, B), A @ B)
    True
"""

# _base first: it imports _ops, which needs _Tensor from it and Dim from _dims.
from torchlevels.dim._base import _Tensor  # noqa: F401  isort: skip
from torchlevels.dim._dims import (
    Dim,
    DimensionBindError,
    DimensionMismatchError,
    DimList,
    dimlists,
    dims,
)
from torchlevels.dim._functions import cat, index, softmax, split, stack
from torchlevels.dim._ops import Tensor

__all__ = [
    "Dim",
    "DimList",
    "DimensionBindError",
    "DimensionMismatchError",
    "Tensor",
    "cat",
    "dimlists",
    "dims",
    "index",
    "softmax",
    "split",
    "stack",
]
