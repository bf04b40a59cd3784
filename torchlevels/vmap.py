"""vmap: the batched level and its public function / context manager.

A batched tensor of level ``B`` is a wrapper whose logical shape is its inner tensor's
shape without the batch dim ``_bdim``. ``B``'s ``__torch_dispatch__`` unwraps the
arguments that are ``B``'s own, finds the op's batching rule (see batching/registry.py),
runs it on the inner tensors (which may belong to enclosing levels and dispatch there)
and wraps the outputs that carry a batch dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._pytree import TreeSpec, _broadcast_to_and_flatten, tree_flatten, tree_unflatten

from torchlevels import batching  # noqa: F401  (registers the rules)
from torchlevels._dim_inputs import accepts_dims
from torchlevels._level import (
    Level,
    LevelTensor,
    autograd_on,
    data_property,
    entered,
    lazy_bits_on,
    new_level_class,
    new_wrapper,
    preserved_dispatch_keys,
    refuse_backward,
    refuse_functional,
    requires_grad_flag,
    resolved,
    set_logical_meta,
    show_lazy_bits,
    through,
    tracked_outside,
    wraps,
)
from torchlevels._torch_compile import eager
from torchlevels.batching import predispatch, shortcuts
from torchlevels.batching.dims import materialize, pad_to_rank, refuse_dtypes_the_kernel_refuses
from torchlevels.batching.pointwise import broadcasting
from torchlevels.batching.registry import (
    How,
    Resolved,
    loop_rule,
    no_examples,
    out_arguments,
    resolve,
    resolved_by_id,
    written_arguments,
)
from torchlevels.batching.shortcuts import wrap_all_front
from torchlevels.inner_duals import primals

RANDOMNESS = ("error", "different", "same")


def _check_randomness(randomness: str) -> None:
    if randomness not in RANDOMNESS:
        raise RuntimeError(
            "Only allowed values for randomness are 'error', 'different', or 'same'. "
            f"Got {randomness}"
        )


class BatchLevel(Level):
    """One vmap invocation: its batch size (fixed by the first wrapped tensor) and randomness."""

    kind = "vmap"

    def __init__(self, randomness: str = "error", batch_size: int | None = None) -> None:
        super().__init__()
        _check_randomness(randomness)
        self.randomness = randomness
        self.batch_size = batch_size

    def describe(self) -> str:
        return f"vmap (batch size {self.batch_size}, created at {self.where})"

    # -- entering and leaving the level ------------------------------------------------
    def wrap(self, cls: type[LevelTensor], tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{cls.__name__}(t, dim): t must be a Tensor, got {type(tensor)}")
        if not isinstance(dim, int):
            raise TypeError(f"{cls.__name__}(t, dim={dim!r}): dim must be an int, got "
                            f"{type(dim).__name__}")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(
                f"{cls.__name__}(t, dim={dim}): t has {tensor.dim()} dims, so dim must satisfy "
                f"-{tensor.dim()} <= dim < {tensor.dim()}"
            )
        dim %= tensor.dim()
        size = tensor.shape[dim]
        if self.batch_size is None:
            self.batch_size = size
        elif size != self.batch_size:
            raise ValueError(
                "vmap: Expected all tensors to have the same size in the mapped dimension, "
                f"got sizes {[self.batch_size, size]} for the mapped dimension"
            )
        return wrap_batched(cls, tensor, dim)

    def unwrap(self, cls: type[LevelTensor], tensor: Any, out_dim: int | None = 0) -> Any:
        if type(tensor) is not cls:
            inner_level = type(tensor)
            if issubclass(inner_level, cls) and inner_level._level.alive:
                raise ValueError(
                    f"{cls.__name__}.unwrap: the tensor is of a live level inside this one, "
                    f"{inner_level._level.describe()}: unwrap it with that level first "
                    "(innermost first)")
            if out_dim is None or not isinstance(tensor, torch.Tensor):
                return tensor
            if wraps(tensor, cls):  # its ops on ours ran inside it
                return through(tensor, lambda t: self.unwrap(cls, t, out_dim))
            if self.batch_size is None:
                raise ValueError(
                    f"{cls.__name__}.unwrap: the tensor is not batched at this level, and the "
                    "level has no batch size to expand it to yet: it takes the size of the "
                    f"first tensor wrapped with {cls.__name__}(t, dim). Wrap one first, or "
                    "pass out_dim=None to get the tensor back as it is.")
            out_dim = _checked_out_dim(out_dim, tensor, cls)
            sizes = [-1] * (tensor.dim() + 1)
            sizes[out_dim] = self.batch_size
            return tensor.unsqueeze(out_dim).expand(sizes)
        if out_dim is None:
            raise ValueError(
                "vmap: a batched tensor cannot be returned with out_dim=None; "
                "only unbatched outputs may use out_dims=None"
            )
        inner = tensor._inner
        out_dim = _checked_out_dim(out_dim, tensor, cls)
        if out_dim == tensor._bdim:
            return inner  # as torch.func does: no identity permute in eager or in a trace
        return inner.movedim(tensor._bdim, out_dim)

    def rewrap(self, cls, tensor: torch.Tensor) -> torch.Tensor:
        """A new tensor object for the same batched value (no op is dispatched)."""
        return wrap_batched(cls, tensor._inner, tensor._bdim)

    # -- the hot path: one op -----------------------------------------------------------
    def dispatch(self, cls, func, args, kwargs):
        rule = resolved_by_id.get(id(func)) or resolve(func)
        if rule.family == "pointwise" and not rule.inplace:
            out = _pointwise_fast_path(cls, func, args, kwargs)
            if out is not None:
                return out
        if rule.how is How.DECOMPOSITION:
            refuse_dtypes_the_kernel_refuses(func, args, (None,) * len(args), kwargs or {})
            if torch.is_grad_enabled() and unwrap_args(cls, args)[2] and not out_arguments(func):
                # pieces on a tracked plain tensor alone reach no level: autograd records
                # them here, or the result would lose the graph to it (x[i] in a where);
                # an out= op's own handling refuses tracked tensors as autograd does
                with autograd_on():
                    return rule.fn(*args, **kwargs)
            return rule.fn(*args, **kwargs)
        phys, dims, grad = unwrap_args(cls, args)
        if rule.inplace and phys and isinstance(phys[0], torch.Tensor) and (
                phys[0].is_inference() and not torch.is_inference_mode_enabled()):
            raise RuntimeError(_INFERENCE_WRITE)  # PyTorch checks this above the levels
        kw_dims = None
        if kwargs and any(type(v) is cls for v in kwargs.values()):
            rule, kwargs, kw_dims, kw_grad = _batched_keywords(cls, rule, kwargs)
            grad = grad or kw_grad
        if self.batch_size == 0 and not grad and _computes_new_values(func):
            # Some kernels refuse, or crash on, the empty inputs a batch of no examples
            # folds to (a grouped convolution of 0 groups, batch norm's backward): give
            # what a loop over none gives, when one example's output shapes can be found.
            try:
                return wrap_outputs(cls, func, False, args,
                                    *no_examples(func, phys, dims, kwargs, kw_dims))
            except Exception:
                pass  # no meta kernel, or a data-dependent shape: the rule decides
        if (grad or rule.view) and torch.is_grad_enabled():
            # Record autograd on the inner tensors, so autograd outside vmap sees the graph.
            # A view is made as autograd's view of its base even when nothing requires
            # grad yet: a tracked value written through it later must reach the base.
            with autograd_on():
                if self.hosts_jvp and fwAD._current_level >= 0:
                    # the plain duals a jvp level inside made: the rule's ops, run with
                    # autograd on, would run their forward formulas again (see
                    # torchlevels.inner_duals); the primals keep autograd outside's graph
                    phys = primals(phys, fwAD._current_level, written=True)
                out, out_dims = self._apply(rule, func, phys, dims, kwargs)
                if grad:
                    out, out_dims = _shared_outputs_copied(cls, out, out_dims, phys, kwargs)
        else:
            with preserved_dispatch_keys():
                lazy_bits_on()
                out, out_dims = self._apply(rule, func, phys, dims, kwargs)
        return wrap_outputs(cls, func, rule.inplace, args, out, out_dims)

    def _apply(self, rule, func, phys, dims, kwargs):
        if rule.takes_level:
            return rule.fn(self, func, phys, dims, kwargs)
        return rule.fn(func, phys, dims, kwargs)

    def composite(self, cls, func, rule, args, kwargs):
        """Apply a composite op's rule (see batching/composite.py), or let it decompose."""
        phys, dims, _ = unwrap_args(cls, args)
        with predispatch.unintercepted():  # the rule's own linear/matmul go straight through
            result = rule(func, phys, dims, kwargs)
        if result is NotImplemented:
            return func.decompose(*args, **kwargs)
        return wrap_outputs(cls, func, False, args, *result)


