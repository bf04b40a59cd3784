"""Shortcuts: everyday calls on batched tensors answered before PyTorch's dispatcher.

A vmap level's ``__torch_dispatch__`` sees an op only after the dispatcher has taken it
through the Python key, and a round trip there costs several microseconds per op: most
of the time of a chain of small ops. For the calls that dominate everyday code
(pointwise math, ``F.linear``, convolution and pooling of one example or of a batch
of them, ``flatten``, ``unsqueeze``, ``view``/``reshape``, ``transpose``, ``permute``;
reductions, norms, softmax, ``split`` and kin along given dims, layer norm, basic indexing,
``expand``, ``where``, ``cat``/``stack``, ``matmul``, ``einsum``, elementwise losses,
``zeros_like`` and kin, ``outer``, ``cosine_similarity``, ``F.pad``, ``contiguous``,
``flip``, ``triu``/``tril``), the batched answer is
the same call on the physical tensor with the batch dim first (and the example's dims
one further in), so the level's ``__torch_function__`` makes that call directly. A
composite call answered whole (``F.normalize``, ``einsum``) skips the dispatcher for
each of the ops it is made of.

A shortcut only ever declines (returns None): then the call takes the usual way, through
the dispatcher to the level's batching rule. It declines whenever anything is unusual: a
batch dim that is not first, a tensor of another level or subclass, a tensor that
requires grad or a live forward-AD level (autograd must see the op on the wrapper), an
in-place call, an ``out=`` argument.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F

from torchlevels._level import LevelTensor, memory_of, new_wrapper
from torchlevels._plain import PLAIN
from torchlevels.batching.dims import pad_to_rank, per_example
from torchlevels.batching.max_pool import max_pool
from torchlevels.batching.predispatch import unintercepted
from torchlevels.l1_loss_weight import l1_loss
from torchlevels.lifted import WRITERS, writing
from torchlevels.math_bits import tracked_views_resolved

_disabled = torch._C._disabled_torch_function_impl
_no_subclass_torch_function = torch._C.DisableTorchFunctionSubclass
_enable_torch_function = torch._C._EnableTorchFunction
_NUMBERS = (int, float, bool, complex)

Shortcut = Callable[[type, Callable, tuple, dict], Any]  # the result, or None to decline
SHORTCUTS: dict[Callable, Shortcut] = {}  # empty once switched off
_BUILTIN: dict[Callable, Shortcut] = {}


def switch_off() -> None:
    """No more shortcuts in this process: every call reaches the batching rules.

    Registering a batching rule for an aten op (or a family) does this, so the user's
    rule sees every call, even those a shortcut would have answered first.
    """
    SHORTCUTS.clear()


def switch_on() -> None:
    """The shortcuts back (after :func:`switch_off`)."""
    SHORTCUTS.update(_BUILTIN)


def torch_function(cls, func, types, args=(), kwargs=None):
    """A vmap level class's ``__torch_function__``: a shortcut for ``func`` if it applies."""
    shortcut = SHORTCUTS.get(func)
    # (a call given its tensors as keywords, torch.sum(input=x), takes the usual way)
    if shortcut is not None and args and cls._level.alive and forward_ad._current_level < 0:
        with _no_subclass_torch_function():
            out = shortcut(cls, func, args, kwargs or _EMPTY)
        if out is not None:
            return out
    return no_shortcuts(cls, func, types, args, kwargs)


def no_shortcuts(cls, func, types, args=(), kwargs=None):
    """The ``__torch_function__`` of a level with no shortcuts (a jvp level): a foreign
    subclass among the arguments answers as it would with no level; the rest goes on to
    the dispatcher, with the conj views autograd tracks resolved (see math_bits.py)."""
    for t in types:
        if t is not torch.Tensor and not issubclass(t, LevelTensor):
            return foreign_call(func, types, args, kwargs or _EMPTY)
    written = func in WRITERS
    args, kwargs = tracked_views_resolved(args, kwargs or _EMPTY, written)
    if written:  # a grad or jvp level may take in the plain tensor it writes
        return writing(_to_the_dispatcher, func, args, types, kwargs)
    return _to_the_dispatcher(func, args, types, kwargs)


def _to_the_dispatcher(func, args: tuple, types, kwargs) -> Any:
    if func is _GETITEM or func is _SETITEM:
        scalars = _level_scalars(args[1])
        if scalars:
            return _index_by_level_scalars(func, args, scalars)
    return _disabled(func, types, args, kwargs or _EMPTY)


_GETITEM, _SETITEM = torch.Tensor.__getitem__, torch.Tensor.__setitem__


def _level_scalars(index: Any) -> list[int]:
    """The positions in ``index`` of 0-dim integer tensors of a level that hold a value
    per example (``a[i]`` with ``i`` one example's index under vmap): the memory of one
    that holds a single value (a tool's, a grad level's) is 0-dim too, and PyTorch reads
    it as an int, selecting a view as it does outside the levels."""
    items = index if type(index) is tuple else (index,)
    return [k for k, i in enumerate(items) if isinstance(i, LevelTensor) and i.dim() == 0
            and not i.is_floating_point() and not i.is_complex() and i.dtype != torch.bool
            and memory_of(i).dim()]


