"""Shortcuts for a grad level: everyday calls run on the inner tensors before the dispatcher.

A grad level's ``__torch_dispatch__`` runs each op on its inner tensors with PyTorch's
autograd on (autodiff.py). For a call that computes new tensors (or out-of-place views)
from its arguments alone, elementwise math, activations, ``F.linear``, convolution,
reductions, losses, running the whole *call* on the inner tensors does the same: autograd
records it there op by op. It skips the round trip through the dispatcher to the level's
Python key and back, for each op the call is made of: ``torch.sin(x)`` of a grad level
over a vmap level costs about 11 µs instead of 15.

A shortcut declines (the call takes the usual way) whenever anything is unusual: a
tensor of a deeper or an unrelated level or a foreign subclass, an in-place call or an
``out=`` argument, a live forward-AD level, an error; and a call made of several ops
that mixes a vmap level's tensors with a plain one this level tracks (``x @ w`` of a
batch and a weight), which may hand the vmap level plain tensors it makes of that one
(a reshape's copy) that the vmap level cannot tell from ones autograd outside tracks.
The calls of per-sample gradients, ``F.linear``, the norms and convolutions of a batch
and weights, make none but views (``w.t()``), which count as tracked as their base is
(:func:`~torchlevels._level.tracked_outside`): they run here. vmap's rules for composite ops
(``F.linear`` whole) step aside for calls run here, where autograd records on the vmap
level's tensors themselves (batching/composite.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

from torchlevels._level import LevelTensor, requires_grad_flag
from torchlevels._plain import PLAIN
from torchlevels.batching.shortcuts import (
    ACTIVATIONS,
    POINTWISE_DUNDERS,
    POINTWISE_NAMES,
    basic_index,
    no_shortcuts,
    torch_and_tensor,
)
from torchlevels.math_bits import tracked_views_resolved

_no_subclass_torch_function = torch._C.DisableTorchFunctionSubclass
_NUMBERS = (int, float, bool)
_EMPTY: dict = {}


ELEMENTWISE = frozenset((
    *torch_and_tensor(*POINTWISE_NAMES), *(getattr(torch.Tensor, n) for n in POINTWISE_DUNDERS),
    *ACTIVATIONS,
))
# calls that compute new tensors, or out-of-place views, from their arguments alone
CALLS = ELEMENTWISE | frozenset((
    *torch_and_tensor("view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
                       "transpose", "t", "permute", "expand", "narrow", "select", "split",
                       "chunk", "unbind", "matmul", "mm", "bmm", "einsum", "sum", "mean",
                       "amax", "amin", "logsumexp", "std", "var", "norm", "cumsum", "softmax",
                       "log_softmax", "where", "masked_fill", "cat", "concat", "stack"),
    torch.Tensor.__getitem__, torch.Tensor.__matmul__, torch.linalg.vector_norm, F.linear,
    F.softmax, F.log_softmax, F.cross_entropy, F.nll_loss, F.mse_loss, F.layer_norm,
    F.rms_norm, F.group_norm, F.normalize, F.conv1d, F.conv2d, F.conv3d,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
))

# calls that may mix a vmap level's tensors with plain ones this level tracks: their ops
# take those plain tensors as they are, or views of them (``w.t()`` in ``F.linear``),
# which count as tracked as their base (see tracked_outside)
MIXED = ELEMENTWISE | frozenset((
    F.linear, F.layer_norm, F.group_norm, F.rms_norm, F.conv1d, F.conv2d, F.conv3d,
))


def torch_function(cls, func, types, args=(), kwargs=None):
    """A grad level class's ``__torch_function__``: one of :data:`CALLS` on the inner
    tensors, with autograd recording it there, if nothing about it is unusual."""
    kwargs = kwargs or _EMPTY
    level = cls._level
    if func in CALLS and level.alive and not level.paused and forward_ad._current_level < 0:
        # reading our tensors' flags here skips a trip through this hook; the levels inside
        # see the call's ops at their dispatch
        with _no_subclass_torch_function():
            out = _on_inner(cls, func, args, kwargs)
        if out is not None:
            return out
    return no_shortcuts(cls, func, types, args, kwargs)


def _on_inner(cls, func, args, kwargs) -> Any:
    """``func`` on the inner tensors of level ``cls``'s tensors among ``args`` (and keyword
    arguments), wrapped at ``cls``; None to decline."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace")):
        return None
    if func in ACTIVATIONS and any(a is True for a in args[1:]):  # F.relu(x, True): in place
        return None
    if func is _GETITEM and not _index_of_tensors(args[1]):
        return None  # an index of other objects (functorch.dim's dims) is theirs to read
    found = [False, False]  # a tensor of an enclosing level; a plain one that is tracked
    inner = []
    for a in args:  # the hot loop of a chain of small ops: _inner_of's common cases inlined
        t = type(a)
        if t is cls:
            if requires_grad_flag(a):
                return None  # autograd outside records on the wrapper itself
            a = a._inner
            t = type(a)
            if t in PLAIN or _tool_level(t):  # plain, or a tool's
                found[1] = found[1] or requires_grad_flag(a)
            else:
                found[0] = True
        elif t in _NUMBERS:
            pass
        else:
            a = _inner_of(cls, a, found)
            if a is _DECLINE:
                return None
        inner.append(a)
    inner_kwargs = {k: _inner_of(cls, v, found) for k, v in kwargs.items()} if kwargs else _EMPTY
    if kwargs and any(v is _DECLINE for v in inner_kwargs.values()):
        return None
    if found[0] and found[1] and func not in MIXED:
        # another call made of several ops may hand a plain tensor it makes of a tracked
        # one (a reshape's copy in matmul) to a vmap level's op unmarked (see
        # mark_level_graph), and that level would record autograd on its physical tensors
        return None
    # (on the inner tensors the call meets no enclosing level's __torch_function__, and
    # PyTorch's fallback would copy a tracked conj view untracked: see math_bits.py)
    inner, inner_kwargs = tracked_views_resolved(tuple(inner), inner_kwargs)
    try:
        out = func(*inner, **inner_kwargs)
    except RuntimeError:
        return None  # the usual path raises the error, or handles the case
    if kwargs:  # what the call read, for wrap_result
        args, inner = (*args, *kwargs.values()), [*inner, *inner_kwargs.values()]
    return cls._level.wrap_result(cls, args, inner, out)