_INFERENCE_WRITE = (  # PyTorch's error
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a "
    "clone to get a normal tensor before doing inplace update.See "
    "https://github.com/pytorch/rfcs/pull/17 for more details.")


def _batched_keywords(cls, rule: Resolved, kwargs: dict) -> tuple[Resolved, dict, dict, bool]:
    """For an op given a batched tensor as a keyword-only argument (``searchsorted``'s
    ``sorter``, ``segment_reduce``'s ``lengths``): the rule to run, the physical keyword
    arguments, their batch dims by name, and whether one needs grad outside. The rule is
    the op's own if it takes the keywords' batch dims, else the per-example loop, which
    takes them apart too."""
    phys, dims, grad = unwrap_args(cls, tuple(kwargs.values()))
    kw_dims = dict(zip(kwargs, dims))
    if rule.keyword_dims:
        rule = dataclasses.replace(rule, fn=functools.partial(rule.fn, kw_dims=kw_dims))
    else:
        rule = Resolved(How.LOOP, functools.partial(loop_rule, kw_dims=kw_dims),
                        inplace=rule.inplace, view=rule.view)
    return rule, dict(zip(kwargs, phys)), kw_dims, grad


@functools.cache
def _computes_new_values(func) -> bool:
    """Whether ``func`` returns fresh tensors computed from its arguments and nothing
    else: it writes no argument, returns no view of one and draws no random numbers."""
    schema = func._schema
    return (not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
            and torch.Tag.nondeterministic_seeded not in func.tags)


