"""Reverse and forward mode as levels: the grad level and the jvp level.

A **grad level**'s tensor wraps a tensor of the level outside it (its ``_inner``) that
carries this level's autograd graph. Its ``__torch_dispatch__`` runs each op on the inner
tensors with PyTorch's autograd switched back on, so PyTorch's own derivative formulas
record the graph; the backward pass is one ``torch.autograd.grad`` over it. The graph
lives on this level's inner tensors only, so each level has its own tape: when a
backward formula runs on the tensors of an enclosing level, that level records it in
turn, which is what makes grad(grad(f)) and vmap(grad(f)) come out right.

A **jvp level**'s tensor carries a primal and a tangent (both tensors of the level
outside). Each op makes forward-AD dual tensors of them, runs, and unpacks the result.
PyTorch allows one dual level at a time, so nested jvp levels share it: they never
confuse their tangents because each level's duals are made of different tensors.

Two traps (see DESIGN.md): an inner tensor is never ``detach``-ed — if it belongs to an
enclosing grad level, that level would record a gradient stop — so leaves and results
are made with :func:`shallow_copy`, which dispatches no op; and user ``no_grad`` is
respected because grad mode is never switched on or off behind the user's back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._decomp
import torch.autograd.forward_ad as fwAD
from torch._decomp import decompositions_for_jvp

from torchlevels import coefficients_traced, grad_shortcuts, linalg_recomputed
from torchlevels._level import (
    Level,
    LevelTensor,
    autograd_on,
    data_property,
    differentiated,
    enclosing_classes,
    entered,
    follow_inner,
    in_level_graph,
    innermost,
    mark_level_graph,
    memory_of,
    new_level_class,
    refuse_backward,
    requires_grad_flag,
    resolved,
    set_requires_grad_flag,
    through,
    tracked_outside,
    unwrap_own,
    wrap_all,
    wrap_inner,
    wraps,
)
from torchlevels._plain import PLAIN
from torchlevels._process_state import dual_level as _dual_level
from torchlevels._process_state import mha_fastpath_off, own_dual_level
from torchlevels.batching import predispatch
from torchlevels.batching.composite import call_recorded
from torchlevels.batching.registry import (
    decomposition_of,
    gradient_flags,
    is_custom_op,
    out_arguments,
    out_of_place_view,
    returns_view,
    writes_first_argument,
)
from torchlevels.batching.shortcuts import no_shortcuts
from torchlevels.inner_duals import primals, without_tangent
from torchlevels.jvp_over_vmap import pointwise_on_batches
from torchlevels.lifted import lift_written
from torchlevels.vmap import BatchLevel, wrap_batched
from torchlevels.zero_tangents import (
    NUMBER_TYPES,
    SCALAR_OVERLOADS,
    WITHOUT_ZERO_TANGENTS,
    ZERO_TANGENT_ARGUMENTS,
)

aten = torch.ops.aten

# A composite op that picks a kernel without a derivative when no argument requires grad,
# which a grad level's wrappers never do (autograd runs on their inner tensors): the
# kernel with one, for the inner tensors that do.
_DIFFERENTIABLE_KERNEL = {
    torch.ops.aten._embedding_bag_forward_only.default: torch.ops.aten._embedding_bag.default,
}

# PyTorch's own requires_grad_(), for a level's leaves: a grad level's tensors answer theirs
_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_


def shallow_copy(t: Any) -> Any:
    """``t`` as a new tensor object with no autograd history of its own, dispatching no op."""
    if isinstance(t, LevelTensor):
        return type(t)._level.rewrap(type(t), t)
    if isinstance(t, torch.Tensor):
        return t.detach()  # a plain tensor: no enclosing level can see this detach
    return t


def without_level_graph(t: Any) -> Any:
    """``t``, a result of a grad level whose graph autograd outside does not track, free of
    that graph, which nothing differentiates once the level exits (a level around would
    take it for one autograd outside tracks): a plain tensor detached, the plain tensor
    under a level's tensor marked as requiring grad for a level's graph alone."""
    if type(t) is torch.Tensor:
        return t.detach() if requires_grad_flag(t) else t
    inner = memory_of(t)
    if type(inner) is torch.Tensor and requires_grad_flag(inner) and not in_level_graph(inner):
        mark_level_graph(inner)
    return t


def _normal(t: torch.Tensor) -> torch.Tensor:
    """A tensor made under inference_mode as a normal one (a copy), which autograd and forward
    AD can use; any other tensor as it is."""
    return t.clone() if t.is_inference() else t


def _normal_arg(a: Any) -> Any:
    """An op's argument with any tensor made under inference_mode as a normal copy."""
    if isinstance(a, torch.Tensor):
        return _normal(a)
    if type(a) in (list, tuple):
        return type(a)(map(_normal_arg, a))
    return a


def _wrap(cls, inner: torch.Tensor, tangent: torch.Tensor | None = None) -> torch.Tensor:
    out = wrap_inner(cls, inner)
    out._tangent = tangent
    return out


