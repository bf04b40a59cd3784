"""``t.data = value`` with ``value`` a tensor of a level and ``t`` not one raises.

PyTorch's setter shallow-copies ``value``'s TensorImpl into ``t``. A level's tensor is a
wrapper with no memory of its own, so ``t`` would come out a plain tensor that points at
no data: its next op crashes the interpreter. torch.func refuses ``.data`` assignments
inside its transforms; a level's own tensors refuse them too (see
``torchlevels._level.data_property``). So importing torchlevels replaces
``torch.Tensor.data`` once with a property that refuses such a value and is PyTorch's own
for every other.

Example::

    >>> import torch
    >>> from torchlevels import grad
    >>> def f(x):
    ...     buffer = torch.zeros(3)
    ...     buffer.data = x * 2  # PyTorch would leave a tensor with no memory behind
    ...     return x.sum()
    >>> grad(f)(torch.ones(3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: `t.data = value`: value is a tensor of grad (created at ...) and t is not, ...
"""

from __future__ import annotations

from typing import Any

import torch

from torchlevels._level import LevelTensor

pytorch_data = torch._C.TensorBase.data  # PyTorch's own


def _set_data(tensor: torch.Tensor, value: Any) -> None:
    if isinstance(value, LevelTensor) and not isinstance(tensor, LevelTensor):
        raise RuntimeError(
            f"`t.data = value`: value is a tensor of {type(value)._level.describe()} and t "
            "is not, which is not supported (torch.func refuses it too): t would be left "
            "holding no memory. Use value in place of t from here on, or compute t outside "
            "the transform.")
    pytorch_data.__set__(tensor, value)


data_property = property(pytorch_data.__get__, _set_data, doc=pytorch_data.__doc__)


def install() -> None:
    """Refuse a level's tensor as the value of ``t.data = value`` (done on import)."""
    torch.Tensor.data = data_property


install()