def wrap_outputs(cls, func, inplace: bool, args, out, out_dims):
    """Wrap a rule's physical outputs that have a batch dim as tensors of level ``cls``."""
    if type(out_dims) is int:
        if type(out) is not torch.Tensor and isinstance(out, (tuple, list)):
            out_dims = (out_dims,) * len(out)  # one batch dim for every output
        elif inplace and type(args[0]) is cls:
            self_ = args[0]
            _refuse_tracked_leaf(func, self_._inner)
            if out is not self_._inner:  # e.g. squeeze_: the wrapper takes the new view
                _rewrap_inplace(self_, out, out_dims)
            return self_
        else:
            return wrap_batched(cls, out, out_dims)
    if out_dims is None:
        return out
    written = written_arguments(func)
    wrapped = []
    for i, (o, d) in enumerate(zip(out, out_dims)):
        k = written[i] if i < len(written) else None
        if d is None:
            wrapped.append(o)
        elif k is not None and k < len(args) and type(args[k]) is cls:  # written: as is
            wrapped.append(args[k])
        elif isinstance(d, (tuple, list)):  # a list of tensors among the outputs
            wrapped.append(wrap_outputs(cls, func, False, (), o, d))
        else:
            wrapped.append(wrap_batched(cls, o, d))
    return type(out)(wrapped)