def constant(cls, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of grad or jvp level ``cls`` that does not depend on its inputs."""
    if isinstance(cls._level, JvpLevel):
        return _wrap(cls, t)
    cls._level.captures_tracked = cls._level.captures_tracked or requires_grad_within(t)
    return wrap_inner(cls, t)


def constant_throughout(cls, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a constant of grad or jvp level ``cls`` and of each grad and jvp level
    around it that it is not a tensor of already (outermost first, so that an outer
    constant then enters an inner level)."""
    for c in reversed(autodiff_classes(cls)):
        if not isinstance(t, c):
            t = constant(c, t)
    return t


def _memory_constant(cls, memory: torch.Tensor) -> torch.Tensor:
    """A tensor level ``cls`` takes in (see lifted.py) as a constant of ``cls`` and of each
    grad and jvp level around it. A plain one, which no graph has seen (the memory of a
    buffer), joins the graph of the outermost level alone, if that is a grad level, until
    a value autograd outside tracks is written into it (see mark_level_graph)."""
    if type(memory) is torch.Tensor and isinstance(autodiff_classes(cls)[-1]._level, GradLevel):
        mark_level_graph(memory)
    return constant_throughout(cls, memory)


class GradLevel(Level):
    """One grad/vjp invocation: tracks ops on its tensors with PyTorch autograd."""

    kind = "grad"
    differentiates = True

    def __init__(self, name: str = "grad") -> None:
        super().__init__()
        self.kind = name
        self.nested_in_autodiff = False  # an enclosing grad or jvp level sees our backward
        # whether an op read a captured tensor that autograd outside tracks: then the
        # backward pass must be recorded for it too, as when an input requires grad
        self.captures_tracked = False
        self.in_backward = False  # its backward pass runs (see backward_pass)
        self.hooks = contextlib.ExitStack()  # saved-tensor hooks refused while it is live
        # how many grad levels entered with grad mode off are live inside: meanwhile
        # nothing is recorded on our graph (see paused_outside)
        self.paused = 0

    def refuse_saved_tensor_hooks(self) -> None:
        """Refuse saved-tensor hooks (``torch.utils.checkpoint``) until the level exits, as
        torch.func's grad does: their pack hook detaches the tensors the level saves, and
        when those are tensors of another level that something outside tracks (the level
        is nested in a derivative, or autograd outside tracks the inputs of a vmap's
        examples), that detach drops what it tracks, and the derivative outside comes out
        wrong. PyTorch restores the graph of a plain tensor it unpacks, not of the tensors
        inside a level's."""
        self.hooks.enter_context(_saved_tensor_hooks_refused())

    def wrap(self, cls, tensor: torch.Tensor) -> torch.Tensor:
        """``G(t)``: ``t`` as an input of this level (a fresh leaf of its graph)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{cls.__name__}(t): t must be a Tensor, got {type(tensor)}")
        if not isinstance(tensor, LevelTensor) and tensor.requires_grad:
            leaf = tensor.view_as(tensor)  # keeps its history for autograd outside
            mark_level_graph(leaf, only=False)
            return wrap_inner(cls, leaf)
        leaf = tensor.clone() if tensor.is_inference() else shallow_copy(tensor)
        _REQUIRES_GRAD_(leaf)
        if type(leaf) is torch.Tensor:
            mark_level_graph(leaf)
        return wrap_inner(cls, leaf)

    def unwrap(self, cls, tensor: Any) -> Any:
        """The tensor one level out, still carrying this level's graph."""
        tensor = resolved(tensor)  # a plain tensor the level took in (see lifted.py)
        if type(tensor) is cls:
            return tensor._inner
        if wraps(tensor, cls):
            # its ops on our tensors ran inside it: this level recorded them on the
            # tensors it wraps, so the wrapper itself has no history to differentiate
            raise NotImplementedError(
                f"{self.kind}: an output is a {type(tensor).__name__} wrapping a tensor of "
                f"{self.describe()}, so its derivative cannot be taken through that "
                f"subclass. This happens when a {type(tensor).__name__} made outside the "
                "function is used in it (a closure): pass it to the function as an input "
                "instead, or take the wrapped tensor out of it before returning.")
        return tensor

    def rewrap(self, cls, tensor: torch.Tensor) -> torch.Tensor:
        return wrap_inner(cls, tensor._inner)

    def wrap_result(self, cls, args: tuple, inner_args: list, out: Any) -> Any:
        """``out``, what a call made of ``args`` gave run on their inner tensors
        ``inner_args`` (no tensor among its keyword arguments), as tensors of level ``cls``,
        noting what the call read as :meth:`dispatch` does."""
        if not self.captures_tracked:
            self.captures_tracked = _captures_tracked(cls, args)
        _note_level_graph(out, inner_args, {})
        return wrap_all(cls, out)

    def dispatch(self, cls, func, args, kwargs):
        if self.paused and torch.is_grad_enabled():  # (see paused_outside)
            with torch.no_grad():
                return self.dispatch(cls, func, args, kwargs)
        if not self.captures_tracked:
            self.captures_tracked = _captures_tracked(cls, args) or (
                bool(kwargs) and _captures_tracked(cls, kwargs.values()))
        decomposed = _DECOMPOSED.get(func)
        if decomposed is not None and decomposed[0](cls, (*args, *kwargs.values())):
            return _decomposition_run(decomposed[1], args, kwargs)
        inner_args = [unwrap_own(a, cls) for a in args]
        inner_kwargs = {k: unwrap_own(v, cls) for k, v in kwargs.items()} if kwargs else {}
        if self.hosts_jvp and fwAD._current_level >= 0:
            # a jvp level's duals reach us as plain tensors with its tangent, which our
            # graph would save and differentiate after that level exits
            written = writes_first_argument(func)  # (an in-place op writes its first)
            with autograd_on():  # (forward AD's ops run at autograd's keys)
                level = fwAD._current_level
                inner_args = [primals(a, level, written and i == 0)
                              for i, a in enumerate(inner_args)]
                inner_kwargs = {k: primals(v, level) for k, v in inner_kwargs.items()}
        if _shapes_only(args):
            # meta copies, made by PyTorch to learn an output's shape: no derivative
            out = func(*inner_args, **inner_kwargs)
            if writes_first_argument(func) and type(args[0]) is cls:
                follow_inner(args[0])
                return args[0]
            return wrap_all(cls, out)
        inplace = writes_first_argument(func)
        if inplace and type(args[0]) is not cls:
            return lift_written(cls, func, args, kwargs, self.kind, _memory_constant)
        view = out_of_place_view(func) if inplace else None
        if view is not None and not _is_tracked_leaf(inner_args[0]):
            with autograd_on():
                out = _rebind_to_view(args[0], view, inner_args, inner_kwargs)
            _note_level_graph(out._inner, inner_args, inner_kwargs)
            return out
        # ops told which gradients to compute: the caller read requires_grad, which is
        # False for a value of ours only a level around this one tracks; that level's
        # autograd sees the op too
        for flag, i in gradient_flags(func):
            if flag < len(args) and i < len(args) and type(args[i]) is cls:
                inner_args[flag] = True
        func = _DIFFERENTIABLE_KERNEL.get(func, func)
        with autograd_on():  # autograd on again for the inner tensors, as the user set it
            try:
                out = func(*inner_args, **inner_kwargs)
            except RuntimeError as e:  # a captured tensor made under inference_mode
                if inplace or "Inference tensors cannot be saved" not in str(e) or any(
                        type(a) is cls and a._inner.is_inference() for a in args):
                    raise  # one made inside, by the user's inference_mode: as in eager
                out = func(*map(_normal_arg, inner_args),
                           **{k: _normal_arg(v) for k, v in inner_kwargs.items()})
        if inplace:
            self_ = args[0]
            follow_inner(self_)
            _note_level_graph(self_._inner, inner_args, inner_kwargs)
            return self_
        _note_level_graph(out, inner_args, inner_kwargs)
        # every output is ours, tracked or not: a later in-place op may write a tracked
        # value into it (``buf = zeros_like(x); buf[0] = x``), as in torch.func
        return wrap_all(cls, out)


def _tracked_by_level(t: torch.Tensor) -> bool:
    """``t.requires_grad`` for a grad level's tensor, as torch.func answers it: whether the
    level tracks it (it depends on the level's inputs), for code that checks it to decide
    what to compute for a backward pass (``F.linear_cross_entropy``, checkpointing)."""
    return requires_grad_flag(t) or requires_grad_flag(t._inner)


_TRACKED_BY_LEVEL = property(_tracked_by_level, set_requires_grad_flag)
_GRAD_FN = torch._C.TensorBase.grad_fn.__get__


def _level_grad_fn(t: torch.Tensor) -> Any:
    """``t.grad_fn`` for a grad level's tensor, as torch.func answers it: the node of the
    level's graph that made it (on the tensor it wraps), None for the level's inputs and
    for tensors the level does not track. While a level nested in this one is live, a
    tensor that carries its graph (the inner tensor of that level's tensor) answers with
    its own node, for PyTorch's code that reads it (``register_hook``)."""
    if type(t) is not innermost():
        own = _GRAD_FN(t)
        if own is not None:
            return own
    inner = t._inner
    return _GRAD_FN(inner) if requires_grad_flag(inner) else None


def _register_hook(t: torch.Tensor, hook: Any) -> Any:
    """``t.register_hook(hook)`` for a grad level's tensor: on the tensor it wraps, which
    carries the level's graph, so the level's backward pass calls ``hook`` with the
    gradient of ``t`` (a tensor of the levels around, as in torch.func)."""
    if not isinstance(hook, _LevelHook):
        hook = _LevelHook(type(t)._level, hook)
    inner = t._inner
    if requires_grad_flag(inner) or not isinstance(inner, LevelTensor):
        return torch.Tensor.register_hook(inner, hook)  # raises if nothing tracks it
    return inner.register_hook(hook)  # tracked, if at all, by a level around this one


class _LevelHook:
    """A hook registered on a tensor of grad level ``level``: it runs in that level's
    backward passes only, as in torch.func. The plain tensor it is registered on may be
    in the history autograd outside keeps too (``w`` requires grad in ``y = x * w``), whose
    own later pass through it must not run the hook again."""

    __slots__ = ("hook", "level")

    def __init__(self, level: Level, hook: Callable) -> None:
        self.level, self.hook = level, hook

    def __call__(self, grad: torch.Tensor) -> Any:
        return self.hook(grad) if self.level.in_backward else None


def _untracked(t: torch.Tensor) -> torch.Tensor:
    """The value of a grad level's tensor ``t`` one level out, where this level does not
    track it (the levels around it still do)."""
    inner = t._inner
    if isinstance(inner, LevelTensor):
        return type(inner)._level.rewrap(type(inner), inner)  # the same, without our graph
    return inner.detach()


def _level_data(t: torch.Tensor) -> torch.Tensor:
    """``t.data`` for a grad level's tensor, as torch.func answers it: the same value, not
    tracked by this level."""
    return wrap_inner(type(t), _untracked(t))


def _level_detach_(t: torch.Tensor) -> torch.Tensor:
    """``t.detach_()`` for a grad level's tensor: from now on this level does not track
    it, as in torch.func (PyTorch handles ``detach_`` above the dispatcher's Python key,
    so the level would never see it)."""
    t._inner = _untracked(t)
    return t


def _level_is_leaf(t: torch.Tensor) -> bool:
    """``t.is_leaf`` for a grad level's tensor, as torch.func answers it: whether no op of
    the level made it (an input, or a tensor the level does not track)."""
    return _level_grad_fn(t) is None


def _level_requires_grad_(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """``t.requires_grad_(flag)`` for a grad level's tensor: a no-op when ``flag`` is what
    ``t`` answers already, else an error (the level decides what it tracks)."""
    if bool(requires_grad) == t.requires_grad:
        return t
    if requires_grad:
        fix = ("make it an input of the function the transform differentiates (for "
               "torch.autograd.functional's jacobian, hessian, vjp or jvp, which set it on "
               "their inputs, call torchlevels' jacrev, hessian, vjp or jvp instead). "
               "nn.Parameter(t) calls it too, and would cut t from the gradient: to run a "
               "module with t as a parameter, call "
               "torch.func.functional_call(module, {name: t}, args)")
    else:
        fix = "use t.detach() for a value the level does not track"
    raise RuntimeError(
        f"requires_grad_({requires_grad}) was called on a tensor of "
        f"{type(t)._level.describe()}, which decides what it tracks: {fix}."
    )


def _refuse_retain_grad(t: torch.Tensor) -> None:
    raise RuntimeError(
        f"retain_grad() was called on a tensor of {type(t)._level.describe()}: a "
        "transform's intermediate tensors keep no gradient. To see the gradient of a "
        "tensor, register a hook on it (t.register_hook), or make it an input of the "
        "function you differentiate."
    )


_GRAD_LEVEL_TENSOR = {"requires_grad": _TRACKED_BY_LEVEL, "grad_fn": property(_level_grad_fn),
                      "data": data_property(_level_data),
                      "detach_": _level_detach_, "register_hook": _register_hook,
                      "retain_grad": _refuse_retain_grad, "backward": refuse_backward,
                      "is_leaf": property(_level_is_leaf),
                      "requires_grad_": _level_requires_grad_}


def autodiff_classes(cls: type[LevelTensor] | None) -> list[type[LevelTensor]]:
    """The grad and jvp level classes among ``cls`` and the levels around it, innermost
    first. Each differentiates a backward pass run inside it, a jvp level included:
    PyTorch's backward formulas take their differentiable form only when that pass is
    recorded (linalg.solve's reuses its LU factors otherwise, which have no tangents)."""
    return [c for c in enclosing_classes(cls) if isinstance(c._level, (GradLevel, JvpLevel))]


def requires_grad_within(t: torch.Tensor) -> bool:
    """Whether ``t``, the tensor it wraps at any level, or the tangent a jvp level gives
    one of them, requires grad for autograd outside (not only for a grad level's own
    graph)."""
    while isinstance(t, LevelTensor):
        tangent = getattr(t, "_tangent", None)
        if tangent is not None and requires_grad_within(tangent):
            return True
        t = t._inner
    return tracked_outside(t)


def _captures_tracked(cls, args: Any) -> bool:
    """Whether a tensor among ``args`` (or in a list among them) that is not of level
    ``cls`` requires grad at some level: a captured tensor autograd outside may track."""
    for a in args:
        if type(a) is cls:
            continue
        if isinstance(a, torch.Tensor):
            if requires_grad_within(a):
                return True
        elif type(a) in (list, tuple) and _captures_tracked(cls, a):
            return True
    return False


def _note_level_graph(out: Any, inner_args: list, inner_kwargs: dict) -> None:
    """Mark each plain result that requires grad with whether it does so only for this
    level's graph: when every argument that requires grad does (see mark_level_graph)."""
    if type(out) is torch.Tensor:
        tracked = (out,) if out.requires_grad else ()
    elif isinstance(out, (tuple, list)):
        tracked = [o for o in out if type(o) is torch.Tensor and o.requires_grad]
    else:  # a tensor of an enclosing level (the common case), or no tensor
        return
    if tracked:
        only = _level_graph_only(inner_args) and _level_graph_only(inner_kwargs.values())
        for o in tracked:
            mark_level_graph(o, only)


def _level_graph_only(args: Any) -> bool:
    """Whether every tensor in ``args`` (or in a list among them) that requires grad is
    plain and requires it only for a grad level's graph."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if requires_grad_flag(a) and (type(a) is not torch.Tensor or tracked_outside(a)):
                return False
        elif isinstance(a, (list, tuple)) and not _level_graph_only(a):
            return False
    return True


def _is_tracked_leaf(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and requires_grad_flag(t) and not t._is_view()
            and t.is_leaf)


def _rebind_to_view(self_: torch.Tensor, view, inner_args: list, inner_kwargs: dict) -> Any:
    """An in-place view op (``t_``, ``squeeze_``) as its view op: ``self_`` wraps the view
    from now on. Autograd rebuilds a view of a Python-dispatch tensor (the tensors of an
    enclosing level) by replaying the view ops that made it, which miss a later in-place
    view op: a write through such a view, or through a view made before it, would get
    wrong gradients. Called with autograd on."""
    inner = view(*inner_args, **inner_kwargs)
    torch.autograd.graph.increment_version(inner)  # as the in-place op: saved values are stale
    self_._inner = inner
    follow_inner(self_)
    return self_


def _real_zeros_in_backward(op, args: tuple, kwargs: dict) -> torch.Tensor:
    """A ZeroTensor that a backward formula makes (``sgn``'s) while a level is live, as
    real zeros. PyTorch's ZeroTensor kernels run above the Python key: a product of a
    ZeroTensor and a level's tensor would be a plain tensor the level never saw, with
    autograd's record of the op on the level's tensors as its history, and the level's
    tensors would escape in it (``vmap(grad(grad(f)))`` with autograd on top).

    The zeros are tensors of the levels around the one whose backward pass runs: constants
    of the grad and jvp levels, the same for every example of the vmap levels. Plain, they
    would be captured tensors to those levels, and the backward of an in-place write
    through a view writes into a copy of the gradient (``CopySlices``), which would then
    be a plain tensor written with a level's values: refused, or (for a vmap level's) an
    unbatched tensor written with batched values, where torch.func raises. A request from
    forward AD run beneath a jvp level (a forward formula's zero tangent, while a backward
    pass computes on that level's tensors) gets plain zeros."""
    if torch._C._current_autograd_node() is None:  # forward AD's zero tangents stay
        return predispatch.passed_by(op, args, kwargs)
    zeros = torch.zeros(*args, **{k: v for k, v in kwargs.items() if v is not None})
    classes = list(enclosing_classes(innermost()))
    if any(isinstance(cls._level, JvpLevel) and cls._level.running for cls in classes):
        return zeros
    for cls in reversed(classes):  # outermost first
        level = cls._level
        if isinstance(level, GradLevel) and level.in_backward:
            break  # the pass computes on the tensors of the levels outside this one
        if isinstance(level, (GradLevel, JvpLevel)):
            zeros = constant(cls, zeros)
        elif isinstance(level, BatchLevel):
            zeros = wrap_batched(cls, zeros.expand(level.batch_size, *zeros.shape), 0)
    return zeros


@contextlib.contextmanager
def backward_pass(cls) -> Iterator[None]:
    """Mark grad level ``cls`` as running its backward pass for the block."""
    level = cls._level
    before, level.in_backward = level.in_backward, True
    try:
        yield
    finally:
        level.in_backward = before


predispatch.intercept(torch.ops.aten._efficientzerotensor.default, _real_zeros_in_backward)


class JvpLevel(Level):
    """One jvp invocation: each of its tensors carries a primal and a tangent."""

    kind = "jvp"
    differentiates = True

    def __init__(self, name: str = "jvp") -> None:
        super().__init__()
        self.kind = name
        # how many jvp levels entered with forward grad off are live inside: meanwhile
        # our ops give no tangents (see paused_outside)
        self.paused = 0
        # how many of its ops run forward AD beneath it now (see _real_zeros_in_backward)
        self.running = 0

    def wrap(self, cls, primal: torch.Tensor, tangent: torch.Tensor) -> torch.Tensor:
        """``J(primal, tangent)``: a tensor of this level."""
        _check_dual(cls, primal, tangent)
        primal = _normal(primal)
        return _wrap(cls, primal, _lift_tangent(_normal(tangent), primal))

    def unwrap(self, cls, tensor: Any) -> tuple[Any, Any]:
        """(primal, tangent) one level out; a constant has a zero tangent."""
        tensor = resolved(tensor)  # a plain tensor the level took in (see lifted.py)
        if type(tensor) is cls:
            tangent = tensor._tangent
            return tensor._inner, torch.zeros_like(tensor._inner) if tangent is None else tangent
        if wraps(tensor, cls):  # its ops on ours ran inside it
            return (through(tensor, lambda t: self.unwrap(cls, t)[0]),
                    through(tensor, lambda t: self.unwrap(cls, t)[1]))
        return tensor, torch.zeros_like(tensor)

    def rewrap(self, cls, tensor: torch.Tensor) -> torch.Tensor:
        return _wrap(cls, tensor._inner, tensor._tangent)

    def dispatch(self, cls, func, args, kwargs):
        if self.paused and torch._C._is_fwd_grad_enabled():  # (see paused_outside)
            with fwAD._set_fwd_grad_enabled(False):
                return self.dispatch(cls, func, args, kwargs)
        inplace = writes_first_argument(func)
        if inplace and type(args[0]) is not cls:
            return lift_written(cls, func, args, kwargs, self.kind, _memory_constant)
        if inplace:
            args = _reads_of_the_written_cloned(args)
        if kwargs and func in coefficients_traced.SCALED:  # (PyTorch crashes tracing them)
            out = coefficients_traced.unscaled(func, args, kwargs)
            if out is not NotImplemented:
                return out
        view = out_of_place_view(func) if inplace else None
        if view is not None:
            return _jvp_inplace_view(cls, view, args, kwargs)
        if func in _DECOMPOSED_UNDER_AUTOGRAD and _tracked_by_autograd(cls, args):
            out = _decomposition_run(_DECOMPOSED_UNDER_AUTOGRAD[func], args, kwargs)
            if out is not NotImplemented:
                return out
        recomputed = _DIFFERENTIABLE_FORWARD.get(func)
        if recomputed is not None and _differentiated_outside(cls, args):
            out = _decomposition_run(functools.partial(recomputed, cls), args, kwargs)
            if out is not NotImplemented:
                return out
        if _shapes_only(args):
            # PyTorch runs an op on meta copies to learn an output's shape (adding a
            # ZeroTensor tangent): the primal alone, with no derivative of any kind
            out = func(*[unwrap_own(a, cls) for a in args], **kwargs)
            return _from_dual(cls, out, -1)
        level = fwAD._current_level
        if level < 0:  # a jvp level outlived the forward-AD level it entered
            with _dual_level():
                return self.dispatch(cls, func, args, kwargs)
        try:
            return self._on_duals(cls, func, args, kwargs, inplace, level)
        except NotImplementedError as e:
            # PyTorch has no forward-AD formula for some ops (multi_margin_loss, CPU flash
            # attention): their decomposition's pieces have (torch.func raises here). An
            # out= op has none by design: PyTorch's error says so
            decomposition = (None if inplace or out_arguments(func)
                             or "Trying to use forward AD with" not in str(e)
                             else decomposition_of(func))
            if decomposition is None:
                raise
            return decomposition(*args, **kwargs)

    def _on_duals(self, cls, func, args, kwargs, inplace: bool, level: int):
        """``func`` run on forward AD's dual tensors of ``args``."""
        self.running += 1
        try:
            return self._run_on_duals(cls, func, args, kwargs, inplace, level)
        finally:
            self.running -= 1

    def _run_on_duals(self, cls, func, args, kwargs, inplace: bool, level: int):
        nested = self.hosts_jvp
        if not (nested or inplace):
            pair = pointwise_on_batches(cls, func, args, kwargs, level)
            if pair is not None:
                return _wrap(cls, *pair)
        if func in _PRODUCTS and not nested:
            out = _product_of_one_tangent(cls, func, args, kwargs)
            if out is not None:
                return out
        with autograd_on():
            dual_args = [_to_dual(a, cls, level, nested) for a in args]
            dual_kwargs = {k: _to_dual(v, cls, level, nested) for k, v in kwargs.items()}
            if func in WITHOUT_ZERO_TANGENTS and not nested:
                func = _without_zero_tangents(cls, func, args, dual_args, level)
            # (a view is made as autograd's view, which a later in-place op recorded needs)
            if inplace or returns_view(func) or _recorded_outside(cls, args, dual_args,
                                                                   dual_kwargs):
                out = call_recorded(func, dual_args, dual_kwargs)
            else:  # forward AD alone (which grad mode off leaves on)
                enabled = torch.is_grad_enabled()
                _set_grad_enabled(False)  # (not torch.no_grad(): its object costs ~1 us)
                try:
                    out = call_recorded(func, dual_args, dual_kwargs)
                finally:
                    _set_grad_enabled(enabled)
            if is_custom_op(func):
                _refuse_custom_op(cls, func, args, dual_args[0] if inplace else out, level)
            if inplace:
                return _update_inplace(args[0], *_written(args[0], dual_args[0], level))
            out = _from_dual(cls, out, level)
        if (returns_view(func) and type(args[0]) is cls and isinstance(out, torch.Tensor)
                and out._tangent is None and _view_tangent(args[0]) is None):
            # a view of a tensor with no tangent yet (not a non-differentiable view of one
            # with a tangent, like detach)
            out._view_of = (args[0], [(func, args[1:], kwargs)])
        return out


def _without_zero_tangents(cls, func, args: tuple, dual_args: list, level: int) -> Any:
    """``func``, or its Scalar overload, to run on ``dual_args``, where a tensor without a
    tangent may get an explicit zero one, so that forward AD makes no ZeroTensor for it
    (see ``ZERO_TANGENT_ARGUMENTS``)."""
    has = [type(a) is cls and _view_tangent(a) is not None for a in args]
    if not any(has):
        return func
    if has[0] and len(args) > 1 and type(args[1]) in NUMBER_TYPES:
        return SCALAR_OVERLOADS.get(func, func)
    positions = ZERO_TANGENT_ARGUMENTS.get(func, ())
    for k in positions(args) if callable(positions) else positions:
        if k < len(args) and not has[k] and isinstance(args[k], torch.Tensor) and (
                args[k].is_floating_point() or args[k].is_complex()) and (
                not _has_internal_overlap(dual_args[k])):  # (make_dual refuses those)
            dual_args[k] = _make_dual(dual_args[k], torch.zeros_like(dual_args[k]),
                                      level=level)
    return func


def _product(term: Callable | None = None, strong_zero: bool = False) -> Callable:
    """The tangent of a product whose operand ``k`` has tangent ``t`` and operand ``other``
    none, by PyTorch's formula (mm's: ``self_t.mm(mat2_p) + self_p.mm(mat2_t)``): ``term``
    (the op itself by default) with ``t`` for operand ``k``, plus ``term`` with zeros for
    operand ``other``, whose tangent forward AD makes a ZeroTensor. A matrix product
    multiplies that out (inf * 0 is nan there, as in torch.func); mul's result is a
    ZeroTensor itself (``strong_zero``), which adds nothing, and so is div's by a
    denominator without a tangent (its formula: ``(self_t - other_t * result) / other_p``)."""
    term = term or _same_op

    def tangent(func, args: list, k: int, other: int | None, t: torch.Tensor, kwargs: dict
                ) -> torch.Tensor:
        if strong_zero:  # (mul's formula: other_t * self_p + self_t * other_p)
            return func(t, args[0]) if k == 1 else func(t, args[1])
        with_tangent = list(args)
        with_tangent[k] = t
        out = term(func, with_tangent, kwargs)
        with_zero = list(args)
        with_zero[other] = torch.zeros_like(args[other])
        return out + term(func, with_zero, kwargs)

    return tangent


def _same_op(func, args: list, kwargs: dict) -> torch.Tensor:
    return func(*args, **kwargs)


def _scaled(product: Callable) -> Callable:
    """The product term of ``addmm``-like ``func(self, a, b, *, beta, alpha)``: ``alpha``
    times ``product(a, b)``, as PyTorch's formula scales it (``maybe_multiply``)."""

    def term(func, args: list, kwargs: dict) -> torch.Tensor:
        out = product(args[1], args[2])
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        return out if alpha == 1 else out * alpha

    return term


def _convolution_tangent(func, args: list, k: int, other: int | None, t: torch.Tensor,
                         kwargs: dict) -> torch.Tensor:
    """PyTorch's ``convolution_jvp``: ``conv(x_t, w, None) + conv(x, w_t, bias_t)``, the
    missing tangents as zeros (a captured bias's is a ZeroTensor, multiplied out too)."""
    x, w, bias, *rest = args
    zero_bias = None if bias is None else torch.zeros_like(bias)
    if k == 0:
        return func(t, w, None, *rest) + func(x, torch.zeros_like(w), zero_bias, *rest)
    return func(torch.zeros_like(x), w, None, *rest) + func(x, t, zero_bias, *rest)


# Products, linear in each operand, whose formula gives an operand without a tangent a
# ZeroTensor one, which PyTorch handles slowly: measured, 45 us an mm, 140 under an
# enclosing vmap, and 700 a mul there (torch.func: 300). op -> (its operands, the
# tangent given the primals and operand k's tangent).
_PRODUCTS = {
    aten.mul.Tensor: ((0, 1), _product(strong_zero=True)),
    aten.div.Tensor: ((0,), _product(strong_zero=True)),  # (the numerator's tangent only)
    aten.mm.default: ((0, 1), _product()),
    aten.bmm.default: ((0, 1), _product()),
    aten.mv.default: ((0, 1), _product()),
    aten.addmm.default: ((1, 2), _product(_scaled(torch.mm))),
    aten.addmv.default: ((1, 2), _product(_scaled(torch.mv))),
    aten.baddbmm.default: ((1, 2), _product(_scaled(torch.bmm))),
    aten.convolution.default: ((0, 1), _convolution_tangent),
}


def _product_of_one_tangent(cls, func, args: tuple, kwargs: dict) -> Any:
    """A product (see ``_PRODUCTS``) of jvp level ``cls`` whose one operand has a tangent
    and no other argument has: primal and tangent computed apart, by PyTorch's formula,
    less its ZeroTensors (no value changes). None if the op is otherwise."""
    operands, tangent_of = _PRODUCTS[func]
    tangent_at = None
    for k, a in enumerate(args):
        if type(a) is cls and _view_tangent(a) is not None:
            if tangent_at is not None or k not in operands:
                return None
            tangent_at = k
        elif k in operands and not isinstance(a, torch.Tensor):
            return None  # a number: the usual way (its Scalar overload)
    if tangent_at is None or any(type(v) is cls for v in kwargs.values()):
        return None
    primals = [unwrap_own(a, cls) for a in args]
    recorded = _recorded_outside(cls, args, primals, {})
    with autograd_on():
        enabled = torch.is_grad_enabled()
        _set_grad_enabled(enabled and recorded)
        try:
            out = func(*primals, **kwargs)
            other = next((k for k in operands if k != tangent_at), None)
            tangent = tangent_of(func, primals, tangent_at, other, args[tangent_at]._tangent,
                                 kwargs)
        finally:
            _set_grad_enabled(enabled)
    return _wrap(cls, out, tangent)


def _reads_of_the_written_cloned(args: tuple) -> tuple:
    """``args`` of an in-place op of a jvp level, where another argument that holds
    exactly the memory the op writes (``y.detach()`` in ``y.mul_(y.detach())``) is cloned:
    it reads the same values. Forward AD's formulas of such ops (mul_, div_, addcmul_,
    atan2_) read that argument after the write, a wrong tangent (torch.func's too)."""
    written = memory_of(args[0])
    for i in range(1, len(args)):
        a = args[i]
        if isinstance(a, torch.Tensor) and a is not args[0] and memory_of(a).is_set_to(written):
            args = (*args[:i], a.clone(), *args[i + 1:])
    return args


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` may share memory (an expanded tensor), as PyTorch tells."""
    return torch._debug_has_internal_overlap(t) != 0


def _recorded_outside(cls, args: tuple, dual_args: list, dual_kwargs: dict) -> bool:
    """Whether autograd must record an op of jvp level ``cls`` run on its duals: a dual or
    another argument, or the tangent of one of ours, requires grad for autograd outside
    or a level outside. A plain tensor that requires grad only for the graph of a grad
    level inside this one (its leaf, ``grad(lambda x: w * x)(x0)`` under ``jvp`` over
    ``w``) does not count: that level recorded the op on our tensors at its own dispatch,
    and a record here would be a second graph, left on the results the transforms return."""
    tangents = [t._tangent for a in args for t in (a if type(a) in (list, tuple) else (a,))
                if type(t) is cls and t._tangent is not None]  # (cat's tensors in a list)
    return any(map(_differentiated_beyond_inner_levels, (*dual_args, *dual_kwargs.values(),
                                                         *tangents)))


def _differentiated_beyond_inner_levels(a: Any) -> bool:
    """Whether argument ``a`` (a tensor or a list of them) is a tensor of a grad or jvp
    level, or wraps a plain one that requires grad other than for a grad level's graph."""
    if type(a) in (list, tuple):
        return any(map(_differentiated_beyond_inner_levels, a))
    while isinstance(a, LevelTensor):
        if a._level.differentiates:
            return True
        a = a._inner
    return isinstance(a, torch.Tensor) and requires_grad_flag(a) and tracked_outside(a)


def _check_dual(cls, primal: Any, tangent: Any) -> None:
    """``J(primal, tangent)`` takes two tensors of the same shape, floating-point or complex:
    make_dual's errors, naming the argument (PyTorch's own are a bare AttributeError, an
    internal assert at the first op, or none)."""
    for what, t in (("primal", primal), ("tangent", tangent)):
        if not isinstance(t, torch.Tensor):
            fix = " (torch.zeros_like(primal) for a zero one)" if what == "tangent" else ""
            raise TypeError(f"{cls.__name__}(primal, tangent): {what} must be a Tensor{fix}, "
                            f"got {type(t).__name__}")
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"{cls.__name__}(primal, tangent): Expected {what} to be floating "
                             f"point or complex, but got: {t.dtype}")
    if primal.shape != tangent.shape:
        raise RuntimeError(f"{cls.__name__}(primal, tangent): the tangent has shape "
                           f"{tuple(tangent.shape)} and the primal {tuple(primal.shape)}: they "
                           "must be the same")


def _refuse_custom_op(cls, func, args, out: Any, level: int) -> None:
    """PyTorch gives a ``torch.library.custom_op`` no forward-mode derivative: its outputs
    come back from forward AD with no tangent, a silent zero. Refuse that when a tangent
    went in and a floating-point output (or written argument) came out."""
    if not any(type(a) is cls and a._tangent is not None for a in args):
        return
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
           and _unpack_dual(o, level=level)[1] is None for o in outs):
        if func.namespace == "prims":  # PyTorch defines prims as custom ops too
            raise NotImplementedError(
                f"jvp: PyTorch gives prims such as {func} no forward-mode derivative, so "
                "jvp would silently treat it as a constant. Call the aten op it implements "
                "(a prim reached through one of torchlevels' decompositions is a bug in "
                "torchlevels: please report it)."
            )
        raise NotImplementedError(
            f"jvp: {func} is a torch.library custom op, and PyTorch gives custom ops no "
            "forward-mode derivative (register_autograd defines only the backward), so "
            "jvp, jacfwd and hessian would silently treat it as a constant. Differentiate "
            "through it in reverse mode (grad, vjp, jacrev), or write it as a "
            "torch.autograd.Function with a jvp staticmethod."
        )


def _written(self_: torch.Tensor, dual: torch.Tensor, level: int) -> tuple:
    """(primal, tangent) of ``self_`` after an in-place op run on its dual. A dual made by
    make_dual is a view, so the inner tensor itself holds the new value and keeps its
    history. With no tangent before, the inner tensor itself was passed and forward AD
    set one on it: the primal is then a view of it without it, made differentiable even
    under no_grad (which the op's history through the inner tensor must survive)."""
    if dual is not self_._inner:
        return self_._inner, _unpack_dual(dual, level=level)[1]
    with torch.enable_grad():
        return _unpack_dual(dual, level=level)


def _levels(t: Any) -> set[type]:
    """The level classes ``t`` is a tensor of (its wrappers, one inside the other)."""
    found = set()
    while isinstance(t, LevelTensor):
        found.add(type(t))
        t = t._inner
    return found


def _lift_tangent(tangent: torch.Tensor, primal: torch.Tensor) -> torch.Tensor:
    """``tangent`` as a tensor of every level ``primal`` is a tensor of, as torch.func's
    make_dual does: a tangent that vmap does not batch (or a grad level does not see) while
    its primal is batched (seen) cannot take the new tangent of an in-place op on the
    primal, which PyTorch's forward AD writes into the old one. A tangent laid out unlike
    its primal is copied into the primal's layout once, here (see :func:`_same_layout`)."""
    if _levels(primal) <= _levels(tangent) and _same_layout(tangent, primal):
        return tangent
    lifted = _new_zeros_with_same_feature_meta(tangent, primal)
    if not _levels(primal) <= _levels(lifted):  # vmap's rule for it batches at one level:
        lifted = lifted + torch.zeros_like(primal)  # nested vmaps take every level's zeros
    return lifted.copy_(tangent)


def _same_layout(tangent: torch.Tensor, primal: torch.Tensor) -> bool:
    """Whether ``tangent`` is laid out as ``primal`` is (PyTorch's ``has_same_meta``), so
    that forward AD's ``make_dual`` takes it as it is. It copies one laid out otherwise, at
    each op: the copy a view took would not see a later write into its base's tangent."""
    if (tangent.shape != primal.shape or tangent.is_conj() != primal.is_conj()
            or tangent.is_neg() != primal.is_neg() or tangent.layout != primal.layout):
        return False
    if primal.layout is not torch.strided:  # sparse: no strides to compare
        return True
    if primal.numel() and (tangent.stride() != primal.stride()
                           or tangent.storage_offset() != primal.storage_offset()):
        return False
    if type(primal) is torch.Tensor and type(tangent) is torch.Tensor:
        # storage sizes in elements: make_dual keeps a tangent of another floating dtype
        return (primal.untyped_storage().nbytes() * tangent.element_size()
                == tangent.untyped_storage().nbytes() * primal.element_size())
    return True


def _jvp_inplace_view(cls, view, args, kwargs) -> torch.Tensor:
    """An in-place view op (``t_``, ``squeeze_``) as its view op on the primal and on the
    tangent (see :func:`_rebind_to_view`): forward AD's own handling of a write through a
    view that was transposed in place reads the base's tangent untransposed. A view still
    waiting for its base's tangent will view it through this op too."""
    self_ = args[0]
    rest = [unwrap_own(a, cls) for a in args[1:]]
    tangent = _view_tangent(self_)
    with autograd_on():
        _rebind_to_view(self_, view, [self_._inner, *rest], kwargs)
        if tangent is not None:
            self_._tangent = view(tangent, *rest, **kwargs)
        elif hasattr(self_, "_view_of"):
            self_._view_of[1].append((view, rest, kwargs))
    return self_


def _jvp_data(t: torch.Tensor) -> torch.Tensor:
    """``t.data`` for a jvp level's tensor, as torch.func answers it: its primal, with no
    tangent at this level."""
    return _wrap(type(t), t._inner)


def _jvp_detach_(t: torch.Tensor) -> torch.Tensor:
    """``t.detach_()`` for a jvp level's tensor: it drops its tangent, as in torch.func
    (PyTorch handles ``detach_`` above the dispatcher's Python key)."""
    t._tangent = None
    t.__dict__.pop("_view_of", None)  # nor will it take one through its base
    return t


_JVP_LEVEL_TENSOR = {"data": data_property(_jvp_data), "detach_": _jvp_detach_,
                     "backward": refuse_backward}


def _view_tangent(t: torch.Tensor) -> Any:
    """``t``'s tangent. A view made while its base had none gets a view of the base's
    tangent once the base has one (written through another view)."""
    if t._tangent is None and hasattr(t, "_view_of"):
        base, ops = t._view_of
        tangent = _view_tangent(base)
        if tangent is not None:
            for func, rest, kwargs in ops:
                tangent = func(tangent, *rest, **kwargs)
            t._tangent = tangent
            del t._view_of
    return t._tangent


def _base_tangent(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``'s tangent, zeros (batched as ``like`` is) if it has none, made through its
    base if it is a view, so that it stays a view of the base's tangent. New zeros are laid
    out as the primal is (strides, offset, storage), as forward AD's own are: a later
    ``as_strided`` of the primal's layout must read the same elements of the tangent."""
    if _view_tangent(t) is None:
        if hasattr(t, "_view_of"):
            _base_tangent(t._view_of[0], like)
            _view_tangent(t)  # now a view of the base's
        else:
            t._tangent = _new_zeros_with_same_feature_meta(like, t._inner)
    return t._tangent


def _update_inplace(self_: torch.Tensor, primal: torch.Tensor, tangent: Any) -> torch.Tensor:
    """After an in-place op on ``self_``: its new tangent is written into its old one (made
    zeros if it had none), which may be a view of a base's tangent or have views: a write
    through a view (``out.narrow(...).copy_(x)``) reaches the base and the other views."""
    self_._inner = primal
    if tangent is None:
        self_._tangent = None  # e.g. zero_(): the value no longer depends on the input
        follow_inner(self_)
        return self_
    old = _base_tangent(self_, tangent)
    if old.shape == tangent.shape and old.dtype == tangent.dtype:
        if old is not tangent:
            old.copy_(tangent)
    else:  # an in-place op that changed the shape (squeeze_, t_)
        self_._tangent = tangent
    follow_inner(self_)
    return self_


# PyTorch's own ops under forward_ad.make_dual / unpack_dual, without those functions'
# per-call checks and export hooks (levels call them on every op); make_dual's one-time
# loading of forward AD's decompositions is done here instead
_make_dual, _unpack_dual = torch._VF._make_dual, torch._VF._unpack_dual
_set_grad_enabled = torch._C._set_grad_enabled
_new_zeros_with_same_feature_meta = torch.ops.aten._new_zeros_with_same_feature_meta.default
fwAD._maybe_load_decompositions()


def _to_dual(a: Any, cls, level: int, nested: bool = False) -> Any:
    """Argument ``a`` of an op at jvp level ``cls`` as forward AD's dual tensor, if it is
    ours; with ``nested`` (a jvp level was entered inside ``cls``), any other tensor
    without the tangent such a level gave it (see
    :func:`torchlevels.inner_duals.without_tangent`)."""
    if type(a) is cls:
        if _view_tangent(a) is None:
            return a._inner
        dual = a.__dict__.get("_dual")  # (primal, tangent, dual, forward-AD level id)
        if (dual is not None and not nested and dual[0] is a._inner
                and dual[1] is a._tangent and dual[3] == own_dual_level() is not None):
            return dual[2]
        return _make_dual(a._inner, a._tangent, level=level)
    if type(a) in (list, tuple):
        return type(a)(_to_dual(t, cls, level, nested) for t in a)
    if nested and isinstance(a, torch.Tensor):
        return without_tangent(a, level)
    return a


# Ops whose forward-AD formula plain autograd cannot differentiate again (softmax's writes
# a saved exp in place: PyTorch's own fwAD then backward raises). Where autograd outside
# tracks an argument, they run as their decompositions, whose pieces it can. Of the vector
# norms only the 1-norm: the others' formulas differentiate again, and stay finite where
# the decomposition's power of a 0 is not (a negative order).
_VECTOR_NORM_PIECES = torch._decomp.decomposition_table[torch.ops.aten.linalg_vector_norm.default]
_DECOMPOSED_UNDER_AUTOGRAD = {
    **{op: torch._decomp.decomposition_table[op]
       for op in (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default,
                  torch.ops.aten._safe_softmax.default, torch.ops.aten.logsumexp.default,
                  torch.ops.aten._softmax_backward_data.default,
                  torch.ops.aten._log_softmax_backward_data.default)},
    torch.ops.aten.linalg_vector_norm.default: lambda x, ord=2, *rest, **kwargs: (
        _VECTOR_NORM_PIECES(x, ord, *rest, **kwargs) if ord == 1 else NotImplemented),
    # composite ops that reach a level whole (from a decomposition's Python code)
    **{op: op.decompose for op in (torch.ops.aten.softmax.int, torch.ops.aten.log_softmax.int)},
}


def _decomposition_run(decomposition: Callable, args: tuple, kwargs: dict) -> Any:
    """``decomposition(*args, **kwargs)``, run inside a level's ``__torch_dispatch__``.
    Its pieces on plain tensors alone reach no level (``A.triu()`` of a captured matrix),
    so where autograd tracks a plain argument it records them here, or the result would
    lose the graph to it (as vmap runs a decomposition)."""
    if any(type(a) in PLAIN and tracked_outside(a) for a in (*args, *kwargs.values())):
        with autograd_on():
            return decomposition(*args, **kwargs)
    return decomposition(*args, **kwargs)


def _on_our_tensors(cls, args: tuple) -> bool:
    """Whether an argument is a tensor of grad level ``cls``."""
    return any(type(a) is cls for a in args)


def _mask_on_our_tensors(cls, args: tuple) -> bool:
    """Whether an attention op's mask (its one tensor argument after query, key and
    value) is a tensor of grad level ``cls``."""
    return _on_our_tensors(cls, args[3:])


def _differentiated_by(levels: int) -> Callable[[type, tuple], bool]:
    """The condition that at least ``levels`` levels may differentiate an op, as a
    function of the grad level class and the op's arguments (see
    :func:`_differentiations`)."""
    return lambda cls, args: _differentiations(cls, args) >= levels


def _differentiations(cls, args: tuple) -> int:
    """How many levels, autograd outside counting as one, may differentiate an op run on
    ``args`` at grad level ``cls`` (the most over the arguments): this level where it
    tracks an argument, a level inside that records the op on this level's tensors (a
    grad shortcut runs a whole call on them), and the levels outside."""
    most = 0
    for a in args:
        if type(a) is cls:
            t = a._inner
            count = requires_grad_flag(t) + requires_grad_flag(a)
            while isinstance(t, LevelTensor):
                count += t._level.differentiates
                t = t._inner
            # not requires_grad: a level's own graph sets it on the tensors it tracks
            most = max(most, count + (isinstance(t, torch.Tensor) and tracked_outside(t)))
    return most


# Ops a grad level runs as decompositions whose derivatives are right, where their own
# derivatives, differentiated again, come out wrong or raise: op -> (when, on the level
# class and the op's arguments, keyword arguments' values last; the decomposition).
# - Norms' backward ops, on a tensor of the level: their own derivatives (PyTorch's
#   batchnorm_double_backward and the like) write temporaries in place, which a vmap
#   inside may not batch, and read the saved mean and invstd, which carry no derivative:
#   a third derivative comes out wrong, in PyTorch too (pytorch/pytorch#175754, #186256).
#   The decompositions are out of place and recompute the statistics from the input.
# - Group norm, differentiated by two levels: its derivative, differentiated (PyTorch's
#   infinitely_differentiable_native_group_norm_backward), adds the part through the mean
#   and rstd in place into the part through the output: a vmap inside the outer derivative
#   that batches only the former may not write it. Its decomposition is out of place.
# - triangular_solve, differentiated by two levels: its derivative, differentiated by
#   forward mode, reads the whole matrix where the op reads its triangle (see
#   linalg_recomputed.py).
# - det, differentiated by three levels: its derivative, differentiated twice, is wrong
#   (from PyTorch's formula for singular matrices, which it uses for every tensor
#   subclass, and the LU factors it saved). Not from two levels: the LU factorization's
#   second derivative at an exactly singular matrix is wrong, PyTorch's right.
# - CPU flash attention with an attention mask of the level: it has no derivative for the
#   mask. Eager PyTorch (and torch.func) pick the math kernel when the mask requires grad,
#   which ours does not show outside the level.
_DECOMPOSED = {
    torch.ops.aten.native_batch_norm_backward.default:
        (_on_our_tensors, decompositions_for_jvp.native_batch_norm_backward),
    torch.ops.aten.batch_norm_backward.default:
        (_on_our_tensors, decompositions_for_jvp.batch_norm_backward),
    torch.ops.aten.native_layer_norm_backward.default:
        (_on_our_tensors, decompositions_for_jvp.native_layer_norm_backward),
    torch.ops.aten.native_group_norm.default: (
        _differentiated_by(2),
        torch._decomp.decomposition_table[torch.ops.aten.native_group_norm.default]),
    torch.ops.aten.triangular_solve.default:
        (_differentiated_by(2), linalg_recomputed.triangular_solve),
    torch.ops.aten._linalg_det.default: (_differentiated_by(3), linalg_recomputed.det),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: (
        _mask_on_our_tensors,
        torch._decomp.decomposition_table[
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default]),
}


def _layer_norm_recomputed(cls, *args, **kwargs):
    """native_layer_norm as its decomposition (see :func:`_batch_norm_recomputed`)."""
    out, mean, rstd = torch._decomp.decomposition_table[
        torch.ops.aten.native_layer_norm.default](*args, **kwargs)
    return out, mean.detach(), rstd.detach()


def _batch_norm_recomputed(cls, x, weight, bias, running_mean, running_var, training,
                           momentum, eps):
    """native_batch_norm in training mode as its decomposition, whose output's tangent
    is computed by differentiable ops from the input, statistics included. The statistics
    it returns are detached, as the op declares them not differentiable. The running
    statistics, which the decomposition would write with values carrying a tangent, are
    updated by the op itself run on the primals. Eval mode's statistics are constants:
    NotImplemented."""
    if not training:
        return NotImplemented
    if running_mean is not None or running_var is not None:
        torch.ops.aten.native_batch_norm.default(
            *(unwrap_own(a, cls) for a in (x, weight, bias, running_mean, running_var)),
            training, momentum, eps)
    out, mean, invstd = torch._decomp.decomposition_table[
        torch.ops.aten.native_batch_norm.default](x, weight, bias, None, None, training,
                                                  momentum, eps)
    return out, mean.detach(), invstd.detach()


def _batch_norm_with_update_recomputed(cls, x, weight, bias, running_mean, running_var,
                                       momentum, eps):
    """_batch_norm_with_update (training mode) as :func:`_batch_norm_recomputed` does it,
    with the op's reserve output."""
    *_, reserve = torch.ops.aten._batch_norm_with_update.default(
        *(unwrap_own(a, cls) for a in (x, weight, bias, running_mean, running_var)),
        momentum, eps)
    return (*_batch_norm_recomputed(cls, x, weight, bias, None, None, True, momentum, eps),
            reserve)


def _logcumsumexp_recomputed(cls, x, dim):
    """logcumsumexp, its tangent by PyTorch's formula run out of place. The formula writes
    the exponentials it computed in place when primal and tangent are plain tensors, as a
    jvp level's are, and autograd outside saved them: differentiating the tangent then
    raises, in PyTorch too (torch.func's wrappers take the formula's out-of-place branch)."""
    if type(x) is not cls:
        return NotImplemented
    primal, tangent = x._inner, _view_tangent(x)
    with autograd_on():
        out = torch.logcumsumexp(primal, dim)
        if tangent is None:
            return _wrap(cls, out)
        exp = primal.exp() if primal.is_complex() else (
            primal - torch.max(primal, dim, keepdim=True).values).exp()
        return _wrap(cls, out, (exp * tangent).cumsum(dim) / (exp.cumsum(dim) + 1e-13))


def _ignoring_level(decomposition):
    """``decomposition`` called as :data:`_DIFFERENTIABLE_FORWARD`'s entries are, with the
    level class first."""
    return lambda cls, *args, **kwargs: decomposition(*args, **kwargs)


# Ops whose forward-AD formulas give a tangent that cannot be differentiated right. Norms'
# read the saved mean and invstd, which carry no derivative of their own: a derivative
# taken of the tangent (jacfwd(jacfwd), jacrev(jacfwd)) misses how they depend on the
# input, in PyTorch too (pytorch/pytorch#196699, #196700). Linalg ops' solve with LU
# factors saved as constants and the like (linalg_recomputed.py); glu's runs glu_jvp, an
# op with no derivative; logcumsumexp's writes what autograd saved in place. Where a
# level or autograd outside differentiates an argument,
# they run as decompositions whose tangents can be: op -> fn(level class, *args,
# **kwargs), which gives NotImplemented where the op's own formula is right.
_DIFFERENTIABLE_FORWARD = {
    torch.ops.aten.native_layer_norm.default: _layer_norm_recomputed,
    torch.ops.aten.native_batch_norm.default: _batch_norm_recomputed,
    torch.ops.aten._native_batch_norm_legit.default: _batch_norm_recomputed,
    torch.ops.aten._native_batch_norm_legit.no_stats:
        lambda cls, x, weight, bias, training, momentum, eps: _batch_norm_recomputed(
            cls, x, weight, bias, None, None, training, momentum, eps),
    torch.ops.aten._batch_norm_with_update.default: _batch_norm_with_update_recomputed,
    torch.ops.aten.logcumsumexp.default: _logcumsumexp_recomputed,
    **{op: _ignoring_level(decomposition) for op, decomposition in (
        *linalg_recomputed.RECOMPUTED.items(),
        (torch.ops.aten.glu.default, torch._decomp.decomposition_table[torch.ops.aten.glu.default]),
    )},
}


def _differentiated_outside(cls, args: tuple) -> bool:
    """Whether a level or autograd outside jvp level ``cls`` may differentiate an
    argument: the primal or tangent of one of ours, or another tensor (a captured matrix
    that autograd tracks, which the tangent's formula reads)."""
    return any(differentiated(a._inner, a._tangent) if type(a) is cls else
               isinstance(a, torch.Tensor) and differentiated(a) for a in args)


def _tracked_by_autograd(cls, args: tuple) -> bool:
    """Whether autograd outside tracks an argument's primal or tangent."""
    for a in args:
        if type(a) is cls:
            if requires_grad_within(a._inner) or (
                    a._tangent is not None and requires_grad_within(a._tangent)):
                return True
        elif isinstance(a, torch.Tensor) and requires_grad_within(a):
            return True
    return False


def _shapes_only(args: tuple) -> bool:
    """Whether the op's first tensor argument is a meta tensor."""
    for a in args:  # (every op of a grad level asks: no generator)
        if isinstance(a, torch.Tensor):
            return a.is_meta
    return False


def _from_dual(cls, out: Any, level: int) -> Any:
    """The op's outputs as tensors of jvp level ``cls`` (a level of -1: no tangents)."""
    if isinstance(out, torch.Tensor):
        if level < 0:
            return _wrap(cls, out)
        primal, tangent = _unpack_dual(out, level=level)
        if tangent is not None and tangent._is_zerotensor():
            # a known zero (sgn's derivative) as no tangent: an in-place op writing a
            # tangent batched by an enclosing vmap into it makes one batched as that is
            tangent = None
        wrapped = _wrap(cls, primal, tangent)  # every output is ours (as in GradLevel)
        level_id = own_dual_level()
        if tangent is not None and level_id is not None:
            # the dual itself, for the next op on this tensor: one made anew checks its
            # layout, three more trips through each enclosing vmap level (see _to_dual)
            wrapped._dual = (primal, tangent, out, level_id)
        return wrapped
    if isinstance(out, (tuple, list)):
        return type(out)(_from_dual(cls, o, level) for o in out)
    return out


def inference_mode_off() -> contextlib.AbstractContextManager:
    """Inference mode off for a level's block, as torch.func's transforms differentiate
    inside it; nothing otherwise (``inference_mode(False)`` also turns grad mode on)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else _NOTHING


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def grad_level(name: str = "grad") -> Iterator[type[LevelTensor]]:
    """Enter a fresh grad level; yields its class ``G``.

    ``G(x)`` makes ``x`` an input of the level; ``G.unwrap(y)`` gives ``y`` one level out,
    carrying the level's autograd graph (differentiate it with ``torch.autograd.grad``
    against ``G.unwrap(x)``).

    Example::

        >>> import torch
        >>> from torchlevels.autodiff import grad_level
        >>> with grad_level() as G:
        ...     x = G(torch.tensor(3.0))
        ...     y = x * x
        ...     torch.autograd.grad(G.unwrap(y), G.unwrap(x))[0]
        tensor(6.)
    """
    level = GradLevel(name)
    # inside a jvp level the shortcuts would decline every call (see grad_shortcuts.py)
    torch_function = no_shortcuts if fwAD._current_level >= 0 else grad_shortcuts.torch_function
    cls = new_level_class(level, "GradTensor", classmethod(torch_function), **_GRAD_LEVEL_TENSOR)
    level.nested_in_autodiff = bool(autodiff_classes(cls.__base__))
    # grad(f) inside no_grad or inference_mode still differentiates, as torch.func's does
    # (nn.TransformerEncoderLayer and nn.MultiheadAttention take fused inference kernels,
    # which have no derivatives, when no argument requires grad: a level's never do)
    with (paused_outside(cls), entered(cls), inference_mode_off(), torch.enable_grad(),
          predispatch.hook(), mha_fastpath_off, level.hooks):
        if level.nested_in_autodiff or fwAD._current_level >= 0:
            level.refuse_saved_tensor_hooks()
        yield cls


@contextlib.contextmanager
def paused_outside(cls: type[LevelTensor]) -> Iterator[None]:
    """While grad level ``cls`` is live, if grad mode is off as it is entered (``grad(f)``
    called under ``torch.no_grad()``), the grad levels around it record nothing, as
    torch.func keeps each level's grad mode as it was when the level was entered: what
    ``f`` computes, its value and its gradient, is a constant to them. ``cls`` itself
    records, as ``grad`` turns grad mode on inside. A jvp level ``cls`` entered with
    forward grad off pauses the jvp levels around it so."""
    kind, enabled = ((GradLevel, torch.is_grad_enabled()) if isinstance(cls._level, GradLevel)
                     else (JvpLevel, torch._C._is_fwd_grad_enabled()))
    outside = [] if enabled else [
        c._level for c in autodiff_classes(cls.__base__) if isinstance(c._level, kind)]
    for level in outside:
        level.paused += 1
    try:
        yield
    finally:
        for level in outside:
            level.paused -= 1


_HOOKS_REFUSED = (
    "torchlevels: saved-tensor hooks (torch.utils.checkpoint with use_reentrant=False, "
    "torch.autograd.graph.save_on_cpu) cannot be used inside a grad whose inputs something "
    "outside it also differentiates: a grad nested in another autodiff transform (jvp, "
    "jacfwd, grad, hessian), or under vmap over inputs that require grad. Their pack hook "
    "detaches the tensors the grad level saves, which would drop what the outer derivative "
    "tracks and give a wrong result. Remove the checkpoint there (torch.func refuses "
    "saved-tensor hooks in every grad).")


@contextlib.contextmanager
def _saved_tensor_hooks_refused() -> Iterator[None]:
    """Saved-tensor hooks refused in this thread, as torch.func's grad refuses them (see
    :meth:`GradLevel.refuse_saved_tensor_hooks`); the state before is put back."""
    before = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    try:  # it raises if hooks are in use (save_on_cpu outside), after disabling them
        torch._C._autograd._saved_tensors_hooks_disable(_HOOKS_REFUSED)
        yield
    finally:
        if before is None:
            torch._C._autograd._saved_tensors_hooks_enable()
        else:
            torch._C._autograd._saved_tensors_hooks_disable(before)


@contextlib.contextmanager
def jvp_level(name: str = "jvp") -> Iterator[type[LevelTensor]]:
    """Enter a fresh jvp level; yields its class ``J``: ``J(primal, tangent)``,
    ``J.unwrap(y) -> (primal, tangent)``. ``name`` names it in error messages.

    Example::

        >>> import torch
        >>> from torchlevels.autodiff import jvp_level
        >>> with jvp_level() as J:
        ...     y = J(torch.tensor(3.0), torch.tensor(1.0)) ** 2
        ...     J.unwrap(y)
        (tensor(9.), tensor(6.))
    """
    level = JvpLevel(name)
    cls = new_level_class(level, "DualTensor", classmethod(no_shortcuts), **_JVP_LEVEL_TENSOR)
    for outer in enclosing_classes(cls.__base__):
        outer._level.hosts_jvp = True
    # on inside, as torch.func's jvp turns it on (PyTorch turns it off in Function.forward)
    with (paused_outside(cls), entered(cls), inference_mode_off(), _dual_level(),
          fwAD._set_fwd_grad_enabled(True), predispatch.hook(), mha_fastpath_off):
        yield cls
