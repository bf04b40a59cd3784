"""The dim-argument family: reductions, scans, softmax, sort/topk and other ops with a ``dim``.

The rule reads the op's schema once to find its ``dim``/``dims`` argument. Batched
tensors go first (padded to a common logical rank, as for pointwise ops) and the dim
shifts by one. For reductions an absent or empty dim list means "every logical dim".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchlevels.batching.dims import (
    logical_rank,
    materialize,
    pad_to_rank,
    rows,
    to_front,
    wrap_dim,
)
from torchlevels.batching.registry import batch_size, per_op, register, register_family

aten = torch.ops.aten


class _DimArg(NamedTuple):
    """An op's ``dim``/``dims`` argument, read from its schema once."""

    index: int
    name: str
    default: object
    is_list: bool  # an int list (``dim=[]`` or None means every dim for a reduction)
    reduction: bool  # whether the op reduces (an absent dim means every dim)


@per_op
def _dim_arg(func) -> _DimArg | None:
    """The op's dim argument, or None."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("dim", "dims"):
            reduction = torch.Tag.reduction in func.tags or func in _UNTAGGED_REDUCTIONS
            return _DimArg(i, arg.name, arg.default_value, "List" in str(arg.type), reduction)
    return None


def dim_rule(func, args, dims, kwargs):
    """Batch an op that works along ``dim``/``dims`` of broadcast tensor inputs."""
    index, name, default, is_list, reduction = _dim_arg(func)
    tensors = [(a, d) for a, d in zip(args, dims) if isinstance(a, torch.Tensor)]
    if len(tensors) == 1 and tensors[0][0] is args[0]:  # the usual case: sum, softmax
        x, d = tensors[0]
        rank = x.dim() - (d is not None)
        phys = list(args)
        phys[0] = pad_to_rank(to_front(x, d), rank) if d is not None else x
    else:  # e.g. softmax backward, cross: every tensor gets the batch dim
        rank = max(a.dim() - (d is not None) for a, d in tensors)
        size = batch_size(args, dims)
        phys = [pad_to_rank(materialize(a, d, size), rank) if isinstance(a, torch.Tensor) else a
                for a, d in zip(args, dims)]
        dims = [0 if isinstance(a, torch.Tensor) else d for a, d in zip(args, dims)]
    scalar = rank == 0
    if scalar:  # a dim of a 0-dim tensor means "the only element": give it a real dim
        phys = [p.unsqueeze(-1) if d is not None else p for p, d in zip(phys, dims)]
    positional = index < len(args)
    dim = args[index] if positional else kwargs.get(name, default)
    if isinstance(dim, int):
        dim = wrap_dim(dim, rank) + 1
    elif dim is None or (isinstance(dim, (list, tuple)) and not dim):
        if reduction:
            if not is_list:
                return _flat_reduction(func, phys, index, kwargs, positional, scalar)
            dim = list(range(1, max(rank, 1) + 1))
    else:
        dim = [wrap_dim(d, rank) + 1 for d in dim]
    if positional:
        phys[index] = dim
    else:
        kwargs = {**kwargs, name: dim}
    out = func(*phys, **kwargs)
    return _unscalar(out, scalar)


def _flat_reduction(func, phys, index, kwargs, positional, scalar):
    """``dim=None`` for an op with an optional int dim: reduce the flattened tensor."""
    x = phys[0]
    flat = rows(x)
    args = [flat, *phys[1:]]
    if positional:
        args[index] = 1
    else:
        kwargs = {**kwargs, _dim_arg(func).name: 1}
    out = func(*args, **kwargs)
    keepdim = any(a is True for a in args[index + 1 :]) or kwargs.get("keepdim")
    if keepdim:
        shape = (x.shape[0],) + (1,) * (x.dim() - 1 - scalar)
        out = out.reshape(shape) if isinstance(out, torch.Tensor) else tuple(
            o.reshape(shape) for o in out
        )
        return out, 0 if isinstance(out, torch.Tensor) else tuple(0 for _ in out)
    return out, 0 if isinstance(out, torch.Tensor) else tuple(0 for _ in out)


def _unscalar(out, scalar):
    def fix(o):
        return o.squeeze(-1) if scalar and o.dim() == 2 else o

    if isinstance(out, torch.Tensor):
        return fix(out), 0
    return type(out)(fix(o) for o in out), tuple(0 for _ in out)


def _has_dim_arg(func) -> bool:
    return torch.Tag.reduction in func.tags and _dim_arg(func) is not None


register_family("reduction", _has_dim_arg, dim_rule)

# Ops that work along a dim without the reduction tag: one line declares them all.
register(
    aten._softmax, aten._log_softmax, aten._safe_softmax, aten._softmax_backward_data,
    aten._log_softmax_backward_data, aten.cumsum, aten.cumprod, aten.logcumsumexp,
    aten.cummax, aten.cummin, aten.sort, aten.argsort, aten.topk, aten.kthvalue, aten.flip,
    aten.median.dim, aten.nanmedian.dim, aten.mode, aten.glu,
    aten.cumsum_, aten.cumprod_, aten.squeeze.dim, aten.squeeze.dims,
    aten.glu_backward, aten.glu_jvp, aten.glu_backward_jvp, aten.logsumexp, aten.nansum,
    aten.count_nonzero, aten._fft_c2c, aten._fft_r2c, aten._fft_c2r, aten.hash_tensor,
)(dim_rule)
_UNTAGGED_REDUCTIONS = {aten.hash_tensor.default}  # an empty dim list means every dim


@register(aten.linalg_cross)
def linalg_cross(func, args, dims, kwargs):
    """``linalg.cross``: along ``dim`` of broadcast inputs, which must be of one rank."""
    if logical_rank(args[0], dims[0]) != logical_rank(args[1], dims[1]):
        raise RuntimeError("linalg.cross: inputs must have the same number of dimensions.")
    return dim_rule(func, args, dims, kwargs)


def _full(reduce_flat):
    """A rule for a reduction over every element, given how to reduce a (B, N) tensor."""

    def rule(func, args, dims, kwargs):
        x = to_front(args[0], dims[0])
        return reduce_flat(rows(x), *args[1:], **kwargs), 0

    return rule


register(aten.sum.default)(_full(lambda x, dtype=None: x.sum(1, dtype=dtype)))
register(aten.mean.default)(_full(lambda x, dtype=None: x.mean(1, dtype=dtype)))
register(aten.prod.default)(_full(lambda x, dtype=None: x.prod(1, dtype=dtype)))
register(aten.max.default)(_full(lambda x: x.amax(1)))
register(aten.min.default)(_full(lambda x: x.amin(1)))
register(aten.all.default)(_full(lambda x: x.all(1)))
register(aten.any.default)(_full(lambda x: x.any(1)))
register(aten.median.default)(_full(lambda x: x.median(1).values))
register(aten.nanmedian.default)(_full(lambda x: x.nanmedian(1).values))
register(aten.norm.Scalar)(_full(lambda x, p=2: torch.linalg.vector_norm(x, p, dim=1)))


@register(aten.renorm, aten.renorm_)
def renorm(func, args, dims, kwargs):
    """Norms are over every dim but ``dim``: fold ``dim`` into the batch, not the batch into it."""
    x, p, d, maxnorm = args
    x = to_front(x, dims[0])
    d = wrap_dim(d, x.dim() - 1) + 1
    moved = x.movedim(d, 1)
    flat = moved.reshape(moved.shape[0] * moved.shape[1], *moved.shape[2:])
    out = torch.renorm(flat, p, 0, maxnorm).reshape(moved.shape).movedim(1, d)
    if func is aten.renorm_.default:
        return x.copy_(out), 0
    return out, 0


@register(aten.segment_reduce.default, aten._segment_reduce_backward.default,
          keyword_dims=True)
def segment_reduce(func, args, dims, kwargs, kw_dims=None):
    """Each example's segments, by its own ``lengths`` or ``offsets`` or by shared ones:
    the batch becomes the first dim of the data and of the lengths (whose last dim is the
    reduction's axis, as PyTorch requires), and the axis moves one along."""
    size = batch_size(args, dims, kwargs, kw_dims)
    kw_dims = kw_dims or {}
    phys = [materialize(a, d, size) if isinstance(a, torch.Tensor) else a
            for a, d in zip(args, dims)]
    data = phys[0] if func is aten.segment_reduce.default else phys[2]  # backward: grad, out
    options = {k: materialize(v, kw_dims.get(k), size) if isinstance(v, torch.Tensor) else v
               for k, v in kwargs.items()}
    options["axis"] = wrap_dim(kwargs.get("axis", 0), data.dim() - 1) + 1
    return func(*phys, **options), 0


@register(aten.histc.default)
def histc(func, args, dims, kwargs):
    """Each example's histogram, in one pass over the batch.

    As ``torch.histc``: each example's range is ``[min, max]``, or its own extremes when
    ``min == max``, widened by 1 each way when they are equal too; an element's bin is
    ``(x - min) * bins / (max - min)`` truncated, computed in the input's dtype (its float
    on CUDA, as CUDA's kernel does), the top edge in the last bin; elements out of range
    and NaN count nowhere. The bins of the whole batch are then filled by one
    ``scatter_add``. Only ``self`` is a tensor, so only it can be batched.
    """
    x, bins, low, high = (*args, *_HISTC_DEFAULTS[len(args):])
    func(x.new_empty(0), bins, low, high)  # torch's own errors: dtype, bins, min > max
    x = rows(to_front(x, dims[0]))
    size, n = x.shape
    if n == 0:
        return x.new_zeros(size, bins), 0
    if low == high:
        low, high = (t.double() for t in torch.aminmax(x, dim=1))
    else:
        low, high = (torch.full((size,), v, dtype=torch.float64, device=x.device)
                     for v in (low, high))
    equal = low == high
    low, high = torch.where(equal, low - 1, low), torch.where(equal, high + 1, high)
    finite = low.isfinite() & high.isfinite()
    if not torch._is_all_true(finite):  # one answer for the batches of enclosing levels too
        raise RuntimeError(_histc_range_error(low, high, finite))
    compute = x.dtype
    if x.device.type != "cpu" and x.element_size() < 4:
        compute = torch.float32
    low, high = (t.to(x.dtype).to(compute)[:, None] for t in (low, high))
    x = x.to(compute)
    inside = (x >= low) & (x <= high)  # False for NaN
    pos = ((x - low) * bins / (high - low)).to(torch.int64).clamp_(0, bins - 1)
    pos = torch.where(inside, pos, 0) + torch.arange(size, device=x.device)[:, None] * bins
    hist = torch.zeros(size * bins, dtype=args[0].dtype, device=x.device)
    # out of place: x may be a tensor of an enclosing vmap level, which hist is not
    return hist.scatter_add(0, pos.flatten(), inside.flatten().to(hist.dtype)).view(size, bins), 0


_HISTC_DEFAULTS = (None, 100, 0, 0)  # aten.histc(self, bins=100, min=0, max=0)


def _histc_range_error(low, high, finite) -> str:
    """torch.histc's message for a range that is not finite, naming the example (values of
    a batch of an enclosing vmap cannot be read)."""
    if type(finite) is not torch.Tensor:
        return "torch.histc: range is not finite (in an example of the vmap batch)"
    bad = (~finite).nonzero()[0, 0]
    return (f"torch.histc: range of [{low[bad].item()}, {high[bad].item()}] is not finite "
            f"(in example {bad.item()} of the vmap batch)")