def _shared_outputs_copied(cls, out: Any, out_dims: Any, args: tuple, kwargs: dict
                           ) -> tuple[Any, Any]:
    """A rule's outputs, with each differentiable one that is the same for every example
    (lstsq's empty residuals) and not an argument as contiguous batched copies, for an
    op that autograd records around this level: returned plain, an output would take the
    node autograd records on this level's tensors, which a backward pass after the level
    exits cannot run. Runs under ``autograd_on``, so the copies keep the output's graph."""
    given = [*args, *kwargs.values()]

    def copied(o: Any, d: Any) -> tuple[Any, Any]:
        if d is not None or type(o) is not torch.Tensor or not (
                o.is_floating_point() or o.is_complex()) or any(o is a for a in given):
            return o, d
        return materialize(o, None, cls._level.batch_size).contiguous(), 0

    if isinstance(out, torch.Tensor):
        return copied(out, out_dims)
    if type(out_dims) is int or not isinstance(out, (tuple, list)) or None not in out_dims:
        return out, out_dims
    outs, dims = zip(*(copied(o, d) for o, d in zip(out, out_dims)))
    return type(out)(outs), type(out_dims)(dims)


def _pointwise_fast_path(cls, func, args, kwargs):
    """The common pointwise case in one pass: our tensors batched at dim 0, other tensors
    of no more dims than the examples (they broadcast against them as they are), nothing
    that autograd outside tracks. Examples of fewer dims than others get size-1 dims after
    the batch dim, so that they broadcast as they would unbatched."""
    phys = []
    rank = low = 0  # the most and the fewest dims of our physical tensors
    others = 0  # one more than the most dims of another tensor
    for a in args:
        if type(a) is cls:
            inner = a._inner
            if a._bdim or (requires_grad_flag(inner) and tracked_outside(inner)):
                return None
            r = inner.dim()
            rank, low = max(rank, r), min(low, r) if low else r
            phys.append(inner)
        elif isinstance(a, torch.Tensor):
            if (requires_grad_flag(a) and tracked_outside(a)) or a._is_zerotensor() or (
                    a.is_conj() or a.is_neg()):
                return None
            others = max(others, a.dim() + 1)
            phys.append(a)
        else:
            phys.append(a)
    if not rank:  # our tensor was in kwargs: not this path
        return None
    if rank == low and not others:  # (the kernel itself: an OpOverload's call adds a frame)
        return wrap_all_front(cls, func._op(*phys, **kwargs))
    if others > rank or low == 1:
        # another tensor outranks the examples, or 0-dim examples (whose dtype promotes
        # as a dimensioned tensor's) meet others: the rule decides
        return None
    if rank != low:
        phys = [pad_to_rank(p, rank - 1) if type(a) is cls else p for a, p in zip(args, phys)]
    return wrap_all_front(cls, broadcasting(func, phys, kwargs))


def wrap_batched(cls, inner: torch.Tensor, bdim: int) -> torch.Tensor:
    """A tensor of vmap level ``cls`` whose batch dim is ``bdim`` of ``inner`` (a negative
    one counts from the end, as a rule may give it)."""
    if bdim < 0:
        bdim += inner.dim()
    out = new_wrapper(cls, inner, bdim)
    out._inner = inner
    out._bdim = bdim
    show_lazy_bits(out, inner)
    return out


