"""The autodiff transforms: thin public functions over the grad and jvp levels.

Same signatures, results and error messages as torch.func. Each call enters a fresh
level (autodiff.py), so they compose with vmap and with each other in any order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch.eager_transforms import (
    _replace_args,
    _slice_argnums,
    _validate_and_wrap_argnums,
)
from torch.func import functional_call, stack_module_state
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torchlevels._dim_inputs import accepts_dims
from torchlevels._level import (
    LevelTensor,
    innermost,
    is_foreign,
    refuse_functional,
    requires_grad_flag,
    resolved,
    untracked_pass,
)
from torchlevels._torch_compile import eager
from torchlevels.autodiff import (
    GradLevel,
    autodiff_classes,
    backward_pass,
    grad_level,
    inference_mode_off,
    jvp_level,
    requires_grad_within,
    shallow_copy,
    without_level_graph,
)
from torchlevels.autograd_grad import own_grad
from torchlevels.batching.registry import UnbatchedWriteError
from torchlevels.lifted import CapturedMutationError
from torchlevels.tools.partial_eval import partially_evaluated
from torchlevels.vmap import BatchLevel, valid_chunk_size, vmap

__all__ = [
    "functional_call", "grad", "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp",
    "linearize", "stack_module_state", "vjp",
]


def _inputs(api: str, flat: list, dtype_error: type[Exception] = RuntimeError) -> None:
    """Differentiated inputs must be floating-point or complex tensors (torch.func's errors)."""
    for t in flat:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{api}: Thing passed to transform API must be Tensor, got {type(t)}")
        if api in ("grad", "vjp", "jacrev", "hessian"):  # (forward mode works in functionalize)
            refuse_functional(api, t)
        if not (t.is_floating_point() or t.is_complex()):
            raise dtype_error(
                f"{api}: inputs must be floating-point or complex Tensors to be "
                f"differentiated, got one of dtype {t.dtype}. Pass it as a non-differentiated "
                "argument (see argnums) or convert it with .float()."
            )


def _refuse_no_output(api: str, flat_out: list) -> None:
    """f must return a tensor: torch.func's error for an empty output."""
    if not flat_out:
        raise RuntimeError(f"{_call(api)}: Expected f to be a function that has non-empty "
                           "output (got output = [])")


def _refuse_complex(api: str, flat: list, what: str) -> None:
    """Jacobians and Hessians are of real functions only, as torch.func's are (with its
    error): of a complex function, reverse mode would give the conjugate Jacobian and
    forward mode the Jacobian itself."""
    for idx, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.is_complex():
            raise RuntimeError(f"{api}: Expected all {what} to be real but received complex "
                               f"tensor at flattened input idx: {idx}")


def _needs_graph(level: GradLevel, tracked_outside: bool, grad_enabled: bool) -> bool:
    """Whether the backward pass itself must be recorded (higher order, or autograd outside
    tracks an input of the level or a tensor it captured: ``tracked_outside``).

    ``grad_enabled`` is the grad mode outside the transform, which turns it on inside.
    """
    return grad_enabled and (level.nested_in_autodiff or tracked_outside)


def _normalized(argnums: int | tuple[int, ...], args: tuple) -> int | tuple[int, ...]:
    """Negative argnums counted from the end, checked against the number of arguments."""
    _slice_argnums(args, argnums)  # raises torch.func's errors for bad argnums
    return _validate_and_wrap_argnums(argnums, len(args))


# How an error names the call the user made (jacrev, jacfwd and linearize run vjp or jvp)
_CALLS = {"vjp": "vjp(f, *primals)", "jvp": "jvp(f, primals, tangents)",
          "linearize": "linearize's jvp_fn"}


def _call(api: str) -> str:
    return _CALLS.get(api, f"{api}(f)(*args)")


def _split_aux(api: str, out: Any, has_aux: bool) -> tuple[Any, Any]:
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise RuntimeError(
            f"{_call(api)}: output of function f should be a tuple: (output, aux) "
            "if has_aux is True"
        )
    for a in tree_flatten(out[1])[0]:
        if not isinstance(a, torch.Tensor):  # torch.func's error, by every transform
            raise RuntimeError(
                f"{_call(api)}: Expected the aux output of f (has_aux=True) to "
                f"contain only Tensors, got unsupported type {type(a)}. Make a number a "
                "tensor (torch.tensor(x)); pass other values out through a variable outside f."
            )
    return out


def grad_and_value(func: Callable, argnums: int | tuple[int, ...] = 0,
                   has_aux: bool = False) -> Callable:
    """Like :func:`grad`, but also returns the value: ``(gradient, value)``
    (``((gradient, (value, aux))`` with ``has_aux=True``).

    Example::

        >>> import torch
        >>> from torchlevels import grad_and_value
        >>> grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1.0, 2.0]))
        (tensor([2., 4.]), tensor(5.))
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        grad_enabled = torch.is_grad_enabled()
        argnums_ = _normalized(argnums, args)
        with grad_level("grad") as G:
            G._level.functional = True
            diff = _slice_argnums(args, argnums_, as_tuple=False)
            flat, spec = tree_flatten(diff)
            _inputs("grad", flat)
            wrapped = [G(t) for t in flat]
            inputs_tracked = [requires_grad_within(t) for t in flat]
            if any(tracked and isinstance(t, LevelTensor)
                   for t, tracked in zip(flat, inputs_tracked)):
                G._level.refuse_saved_tensor_hooks()
            new_diff = tree_unflatten(wrapped, spec)
            new_args = _replace_args(args, (new_diff,) if isinstance(argnums_, int)
                                     else new_diff, argnums_)
            out, aux = _split_aux("grad_and_value", func(*new_args, **kwargs), has_aux)
            out = resolved(out)  # a buffer the level took in (see lifted.py): its tensor
            if not isinstance(out, torch.Tensor):
                raise RuntimeError(
                    "grad_and_value(f)(*args): Expected f(*args) to return a Tensor, "
                    f"got {type(out)}"
                )
            if out.dim() != 0:
                raise RuntimeError(
                    "grad_and_value(f)(*args): Expected f(*args) to return a scalar Tensor, "
                    f"got tensor with {out.dim()} dims. Maybe you wanted to use the vjp or "
                    "jacrev APIs instead?"
                )
            level = G._level
            untracked = not (level.captures_tracked or any(inputs_tracked))
            keep = _needs_graph(level, not untracked, grad_enabled)
            out_inner = G.unwrap(out)
            leaves = [w._inner for w in wrapped]
            grads = [None] * len(leaves)
            if type(out) is G and requires_grad_flag(out_inner):  # depends on the inputs
                with backward_pass(G), untracked_pass(untracked):
                    grads = list(own_grad(out_inner, leaves, allow_unused=True,
                                          create_graph=keep))
            grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, flat)]
            value = out_inner if keep else shallow_copy(out_inner)
            if has_aux:
                aux = tree_map(lambda a: _out_of(G, a, keep), aux)
                value = (value, aux)
            if keep and untracked:  # kept for the levels around, not for autograd outside
                grads, value = tree_map(without_level_graph, (grads, value))
        return tree_unflatten(grads, spec), value

    return eager(accepts_dims(wrapper), "grad_and_value")


def _out_of(G, t: Any, keep: bool) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    inner = G.unwrap(t)
    return inner if keep else shallow_copy(inner)


def grad(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable:
    """The gradient of a scalar-valued ``func`` with respect to the inputs at ``argnums``.

    A drop-in for ``torch.func.grad``: ``argnums`` is an int or a tuple of ints (the
    gradient has the same structure: pytrees of tensors are fine), ``has_aux=True`` means
    ``func`` returns ``(output, aux)`` and the result is ``(gradient, aux)``. Composes with
    every other transform, to any depth.

    Example::

        >>> import torch
        >>> from torchlevels import grad, vmap
        >>> grad(lambda x: x.sin().sum())(torch.tensor([0.0, 1.0]))
        tensor([1.0000, 0.5403])
        >>> grad(lambda x: x * grad(lambda y: x * y)(torch.tensor(1.0)))(torch.tensor(3.0))
        tensor(6.)
        >>> vmap(grad(lambda x: (x ** 3).sum()))(torch.ones(2, 2))  # per-example gradients
        tensor([[3., 3.],
                [3., 3.]])
    """
    g_and_v = grad_and_value(func, argnums, has_aux)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        gradient, value = g_and_v(*args, **kwargs)
        return (gradient, value[1]) if has_aux else gradient

    return eager(accepts_dims(wrapper), "grad")


@eager
def vjp(func: Callable, *primals: Any, has_aux: bool = False, _api: str = "vjp") -> tuple:
    """``(func(*primals), vjp_fn)``: ``vjp_fn(cotangents)`` is the vector-Jacobian product.

    ``cotangents`` has the structure of ``func``'s output; ``vjp_fn`` returns a tuple with
    one entry per primal. With ``has_aux=True`` the result is ``(output, vjp_fn, aux)``.
    As torch.func's, ``vjp_fn`` also takes ``retain_graph`` (default True: it may be called
    again) and ``create_graph`` (default: record the backward pass where grad mode is on
    and something could differentiate it), passed on to ``torch.autograd.grad``.

    Example::

        >>> import torch
        >>> from torchlevels import vjp
        >>> out, vjp_fn = vjp(torch.sin, torch.tensor([0.0, 1.0]))
        >>> vjp_fn(torch.ones(2))
        (tensor([1.0000, 0.5403]),)
    """
    grad_enabled = torch.is_grad_enabled()
    with grad_level(_api) as G:
        G._level.functional = True
        flat, spec = tree_flatten(primals)
        _inputs(_api, flat)
        wrapped = [G(t) for t in flat]
        out, aux = _split_aux(_api, func(*tree_unflatten(wrapped, spec)), has_aux)
        flat_out, out_spec = tree_flatten(out)
        flat_out = [resolved(o) for o in flat_out]  # buffers the level took in: its tensors
        _refuse_no_output(_api, flat_out)
        for o in flat_out:
            if not isinstance(o, torch.Tensor):
                raise RuntimeError(
                    f"{_call(_api)}: Expected f to be a function that has only Tensor "
                    f"outputs, got {type(o)}"
                )
            if not (o.is_floating_point() or o.is_complex()):
                raise RuntimeError(
                    f"{_call(_api)}: All outputs of f must be floating-point or complex "
                    f"Tensors, got Tensor with dtype {o.dtype}"
                )
        inputs_require_grad = G._level.captures_tracked or any(map(requires_grad_within, flat))
        keep = _needs_graph(G._level, inputs_require_grad, grad_enabled)
        out_inners = [G.unwrap(o) for o in flat_out]
        # the outputs that carry this level's graph (the others do not depend on the inputs)
        tracks = [type(o) is G and requires_grad_flag(i) for o, i in zip(flat_out, out_inners)]
        leaves = [w._inner for w in wrapped]
        results = tree_unflatten([o if keep else shallow_copy(o) for o in out_inners], out_spec)
        if has_aux:
            aux = tree_map(lambda a: _out_of(G, a, keep), aux)
    if keep and not inputs_require_grad:  # kept for the levels around, not autograd outside
        results, aux = tree_map(without_level_graph, (results, aux))

    @eager
    def vjp_fn(cotangents: Any, retain_graph: bool = True,
               create_graph: bool | None = None) -> tuple:
        flat_ct, ct_spec = tree_flatten(cotangents)
        if ct_spec != out_spec:
            raise RuntimeError(
                "Expected pytree structure of cotangents to be the same as pytree structure "
                f"of outputs to the function. cotangents: {ct_spec}, primal output: {out_spec}"
            )
        for k, (c, o) in enumerate(zip(flat_ct, out_inners)):
            if not isinstance(c, torch.Tensor):
                raise TypeError(f"vjp_fn: cotangent {k} is a {type(c).__name__}; give a tensor "
                                f"shaped like output {k}, {tuple(o.shape)}")
        tracked = [(o, c) for o, c, t in zip(out_inners, flat_ct, tracks) if t]
        grads = [None] * len(leaves)
        # nothing outside differentiates the pass: its graph is for the levels around alone
        untracked = not (inputs_require_grad or any(map(requires_grad_within, flat_ct)))
        if tracked:
            if create_graph is None:  # torch.func's default, grad mode, where it matters
                create_graph = torch.is_grad_enabled() and (
                    inputs_require_grad or bool(autodiff_classes(innermost()))
                    or any(c.requires_grad or requires_grad_within(c) for _, c in tracked)
                )
            # the level's graph was recorded with inference mode off: a backward pass run
            # inside the user's inference_mode would make inference tensors for views of it
            with backward_pass(G), untracked_pass(untracked), inference_mode_off():
                grads = list(own_grad(
                    [o for o, _ in tracked], leaves, [c for _, c in tracked],
                    retain_graph=retain_graph, create_graph=create_graph, allow_unused=True,
                ))
            if create_graph and untracked:
                grads = [without_level_graph(g) for g in grads]
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, flat)]
        return tuple(tree_unflatten(grads, spec))

    return (results, vjp_fn, aux) if has_aux else (results, vjp_fn)


@eager
def jvp(func: Callable, primals: Any, tangents: Any, *, strict: bool = False,
        has_aux: bool = False, _api: str = "jvp") -> tuple:
    """``(func(*primals), jvp_out)``: the Jacobian-vector product along ``tangents``.

    ``primals`` and ``tangents`` are tuples of the same structure. With ``has_aux=True``
    the result is ``(output, jvp_out, aux)``.

    Example::

        >>> import torch
        >>> from torchlevels import jvp
        >>> jvp(torch.sin, (torch.tensor([0.0, 1.0]),), (torch.ones(2),))
        (tensor([0.0000, 0.8415]), tensor([1.0000, 0.5403]))
    """
    call = _call(_api)
    if not isinstance(primals, tuple):
        raise RuntimeError(
            f"{call}: Expected primals to be a tuple. E.g. it should be "
            f"valid to call f(*primals). Got {type(primals)}"
        )
    flat_p, spec_p = tree_flatten(primals)
    flat_t, spec_t = tree_flatten(tangents)
    if spec_p != spec_t:
        raise RuntimeError(
            f"{call}: Expected primals and tangents to have the same python "
            f"structure. For example, if primals is a tuple of 3 tensors, tangents also must "
            f"be. Got primals with structure {spec_p} and tangents with structure {spec_t}"
        )
    if not flat_p:
        raise RuntimeError(f"{call}: Expected primals to contain at least one Tensor.")
    for p in flat_p:
        if not isinstance(p, torch.Tensor):
            raise RuntimeError(f"{call}: Expected primals to only contain Tensors, got "
                               f"{type(p).__name__}")
    _inputs(_api, flat_p, ValueError)
    for p, t in zip(flat_p, flat_t):
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(f"{call}: Expected tangents to only contain Tensors, got "
                               f"{type(t).__name__}")
        if p.shape != t.shape:
            raise RuntimeError(
                f"{call}: Expected primals and tangents to have the same "
                f"shapes, got {p.shape} and {getattr(t, 'shape', type(t))}"
            )
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(
                f"{call}: Expected tangent to be floating point or "
                f"complex, but got: {t.dtype}"
            )
    with jvp_level(_api) as J:
        J._level.functional = True
        wrapped = [J(p, t) for p, t in zip(flat_p, flat_t)]
        out, aux = _split_aux(_api, func(*tree_unflatten(wrapped, spec_p)), has_aux)
        flat_out, out_spec = tree_flatten(out)
        flat_out = [resolved(o) for o in flat_out]  # buffers the level took in: its tensors
        _refuse_no_output(_api, flat_out)
        pairs = []
        for o in flat_out:
            if not isinstance(o, torch.Tensor):
                raise RuntimeError(
                    f"{call}: expected f(*args) to return only tensors, "
                    f"got unsupported type {type(o)}"
                )
            if strict and type(o) is not J:
                raise RuntimeError(
                    "jvp(f, primals, tangents, strict=True): The output of f is independent "
                    "of the inputs. This is not allowed with strict=True."
                )
            pairs.append(J.unwrap(o))
        if has_aux:
            aux = tree_map(lambda a: J.unwrap(a)[0] if isinstance(a, torch.Tensor) else a, aux)
    primals_out = tree_unflatten([p for p, _ in pairs], out_spec)
    tangents_out = tree_unflatten([t for _, t in pairs], out_spec)
    return (primals_out, tangents_out, aux) if has_aux else (primals_out, tangents_out)


@eager
def linearize(func: Callable, *primals: Any) -> tuple[Any, Callable]:
    """``(func(*primals), jvp_fn)`` where ``jvp_fn(*tangents)`` is the JVP at ``primals``.

    As in torch.func, ``func`` runs eagerly for the output, and once more, traced, for
    ``jvp_fn``: the ops of the JVP that do not depend on the tangents run then, once
    (random ones included), and ``jvp_fn`` replays only the rest, a fixed linear map.
    Unlike torch.func's, the results keep their autograd history to primals (and captured
    tensors) that require grad. Inside another transform, ``jvp_fn`` runs ``jvp`` anew.

    Example::

        >>> import torch
        >>> from torchlevels import linearize
        >>> out, jvp_fn = linearize(torch.sin, torch.tensor([0.0, 1.0]))
        >>> jvp_fn(torch.ones(2))
        tensor([1.0000, 0.5403])
    """
    flat_primals, primals_spec = tree_flatten(primals)
    _inputs("linearize", flat_primals, ValueError)
    out = func(*primals)
    out_spec = tree_flatten(out)[1]

    def tangent_part(*flat_tangents: torch.Tensor) -> Any:
        return jvp(func, primals, tree_unflatten(list(flat_tangents), primals_spec),
                   _api="linearize")[1]

    run = None  # inside another transform, a trace would hold that level's ops
    if innermost() is None and not any(isinstance(p, LevelTensor) for p in flat_primals):
        try:
            run = partially_evaluated(lambda *t: tree_flatten(tangent_part(*t))[0],
                                      [torch.zeros_like(p) for p in flat_primals])
        except RuntimeError as e:  # a value read into Python while tracing (torch.cond's
            if "data-dependent" not in str(e) and "tracing tensor" not in str(e):  # pred)
                raise

    @eager
    def jvp_fn(*tangents: Any) -> Any:
        flat, spec = tree_flatten(tangents)
        if spec != primals_spec:
            raise RuntimeError(
                f"linearize's jvp_fn: Expected the tangents {spec} to have the same pytree "
                f"structure as the primals {primals_spec}")
        for k, (p, t) in enumerate(zip(flat_primals, flat)):
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"linearize's jvp_fn: tangent {k} is a {type(t).__name__}, "
                                   f"not a Tensor")
            for what in ("shape", "dtype", "device"):
                if getattr(t, what) != getattr(p, what):
                    raise RuntimeError(
                        f"linearize's jvp_fn: tangent {k} has {what} {getattr(t, what)}, which "
                        f"does not match the {what} {getattr(p, what)} of primal {k}")
        if run is None:
            return tangent_part(*flat)
        return tree_unflatten(run(*flat), out_spec)

    return out, jvp_fn


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def jacrev(func: Callable, argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False,
           chunk_size: int | None = None, _preallocate_and_copy: bool = False,
           _api: str = "jacrev") -> Callable:
    """The Jacobian of ``func`` with respect to ``argnums``, by reverse mode (vmap over vjp).

    The result nests like torch.func's: the output's structure outside, ``argnums``'
    inside; each block has shape ``output.shape + input.shape``.

    Example::

        >>> import torch
        >>> from torchlevels import jacrev
        >>> jacrev(torch.sin)(torch.tensor([0.0, 1.0]))
        tensor([[1.0000, 0.0000],
                [0.0000, 0.5403]])
    """
    if not valid_chunk_size(chunk_size):
        raise ValueError(f"jacrev: `chunk_size` should be None or an int greater than 0 (got "
                         f"{chunk_size!r}).")

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        argnums_ = _normalized(argnums, args)
        diff = _slice_argnums(args, argnums_)
        flat_in, in_spec = tree_flatten(diff)
        _refuse_complex(_api, flat_in, "inputs")

        def partial(*diff_args):
            return func(*_replace_args(args, diff_args, argnums_), **kwargs)

        result = vjp(partial, *diff, has_aux=has_aux, _api=_api)
        out, vjp_fn = result[0], result[1]
        flat_out, out_spec = tree_flatten(out)
        _refuse_complex(_api, flat_out, "outputs")
        pull = vmap(lambda *cts: vjp_fn(tree_unflatten(list(cts), out_spec)),
                    chunk_size=chunk_size)
        try:
            rows = pull(*_basis(flat_out))
        except (UnbatchedWriteError, CapturedMutationError):
            # a backward formula wrote batched or tracked values into a buffer made from a
            # cotangent (CopySlices, for a write through a view): a basis made at every
            # level around, as torch.func's, gives it buffers of those levels; the one made
            # below them is cheaper
            rows = pull(*_basis(flat_out, below=False))
        flat_rows = tree_flatten(rows)[0]  # one per input: (sum of out numels, *input.shape)
        blocks = []
        for o, pieces in zip(flat_out, _split_rows(flat_rows, flat_out)):
            per_input = [p.reshape(tuple(o.shape) + tuple(t.shape))
                         for p, t in zip(pieces, flat_in)]
            inputs_tree = tree_unflatten(per_input, in_spec)
            blocks.append(inputs_tree[0] if isinstance(argnums, int) else inputs_tree)
        jac = tree_unflatten(blocks, out_spec)
        return (jac, result[2]) if has_aux else jac

    return eager(accepts_dims(wrapper), "jacrev")


def _basis(tensors: list[torch.Tensor], below: bool = True) -> list[torch.Tensor]:
    """One-hot rows for all ``tensors`` at once: entry i is (total numel, *tensors[i].shape).

    ``below``: made below the vmap and grad levels around (see :func:`_below_transforms`),
    for a basis of cotangents. A basis of tangents is made at every level, batched as its
    primals are: an in-place op on a tensor made from an input (``y = x.clone();
    y.mul_(x)``) writes batched values into its tangent, as torch.func allows.
    """
    total = sum(t.numel() for t in tensors)
    first = tensors[0]
    maker = _below_transforms(first) if below else first
    if first.layout == torch.strided and not (below and is_foreign(maker)):
        eye = maker.new_zeros(total, total)
        eye.diagonal().fill_(1)
    else:  # sparse outputs, or a foreign subclass's below the levels: a dense plain basis
        eye = torch.eye(total, dtype=first.dtype, device=first.device)
    out, start = [], 0
    for t in tensors:
        out.append(eye[:, start:start + t.numel()].to(t.dtype).reshape(total, *t.shape))
        start += t.numel()
    return out


def _below_transforms(t: torch.Tensor) -> torch.Tensor:
    """``t`` unwrapped through the vmap and grad levels around it: a constant made from
    it (``new_zeros``) skips those levels, which would only see it as unbatched and
    untracked, yet lives at any tool level outside them, which sees its ops. Unwrapping
    stops at a jvp level: forward-AD formulas write into buffers made from a tangent, so
    a basis of tangents must live at every jvp level around it."""
    while isinstance(t, LevelTensor) and isinstance(type(t)._level, _SKIPPED_BY_CONSTANTS):
        t = t._inner
    return t


_SKIPPED_BY_CONSTANTS = (BatchLevel, GradLevel)


def _split_rows(flat_rows: list[torch.Tensor], flat_out: list) -> list[list[torch.Tensor]]:
    """Per output, the rows of each input's stacked gradients that belong to it."""
    sizes = [o.numel() for o in flat_out]
    per_input = [r.split(sizes) for r in flat_rows]
    return [list(pieces) for pieces in zip(*per_input)]


