"""Trace and replay: ``trace(f)`` records the plain aten ops that ``f`` runs through every
transform inside it; ``compile(f)`` caches one trace per input signature and replays it.

The tracer is PyTorch's ``make_fx``, a ``__torch_dispatch__`` mode: a mode sees an op only
after every level has unwrapped its tensors, so the graph holds the physical ops of
``vmap(grad(f))``, forward and backward, and none of the Python that chose them. Replaying
the graph skips that Python, which is where the per-op overhead of levels goes.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from traceback import FrameSummary
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchlevels import data_assignment
from torchlevels._level import _AUTOGRAD, LevelTensor, _key_excluded
from torchlevels.tools.forwarding import wraps_function
from torchlevels.tools.fx_sources import sources_forgotten

__all__ = ["DataDependentError", "compile", "trace"]

aten = torch.ops.aten


class DataDependentError(RuntimeError):
    """``f`` reads tensor values into Python, so one trace cannot stand for other inputs."""


def trace(func: Callable) -> Callable[..., GraphModule]:
    """``trace(f)(*args)``: a ``torch.fx.GraphModule`` of the plain aten ops ``f`` runs on
    ``args``, traced through every transform inside ``f`` (vmap, grad, jvp, user levels).

    The graph takes the tensors of ``args`` (and of ``kwargs``), flattened in pytree order,
    and returns ``f``'s outputs, flattened (non-tensor ones as constants); tensors ``f``
    captures are constants of the graph (the same objects, so updating them in place is
    seen). Non-tensor arguments are fixed at their traced values, and so is aliasing (a
    tensor passed twice is traced as one, so the graph of ``f(x, x)`` reads one of its two
    inputs), and the storage offset an ``as_strided`` under vmap reads from an input.
    Raises :class:`DataDependentError` if ``f`` reads a tensor's value into Python
    (``.item()``, ``if t:``, ``.tolist()``, ``.numpy()``): the graph would hold the branch
    taken for these inputs only. Where an input or a captured tensor requires grad, the
    graph also switches grad mode where it was switched while tracing (a
    ``torch.no_grad()`` block in ``f``), so that autograd records a replay as it
    recorded ``f``. Call it outside every transform.

    Example::

        >>> import torch
        >>> from torchlevels import grad, trace, vmap
        >>> gm = trace(vmap(grad(lambda x: x.sin().sum())))(torch.randn(3, 4))
        >>> ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        >>> "aten.cos.default" in ops  # the backward of sin, batched: plain aten ops only
        True
        >>> x = torch.randn(3, 4)
        >>> torch.equal(gm(x)[0], torch.cos(x))
        True
    """

    def traced(*args: Any, **kwargs: Any) -> GraphModule:
        return _trace(func, args, kwargs)[0]

    return traced


def _trace(func: Callable, args: tuple, kwargs: dict) -> tuple[GraphModule, Any, list]:
    """The graph of ``func`` on these inputs, the pytree spec of its outputs, and the
    outputs themselves: tracing runs ``func`` on the real inputs, in-place writes included,
    so this call's answer is that run's, not a second run's."""
    flat, spec = tree_flatten((args, kwargs))
    tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    if any(isinstance(flat[i], LevelTensor) for i in tensors):
        raise ValueError(
            "trace/compile: got a tensor of a live transform as an input. Trace from outside "
            "every transform: write trace(vmap(f)) rather than vmap(trace(f))."
        )
    out_spec = outputs = None

    def flat_func(*tensor_args: torch.Tensor) -> list:
        nonlocal out_spec, outputs
        _note_autograd(get_proxy_mode().tracer, calls)
        leaves = list(flat)
        for i, t in zip(tensors, tensor_args):
            leaves[i] = t
        a, k = tree_unflatten(leaves, spec)
        outputs, out_spec = tree_flatten(func(*a, **k))
        return outputs

    calls = _TracedCalls(func)
    with sources_forgotten() as kept:  # gm's own, until it is freed
        try:
            with calls:
                gm = make_fx(flat_func)(*(flat[i] for i in tensors))
        except RuntimeError as e:
            if "data-dependent" not in str(e):
                raise
            frames = traceback.extract_tb(e.__traceback__)
            raise DataDependentError(
                _data_dependent(func, "aten._local_scalar_dense", frames)) from e
        _check_no_python_values(gm, func)
        drop_aliases(gm)
        _read_through_saved_outputs(gm)
        gm.graph.eliminate_dead_code()
        if _recorded_by_autograd(gm, [flat[i] for i in tensors]):
            _replay_grad_modes(gm.graph, torch.is_grad_enabled())
        gm.recompile()
        kept.append(gm)
    return gm, out_spec, outputs


