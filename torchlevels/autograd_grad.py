"""``torch.autograd.grad`` called inside a grad level differentiates at that level.

Inside ``grad(f)``, ``f``'s tensors are the level's wrappers, and the level's graph is on
the tensors they wrap (see autodiff.py), so PyTorch's engine, handed the wrappers, finds
no graph. torch.func lets ``f`` differentiate at the current level with
``torch.autograd.grad(y, x, create_graph=True)``, the way a physics-informed loss takes
``du/dx`` of a network's output. So importing torchlevels wraps ``torch.autograd.grad``
once: a call on tensors of the innermost live level, a grad level, runs on the tensors
they wrap and returns tensors of that level (tracked by it when ``create_graph=True``,
so the level differentiates through them); every other call is PyTorch's own. Among
those are a level's own calls, on tensors of the levels around it that carry its graph.
Such a call may also name plain tensors, or tensors of the levels around it, that the
level's graph holds: a leaf made inside ``f`` for a gradient penalty, ``du/dx`` at a
``x.detach().requires_grad_()``, differentiates as it would without the transform. A
tool's level (``count_flops``) hands a call on its tensors to the level around it, as if
the tool were not there.

Example::

    >>> import torch
    >>> from torchlevels import grad
    >>> def f(x):  # d/dx of a value that is itself a derivative
    ...     (dy,) = torch.autograd.grad(x.sin(), x, create_graph=True)
    ...     return dy
    >>> grad(f)(torch.tensor(0.5)) == -torch.tensor(0.5).sin()
    tensor(True)
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any

import torch

from torchlevels._level import (
    EscapedTensorError,
    LevelTensor,
    UnrelatedLevelsError,
    enclosing_classes,
    escape_message,
    innermost,
    unwrap_own,
    wrap_inner,
)
from torchlevels.autodiff import GradLevel, backward_pass
from torchlevels.tools.forwarding import ForwardingLevel

pytorch_grad = torch.autograd.grad  # PyTorch's own


def on_this_thread(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """PyTorch's ``torch.autograd.grad``, on this thread: on a GPU its engine runs a backward
    pass on a worker thread of its own, where the context (the live levels, kept in
    context variables) is not the caller's, so the levels' ops and hooks there would run
    as if no level were live."""
    with torch.autograd.set_multithreading_enabled(False):
        return pytorch_grad(outputs, inputs, *args, **kwargs)


# the outputs of a level's own call while it is handed back to torch.autograd.grad
# (see own_grad)
_own_call: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "torchlevels_own_grad_call", default=None)


def own_grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """PyTorch's ``torch.autograd.grad``, for a level's own calls on the tensors levels
    wrap. PyTorch hands a call on tensors with ``__torch_function__`` back to
    ``torch.autograd.grad``, which is :func:`grad` below, once for each torch function
    mode too (``with torch.device(...)``): the mark set here, the call's outputs, keeps
    it from being taken for a user's call at the innermost grad level (``vjp_fn`` of a
    vjp made inside ``grad`` runs on that level's tensors)."""
    token = _own_call.set(_tensors(outputs))
    try:
        return on_this_thread(outputs, inputs, *args, **kwargs)
    finally:
        _own_call.reset(token)


def _tensors(arg: Any) -> list | None:
    """``arg`` as a list of tensors (one tensor, or a sequence of them), else None."""
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in arg):
        return list(arg)
    return None


def _same_tensors(a: list, b: list | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _at_grad_level(cls: type[LevelTensor] | None, outputs: Any, inputs: Any
                   ) -> tuple[type[LevelTensor], list, list] | None:
    """``cls`` and the call's outputs and inputs as lists, if ``cls`` is a grad level's
    class and the call is on its tensors, else None: PyTorch's own call. The others must
    be tensors the level's graph can hold: plain tensors, or those of the levels around
    it (a leaf made inside ``f``, as for a gradient penalty)."""
    if cls is None or not isinstance(cls._level, GradLevel):
        return None
    outs, ins = _tensors(outputs), _tensors(inputs)
    if outs is None or ins is None or not any(type(t) is cls for t in (*outs, *ins)):
        return None  # plain tensors, or (a level's own code) tensors of a level around it
    stray = [t for t in (*outs, *ins)
             if isinstance(t, LevelTensor) and not issubclass(cls, type(t))]
    if stray and not stray[0]._level.alive:
        raise EscapedTensorError(escape_message(stray[0]._level, "torch.autograd.grad"))
    if stray:  # the levels inside cls have exited: a live one is unrelated to it
        raise UnrelatedLevelsError(
            f"torch.autograd.grad inside {cls._level.describe()}: one of its outputs or "
            f"inputs is a tensor of {stray[0]._level.describe()}, a transform not nested "
            "around it, whose tensors its graph cannot hold. Unwrap that tensor before "
            "using it here."
        )
    return cls, outs, ins


@functools.wraps(pytorch_grad)
def grad(outputs: Any, inputs: Any, grad_outputs: Any = None, *args: Any, **kwargs: Any
         ) -> Any:
    # PyTorch's docstring (functools.wraps): this is torch.autograd.grad from now on
    own = _own_call.get()
    if own is not None and _same_tensors(own, _tensors(outputs)):  # (not a hook's call)
        return on_this_thread(outputs, inputs, grad_outputs, *args, **kwargs)
    return _differentiated_at(innermost(), outputs, inputs, grad_outputs, args, kwargs)


def _differentiated_at(cls: type[LevelTensor] | None, outputs: Any, inputs: Any,
                       grad_outputs: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` called while ``cls`` is the innermost live level. A tool's
    level (count_flops...) passes the call on to the level around it, with its tensors
    unwrapped and the gradients wrapped again: they stand for the same values."""
    if cls is not None and isinstance(cls._level, ForwardingLevel):
        outer = next(enclosing_classes(cls.__base__), None)
        if not any(type(t) is cls for t in (*(_tensors(outputs) or ()),
                                            *(_tensors(inputs) or ()))):
            return _differentiated_at(outer, outputs, inputs, grad_outputs, args, kwargs)
        results = _differentiated_at(
            outer, unwrap_own(outputs, cls), unwrap_own(inputs, cls),
            unwrap_own(grad_outputs, cls), args, kwargs)
        return tuple(None if r is None else wrap_inner(cls, r) for r in results)
    found = _at_grad_level(cls, outputs, inputs)
    if found is None:
        call = on_this_thread if innermost() is not None else pytorch_grad
        return call(outputs, inputs, grad_outputs, *args, **kwargs)
    cls, outs, ins = found
    if grad_outputs is not None:
        grad_outputs = [unwrap_own(g, cls) for g in (_tensors(grad_outputs) or grad_outputs)]
    with backward_pass(cls):
        results = on_this_thread([unwrap_own(t, cls) for t in outs],
                               [unwrap_own(t, cls) for t in ins], grad_outputs, *args, **kwargs)
    return tuple(None if r is None else wrap_inner(cls, r) for r in results)


def install() -> None:
    """Route ``torch.autograd.grad`` through the grad levels (done on import)."""
    torch.autograd.grad = grad


install()
