"""torch.autograd.Function subclasses inside levels: their own backward, jvp and vmap rules.

``MyFn.apply`` runs above PyTorch's dispatcher, so a level's ``__torch_dispatch__`` would
only see the ops of ``MyFn.forward`` and differentiate those, silently ignoring a custom
backward (a straight-through estimator, a clipped gradient). PyTorch consults neither
``__torch_function__`` nor a mode in ``apply``; torch.func hooks it through
``_are_functorch_transforms_active()``, which only its own C++ level stack can switch on.
So importing torchlevels wraps ``torch.autograd.Function.apply`` once: a call whose
arguments hold no level tensor goes straight to PyTorch's ``apply``; otherwise the
*innermost* level among the arguments handles it, the way functorch's
``custom_function_call`` does, and each level redispatches ``MyFn.apply`` one level out:

- a **grad level** applies a one-level Function (``MyFn``'s forward redispatched one level
  out, ``MyFn``'s setup_context and backward) to its inner tensors with autograd on, so
  PyTorch records ``MyFn.backward`` in that level's graph;
- a **jvp level** applies the same one-level Function to dual tensors, so forward AD
  calls ``MyFn.jvp``;
- a **vmap level** calls ``MyFn.vmap``, or with ``generate_vmap_rule = True`` applies a
  Function whose forward, setup_context, backward and jvp are ``MyFn``'s under a vmap
  over the physical tensors (levels further out then see a custom backward too);
- a **tool's level** (``count_flops``, a ``ForwardingLevel``) applies ``MyFn`` one level
  out, with a forward that runs ``MyFn.forward`` on its tensors again: the levels out
  there use ``MyFn``'s rules, and the tool sees the forward's ops.

Like torch.func, a user's Function must use the ``setup_context`` style under a
transform. PyTorch's own ctx-style Functions run as before, their ops seen by the levels:
the autograd kernel of a ``torch.library`` custom op is one, applied from inside the
dispatcher to the tensors of enclosing levels.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd.function import Function, _SingleLevelFunction
from torch.utils._pytree import TreeSpec, _broadcast_to_and_flatten, tree_flatten, tree_unflatten

from torchlevels._level import LevelTensor, wrap_inner
from torchlevels._process_state import dual_level
from torchlevels.autodiff import (
    GradLevel,
    JvpLevel,
    _captures_tracked,
    _from_dual,
    _to_dual,
    _wrap,
)
from torchlevels.batching.composite import _deepest_level
from torchlevels.batching.dims import materialize
from torchlevels.batching.registry import VmapInfo
from torchlevels.tools.forwarding import ForwardingLevel
from torchlevels.vmap import BatchLevel, batch_level, wrap_batched

_pytorch_apply = Function.apply.__func__  # PyTorch's own apply, called for non-level args


def _apply(fn: type[Function], *args: Any, **kwargs: Any) -> Any:
    """``Function.apply``: the innermost level among ``args`` handles the call, if any."""
    cls = _deepest_level(args)
    if cls is None or not cls._level.alive:
        return _pytorch_apply(fn, *args, **kwargs)
    if fn.setup_context is _SingleLevelFunction.setup_context:
        if fn.__module__.startswith("torch._library."):
            # a torch.library custom op's autograd kernel, applied inside the dispatcher
            # to the tensors of enclosing levels: they see its ops, and record them
            return _pytorch_apply(_recorded_outside(fn), *args, **kwargs)
        hint = (" torch.utils.checkpoint works in transforms with use_reentrant=False."
                if fn.__module__ == "torch.utils.checkpoint" else "")
        raise RuntimeError(
            "In order to use an autograd.Function with functorch transforms "
            "(vmap, grad, jvp, jacrev, ...), it must override the setup_context "
            f"staticmethod ({fn.__qualname__} does not).{hint} For more details, please see "
            "https://pytorch.org/docs/main/notes/extending.func.html"
        )
    bound = inspect.signature(fn.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args, bound.kwargs
    level = cls._level
    if isinstance(level, GradLevel):
        return _grad_rule(cls, fn, args, kwargs)
    if isinstance(level, JvpLevel):
        return _jvp_rule(cls, fn, args, kwargs)
    if isinstance(level, BatchLevel):
        return _vmap_rule(cls, fn, args, kwargs)
    if isinstance(level, ForwardingLevel):
        return _forwarding_rule(cls, fn, args, kwargs)
    return _pytorch_apply(fn, *args, **kwargs)  # a level with no rule: forward's ops


_RECORDED_OUTSIDE: dict[type, type] = {}  # one per custom op (each lives for the process)


def _recorded_outside(fn: type[Function]) -> type[Function]:
    """A custom op's generated autograd Function whose forward runs with grad mode on.
    PyTorch's apply turns it off for the forward, so the levels around the one whose
    node this is (which the op reaches, below autograd) would not record it: a grad
    level around would take the op's output as a constant (a zero Hessian). The op's
    kernel runs only where grad mode is on and an argument requires grad."""
    wrapped = _RECORDED_OUTSIDE.get(fn)
    if wrapped is None:
        def forward(ctx, *args):
            with torch.enable_grad():
                return fn.forward(ctx, *args)

        wrapped = type(fn.__name__, (fn,), {"forward": staticmethod(forward)})
        _RECORDED_OUTSIDE[fn] = wrapped
    return wrapped


def install() -> None:
    """Route ``torch.autograd.Function.apply`` through the levels (done on import)."""
    if Function.__dict__["apply"].__func__ is not _apply:
        Function.apply = classmethod(functools.wraps(_pytorch_apply)(_apply))


# -- grad and jvp: one autograd node on the inner tensors ----------------------------------


def _one_level_out(fn: type[Function], kwargs: dict,
                   copy_views: bool = False) -> type[_SingleLevelFunction]:
    """A Function with ``fn``'s rules whose forward redispatches ``fn`` one level out
    (its outputs that alias an input copied if ``copy_views``; see :func:`_unaliased`)."""
    grad_on, fwd_grad_on = torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()

    def redispatch(*inner):
        if _deepest_level(inner) is None:  # plain tensors: nothing further out to record
            return fn.forward(*inner, **kwargs)
        # PyTorch's apply turned autograd off; enclosing levels record on their own tensors
        with torch.set_grad_enabled(grad_on), fwAD._set_fwd_grad_enabled(fwd_grad_on):
            return fn.apply(*inner, **kwargs)

    def setup_context(ctx, inputs, output):
        return fn.setup_context(ctx, inputs, output)

    def forward_unaliased(ctx, *inner):
        # fn's setup_context runs in forward (ctx style), before the outputs are copied:
        # an input it marks dirty is returned as itself
        out = _with_tangents_hidden(redispatch, inner)
        setup_context(ctx, inner, out)
        return _unaliased(out, inner, ctx.dirty_tensors or ())

    def backward(ctx, *grads):
        return fn.backward(ctx, *grads)

    def jvp(ctx, *tangents):
        return fn.jvp(ctx, *tangents)

    rules = {"backward": backward, "jvp": jvp}
    if copy_views:
        rules["forward"] = forward_unaliased
    else:
        rules.update(forward=redispatch, setup_context=setup_context)
    return type(f"{fn.__name__}OneLevel", (_SingleLevelFunction,),
                {name: staticmethod(f) for name, f in rules.items()})


def _with_tangents_hidden(redispatch, duals: tuple) -> Any:
    """``redispatch(*duals)``, with the plain tensors among ``duals`` passed as their
    primals: their tangents are the jvp level's own, which levels further out must not
    see (a vmap level's generated rule would run ``jvp`` for them too, then PyTorch's
    apply here would set the outputs' tangents a second time). Outputs that are those
    primals are the duals again, so an input returned as itself stays itself."""
    primals = tuple(fwAD.unpack_dual(t).primal if type(t) is torch.Tensor else t
                    for t in duals)
    out = redispatch(*primals)
    back = {id(p): d for p, d in zip(primals, duals) if p is not d}

    def one(o):
        return back.get(id(o), o) if isinstance(o, torch.Tensor) else o

    return tuple(one(o) for o in out) if isinstance(out, tuple) else one(out)


def _unaliased(out: Any, inputs: tuple, dirty: tuple) -> Any:
    """``out`` with each view, and each input returned as is but not ``dirty``, copied.

    PyTorch's forward AD wants ``jvp`` to return a view for such an output; torch.func takes
    the tangent ``jvp`` gives (a straight-through ``x.view_as(x)`` whose jvp is ``-t``).
    An input marked dirty (``ctx.mark_dirty``, modified in place) stays itself.
    """
    def one(o):
        if not isinstance(o, torch.Tensor) or any(o is t for t in dirty):
            return o
        return o.clone() if o._is_view() or any(o is t for t in inputs) else o

    return tuple(one(o) for o in out) if isinstance(out, tuple) else one(out)


def _keep_identity(out: Any, inner: tuple, args: tuple, wrap) -> Any:
    """``wrap`` the outputs, except that an input returned as is stays the caller's object."""
    originals = {id(i): a for i, a in zip(inner, args) if isinstance(i, torch.Tensor)}

    def one(o):
        if not isinstance(o, torch.Tensor):
            return o
        return originals[id(o)] if id(o) in originals else wrap(o)

    return tuple(one(o) for o in out) if isinstance(out, tuple) else one(out)


def _map_level(cls, f, a: Any, rest=lambda x: x) -> Any:
    """``f`` of each tensor of level ``cls`` in ``a``, also inside lists and tuples (where
    ``_deepest_level`` finds them too), and ``rest`` of anything else."""
    if type(a) in (list, tuple):
        return type(a)(_map_level(cls, f, x, rest) for x in a)
    return f(a) if type(a) is cls else rest(a)


def _grad_rule(G: type[LevelTensor], fn, args: tuple, kwargs: dict) -> Any:
    """Record ``fn.backward`` in G's graph, which lives on G's inner tensors."""
    level = G._level
    level.captures_tracked = level.captures_tracked or _captures_tracked(G, args)
    inner = tuple(_map_level(G, lambda t: t._inner, a) for a in args)
    out = _one_level_out(fn, kwargs).apply(*inner)
    return _keep_identity(out, inner, args, lambda o: _wrap(G, o) if o.requires_grad else o)


def _jvp_rule(J: type[LevelTensor], fn, args: tuple, kwargs: dict) -> Any:
    """Apply ``fn`` to dual tensors, so forward AD calls ``fn.jvp``."""
    with dual_level() as level:
        duals = tuple(_to_dual(a, J, level, J._level.hosts_jvp) for a in args)
        out = _one_level_out(fn, kwargs, copy_views=True).apply(*duals)
        return _keep_identity(out, duals, args, lambda o: _from_dual(J, o, level))


def _forwarding_rule(T: type[LevelTensor], fn, args: tuple, kwargs: dict) -> Any:
    """Apply ``fn`` one level out of tool level ``T``, so that the levels there use its
    rules (a grad level its backward), with a forward that wraps its arguments at ``T``
    again wherever it runs: the tool sees the forward's ops, as it sees any others."""
    def forward(*xs, **kw):
        out = fn.forward(*(_map_tensors(lambda t: wrap_inner(T, t), x) for x in xs), **kw)
        return _map_level(T, lambda t: t._inner, out)

    watched = type(fn.__name__, (fn,), {"forward": staticmethod(forward)})
    inner = tuple(_map_level(T, lambda t: t._inner, a) for a in args)
    out = watched.apply(*inner, **kwargs)
    return _keep_identity(out, inner, args, lambda o: wrap_inner(T, o))


def _map_tensors(f, a: Any) -> Any:
    """``f`` of each tensor in ``a``, also inside lists and tuples."""
    if type(a) in (list, tuple):
        return type(a)(_map_tensors(f, x) for x in a)
    return f(a) if isinstance(a, torch.Tensor) else a


# -- vmap: the vmap staticmethod, or fn's rules run under vmap -----------------------------


def _has_vmap_staticmethod(fn) -> bool:
    return fn.vmap is not Function.vmap


def _vmap_rule(B: type[LevelTensor], fn, args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` on B's physical tensors, by its ``vmap`` staticmethod or a generated rule."""
    level = B._level
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        raise NotImplementedError(
            "Run vmap on autograd.Function with kwarg-only Tensor args. Please do not pass "
            f"kwarg-only Tensors to autograd.Function. Got: {kwargs}"
        )
    inner = tuple(_map_level(B, lambda t: t._inner, a) for a in args)
    in_dims = tuple(_map_level(B, lambda t: t._bdim, a, lambda x: None) for a in args)
    if fn.generate_vmap_rule:
        if _has_vmap_staticmethod(fn):
            raise RuntimeError(
                f"You tried to vmap over {fn.__name__}, but it has both generate_vmap_rule=True "
                "and an overridden vmap staticmethod. Please set generate_vmap_rule=False or "
                "delete the overridden vmap staticmethod to avoid ambiguity."
            )
        vmapped, out_dims_of = _vmapped_function(fn, in_dims, level, kwargs)
        out = vmapped.apply(*inner)  # levels further out see a Function too
        out_dims = out_dims_of() if isinstance(out, tuple) else out_dims_of()[0]
    elif _has_vmap_staticmethod(fn):
        result = fn.vmap(VmapInfo(level.batch_size, level.randomness), in_dims, *inner, **kwargs)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(
                "Expected the vmap staticmethod to have two returns, an output and out_dims "
                f"with pytree structure compatible with the output. Got {type(result)}"
            )
        out, out_dims = result
    else:
        raise RuntimeError(
            f"You tried to vmap over {fn.__name__}, but it does not have vmap support. Please "
            "override and implement the vmap staticmethod or set generate_vmap_rule=True. For "
            "more details, please see https://pytorch.org/docs/main/notes/extending.func.html"
        )
    outs, spec = tree_flatten(out)
    dims = _per_output(out_dims, spec)
    wrapped = [
        _keep_identity(o, inner, args, lambda t, d=d: t if d is None else wrap_batched(B, t, d))
        for o, d in zip(outs, dims)
    ]
    return tree_unflatten(wrapped, spec)


def _per_output(out_dims: Any, spec: TreeSpec) -> list:
    """The batch dim of each output, ``out_dims`` a prefix of the outputs' structure
    ``spec`` (one int or None for all of them, or one per output), as torch.func takes it."""
    dims = _broadcast_to_and_flatten(out_dims, spec)
    if dims is None:
        raise RuntimeError(
            f"The autograd.Function's vmap staticmethod returned an incompatible (output, "
            f"out_dims) tuple. Expected out_dims={out_dims} to be compatible with the "
            f"structure of `output`. out_dims has structure {tree_flatten(out_dims)[1]} but "
            f"output has structure {spec}.")
    return dims


def _under_vmap(func, tensors: tuple, dims: tuple, level: BatchLevel, ctx_of=None):
    """``func`` on ``tensors`` batched at ``dims`` in a fresh vmap level: (outputs, dims)."""
    with batch_level(level.randomness, level.batch_size) as B:
        batched = tuple(_batched(B, t, d) for t, d in zip(tensors, dims))
        out = func(B, *batched)
        outs = out if isinstance(out, tuple) else (out,)
        phys = tuple(o._inner if type(o) is B else o for o in outs)
        out_dims = tuple(o._bdim if type(o) is B else None for o in outs)
    return phys, out_dims


def _batched(B, t: Any, dim: Any) -> Any:
    """``t`` batched at ``dim`` at level ``B``, ``dim`` a tree like ``t`` (lists, tuples)."""
    if type(t) in (list, tuple) and dim is not None:
        return type(t)(_batched(B, x, d) for x, d in zip(t, dim))
    return t if dim is None or not isinstance(t, torch.Tensor) else wrap_batched(B, t, dim)


class _BatchedCtx:
    """``ctx`` as ``fn``'s rules see it under vmap: saved tensors are unwrapped on saving
    (their batch dims kept in ``state``, the vmapped Function's own: under nested vmap
    each level's ctx wraps the next one's, and they share the attributes of the one
    PyTorch made) and come back batched (``saved``)."""

    def __init__(self, ctx, B=None, saved: tuple = (), state: dict | None = None) -> None:
        object.__setattr__(self, "_tl_ctx", ctx)
        object.__setattr__(self, "_tl_level", B)
        object.__setattr__(self, "_tl_state", state)
        object.__setattr__(self, "saved_tensors", saved)

    def _unwrap(self, tensors: tuple) -> tuple[tuple, tuple]:
        B = self._tl_level
        return (tuple(t._inner if type(t) is B else t for t in tensors),
                tuple(t._bdim if type(t) is B else None for t in tensors))

    def save_for_backward(self, *tensors) -> None:
        phys, self._tl_state["backward_dims"] = self._unwrap(tensors)
        self._tl_ctx.save_for_backward(*phys)

    def save_for_forward(self, *tensors) -> None:
        phys, self._tl_state["forward_dims"] = self._unwrap(tensors)
        self._tl_ctx.save_for_forward(*phys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tl_ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tl_ctx, name, value)


def _vmapped_function(fn, in_dims: tuple, level: BatchLevel, kwargs: dict):
    """A Function over physical tensors: ``fn``'s rules run under vmap at ``in_dims``.

    Returns it and a getter for its outputs' batch dims (known once forward has run).
    """
    state: dict[str, Any] = {}

    def forward(*phys):
        def run(B, *xs):
            out = fn.forward(*xs, **kwargs)
            state["tuple"] = isinstance(out, tuple)
            return out

        out, state["out_dims"] = _under_vmap(run, phys, in_dims, level)
        return out if state["tuple"] else out[0]

    def setup_context(ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        n = len(inputs)
        state["shapes"] = [None] * n  # per-example input shapes, to reduce gradients to

        def run(B, *xs):
            batched_ctx = _BatchedCtx(ctx, B, state=state)
            state["shapes"] = [x.shape if isinstance(x, torch.Tensor) else None for x in xs[:n]]
            out = xs[n:] if isinstance(output, tuple) else xs[n]
            fn.setup_context(batched_ctx, xs[:n], out)

        _under_vmap(run, (*inputs, *outs), (*in_dims, *state["out_dims"]), level)

    def backward(ctx, *grads):
        saved, saved_dims = ctx.saved_tensors, state.get("backward_dims", ())
        grad_dims = tuple(None if g is None else d for g, d in zip(grads, state["out_dims"]))
        k = len(saved)

        def run(B, *xs):
            result = fn.backward(_BatchedCtx(ctx, saved=xs[:k]), *xs[k:])
            return result if isinstance(result, tuple) else (result,)

        grads_in, dims = _under_vmap(run, (*saved, *grads), (*saved_dims, *grad_dims), level)
        return tuple(_reduce_to(g, d, in_d, s, level.batch_size)
                     for g, d, in_d, s in zip(grads_in, dims, in_dims, state["shapes"]))

    def jvp(ctx, *tangents):
        saved, saved_dims = ctx.saved_tensors, state.get("forward_dims", ())
        tangent_dims = tuple(None if t is None else d for t, d in zip(tangents, in_dims))
        k = len(saved)

        def run(B, *xs):
            result = fn.jvp(_BatchedCtx(ctx, saved=xs[:k]), *xs[k:])
            return result if isinstance(result, tuple) else (result,)

        outs, dims = _under_vmap(run, (*saved, *tangents), (*saved_dims, *tangent_dims), level)
        moved = tuple(_move_to(t, d, od, level.batch_size)
                      for t, d, od in zip(outs, dims, state["out_dims"]))
        return moved if len(moved) != 1 else moved[0]

    rules = {"forward": forward, "setup_context": setup_context, "backward": backward,
             "jvp": jvp}
    vmapped = type(f"Vmapped{fn.__name__}", (Function,),
                   {"generate_vmap_rule": True,
                    **{name: staticmethod(f) for name, f in rules.items()}})
    return vmapped, lambda: state["out_dims"]


def _move_to(t: Any, dim: int | None, target: int | None, size: int) -> Any:
    """Physical ``t`` with its batch dim ``dim`` moved to ``target`` (expanded if absent)."""
    if t is None or dim == target:
        return t
    if target is None:
        return t.sum(dim)
    if dim is None:
        return materialize(t, None, size).movedim(0, target)
    return t.movedim(dim, target)


def _reduce_to(g: Any, dim: int | None, in_dim: int | None, shape, size: int) -> Any:
    """A per-example gradient as the gradient of the physical input (batched at ``in_dim``):
    summed over the batch for an unbatched input, and over broadcast dims."""
    if g is None or shape is None:
        return None if shape is None else g
    if in_dim is None:
        return _sum_to(g if dim is None else g.sum(dim), shape, 0)
    return _sum_to(_move_to(g, dim, 0, size), shape, 1).movedim(0, in_dim)


def _sum_to(g: torch.Tensor, shape, start: int) -> torch.Tensor:
    """``g`` summed to ``shape`` over its broadcast dims, leaving its first ``start`` dims."""
    lead = g.dim() - start - len(shape)
    if lead:
        g = g.sum(tuple(range(start, start + lead)))
    ones = tuple(start + i for i, n in enumerate(shape) if n == 1 and g.shape[start + i] != 1)
    return g.sum(ones, keepdim=True) if ones else g


install()