def _index_by_level_scalars(func, args: tuple, scalars: list[int]) -> Any:
    """``x[i]`` (or ``x[i] = v``) with ``i`` a 0-dim integer tensor of a level (at the
    positions ``scalars`` of the index). PyTorch reads such an index as a Python int,
    which a batched one does not have; it indexes as the tensor ``i[None]`` does, less
    the size-1 dim that adds (found on meta tensors)."""
    x, index = args[0], args[1]
    items = index if type(index) is tuple else (index,)
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
        raise IndexError(
            "indexing with a 0-dim integer tensor that differs per example together with a "
            "boolean mask is not supported: index with the mask first, then with the "
            "integer (x[mask][i])")

    def probe(vector: bool) -> torch.Size:  # a 0-dim index reads as the int 0 here
        meta = tuple(i if not isinstance(i, torch.Tensor) else
                     torch.zeros(1, dtype=torch.long, device="meta") if vector and k in scalars
                     else 0 if i.dim() == 0 else
                     torch.zeros(i.shape, dtype=torch.long, device="meta")
                     for k, i in enumerate(items))
        return torch.empty(x.shape, device="meta")[meta].shape

    with _enable_torch_function():
        as_vectors = tuple(i.unsqueeze(0) if k in scalars else i for k, i in enumerate(items))
        out, out_vector = probe(False), probe(True)
        added = next((k for k in range(len(out_vector))
                      if out_vector[:k] + out_vector[k + 1:] == out), None)
        if len(out_vector) == len(out):
            added = None  # another index tensor broadcasts the size-1 dim away
        if func is _GETITEM:
            got = x[as_vectors]
            return got if added is None else got.squeeze(added)
        value = args[2]
        if added is not None and isinstance(value, torch.Tensor) and (
                value.dim() > len(out) - added):
            value = value.unsqueeze(added - (len(out) - value.dim()))
        x[as_vectors] = value
        return None


def foreign_call(func, types, args, kwargs):
    """A call with a foreign subclass that has a ``__torch_function__``: it answers, as if
    the level had none (its tensors reach the level's ``__torch_dispatch__`` as ever).

    A subclass with torch.Tensor's own ``__torch_function__`` (``class T(torch.Tensor):
    pass``) would turn the level's result into a ``T``, which a tensor of a level cannot
    become: it counts as a plain tensor, as it does under torch.func."""
    others = tuple(t for t in types if not issubclass(t, LevelTensor)
                   and getattr(t.__torch_function__, "__func__", None) is not _TENSOR_DEFAULT)
    for t in others:
        try:
            out = t.__torch_function__(func, others, args, kwargs)
        except RuntimeError as error:
            if "already associated to a python object" not in str(error):
                raise
            name = t.__name__
            # not a TypeError, which a binary operator turns into "unsupported operand"
            raise RuntimeError(
                f"{name}.__torch_function__ made the result of {_name(func)} a {name}, as "
                "torch.Tensor.__torch_function__ (reached through super()) does, but the "
                "result is a tensor of a torchlevels transform, which cannot change its "
                f"class. Let {name} handle ops in __torch_dispatch__ instead (with "
                "__torch_function__ = torch._C._disabled_torch_function_impl), which "
                "composes with the transforms, or keep its tensors out of them."
            ) from error
        if out is not NotImplemented:
            return out
    return NotImplemented if others else _disabled(func, types, args, kwargs)


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


_TENSOR_DEFAULT = torch.Tensor.__torch_function__.__func__


_EMPTY: dict = {}


def wrap_front(cls, out: torch.Tensor) -> torch.Tensor:
    """``out``, whose dim 0 is the batch, as a tensor of level ``cls``."""
    wrapped = new_wrapper(cls, out, 0)
    wrapped._inner = out
    wrapped._bdim = 0
    return wrapped


def wrap_all_front(cls, out: Any) -> Any:
    """:func:`wrap_front` of an op's output: one tensor, or each of a tuple's."""
    if isinstance(out, torch.Tensor):
        return wrap_front(cls, out)
    return tuple(wrap_front(cls, o) for o in out)


def _own(cls, a: Any) -> torch.Tensor | None:
    """The physical tensor of ``a`` if it is ours, batched first, nothing needs grad, and
    it shows no conj or neg bit (which a view of it must show: the usual path does)."""
    if type(a) is not cls or a._bdim or a.requires_grad or a.is_conj() or a.is_neg():
        return None
    inner = a._inner
    return inner if _passable(inner) else None


def _passable(a: Any) -> bool:
    """Whether tensor ``a``, without grad, is plain or of an enclosing level (whose own
    shortcuts or rules then take the call, or, for a tool, its ``__torch_dispatch__``, so
    it sees the ops that run without it)."""
    return (type(a) in PLAIN or isinstance(a, LevelTensor)) and not a.requires_grad


def _unbatched(cls, a: Any) -> bool:
    """Whether tensor ``a`` is unbatched at level ``cls`` and can be handed on as is."""
    t = type(a)
    return _passable(a) and (t in PLAIN or (t is not cls and issubclass(cls, t)))


def _call(func, args, kwargs):
    """``func`` on physical tensors. Tensors of an enclosing vmap level among them may take
    that level's own shortcuts. With none, no level's tensor is left: the call goes
    straight to the kernels, past vmap's composite-op hook (predispatch.py) where it would
    reach it."""
    for a in args:
        if isinstance(a, LevelTensor):
            with _enable_torch_function():
                return func(*args, **kwargs)
    if func in _REACHES_HOOK:
        with unintercepted():
            return func(*args, **kwargs)
    return func(*args, **kwargs)


# -- pointwise: batched tensors of any ranks, unbatched ones of no more dims than they -------


