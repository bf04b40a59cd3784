"""Own rules for neural-network ops: convolution, pooling, norms, losses, upsampling, padding.

Most of these ops already take a leading N (batch) dim, so the vmap batch folds into it:
``[B, N, C, *spatial]`` becomes ``[B*N, C, *spatial]``, the op runs once, and the result
unfolds. A batched weight is handled by moving the batch into the channel dim and using
groups (convolution) or per-channel statistics (batch norm), as functorch does.

The backwards of the norms and of the elementwise losses have rules, although their
``torch._decomp`` decompositions batch too: those round every step in 16-bit floats, and
run as several ops (a dozen for a norm, eight for ``mse_loss``) where the rule runs the
kernel once. ``binary_cross_entropy_with_logits`` has no backward op of its own.
"""

from __future__ import annotations

import math

import torch
from torch._decomp.decompositions_for_jvp import recompute_mean_var
from torch._prims_common import get_computation_dtype

from torchlevels._level import autograd_records, differentiated
from torchlevels.batching.dims import (
    logical_rank,
    logical_shape,
    materialize,
    pad_to_rank,
    per_example,
    refuse_dtypes_the_kernel_refuses,
    to_front,
)
from torchlevels.batching.max_pool import max_pool
from torchlevels.batching.registry import (
    batch_size,
    bound_arguments,
    decomposition_of,
    loop_rule,
    register,
    skip_decomposition,
)

aten = torch.ops.aten


# -- folding the vmap batch into N --------------------------------------------------------


def fold(x: torch.Tensor, bdim: int | None, size: int, full_rank: int):
    """``x`` with its batch folded into N, and the leading shape to unfold the result with.

    ``full_rank`` is the logical rank of an input that has an N dim; a logical input
    without one (``[C, *spatial]``) just lets the vmap batch play N.
    """
    # contiguous: an expanded (stride-0) unbatched argument crashes some kernels, e.g.
    # adaptive_max_pool3d_backward with shared indices
    x = materialize(x, bdim, size)
    if x.dim() == full_rank + 1:
        return x.flatten(0, 1).contiguous(), x.shape[:2]
    return x.contiguous(), x.shape[:1]


def unfold(out, lead):
    """Undo :func:`fold` on one output or a tuple of them (absent ones, from an output
    mask, stay None); batch dims are 0."""
    if isinstance(out, torch.Tensor):
        return (out.unflatten(0, lead) if len(lead) == 2 else out), 0
    outs = tuple(o.unflatten(0, lead) if o is not None and len(lead) == 2 else o for o in out)
    return outs, tuple(None if o is None else 0 for o in outs)


def spatial_rule(k: int):
    """A rule for an op on ``[N, C, *k spatial]`` tensors whose N examples are independent.

    Every tensor argument (an N-first tensor of the same rank, like grid_sampler's grid,
    too) is folded into N; the op's other arguments pass through.
    """

    def rule(func, args, dims, kwargs):
        size = batch_size(args, dims)
        first, d = next((a, d) for a, d in zip(args, dims) if isinstance(a, torch.Tensor))
        has_n = logical_rank(first, d) == k + 2
        lead = None
        phys = []
        for a, d in zip(args, dims):
            if isinstance(a, torch.Tensor):
                a, lead_a = fold(a, d, size, k + 2 if has_n else k + 3)
                lead = lead or lead_a
            phys.append(a)
        if func in _MAX_POOLS:
            return unfold(max_pool(func, *phys, **kwargs), lead)
        return unfold(func(*phys, **kwargs), lead)

    return rule


_MAX_POOLS = {aten.max_pool2d.default, aten.max_pool2d_with_indices.default,
              aten.max_pool3d_with_indices.default}


for _k, _ops in {
    1: ["max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d",
        "reflection_pad1d", "replication_pad1d", "upsample_nearest1d",
        "_upsample_nearest_exact1d", "upsample_linear1d", "reflection_pad1d_backward",
        "replication_pad1d_backward"],
    2: ["max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d",
        "adaptive_max_pool2d", "reflection_pad2d", "replication_pad2d", "upsample_nearest2d",
        "_upsample_nearest_exact2d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
        "upsample_bicubic2d", "_upsample_bicubic2d_aa", "im2col", "grid_sampler_2d",
        "grid_sampler_2d_backward",
        "max_pool2d_with_indices_backward", "avg_pool2d_backward",
        "_adaptive_avg_pool2d_backward", "adaptive_max_pool2d_backward",
        "reflection_pad2d_backward", "replication_pad2d_backward"],
    3: ["max_pool3d", "max_pool3d_with_indices", "avg_pool3d", "_adaptive_avg_pool3d",
        "adaptive_max_pool3d", "reflection_pad3d", "replication_pad3d", "upsample_nearest3d",
        "_upsample_nearest_exact3d", "upsample_trilinear3d", "grid_sampler_3d",
        "grid_sampler_3d_backward",
        "max_pool3d_with_indices_backward", "avg_pool3d_backward",
        "_adaptive_avg_pool3d_backward", "adaptive_max_pool3d_backward",
        "reflection_pad3d_backward", "replication_pad3d_backward"],
}.items():
    register(*(getattr(aten, name) for name in _ops))(spatial_rule(_k))

register(aten.fractional_max_pool2d_backward.default)(spatial_rule(2))
register(aten.fractional_max_pool3d_backward.default)(spatial_rule(3))


