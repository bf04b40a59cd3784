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
import torch.autograd.forward_ad as fwAD
from torch.utils._pytree import tree_map

from torchlevels._level import (
    Level,
    LevelTensor,
    autograd_on,
    data_property,
    follow_inner,
    new_level_class,
    requires_grad_flag,
    through,
    unwrap_own,
    wrap_all,
    wrap_inner,
    wraps,
)
from torchlevels.batching.registry import written_arguments, written_positions
from torchlevels.batching.shortcuts import no_shortcuts
from torchlevels.inner_duals import primals


class ForwardingLevel(Level):
    """A level that shows each op on its tensors to :meth:`process` and forwards it out.

    Subclass it and override :meth:`process`; enter it with :func:`torchlevels.enter_level`.
    Autograd outside the level sees the ops on the wrapped tensors, so
    ``count_flops(f)(x).sum().backward()`` differentiates ``f`` as usual, and code in
    ``f`` reads what it would read without the level (``requires_grad``, ``grad_fn``...).

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

    def new_class(self, name: str) -> type[LevelTensor]:
        """A class whose tensors answer autograd's attributes as the tensors they wrap do
        (see ``_AS_WRAPPED``), and hand each Python call on as the levels around handle
        it there (a grad level takes in a plain buffer written in place, vmap indexes by
        each example's 0-dim index), answering none themselves."""
        cls = new_level_class(self, name, classmethod(no_shortcuts), **_AS_WRAPPED)
        cls._has_torch_function = False  # (no shortcuts of its own)
        return cls

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
            if self.hosts_jvp and fwAD._current_level >= 0:
                # the plain duals a jvp level inside made (a captured constant's, with a
                # zero tangent): forward AD, on here, would give the inner result that
                # tangent, unbatched under a vmap outside, which a later in-place op then
                # writes (see torchlevels.inner_duals)
                level = fwAD._current_level
                inner_args = primals(inner_args, level, written=True)
                inner_kwargs = {k: primals(v, level, written=True) for k, v in inner_kwargs.items()}
            out = self.process(func, tuple(inner_args), inner_kwargs)
        if not written_positions(func):
            return wrap_all(cls, out)
        return _written_outputs(cls, func, args, kwargs, out)


def _written_outputs(cls: type[LevelTensor], func, args: tuple, kwargs: dict, out: Any) -> Any:
    """The outputs of ``func``, which wrote some of its arguments (in place, or ``out=``):
    each of ours written takes its inner tensor's new shape (``squeeze_``, an ``out=``
    tensor the op resized), and an output that is a written argument is that argument."""
    arguments = func._schema.arguments

    def argument(k: int) -> Any:
        return args[k] if k < len(args) else kwargs.get(arguments[k].name)

    for k in written_positions(func):
        written = argument(k)
        for t in written if type(written) in (list, tuple) else (written,):
            if type(t) is cls:
                follow_inner(t)
    returned = written_arguments(func)
    if isinstance(out, torch.Tensor):
        return wrap_all(cls, out) if returned[0] is None else argument(returned[0])
    if isinstance(out, (tuple, list)):
        return type(out)(wrap_all(cls, o) if k is None else argument(k)
                         for o, k in zip(out, returned))
    return out


# PyTorch's own answers, for a tool's tensor that autograd records on itself: a grad level
# inside the tool makes its leaves of the tool's tensors (and its ops' results on them)
_OWN_GRAD_FN = torch._C.TensorBase.grad_fn.__get__
_OWN_IS_LEAF = torch._C.TensorBase.is_leaf.__get__
_OWN_DATA = torch._C.TensorBase.data.__get__


def _requires_grad(t: LevelTensor) -> bool:
    return requires_grad_flag(t) or t._inner.requires_grad


def _set_requires_grad(t: LevelTensor, requires_grad: bool) -> None:
    t._inner.requires_grad = requires_grad


def _requires_grad_(t: LevelTensor, requires_grad: bool = True) -> LevelTensor:
    t._inner.requires_grad_(requires_grad)
    return t


def _grad_fn(t: LevelTensor) -> Any:
    return _OWN_GRAD_FN(t) if requires_grad_flag(t) else t._inner.grad_fn


def _is_leaf(t: LevelTensor) -> bool:
    return _OWN_IS_LEAF(t) if requires_grad_flag(t) else t._inner.is_leaf


def _data(t: LevelTensor) -> torch.Tensor:
    return _OWN_DATA(t) if requires_grad_flag(t) else wrap_inner(type(t), t._inner.data)


def _detach_(t: LevelTensor) -> LevelTensor:
    if requires_grad_flag(t):
        return torch.Tensor.detach_(t)
    t._inner.detach_()
    return t


def _register_hook(t: LevelTensor, hook: Callable) -> Any:
    if requires_grad_flag(t):
        return torch.Tensor.register_hook(t, hook)
    return t._inner.register_hook(hook)


def _backward(t: LevelTensor, gradient: Any = None, *args: Any, **kwargs: Any) -> None:
    if requires_grad_flag(t):
        return torch.Tensor.backward(t, gradient, *args, **kwargs)
    return t._inner.backward(unwrap_own(gradient, type(t)), *args, **kwargs)


# What a forwarding level's tensors answer: what the tensor each wraps answers, so that
# code reading them computes as it would without the tool (inside grad, ``t.requires_grad``
# is True for a tensor computed from the input; ``t.data`` stops the grad tracking it),
# unless autograd records on the tensor itself (see _OWN_GRAD_FN)
_AS_WRAPPED = {
    "requires_grad": property(_requires_grad, _set_requires_grad),
    "requires_grad_": _requires_grad_,
    "grad_fn": property(_grad_fn),
    "is_leaf": property(_is_leaf),
    "data": data_property(_data),
    "detach_": _detach_,
    "register_hook": _register_hook,
    "backward": _backward,
}


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