def pointwise(cls, func, args, kwargs):
    """Elementwise math: the physical tensors broadcast as the logical ones do. Batched
    tensors of fewer dims than others get size-1 dims after the batch dim."""
    if kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    phys = []
    rank = low = -1  # the most and the fewest dims of our examples (batched first, no grad)
    plain_rank = -1  # the largest rank of an unbatched tensor
    nested = False  # whether a tensor of an enclosing level is handed on
    for a in args:  # the hot loop of a chain of small ops: _own and _unbatched, inlined
        t = type(a)
        if t is cls:
            if a._bdim or a.requires_grad:
                return None
            inner = a._inner
            if type(inner) is torch.Tensor:
                if inner.requires_grad:
                    return None
            elif _passable(inner):
                nested = True
            else:
                return None
            r = inner.dim() - 1
            if r != rank:
                if rank == -1:
                    rank = low = r
                else:
                    rank, low = max(rank, r), min(low, r)
            phys.append(inner)
        elif t in _NUMBERS:
            phys.append(a)
        elif t in PLAIN or (isinstance(a, LevelTensor) and _unbatched(cls, a)):
            if a.requires_grad:
                return None
            nested = nested or t not in PLAIN
            plain_rank = max(plain_rank, a.dim())
            phys.append(a)
        else:
            return None
    # a batched 0-dim tensor is physically 1-dim and would promote types as one
    if rank == -1 or plain_rank > rank or (low == 0 and (rank or plain_rank != -1)):
        return None
    if rank != low:
        phys = [pad_to_rank(p, rank) if type(a) is cls else p for a, p in zip(args, phys)]
    if nested:
        return wrap_front(cls, _call(func, phys, kwargs))
    return wrap_front(cls, func(*phys, **kwargs))  # plain tensors: the hot path, no guard


def activation(cls, func, args, kwargs):
    """``F.relu`` and kin: pointwise, unless asked to work in place."""
    if kwargs.get("inplace") or any(a is True for a in args[1:]):
        return None
    return pointwise(cls, func, args, kwargs)


# -- calls that take examples with or without a leading batch dim ---------------------------


def _operand(cls, a: Any) -> torch.Tensor | None:
    """The physical tensor of operand ``a``: ours (see :func:`_own`), or ``a`` itself if
    unbatched here; None if it is neither."""
    if type(a) is cls:
        return _own(cls, a)
    return a if _unbatched(cls, a) else None


def _unbatched_rest(cls, args, kwargs) -> bool:
    """Whether every tensor argument but the first is unbatched at level ``cls``."""
    return all(_unbatched(cls, a) for a in (*args[1:], *kwargs.values())
               if isinstance(a, torch.Tensor))


def _first_batched(cls, func, args, kwargs, fits: Callable[[int], bool]) -> Any:
    """``func`` on the batch when its first argument is ours with an example rank that
    ``fits`` and every other tensor is unbatched."""
    inner = _own(cls, args[0])
    if inner is None or not fits(inner.dim() - 1) or not _unbatched_rest(cls, args, kwargs):
        return None
    return wrap_all_front(cls, _call(func, (inner, *args[1:]), kwargs))


def leading_dims(cls, func, args, kwargs):
    """``F.linear`` and kin take any number of leading dims: the batch is one more."""
    return _first_batched(cls, func, args, kwargs, lambda rank: rank >= 1)


def example_rank(rank: int, run: Callable = _call) -> Shortcut:
    """Convolution, pooling: one example has ``rank`` dims, and a batch of them one more.
    Examples that are batches themselves (``x.unsqueeze(0)`` per example, as in per-sample
    gradients) have the vmap batch folded into their own. ``run`` makes the call."""

    def shortcut(cls, func, args, kwargs):
        inner = _own(cls, args[0])
        if inner is None or not _unbatched_rest(cls, args, kwargs):
            return None
        if inner.dim() - 1 == rank:
            if not inner.is_contiguous():
                # a batch laid out otherwise (channels-last) gives outputs laid out so,
                # where one example's call, a dim fewer, gives them contiguous: the usual
                # path lays each example out as its call does
                return None
            return wrap_all_front(cls, run(func, (inner, *args[1:]), kwargs))
        if inner.dim() - 1 != rank + 1:
            return None
        out = run(func, (inner.flatten(0, 1), *args[1:]), kwargs)
        lead = inner.shape[:2]
        if isinstance(out, torch.Tensor):
            return wrap_front(cls, out.unflatten(0, lead))
        return tuple(wrap_front(cls, o.unflatten(0, lead)) for o in out)

    return shortcut


def flatten(cls, func, args, kwargs):
    """``x.flatten(start_dim, end_dim)``: the same dims of each example."""
    inner = _own(cls, args[0])
    params = {**dict(zip(("start_dim", "end_dim"), args[1:])), **kwargs}
    start, end = params.pop("start_dim", 0), params.pop("end_dim", -1)
    if inner is None or params or type(start) is not int or type(end) is not int:
        return None
    rank = inner.dim() - 1
    if not (-rank <= start < rank and -rank <= end < rank) or start % rank > end % rank:
        return None  # 0-dim, or out of range: the usual path raises torch's error
    return wrap_front(cls, _call(torch.flatten, (inner, start % rank + 1, end % rank + 1), {}))