def unwrap_args(cls, args: tuple) -> tuple[list, list, bool]:
    """Physical args, their batch dims, and whether any requires grad for autograd outside
    (a grad level's own leaves do not: that level records its ops on our tensors)."""
    phys = []
    dims = []
    grad = False
    for a in args:
        if type(a) is cls:
            inner = a._inner
            phys.append(inner)
            dims.append(a._bdim)
            # the flag first: the usual answer, without a Python call, on every op's arguments
            grad = grad or (requires_grad_flag(inner) and tracked_outside(inner))
        elif type(a) is list and any(type(t) is cls for t in a):
            phys.append([t._inner if type(t) is cls else t for t in a])
            dims.append(tuple(t._bdim if type(t) is cls else None for t in a))
            grad = grad or any(isinstance(t, torch.Tensor) and tracked_outside(t)
                               for t in phys[-1])
        else:
            if isinstance(a, torch.Tensor):
                if a._is_zerotensor():
                    a = _zeros(a)
                grad = grad or tracked_outside(a)
            phys.append(a)
            dims.append(None)
    return phys, dims, grad


def _zeros(zero: torch.Tensor) -> torch.Tensor:
    """A ZeroTensor (the tangent forward AD makes for an argument without one) as real
    zeros: inside ``__torch_dispatch__`` its dispatch key is off, and a kernel that a rule
    calls on it (``dot`` run as ``mv``) would read memory it does not have."""
    return torch.zeros(zero.shape, dtype=zero.dtype, device=zero.device)


def _refuse_tracked_leaf(func, inner: torch.Tensor) -> None:
    """Autograd's check of an in-place ``func`` that only changes the metadata of ``inner``
    (``squeeze_``, ``t_``), which no kernel then runs on for autograd to check: a leaf that
    autograd tracks, or a view of one, is not written in place."""
    if not (requires_grad_flag(inner) and torch.is_grad_enabled()
            and torch.Tag.inplace_view in func.tags and tracked_outside(inner)):
        return
    if inner.is_leaf:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                           "operation.")
    if inner._is_view() and inner._base.is_leaf:
        raise RuntimeError("a view of a leaf Variable that requires grad is being used in "
                           "an in-place operation.")


def _rewrap_inplace(self: torch.Tensor, inner: torch.Tensor, bdim: int) -> None:
    """Point the batched ``self`` at ``inner``, updating its logical shape in place."""
    bdim %= inner.dim()
    self._inner = inner
    self._bdim = bdim
    shape, strides = inner.shape, inner.stride()
    set_logical_meta(self, shape[:bdim] + shape[bdim + 1 :], strides[:bdim] + strides[bdim + 1 :],
                     inner.storage_offset())


# -- the public API -----------------------------------------------------------------------


def _batched_data(t: torch.Tensor) -> torch.Tensor:
    """``t.data`` for a batched tensor: the same values, detached (torch.func refuses
    ``.data`` under vmap)."""
    return wrap_batched(type(t), t._inner.detach(), t._bdim)


def _batched_detach_(t: torch.Tensor) -> torch.Tensor:
    """``t.detach_()`` for a batched tensor: its values, detached from now on (PyTorch
    handles ``detach_`` above the dispatcher's Python key, so the level would not see it)."""
    t._inner = t._inner.detach()
    return t


def valid_chunk_size(chunk_size: Any) -> bool:
    """Whether ``chunk_size`` (of vmap or jacrev) is None or an int above 0 (not a bool)."""
    return chunk_size is None or (type(chunk_size) is not bool and isinstance(chunk_size, int)
                                  and chunk_size > 0)


def new_batch_class(randomness: str = "error", batch_size: int | None = None) -> type:
    """The class of a fresh vmap level (not yet entered)."""
    level = BatchLevel(randomness, batch_size)
    return new_level_class(level, "BatchedTensor", classmethod(shortcuts.torch_function),
                           data=data_property(_batched_data),
                           detach_=_batched_detach_, backward=refuse_backward)


@contextlib.contextmanager
def batch_level(randomness: str = "error", batch_size: int | None = None) -> Iterator[type]:
    """Enter a fresh vmap level; yields its class (see :func:`vmap` with no function)."""
    with entered(new_batch_class(randomness, batch_size)) as cls, predispatch.hook():
        yield cls


