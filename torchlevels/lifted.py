"""A plain tensor written in place with a grad or jvp level's values: taken into the level.

torch.func makes every tensor created inside a transform one of its own, so a buffer a
factory made inside ``grad`` can be written with tracked values: message passing's
``agg = torch.zeros(n, f); agg.index_add_(0, dst, msg)``, or ``out[i] = f(x[i])``. Here a
factory makes a plain tensor (no level sees an op without its tensors), so the level takes
the buffer in at its first such write instead: the object the user holds becomes a
:class:`LiftedTensor`, whose every call runs on a constant of the level that shares the
buffer's memory and from then on is written like any tensor of the level. When the level
exits, the object is a plain tensor again, holding the values written. It keeps its
identity throughout, so ``y = buf.add_(v)`` and ``torch.zeros(n).index_add_(...)`` give it.

A write into a view (``out[i] = v`` writes into ``out.select(0, i)``) takes in the view's
base too, the view being the same view of the base's constant, and so every other view of
the base the program holds (``rows = agg.unbind(0)``, ``head = out[:2]`` taken before the
first write): each would otherwise go on reading the buffer untracked, a wrong derivative
with no error. PyTorch keeps no list of a tensor's views, so they are looked for among the
objects Python's garbage collector tracks, youngest first, until they account for every
tensor that holds the memory (the storage's use count). A tensor whose memory something
else holds (an alias that is no view, such as ``detach()``'s, or one only C++ code holds)
is refused. So is a tensor PyTorch's C++ code made and writes (a backward formula's
buffer): only the tensors the user's own call names (``buf`` in ``buf.index_add_(...)``,
the tensor indexed in ``buf[i] = v``) are taken in, since C++ code goes on using the plain
tensor it holds.

A tensor of an enclosing level (a vmap's tensor made from an argument grad does not
differentiate: ``out = torch.zeros_like(y); out[i] = f(x)``, which torch.func's grad allows
because it wraps every argument) is taken in the same way, with the tensor of that level
holding the whole memory and its views the program holds. A level's views are found by
their memory, a plain view of the holder's: the shortcuts that make them record no
autograd view between the level's tensors. Each becomes the same view of the holder's
constant (an ``as_strided`` view, which autograd tracks).

torch.func refuses a write into a tensor made outside the function (a captured one); this
takes it in as well, and it keeps the values written after the call, as in eager PyTorch.
"""

from __future__ import annotations

import contextvars
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch

from torchlevels._level import (
    LevelTensor,
    LiftedTensor,
    memory_of,
    resolved,
    set_logical_meta,
    tracked_outside,
)

_storage_use_count = torch._C._storage_Use_Count
# set on the plain tensor a level's constant holds for a buffer it took in: weak
# references to the plain tensors (the buffer, its views) that stand for that constant
_ALIASES = "_torchlevels_aliases"


# The arguments of the in-place call from Python (a method such as ``buf.add_``, a
# ``torch.*_`` function, ``buf[i] = v``, ``buf += v``) that is running, if any.
_writing: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "torchlevels_writing", default=())


def _writers() -> frozenset:
    methods = [getattr(torch.Tensor, name) for name in dir(torch.Tensor)
               if name.endswith("_") and not name.startswith("_")]
    functions = [getattr(torch, name) for name in dir(torch)
                 if name.endswith("_") and not name.startswith("_")]
    operators = [getattr(torch.Tensor, f"__i{name}__") for name in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
        "xor", "lshift", "rshift") if hasattr(torch.Tensor, f"__i{name}__")]
    return frozenset(f for f in (*methods, *functions, *operators, torch.Tensor.__setitem__)
                     if callable(f))


WRITERS = _writers()  # the Python calls that write their first argument in place


def writing(call: Callable, func, args: tuple, *rest: Any) -> Any:
    """``call(func, args, *rest)`` for in-place call ``func`` (one of :data:`WRITERS`)
    from Python, noting ``args``: the tensors a level may take in if it writes them."""
    token = _writing.set(args)
    try:
        return call(func, args, *rest)
    finally:
        _writing.reset(token)


class CapturedMutationError(RuntimeError):
    """A value of a grad or jvp level written in place into a tensor not of that level."""