def unsqueeze(cls, func, args, kwargs):
    """``x.unsqueeze(dim)``: the same dim of each example, one further in."""
    inner = _own(cls, args[0])
    dim = args[1] if len(args) == 2 else kwargs.get("dim")
    if inner is None or type(dim) is not int or len(args) + len(kwargs) != 2:
        return None
    rank = inner.dim()  # an example's rank with the new dim
    if not -rank <= dim < rank:
        return None  # out of range: the usual path raises torch's error
    return wrap_front(cls, _call(torch.unsqueeze, (inner, dim % rank + 1), {}))


def _int_args(args: tuple, kwargs: dict) -> tuple | None:
    """The ints after ``self`` (given one by one or as one sequence), or None."""
    rest = args[1:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = tuple(rest[0])
    return None if kwargs or not all(type(i) is int for i in rest) else rest


def reshape(cls, func, args, kwargs):
    """``x.view(shape)``, ``x.reshape(shape)``: each example's shape, the batch in front.
    Past the dispatcher, a chain of views costs the same per view however long it is
    (PyTorch clones a subclass view's whole chain of view functions for every new view)."""
    inner = _own(cls, args[0])
    shape = _int_args(args, kwargs)
    if inner is None or shape is None or not inner.shape[0]:
        return None  # no examples: -1 would be ambiguous
    try:
        out = _call(func, (inner, (inner.shape[0], *shape)), {})
    except RuntimeError:
        return None  # a bad shape, or not a view of the batch: the usual path decides
    return wrap_front(cls, out)


def transpose(cls, func, args, kwargs):
    """``x.transpose(d0, d1)``, ``x.t()``: the same dims of each example, one further in."""
    inner = _own(cls, args[0])
    dims = _int_args(args, kwargs)
    if inner is None or dims is None:
        return None
    rank = inner.dim() - 1
    if func in (torch.t, torch.Tensor.t):
        if dims or rank != 2:
            return None  # t() of a vector or a 0-dim example: the usual path
        dims = (0, 1)
    if len(dims) != 2 or not rank or not all(-rank <= d < rank for d in dims):
        return None  # out of range: the usual path raises torch's error
    return wrap_front(cls, _call(torch.transpose, (inner, *(d % rank + 1 for d in dims)), {}))


def permute(cls, func, args, kwargs):
    """``x.permute(dims)``: each example's dims in that order, the batch in front."""
    inner = _own(cls, args[0])
    order = _int_args(args, kwargs)
    if inner is None or order is None or len(order) != inner.dim() - 1 or not order:
        return None
    rank = len(order)
    if not all(-rank <= d < rank for d in order):
        return None
    return wrap_front(cls, _call(torch.permute, (inner, (0, *(d % rank + 1 for d in order))), {}))


# -- calls along dims, indexing, products: the example's dims shift by one -------------------


def _taken(cls, func, args, kwargs) -> Any:
    """:func:`_call` of ``func`` on physical tensors batched first, wrapped; None where torch
    raises: the usual path then raises torch's own error, naming the example's dims."""
    try:
        return wrap_all_front(cls, _call(func, args, kwargs))
    except (RuntimeError, IndexError, TypeError, ValueError):
        return None


def _shift(dim: Any, rank: int) -> Any:
    """An example's ``dim`` (an int, or a non-empty sequence of ints) as the batch's, or
    None where it is out of range or something else (a name, an empty list: the usual
    path decides)."""
    if type(dim) is int:
        return dim % rank + 1 if -rank <= dim < rank else None
    if type(dim) in (tuple, list) and dim and all(
            type(d) is int and -rank <= d < rank for d in dim):
        return tuple(d % rank + 1 for d in dim)
    return None


_ALL = object()  # an along_dim default: no dim means every dim of the example


def along_dim(position: int, default: Any = None) -> Shortcut:
    """Reductions, softmax, cumsum, split and kin, working along ``dim`` (argument
    ``position``, else keyword ``dim``, else ``default``) of their first argument: the same
    dims of each example, one further in."""

    def shortcut(cls, func, args, kwargs):
        inner = _own(cls, args[0])
        if inner is None or kwargs.get("out") is not None or not _unbatched_rest(
                cls, args, kwargs):
            return None
        rank = inner.dim() - 1
        if not rank:
            return None  # a dim of a 0-dim example means that one element: the usual path
        given = args[position] if len(args) > position else kwargs.get("dim", default)
        dim = tuple(range(1, rank + 1)) if given is _ALL else _shift(given, rank)
        if dim is None:
            return None
        if len(args) > position:
            args = (inner, *args[1:position], dim, *args[position + 1:])
        else:
            args, kwargs = (inner, *args[1:]), {**kwargs, "dim": dim}
        return _taken(cls, func, args, kwargs)

    return shortcut


def normalized_trailing(cls, func, args, kwargs):
    """``F.layer_norm``, ``F.rms_norm``: they normalize trailing dims, so the batch in
    front is one more leading dim."""
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    count = 1 if type(shape) is int else len(shape) if isinstance(shape, (tuple, list)) else -1
    inner = _own(cls, args[0])
    if inner is not None and inner.dim() in (4, 5) and not inner.is_contiguous():
        # a batch laid out channels-last gives a norm laid out so (rms_norm keeps its
        # input's layout), where one example's, a dim fewer, is contiguous: the usual
        # path lays each example out as its call does
        return None
    return _first_batched(cls, func, args, kwargs, lambda rank: rank >= count >= 0)


_along_first_dim = along_dim(1)


_norm_along = along_dim(2)
_vector_norm = along_dim(2, _ALL)
_NORM_PARAMETERS = ("input", "p", "dim", "keepdim")


def norm(cls, func, args, kwargs):
    """``x.norm(p, dim, keepdim, dtype=...)``: along the given dims of each example; with
    none, for a number ``p`` or "fro", ``torch.linalg.vector_norm`` of each whole example,
    as torch.norm computes it (a matrix norm of a whole example goes the usual way)."""
    given = dict(zip(_NORM_PARAMETERS, args), **kwargs)
    if len(args) > 4 or "input" not in given or given.get("out") is not None or (
            given.keys() - {*_NORM_PARAMETERS, "dtype", "out"}):
        return None  # out= (torch.norm's fifth), or a name torch.norm does not take
    if given.get("dim") is not None:
        return _norm_along(cls, func, args, kwargs)
    p = given.get("p", "fro")
    if isinstance(p, str) and p != "fro":
        return None
    return _vector_norm(cls, torch.linalg.vector_norm, (
        given["input"], 2 if p is None or isinstance(p, str) else p, _ALL,
        given.get("keepdim", False)), {"dtype": given.get("dtype")})


def squeeze(cls, func, args, kwargs):
    """``x.squeeze(dim)``, or ``x.squeeze()``: the example's size-1 dims, not the batch's."""
    if len(args) > 1 or kwargs:
        return _along_first_dim(cls, func, args, kwargs)
    inner = _own(cls, args[0])
    if inner is None:
        return None
    ones = tuple(d for d in range(1, inner.dim()) if inner.shape[d] == 1)
    return _taken(cls, torch.squeeze, (inner, ones), {})


def basic_index(item: Any) -> bool:
    """Whether ``item`` indexes each example's dims alone: an int, a slice of ints, None or
    ``...`` (not a tensor, list or bool, which index by values)."""
    if type(item) is slice:
        return all(type(i) is int or i is None for i in (item.start, item.stop, item.step))
    return type(item) is int or item is None or item is Ellipsis


def getitem(cls, func, args, kwargs):
    """``x[0, 1:3, None, ...]``: the same basic index of each example, the batch kept."""
    inner = _own(cls, args[0])
    index = args[1]
    items = index if type(index) is tuple else (index,)
    if inner is None or not all(basic_index(i) for i in items):
        return None
    return _taken(cls, func, (inner, (slice(None), *items)), {})


def expand(cls, func, args, kwargs):
    """``x.expand(*sizes)``: new leading dims go after the batch dim."""
    inner = _own(cls, args[0])
    sizes = _int_args(args, kwargs)
    if inner is None or sizes is None:
        return None
    new = len(sizes) - (inner.dim() - 1)
    if new < 0 or -1 in sizes[:new]:
        return None  # fewer sizes than dims, or -1 for a new dim: the usual path raises
    inner = pad_to_rank(inner, len(sizes))
    return _taken(cls, torch.Tensor.expand, (inner, (inner.shape[0], *sizes)), {})


def where(cls, func, args, kwargs):
    """``torch.where(cond, x, y)``, ``x.where(cond, y)``: elementwise in all three."""
    if kwargs or len(args) != 3:
        return None  # torch.where(cond) gives indices
    return pointwise(cls, func, args, kwargs)


def masked_fill(cls, func, args, kwargs):
    """``x.masked_fill(mask, value)`` of a batched ``x`` and an unbatched value: elementwise."""
    if type(args[0]) is not cls or kwargs or len(args) != 3 or type(args[2]) is cls:
        return None
    return pointwise(cls, func, args, kwargs)


def cat(cls, func, args, kwargs):
    """``torch.cat(tensors, dim)``, ``torch.stack(tensors, dim)`` of batched tensors of
    one rank: the same dim of each example."""
    tensors = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if type(tensors) not in (tuple, list) or not tensors or len(args) > 2 or (
            kwargs.keys() - {"dim"}):
        return None
    inners = [_own(cls, t) for t in tensors]
    if any(t is None for t in inners) or len({t.dim() for t in inners}) != 1:
        return None
    rank = inners[0].dim() - 1 + (func is torch.stack)
    dim = _shift(dim, rank) if rank else None
    return None if dim is None else _taken(cls, func, (inners, dim), {})


def matmul(cls, func, args, kwargs):
    """``a @ b``. A batched vector is a one-row (first) or one-column (second) matrix
    whose dim leaves the product, as matmul defines it, unless the physical call already
    treats it as a batch of vectors; operands of two or more dims are padded to the larger
    rank with size-1 dims after the batch dim, broadcast as each example's. ``dot``,
    ``mv``, ``mm`` and ``bmm`` are matmul of the ranks they take."""
    operands = None if kwargs or len(args) != 2 else _operands(cls, args)
    if operands is None or 0 in operands[1] or func in _RANKS and (
            tuple(operands[1]) != _RANKS[func]):
        return None
    (a, b), (rank_a, rank_b) = operands
    if func in _BMM and a.shape[-3] != b.shape[-3]:
        return None  # bmm does not broadcast its batch as matmul does: the usual path raises
    ours_a, ours_b = type(args[0]) is cls, type(args[1]) is cls
    if ours_b and rank_b == 1 and not ours_a and rank_a <= 2:
        # an unbatched vector or matrix times batched vectors: the vectors' batch on the
        # left of the same product, as torch.matmul batches a left operand's leading dims
        return _taken(cls, torch.matmul, (b, a if rank_a == 1 else a.mT), {})
    row = ours_a and rank_a == 1 and (ours_b or rank_b > 2)
    column = ours_b and rank_b == 1
    if row:
        a, rank_a = a.unsqueeze(-2), 2
    if column:
        b, rank_b = b.unsqueeze(-1), 2
    if rank_a > 1 and rank_b > 1:
        rank = max(rank_a, rank_b)
        a, b = (pad_to_rank(a, rank) if ours_a else a), (pad_to_rank(b, rank) if ours_b else b)
    try:
        out = _call(torch.matmul, (a, b), {})
    except RuntimeError:
        return None  # the usual path raises torch's error, naming the example's shapes
    if column:
        out = out.squeeze(-1)
    if row:
        out = out.squeeze(-1 if column else -2)
    return wrap_front(cls, out)


def einsum(cls, func, args, kwargs):
    """``torch.einsum(equation, *operands)``: the batch gets a letter of its own, leading
    each batched operand and the output (an equation with ``->`` only)."""
    operands = args[1:]
    if len(operands) == 1 and type(operands[0]) in (tuple, list):
        operands = tuple(operands[0])
    if kwargs or not args or type(args[0]) is not str or "->" not in args[0]:
        return None
    inputs, output = args[0].replace(" ", "").split("->", 1)
    terms = inputs.split(",")
    letter = next((c for c in _LETTERS if c not in args[0]), None)
    if letter is None or len(terms) != len(operands):
        return None
    phys = [_operand(cls, a) for a in operands]
    if any(p is None for p in phys):
        return None
    terms = [letter + term if type(a) is cls else term for a, term in zip(operands, terms)]
    try:
        out = _call(torch.einsum, (f"{','.join(terms)}->{letter}{output}", *phys), {})
    except (RuntimeError, IndexError, TypeError, ValueError):
        return None  # the usual path raises torch's own error, naming the example's dims
    # of one operand, a view of it (a diagonal, a permutation), as each example's einsum
    # gives, so writes go through; of more, each example contiguous (the batch's letter may
    # leave it among another dim's rows, where one example's einsum gives a tensor that
    # .view accepts)
    return wrap_front(cls, out if len(phys) == 1 else out.contiguous())


_LETTERS = "ZYXWVUTSRQPONMLKJIHGFEDCBAzyxwvutsrqponmlkjihgfedcba"

_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                    "enable_gqa")