class _LevelBlock:
    """What ``vmap()`` returns: a context manager entering one fresh vmap level, once
    (contextlib's would raise a bare AttributeError if entered again)."""

    def __init__(self, randomness: str) -> None:
        self._randomness = randomness
        self._block: Any = None

    def __enter__(self) -> type:
        if self._block is not None:
            raise RuntimeError(
                "vmap(): this context manager was entered already. Each `with vmap() as B` "
                "block makes its own level: call vmap() again for another block."
            )
        self._block = batch_level(self._randomness)
        return self._block.__enter__()

    def __exit__(self, *exc: object) -> Any:
        return self._block.__exit__(*exc)


def vmap(
    func: Callable | None = None,
    in_dims: Any = 0,
    out_dims: Any = 0,
    randomness: str = "error",
    *,
    chunk_size: int | None = None,
) -> Any:
    """Vectorize ``func`` over a batch dimension of its inputs (a drop-in for torch.func.vmap).

    ``in_dims`` and ``out_dims`` are pytree prefixes of the inputs and outputs: an int
    names the mapped dim, None leaves that input unbatched. Keyword arguments are not
    mapped. ``randomness`` is "error" (random ops raise), "different" (each example draws
    its own numbers) or "same" (one draw shared by all examples). ``chunk_size`` runs the
    batch in chunks of that many examples to bound memory.

    With no function, ``vmap()`` is a context manager yielding the level's class ``B``:
    ``B(t, dim=0)`` makes a batched tensor and ``B.unwrap(t, out_dim=0)`` takes it back.

    Example::

        >>> import torch
        >>> from torchlevels import vmap
        >>> x, y = torch.randn(5, 3), torch.randn(5, 3)
        >>> torch.allclose(vmap(torch.dot)(x, y), (x * y).sum(1))
        True
        >>> xs, ys = torch.randn(10, 2), torch.randn(15, 2)  # random ops inside would raise
        >>> with vmap() as B0, vmap() as B1:
        ...     z = B0(xs) + B1(ys)
        ...     B0.unwrap(B1.unwrap(z)).shape
        torch.Size([10, 15, 2])
    """
    _check_randomness(randomness)
    if func is None:
        return _LevelBlock(randomness)
    if not valid_chunk_size(chunk_size):
        raise ValueError(f"vmap: chunk_size should be None or an int greater than 0 (got "
                         f"{chunk_size!r})")

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        flat_args, flat_dims, spec, size = _flat_inputs(func, in_dims, args)
        if chunk_size is None or not size:
            return _vmap_call(func, flat_args, flat_dims, spec, kwargs, out_dims, randomness, size)
        # chunks, even one: the outputs are new tensors (concatenated), as in torch.func
        return _chunked_call(
            func, flat_args, flat_dims, spec, kwargs, out_dims, randomness, size, chunk_size
        )

    return eager(accepts_dims(wrapped), "vmap")


def _name(func: Callable) -> str:
    if isinstance(func, functools.partial):
        return f"functools.partial({_name(func.func)}, ...)"
    return getattr(func, "__name__", repr(func))