def lift_written(cls: type[LevelTensor], func, args: tuple, kwargs: dict, kind: str,
                 constant) -> Any:
    """Run in-place op ``func`` of grad or jvp level ``cls``, whose first argument is not
    the level's, after taking that tensor into the level (``constant(cls, t)`` makes ``t``
    a constant of that level and of each grad and jvp level around it); raise
    :class:`CapturedMutationError` where it cannot be."""
    written = args[0]
    if type(written) is LiftedTensor:  # C++ code writing again into the tensor it holds
        return func(resolved(written), *args[1:], **kwargs)
    if isinstance(written, LevelTensor):  # of an enclosing level (a vmap's): it becomes ours
        base, views = _level_holders(written)
        _refuse(func, kind, _level_tensor_refusal(written, base, views))
        enclosing = type(written)
        _become(base, constant(cls, enclosing._level.rewrap(enclosing, base)))
        _note(cls, base)
        for view in views:  # the same view of the level's tensor: its writes are tracked
            _become(view, _strided_view(base, view))
            _note(cls, view)
        return func(written, *args[1:], **kwargs)
    base = written._base if type(written) is torch.Tensor and written._is_view() else written
    views = _views_named(written, base)
    _refuse(func, kind, _plain_refusal(written, base, views))
    views += _views_held(base, views)
    _refuse(func, kind, _shared_memory_refusal(base, 2 + len(views)))
    memory = base.detach()  # the level's own TensorImpl for the buffer's memory
    level_base = _take_in(cls, base, constant(cls, memory))
    aliases = [weakref.ref(base)]
    target = level_base
    for view in views:
        level_view = _take_in(cls, view, view._view_func(level_base))
        aliases.append(weakref.ref(view))
        if view is written:
            target = level_view
    setattr(memory, _ALIASES, aliases)
    return func(target, *args[1:], **kwargs)


def _refuse(func, kind: str, why: str) -> None:
    if why:
        raise CapturedMutationError(
            # (torch.func's words first: code written for its error matches ours)
            f"During a grad (vjp, jvp, grad, etc) transform ({kind}), the function provided "
            f"attempted to call in-place operation ({func}) that would mutate a tensor not "
            f"of the transform with a value that depends on its inputs, and {why}. Use the "
            "out-of-place op, or make the tensor from an input (x.new_zeros(n), "
            "torch.zeros_like(x)) or pass it in as an input.")


def _views_named(written: Any, base: Any) -> list[torch.Tensor]:
    """The plain views of ``base`` to take in with it: ``written`` and those the call
    names (``A[i]`` in ``A[i][j] = v``, ``g`` in ``g[:, 0] = v`` where ``g`` is a reshape of
    a factory's tensor), each once."""
    views: list[torch.Tensor] = []
    for t in (written, *_writing.get()):
        if (type(t) is torch.Tensor and t is not base and t._is_view() and t._base is base
                and not any(t is v for v in views)):
            views.append(t)
    return views


def _plain_refusal(written: Any, base: Any, views: list[torch.Tensor]) -> str:
    """Why plain ``written`` (a view of ``base``, or ``base`` itself) cannot be taken into
    a level with ``views``, or '' if it can."""
    if type(written) is not torch.Tensor or type(base) is not torch.Tensor:
        return (f"it is a {type(written).__name__}: only a plain torch.Tensor or a tensor "
                "of an enclosing transform can be taken into the transform")
    if base.requires_grad:
        return "it requires grad (autograd outside tracks it)"
    if base.layout != torch.strided:
        return f"it is a {base.layout} tensor"
    if not any(a is base or any(a is v for v in views) for a in _writing.get()):
        return ("it is not a tensor the call names (PyTorch's own code made it, the call "
                "went to torch.ops.aten directly, or it wrote through a view made before)")
    return ""