def attention(cls, func, args, kwargs):
    """``F.scaled_dot_product_attention`` of batched query, key and value of one example
    rank, with no dropout and no mask or an unbatched one of at most 2 dims: the batch is
    one more leading dim. Examples of 4 dims or more, whose leading dims agree, have the
    batch folded into their first, so the fused kernels (which take 4 dims) still run."""
    given = dict(zip(_SDPA_PARAMETERS, args))
    if len(args) > len(_SDPA_PARAMETERS) or given.keys() & kwargs.keys() or (
            kwargs.keys() - set(_SDPA_PARAMETERS)):
        return None
    given.update(kwargs)
    qkv = [_own(cls, given.pop(name, None)) for name in _SDPA_PARAMETERS[:3]]
    mask = given.get("attn_mask")
    if any(t is None for t in qkv) or len({t.dim() for t in qkv}) != 1 or given.get(
            "dropout_p", 0.0) != 0.0 or not (mask is None or (
                _unbatched(cls, mask) and mask.dim() <= 2)):
        return None
    batch, rank = qkv[0].shape[0], qkv[0].dim() - 1
    if rank < 2 or (rank >= 4 and len({t.shape[:2] for t in qkv}) != 1):
        return None
    if rank >= 4:
        qkv = [t.flatten(0, 1) for t in qkv]
    try:
        out = _call(func, qkv, given)
    except (RuntimeError, IndexError, TypeError, ValueError):
        return None  # the usual path raises torch's own error
    return wrap_front(cls, out.unflatten(0, (batch, -1)) if rank >= 4 else out)