def _flat_inputs(func, in_dims, args) -> tuple[list, list, Any, int]:
    """The inputs as a flat list, their batch dims, the pytree spec (None when each of
    ``args`` is a tensor mapped over a dim or an input not mapped at all: the common
    cases, without pytree work) and the batch size."""
    dims = (in_dims,) * len(args) if type(in_dims) is int else in_dims
    if type(dims) is tuple and len(dims) == len(args):
        sizes = set()
        for a, d in zip(args, dims):
            if d is None:
                continue  # passed as it is, a pytree or not
            if (type(d) is not int or type(a) is not torch.Tensor or a.is_nested
                    or not -a.dim() <= d < a.dim()):
                break  # the general path raises the error (a nested tensor's too), or flattens
            refuse_functional("vmap", a)
            sizes.add(a.shape[d])
        else:
            if len(sizes) == 1:
                flat_dims = [None if d is None else d % a.dim() for a, d in zip(args, dims)]
                return list(args), flat_dims, None, sizes.pop()
    name = _name(func)
    if not isinstance(in_dims, (int, tuple)):
        raise ValueError(
            f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): expected `in_dims` to be int or "
            f"a (potentially nested) tuple matching the structure of inputs, got: {type(in_dims)}."
        )
    if len(args) == 0:
        raise ValueError(
            f"vmap({name})(<inputs>): got no inputs. Maybe you forgot to add inputs, or you "
            "are trying to vmap over a function with no inputs. The latter is unsupported."
        )
    flat_args, spec = tree_flatten(args)
    flat_dims = _broadcast_prefix(in_dims, spec)
    if flat_dims is None:
        raise ValueError(
            f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): in_dims is not compatible with "
            f"the structure of `inputs`. in_dims has structure {tree_flatten(in_dims)[1]} but "
            f"inputs has structure {spec}."
        )
    sizes = []
    for i, (arg, dim) in enumerate(zip(flat_args, flat_dims)):
        if dim is None:
            continue
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(
                f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for an input "
                "but in_dim must be either an integer dimension or None."
            )
        if not isinstance(arg, torch.Tensor):
            raise ValueError(
                f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for an input "
                f"but the input is of type {type(arg)}. We cannot vmap over non-Tensor "
                "arguments, please use None as the respective in_dim"
            )
        if arg.is_nested:
            raise NotImplementedError(
                f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): input {i} is a nested tensor "
                "(torch.nested), which torchlevels' vmap cannot map over. Map over its "
                "components instead (torch.nested.as_nested_tensor([f(t) for t in "
                "nt.unbind()])), or vmap over a padded tensor (nt.to_padded_tensor(0.0))."
            )
        refuse_functional("vmap", arg)
        if not -arg.dim() <= dim < arg.dim():
            raise ValueError(
                f"vmap({name}, in_dims={in_dims}, ...)(<inputs>): Got in_dim={dim} for some "
                f"input, but that input is a Tensor of dimensionality {arg.dim()} so expected "
                f"in_dim to satisfy -{arg.dim()} <= in_dim < {arg.dim()}."
            )
        flat_dims[i] = dim % arg.dim()
        sizes.append(arg.shape[flat_dims[i]])
    if not sizes:
        raise ValueError(
            f"vmap: Expected at least one Tensor to vmap over: vmap({name}, in_dims={in_dims}, "
            "...)(<inputs>) maps no input over a dim. Give the tensors to map over an int "
            "in_dim (None leaves an input unbatched).")
    if any(s != sizes[0] for s in sizes):
        raise ValueError(
            "vmap: Expected all tensors to have the same size in the mapped dimension, "
            f"got sizes {sizes} for the mapped dimension"
        )
    return flat_args, flat_dims, spec, sizes[0]


def _checked_out_dim(out_dim: int, example: torch.Tensor, cls: type) -> int:
    """``out_dim`` counted from the front of the batched output of level ``cls`` whose
    examples are shaped as ``example``; an error naming vmap's out_dims (or, for a level
    entered by ``with vmap() as B``, ``B.unwrap``'s out_dim) if it is not a dim of it."""
    rank = example.dim() + 1
    if isinstance(out_dim, int) and -rank <= out_dim < rank:
        return out_dim % rank
    name = "vmap: out_dims" if cls._level.functional else f"{cls.__name__}.unwrap: out_dim"
    if not isinstance(out_dim, int):
        raise TypeError(f"{name}={out_dim!r}: out_dim must be an int (or None for a tensor "
                        f"that is not batched), got {type(out_dim).__name__}")
    # torch.func raises TypeError for a dim no int64 holds, IndexError for the others
    error = IndexError if -2**63 <= out_dim < 2**63 else TypeError
    raise error(
        f"{name}={out_dim} is out of range for an output of shape {tuple(example.shape)} "
        f"per example: with the batch dim it has {rank} dims, so out_dim must be in "
        f"[{-rank}, {rank - 1}]"
    )


