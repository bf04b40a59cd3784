"""A user-defined level: int8 weight-only quantization that dequantizes on use.

``Q(w)`` stores ``w`` as int8 with one float scale per row; every op that meets a
quantized weight gets its dequantized value, so models run unchanged, and because it is
a level, ``vmap`` and ``grad`` nested inside it compose with it (docs/writing-a-transform.md).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_map

from torchlevels import Level, LevelTensor, enter_level


class Int8Weights(Level):
    """Its tensors hold int8 values and per-row scales; ops see the dequantized floats."""

    kind = "int8 weights"

    def wrap(self, cls: type[LevelTensor], w: torch.Tensor) -> torch.Tensor:
        scale = w.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
        return self.new(cls, torch.round(w.detach() / scale).to(torch.int8), scale, w.dtype)

    def new(self, cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        t = torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=dtype, device=q.device)
        t._inner, t._scale = q, scale
        return t

    def unwrap(self, cls: type[LevelTensor], t):
        """The dequantized weight (anything else as is)."""
        return t._inner.to(t.dtype) * t._scale if type(t) is cls else t

    def rewrap(self, cls, t):
        return self.new(cls, t._inner, t._scale, t.dtype)

    def dispatch(self, cls, func, args, kwargs):
        def dequantize(a):
            return self.unwrap(cls, a)

        return func(*tree_map(dequantize, args), **tree_map(dequantize, kwargs))


@contextmanager
def int8_weights() -> Iterator[type[LevelTensor]]:
    """A fresh quantization level; yields its class ``Q``: ``Q(w)`` quantizes ``w``.

    Example::

        >>> w = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
        >>> with int8_weights() as Q:
        ...     qw = Q(w)
        ...     (torch.ones(2) @ qw.T, qw._inner.dtype)  # 0.5 is stored as 64/127
        (tensor([-0.4961,  2.2520]), torch.int8)
    """
    with enter_level(Int8Weights(), "Int8Tensor") as cls:
        yield cls