# -- losses, factories, outer, cosine_similarity, padding and layout ----------------------


def _operands(cls, args) -> tuple[list, list[int]] | None:
    """The physical tensors of ``args`` (see :func:`_operand`) and their example ranks;
    None unless each is an operand and at least one is ours."""
    phys = [_operand(cls, a) for a in args]
    if any(p is None for p in phys) or not any(type(a) is cls for a in args):
        return None
    return phys, [p.dim() - (type(a) is cls) for a, p in zip(args, phys)]


_LOSS_KEYWORDS = frozenset(("size_average", "reduce", "reduction", "beta", "delta", "weight"))


def elementwise_loss(cls, func, args, kwargs):
    """``F.mse_loss`` and kin of an input and a target of one example shape: the terms on
    the batch (reduction "none"), then each example's mean or sum, as vmap's rule for the
    aten op computes them. Legacy ``size_average``/``reduce`` and ``weight`` go the usual
    way."""
    operands = _operands(cls, args) if len(args) == 2 else None
    reduction = kwargs.get("reduction", "mean")
    if operands is None or not kwargs.keys() <= _LOSS_KEYWORDS or (
            reduction not in ("mean", "sum", "none")) or any(
            kwargs.get(k) is not None for k in ("size_average", "reduce", "weight")):
        return None
    phys, _ = operands
    shapes = {p.shape[1:] if type(a) is cls else p.shape for a, p in zip(args, phys)}
    if len(shapes) != 1:
        return None
    batch = next(p.shape[0] for a, p in zip(args, phys) if type(a) is cls)
    phys = [p if type(a) is cls else p.expand(batch, *p.shape) for a, p in zip(args, phys)]
    terms = _call(func, phys, {**kwargs, "reduction": "none"})
    if reduction == "none":
        return wrap_front(cls, terms)
    return wrap_front(cls, per_example(terms, mean=reduction == "mean"))