_DECLINE = object()  # what _inner_of gives for an argument the shortcut cannot take
_GETITEM = torch.Tensor.__getitem__


def _index_of_tensors(index: Any) -> bool:
    """Whether ``x[index]`` indexes by ints, slices, None, ``...`` and tensors only."""
    items = index if type(index) is tuple else (index,)
    return all(basic_index(i) or isinstance(i, torch.Tensor) for i in items)


def _tool_level(t: type) -> bool:
    """Whether tensors of type ``t`` are of a tool's level (count_flops...), which answers
    no calls in ``__torch_function__``: they count as plain here. A vmap level's do not,
    nor do a foreign subclass's (a user's ``LoggingTensor``)."""
    return issubclass(t, LevelTensor) and not t._has_torch_function


def _inner_of(cls, a: Any, found: list) -> Any:
    """Argument ``a`` of a call on level ``cls``: its inner tensor if it is ours, as it is
    if plain or of an enclosing level (noting in ``found`` whether a tensor of an enclosing
    level, and a tracked plain one, were met), or _DECLINE."""
    t = type(a)
    if t is cls:
        if requires_grad_flag(a):
            return _DECLINE  # autograd outside records on the wrapper itself
        a = a._inner
        t = type(a)
    elif isinstance(a, (tuple, list)):  # an index, tensors to concatenate, a shape
        items = [_inner_of(cls, i, found) for i in a]
        if any(i is _DECLINE for i in items):
            return _DECLINE
        if all(i is j for i, j in zip(items, a)):
            return a  # a torch.Size stays one
        return items if t is list else tuple(items)  # a named tuple (aminmax's) as a tuple
    elif not (t in PLAIN or (isinstance(a, LevelTensor) and issubclass(cls, t))):
        if isinstance(a, torch.Tensor):
            return _DECLINE  # of a deeper or an unrelated level, or a foreign subclass
        return a  # a number, a dtype, None...
    if t in PLAIN or _tool_level(t):  # an inner tensor, one unbatched here (a captured
        found[1] = found[1] or requires_grad_flag(a)  # tensor), or a tool's
    else:
        found[0] = True
    return a