def jacfwd(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
           randomness: str = "error") -> Callable:
    """The Jacobian of ``func`` with respect to ``argnums``, by forward mode (vmap over jvp).

    Same result structure as :func:`jacrev`.

    Example::

        >>> import torch
        >>> from torchlevels import jacfwd
        >>> jacfwd(torch.sin)(torch.tensor([0.0, 1.0]))
        tensor([[1.0000, 0.0000],
                [0.0000, 0.5403]])
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        argnums_ = _normalized(argnums, args)
        diff = _slice_argnums(args, argnums_)
        flat_in, in_spec = tree_flatten(diff)
        _inputs("jacfwd", flat_in, ValueError)
        _refuse_complex("jacfwd", flat_in, "inputs")

        def partial(*diff_args):
            return func(*_replace_args(args, diff_args, argnums_), **kwargs)

        def push(*tangents):
            return jvp(partial, diff, tuple(tree_unflatten(list(tangents), in_spec)),
                       has_aux=has_aux, _api="jacfwd")

        basis = _basis(flat_in, below=False)
        if basis[0].shape[0] == 0:  # empty inputs: nothing to push, every block is empty
            zero = tuple(torch.zeros_like(t) for t in flat_in)
            results = tree_map(lambda o: o.unsqueeze(0), push(*zero))
        else:
            results = vmap(push, randomness=randomness)(*basis)
        out, columns = results[0], results[1]
        flat_cols, out_spec = tree_flatten(columns)  # each (total in numel, *output.shape)
        flat_out = tree_flatten(tree_map(lambda o: o[0], out))[0]
        _refuse_complex("jacfwd", flat_out, "outputs")
        sizes = [t.numel() for t in flat_in]
        blocks = []
        for col, o in zip(flat_cols, flat_out):
            pieces = col[: sum(sizes)].split(sizes)
            per_input = [p.movedim(0, -1).reshape(tuple(o.shape) + tuple(t.shape))
                         for p, t in zip(pieces, flat_in)]
            inputs_tree = tree_unflatten(per_input, in_spec)
            blocks.append(inputs_tree[0] if isinstance(argnums, int) else inputs_tree)
        jac = tree_unflatten(blocks, out_spec)
        if has_aux:
            return jac, tree_map(lambda a: a[0], results[2])
        return jac

    return eager(accepts_dims(wrapper), "jacfwd")


def hessian(func: Callable, argnums: int | tuple[int, ...] = 0) -> Callable:
    """The Hessian of a scalar ``func``, as torch.func.hessian gives it.

    Computed as ``jacrev(jacrev(func, argnums), argnums)``: the same blocks as torch.func's
    ``jacfwd(jacrev(...))`` (block ``[i][j]`` in input ``i``'s dtype, as there), and about
    twice as fast here, where a reverse level costs less per op than a forward level (each
    forward op makes and unpacks dual tensors). The two orders use different formulas of
    PyTorch's, and can differ in two kinds of place. Where ``func`` is not twice
    differentiable: at 0, the Hessian of ``torch.linalg.vector_norm`` is NaN in
    reverse-over-reverse (as ``torch.autograd.functional.hessian`` gives it) and 0 in
    forward-over-reverse. And where a formula assumes structure of its input:
    ``eigh``, ``eigvalsh`` and ``cholesky`` read one triangle of a matrix taken to be
    symmetric, and their derivatives are symmetric matrices, so Hessians through them
    agree on symmetric directions (``E1 : H : E2`` with symmetric ``E1``, ``E2``) but not
    on others (torch.func's is then not even symmetric). A ``torch.no_grad()`` block in
    ``func`` is constant to both reverse passes (as in ``torch.autograd.functional.hessian``)
    but not to torch.func's forward pass, which no_grad does not stop. Write
    ``jacfwd(jacrev(func))`` for torch.func's numbers in such places.

    Example::

        >>> import torch
        >>> from torchlevels import hessian
        >>> hessian(lambda x: (x ** 3).sum())(torch.tensor([1.0, 2.0]))
        tensor([[ 6.,  0.],
                [ 0., 12.]])
    """
    jac = jacrev(jacrev(func, argnums, _api="hessian"), argnums, _api="hessian")

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        flat = tree_flatten(_slice_argnums(args, argnums))[0]
        _inputs("hessian", flat, ValueError)
        _refuse_complex("hessian", flat, "inputs")
        out = jac(*args, **kwargs)
        if all(t.dtype == flat[0].dtype for t in flat):
            return out
        # the outer jacrev gives block [i][j] input j's dtype; torch.func's jacfwd, input i's
        blocks, spec = tree_flatten(out)
        n = len(flat)
        return tree_unflatten([b.to(flat[k // n].dtype) for k, b in enumerate(blocks)], spec)

    return eager(accepts_dims(wrapper), "hessian")


def debug_unwrap(tensor: torch.Tensor, *, recurse: bool = True) -> torch.Tensor:
    """The tensor under a level's tensor (all levels' with ``recurse``), as
    torch.func.debug_unwrap: for looking at values in a debugger, not for computing with.

    A batched tensor's inner tensor holds the whole batch, its batch dim where vmap put it.

    Example::

        >>> import torch
        >>> from torchlevels import debug_unwrap, vmap
        >>> vmap(lambda x: print(debug_unwrap(x).shape) or x)(torch.zeros(4, 3)).shape
        torch.Size([4, 3])
        torch.Size([4, 3])
    """
    while isinstance(tensor, LevelTensor):
        tensor = tensor._inner
        if not recurse:
            break
    return tensor