def like(cls, func, args, kwargs):
    """``torch.zeros_like(x)`` and kin: the same call on the batch. Its values do not
    depend on ``x``'s, so ``x`` may require grad."""
    a = args[0]
    if type(a) is not cls or a._bdim or a.is_conj() or a.is_neg() or kwargs.get(
            "requires_grad") or kwargs.get("memory_format", torch.preserve_format) is not (
            torch.preserve_format) or not _unbatched_rest(cls, args, kwargs):
        return None
    inner = a._inner
    if not (type(inner) in PLAIN or isinstance(inner, LevelTensor)):
        return None
    return wrap_front(cls, _call(func, (inner, *args[1:]), kwargs))


def new_factory(cls, func, args, kwargs):
    """``x.new_zeros(size)`` and kin: batched, as vmap's rule makes them (values written
    into the new tensor later may be batched)."""
    inner = _own(cls, args[0])
    size = _int_args(args, {})
    if inner is None or size is None or "size" in kwargs or kwargs.get("requires_grad"):
        return None
    return wrap_front(cls, _call(func, (inner, (inner.shape[0], *size)), kwargs))


def outer(cls, func, args, kwargs):
    """``torch.outer(u, v)`` of vectors: ``u`` as a column times ``v``, as torch computes
    it, on the batch."""
    operands = None if kwargs or len(args) != 2 else _operands(cls, args)
    if operands is None or operands[1] != [1, 1]:
        return None
    (u, v), _ = operands
    return wrap_front(cls, _call(torch.mul, (u.unsqueeze(-1), v.unsqueeze(-2)), {}))


def cosine_similarity(cls, func, args, kwargs):
    """``F.cosine_similarity(x1, x2, dim)`` of examples of one rank (an unbatched tensor
    of no more dims): along the same dim of each example, one further in."""
    operands = _operands(cls, args[:2]) if len(args) >= 2 else None
    if operands is None or len(args) > 4 or kwargs.keys() - {"dim", "eps"}:
        return None
    phys, ranks = operands
    rank = max(r for a, r in zip(args, ranks) if type(a) is cls)
    if any(r != rank if type(a) is cls else r > rank for a, r in zip(args, ranks)):
        return None
    dim = _shift(args[2] if len(args) > 2 else kwargs.get("dim", 1), rank)
    if dim is None:
        return None
    rest = {k: v for k, v in kwargs.items() if k != "dim"}
    return _taken(cls, func, (*phys, dim, *args[3:]), rest)