@register(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(func, args, dims, kwargs):
    """Fold the batch into N, of the input and of its random samples (``[N, C, k]``, or
    ``[1, C, k]`` for an input without N, so both fold the same way)."""
    x, kernel_size, output_size, samples = args
    size = batch_size(args, dims)
    x, lead = fold(x, dims[0], size, len(kernel_size) + 2)
    samples = materialize(samples, dims[3], size).flatten(0, 1)
    return unfold(func(x, kernel_size, output_size, samples), lead)


_UPSAMPLE_BACKWARD = [
    "upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward", "upsample_linear1d_backward",
    "upsample_bilinear2d_backward", "_upsample_bilinear2d_aa_backward",
    "upsample_bicubic2d_backward", "_upsample_bicubic2d_aa_backward",
    "upsample_trilinear3d_backward",
]


@register(*(getattr(aten, name) for name in _UPSAMPLE_BACKWARD))
def upsample_backward(func, args, dims, kwargs):
    """Fold the batch into N, of the gradient and of the recorded input size."""
    go, output_size, input_size, *rest = args
    size = go.shape[dims[0]]
    go = to_front(go, dims[0]).flatten(0, 1)
    out = func(go, output_size, [size * input_size[0], *input_size[1:]], *rest, **kwargs)
    return out.unflatten(0, (size, -1)), 0


# col2im's input is [N, C*k, L] or [C*k, L]: one "spatial" dim as far as folding goes.
register(aten.col2im)(spatial_rule(1))


@register(aten.pixel_shuffle, aten.pixel_unshuffle)
def pixel_shuffle(func, args, dims, kwargs):
    """Takes any number of leading dims, so the batch simply goes first.

    The kernel refuses a 5-d input laid out channels-last-3d, which a batch of 4-d examples
    can be by chance (stride 1 on the example's first dim), so that layout is copied.
    """
    x = to_front(args[0], dims[0])
    cl3d = torch.channels_last_3d
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(memory_format=cl3d):
        x = x.contiguous()
    return func(x, *args[1:], **kwargs), 0


@register(aten.constant_pad_nd.default)
def constant_pad_nd(func, args, dims, kwargs):
    """Pads only trailing dims, so a leading batch dim is left alone."""
    return func(to_front(args[0], dims[0]), *args[1:], **kwargs), 0


# -- convolution --------------------------------------------------------------------------


def _to_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, O, ...]`` as ``[groups * B * O/groups, ...]``: a group's channels for all examples."""
    return t.unflatten(1, (groups, t.shape[1] // groups)).transpose(0, 1).flatten(0, 2)


def _from_groups(out: torch.Tensor, groups: int, size: int) -> torch.Tensor:
    """``[N, groups * B * O/groups, ...]`` back to ``[N, B, O, ...]``."""
    return out.unflatten(1, (groups, size, -1)).transpose(1, 2).flatten(2, 3)


def _channel_view(t: torch.Tensor, n_dims: int, spatial: int) -> torch.Tensor:
    """A ``[B, C]`` tensor viewed to broadcast against ``[B, *n_dims, C, *spatial]``."""
    return t.reshape(t.shape[:1] + (1,) * n_dims + t.shape[1:] + (1,) * spatial)


@register(aten.convolution.default)
def convolution(func, args, dims, kwargs):
    """Batched input: fold into N. Batched weight: the batch becomes extra output channels
    (unbatched input) or extra groups (batched input)."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    xd, wd, bd = dims[:3]
    size = batch_size(args, dims)

    def conv(x, w, b, g):
        return func(x, w, b, stride, padding, dilation, transposed, output_padding, g)

    if wd is None:
        x, lead = fold(x, xd, size, w.dim())
        if bd is None:
            return unfold(conv(x, w, bias, groups), lead)
        out, _ = unfold(conv(x, w, None, groups), lead)
        return out + _channel_view(to_front(bias, bd), out.dim() - w.dim(), w.dim() - 2), 0
    w = to_front(w, wd)
    has_n = logical_rank(x, xd) == w.dim() - 1
    b = None if bias is None else materialize(bias, bd, size)
    if xd is None:
        x = x if has_n else x.unsqueeze(0)
        # transposed: [B, Cin, O/g, *k] -> [Cin, B * O/g, *k], so group j makes [B, O/g]
        w = w.transpose(0, 1).flatten(1, 2) if transposed else _to_groups(w, groups)
        out = conv(x, w, None if b is None else _to_groups(b, groups), groups)
        out = _from_groups(out, groups, size)
    else:
        x = materialize(x, xd, size)
        x = x if has_n else x.unsqueeze(1)
        out = conv(x.transpose(0, 1).flatten(1, 2), w.flatten(0, 1),
                   None if b is None else b.flatten(), groups * size)
        out = out.unflatten(1, (size, -1))
    return (out, 1) if has_n else (out.squeeze(0), 0)


@register(aten.convolution_backward.default)
def convolution_backward(func, args, dims, kwargs):
    """A shared weight: the input gradient folds into N (one ungrouped kernel). Per-example
    weight (and bias) gradients: examples become groups of one grouped kernel."""
    go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    size = batch_size(args, dims)
    w_rank = logical_rank(w, dims[2])
    has_n = logical_rank(x, dims[1]) == w_rank
    rest = (stride, padding, dilation, transposed, output_padding)
    if dims[2] is None:
        gi = None
        if mask[0]:
            go_n, lead = fold(go, dims[0], size, w_rank)
            x_n, _ = fold(x, dims[1], size, w_rank)
            gi = unfold(func(go_n, x_n, w, None, *rest, groups, [True, False, False])[0], lead)[0]
        gw = gb = None
        if mask[1]:
            (_, gw, gb), _ = _grouped_backward(func, args, dims, size, has_n,
                                               [False, True, mask[2]])
            gb = gb if mask[2] else None  # the CPU kernel may fill outputs it was not asked for
        elif mask[2]:  # per example: sum over everything but the output channels
            go = materialize(go, dims[0], size)
            gb = go.sum([d for d in range(1, go.dim()) if d != 1 + has_n])
        return (gi, gw, gb), tuple(None if t is None else 0 for t in (gi, gw, gb))
    return _grouped_backward(func, args, dims, size, has_n, mask)


def _grouped_backward(func, args, dims, size, has_n, mask):
    """convolution_backward with the batch as groups: every gradient comes out per example."""
    go, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, _ = args
    go, x = (materialize(t, d, size) for t, d in zip(args[:2], dims[:2]))
    if dims[2] is None and not mask[0] and not (w.requires_grad and autograd_records()):
        # the weight gradient reads only the weight's shape: no copy per example (unless
        # autograd records this call, whose derivatives might read the weight)
        w = w.new_empty((size * w.shape[0], *w.shape[1:]))
    else:
        w = materialize(w, dims[2], size).flatten(0, 1)
    if not has_n:
        go, x = go.unsqueeze(1), x.unsqueeze(1)
    gi, gw, gb = func(go.transpose(0, 1).flatten(1, 2), x.transpose(0, 1).flatten(1, 2),
                      w, None if bias_sizes is None else [size * bias_sizes[0]],
                      stride, padding, dilation, transposed, output_padding, groups * size, mask)
    if gi is not None:
        gi = gi.unflatten(1, (size, -1)) if has_n else gi.squeeze(0)
    gw = None if gw is None else gw.unflatten(0, (size, -1))
    gb = None if gb is None else gb.unflatten(0, (size, -1))
    return (gi, gw, gb), (None if gi is None else int(has_n), None if gw is None else 0,
                          None if gb is None else 0)


# -- normalization ------------------------------------------------------------------------


def _affine(out, w, wd, b, bd, size, view):
    """``out * w + b`` for a batched ``w`` or ``b``; ``view`` shapes a front-batched param."""
    if w is not None:
        out = out * view(materialize(w, wd, size))
    if b is not None:
        out = out + view(materialize(b, bd, size))
    return out


@register(aten.native_layer_norm.default)
def native_layer_norm(func, args, dims, kwargs):
    """Normalizes trailing dims, so a leading batch is free; a batched weight/bias applies after."""
    x, shape, w, b, eps = args
    xd = None if dims[0] is None else 0
    x = to_front(x, dims[0])
    if dims[2] is None and dims[3] is None:
        return func(x, shape, w, b, eps), (xd, xd, xd)
    out, mean, rstd = func(x, shape, None, None, eps)
    lead = (1,) * (logical_rank(x, xd) - len(shape))
    out = _affine(out, w, dims[2], b, dims[3], batch_size(args, dims),
                  lambda p: p.reshape(p.shape[:1] + lead + p.shape[1:]))
    return (out, mean, rstd), (0, xd, xd)


@register(aten.native_group_norm.default)
def native_group_norm(func, args, dims, kwargs):
    """Groups are per example: fold the batch into N; a batched weight/bias applies after."""
    x, w, b, n, c, hxw, group, eps = args
    size = batch_size(args, dims)
    affine_batched = dims[1] is not None or dims[2] is not None
    params = (None, None) if affine_batched else (w, b)
    if dims[0] is None:
        out, mean, rstd = func(x, *params, n, c, hxw, group, eps)
        xd = None
    else:
        x = to_front(x, dims[0]).contiguous()  # the kernel needs a contiguous input
        outs = func(x.flatten(0, 1), *params, size * n, c, hxw, group, eps)
        out, mean, rstd = (t.unflatten(0, (size, n)) for t in outs)
        xd = 0
    if affine_batched:
        spatial = out.dim() - 2 - (xd is not None)
        out = _affine(out, w, dims[1], b, dims[2], size, lambda p: _channel_view(p, 1, spatial))
    return (out, mean, rstd), (0, xd, xd)


def _batch_norm(args, dims, training, momentum, eps):
    """native_batch_norm on ``(x, w, b, running_mean, running_var)``, any of them batched."""
    x, w, b, rm, rv = args
    xd, wd, bd, md, vd = dims
    size = batch_size(args, dims)
    bn = aten.native_batch_norm.default
    if training and rm is not None and (md is None or vd is None):
        if xd is not None:
            shared = [name for name, d in (("running_mean", md), ("running_var", vd))
                      if d is None]
            is_, it = ("is", "it") if len(shared) == 1 else ("are", "them")
            raise RuntimeError(
                "vmap: batch norm in training mode would update running_mean/running_var in "
                f"place with batched statistics, but {' and '.join(shared)} {is_} not "
                f"batched: each example would update {it} in turn, as in a loop, which "
                "cannot be batched. Batch the running stats too (one per example); or, if you "
                "do not need them, use eval mode or set `track_running_stats=False` on the "
                "module (or pass running_mean=None and running_var=None)."
            )
        # x, and so its statistics, are the same for every example: a loop updates a running
        # stat the examples share once per example in turn, as one update with momentum
        # 1 - (1 - momentum) ** size does (a batched stat, each example's own, is updated below)
        stats = [t if d is None else t.new_zeros(logical_shape(t, d))  # (a stand-in)
                 for t, d in ((rm, md), (rv, vd))]
        bn(x, None, None, *stats, True, 1 - (1 - momentum) ** size, eps)
        if md is None and vd is None:
            rm = rv = None  # no running stat left to update
    params_batched = wd is not None or bd is not None
    if not training and md is None and vd is None and xd is not None and not params_batched:
        x, lead = fold(x, xd, size, x.dim() - 1)  # the logical x always has N
        out, mean, invstd = bn(x, w, b, rm, rv, False, momentum, eps)
        return (unfold(out, lead)[0], mean, invstd), (0, None, None)
    if xd is None and md is None and vd is None:  # only the affine params batched
        out, mean, invstd = bn(x, None, None, rm, rv, training, momentum, eps)
        spatial = x.dim() - 2
        out = _affine(out, w, wd, b, bd, size, lambda p: _channel_view(p, 1, spatial))
        return (out, mean, invstd), (0, None, None)
    # The batch joins the channels: [B, N, C, *s] -> [N, B*C, *s], one statistic per (b, c).
    x = materialize(x, xd, size)
    flat = [None if t is None else materialize(t, d, size).flatten().clone()
            for t, d in zip((w, b, rm, rv), (wd, bd, md, vd))]
    out, mean, invstd = bn(x.transpose(0, 1).flatten(1, 2), *flat, training, momentum, eps)
    if training and rm is not None:
        for stat, d, new in zip((rm, rv), (md, vd), flat[2:]):
            if d is not None:  # (a shared one was updated above)
                to_front(stat, d).copy_(new.view(size, -1))
    out = out.unflatten(1, (size, -1))
    if not training:
        return (out, mean, invstd), (1, None, None)
    return (out, mean.view(size, -1), invstd.view(size, -1)), (1, 0, 0)


@register(aten.native_batch_norm.default, aten._native_batch_norm_legit.default)
def native_batch_norm(func, args, dims, kwargs):
    """Eval: fold the batch into N. Training: per-example statistics via ``B*C`` channels."""
    return _batch_norm(args[:5], dims[:5], *args[5:])


@register(aten._batch_norm_with_update.default)
def batch_norm_with_update(func, args, dims, kwargs):
    """Training mode, updating the running stats: as ``native_batch_norm``, which refuses
    running stats that are not batched by name, not by a failed ``copy_``."""
    momentum, eps = args[5:]
    (out, mean, invstd), out_dims = _batch_norm(args[:5], dims[:5], True, momentum, eps)
    reserve = torch.empty(0, dtype=torch.uint8, device=out.device)  # as on the CPU
    return (out, mean, invstd, reserve), (*out_dims, None)


@register(aten._native_batch_norm_legit.no_stats)
def native_batch_norm_no_stats(func, args, dims, kwargs):
    """``_native_batch_norm_legit`` without running stats."""
    x, w, b, training, momentum, eps = args
    return _batch_norm((x, w, b, None, None), (*dims[:3], None, None), training, momentum, eps)


@register(aten._native_batch_norm_legit_no_training.default)
def native_batch_norm_no_training(func, args, dims, kwargs):
    """``_native_batch_norm_legit`` in eval mode."""
    return _batch_norm(args[:5], dims[:5], False, *args[5:])


@register(aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
def batch_norm_backward(func, args, dims, kwargs):
    """In the forward's layout, the batch joined to the channels ([B, N, C, *s] ->
    [N, B*C, *s]): every example gets its own statistics and affine-parameter gradients.
    Natively, so an enclosing grad level gets the op's own double backward (the
    decomposition reads the saved statistics as constants: wrong Hessians)."""
    go, x, w, rm, rv, save_mean, save_invstd, train, eps, mask, *reserve = args
    if reserve and dims[10] is not None:
        raise NotImplementedError(
            f"vmap: {func} with a batched `reserve` (cuDNN's opaque workspace) has no "
            "batching rule; run batch norm outside vmap or on the CPU"
        )
    size = batch_size(args, dims)

    def per_channel(t, d):  # [B, C] (or [C], the same for every example) -> [B*C]
        # contiguous: the CPU kernel reads the stats' memory as if they were, and an
        # expanded [C] with C = 1 flattens to a view of one element
        return None if t is None else materialize(t, d, size).flatten().contiguous()

    go, x = (materialize(t, d, size).transpose(0, 1).flatten(1, 2)
             for t, d in zip((go, x), dims[:2]))
    stats = [per_channel(t, d) for t, d in zip((w, rm, rv, save_mean, save_invstd), dims[2:7])]
    # a decomposition (forward AD has no formula for this op) may give a masked-off
    # gradient as a placeholder tensor: None, as the kernel gives
    gi, gw, gb = (g if wanted else None for g, wanted in
                  zip(func(go, x, *stats, train, eps, mask, *reserve), mask))
    gi = None if gi is None else gi.unflatten(1, (size, -1))
    gw, gb = (None if g is None else g.view(size, -1) for g in (gw, gb))
    return (gi, gw, gb), tuple(None if g is None else d for g, d in zip((gi, gw, gb), (1, 0, 0)))


def _sum_over(t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    return t.sum(dims) if dims else t  # sum(()) would sum everything


@register(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(func, args, dims, kwargs):
    """The input's gradient natively on the batch: rows are independent, and an unbatched
    weight goes into the kernel, so every row is computed as for one example (bit for bit
    in 16-bit floats). The weight's and bias's gradients are sums over each example's rows,
    in the kernel's float32 for 16-bit inputs. Where autograd or a grad or jvp level
    outside differentiates, they read mean and rstd recomputed from the input, as
    PyTorch's forward-AD decomposition does: the saved ones are constants to it."""
    go, x, shape, mean, rstd, w, b, mask = args
    size = batch_size(args, dims)
    go, x, mean, rstd = (materialize(t, d, size).contiguous() for t, d in
                         zip((go, x, mean, rstd), (dims[0], dims[1], dims[3], dims[4])))
    axis = x.dim() - len(shape)
    rows = list(range(1, axis))  # one example's rows
    gi = gw = gb = None
    if mask[0]:
        if dims[5] is None:
            gi = func(go, x, shape, mean, rstd, w, None, [True, False, False])[0]
        else:
            w_rows = to_front(w, dims[5]).reshape(size, *(1,) * (axis - 1), *shape)
            gi = func(go * w_rows, x, shape, mean, rstd, None, None, [True, False, False])[0]
    compute = get_computation_dtype(x.dtype)  # float32 for 16-bit floats, as the kernel
    if mask[1] and w is not None:
        if differentiated(go, x, mean, rstd):
            mean, rstd = recompute_mean_var(x, rstd, list(range(axis, x.dim())), keepdim=True)
        x_hat = (x.to(compute) - mean.to(compute)) * rstd.to(compute)
        gw = _sum_over(go.to(compute) * x_hat, rows).to(w.dtype)
    if mask[2] and b is not None:
        gb = _sum_over(go.to(compute), rows).to(b.dtype)
    return (gi, gw, gb), tuple(None if g is None else 0 for g in (gi, gw, gb))


