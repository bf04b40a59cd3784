"""What every tensor with first-class dims shares (``Dim`` and ``Tensor`` both are one).

Such a tensor is ``_tensor``, a plain torch.Tensor (or a tensor of a transform level)
whose leading dims are the first-class ``_dims``, in order, followed by the positional
dims. Every torch function and Tensor method reaches ``_ops.torch_function`` through
``__torch_function__`` or the attributes copied here from torch.Tensor (its operators and
public methods and properties, as functorch.dim's Tensor has them: ``Tensor.clamp``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Read straight from the underlying tensor: they do not depend on the dims.
_METADATA = frozenset({
    "dtype", "device", "layout", "requires_grad", "is_cuda", "is_sparse", "is_quantized",
    "is_meta", "is_leaf", "grad_fn", "is_floating_point", "is_complex", "element_size",
    "get_device", "is_contiguous",
})

_OPERATORS = (
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__",
    "__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__",
    "__floordiv__", "__rfloordiv__", "__ifloordiv__", "__mod__", "__rmod__", "__imod__",
    "__pow__", "__rpow__", "__ipow__", "__matmul__", "__rmatmul__",
    "__and__", "__rand__", "__iand__", "__or__", "__ror__", "__ior__",
    "__xor__", "__rxor__", "__ixor__", "__lshift__", "__rlshift__", "__rshift__",
    "__rrshift__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__neg__", "__pos__", "__abs__", "__invert__", "__getitem__", "__setitem__",
)


class _Tensor:
    """Base of ``Dim`` and ``Tensor``: positional metadata, operators, and Tensor methods."""

    __slots__ = ()
    _tensor: torch.Tensor
    _dims: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _ops.torch_function(func, args, kwargs or {})

    @property
    def dims(self) -> tuple:
        """The first-class dims of this tensor, in storage order."""
        return self._dims

    @property
    def ndim(self) -> int:
        """The number of positional dims (first-class dims are not counted)."""
        return self._tensor.ndim - len(self._dims)

    def dim(self) -> int:
        return self.ndim

    @property
    def shape(self) -> torch.Size:
        """The positional shape."""
        return self._tensor.shape[len(self._dims):]

    def size(self, dim: int | None = None) -> torch.Size | int:
        if dim is None:
            return self.shape
        try:
            return self.shape[dim]
        except IndexError:
            raise IndexError(_ops.out_of_range(self, f"size({dim})")) from None

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a tensor with no positional dims")
        return self.shape[0]

    def __bool__(self) -> bool:
        raise ValueError(
            f"the truth value of a tensor with first-class dims {self._dims} is ambiguous: "
            "reduce over them (.all(dims), .any(dims)) or .order() them first"
        )

    def __float__(self) -> float:
        raise ValueError(_ops.python_value(self, "float()"))

    def __int__(self) -> int:
        raise ValueError(_ops.python_value(self, "int()"))

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def order(self, *dims: Any) -> Any:
        """Move ``dims`` back to positional dims, on the left, in this order. A tuple or
        list of dims becomes one flattened dim. With no first-class dims left, the
        result is a plain torch.Tensor.

        Example::

            >>> import torch
            >>> from torchlevels.dim import dims
            >>> i, j = dims(2)
            >>> A = torch.rand(3, 4)
            >>> torch.equal(A[i, j].order(j, i), A.T)
            True
        """
        return _ops.order(self, dims)

    def index(self, dims: Any, indices: Any) -> Any:
        """Index first-class ``dims`` (one dim or a sequence) with ``indices``.

        Example::

            >>> import torch
            >>> from torchlevels.dim import dims
            >>> i, j = dims(2)
            >>> A = torch.rand(3, 4)
            >>> torch.equal(A[i, j].index(i, 1).order(j), A[1])
            True
        """
        return _ops.index(self, dims, indices)

    def expand(self, *sizes: Any) -> Any:
        """With dims as arguments, add them as broadcast (stride 0) first-class dims;
        otherwise Tensor.expand on the positional dims."""
        return _ops.expand(self, sizes)

    def __repr__(self) -> str:
        return _ops.describe(self)

    __hash__ = object.__hash__


def _attribute(name: str, attr: Any) -> Any:
    """torch.Tensor's attribute ``name`` (``attr``) for a tensor with dims: metadata read
    from the tensor behind it, anything else an op on it."""
    if callable(attr):
        if name in _METADATA:
            def method(self, *args, **kwargs):
                return getattr(self._tensor, name)(*args, **kwargs)
        else:
            def method(self, *args, **kwargs):
                return _ops.torch_function(attr, (self, *args), kwargs)
        return functools.update_wrapper(method, attr, assigned=("__name__", "__doc__"),
                                        updated=())
    if name in _METADATA:
        return property(lambda self: getattr(self._tensor, name), doc=attr.__doc__)
    # a property that computes (x.T, x.real, ...): an op like any other
    return property(lambda self: _ops.torch_function(attr.__get__, (self,), {}),
                    doc=attr.__doc__)


for _name in (*_OPERATORS, *(n for n in dir(torch.Tensor) if not n.startswith("_"))):
    if _name not in _Tensor.__dict__:
        setattr(_Tensor, _name, _attribute(_name, getattr(torch.Tensor, _name)))

# The ops need _Tensor, so they are imported after it (torchlevels.dim imports this first).
from torchlevels.dim import _ops  # noqa: E402