def pad(cls, func, args, kwargs):
    """``F.pad(x, pad, "constant", value)``: it pads trailing dims, so the batch in front
    is one more leading dim (the other modes take inputs of set ranks: the usual way)."""
    given = dict(zip(("input", "pad", "mode", "value"), args), **kwargs)
    inner = _own(cls, given.get("input"))
    widths = given.get("pad")
    if inner is None or len(given) > 4 or given.get("mode", "constant") != "constant" or not (
            isinstance(widths, (tuple, list)) and len(widths) // 2 <= inner.dim() - 1):
        return None
    return _taken(cls, func, (inner, widths, "constant", given.get("value")), {})


def contiguous(cls, func, args, kwargs):
    """``x.contiguous()``: ``x`` itself when it is, else contiguous examples (a contiguous
    batch); other memory formats go the usual way."""
    given = dict(zip(("self", "memory_format"), args), **kwargs)
    inner = _own(cls, args[0])
    if inner is None or len(given) > 2 or given.get(
            "memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return None
    if args[0].is_contiguous():
        return args[0]
    out = _call(func, (inner,), {})
    if out is inner:  # a batch of no examples: torch keeps an empty tensor's strides
        out = inner.clone(memory_format=torch.contiguous_format)
    return wrap_front(cls, out)


def flip(cls, func, args, kwargs):
    """``x.flip(dims)``: the same dims of each example, one further in."""
    inner = _own(cls, args[0])
    if inner is None or kwargs.keys() - {"dims"} or len(args) + len(kwargs) < 2 or (
            kwargs and len(args) > 1) or inner.dim() == 1:
        return None
    dims = kwargs["dims"] if kwargs else args[1] if len(args) == 2 else args[1:]
    shifted = _shift(dims, inner.dim() - 1)
    if shifted is None:
        return None
    return _taken(cls, torch.flip, (inner, (shifted,) if type(shifted) is int else shifted), {})


def trailing_matrix(cls, func, args, kwargs):
    """``x.triu()``, ``x.tril()``: they work on the last two dims, so the batch in front
    is one more leading dim."""
    return _first_batched(cls, func, args, kwargs, lambda rank: rank >= 2)


def _declare(shortcut: Shortcut, *funcs: Callable) -> None:
    for func in funcs:
        SHORTCUTS[func] = shortcut


def torch_and_tensor(*names: str) -> list:
    """``torch.<name>`` and ``Tensor.<name>`` for each name, where they exist."""
    return [getattr(m, n) for n in names for m in (torch, torch.Tensor) if hasattr(m, n)]


# the example ranks that dot, mv, mm and bmm take (the usual path raises torch's error
# for others)
_RANKS = {f: ranks for names, ranks in (("dot", (1, 1)), ("mv", (2, 1)), ("mm", (2, 2)),
                                        ("bmm", (3, 3)))
          for f in torch_and_tensor(names)}
_BMM = frozenset(torch_and_tensor("bmm"))


# torch.<name> and Tensor.<name>, and Tensor's operators: elementwise, each tested against
# torch.func.vmap in tests/test_shortcuts.py
POINTWISE_NAMES = [
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh",
    "deg2rad", "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "logical_not", "nan_to_num", "neg",
    "negative", "rad2deg", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign",
    "sgn", "sin", "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "isnan",
    "bitwise_not", "clamp", "clip", "clamp_min", "clamp_max", "pow", "float_power", "add",
    "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "floor_divide",
    "remainder", "fmod", "atan2", "maximum", "minimum", "fmax", "fmin", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_xor", "hypot", "copysign", "xlogy", "lerp", "addcmul",
    "addcdiv", "heaviside", "logaddexp", "logaddexp2",
]
POINTWISE_DUNDERS = [
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__or__", "__xor__", "__invert__",
    "__floordiv__", "__mod__",
]
ACTIVATIONS = (F.relu, F.silu, F.gelu, F.leaky_relu, F.elu, F.softplus, F.mish, F.hardtanh,
               F.relu6, F.hardswish, F.hardsigmoid, F.selu, F.celu, F.softsign, F.tanhshrink,
               F.logsigmoid, F.hardshrink, F.softshrink, F.threshold)

_declare(pointwise, *(getattr(torch, n) for n in POINTWISE_NAMES))
_declare(pointwise, *(getattr(torch.Tensor, n) for n in POINTWISE_NAMES + POINTWISE_DUNDERS))
_declare(activation, *ACTIVATIONS)
_declare(leading_dims, F.linear)
_declare(flatten, torch.flatten, torch.Tensor.flatten)
_declare(unsqueeze, torch.unsqueeze, torch.Tensor.unsqueeze)
_declare(reshape, torch.Tensor.view, torch.reshape, torch.Tensor.reshape)
_declare(transpose, torch.transpose, torch.Tensor.transpose, torch.t, torch.Tensor.t)
_declare(permute, torch.permute, torch.Tensor.permute)
_declare(along_dim(1, _ALL), *torch_and_tensor("sum", "mean", "amax", "amin", "std", "var"))
_declare(_along_first_dim, *torch_and_tensor(
    "logsumexp", "prod", "argmax", "argmin", "softmax", "log_softmax", "cumsum", "cumprod",
    "narrow", "select"), F.softmax, F.log_softmax)
_declare(along_dim(2, 0), torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk)
_declare(along_dim(1, 0), torch.unbind, torch.Tensor.unbind)
_declare(along_dim(2, 1), F.normalize)
_declare(_vector_norm, torch.linalg.vector_norm)
_declare(norm, torch.norm, torch.Tensor.norm)
_declare(squeeze, torch.squeeze, torch.Tensor.squeeze)
_declare(normalized_trailing, F.layer_norm, F.rms_norm)
_declare(getitem, torch.Tensor.__getitem__)
_declare(expand, torch.Tensor.expand)
_declare(where, torch.where, torch.Tensor.where)
_declare(masked_fill, torch.Tensor.masked_fill)
_declare(cat, torch.cat, torch.concat, torch.stack)
_declare(matmul, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, *_RANKS)
_declare(einsum, torch.einsum)
_declare(attention, F.scaled_dot_product_attention)
# torchlevels' F.l1_loss: what reaches __torch_function__, weighted (declined) or not
_declare(elementwise_loss, F.mse_loss, l1_loss, F.smooth_l1_loss, F.huber_loss)
_declare(like, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like)
_declare(new_factory, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty)
_declare(outer, torch.outer, torch.Tensor.outer, torch.ger, torch.Tensor.ger)
_declare(cosine_similarity, torch.cosine_similarity)
_declare(pad, F.pad)
_declare(contiguous, torch.Tensor.contiguous)
_declare(flip, torch.flip, torch.Tensor.flip)
_declare(trailing_matrix, *torch_and_tensor("triu", "tril"))


def _max_pool(func, args, kwargs):
    """:func:`_call` of a 2-d or 3-d max pool, in the layout PyTorch pools fastest in."""
    return _call(partial(max_pool, func), args, kwargs)


for _n in (1, 2, 3):
    _declare(example_rank(_n + 1), *(getattr(F, f"{name}{_n}d{suffix}") for name, suffix in (
        ("conv", ""), ("avg_pool", ""), ("adaptive_avg_pool", ""), ("adaptive_max_pool", ""),
        ("adaptive_max_pool", "_with_indices"))))
_declare(example_rank(2), F.max_pool1d, F.max_pool1d_with_indices)
for _n in (2, 3):
    _declare(example_rank(_n + 1, _max_pool),
             getattr(F, f"max_pool{_n}d"), getattr(F, f"max_pool{_n}d_with_indices"))
_BUILTIN.update(SHORTCUTS)
# the shortcut calls that run ops vmap's composite-op hook intercepts (linear, matmul):
# _call skips the hook around them. (A call missing here would reach the hook, which
# passes plain tensors by: the same result, one Python call slower.)
_REACHES_HOOK = frozenset((F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                           torch.einsum, F.scaled_dot_product_attention))