@register(aten.native_group_norm_backward.default)
def native_group_norm_backward(func, args, dims, kwargs):
    """The input's gradient with the batch folded into N, an unbatched weight inside the
    kernel (so every example is computed as alone, bit for bit in 16-bit floats); the
    weight's and bias's gradients summed per example as :func:`native_layer_norm_backward`
    does, from recomputed statistics where something outside differentiates."""
    go, x, mean, rstd, w, n, c, hxw, group, mask = args
    size = batch_size(args, dims)
    go, x, mean, rstd = (materialize(t, d, size).contiguous() for t, d in
                         zip((go, x, mean, rstd), (dims[0], dims[1], dims[2], dims[3])))
    gi = gw = gb = None
    if mask[0]:
        weight = w
        if dims[4] is not None:
            go_w = go * _channel_view(to_front(w, dims[4]), 1, go.dim() - 3)
            weight = None
        else:
            go_w = go
        gi = func(go_w.flatten(0, 1), x.flatten(0, 1), mean.flatten(0, 1), rstd.flatten(0, 1),
                  weight, size * n, c, hxw, group, [True, False, False])[0].unflatten(0, (size, n))
    compute = get_computation_dtype(x.dtype)  # float32 for 16-bit floats, as the kernel
    groups = (size, n, group, c // group, hxw)
    if mask[1] and w is not None:
        x_groups = x.reshape(groups)
        mean, rstd = (t.reshape(*groups[:3], 1, 1) for t in (mean, rstd))
        if differentiated(go, x, mean, rstd):
            mean, rstd = recompute_mean_var(x_groups, rstd, [3, 4], keepdim=True)
        x_hat = (x_groups.to(compute) - mean.to(compute)) * rstd.to(compute)
        gw = (go.reshape(groups).to(compute) * x_hat).sum((1, 4)).reshape(size, c).to(w.dtype)
    if mask[2]:
        gb = go.reshape(size, n, c, hxw).to(compute).sum((1, 3)).to((x if w is None else w).dtype)
    return (gi, gw, gb), tuple(None if g is None else 0 for g in (gi, gw, gb))


@register(aten._weight_norm_interface_backward.default)
def weight_norm_backward(func, args, dims, kwargs):
    """Natively, the batch folded into the kernel's rows: the rows of each example (along
    ``dim``, which is 0 or its last dim) are moved next to the batch and flattened with it,
    so each row's norm still covers the rest of its own example. The native op brings its
    own double-backward formula for an enclosing grad level."""
    grad_w, v, g, norms, dim = args
    if dim not in (0, logical_rank(v, dims[1]) - 1):
        raise RuntimeError(f"{func}: dim={dim}, but the fused kernels take only the first or "
                           "the last dim of saved_v (torch._weight_norm picks them)")
    size = batch_size(args, dims)
    g_shape = logical_shape(g, dims[2])

    def rows_first(t, d):  # [B, *shape] with the rows along `dim` next to the batch
        return materialize(t, d, size).movedim(dim + 1, 1)

    grad_w, v = (rows_first(t, d) for t, d in zip((grad_w, v), dims[:2]))
    rows = v.shape[1]
    g, norms = (materialize(t, d, size).reshape(size * rows) for t, d in zip((g, norms), dims[2:4]))
    grad_v, grad_g = func(*(t.contiguous() for t in (grad_w.flatten(0, 1), v.flatten(0, 1), g,
                                                      norms)), 0)  # as the kernel wants them
    return (grad_v.unflatten(0, (size, rows)).movedim(1, dim + 1),
            grad_g.view(size, *g_shape)), (0, 0)


# -- losses -------------------------------------------------------------------------------


def _floating_only(func, x: torch.Tensor) -> None:
    """Refuse input that is not floating point, as the loss kernels do (the rules' gathers
    and products would take integer or complex input)."""
    if not x.is_floating_point():
        raise NotImplementedError(f"vmap: {func} is not implemented for input of dtype "
                                  f"{x.dtype}, as each example's call is not")


def _nll_setup(args, dims, size):
    """Front-batched input and targets, the class dim, where targets count, and their weights."""
    x, target, weight, _, ignore_index = args[:5]
    x = materialize(x, dims[0], size)
    target = materialize(target, dims[1], size)
    class_dim = 1 + (x.dim() > 2)  # logical [N, C, *d]; else [C] with a 0-dim target
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    if weight is None:
        w = keep.to(x.dtype)
    elif dims[2] is None:  # (gather: torch's RuntimeError for a target out of range)
        w = weight.gather(0, safe.flatten()).view_as(safe) * keep
    else:
        w = to_front(weight, dims[2]).gather(1, safe.reshape(size, -1)).view_as(safe) * keep
    return x, class_dim, keep, safe.unsqueeze(class_dim), w


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(func, args, dims, kwargs):
    """Per example: gather -log p of each target class, weigh it, reduce that example's."""
    reduction = args[3]
    _floating_only(func, args[0])
    size = batch_size(args, dims)
    x, class_dim, keep, index, w = _nll_setup(args, dims, size)
    loss = (-x.gather(class_dim, index).squeeze(class_dim) * w).masked_fill(~keep, 0)
    if class_dim == 1:  # a single target per example
        total = w
    else:
        total = w.flatten(1).sum(1)
        if reduction == 0:  # the op returns a 0-dim zero total weight here
            return (loss, x.new_zeros(())), (0, None)
        loss = loss.flatten(1).sum(1)
    if reduction == 1:
        loss = loss / total
    return (loss, total), (0, 0)


@register(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(func, args, dims, kwargs):
    """Scatter ``-weight * grad`` (over the total weight for "mean") to the target classes."""
    go, reduction, total = args[0], args[4], args[6]
    size = batch_size(args, dims)
    x, class_dim, keep, index, w = _nll_setup(args[1:6], dims[1:6], size)
    go = materialize(go, dims[0], size)
    if reduction != 0:  # one gradient per example
        go = go.reshape((size,) + (1,) * (w.dim() - 1))
    if reduction == 1:
        go = go / materialize(total, dims[6], size).reshape(go.shape)
    # an ignored target writes nothing, as in PyTorch's kernel: no 0 * inf where an example
    # has no targets that count (its mean's total weight is 0)
    value = (-w * go).masked_fill(~keep, 0)
    grad = torch.zeros_like(x).scatter(class_dim, index, value.unsqueeze(class_dim))
    return grad, 0


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """A margin loss's front-batched input as rows ``[B*N, C]`` (``[B, C]`` for examples
    without N, ``[B, 1]`` for 0-d ones, of one class)."""
    return x.flatten(0, -2) if x.dim() > 1 else x.unsqueeze(1)


def _example_losses(loss: torch.Tensor, shape: tuple, reduction: int) -> torch.Tensor:
    """Each row's loss (of the rows of :func:`_as_rows`) as each example's: its unreduced
    loss of (front-batched) ``shape``, reduced over its rows unless ``reduction`` is none
    (0)."""
    loss = loss.view(shape)
    return loss if reduction == 0 else per_example(loss, reduction == 1)


def _row_gradients(go: torch.Tensor, x: torch.Tensor, reduction: int) -> torch.Tensor:
    """Each example's loss gradient ``go`` (front-batched) as its rows', flat: spread over
    the N rows of a reduced loss (a mean's divided by N)."""
    if x.dim() == 3 and reduction != 0:
        go = go.unsqueeze(1).expand(x.shape[:2])
        go = go / x.shape[1] if reduction == 1 else go
    return go.reshape(-1)


def _multilabel_rows(args, dims, size):
    """Input, target and is_target front-batched, and each as rows ``[B*N, C]`` (``[B, C]``
    for examples without N, ``[B, 1]`` for 0-d ones)."""
    x = materialize(args[0], dims[0], size)
    rows = [_as_rows(x)]
    for a, d in zip(args[1:], dims[1:]):
        rows.append(materialize(a, d, size).reshape(rows[0].shape))
    return x, rows


# torch._decomp's decomposition counts the target slots after a -1 as class 0 (wrong
# values), and gives a 1-d input's unreduced loss a dim of 1: never use it.
skip_decomposition(aten.multilabel_margin_loss_forward.default)


@register(aten.multilabel_margin_loss_forward.default)
def multilabel_margin_loss_forward(func, args, dims, kwargs):
    """Each row's loss in one call, then each example's reduction over its rows."""
    reduction = args[2]
    x, (rows, target) = _multilabel_rows(args[:2], dims[:2], batch_size(args, dims))
    loss, is_target = func(rows, target, 0)
    shape = x.shape[:-1] if x.dim() > 1 else x.shape  # a loss per row (a 0-d example: one)
    return (_example_losses(loss, shape, reduction), is_target.view(x.shape)), (0, 0)


@register(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(func, args, dims, kwargs):
    """Each row's gradient in one call, from each example's gradient spread over its rows."""
    go, reduction = args[0], args[3]
    size = batch_size(args, dims)
    x, (rows, target, is_target) = _multilabel_rows(
        (args[1], args[2], args[4]), (dims[1], dims[2], dims[4]), size)
    go = _row_gradients(materialize(go, dims[0], size), x, reduction)
    grad = func(go, rows, target, 0, is_target)
    return grad.view(x.shape), 0


def _margin_rows(func, args, dims, first: int):
    """multi_margin_loss's (or, ``first=1``, its backward's) arguments by name: ``self``
    front-batched, ``rows`` the same as ``[B*N, C]`` (``[B, C]`` for examples without N),
    ``target`` flat, and ``weight`` each row's class weight (None without weights)."""
    named = bound_arguments(func, args, {})
    size = batch_size(args, dims)
    x = named["self"] = materialize(named["self"], dims[first], size)
    named["rows"] = _as_rows(x)
    target = named["target"] = materialize(named["target"], dims[first + 1], size).flatten()
    if named["weight"] is not None:  # a row's loss scales by its target's weight
        weight = materialize(named["weight"], dims[first + 4], size).view(size, -1)
        if weight.shape[1] != named["rows"].shape[1]:
            raise RuntimeError(
                f"multi_margin_loss: inconsistent weight size, expected "
                f"{named['rows'].shape[1]} (one per class) but got {weight.shape[1]}")
        named["weight"] = weight.gather(1, target.view(size, -1)).flatten()
    return named


@register(aten.multi_margin_loss.default)
def multi_margin_loss(func, args, dims, kwargs):
    """Each row's loss in one call (PyTorch's decomposition, which differentiates in every
    mode), scaled by its class weight, then each example's reduction over its rows. (The
    decomposition alone gives an unreduced 1-d example's loss a dim of 1.)"""
    refuse_dtypes_the_kernel_refuses(func, args, dims, kwargs)
    a = _margin_rows(func, args, dims, 0)
    loss = decomposition_of(func)(a["rows"], a["target"], a["p"], a["margin"], None, 0)
    if a["weight"] is not None:
        loss = loss * a["weight"]
    shape = (a["self"].shape[0], *logical_shape(args[1], dims[1]))  # the target's, as eager's
    return _example_losses(loss, shape, a["reduction"]), 0


@register(aten.multi_margin_loss_backward.default)
def multi_margin_loss_backward(func, args, dims, kwargs):
    """Each row's gradient in one call, from each example's gradient spread over its rows
    and scaled by the row's class weight."""
    a = _margin_rows(func, args, dims, 1)
    x = a["self"]
    go = _row_gradients(materialize(args[0], dims[0], x.shape[0]), x, a["reduction"])
    if a["weight"] is not None:
        go = go * a["weight"]
    grad = func(go, a["rows"], a["target"], a["p"], a["margin"], None, 0)
    return grad.view(x.shape), 0


def _ctc_fold(args, dims, size):
    """``_ctc_loss``'s log_probs, targets and lengths with the batch folded into N (each
    example's N sequences, then the next example's), and N."""
    log_probs = materialize(args[0], dims[0], size)  # [B, T, N, C]
    n = log_probs.shape[2]
    targets = materialize(args[1], dims[1], size)  # [B, N, S] padded, or [B, sum(L)]
    targets = targets.flatten(0, 1) if targets.dim() == 3 else targets.flatten()
    lengths = [materialize(a, d, size).flatten() if isinstance(a, torch.Tensor)
               else list(a) * size for a, d in zip(args[2:4], dims[2:4])]
    return [log_probs.movedim(0, 1).flatten(1, 2), targets, *lengths], n


@register(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(func, args, dims, kwargs):
    """The op takes N sequences: every example's in one call. Its log_alpha is padded to
    the longest target of the whole batch (only its backward reads it)."""
    size = batch_size(args, dims)
    folded, n = _ctc_fold(args, dims, size)
    nll, log_alpha = func(*folded, *args[4:], **kwargs)
    return (nll.view(size, n), log_alpha.unflatten(0, (size, n))), (0, 0)


@register(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(func, args, dims, kwargs):
    """As the forward: every example's sequences in one call."""
    size = batch_size(args, dims)
    folded, n = _ctc_fold(args[1:5], dims[1:5], size)
    grad, nll, log_alpha = (materialize(a, d, size).flatten(0, 1)
                            for a, d in zip((args[0], *args[5:7]), (dims[0], *dims[5:7])))
    out = func(grad, *folded, nll, log_alpha, *args[7:], **kwargs)  # [T, B*N, C]
    return out.unflatten(1, (size, n)), 1


@register(aten.mse_loss.default, aten.huber_loss.default, aten.smooth_l1_loss.default,
          aten.soft_margin_loss.default, aten.binary_cross_entropy.default,
          aten.binary_cross_entropy_with_logits.default)
def elementwise_loss(func, args, dims, kwargs):
    """A loss whose terms are elementwise, then their mean or sum: the terms natively on
    the batch (reduction "none"), then each example's mean or sum. The kernel
    rounds each term once (computing in float32 for 16-bit inputs), as the op does for
    one example; the decompositions round every step."""
    bound = bound_arguments(func, args, kwargs)
    reduction = bound.pop("reduction")
    names = [a.name for a in func._schema.arguments]
    in_dims = {names[i]: d for i, d in enumerate(dims)}
    tensors = [n for n, v in bound.items() if isinstance(v, torch.Tensor)]
    size = batch_size(args, dims)
    rank = max(logical_rank(bound[n], in_dims.get(n)) for n in tensors)
    for n in tensors:  # each [B, *shape], with the op's own broadcasting (or refusal)
        bound[n] = pad_to_rank(materialize(bound[n], in_dims.get(n), size), rank)
    loss = func(**bound, reduction=0)
    if reduction == 0:
        return loss, 0
    return per_example(loss, mean=reduction == 1), 0


@register(aten.mse_loss_backward.default, aten.huber_loss_backward.default,
          aten.smooth_l1_loss_backward.default, aten.soft_margin_loss_backward.default,
          aten.binary_cross_entropy_backward.default)
def elementwise_loss_backward(func, args, dims, kwargs):
    """The backward of :func:`elementwise_loss`, natively on the batch: a mean becomes a
    sum whose grad_output is divided by one example's number of elements. One kernel
    where the decompositions dispatch eight ops, and the native op brings its own
    double-backward formula for an enclosing grad level."""
    bound = bound_arguments(func, args, kwargs)
    names = [a.name for a in func._schema.arguments]
    in_dims = dict(zip(names, dims))
    size = batch_size(args, dims)
    grad, grad_dim = bound.pop("grad_output"), in_dims["grad_output"]
    self_dim = in_dims["self"]
    rank = logical_rank(bound["self"], self_dim)
    shape = (size, *logical_shape(bound["self"], self_dim))
    bound["self"] = materialize(bound["self"], self_dim, size)  # the kernel's output shape
    for n in ("target", "weight"):  # batched: lined up with self; else broadcast as they are
        if in_dims.get(n) is not None:
            bound[n] = pad_to_rank(to_front(bound[n], in_dims[n]), rank)
    mean = bound["reduction"] == 1
    if mean:  # one example's mean, as a sum
        grad = grad / math.prod(shape[1:])
    if grad_dim is not None:
        # each example's own grad_output (0-dim, or of any shape that broadcasts to self's
        # in a double backward), elementwise: the op's double backward of a reduced loss
        # takes one 0-dim grad_output for the whole call
        grad = pad_to_rank(to_front(grad, grad_dim), rank)
        bound["reduction"] = 0
    elif mean:  # the kernel would divide by the whole batch's elements
        bound["reduction"] = 2
    if grad.dim():  # binary_cross_entropy_backward takes a dimensioned grad of full shape
        grad = grad.expand(shape)
    return func(grad, **bound), 0


# -- elementwise backward ops ----------------------------------------------------------------


@register(aten.elu_backward.default, aten.hardshrink_backward.default,
          aten.hardsigmoid_backward.default, aten.hardswish_backward.default,
          aten.hardtanh_backward.default, aten.leaky_relu_backward.default,
          aten.mish_backward.default, aten.softplus_backward.default,
          aten.softshrink_backward.default)
def elementwise_backward(func, args, dims, kwargs):
    """An activation's backward, natively on the batch: its tensors all have one shape,
    and the native op brings its own double-backward formula for an enclosing grad level
    (the decompositions go through prims.where, which has none)."""
    at = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)]
    same = torch.broadcast_tensors(*(to_front(args[k], dims[k]) for k in at))
    phys = list(args)
    for k, t in zip(at, same):
        phys[k] = t
    return func(*phys, **kwargs), 0


# -- ops with a saved buffer ----------------------------------------------------------------


@register(aten.log_sigmoid_forward.default, aten.log_sigmoid_backward.default)
def log_sigmoid(func, args, dims, kwargs):
    """Elementwise, run natively on the batch: the decomposition of the backward reads the
    forward's buffer (exp(-|x|)) as a constant, so an enclosing grad level would miss its
    derivative (a zero Hessian); the native op brings its own double-backward formula."""
    phys = [to_front(a, d) if d is not None else a for a, d in zip(args, dims)]
    if func is aten.log_sigmoid_backward.default:  # the kernel wants equal shapes
        grad_output, x, buffer = phys
        if buffer.numel():
            grad_output, x, buffer = torch.broadcast_tensors(grad_output, x, buffer)
        else:  # no buffer saved (CUDA): the kernel recomputes it
            grad_output, x = torch.broadcast_tensors(grad_output, x)
        return func(grad_output, x, buffer, **kwargs), 0
    out = func(*phys, **kwargs)
    output, buffer = out  # the buffer is empty where the kernel does not save it (CUDA)
    return (output, buffer), (0, 0 if buffer.numel() else None)


# -- attention ----------------------------------------------------------------------------


def _fold_attention(args, dims, count: int, size: int) -> list:
    """The first ``count`` tensors of an attention op with the batch folded into N."""
    return [materialize(a, d, size).flatten(0, 1) for a, d in zip(args[:count], dims[:count])]


def _fold_mask(kwargs: dict, size: int) -> dict:
    """An (unbatched) attention mask that still broadcasts once the batch is folded into N."""
    mask = kwargs.get("attn_mask")
    if mask is None or mask.dim() < 4 or mask.shape[0] == 1:
        return kwargs
    return {**kwargs, "attn_mask": mask.expand(size, *mask.shape).flatten(0, 1)}


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def flash_attention_cpu(func, args, dims, kwargs):
    """Fold the batch into N. (torch._decomp's decomposition of this op returns the attention
    weights where the kernel returns its log-sum-exp, which the backward kernel reads.)"""
    size, n = batch_size(args, dims), logical_shape(args[0], dims[0])[0]
    out, lse = func(*_fold_attention(args, dims, 3, size), *args[3:], **_fold_mask(kwargs, size))
    return (out.unflatten(0, (size, n)), lse.unflatten(0, (size, n))), (0, 0)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def flash_attention_cpu_backward(func, args, dims, kwargs):
    """Fold the batch into N, of the gradient, the inputs and the forward's outputs."""
    size, n = batch_size(args, dims), logical_shape(args[1], dims[1])[0]
    grads = func(*_fold_attention(args, dims, 6, size), *args[6:], **_fold_mask(kwargs, size))
    return tuple(g.unflatten(0, (size, n)) for g in grads), (0, 0, 0)


def _fold_bias(bias: torch.Tensor | None, bdim: int | None, size: int) -> torch.Tensor | None:
    """CUDA's memory-efficient attention's bias with the batch folded into N, laid out as
    its kernel needs (every stride but the last a multiple of 16 elements), as PyTorch's
    own ``scaled_dot_product_attention`` pads it: a fold may copy it without the padding."""
    if bias is None:
        return None
    bias = materialize(bias, bdim, size).flatten(0, 1)
    if bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1]):
        return bias
    return torch.nn.functional.pad(bias, (0, -bias.shape[-1] % 16))[..., :bias.shape[-1]]


def _unfold(t: torch.Tensor | None, size: int, n: int) -> tuple[torch.Tensor | None, int | None]:
    """An output of a folded call, and its batch dim (none for an empty or absent one)."""
    if t is None or t.dim() == 0 or t.numel() == 0:
        return t, None
    return t.unflatten(0, (size, n)), 0


@register(aten._scaled_dot_product_efficient_attention.default)
def efficient_attention(func, args, dims, kwargs):
    """CUDA's memory-efficient attention: the batch folded into N. With dropout, a loop
    (each example's draws are its own)."""
    if bound_arguments(func, args, kwargs)["dropout_p"]:
        return loop_rule(func, args, dims, kwargs)
    size, n = batch_size(args, dims), logical_shape(args[0], dims[0])[0]
    out, lse, seed, offset = func(*_fold_attention(args, dims, 3, size),
                                  _fold_bias(args[3], dims[3], size), *args[4:], **kwargs)
    (out, d_out), (lse, d_lse) = _unfold(out, size, n), _unfold(lse, size, n)
    return (out, lse, seed, offset), (d_out, d_lse, None, None)


@register(aten._scaled_dot_product_efficient_attention_backward.default)
def efficient_attention_backward(func, args, dims, kwargs):
    """Fold the batch into N, of the gradient, the inputs, the bias and the forward's
    outputs (its random state is shared: with dropout, a loop)."""
    if bound_arguments(func, args, kwargs)["dropout_p"]:
        return loop_rule(func, args, dims, kwargs)
    size, n = batch_size(args, dims), logical_shape(args[1], dims[1])[0]
    grad_out, query, key, value = _fold_attention(args, dims, 4, size)
    out, lse = _fold_attention(args[5:7], dims[5:7], 2, size)
    grads = func(grad_out, query, key, value, _fold_bias(args[4], dims[4], size), out, lse,
                 *args[7:], **kwargs)
    unfolded = [_unfold(g, size, n) for g in grads]
    return tuple(g for g, _ in unfolded), tuple(d for _, d in unfolded)


@register(aten._use_cudnn_ctc_loss.default, aten._use_cudnn_ctc_loss.Tensor,
          aten._use_miopen_ctc_loss.default, aten._use_miopen_ctc_loss.Tensor)
def use_cudnn_ctc_loss(func, args, dims, kwargs):
    """Whether ``ctc_loss`` may take cuDNN's (or MIOpen's) kernel: not under vmap, where
    the native kernel's rule (above) batches it, and theirs have none."""
    return False, None
