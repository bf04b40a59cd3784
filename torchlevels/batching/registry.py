"""The batching-rule registry and how an op finds its rule.

A rule has the shape of the batching-rule guide's, in Python::

    rule(func, args, dims, kwargs) -> (out, out_dims)

``args`` are the op's positional arguments with this level's tensors replaced by the
tensors they wrap; ``dims`` is parallel to ``args``: the batch dim (an int) of each
batched tensor, None for anything else, and for a list of tensors a tuple of those.
``out_dims`` mirrors ``out``. At least one argument is batched.

Precedence, as in PyTorch's dispatcher: an op's own rule (registered for the overload,
else for its packet; for a ``torch.library.custom_op``, the rule given to its
``register_vmap``) > a family rule (pointwise, reduction, ...) > a decomposition from
``torch._decomp`` re-dispatched so its pieces are batched > a per-example loop.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._pytree import (
    _broadcast_to_and_flatten,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)

from torchlevels._level import LevelTensor, autograd_on, differentiated
from torchlevels.batching import shortcuts
from torchlevels.batching.dims import kernel_on_zeros

Rule = Callable[[OpOverload, tuple, tuple, dict], tuple[Any, Any]]


class How(enum.Enum):
    OWN = "own rule"
    FAMILY = "family rule"
    DECOMPOSITION = "decomposition"
    LOOP = "slow loop"


@dataclass(frozen=True)
class Resolved:
    how: How
    fn: Callable
    family: str = ""
    takes_level: bool = False  # fn(level, func, args, dims, kwargs): needs the level's state
    inplace: bool = False  # func writes its first argument and returns it (add_, copy_...)
    view: bool = False  # func returns a view of an argument (select, slice, t...)
    # fn(func, args, dims, kwargs, kw_dims=...) takes batched keyword-only tensors (sorter=)
    keyword_dims: bool = False


_own: dict[OpOverload | OpOverloadPacket, tuple[Rule, bool, bool]] = {}
_families: list[tuple[str, Callable[[OpOverload], bool], Rule]] = []
# Keyed by id(func): OpOverloads are interned for the process, and hashing them runs Python.
resolved_by_id: dict[int, Resolved] = {}
# Ops whose decomposition is known to loop back to the op itself or to be wrong here.
_no_decomposition: set[OpOverload] = set()


def register(
    *ops: OpOverload | OpOverloadPacket, takes_level: bool = False, keyword_dims: bool = False
) -> Callable[[Rule], Rule]:
    """Register ``rule`` as the own batching rule of ``ops`` (overloads or packets).

    With ``takes_level=True`` the rule is called as ``rule(level, func, args, dims, kwargs)``
    (for rules that depend on the level's state, such as its randomness). With
    ``keyword_dims=True`` it also batches keyword-only tensors (``searchsorted``'s
    ``sorter``): when one is batched it is called with ``kw_dims=``, the batch dims of
    the keyword arguments by name (``None`` for unbatched ones); a call with none batched
    omits it. A rule without it leaves such calls to the per-example loop.

    Example::

        @register(aten.unsqueeze.default)
        def unsqueeze(func, args, dims, kwargs):
            x, d = args
            return x.movedim(dims[0], 0).unsqueeze(wrap_dim(d, x.dim()) + 1), 0
    """

    def deco(rule: Rule) -> Rule:
        used = _checked(rule, takes_level) if _builtins_loaded else rule  # a user's
        for op in ops:
            if _builtins_loaded and isinstance(op, OpOverloadPacket):
                # the user's rule for the packet wins over the library's for its overloads
                for known in [k for k in _own if getattr(k, "overloadpacket", None) is op]:
                    del _own[known]
            _own[op] = (used, takes_level, keyword_dims)
            if _builtins_loaded:
                _see_before_decomposition(op)
        resolved_by_id.clear()
        if _builtins_loaded and any(_namespace(op) == "aten" for op in ops):
            shortcuts.switch_off()  # the user's rule must see every call of the op
        return rule

    return deco


def _namespace(op: OpOverload | OpOverloadPacket) -> str:
    """``"aten"`` for ``aten.sin`` and ``aten.sin.default`` alike."""
    name = op.name() if isinstance(op, OpOverload) else op._qualified_op_name
    return name.split("::")[0]


def _checked(rule: Rule, takes_level: bool) -> Rule:
    """A user's ``rule`` whose answers are checked (:func:`checked_result`)."""
    name = "the batching rule registered"
    if takes_level:
        def checked(level, func, args, dims, kwargs, **kw):
            result = rule(level, func, args, dims, kwargs, **kw)
            return checked_result(func, result, level.batch_size, name)
    else:
        def checked(func, args, dims, kwargs, **kw):
            size = batch_size(args, dims, kwargs, kw.get("kw_dims"))
            return checked_result(func, rule(func, args, dims, kwargs, **kw), size, name)
    return functools.wraps(rule)(checked)


def _see_before_decomposition(op: OpOverload | OpOverloadPacket) -> None:
    """A composite op's rule runs before PyTorch decomposes it (a level never sees the op
    itself, only its pieces): as the library's rules for ``linear`` and ``matmul`` do."""
    from torchlevels.batching import composite  # (it registers rules itself)

    overloads = ([getattr(op, name) for name in op.overloads()]
                 if isinstance(op, OpOverloadPacket) else [op])
    for overload in overloads:
        if is_composite(overload) and overload not in composite.composite_ops():
            composite.composite_rule(overload)(_own_rule_of)


def _own_rule_of(func: OpOverload, args: tuple, dims: tuple, kwargs: dict) -> Any:
    """The own rule registered for composite ``func`` (see composite.py), if one still is
    (else it decomposes)."""
    rule = registered_rule(func)
    return NotImplemented if rule is None else rule(func, args, dims, kwargs)


def registered_rule(func: OpOverload) -> Rule | None:
    """The own rule registered for ``func`` or its packet (the library registers none
    for composite ops: the rules of those it batches whole live in composite.py)."""
    own = _own.get(func) or _own.get(func.overloadpacket)
    if own is None:
        return None
    if own[1]:
        raise NotImplementedError(f"{func}: a rule for a composite op cannot take the level")
    return own[0]


_user_families = 0  # how many of the families at the front are users'


def register_family(name: str, applies: Callable[[OpOverload], bool], rule: Rule) -> None:
    """Register a rule for every op for which ``applies(op)`` holds (first match wins; the
    user's families, registered after the library's, are tried before them)."""
    global _user_families
    if _builtins_loaded:
        _families.insert(_user_families, (name, applies, rule))
        _user_families += 1
        shortcuts.switch_off()
    else:
        _families.append((name, applies, rule))
    resolved_by_id.clear()


_builtins_loaded = False


def builtins_loaded() -> None:
    """The library's own rules are in: rules registered from now on are users'."""
    global _builtins_loaded
    _builtins_loaded = True


def skip_decomposition(*ops: OpOverload) -> None:
    """Never batch ``ops`` through their ``torch._decomp`` decomposition."""
    _no_decomposition.update(ops)
    resolved_by_id.clear()


def resolve(func: OpOverload) -> Resolved:
    """How ``func`` is batched: its own rule, a family rule, a decomposition or the loop."""
    found = resolved_by_id.get(id(func))
    if found is None:
        found = _resolve(func)
        if found.how is not How.LOOP or not is_custom_op(func):  # its rule may come later
            resolved_by_id[id(func)] = found
    return found


def _resolve(func: OpOverload) -> Resolved:
    inplace = _is_inplace(func)
    view = returns_view(func)
    own = _own.get(func)
    if own is None and out_arguments(func):
        return Resolved(How.DECOMPOSITION, functools.partial(into_out, func))
    own = own or _own.get(func.overloadpacket)
    if own is not None:
        return Resolved(How.OWN, own[0], takes_level=own[1], inplace=inplace, view=view,
                        keyword_dims=own[2])
    if is_custom_op(func) and _maybe_get_opdef(func)._vmap_fn is not None:
        return Resolved(How.OWN, _custom_op_rule, takes_level=True, inplace=inplace, view=view)
    for name, applies, rule in _families:
        if applies(func):
            return Resolved(How.FAMILY, rule, name, inplace=inplace, view=view)
    decomposition = decomposition_of(func)
    if decomposition is not None:
        return Resolved(How.DECOMPOSITION, decomposition)
    return Resolved(How.LOOP, loop_rule, inplace=inplace, view=view)


def per_op(compute: Callable[[OpOverload], Any]) -> Callable[[OpOverload], Any]:
    """``compute(func)``, cached by ``id(func)``: levels ask these on every op."""
    cache: dict[int, Any] = {}

    @functools.wraps(compute)
    def lookup(func: OpOverload) -> Any:
        key = id(func)
        try:
            return cache[key]
        except KeyError:
            found = cache[key] = compute(func)
            return found

    return lookup


@per_op
def is_custom_op(func: OpOverload) -> bool:
    """Whether ``func`` was made by ``torch.library.custom_op``."""
    return _maybe_get_opdef(func) is not None


@per_op
def is_composite(func: OpOverload) -> bool:
    """Whether ``func`` is a composite op (PyTorch decomposes it into aten ops above
    autograd: ``matmul``, ``linear``)."""
    try:
        return func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:  # TorchScript-only overloads (e.g. index.Tensor_hacked_twin)
        return False


@per_op
def writes_first_argument(func: OpOverload) -> bool:
    """Whether ``func`` writes its first argument in place (``add_``, ``copy_``, ``normal_``)."""
    first = func._schema.arguments[0].alias_info if func._schema.arguments else None
    return bool(first and first.is_write)


@per_op
def returns_view(func: OpOverload) -> bool:
    """Whether ``func`` returns a view of an argument (slice, select, view, split...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns)


@per_op
def written_positions(func: OpOverload) -> tuple[int, ...]:
    """The positions of the arguments that ``func`` writes (``self`` of ``add_``)."""
    return tuple(k for k, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


@per_op
def written_arguments(func: OpOverload) -> tuple[int | None, ...]:
    """For each output of ``func``: the position of the argument it writes and returns
    (an in-place or out= op's), else None."""
    schema = func._schema
    return tuple(
        next((k for k, a in enumerate(schema.arguments)
              if r.alias_info is not None and r.alias_info.is_write
              and a.alias_info is not None
              and a.alias_info.before_set == r.alias_info.before_set), None)
        for r in schema.returns)


@per_op
def out_arguments(func: OpOverload) -> tuple[str, ...]:
    """The names of the ``out=`` arguments that ``func`` writes (none for most ops)."""
    arguments = func._schema.arguments
    return tuple(arguments[k].name for k in written_positions(func) if arguments[k].kwarg_only)


@per_op
def functional_overload(func: OpOverload) -> OpOverload | None:
    """The overload of ``func``'s packet that takes its arguments but the ``out=`` ones and
    writes none (``mul.out`` -> ``mul.Tensor``), or None."""
    outs = out_arguments(func)
    wanted = [s for s in _signature(func) if s[0] not in outs]
    packet = func.overloadpacket
    return next((op for op in (getattr(packet, name) for name in packet.overloads())
                 if not op._schema.is_mutable and _signature(op) == wanted), None)


def into_out(func: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """An ``out=`` op under vmap: its functional overload, its results then copied into the
    ``out`` tensors (resized first where their shapes differ, as out= does). The copies
    are in-place writes that the level checks like any other: batched results cannot go
    into a tensor that is not batched."""
    functional = functional_overload(func)
    if functional is None:
        raise RuntimeError(
            f"vmap: {func} writes its out= argument and has no overload without one that "
            "vmap could run instead; call the function without out= inside vmap.")
    names = out_arguments(func)
    outs = [kwargs.pop(name) for name in names]
    result = functional(*args, **kwargs)
    results = (result,) if isinstance(result, torch.Tensor) else result
    if any(isinstance(a, torch.Tensor) for a in tree_leaves(args)):  # not a factory's
        if any(out.dtype != value.dtype for out, value in zip(outs, results)):
            _out_kernel_on_zeros(func, args, dict(kwargs, **dict(zip(names, outs))))
            if (len(outs) == 1 and kwargs.get("dtype") is None
                    and any(a.name == "dtype" for a in functional._schema.arguments)):
                # an op that takes a dtype (sum, cumsum) computes in its out tensor's
                result = functional(*args, **dict(kwargs, dtype=outs[0].dtype))
                results = (result,)
        for out, value in zip(outs, results):
            if not torch.can_cast(value.dtype, out.dtype):
                # the out= kernels' own check (copy_ would cast)
                raise RuntimeError(f"result type {value.dtype} can't be cast to the desired "
                                   f"output type {out.dtype}")
        # and the checks of kernels that take only their result's dtype (mm, matmul), and
        # autograd's, raised by one example's call on meta tensors
        _out_call_on_meta(func, args, dict(kwargs, **dict(zip(names, outs))))
    for name, out, value in zip(names, outs, results):
        if out.shape != value.shape:
            out.resize_(value.shape)
        try:
            out.copy_(value)
        except UnbatchedWriteError as error:  # the level's own error, with what wrote where
            raise UnbatchedWriteError(
                f"vmap: {func} copies its result into its out= tensor `{name}`, which failed: "
                f"{error} To write batched results, make the out tensor inside the function "
                f"from a batched one (torch.empty_like(x)), or call {functional} without "
                "out=.") from error
    return outs[0] if len(outs) == 1 else tuple(outs)


def _out_kernel_on_zeros(func: OpOverload, args: tuple, kwargs: dict) -> None:
    """Raise the dtype error one example's call raises where an out tensor's dtype is not
    the result's (softmax and clamp refuse another float dtype, which a copy would cast
    to), from ``func``'s kernel on zeros (see :func:`dims.kernel_on_zeros`)."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]

    def call():
        zeros = tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=t.device),
            (args, kwargs))
        func(*zeros[0], **zeros[1])

    kernel_on_zeros((func, *((t.dtype, t.device.type) for t in tensors)), call,
                    lambda error: isinstance(error, (RuntimeError, TypeError))  # (cat's cast)
                    and ("type" in str(error) or "cast" in str(error)))


def _out_call_on_meta(func: OpOverload, args: tuple, kwargs: dict) -> None:
    """``func`` on meta tensors of ``args``' and ``kwargs``' logical shapes and dtypes,
    tracked by autograd where they are: it raises what the kernel, or autograd, refuses of
    one example's call (autograd refuses out= of tensors it tracks)."""

    def as_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta",
                           requires_grad=differentiated(t) and (
                               t.is_floating_point() or t.is_complex()))

    args, kwargs = tree_map_only(torch.Tensor, as_meta, (args, kwargs))
    tracked = any(isinstance(t, torch.Tensor) and t.requires_grad
                  for t in tree_leaves((args, kwargs)))
    # (autograd switched back on, inside a level's dispatch, where something is tracked;
    # an out tensor's resize warns in the real call; with no meta kernel, the result's
    # cast to the out tensors is all there is to check)
    with warnings.catch_warnings(), contextlib.suppress(NotImplementedError), (
            autograd_on() if tracked else contextlib.nullcontext()):
        warnings.simplefilter("ignore")
        func(*args, **kwargs)


@per_op
def out_of_place(func: OpOverload) -> OpOverload | None:
    """The out-of-place op of an in-place one (``index_add_.default`` ->
    ``index_add.default``, the operator ``__iand__.Tensor`` -> ``__and__.Tensor``); None
    for other ops, or where aten has none."""
    name = func.overloadpacket.__name__
    if name.startswith("__i") and name.endswith("__"):
        name = "__" + name[3:]
    elif name.endswith("_"):
        name = name[:-1]
    else:
        return None
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, func._overloadname, None) if packet is not None else None


@per_op
def out_of_place_view(func: OpOverload) -> OpOverload | None:
    """The view op that ``func`` does in place if it only changes metadata (``t_`` ->
    ``t``, ``squeeze_.dim`` -> ``squeeze.dim``), else None."""
    name = func.overloadpacket.__name__
    if torch.Tag.inplace_view not in func.tags or not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    candidates = (getattr(packet, o) for o in (packet.overloads() if packet else ()))
    return next((view for view in candidates
                 if _signature(view) == _signature(func) and returns_view(view)), None)


@per_op
def gradient_flags(func: OpOverload) -> tuple[tuple[int, int], ...]:
    """For an op told which gradients to compute (``compute_input_grad``, decided by the
    caller from ``input.requires_grad``), or whether to save what its backward needs
    (CUDA's attention kernels' ``compute_log_sumexp``, decided from its tensors'):
    (flag position, tensor position) pairs."""
    names = [a.name for a in func._schema.arguments]
    flagged = [(i, n.removeprefix("compute_").removesuffix("_grad")) for i, n in enumerate(names)
               if n.startswith("compute_") and n.endswith("_grad")]
    pairs = [(i, names.index(arg)) for i, arg in flagged if arg in names]
    if "compute_log_sumexp" in names:
        flag = names.index("compute_log_sumexp")
        pairs += [(flag, names.index(t)) for t in ("query", "key", "value", "attn_bias")
                  if t in names]
    return tuple(pairs)


def bound_arguments(func: OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by name, with its defaults for those not given."""
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args))
    bound.update(kwargs)
    return bound


def _signature(func: OpOverload) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in func._schema.arguments]


def _is_inplace(func: OpOverload) -> bool:
    """Writes its first argument and returns it: the level returns the caller's tensor."""
    ret = func._schema.returns[0].alias_info if func._schema.returns else None
    return writes_first_argument(func) and bool(ret and ret.is_write)


def decomposition_of(func: OpOverload) -> Callable | None:
    """The decomposition vmap batches ``func`` by when it has no rule (None if none): one
    that differentiates as the op does, preferred in this order: PyTorch's forward-AD
    version, its composite one in aten ops, torch._decomp's."""
    if func in _no_decomposition:
        return None
    from torch._decomp import decomposition_table
    from torch._decomp.decompositions_for_jvp import decomposition_table_for_jvp

    # a norm's backward differentiated by a level outside (a Hessian through layer_norm):
    # PyTorch's version for that recomputes the saved mean and rstd from the input, which
    # the core version reads as constants, dropping their share of the derivative
    decomposition = decomposition_table_for_jvp.get(func) or decomposition_table.get(func)
    if is_composite(func) and (decomposition is None or _calls_prims(decomposition)):
        # PyTorch's own decomposition, in aten ops. A torch._refs one calls prims, whose
        # autograd kernel turns grad mode off: a grad level around the vmap would record
        # nothing (a silently zero second derivative through prelu's backward)
        return func.decompose
    return decomposition


def _calls_prims(decomposition: Callable) -> bool:
    """Whether ``decomposition`` is written with prims (those of ``torch._refs``)."""
    return getattr(decomposition, "__module__", "").startswith("torch._refs")


class VmapInfo(NamedTuple):
    """What a custom op's vmap rule (or an autograd.Function's ``vmap`` staticmethod) is
    told about the vmap level, as in torch.func."""

    batch_size: int
    randomness: str


def _custom_op_rule(level: Any, func: OpOverload, args: tuple, dims: tuple,
                    kwargs: dict) -> tuple[Any, Any]:
    """A ``torch.library.custom_op``'s own rule: the function given to its ``register_vmap``,
    called as torch.func calls it, ``rule(info, in_dims, *args, **kwargs)``."""
    rule = _maybe_get_opdef(func)._vmap_fn
    in_dims = tuple(list(d) if isinstance(d, tuple) else d for d in dims)
    result = rule(VmapInfo(level.batch_size, level.randomness), in_dims, *args, **kwargs)
    return checked_result(func, result, level.batch_size, "the vmap rule registered")


def checked_result(func: OpOverload, result: Any, size: int, rule: str) -> tuple[Any, Any]:
    """A user's rule's ``(output, out_dims)``, checked: a pair, ``out_dims`` a pytree prefix
    of the output (one out_dim per output, or one for all, as torch.func reads it), each
    batched output a batch of ``size`` examples along its out_dim. The out_dims come back
    with the output's structure (``([0, 0], None)`` for a list of tensors and an int)."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RuntimeError(
            f"vmap: {rule} for {func} must return a pair (output, out_dims); "
            f"got {type(result).__name__}."
        )
    out, out_dims = result
    outs = out if isinstance(out, (tuple, list)) else (out,)
    returns = len(func._schema.returns)
    if returns > 1 and len(outs) != returns:
        raise RuntimeError(f"vmap: {rule} for {func} returned {len(outs)} output(s); the op "
                           f"returns {returns}.")
    leaves, spec = tree_flatten(out)
    flat_dims = _broadcast_to_and_flatten(out_dims, spec)
    if flat_dims is None:
        raise RuntimeError(
            f"vmap: {rule} for {func} returned out_dims={out_dims!r}, which does not "
            "match its output: give one out_dim per output (out_dims with the output's "
            "structure), or a single int."
        )
    for k, (o, d) in enumerate(zip(leaves, flat_dims)):
        if d is not None and isinstance(o, torch.Tensor) and (
                not -o.dim() <= d < o.dim() or o.shape[d] != size):
            raise RuntimeError(
                f"vmap: {rule} for {func} returned output {k} of shape {tuple(o.shape)} with "
                f"out_dim {d}, which is not a batch of the {size} examples along that dim."
            )
    return out, tree_unflatten(flat_dims, spec)


def registered_ops() -> Iterable[OpOverload | OpOverloadPacket]:
    return _own.keys()


class UnbatchedWriteError(RuntimeError):
    """Batched values written in place into a tensor that is not batched at that level."""


def raise_inplace_unbatched_self(func) -> None:
    raise UnbatchedWriteError(
        f"vmap: {func}(self, *extra_args) is not possible because there exists a Tensor "
        "`other` in extra_args that has more elements than `self`. This happened due to "
        "`other` being vmapped over but `self` not being vmapped over in a vmap. Please try "
        f"to use out-of-place operators instead of {func}."
    )


_warned: set[OpOverload] = set()
_resize_as_ = torch.ops.aten.resize_as_.default


def reset_loop_warnings() -> None:
    """Let the slow loop warn again for ops it already warned about (for tests)."""
    _warned.clear()


def loop_rule(func: OpOverload, args: tuple, dims: tuple, kwargs: dict,
              kw_dims: dict | None = None) -> tuple[Any, Any]:
    """The fallback: run ``func`` once per example and stack the results (slow, warns).
    ``kw_dims`` are the batch dims of keyword arguments by name, if any is batched."""
    # each example would write the one unbatched tensor in turn (resize_as_ may: it reads
    # only the template's shape, the same for every example)
    if func is not _resize_as_ and any(
            dims[k] is None and isinstance(args[k], torch.Tensor)
            for k in written_positions(func) if k < len(args)):
        raise_inplace_unbatched_self(func)
    kw_dims = kw_dims or {}
    if func not in _warned:
        _warned.add(func)
        batched_keywords = [k for k, d in kw_dims.items() if d is not None]
        which = (f" with batched keyword-only arguments {batched_keywords}"
                 if batched_keywords else "")
        warnings.warn(f"no batching rule for {func}{which}; using a slow loop", stacklevel=2)
    size = batch_size(args, dims, kwargs, kw_dims)
    if size == 0:
        try:
            return no_examples(func, args, dims, kwargs, kw_dims)
        except NotImplementedError:
            raise RuntimeError(
                f"vmap over a batch of 0 examples: {func} has no batching rule, and no meta "
                "kernel to find the shape of one example's output. Skip the call for an "
                "empty batch, or write a batching rule for the op."
            ) from None
    # some kernels need contiguous inputs (pdist); ops that write or return views get views
    schema = func._schema
    contiguous = not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
    per_example = []
    for b in range(size):
        sliced = [_select(a, d, b, contiguous) for a, d in zip(args, dims)]
        sliced_kwargs = {k: _select(v, kw_dims.get(k), b, contiguous) for k, v in kwargs.items()}
        per_example.append(func(*sliced, **sliced_kwargs))
    first = per_example[0] if per_example else None
    if isinstance(first, torch.Tensor):
        return _stack(func, per_example), 0
    if isinstance(first, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in first):
        outs = [_stack(func, [r[i] for r in per_example]) for i in range(len(first))]
        return type(first)(outs), type(first)(0 for _ in outs)
    raise RuntimeError(
        f"vmap: {func} returned {type(first).__name__}, which cannot be batched by the "
        "per-example loop. Write a batching rule for it (see docs/writing-batching-rules.md)."
    )


def no_examples(func: OpOverload, args: tuple, dims: tuple, kwargs: dict,
                kw_dims: dict | None = None) -> tuple[Any, Any]:
    """What a loop over a batch of no examples gives: ``(0, *shape)`` outputs, ``shape`` that
    of one example's output, found by running ``func`` on meta tensors. For kernels that
    refuse the empty inputs a batch of none folds to (0 groups of a grouped convolution,
    batch norm over no elements...). ``kw_dims``: the keyword arguments' batch dims."""

    def meta(a, d):
        if isinstance(d, tuple):
            return [meta(t, e) for t, e in zip(a, d)]
        if not isinstance(a, torch.Tensor):
            return a
        shape = a.shape if d is None else a.shape[:d] + a.shape[d + 1:]
        return torch.empty(shape, dtype=a.dtype, device="meta")

    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    kw_dims = kw_dims or {}
    meta_args = list(map(meta, args, dims))
    meta_kwargs = {k: meta(v, kw_dims.get(k)) for k, v in kwargs.items()}
    key = _meta_call_key(func, meta_args, meta_kwargs)
    out = _META_OUTPUTS.get(key) if key is not None else None
    if out is None:
        out = func(*meta_args, **meta_kwargs)
        if key is not None:
            if len(_META_OUTPUTS) >= 1024:
                _META_OUTPUTS.clear()
            _META_OUTPUTS[key] = out
    carrier = _carrier([*args, *kwargs.values()], device)

    def batch_of_none(o):
        return carrier.new_empty((0, *o.shape), dtype=o.dtype)

    if isinstance(out, torch.Tensor):
        return batch_of_none(out), 0
    outs = [batch_of_none(o) if isinstance(o, torch.Tensor) else o for o in out]
    return type(out)(outs), tuple(0 if isinstance(o, torch.Tensor) else None for o in outs)


# One example's meta outputs of an op, by its arguments' shapes, dtypes and other values:
# PyTorch computes many through Python references, ~0.1-1 ms an op, each time vmap runs
# over no examples (a batch emptied by a mask) a function it ran over none before.
_META_OUTPUTS: dict = {}


def _meta_call_key(func: OpOverload, args: list, kwargs: dict) -> tuple | None:
    """A key naming ``func`` on these meta arguments, or None if one is not hashable."""

    def described(a):
        if isinstance(a, torch.Tensor):
            return a.shape, a.dtype
        if isinstance(a, (list, tuple)):
            return type(a), tuple(map(described, a))
        return type(a), a  # (1 and True, and 1 and 1.0, are equal keys otherwise)

    key = (func, tuple(map(described, args)),
           tuple((k, described(v)) for k, v in sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _carrier(values: Iterable, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor batched at each enclosing level that batches one of ``values`` (or
    of a list among them): tensors made with its ``new_empty`` carry those levels' batches,
    as an op's outputs would (a write into them of values batched there then works)."""
    carrier = torch.zeros((), device=device)
    for v in values:
        for t in v if type(v) is list else (v,):
            if isinstance(t, LevelTensor):
                carrier = carrier + t.new_zeros(())
    return carrier


def _stack(func: OpOverload, outs: list[torch.Tensor]) -> torch.Tensor:
    shapes = {tuple(o.shape) for o in outs}
    if len(shapes) > 1:
        raise RuntimeError(
            f"vmap: {func} gives outputs of different shapes for different examples "
            f"({sorted(shapes)[:3]}...): its output shape depends on the data, which vmap "
            "cannot batch. Compute it outside vmap, or pad to a fixed size."
        )
    return torch.stack(outs)


def _select(arg: Any, dim: Any, index: int, contiguous: bool) -> Any:
    if dim is None:
        return arg
    if isinstance(dim, tuple):
        return [_select(a, d, index, contiguous) for a, d in zip(arg, dim)]
    row = arg.select(dim, index)
    return row.contiguous() if contiguous else row


def batch_size(args: Iterable, dims: Iterable, kwargs: dict | None = None,
               kw_dims: dict | None = None) -> int:
    """The batch size, read off the first batched tensor in ``args``, or in ``kwargs``
    when ``kw_dims`` (their batch dims by name) says one of those is batched."""
    if kw_dims:
        args, dims = (*args, *kwargs.values()), (*dims, *map(kw_dims.get, kwargs))
    for a, d in zip(args, dims):
        if isinstance(d, int):
            return a.shape[d]
        if isinstance(d, tuple):
            for t, td in zip(a, d):
                if td is not None:
                    return t.shape[td]
    raise AssertionError("a batching rule was called with no batched argument")
