"""Forwarding levels: the base of tools that watch ops (flop counting, logging).

A forwarding level's tensor stands for the same value as the tensor it wraps, one level
out. Each op on its tensors is shown to :meth:`ForwardingLevel.process` with them
unwrapped, runs one level out, and its tensor outputs are wrapped again, so the level
sees every later op computed from them. Where the level sits decides what it sees:
outside ``vmap(grad(f))`` it sees the batched forward and backward ops; inside
``vmap(f)`` it sees the per-example ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from torchlevels._level import (
    Level,
    LevelTensor,
    autograd_on,
    follow_inner,
    through,
    unwrap_own,
    wrap_all,
    wrap_inner,
    wraps,
)
from torchlevels.batching.registry import writes_first_argument


class ForwardingLevel(Level):
    """A level that shows each op on its tensors to :meth:`process` and forwards it out.

    Subclass it and override :meth:`process`; enter it with :func:`torchlevels.enter_level`.
    Autograd outside the level sees the ops on the wrapped tensors, so
    ``count_flops(f)(x).sum().backward()`` differentiates ``f`` as usual.

    Example::

        >>> import torch
        >>> from torchlevels import ForwardingLevel, enter_level
        >>> class OpNames(ForwardingLevel):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.seen = []
        ...     def process(self, func, args, kwargs):
        ...         self.seen.append(str(func))
        ...         return func(*args, **kwargs)
        >>> with enter_level(OpNames()) as L:
        ...     y = L.unwrap(L(torch.ones(2)).exp() * 2)
        >>> L._level.seen
        ['aten.exp.default', 'aten.mul.Tensor']
    """

    kind = "forwarding"

    def wrap(self, cls: type[LevelTensor], tensor: torch.Tensor) -> torch.Tensor:
        """``L(t)``: ``t`` as a tensor of this level (same value, watched from now on)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{cls.__name__}(t): t must be a Tensor, got {type(tensor).__name__}")
        return wrap_inner(cls, tensor)

    def unwrap(self, cls: type[LevelTensor], tensor: Any) -> Any:
        """The tensor one level out (anything else as is)."""
        if type(tensor) is cls:
            return tensor._inner
        if wraps(tensor, cls):  # its ops on ours ran inside it
            return through(tensor, lambda t: self.unwrap(cls, t))
        return tensor

    def rewrap(self, cls: type[LevelTensor], tensor: torch.Tensor) -> torch.Tensor:
        return wrap_inner(cls, tensor._inner)

    def process(self, func, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` one level out; ``args`` and ``kwargs`` hold no tensor of this level."""
        return func(*args, **kwargs)

    def dispatch(self, cls, func, args, kwargs):
        inner_args = [unwrap_own(a, cls) for a in args]
        inner_kwargs = {k: unwrap_own(v, cls) for k, v in kwargs.items()} if kwargs else {}
        with autograd_on():  # autograd outside records on the inner tensors, as grad does
            out = self.process(func, tuple(inner_args), inner_kwargs)
        if writes_first_argument(func):
            self_ = args[0]
            if type(self_) is cls:
                follow_inner(self_)
            return self_
        return wrap_all(cls, out)


def call_in_level(cls: type[LevelTensor], func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` on every tensor of ``args`` and ``kwargs`` wrapped at level ``cls``, its
    outputs unwrapped."""
    def wrap(t: Any) -> Any:
        return cls(t) if isinstance(t, torch.Tensor) else t

    out = func(*tree_map(wrap, args), **tree_map(wrap, kwargs))
    return tree_map(lambda t: cls.unwrap(t) if isinstance(t, torch.Tensor) else t, out)


def wraps_function(func: Callable, obj: Any) -> Any:
    """Copy ``func``'s name and docstring onto the callable object ``obj``."""
    functools.update_wrapper(obj, func, updated=())
    return obj
