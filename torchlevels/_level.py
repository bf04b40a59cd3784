"""Levels as dynamically allocated classes.

Every transform invocation (one call of ``vmap(f)``, one ``with vmap() as B``) makes a
fresh subclass of :class:`LevelTensor` whose parent is the class of the innermost live
level. PyTorch's ``__torch_dispatch__`` tries a subclass before its parent, so the
innermost transform runs first, unwraps its own tensors and re-dispatches to the next
one out. Nothing here keeps an integer level or consults a stack at dispatch time: the
only state is the ``_innermost`` context variable, read when a new level class is made.
"""

from __future__ import annotations

import contextvars
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map_only

from torchlevels import math_bits

# The class of the innermost live level, per thread and per context. Read only when a
# new level class is made (to pick its parent) and by the random-factory hook.
_innermost: contextvars.ContextVar[type[LevelTensor] | None] = contextvars.ContextVar(
    "torchlevels_innermost", default=None
)


_DETACH = torch.ops.aten.detach.default
_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality
_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"))
_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView
_CONJUGATE = torch._C.DispatchKey.Conjugate
_NEGATIVE = torch._C.DispatchKey.Negative
_ZERO_TENSOR = torch._C.DispatchKey.ZeroTensor
# saves every dispatch key's state, restores it on exit (cheaper than saving three here)
preserved_dispatch_keys = torch._C._PreserveDispatchKeyGuard
_key_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
_restore_tls = torch._C._RestorePythonTLSSnapshot
_PYTHON_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)
_python_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_set_included = torch._C._dispatch_tls_set_dispatch_key_included
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_no_subclass_torch_function = torch._C.DisableTorchFunctionSubclass
_disabled_torch_function = torch._C._disabled_torch_function_impl
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
_default_dtype = torch.get_default_dtype
# PyTorch's own requires_grad flag, which autograd reads: on a level's tensor it says
# whether autograd of a level inside records ops on it. (A grad level's tensors answer
# ``t.requires_grad`` to users as torch.func's do: see autodiff.py.)
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
requires_grad_flag = _REQUIRES_GRAD.__get__
set_requires_grad_flag = _REQUIRES_GRAD.__set__


# An op that a foreign subclass passes on to the tensors it wraps, as it passes any op:
# ``through(t, fn)`` runs ``fn`` on each of them (see :func:`through`).
_library = torch.library.Library("torchlevels", "DEF")  # kept alive for the process
_library.define("through(Tensor self) -> Tensor")
_through_fn: contextvars.ContextVar = contextvars.ContextVar("torchlevels_through")
_library.impl("through", lambda t: _through_fn.get()(t), "CompositeExplicitAutograd")
_THROUGH = torch.ops.torchlevels.through.default


def is_foreign(t: Any) -> bool:
    """Whether ``t`` is a tensor of a subclass torchlevels does not know that handles ops
    itself (a user's logging tensor), which may wrap tensors of a level."""
    return (isinstance(t, torch.Tensor) and not isinstance(t, LevelTensor)
            and type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__)


def through(tensor: torch.Tensor, fn: Any) -> torch.Tensor:
    """``fn`` run on the tensors that foreign subclass ``tensor`` wraps, as an op that it
    passes on to them: a level's unwrap reaches its own tensors inside a foreign one
    (``x + LoggingTensor(w)`` under vmap gives a logging tensor around a batched one)."""
    if requires_grad_flag(tensor) and torch.is_grad_enabled():
        raise NotImplementedError(
            f"torchlevels: a {type(tensor).__name__} that requires grad wraps a tensor of a "
            "transform, which cannot be unwrapped through it keeping its history. Pass "
            f"the {type(tensor).__name__} to the transformed function as an input instead "
            "of using it from outside (a closure)")
    token = _through_fn.set(fn)
    try:
        return _THROUGH(tensor)
    finally:
        _through_fn.reset(token)


def memory_of(t: Any) -> Any:
    """The plain tensor that ``t``, a tensor of some levels, holds its values in (``t``
    itself if it is of none)."""
    while isinstance(t, LevelTensor):
        t = t._inner
    return t


def wraps(tensor: Any, cls: type[LevelTensor]) -> bool:
    """Whether ``tensor`` is a foreign subclass's that wraps a tensor of level ``cls``
    (its ops on that level's tensors ran inside it). A subclass that refuses ops it does
    not know (``through`` among them) wraps none."""
    if not is_foreign(tensor):
        return False
    found = []

    def note(t: torch.Tensor) -> torch.Tensor:
        found.append(type(t) is cls or wraps(t, cls))
        return t

    try:
        with torch.no_grad():  # only looks
            through(tensor, note)
    except Exception:
        if not found:
            return False
        raise
    return any(found)