def _broadcast_prefix(prefix: Any, spec: TreeSpec) -> list | None:
    """``prefix`` (in_dims or out_dims) broadcast to the leaves of ``spec``, or None."""
    if prefix is None or isinstance(prefix, int):
        return [prefix] * spec.num_leaves
    return _broadcast_to_and_flatten(prefix, spec)


def _one_tensors_out_dims(out: Any, out_dims: Any) -> Any:
    """``out_dims`` for the output ``out``: for a single tensor, ``(d,)`` means ``d``, as
    torch.func reads it."""
    if isinstance(out, torch.Tensor) and type(out_dims) is tuple and len(out_dims) == 1:
        return out_dims[0]
    return out_dims


def _vmap_call(func, flat_args, flat_dims, spec, kwargs, out_dims, randomness, size):
    with entered(new_batch_class(randomness, size)) as B, predispatch.hook():
        B._level.functional = True
        batched = [a if d is None else wrap_batched(B, resolved(a), d)
                   for a, d in zip(flat_args, flat_dims)]
        out = func(*(batched if spec is None else tree_unflatten(batched, spec)), **kwargs)
        out_dims = _one_tensors_out_dims(out, out_dims)
        if type(out) is B and type(out_dims) is int:  # one batched tensor: no pytree work
            return B._level.unwrap(B, out, out_dims)
        flat_out, out_spec = tree_flatten(out)
        flat_out_dims = _broadcast_prefix(out_dims, out_spec)
        name = _name(func)
        if flat_out_dims is None:
            raise ValueError(
                f"vmap({name}, ..., out_dims={out_dims})(<inputs>): out_dims is not compatible "
                f"with the structure of `outputs`. out_dims has structure "
                f"{tree_flatten(out_dims)[1]} but outputs has structure {out_spec}."
            )
        results = []
        for o, d in zip(flat_out, flat_out_dims):
            if d is not None and not isinstance(d, int):
                raise ValueError(
                    f"vmap({name}, ..., out_dims={out_dims}): `out_dims` must be an int, None or "
                    "a python collection of ints representing where in the outputs the vmapped "
                    "dimension should appear."
                )
            if not isinstance(o, torch.Tensor):
                if d is None:
                    results.append(o)
                    continue
                raise ValueError(
                    f"vmap({name}, ...): `{name}` must only return Tensors, got type {type(o)}. "
                    "Did you mean to set out_dims= to None for output?"
                )
            if d is None and type(o) is B:
                raise ValueError(
                    f"vmap({name}, ...): `{name}` can not return a BatchedTensor when out_dim "
                    "is None"
                )
            results.append(B._level.unwrap(B, o, d))
        return tree_unflatten(results, out_spec)


def _chunked_call(func, flat_args, flat_dims, spec, kwargs, out_dims, randomness, size, chunk):
    starts = range(0, size, chunk)
    rng = torch.random.get_rng_state() if randomness == "same" else None
    pieces = []
    for start in starts:
        if rng is not None:
            torch.random.set_rng_state(rng)
        args = [a if d is None else a.narrow(d, start, min(chunk, size - start))
                for a, d in zip(flat_args, flat_dims)]
        n = min(chunk, size - start)
        pieces.append(_vmap_call(func, args, flat_dims, spec, kwargs, out_dims, randomness, n))
    flat_pieces = [tree_flatten(p)[0] for p in pieces]
    out_spec = tree_flatten(pieces[0])[1]
    flat_out_dims = _broadcast_prefix(_one_tensors_out_dims(pieces[0], out_dims), out_spec)
    merged = [
        pieces_i[0] if d is None else torch.cat(pieces_i, dim=d)
        for pieces_i, d in zip(zip(*flat_pieces), flat_out_dims)
    ]
    return tree_unflatten(merged, out_spec)