_GRAD_ENABLED = "torchlevels_grad_enabled"
_SAVED_OUTPUT = "torchlevels_saved_output"


def _note_autograd(tracer: Any, calls: _TracedCalls) -> None:
    """Make make_fx's ``tracer`` note on each node it makes whether grad mode was on when
    the op ran, and on each ``detach`` whether autograd made it to save an output: make_fx
    sees ops below autograd, and its graph would hold neither."""
    create_node = tracer.create_node

    def noting(*args: Any, **kwargs: Any) -> torch.fx.Node:
        node = create_node(*args, **kwargs)
        node.meta[_GRAD_ENABLED] = torch.is_grad_enabled()
        if node.target is aten.detach.default:
            # a detach called through the dispatcher passed autograd's kernel, which
            # excluded autograd below it; autograd's own shallow copies did not
            node.meta[_SAVED_OUTPUT] = not (_key_excluded(_AUTOGRAD) or calls.reading_data)
        return node

    tracer.create_node = noting


def _recorded_by_autograd(gm: GraphModule, inputs: list) -> bool:
    """Whether autograd may record a replay of ``gm``: an input or a captured tensor
    requires grad."""
    return any(_requires_grad((*inputs, *_captured(gm))))


def _captured(gm: GraphModule) -> tuple[torch.Tensor, ...]:
    """The tensors ``gm`` holds as constants: those ``f`` captured (a module's parameters)."""
    constants = (getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr")
    return tuple(t for t in constants if isinstance(t, torch.Tensor))


def _requires_grad(tensors: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    """Each tensor's ``requires_grad`` flag."""
    return tuple(t.requires_grad for t in tensors)


def _replay_grad_modes(graph: torch.fx.Graph, enabled: bool) -> None:
    """Switch grad mode in ``graph`` where it was switched while tracing (``torch.no_grad()``
    in ``f``, PyTorch's backward pass), from ``enabled`` at the call and back at its end:
    autograd outside then records the ops of a replay that it recorded when traced."""
    current = enabled
    for node in list(graph.nodes):
        mode = enabled if node.op == "output" else node.meta.get(_GRAD_ENABLED, current)
        if node.op in ("call_function", "output") and mode != current:
            with graph.inserting_before(node):
                graph.call_function(torch._C._set_grad_enabled, (mode,))
            current = mode


def _read_through_saved_outputs(gm: GraphModule) -> None:
    """Read through the ``detach`` nodes of autograd's saved outputs. Autograd saves an
    output an op's derivative needs (``exp``'s, ``logsumexp``'s) as a shallow copy and
    unpacks it in the backward pass as another, which make_fx records as two detaches; but
    the tensor unpacked has the output's history, so autograd outside differentiates a
    double backward through it (``grad`` of ``grad``, hessian-vector products). Read as
    detaches, a replay of ``f`` would cut that history and give wrong derivatives."""
    _read_through(gm, lambda node: node.meta.get(_SAVED_OUTPUT, False))


def drop_aliases(gm: GraphModule) -> None:
    """Read through ``aten.alias`` nodes (forward AD makes one per dual tensor it packs or
    unpacks, half the nodes of a jvp's graph). An alias has its input's storage and
    metadata, so reading it is reading its input."""
    _read_through(gm, lambda node: node.op == "call_function"
                  and node.target is aten.alias.default)


def _read_through(gm: GraphModule, picked: Callable[[torch.fx.Node], bool]) -> None:
    """Replace each node ``picked`` (a view of its first argument with its metadata) by
    that argument, except one an op writes to (which could change its metadata alone:
    ``t_``)."""
    for node in list(gm.graph.nodes):
        if picked(node) and not any(
            isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable
            for u in node.users
        ):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


# Ops that hand a tensor's values (not its metadata) to Python.
_READS_VALUES = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


# `t.data`, torchlevels' and PyTorch's: a mode sees the getter of one of these
_DATA = (data_assignment.data_property, data_assignment.pytorch_data)


class _TracedCalls(TorchFunctionMode):
    """What make_fx, a dispatch mode, cannot tell from the ops it sees: raises on the reads
    of tensor values that run no aten op (``.tolist()``, ``.numpy()``), whose values the
    graph would hold, and notes ``t.data`` reads, a shallow copy as autograd's saved
    outputs are, but one that stops the history."""

    _READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}

    def __init__(self, func: Callable) -> None:
        super().__init__()
        self.func = func
        self.reading_data = False

    def __torch_function__(self, f, types, args=(), kwargs=None):
        if f in self._READS:
            raise DataDependentError(_data_dependent(self.func, f"Tensor.{f.__name__}",
                                                     traceback.extract_stack()))
        if getattr(f, "__self__", None) in _DATA:  # t.data
            self.reading_data, reading = True, self.reading_data
            try:
                return f(*args, **(kwargs or {}))
            finally:
                self.reading_data = reading
        return f(*args, **(kwargs or {}))


def _check_no_python_values(gm: GraphModule, func: Callable) -> None:
    """Raise if the graph handed a tensor's values to Python, which then decided things."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _READS_VALUES:
            raise DataDependentError(_data_dependent(func, str(node.target.overloadpacket)))


# PyTorch's and torchlevels' own files: the frame of a read outside them is the user's
_LIBRARIES = (os.path.join(os.path.dirname(torch.__file__), ""),
              os.path.join(os.path.dirname(os.path.dirname(__file__)), ""))
_DISTRIBUTIONS = os.path.join(_LIBRARIES[0], "distributions", "")


def _data_dependent(func: Callable, op: str, frames: Sequence[FrameSummary] = ()) -> str:
    """The error for ``func``, which read a tensor's value through ``op``, with where
    (``frames``: the stack when it read, innermost last) if known."""
    name = getattr(func, "__name__", repr(func))
    user = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    where = ""
    if user:
        where = f" at {user[-1].filename}:{user[-1].lineno}"
        where += f" (`{user[-1].line}`)" if user[-1].line else ""
    advice = (" torch.distributions reads its arguments' values to check them: make the "
              "distribution with validate_args=False."
              if any(f.filename.startswith(_DISTRIBUTIONS) for f in frames) else "")
    return (
        f"trace/compile: {name} reads a tensor's value into Python ({op}, from `.item()`, "
        f"`if t:`, `.tolist()`, `torch.equal` or a shape that depends on values){where}, so a "
        "traced graph would hold what Python did for these inputs only. Keep such code out "
        "of the traced function, express the branch with torch.where, or run it eagerly."
        + advice
    )


class CompiledFunction:
    """``compile(f)``: traces cached per input signature, each kept with the training flags
    of the modules it ran, and replayed while those flags hold. At most ``cache_size_limit``
    traces are kept; a call that would need another runs ``f`` eagerly."""

    def __init__(self, func: Callable, backend: str | Callable | None,
                 cache_size_limit: int) -> None:
        if type(cache_size_limit) is not int or cache_size_limit < 1:
            raise ValueError(f"compile: cache_size_limit must be a positive int, got "
                             f"{cache_size_limit!r}")
        self.func = func
        self.backend = backend
        self.cache_size_limit = cache_size_limit
        self.cache: dict[Any, list[_Trace]] = {}
        self._warned = False
        wraps_function(func, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            flat, spec = args, len(args)  # the common case, without pytree's cost (~40 us)
        else:
            flat, spec = tree_flatten((args, kwargs))
        key = (spec, torch.is_grad_enabled(), _autocast(), _aliasing(flat),
               *(_signature(a) for a in flat))
        traces = self.cache.get(key, ())
        entry = next((t for t in traces if t.holds(flat)), None)
        if entry is not None:
            return tree_unflatten(entry.run(*(flat[i] for i in entry.tensors)), entry.out_spec)
        if not self._room():
            return self.func(*args, **kwargs)
        with _modules_run() as modules:
            gm, out_spec, outputs = _trace(self.func, args, kwargs)
        tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        inputs = [flat[i] for i in tensors]
        captured = _captured(gm)
        run = _backend(gm, self.backend, inputs)
        self.cache.setdefault(key, []).append(
            _Trace(run, out_spec, tensors, modules, _storage_offsets(gm, inputs), captured,
                   _requires_grad(captured)))
        return tree_unflatten(outputs, out_spec)  # the traced run's: it wrote in place

    def _room(self) -> bool:
        """Whether one more trace fits, after dropping those of modules that no longer
        exist (no call can replay them); warns once when none does."""
        for key in list(self.cache):
            self.cache[key] = [t for t in self.cache[key] if t.alive()]
            if not self.cache[key]:
                del self.cache[key]
        if sum(map(len, self.cache.values())) < self.cache_size_limit:
            return True
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"compile: {getattr(self.func, '__name__', 'the function')} has traced "
                f"{self.cache_size_limit} input signatures (cache_size_limit); calls with a "
                "new one run eagerly from now on. Keep shapes, dtypes and non-tensor "
                "arguments fixed, pass numbers that vary as tensors, or raise "
                "compile(f, cache_size_limit=...).", stacklevel=3)
        return False


@dataclass
class _Trace:
    """A replayable trace, the modules whose ``training`` flag it was traced with (train
    and eval take different branches: dropout, batch norm), the storage offsets of its
    inputs where the graph holds them, and the tensors it captured with their
    ``requires_grad`` flags (a frozen layer unfrozen: the trace of frozen ones switched no
    grad modes for autograd, so a replay would record a ``no_grad`` block)."""

    run: Callable
    out_spec: Any
    tensors: list[int]  # which flattened arguments are the graph's inputs
    modules: list[tuple[weakref.ref, bool]]
    offsets: tuple[int, ...] | None
    captured: tuple[torch.Tensor, ...]
    captured_requires_grad: tuple[bool, ...]

    def alive(self) -> bool:
        """Whether every module the trace ran still exists."""
        return all(ref() is not None for ref, _ in self.modules)

    def holds(self, flat: Sequence) -> bool:
        if self.offsets is not None and self.offsets != tuple(
                flat[i].storage_offset() for i in self.tensors):
            return False
        if _requires_grad(self.captured) != self.captured_requires_grad:
            return False
        for ref, training in self.modules:
            module = ref()
            if module is None or module.training is not training:
                return False
        return True


@contextlib.contextmanager
def _modules_run() -> Iterator[list[tuple[weakref.ref, bool]]]:
    """The modules called inside the block, each once, with its ``training`` flag."""
    seen: dict[int, tuple[weakref.ref, bool]] = {}

    def record(module: torch.nn.Module, args: Any) -> None:
        seen.setdefault(id(module), (weakref.ref(module), module.training))

    handle = register_module_forward_pre_hook(record)
    modules: list[tuple[weakref.ref, bool]] = []
    try:
        yield modules
    finally:
        handle.remove()
        modules.extend(seen.values())


_AS_STRIDED = {aten.as_strided.default, aten.as_strided_.default, aten.as_strided_copy.default,
               aten.as_strided_scatter.default}


def _storage_offsets(gm: GraphModule, inputs: list) -> tuple[int, ...] | None:
    """The inputs' storage offsets if the graph has an as_strided view, whose offset may be
    one read from an input (vmap's rule passes the example's): another offset would view
    other elements. Else None: the graph holds no offset."""
    if any(n.op == "call_function" and n.target in _AS_STRIDED for n in gm.graph.nodes):
        return tuple(t.storage_offset() for t in inputs)
    return None


def _backend(gm: GraphModule, backend: str | Callable | None, inputs: list) -> Callable:
    """The graph as it will be replayed: as is, through inductor, or through torch.compile."""
    if backend is None:
        return gm
    if backend == "inductor":
        # straight to inductor: the cache above already guards, so no dynamo guards per call
        from torch._inductor.compile_fx import compile_fx

        return _with_constant_outputs(gm, lambda g: compile_fx(g, inputs))
    return torch.compile(gm, backend=backend)


def _with_constant_outputs(gm: GraphModule, compile_graph: Callable) -> Callable:
    """``compile_graph`` of ``gm`` made to return its tensor outputs alone (inductor takes
    no others), run with its other outputs (numbers, strings: constants of the trace) put
    back in their places."""
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    nodes = [k for k, o in enumerate(outs) if isinstance(o, torch.fx.Node)]
    if len(nodes) == len(outs):
        return compile_graph(gm)
    output.args = ([outs[k] for k in nodes],)
    gm.recompile()
    run = compile_graph(gm)

    def replay(*args: Any) -> list:
        filled = list(outs)
        for k, value in zip(nodes, run(*args)):
            filled[k] = value
        return filled

    return replay


def _aliasing(flat: Sequence) -> tuple[int, ...] | None:
    """Which tensor arguments are one object, if any are: make_fx traces a tensor passed twice
    as one input, so the graph of ``f(x, x)`` does not stand for ``f(x, y)``."""
    ids = [id(a) for a in flat if isinstance(a, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return None
    return tuple(ids.index(i) for i in ids)


def _signature(a: Any) -> Any:
    """What a trace depends on: a tensor's metadata, any other argument's value."""
    if isinstance(a, torch.Tensor):
        return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
    try:
        hash(a)
    except TypeError:
        raise TypeError(
            f"compile: got an argument of type {type(a).__name__}, which is neither a tensor "
            "nor hashable. The trace would fix its value, and a later call with other values "
            "could not be told apart. Pass it as a tensor (or a tuple), or let the compiled "
            "function close over it."
        ) from None
    if isinstance(a, (float, complex)) and a != a:  # NaN, as a key, equals no NaN
        return (type(a), "nan")
    if isinstance(a, float):  # -0.0 == 0.0, but 1 / -0.0 is not 1 / 0.0
        return (float, a, math.copysign(1.0, a))
    if isinstance(a, complex):
        return (complex, a, math.copysign(1.0, a.real), math.copysign(1.0, a.imag))
    return (type(a), a)


def _autocast() -> tuple:
    """The autocast state a trace holds (its ops' dtypes), on the devices that have one."""
    return tuple((d, torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def compile(func: Callable, backend: str | Callable | None = None, *,
            cache_size_limit: int = 8) -> Callable:
    """``f`` traced once per input signature (the pytree structure, each tensor's shape,
    strides, dtype, device and requires_grad, which tensor arguments are the same object,
    every other argument's value, grad mode, autocast; storage offsets too for a graph with an
    ``as_strided`` view) and replayed from the cached graph: the ops of
    ``f`` with none of the Python per op.

    A trace also holds the ``training`` flag of every module ``f`` calls: after
    ``model.eval()`` the next call traces again (dropout and batch norm take other
    branches), and ``model.train()`` brings back the first trace; so does the
    ``requires_grad`` flag of every tensor ``f`` captures (a layer frozen, then unfrozen).
    Other Python state ``f`` reads (a global, a captured number) is fixed in the trace, as
    in ``jax.jit``; pass it as an argument to have it checked. Arguments that are neither
    tensors nor hashable raise TypeError.

    At most ``cache_size_limit`` traces are kept (8, as ``torch.compile``'s limit): a
    call that would need one more runs ``f`` eagerly, with a warning the first time. A
    trace of a module that no longer exists is dropped.

    ``backend=None`` replays the ``torch.fx`` graph as is; ``backend="inductor"`` (or any
    ``torch.compile`` backend) compiles each graph with ``torch.compile``. Results equal
    eager. A new signature traces again. ``f`` must not read tensor values into Python
    (``.item()``, ``if t:``): that raises :class:`DataDependentError` at the first call,
    because replaying would silently repeat the branch taken when tracing. A size read
    in Python from a tensor whose shape depends on values (``x[x > 0].shape[0]``) is not
    detected and stays fixed in the trace too: keep such reads out of ``f`` (``x[x > 0]``
    itself replays correctly). Random ops draw fresh numbers on every replay, as eager does.

    Example::

        >>> import torch
        >>> import torchlevels
        >>> f = torchlevels.compile(torchlevels.vmap(torchlevels.grad(lambda x: x.sin().sum())))
        >>> x = torch.randn(3, 4)
        >>> torch.allclose(f(x), torch.cos(x))
        True
        >>> len(f.cache)  # a second call with the same signature replays
        1
    """
    return CompiledFunction(func, backend, cache_size_limit)