class EscapedTensorError(RuntimeError):
    """A tensor of a transform that has already exited was used."""


class UnrelatedLevelsError(RuntimeError):
    """Tensors of two live transforms that are not nested in each other were mixed."""


class Level:
    """The state of one transform invocation; each level class holds one in ``_level``.

    Subclasses implement :meth:`dispatch` (what the transform does to an op) and
    :meth:`describe` (a short name for error messages, e.g. ``vmap``).
    """

    kind = "level"
    differentiates = False  # whether the level takes derivatives of the ops run on its tensors
    # made by a transform of a function (vmap(f), grad(f)...), not entered by a `with` block
    # (``with vmap() as B``): what an escaped tensor's error suggests
    functional = False

    # the tensors it took in when written with its values (see torchlevels.lifted), given
    # back at its exit
    lifted: list[torch.Tensor] | None = None
    # whether a jvp level was entered inside it: that level's duals, which share PyTorch's
    # one forward-AD level, may then reach its ops (see torchlevels.inner_duals)
    hosts_jvp = False

    def __init__(self) -> None:
        self.alive = True
        self.where = _user_frame()

    def dispatch(self, cls: type[LevelTensor], func, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def wrap(self, cls: type[LevelTensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def unwrap(self, cls: type[LevelTensor], tensor: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def rewrap(self, cls: type[LevelTensor], tensor: Any) -> Any:
        """A new tensor object for the same value of this level, dispatching no op."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.kind} (created at {self.where})"

    def new_class(self, name: str) -> type[LevelTensor]:
        """The class of this level's tensors, named ``name``, nested in the innermost live
        level (:func:`new_level_class`). Overridden by a level whose tensors answer Python
        calls or attributes (``requires_grad``...) otherwise than PyTorch's wrappers do:
        a tool's answer as the tensors they wrap."""
        return new_level_class(self, name)


def refuse_functional(api: str, tensor: torch.Tensor) -> None:
    """Inputs of torch.func.functionalize cannot enter a level: PyTorch crashes (vmap) or
    misreports (grad) running a level's ops on them."""
    if torch._is_functional_tensor(tensor):
        raise RuntimeError(
            f"{api}: got an input made by torch.func.functionalize, which cannot run around "
            f"a torchlevels transform. Put functionalize inside it instead: "
            f"{api}(functionalize(f))."
        )


def _user_frame() -> str:
    """The innermost stack frame outside torchlevels, torch and contextlib: the user's."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_INTERNAL) or name.endswith("contextlib.py")):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


_INTERNAL = (os.path.dirname(torch.__file__), *(
    os.path.join(os.path.dirname(__file__), name)
    for name in os.listdir(os.path.dirname(__file__)) if name != "demo.py"
))


_TRACED_BY_COMPILE = (
    "{}: torch.compile traced a tensor of {} (its FakeTensors reached the level): a "
    "torchlevels transform runs eagerly, so a call to one is a graph break, which "
    "torch._dynamo.allow_in_graph on it overrides. Remove allow_in_graph, or trace the "
    "transform with torchlevels.compile.")


class LevelTensor(torch.Tensor):
    """The base of every level class: a wrapper holding the tensor one level out.

    An instance's ``_inner`` is the tensor it wraps, which may itself be a tensor of an
    enclosing level. Subclasses are made only by :func:`new_level_class`.
    """

    __slots__ = ("_inner", "_bdim")  # read and written on every op: slots are quicker
    _level: Level
    _inner: torch.Tensor
    _bdim: int  # a vmap level's: the batch dim of ``_inner``
    __torch_function__ = _disabled_torch_function
    _has_torch_function = False  # whether it answers calls in __torch_function__ (no tool does)

    def __new__(cls, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``B(t, ...)``: ``t`` as a tensor of level ``B`` (for vmap: ``B(t, dim=0)``)."""
        if not cls._level.alive:
            raise EscapedTensorError(
                f"{cls.__name__}(t): {cls._level.describe()} has exited, so it makes no more "
                "tensors: wrap t inside its `with` block")
        return cls._level.wrap(cls, resolved(tensor), *args, **kwargs)

    @classmethod
    def unwrap(cls, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """``B.unwrap(t, ...)``: ``t`` one level down (for vmap: ``B.unwrap(t, out_dim=0)``)."""
        return cls._level.unwrap(cls, tensor, *args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        level = cls._level
        if not level.alive:
            raise EscapedTensorError(escape_message(level, func))
        for t in types:
            if t is cls or issubclass(cls, t):
                continue  # ours, or a tensor of an enclosing level: unbatched here
            if issubclass(t, LevelTensor):
                if not t._level.alive:
                    raise EscapedTensorError(escape_message(t._level, func))
                if issubclass(t, cls):
                    return NotImplemented  # a deeper level declined this op
                raise UnrelatedLevelsError(
                    f"{func}: got tensors of two unrelated live transforms, "
                    f"{t._level.describe()} and {level.describe()}. One is not nested in "
                    "the other, so their batch dimensions cannot be matched. Unwrap the "
                    "tensor of one transform before using it in the other."
                )
            if issubclass(t, FakeTensor):
                raise RuntimeError(_TRACED_BY_COMPILE.format(func, level.describe()))
            return NotImplemented  # a foreign subclass: let it go first
        if func is _THROUGH:
            return _through_fn.get()(args[0])
        if func is _DETACH and not _key_excluded(_AUTOGRAD):
            # autograd's own shallow copy (a saved output), not a user's detach: keep the
            # value and its history in every enclosing level (see DESIGN.md, the detach trap)
            return level.rewrap(cls, args[0])
        with _no_subclass_torch_function():  # ops inside a level skip vmap's shortcuts
            return level.dispatch(cls, func, args, kwargs or {})

    # -- Python values: PyTorch reads them so only for plain tensors ----------------------
    def tolist(self) -> Any:
        """``t.tolist()``, which PyTorch refuses for tensor subclasses: each element read
        as ``t.item()`` reads it. A grad or jvp level gives the values, as torch.func does;
        vmap raises its error for a value that differs from example to example."""
        if self.dim() == 0:
            return self.item()
        return [row.tolist() for row in self.unbind()]

    def data_ptr(self) -> int:
        """PyTorch answers 0 for every wrapper, so ``a.data_ptr() == b.data_ptr()`` would
        call any two of a level's tensors aliases: raise, as torch.func's transforms do."""
        raise RuntimeError(f"{type(self).__name__}.data_ptr(): a tensor of "
                           f"{type(self)._level.describe()} has no storage of its own; "
                           "Cannot access data pointer of Tensor that doesn't have storage")

    def untyped_storage(self) -> torch.UntypedStorage:
        """PyTorch gives a wrapper a storage of its logical size that holds no data, so
        ``len(t.untyped_storage())`` or ``t.storage().size()`` would answer a number that
        no example's storage has: raise, as torch.func's transforms do."""
        raise NotImplementedError(f"{type(self).__name__}.untyped_storage(): a tensor of "
                                  f"{type(self)._level.describe()} has no storage of its "
                                  "own; Cannot access storage of a transform's tensor")

    # ``torch.tensor([x])`` reads a tensor element ``x`` as a Python number with the Python
    # dispatch key off, where a wrapper has no data: the level answers it here instead
    def __float__(self) -> float:
        return _read_number(torch.Tensor.__float__, self)

    def __int__(self) -> int:
        return _read_number(torch.Tensor.__int__, self)

    def __index__(self) -> int:
        return _read_number(torch.Tensor.__index__, self)

    def __complex__(self) -> complex:
        return _read_number(torch.Tensor.__complex__, self)

    def __bool__(self) -> bool:
        return _read_number(torch.Tensor.__bool__, self)

    def __format__(self, format_spec: str) -> str:
        """``f"{loss:.3f}"``: a 0-dim tensor formats its value, as a plain tensor does."""
        if self.dim() == 0 and not self.is_meta:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __repr__(self) -> str:
        level = type(self)._level
        if not level.alive:
            return f"<tensor escaped from {level.describe()}>"
        return f"{type(self).__name__}(level={level.describe()}, inner={self._inner!r})"


def _read_number(method: Any, tensor: LevelTensor) -> Any:
    """``method(tensor)``, a read of a Python number, with the Python dispatch key back on
    where PyTorch turned it off (``torch.tensor([x])``, ``torch.tensor([[x, y]])``): a
    grad or jvp level gives the value, as torch.func does, and vmap raises its error for a
    value that differs from example to example. Elsewhere it is ``method(tensor)``."""
    if not _key_excluded(_PYTHON_KEYS[0]):  # (the usual case)
        return method(tensor)
    with preserved_dispatch_keys():
        for key in _PYTHON_KEYS:
            _set_excluded(key, False)
        return method(tensor)


class LiftedTensor(torch.Tensor):
    """A plain tensor a grad or jvp level took in when it was written with the level's
    values: each call on it runs on ``_level_tensor``, the level's tensor for its memory.
    It answers calls in ``__torch_function__``, before the dispatcher, so its own
    TensorImpl stays the plain one the user's code holds (and PyTorch's in-place ops
    return); no ``__slots__``, so a plain tensor's object can become one and back.

    Example::

        >>> import torch
        >>> import torchlevels
        >>> def energy(x):
        ...     agg = torch.zeros(2)  # a buffer made inside: plain, until written with x
        ...     agg.index_add_(0, torch.tensor([0, 1, 0]), x ** 2)
        ...     return agg.prod()
        >>> torchlevels.grad(energy)(torch.tensor([1.0, 2.0, 3.0]))
        tensor([ 8., 40., 24.])
    """

    _level_tensor: LevelTensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        resolved_args, resolved_kwargs = tree_map_only(
            LiftedTensor, _level_tensor_of, (args, kwargs or {}))
        attribute = getattr(func, "__self__", None)
        if type(attribute) is _ATTRIBUTE:  # t.requires_grad: as the level's class answers
            if func.__name__ == "__get__":
                return getattr(resolved_args[0], attribute.__name__)
            return setattr(resolved_args[0], attribute.__name__, resolved_args[1])
        if args and type(args[0]) is LiftedTensor:  # a method: the level's class may have
            name = getattr(func, "__name__", "")  # its own (tolist, detach_, __format__)
            if getattr(torch.Tensor, name, None) is func:
                func = getattr(type(resolved_args[0]), name)
        out = func(*resolved_args, **resolved_kwargs)
        if args and type(args[0]) is LiftedTensor and out is resolved_args[0]:
            return args[0]  # an in-place method returns the object it was called on
        return out


_ATTRIBUTE = type(torch._C.TensorBase.requires_grad)  # a C attribute of tensors


def _level_tensor_of(t: LiftedTensor) -> LevelTensor:
    return vars(t)["_level_tensor"]


def resolved(t: Any) -> Any:
    """``t``, or the level tensor it stands for if it is a :class:`LiftedTensor`."""
    return _level_tensor_of(t) if type(t) is LiftedTensor else t


class autograd_on:  # lower case: used like a function, `with autograd_on():`
    """Inside ``__torch_dispatch__``: the dispatch keys as the user set them when the op
    was called (PyTorch's TLS snapshot), so that autograd and forward AD record the op run
    on inner tensors, for every level outside this one to differentiate. A level's
    ``dispatch`` runs its ops under it for autograd outside to see them
    (docs/writing-a-transform.md).

    Example (a level that only passes ops on; ``ForwardingLevel`` does this for you)::

        >>> import torch
        >>> from torchlevels import Level, autograd_on, enter_level
        >>> class PassOn(Level):
        ...     def wrap(self, cls, t):
        ...         out = torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype)
        ...         out._inner = t
        ...         return out
        ...     def unwrap(self, cls, t):
        ...         return t._inner if type(t) is cls else t
        ...     def dispatch(self, cls, func, args, kwargs):
        ...         with autograd_on():  # without it, x's graph would stop here
        ...             out = func(*(self.unwrap(cls, a) for a in args), **kwargs)
        ...         return self.wrap(cls, out)
        >>> x = torch.ones(2, requires_grad=True)
        >>> with enter_level(PassOn()) as L:
        ...     y = L.unwrap(L(x).sin()).sum()
        >>> torch.autograd.grad(y, x)[0].allclose(x.cos())
        True

    PyTorch takes the snapshot below autograd for an op with Python kernels that make_fx's
    Python dispatcher runs (``ones_like`` under ``trace``): autograd's keys, and the
    ADInplaceOrView key that ``make_dual`` needs, are let back in then. Inference mode
    excludes autograd itself, and is respected. A user's ``TorchDispatchMode`` that passed
    the op on from its own ``__torch_dispatch__`` is off the stack until that returns, so
    the Python key its snapshot includes is left out (PyTorch would find no mode there).
    """

    __slots__ = ("_snapshot",)

    def __enter__(self) -> None:
        self._snapshot = _restore_tls()
        self._snapshot.__enter__()  # its exit restores every key changed below
        if _python_key_included(_PYTHON_KEYS[0]) and not _dispatch_modes():
            for key in _PYTHON_KEYS:
                _set_included(key, False)
        if _key_excluded(_AD_INPLACE_OR_VIEW):
            _set_excluded(_AD_INPLACE_OR_VIEW, False)
        if _key_excluded(_AUTOGRAD) and not torch.is_inference_mode_enabled():
            for key in _AUTOGRAD_KEYS:
                _set_excluded(key, False)

    def __exit__(self, *exc: object) -> None:
        self._snapshot.__exit__(*exc)


def lazy_bits_on() -> None:
    """Inside ``__torch_dispatch__``: PyTorch's conjugate, negative and zero-tensor
    fallbacks back on, until the enclosing :data:`preserved_dispatch_keys` block ends.
    PyTorch excludes every key above Python while a subclass handles an op, these among
    them, so a kernel run there would read a conj or neg view that it makes itself
    (``U.mH`` inside ``linalg.pinv``) as the plain tensor under it.

    Example (how a vmap level runs a rule)::

        with preserved_dispatch_keys():
            lazy_bits_on()
            out = rule(...)
    """
    _set_excluded(_CONJUGATE, False)
    _set_excluded(_NEGATIVE, False)
    _set_excluded(_ZERO_TENSOR, False)


def autograd_records() -> bool:
    """Inside a level's ``__torch_dispatch__``: whether autograd records the ops run now
    (grad mode on, and autograd switched back on by :class:`autograd_on`)."""
    return torch.is_grad_enabled() and not _key_excluded(_AUTOGRAD)


def wrap_inner(cls: type[LevelTensor], inner: torch.Tensor) -> LevelTensor:
    """A tensor of level ``cls`` standing for ``inner``, with its shape, strides and offset."""
    if isinstance(inner, LevelTensor):  # its metadata as PyTorch has it, without a trip
        with _no_subclass_torch_function():  # through its level's __torch_function__ each
            return _wrap_inner(cls, inner)
    return _wrap_inner(cls, inner)


def _wrap_inner(cls: type[LevelTensor], inner: torch.Tensor) -> LevelTensor:
    out = new_wrapper(cls, inner)
    out._inner = inner
    show_lazy_bits(out, inner)
    return out


def new_wrapper(cls: type[LevelTensor], t: torch.Tensor, bdim: int | None = None
                ) -> LevelTensor:
    """A new tensor of class ``cls`` with the shape, strides, offset, dtype and device of
    ``t``, less dim ``bdim`` of ``t`` if given (a vmap level's batch dim: the strides and
    offset are then example 0's, as forward AD compares views' layouts)."""
    shape = t.shape
    # the strides a new tensor of its shape gets (a contiguous tensor's are those only if
    # no dim has size 0 or 1), and the default dtype and device: no keywords to parse
    if not bdim and t.is_contiguous() and not t.storage_offset() and (
            1 not in shape and 0 not in shape):
        size = shape if bdim is None else shape[1:]
        if t.is_cpu and t.dtype is _default_dtype():
            return _make_wrapper_subclass(cls, size)
        return _make_wrapper_subclass(cls, size, dtype=t.dtype, device=t.device)
    if bdim is None and t.layout is not torch.strided:  # sparse (never contiguous): no strides
        return _make_wrapper_subclass(cls, shape, dtype=t.dtype, device=t.device, layout=t.layout)
    strides = t.stride()
    if bdim is not None:
        shape, strides = shape[:bdim] + shape[bdim + 1:], strides[:bdim] + strides[bdim + 1:]
    return _make_wrapper_subclass(cls, shape, strides=strides, storage_offset=t.storage_offset(),
                                  dtype=t.dtype, device=t.device)


def show_lazy_bits(wrapper: LevelTensor, inner: torch.Tensor) -> None:
    """The conj and neg bits of ``inner`` (a lazy view such as ``conj()``, or the ``imag``
    of one) on ``wrapper`` too, as a plain tensor would show them: PyTorch then resolves
    them before the ops that need it, forward AD finds a tangent laid out as its primal,
    and writes through the view reach its base."""
    if inner.is_conj() or inner.is_neg():
        torch._C._set_conj(wrapper, inner.is_conj())
        torch._C._set_neg(wrapper, inner.is_neg())


def wrap_all(cls: type[LevelTensor], out: Any) -> Any:
    """Every tensor of an op's output (alone, or in a tuple or list) wrapped at level ``cls``."""
    if isinstance(out, torch.Tensor):
        return wrap_inner(cls, out)
    if isinstance(out, (tuple, list)):
        return type(out)(wrap_all(cls, o) for o in out)
    return out


def unwrap_own(a: Any, cls: type[LevelTensor]) -> Any:
    """An op argument with the tensors of level ``cls`` (alone or in a list) unwrapped."""
    if type(a) is cls:
        return a._inner
    if type(a) in (list, tuple):
        return type(a)(t._inner if type(t) is cls else t for t in a)
    return a


def follow_inner(tensor: LevelTensor) -> None:
    """After an in-place op, give the wrapper its inner tensor's shape (``squeeze_``...)."""
    inner = tensor._inner
    if inner.shape != tensor.shape or inner.stride() != tensor.stride():
        set_logical_meta(tensor, inner.shape, inner.stride(), inner.storage_offset())


# A plain tensor that requires grad only for a grad level's own graph (a leaf the level
# made, or a result of the level's ops on such leaves alone) carries this attribute.
_LEVEL_GRAPH = "_torchlevels_level_graph"


def mark_level_graph(t: torch.Tensor, only: bool = True) -> None:
    """Record whether plain tensor ``t`` requires grad only for a grad level's own graph.

    A vmap level around that grad level need not record its ops on such a tensor a second
    time on the physical tensors: nothing outside reads that copy of the graph (the
    per-sample gradients of ``vmap(grad(loss), in_dims=(None, 0))`` are the common case).
    """
    setattr(t, _LEVEL_GRAPH, only)


# Set while a grad level's backward pass runs that autograd outside does not track (see
# untracked_pass): the plain tensors that PyTorch's engine makes then are not marked.
_in_untracked_pass: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torchlevels_untracked_pass", default=False)


@contextmanager
def untracked_pass(untracked: bool) -> Iterator[None]:
    """Run a grad level's backward pass, in which nothing requires grad for autograd
    outside when ``untracked`` (no input, capture or cotangent of the level does): a
    tensor that requires grad then does so for that level's graph alone, which ends with
    the level, and levels around it must not take it for one autograd outside tracks."""
    if not untracked:
        yield
        return
    token = _in_untracked_pass.set(True)
    try:
        yield
    finally:
        _in_untracked_pass.reset(token)


def tracked_outside(t: Any) -> bool:
    """Whether plain tensor ``t`` requires grad for autograd outside the transforms: it
    requires grad, and not only for a grad level's graph (see :func:`mark_level_graph`).
    A meta tensor never is: PyTorch makes meta copies only to learn an output's shape
    (adding a ZeroTensor tangent under forward AD). A view no level marked (``w.t()``
    made inside ``F.linear``) is tracked as its base is. Nothing is while an untracked
    backward pass runs (see :func:`untracked_pass`)."""
    if not requires_grad_flag(t) or t.is_meta or _in_untracked_pass.get():
        return False
    only = getattr(t, _LEVEL_GRAPH, None)
    if only is None and t._is_view():
        only = getattr(t._base, _LEVEL_GRAPH, None)
    return not only


def in_level_graph(t: torch.Tensor) -> bool:
    """Whether plain tensor ``t`` is part of a grad level's graph (a leaf it made, or a
    result of its ops), whether or not autograd outside tracks it too (see
    :func:`mark_level_graph`)."""
    return getattr(t, _LEVEL_GRAPH, None) is not None


def differentiated(*tensors: Any) -> bool:
    """Whether autograd, or a grad or jvp level, may take derivatives of an op run on
    ``tensors`` (tensors of enclosing levels, or plain ones that require grad)."""
    for t in tensors:
        while isinstance(t, LevelTensor):
            if t._level.differentiates:
                return True
            t = t._inner
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return True
    return False


def set_logical_meta(tensor: LevelTensor, shape, strides, storage_offset: int = 0) -> None:
    """Change a level tensor's own sizes and strides in place (after ``squeeze_`` and such).

    An in-place op may also grow its tensor (``x.addbmm_(a, b)`` resizes a one-element
    ``x`` to the product's shape): the wrapper then takes a placeholder storage of the new
    size, as a new wrapper of that geometry would have (it holds no data either way).
    """
    end = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    with torch._C._DisableTorchDispatch():
        storage = torch.Tensor.untyped_storage  # a level tensor's own method refuses
        if 0 not in shape and end * tensor.element_size() > storage(tensor).nbytes():
            room = torch.Tensor._make_wrapper_subclass(
                type(tensor), shape, strides=strides, storage_offset=storage_offset,
                dtype=tensor.dtype, device=tensor.device)
            torch.ops.aten.set_.source_Storage_storage_offset(
                tensor, storage(room), storage_offset, shape, strides)
        else:
            torch.ops.aten.as_strided_.default(tensor, shape, strides, storage_offset)


def escape_message(level: Level, func) -> str:
    if _in_checkpoint_recomputation():
        if level.differentiates:
            return (
                f"{func}: torch.utils.checkpoint recomputed its function, in a backward pass "
                f"taken after {level.describe()} exited, on that transform's tensors. "
                "Checkpointing works inside grad and vmap(grad), whose backward pass runs "
                "while they are live, but not under vjp or jacrev, whose backward pass runs "
                "after the function returned, nor under a transform that differentiates a "
                "backward pass (hessian, grad of grad, grad of jvp): remove the checkpoint "
                "there."
            )
        return (
            f"{func}: torch.utils.checkpoint recomputed its function, in a backward pass "
            f"taken after {level.describe()} exited, on that level's tensors: a transform "
            "around it (grad(count_flops(f)), grad(vmap(f))), or autograd outside it "
            "(count_flops(f)(x).sum().backward()), runs its backward pass after the "
            "function returned. Put this level outside what differentiates "
            "(count_flops(grad(f)), vmap(grad(f))), or remove the checkpoint."
        )
    if level.functional:
        return (
            f"{func}: a tensor of {level.describe()} was used after that transform exited. "
            "It escaped the function the transform ran (stored in a list, a global or a "
            "closure). Return it from that function instead: a transform's results are "
            "the only tensors that come out of it."
        )
    return (
        f"{func}: a tensor of {level.describe()} was used after that level exited. It "
        "escaped its `with` block (stored in a list, a global or a closure, or kept "
        "without being unwrapped). Unwrap it with the level's class before the block "
        "exits (`B.unwrap(t)` for `with vmap() as B`)."
    )


def _in_checkpoint_recomputation() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("torch", "utils", "checkpoint.py")):
            return True
        frame = frame.f_back
    return False


# What a level's tensors answer for these names: PyTorch's own unless the level says
# otherwise (a grad level's tensors answer as torch.func's do, see autodiff.py).
_TENSOR_ATTRIBUTES = {
    "requires_grad": _REQUIRES_GRAD,
    "grad_fn": torch._C.TensorBase.grad_fn,
    "register_hook": torch.Tensor.register_hook,
    "retain_grad": torch.Tensor.retain_grad,
    "backward": torch.Tensor.backward,
    "data": torch._C.TensorBase.data,
    "detach_": torch.Tensor.detach_,
    "is_leaf": torch._C.TensorBase.is_leaf,
    "requires_grad_": torch.Tensor.requires_grad_,
}


def refuse_backward(t: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """What ``t.backward()`` does for a tensor of a vmap, grad or jvp level: raise, as
    torch.func does. The ``.grad`` it would leave on a leaf holds a tensor of the level
    (one gradient per example under vmap), which outlives the level."""
    raise RuntimeError(
        f"backward() was called on a tensor of {type(t)._level.describe()}. Inside a "
        "transform, differentiate with grad, vjp or jacrev (vmap(grad(f)) for one "
        "gradient per example), or call backward() on the transform's result, outside it."
    )


def data_property(get: Any) -> property:
    """What a level's tensors answer for ``t.data``: ``get(t)``. Assigning ``t.data = v``
    raises, as in torch.func: PyTorch's setter would swap the wrapper's own placeholder,
    leaving the values the level holds as they were, silently."""
    return property(get, _refuse_data_assignment)


def _refuse_data_assignment(t: torch.Tensor, value: Any) -> None:
    raise RuntimeError(
        f"assigning `t.data = value` to a tensor of {type(t)._level.describe()} is not "
        "supported (torch.func refuses it too). Write the values in with `with "
        "torch.no_grad(): t.copy_(value)`, or use `value` in place of t from here on.")


def new_level_class(
    level: Level, name: str, torch_function: Any = _disabled_torch_function,
    **tensor_attributes: Any,
) -> type[LevelTensor]:
    """Make the class for a new level, a subclass of the innermost live level's class.

    ``torch_function`` is its ``__torch_function__`` (vmap's answers common calls before
    the dispatcher); ``tensor_attributes`` replace what its tensors answer for
    the names in ``_TENSOR_ATTRIBUTES`` (``requires_grad``, ``grad_fn``, ``is_leaf``,
    ``data``...: PyTorch's own unless given). A level class never inherits its parent's.
    """
    unknown = tensor_attributes.keys() - _TENSOR_ATTRIBUTES.keys()
    if unknown:
        raise TypeError(f"new_level_class: no tensor attribute {sorted(unknown)} to replace")
    parent = _innermost.get() or LevelTensor
    math_bits.register()  # (a no-op once done)
    namespace = {"_level": level, "__module__": __name__, "__torch_function__": torch_function,
                 "_has_torch_function": torch_function is not _disabled_torch_function,
                 **_TENSOR_ATTRIBUTES, **tensor_attributes}
    return type(name, (parent,), namespace)


_get_interpreter_stack = torch._C._functorch.get_interpreter_stack
_TORCH_FUNC_NAMES = {"Grad": "grad/vjp", "Jvp": "jvp", "Vmap": "vmap"}


def _refuse_inside_torch_func(level: Level) -> None:
    """torch.func's transforms cannot enclose a level: they would see its inputs only
    through detach-like shallow copies and give wrong gradients (functionalize can)."""
    outer = [_TORCH_FUNC_NAMES[i.key().name] for i in _get_interpreter_stack()
             if i.key().name in _TORCH_FUNC_NAMES]
    if outer:
        raise RuntimeError(
            f"{level.kind}: a torchlevels transform was called inside torch.func's "
            f"{', '.join(outer)}. torch.func transforms work inside torchlevels' ones but not "
            "around them (they would give wrong gradients): take the outer transforms from "
            "torchlevels too."
        )


def _decline_levels(mode: Any) -> None:
    """Make a user's ``TorchDispatchMode``, active when a level is entered, decline the ops
    on the levels' tensors, so that it sees the plain ops every level runs, as a mode around
    torch.func's transforms does (``FlopCounterMode`` then counts the batched ops, not one
    example's). PyTorch hands a declined op on to the tensors' ``__torch_dispatch__``, with
    the mode still active for the ops that runs. Outside the transforms nothing changes:
    no level's tensor lives there. PyTorch's own infrastructure modes (fake tensors,
    make_fx's tracer) decline subclasses they do not know already, and are left as they are.
    """
    if getattr(mode, "_mode_key", None) is not None or not hasattr(mode, "__dict__") or (
            "_torchlevels_dispatch" in vars(mode)):
        return
    mode._torchlevels_dispatch = mode.__torch_dispatch__
    mode.__torch_dispatch__ = types.MethodType(_declining_dispatch, mode)


def _declining_dispatch(self: Any, func: Any, types_: tuple, args: tuple = (),
                        kwargs: dict | None = None) -> Any:
    """A mode's ``__torch_dispatch__`` once :func:`_decline_levels` has seen it."""
    for t in types_:
        if issubclass(t, LevelTensor):
            return NotImplemented
    return self._torchlevels_dispatch(func, types_, args, kwargs)


class entered:  # lower case: used like the function it replaced, `with entered(cls)`
    """Make ``cls`` the innermost live level while the block runs; it is dead after.

    A class rather than a generator: it runs on every transform call.
    """

    __slots__ = ("cls", "token")

    def __init__(self, cls: type[LevelTensor]) -> None:
        self.cls = cls

    def __enter__(self) -> type[LevelTensor]:
        if _get_interpreter_stack() is not None:
            _refuse_inside_torch_func(self.cls._level)
        for i in range(_dispatch_modes()):  # (none, usually)
            _decline_levels(_dispatch_mode_at(i))
        self.token = _innermost.set(self.cls)
        return self.cls

    def __exit__(self, *exc: object) -> None:
        level = self.cls._level
        level.alive = False
        if _innermost.get() is self.cls:
            _innermost.reset(self.token)
        live = _innermost.get()
        if live is not None and not live._level.alive:
            # levels entered by hand and exited out of order (`with vmap() as B` in two
            # generators): the innermost is the nearest live level around
            live = next((c for c in enclosing_classes(live) if c._level.alive), None)
            _innermost.set(live)
        if level.lifted:
            from torchlevels.lifted import lower  # (it builds on this module)

            lifted, level.lifted = level.lifted, None
            lower(lifted)


@contextmanager
def enter_level(level: Level, name: str = "LevelTensor") -> Iterator[type[LevelTensor]]:
    """Make a class for ``level`` (named ``name``), nested in the innermost live level, and
    enter it for the block; yields the class ``L`` (``L(t)`` wraps, ``L.unwrap(t)``
    unwraps). The way to start a user-defined level (docs/writing-a-transform.md).

    Example::

        >>> import torch
        >>> from torchlevels import enter_level
        >>> from torchlevels.tools import ForwardingLevel
        >>> with enter_level(ForwardingLevel()) as L:
        ...     y = L(torch.ones(2)) * 3
        ...     L.unwrap(y)
        tensor([3., 3.])
    """
    level.where = _user_frame()  # where it is entered (not where the user's class made it)
    with entered(level.new_class(name)) as cls:
        yield cls


def innermost() -> type[LevelTensor] | None:
    """The class of the innermost live level in this context, or None."""
    return _innermost.get()


def enclosing_classes(cls: type[LevelTensor] | None) -> Iterator[type[LevelTensor]]:
    """The level classes from ``cls`` outwards."""
    while cls is not None and cls is not LevelTensor:
        yield cls
        cls = cls.__base__