def _views_held(base: torch.Tensor, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """The plain views of ``base`` other than ``base`` and ``views`` that the program
    holds, searched for only while the TensorImpls holding its storage are not all
    accounted for (see :func:`_shared_memory_refusal`); the youngest generation of the
    garbage collector first, where views just made are."""
    known = [base, *views]
    found: list[torch.Tensor] = []
    for generation in range(3):
        if not _shared_memory_refusal(base, 2 + len(views) + len(found)):
            break
        found += [t for t in gc.get_objects(generation)
                  if type(t) is torch.Tensor and t._is_view() and t._base is base
                  and not any(t is k for k in known)]
    return found


def _level_holders(written: LevelTensor) -> tuple[LevelTensor | None, list[LevelTensor]]:
    """The tensors of ``written``'s level the program holds that hold its memory: the
    one holding the whole of it (``None`` if none is found), and the views of that one,
    ``written`` among them if it is one. A level's views hold a plain view of its memory
    (its shortcuts make them with no autograd view of their own): they are looked for
    as :func:`_views_held` looks for plain ones."""
    kind, memory = type(written), memory_of(written)
    root = memory._base if memory._is_view() else memory
    base, views = (written, []) if memory is root else (None, [written])
    for generation in range(3):
        if base is not None and not _unaccounted(base, views):
            break
        for t in gc.get_objects(generation):
            if type(t) is not kind or t is written or any(t is v for v in views):
                continue
            m = memory_of(t)
            if m is root and base is None:
                base = t
            elif m._is_view() and m._base is root:
                views.append(t)
    return base, views


def _unaccounted(base: LevelTensor, views: list[LevelTensor]) -> str:
    """Why the memory of ``base`` and ``views`` is held by more than them and the plain
    tensors an enclosing level took in (each reads it only through that level's tensor),
    or '' if it is not."""
    memory = memory_of(base)
    refs = getattr(memory, _ALIASES, ())
    held = {id(memory_of(t)) for t in (base, *views)}
    return _shared_memory_refusal(
        memory, 1 + len(held) + sum(type(ref()) is LiftedTensor for ref in refs))


def _level_tensor_refusal(written: LevelTensor, base: LevelTensor | None,
                          views: list[LevelTensor]) -> str:
    """Why ``written``, a tensor of a level around the writing one (``base`` or one of
    its ``views``), cannot become one of the writing level with them, or '' if it can."""
    if base is None:
        return (f"it is a {type(written).__name__} whose memory is a view of another "
                "tensor's that the program does not hold")
    memory = memory_of(base)
    if type(memory) is not torch.Tensor:
        return f"it holds its memory in a {type(memory).__name__}"
    if memory.layout != torch.strided:
        return f"it is a {memory.layout} tensor"
    if not any(resolved(a) is t for a in _writing.get() for t in (base, *views)):
        return "it is not a tensor the call names (PyTorch's own code made it)"
    for view in views:  # (an as_strided view of the holder reads its dtype, without bits)
        if (view.dtype, view.is_conj(), view.is_neg()) != (
                base.dtype, base.is_conj(), base.is_neg()):
            return ("it or another view of the same memory reads it as another dtype or "
                    "through a conj or neg bit")
    return _unaccounted(base, views)


def _strided_view(base: LevelTensor, view: LevelTensor) -> torch.Tensor:
    """``view``, a view of ``base`` at the level ``base`` was of, as the same view of
    ``base``, now a tensor of a level inside: an ``as_strided`` view, which autograd
    tracks as a view (PyTorch's wrappers record no view function to replay). A level's
    tensor shows its memory's strides and offset, less its batch dim."""
    return base.as_strided(view.shape, view.stride(), view.storage_offset())


def _shared_memory_refusal(t: torch.Tensor, expected: int) -> str:
    """Why ``t`` cannot be taken in, if more than ``expected`` TensorImpls hold its
    storage (counting the storage object made here to ask): the others would go on
    reading it untracked."""
    if _storage_use_count(t.untyped_storage()._cdata) > expected:
        return ("something else holds its memory (an alias that is no view of it, such as "
                "detach()'s, or a tensor that only PyTorch's C++ code holds): it would "
                "read the memory untracked")
    return ""


def _become(t: LevelTensor, other: LevelTensor) -> None:
    """Make the object ``t``, a tensor of some level, the tensor ``other`` is: its class
    (every level class has the same slots), the tensor it wraps and its attributes."""
    t.__class__ = type(other)
    for slot in ("_inner", "_bdim"):
        if hasattr(other, slot):
            setattr(t, slot, getattr(other, slot))
        elif hasattr(t, slot):
            delattr(t, slot)
    vars(t).clear()
    vars(t).update(vars(other))
    if t.shape != other.shape or t.stride() != other.stride():
        set_logical_meta(t, other.shape, other.stride(), other.storage_offset())


def _note(cls: type[LevelTensor], t: torch.Tensor) -> None:
    """Record that level ``cls`` took ``t`` in, to give it back at its exit."""
    level = cls._level
    if level.lifted is None:
        level.lifted = []
    level.lifted.append(t)


def _take_in(cls: type[LevelTensor], plain: torch.Tensor, level_tensor: LevelTensor
             ) -> LevelTensor:
    """Make the object ``plain`` a :class:`LiftedTensor` standing for ``level_tensor``."""
    plain.__class__ = LiftedTensor
    vars(plain)["_level_tensor"] = level_tensor
    _note(cls, plain)
    return level_tensor


def lower(lifted: list[LiftedTensor]) -> None:
    """At a level's exit, each tensor it took in becomes what its level tensor holds one
    level out: plain again (its values written), or taken into an enclosing level that
    took the value in too (a write nested transforms both track)."""
    for t in lifted:
        if type(t) is not LiftedTensor:  # a tensor of an enclosing level it made its own
            value = resolved(t._inner)
            if isinstance(value, LevelTensor):
                _become(t, value)
            continue
        level_tensor = vars(t).pop("_level_tensor")
        value = resolved(level_tensor._inner)
        if isinstance(value, LevelTensor):
            _take_in(type(value), t, value)
            continue
        t.__class__ = torch.Tensor
        tracked = tracked_outside(value)
        if tracked or not _same_memory(t, value):
            # autograd outside tracks what was written, or the level moved it: the object
            # takes a new TensorImpl for the value (with its history), as
            # torch.utils.swap_tensors does (the value itself may be a result of the call)
            torch._C._swap_tensor_impl(t, value.view_as(value) if tracked else value.detach())


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)
