"""Neural-network op rules (torchlevels/batching/nn.py) against torch.func.vmap and a loop.

Every check runs the same function three ways on the same inputs: torchlevels' vmap,
torch.func.vmap, and a Python loop over examples stacked with torch.stack. It also fails
if the slow per-example loop fallback ran for any op.
"""

from __future__ import annotations

import pytest
import torch
import torch.func as ft
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from vmap_reference import check_vmap, counting_dispatches, seeded, vmap_without_slow_loop

import torchlevels as tl
from torchlevels import grad, vmap
from torchlevels.vmap import BatchLevel

aten = torch.ops.aten
B = 3


def check(f, *args, in_dims=0, atol=1e-5, rtol=1e-4):
    """Assert vmap(f) == torch.func.vmap(f) == loop over examples, with no slow loop.

    NaNs compare equal, and every output of vmap(f) must be a plain torch.Tensor.
    """
    got = check_vmap(f, *args, in_dims=in_dims, atol=atol, rtol=rtol, equal_nan=True)
    for g in tree_flatten(got)[0]:
        assert type(g) is torch.Tensor, type(g)
    return got


def batched(t, dim=0):
    """A batch of B copies-with-noise of ``t``'s shape, the batch at ``dim``."""
    return torch.randn(t.shape[:dim] + (B,) + t.shape[dim:], dtype=t.dtype)


def maybe(t, is_batched, dim=0):
    """(argument, in_dim): ``t`` as is, or a batch of tensors like it at ``dim``."""
    return (batched(t, dim), dim) if is_batched else (t, None)


# -- convolution --------------------------------------------------------------------------

CONVS = [  # (function, input shape without N, weight shape, kwargs)
    (F.conv1d, (4, 9), (6, 4, 3), {}),
    (F.conv1d, (4, 9), (6, 2, 3), {"groups": 2, "stride": 2, "padding": 1}),
    (F.conv2d, (4, 7, 6), (6, 4, 3, 2), {"dilation": 2, "padding": (1, 2)}),
    (F.conv2d, (4, 7, 6), (8, 1, 3, 3), {"groups": 4, "stride": (2, 1)}),
    (F.conv3d, (2, 5, 4, 4), (4, 1, 2, 2, 2), {"groups": 2}),
    (F.conv_transpose1d, (4, 6), (4, 3, 3), {"stride": 2, "output_padding": 1}),
    (F.conv_transpose2d, (4, 5, 5), (4, 3, 3, 3), {"groups": 2, "padding": 1}),
    (F.conv_transpose3d, (2, 3, 3, 3), (2, 2, 2, 2, 2), {"stride": 2}),
]


@pytest.mark.parametrize("conv, xs, ws, kw", CONVS)
@pytest.mark.parametrize("xb, wb", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("bias", ["none", "unbatched", "batched"])
@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_convolution(conv, xs, ws, kw, xb, wb, bias, has_n, dim):
    x, xd = maybe(torch.randn(((2,) if has_n else ()) + xs), xb, dim)
    w, wd = maybe(torch.randn(ws), wb, dim)
    transposed = conv.__name__.startswith("conv_transpose")
    out_channels = ws[1] * kw.get("groups", 1) if transposed else ws[0]
    b, bd = maybe(torch.randn(out_channels), bias == "batched")
    if bias == "none":
        check(lambda x, w: conv(x, w, **kw), x, w, in_dims=(xd, wd))
    else:
        check(lambda x, w, b: conv(x, w, b, **kw), x, w, b, in_dims=(xd, wd, bd))


@pytest.mark.parametrize("conv, xs, ws, kw", CONVS)
@pytest.mark.parametrize("batched_args", [(0, 1), (0, 1, 2), (0, 2), (1,), (2,)])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False),
                                  (False, True, True), (True, False, True)])
def test_convolution_backward(conv, xs, ws, kw, batched_args, mask):
    transposed = conv.__name__.startswith("conv_transpose")
    x, w = torch.randn((2,) + xs), torch.randn(ws)
    go = conv(x, w, **kw)
    go = torch.randn_like(go)
    out_channels = go.shape[1]
    rest = (kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1))
    rest = tuple([r] * (w.dim() - 2) if isinstance(r, int) else list(r) for r in rest)
    output_padding = [kw.get("output_padding", 0)] * (w.dim() - 2)

    def f(go, x, w):
        return aten.convolution_backward(go, x, w, [out_channels], *rest, transposed,
                                         output_padding, kw.get("groups", 1), list(mask))

    args = [go, x, w]
    dims = [None, None, None]
    for i in batched_args:
        args[i], dims[i] = maybe(args[i], True, 1 if i == 1 else 0)
    # by the mask: unbatched, the CPU kernel can return a (meaningless) masked-out output
    check(lambda *a: tuple(o for o, m in zip(f(*a), mask) if m), *args, in_dims=tuple(dims),
          atol=1e-4)


def test_convolution_autograd_through_vmap():
    x = torch.randn(B, 2, 3, 6, 6, requires_grad=True)
    w = torch.randn(B, 4, 3, 3, 3, requires_grad=True)
    out = vmap(F.conv2d)(x, w)
    gx, gw = torch.autograd.grad(out.square().sum(), (x, w))
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = torch.stack([F.conv2d(a, b) for a, b in zip(x2, w2)])
    rx, rw = torch.autograd.grad(ref.square().sum(), (x2, w2))
    torch.testing.assert_close(gx, rx, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gw, rw, atol=1e-4, rtol=1e-4)


# -- pooling ------------------------------------------------------------------------------

POOLS = [
    (lambda x: F.max_pool1d(x, 2), 1),
    (lambda x: F.max_pool1d(x, 3, 2, 1, ceil_mode=True, return_indices=True), 1),
    (lambda x: F.max_pool2d(x, 2), 2),
    (lambda x: F.max_pool2d(x, (3, 2), 2, 1, dilation=(1, 2), return_indices=True), 2),
    (lambda x: F.max_pool3d(x, 2, return_indices=True), 3),
    (lambda x: F.avg_pool1d(x, 3, 2, 1), 1),
    (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False), 2),
    (lambda x: F.avg_pool2d(x, 2, divisor_override=3), 2),
    (lambda x: F.avg_pool3d(x, 2), 3),
    (lambda x: F.adaptive_avg_pool1d(x, 3), 1),
    (lambda x: F.adaptive_avg_pool2d(x, (3, 2)), 2),
    (lambda x: F.adaptive_avg_pool3d(x, 2), 3),
    (lambda x: F.adaptive_max_pool1d(x, 3, return_indices=True), 1),
    (lambda x: F.adaptive_max_pool2d(x, (3, 2), return_indices=True), 2),
    (lambda x: F.adaptive_max_pool3d(x, 2), 3),
]


@pytest.mark.parametrize("pool, k", POOLS)
@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_pooling(pool, k, has_n, dim):
    x = torch.randn(((2,) if has_n else ()) + (3,) + (7, 6, 5)[:k])
    x, _ = maybe(x, True, dim % (x.dim() + 1))
    check(pool, x, in_dims=dim)


@pytest.mark.parametrize("spatial", [2, 3])
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, -1)])
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample(spatial, dims, mode):
    x = torch.randn((2, 3) + (5, 4, 6)[:spatial], dtype=torch.float64)
    grid = torch.rand((2,) + (3, 2, 4)[:spatial] + (spatial,), dtype=torch.float64) * 2 - 1
    (x, xd), (grid, gd) = (maybe(t, d is not None, 0 if d is None else d % (t.dim() + 1))
                           for t, d in zip((x, grid), dims))

    def sample(x, grid):
        return F.grid_sample(x, grid, mode=mode, align_corners=False)

    def grads(lib):
        return lib.vmap(lib.grad(lambda x, g: sample(x, g).sin().sum(), argnums=(0, 1)),
                        in_dims=(xd, gd))(x, grid)

    # torch.func's own rule mis-batches batch dims that are not first: the loop decides
    front = all(d in (0, None) for d in (xd, gd))
    check_vmap(sample, x, grid, in_dims=(xd, gd), against_func=front)
    got = vmap_without_slow_loop(
        grad(lambda x, g: sample(x, g).sin().sum(), argnums=(0, 1)), x, grid, in_dims=(xd, gd))
    if front:
        torch.testing.assert_close(got, grads(torch.func))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["max", "avg", "adaptive_avg", "adaptive_max"])
@pytest.mark.parametrize("batched_args", [(0,), (1,), (0, 1)])
def test_pooling_backward(k, kind, batched_args):
    x = torch.randn((2, 3) + (7, 6, 5)[:k])
    if kind in ("max", "adaptive_max"):
        if kind == "max":
            if k == 1:
                pytest.skip("max_pool1d's backward is max_pool2d's")
            out, idx = getattr(F, f"max_pool{k}d")(x, 2, return_indices=True)
            op = getattr(aten, f"max_pool{k}d_with_indices_backward")

            def f(go, x):
                return op(go, x, [2] * k, [2] * k, [0] * k, [1] * k, False, idx)
        else:
            out, idx = getattr(F, f"adaptive_max_pool{k}d")(x, 3, return_indices=True)
            if k == 1:
                pytest.skip("adaptive_max_pool1d has no backward op of its own")
            op = getattr(aten, f"adaptive_max_pool{k}d_backward")

            def f(go, x):
                return op(go, x, idx)
    elif kind == "avg":
        if k == 1:
            pytest.skip("avg_pool1d has no backward op of its own")
        out = getattr(F, f"avg_pool{k}d")(x, 2)
        op = getattr(aten, f"avg_pool{k}d_backward")

        def f(go, x):
            return op(go, x, [2] * k, [2] * k, [0] * k, False, True, None)
    else:
        if k == 1:
            pytest.skip("adaptive_avg_pool1d has no backward op of its own")
        out = getattr(F, f"adaptive_avg_pool{k}d")(x, 3)
        op = getattr(aten, f"_adaptive_avg_pool{k}d_backward")

        def f(go, x):
            return op(go, x)
    args, dims = [torch.randn_like(out), x], [None, None]
    for i in batched_args:
        args[i], dims[i] = maybe(args[i], True, 1)
    check(f, *args, in_dims=tuple(dims))


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (1, -1)])
def test_fractional_max_pool_and_its_gradient(k, has_n, dims):
    """With the random samples given, so every way draws the same; either may be batched."""
    pool = getattr(F, f"fractional_max_pool{k}d")
    x, xd = maybe(torch.randn(((2,) if has_n else ()) + (3,) + (9, 8, 7)[:k],
                              dtype=torch.float64), dims[0] is not None, dims[0] or 0)
    samples, sd = maybe(torch.rand((2 if has_n else 1, 3, k), dtype=torch.float64),
                        dims[1] is not None, (dims[1] or 0) % 4)

    def f(x, samples):
        return pool(x, 2, output_size=(4,) * k, return_indices=True, _random_samples=samples)

    check(f, x, samples, in_dims=(xd, sd))

    def loss(x, samples):
        return f(x, samples)[0].sin().sum()

    got = vmap_without_slow_loop(grad(loss), x, samples, in_dims=(xd, sd))
    torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(loss), (xd, sd))(x, samples))


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_fractional_max_pool_draws_per_randomness_mode(randomness):
    x = torch.randn(3, 9, 9).repeat(4, 1, 1, 1)  # equal examples: pools differ by samples
    out = vmap(lambda v: F.fractional_max_pool2d(v, 2, output_size=4),
               randomness=randomness)(x)
    same = all(torch.equal(out[0], o) for o in out[1:])
    assert same == (randomness == "same")


# -- max pooling in channels-last layout (torchlevels/batching/max_pool.py) ---------------

MAX_POOL_ARGS = [(2,), (3, 2, 1, 1, True), (2, 1, 0, 2, False)]  # kernel, stride, pad, ...


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("values", ["random", "ties", "nan"])
@pytest.mark.parametrize("args", MAX_POOL_ARGS)
@pytest.mark.cpu_only("the channels-last max pool runs on the CPU alone")
def test_max_pool_in_channels_last_equals_pytorch(k, dtype, values, args):
    """Values, indices and strides as PyTorch's call on the contiguous input, NaN and ties
    (the first maximum wins) included."""
    from torchlevels.batching.max_pool import max_pool

    shape = (3, 8) + (9, 8, 7)[:k]
    if values == "random":
        x = (torch.randn(shape) * 10).to(dtype)
    elif values == "ties":
        x = torch.randint(0, 3, shape).to(dtype)
    else:
        if not dtype.is_floating_point:
            pytest.skip("integers have no NaN")
        x = torch.randn(shape).to(dtype)
        x.view(-1)[::7] = float("nan")
        x.view(-1)[::11] = float("-inf")
    op = getattr(aten, f"max_pool{k}d_with_indices")
    args = tuple([a] * k if type(a) is int else a for a in args)
    expected = op(x, *args)
    got = max_pool(op, x, *args)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, equal_nan=True, rtol=0, atol=0)
        assert g.stride() == e.stride()


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.cpu_only("the channels-last max pool runs on the CPU alone")
def test_max_pool_of_many_channels_runs_in_channels_last(k, has_n, monkeypatch):
    """From 4 channels up the batched max pool (the aten rule under grad, the shortcut
    without) runs in channels-last layout, and its result and per-example gradients
    equal torch.func's."""
    import torchlevels.batching.max_pool as max_pool_module

    answers = []
    original = max_pool_module.faster_in_channels_last
    monkeypatch.setattr(max_pool_module, "faster_in_channels_last",
                        lambda x: answers.append(original(x)) or answers[-1])
    x = torch.randn((B,) + ((2,) if has_n else ()) + (8,) + (9, 8, 7)[:k], dtype=torch.float64)
    pool = getattr(F, f"max_pool{k}d")

    def f(x):
        out, idx = pool(x, 3, 2, 1, return_indices=True)
        return out, idx

    check(f, x)
    assert answers == [True]
    grads = vmap_without_slow_loop(grad(lambda v: pool(v, 2).sin().sum()), x)
    torch.testing.assert_close(grads, torch.func.vmap(
        torch.func.grad(lambda v: pool(v, 2).sin().sum()))(x))
    assert answers == [True, True]


@pytest.mark.cpu_only("the channels-last max pool runs on the CPU alone")
def test_max_pool_of_few_channels_stays_contiguous():
    from torchlevels.batching.max_pool import faster_in_channels_last

    assert not faster_in_channels_last(torch.randn(4, 3, 8, 8))
    assert not faster_in_channels_last(torch.randn(4, 4, 8, 8, dtype=torch.bfloat16))
    assert not faster_in_channels_last(torch.randint(0, 9, (4, 8, 8, 8)))
    assert faster_in_channels_last(torch.randn(4, 8, 8, 8, dtype=torch.bfloat16))


# -- normalization ------------------------------------------------------------------------


@pytest.mark.parametrize("xb, wb, bb", [(True, False, False), (True, True, False),
                                        (True, False, True), (False, True, True),
                                        (True, None, None), (True, True, None)])
@pytest.mark.parametrize("dim", [0, 2])
def test_layer_norm(xb, wb, bb, dim):
    x, xd = maybe(torch.randn(2, 4, 5), xb, dim)
    w, wd = (None, None) if wb is None else maybe(torch.randn(4, 5), wb, 1)
    b, bd = (None, None) if bb is None else maybe(torch.randn(4, 5), bb)
    check(lambda x, w, b: F.layer_norm(x, (4, 5), w, b), x, w, b, in_dims=(xd, wd, bd))
    check(lambda x, w, b: aten.native_layer_norm(x, [5], None if w is None else w[0],
                                                 None if b is None else b[0], 1e-5),
          x, w, b, in_dims=(xd, wd, bd))


@pytest.mark.parametrize("xb, wb, bb", [(True, False, False), (True, True, True),
                                        (True, None, False), (False, True, False),
                                        (False, None, True)])
@pytest.mark.parametrize("dim", [0, 1])
def test_group_norm(xb, wb, bb, dim):
    x, xd = maybe(torch.randn(2, 6, 4, 3), xb, dim)
    w, wd = (None, None) if wb is None else maybe(torch.randn(6), wb)
    b, bd = maybe(torch.randn(6), bb)
    check(lambda x, w, b: F.group_norm(x, 3, w, b), x, w, b, in_dims=(xd, wd, bd))
    check(lambda x, w, b: aten.native_group_norm(x.contiguous(), w, b, 2, 6, 12, 2, 1e-5),
          x, w, b, in_dims=(xd, wd, bd))


BN_CASES = [  # which of (x, weight, bias, running_mean, running_var) are batched
    (True, False, False, False, False), (True, True, True, False, False),
    (True, False, False, True, True), (False, True, False, False, False),
    (False, False, False, True, True), (True, True, False, True, False),
]


@pytest.mark.parametrize("batched_args", BN_CASES)
@pytest.mark.parametrize("spatial", [(), (4, 3)])
def test_batch_norm_eval(batched_args, spatial):
    shapes = [(4, 5) + spatial, (5,), (5,), (5,), (5,)]
    args, dims = [], []
    for shape, b in zip(shapes, batched_args):
        a, d = maybe(torch.randn(shape), b)
        args.append(a), dims.append(d)
    args[4] = args[4].abs() + 0.5  # running_var > 0

    def f(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=False)

    check(f, *args, in_dims=tuple(dims))
    check(lambda x, w, b, rm, rv: aten._native_batch_norm_legit_no_training(
        x, w, b, rm, rv, 0.1, 1e-5)[0], *args, in_dims=tuple(dims))


@pytest.mark.parametrize("batched_args", [(True, False, False), (True, True, True),
                                          (False, True, False), (True, False, True)])
@pytest.mark.parametrize("dim", [0, 1])
def test_batch_norm_training_without_running_stats(batched_args, dim):
    args, dims = [], []
    for shape, b in zip([(4, 5, 3), (5,), (5,)], batched_args):
        a, d = maybe(torch.randn(shape), b, dim if len(shape) > 1 else 0)
        args.append(a), dims.append(d)
    check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), *args,
          in_dims=tuple(dims))
    check(lambda x, w, b: aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
          *args, in_dims=tuple(dims))
    check(lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
          *args, in_dims=tuple(dims))


@pytest.mark.parametrize("batched_args", [(True, True, False, False), (True, False, True, True),
                                          (False, True, False, True), (True, True, True, True)])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("backward", ["native_batch_norm_backward", "batch_norm_backward"])
def test_batch_norm_backward(batched_args, train, backward):
    """The backward op itself (grad_out, input, weight, stats), against the loop."""
    shapes = [(4, 5, 3), (4, 5, 3), (5,), (5,)]
    (go, x, w, stat), dims = zip(*(maybe(torch.randn(s), b) for s, b in zip(shapes, batched_args)))
    rm, rv = torch.randn(5), torch.rand(5) + 0.5
    mask = [True, True, True]

    def f(go, x, w, stat):
        mean, invstd = (stat, stat.abs() + 0.5) if train else (None, None)
        if backward == "batch_norm_backward":
            return aten.batch_norm_backward(go, x, w, rm, rv, mean, invstd, train, 1e-5, mask,
                                            torch.empty(0))
        return aten.native_batch_norm_backward(go, x, w, rm, rv, mean, invstd, train, 1e-5,
                                               mask)

    if backward == "batch_norm_backward" and not train and x.is_cuda:
        pytest.xfail("known gap, seen once on CUDA (H100, torch 2.11) and not yet explained: "
                     "with no saved statistics, CUDA's batch_norm_backward fails on the batched "
                     "call ('sym_strides() called on an undefined Tensor') but not per example")
    # torch.func's rule asserts on eval mode's missing saved statistics: the loop only
    check_vmap(f, go, x, w, stat, in_dims=dims, against_func=train)


@pytest.mark.parametrize("activation", [
    F.elu, F.hardsigmoid, F.hardswish, F.hardtanh, F.leaky_relu, F.mish, F.softplus,
    F.logsigmoid, F.hardshrink, F.softshrink,
])
def test_activation_backward_batched_natively(activation):
    """The backward op under vmap (a batched gradient, as jacrev makes; per-example
    gradients), and a Hessian through it: the native op's own double backward (the
    decompositions have none). hardshrink's and softshrink's backwards are not tagged
    pointwise and took the slow loop."""
    from torchlevels import hessian, jacrev

    x = torch.randn(5, dtype=torch.float64) * 3
    f = lambda x: activation(x).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(jacrev(activation)(x), torch.func.jacrev(activation)(x))
    xs = torch.randn(B, 5, dtype=torch.float64) * 3
    torch.testing.assert_close(vmap_without_slow_loop(grad(f), xs),
                               torch.func.vmap(torch.func.grad(f))(xs))
    if activation is not F.hardsigmoid:  # no forward-over-reverse formula in PyTorch
        torch.testing.assert_close(hessian(f)(x), torch.autograd.functional.hessian(f, x))


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("in_dims", [(0, 0, 0), (None, 1, 0), (2, None, None)])
def test_glu_jvp_rule(dim, in_dims):
    """glu's forward formula's op (jacfwd of glu runs it under vmap; it took the slow
    loop), its tensors batched anywhere or not."""
    from torchlevels import jacfwd

    x = torch.randn(4, 6, dtype=torch.float64)
    args = [F.glu(x, dim), x, torch.randn_like(x)]
    args = [batched(a, d) if d is not None else a for a, d in zip(args, in_dims)]
    check(lambda *a: aten.glu_jvp(*a, dim), *args, in_dims=in_dims)
    xs = torch.randn(B, 4, 6, dtype=torch.float64)
    f = lambda x: F.glu(x, dim).sin()  # noqa: E731
    expected = torch.stack([torch.autograd.functional.jacobian(f, x) for x in xs])
    torch.testing.assert_close(vmap_without_slow_loop(jacfwd(f), xs), expected)


@pytest.mark.parametrize("dim", [0, -1])
def test_per_example_hessian_vector_products_through_glu(dim):
    """Forward over reverse through glu under vmap runs glu_backward_jvp (it took the slow
    loop)."""
    from torchlevels import jvp

    xs = torch.randn(B, 4, 6, dtype=torch.float64)
    f = lambda x: F.glu(x, dim).pow(3).sum()  # noqa: E731
    got = vmap_without_slow_loop(lambda x: jvp(grad(f), (x,), (x.cos(),))[1], xs)
    expected = torch.stack([torch.autograd.functional.hvp(f, x, x.cos())[1] for x in xs])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("n", [1, 2])
def test_per_example_gradients_through_batch_norm_of_one_channel(n):
    """Eval mode, one channel: the running stats of the examples are one expanded element,
    which must reach the CPU kernel as real memory (it read past it before)."""
    from torchlevels import grad, jacrev, vmap

    rm, rv = torch.randn(1, dtype=torch.float64), torch.rand(1, dtype=torch.float64) + 0.5
    x = torch.randn(3, n, 1, dtype=torch.float64)
    f = lambda y: F.batch_norm(y, rm, rv, training=False).exp()  # noqa: E731
    loop = torch.stack([torch.autograd.grad(f(y).sum(), y)[0]
                        for y in x.clone().requires_grad_().unbind()])
    torch.testing.assert_close(vmap(grad(lambda y: f(y).sum()))(x), loop)
    torch.testing.assert_close(vmap(jacrev(f))(x), torch.func.vmap(torch.func.jacrev(f))(x))


@pytest.mark.parametrize("make, shape", [
    (lambda: torch.nn.Linear(5, 3), (5,)),
    (lambda: torch.nn.Conv2d(2, 4, 3), (2, 6, 6)),
])
@pytest.mark.parametrize("dim", [0, -1])
def test_per_example_gradients_through_weight_norm(make, shape, dim):
    """Weight norm's fused backward (``_weight_norm_interface_backward``, which took the
    slow loop) on per-example gradients of the norm's parameters and of the input, with
    every example's rows folded into the kernel's: against torch.func, and second
    derivatives through the native op's own double backward."""
    from torch.nn.utils.parametrizations import weight_norm

    from torchlevels import functional_call, jacrev

    module = weight_norm(make(), dim=dim % len(make().weight.shape)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(B, *shape, dtype=torch.float64)

    def loss(call):
        return lambda p, x: call(module, p, (x,)).sin().sum()

    ours, theirs = loss(functional_call), loss(torch.func.functional_call)
    got = vmap_without_slow_loop(grad(ours, argnums=(0, 1)), params, x, in_dims=(None, 0))
    expected = torch.func.vmap(torch.func.grad(theirs, argnums=(0, 1)), in_dims=(None, 0))
    torch.testing.assert_close(got, expected(params, x))
    got = vmap_without_slow_loop(jacrev(jacrev(ours)), params, x, in_dims=(None, 0))
    expected = torch.func.vmap(torch.func.jacrev(torch.func.jacrev(theirs)), in_dims=(None, 0))
    torch.testing.assert_close(got, expected(params, x))


@pytest.mark.parametrize("v_dim, g_dim", [(0, 0), (1, None), (2, 1), (None, 0)])
@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm_backward_rule(v_dim, g_dim, dim):
    """The backward op on directions and norms batched anywhere or not, along the first
    or the last dim of each example (the two the fused kernel takes)."""
    v, g = torch.randn(4, 3, 5), torch.randn(4 if dim == 0 else 5)
    g = g.view(-1, 1, 1) if dim == 0 else g.view(1, 1, -1)
    args, dims = [v, g], [v_dim, g_dim]
    for i, d in enumerate(dims):
        if d is not None:
            args[i] = batched(args[i], d)

    def backward(v, g):
        v, g = v.contiguous(), g.contiguous()  # as torch._weight_norm passes them
        w, norms = aten._weight_norm_interface(v, g, dim)
        return aten._weight_norm_interface_backward(w.cos(), v, g, norms, dim)

    check(backward, *args, in_dims=tuple(dims))
    with pytest.raises(RuntimeError, match="dim=-1, but the fused kernels take only"):
        vmap(lambda v: aten._weight_norm_interface_backward(v, v, g, g, -1))(v[None])


def test_hessian_through_batch_norm_in_training_mode():
    """The backward batched natively: an enclosing grad level gets its double backward."""
    from torchlevels import hessian

    x = torch.randn(4, 3, 2, dtype=torch.float64)
    f = lambda x: F.batch_norm(x, None, None, training=True).pow(3).sum()  # noqa: E731
    torch.testing.assert_close(hessian(f)(x), torch.autograd.functional.hessian(f, x))


@pytest.mark.parametrize("norm", ["eval", "train", "instance", "train_affine"])
def test_forward_over_reverse_through_batch_norm(norm):
    """jacfwd(jacrev(f)), torch.func's hessian: forward AD has no formula for the
    backward, whose decomposition gives masked-off gradients as placeholders."""
    from torchlevels import jacfwd, jacrev

    x = torch.randn(3, 2, 2, dtype=torch.float64)
    rm, rv = torch.zeros(2, dtype=torch.float64), torch.full((2,), 2.0, dtype=torch.float64)
    w = torch.randn(2, dtype=torch.float64)
    f = {"eval": lambda y: F.batch_norm(y, rm, rv, training=False).sin(),
         "train": lambda y: F.batch_norm(y, None, None, training=True).sin(),
         "instance": lambda y: F.instance_norm(y).sin(),
         "train_affine": lambda y: F.batch_norm(y, None, None, w, w, training=True).sin()}[norm]
    torch.testing.assert_close(jacfwd(jacrev(f))(x),
                               torch.func.jacfwd(torch.func.jacrev(f))(x))


def test_batch_norm_training_updates_batched_running_stats():
    x = torch.randn(B, 4, 5, 3)
    rm0, rv0 = torch.randn(B, 5), torch.rand(B, 5) + 0.5

    def run(vmapper):
        rm, rv = rm0.t().clone().t(), rv0.clone()  # batch dims 1 and 0 of the stats
        out = vmapper(lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True),
                      in_dims=(0, 1, 0))(x, rm.t(), rv)
        return out, rm, rv

    got, expected = run(vmap), run(torch.func.vmap)
    rm, rv = rm0.clone(), rv0.clone()
    looped = torch.stack([F.batch_norm(x[i], rm[i], rv[i], training=True) for i in range(B)])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(got[0], looped)
    torch.testing.assert_close(got[1], rm)
    torch.testing.assert_close(got[2], rv)


def test_batch_norm_with_update_updates_batched_running_stats_and_names_unbatched_ones():
    x = torch.randn(B, 4, 5)
    rm0, rv0 = torch.randn(B, 5), torch.rand(B, 5) + 0.5
    op = torch.ops.aten._batch_norm_with_update.default
    f = lambda x, rm, rv: op(x, None, None, rm, rv, 0.1, 1e-5)[:3]  # noqa: E731
    rm, rv = rm0.clone(), rv0.clone()
    got = vmap_without_slow_loop(f, x, rm, rv)
    rm_loop, rv_loop = rm0.clone(), rv0.clone()
    want = [torch.stack(o) for o in zip(*[f(x[i], rm_loop[i], rv_loop[i]) for i in range(B)])]
    torch.testing.assert_close(list(got), want)
    torch.testing.assert_close((rm, rv), (rm_loop, rv_loop))
    with pytest.raises(RuntimeError, match="running_mean/running_var in place"):
        vmap(f, in_dims=(0, None, None))(x, torch.zeros(5), torch.ones(5))


def test_batch_norm_training_with_unbatched_running_stats_errors():
    x = torch.randn(B, 4, 5)
    rm, rv = torch.zeros(5), torch.ones(5)
    with pytest.raises(RuntimeError, match="track_running_stats=False"):
        vmap(lambda x: F.batch_norm(x, rm, rv, training=True))(x)
    torch.testing.assert_close(rm, torch.zeros(5))  # left untouched


@pytest.mark.parametrize("spatial", [0, 2])
def test_batch_norm_training_of_an_ensemble_on_shared_input(spatial):
    """Only the affine parameters batched: every member normalizes x with the same
    statistics and, as in a loop, updates the running stats they share in turn (torch.func
    updates them once; its outputs are the same)."""
    x = torch.randn((4, 3) + (5,) * spatial)
    w, b = torch.randn(B, 3), torch.randn(B, 3)

    def f(w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3)

    rm, rv = torch.zeros(3), torch.ones(3)
    out = vmap(f, in_dims=(0, 0, None, None))(w, b, rm, rv)
    loop_rm, loop_rv = torch.zeros(3), torch.ones(3)
    loop = torch.stack([f(wi, bi, loop_rm, loop_rv) for wi, bi in zip(w, b)])
    torch.testing.assert_close((out, rm, rv), (loop, loop_rm, loop_rv))
    theirs = torch.func.vmap(f, in_dims=(0, 0, None, None))(w, b, torch.zeros(3), torch.ones(3))
    torch.testing.assert_close(out, theirs)


@pytest.mark.parametrize("in_dims", [  # of the running mean, running var and weight
    (0, None, None), (None, 1, None), (1, 0, None), (0, None, 0), (None, 1, 0), (None, None, 0)])
def test_batch_norm_training_on_shared_input_updates_each_running_stat_as_a_loop_does(
        in_dims):
    """x the same for every example: a batched running stat takes its example's update, a
    shared one every example's in turn (torch.func updates a shared one once)."""
    x = torch.randn(4, 5)
    rm, rv, w = torch.randn(B, 5), torch.rand(B, 5) + 0.5, torch.randn(B, 5)
    args = [t[0] if d is None else t.movedim(0, d).contiguous()
            for t, d in zip((rm, rv, w), in_dims)]
    in_dims = (None, *in_dims)

    def f(x, rm, rv, w):
        return F.batch_norm(x, rm, rv, w, None, training=True)

    ours = [t.clone() for t in (x, *args)]
    out = vmap_without_slow_loop(f, *ours, in_dims=in_dims)
    looped = [t.clone() for t in (x, *args)]
    loop = torch.stack([f(*(t if d is None else t.select(d, i)
                            for t, d in zip(looped, in_dims))) for i in range(B)])
    torch.testing.assert_close(out, loop)
    torch.testing.assert_close(ours, looped)
    theirs = [t.clone() for t in (x, *args)]
    torch.testing.assert_close(out, torch.func.vmap(f, in_dims=in_dims)(*theirs))


def test_batch_norm_training_names_the_shared_running_stat_batched_statistics_would_update():
    """Each example's own statistics would update a running stat they share in turn: a
    loop's sequence of updates, which vmap refuses as torch.func does, naming the stat."""
    x, rm, rv = torch.randn(B, 4, 5), torch.randn(B, 5), torch.rand(5) + 0.5
    before = rv.clone()
    with pytest.raises(RuntimeError, match="running_var is not batched.*Batch the running"):
        vmap(lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True),
             in_dims=(0, 0, None))(x, rm, rv)
    with pytest.raises(RuntimeError, match="were not batched"):
        torch.func.vmap(lambda x, rm, rv: F.batch_norm(x, rm, rv, training=True),
                        in_dims=(0, 0, None))(x, rm.clone(), rv.clone())
    torch.testing.assert_close(rv, before)  # left untouched


def test_norm_modules():
    x = torch.randn(B, 2, 4, 5, 5)
    for module in (torch.nn.BatchNorm2d(4, track_running_stats=False), torch.nn.GroupNorm(2, 4),
                   torch.nn.LayerNorm([5, 5]), torch.nn.BatchNorm2d(4).eval(),
                   torch.nn.InstanceNorm2d(4)):
        with torch.no_grad():
            check(module, x)


# the backwards of the norms: own rules (the gradients of a weight and a bias are
# per example; a batched weight scales the output gradient first)
@pytest.mark.parametrize("batched_args", [(0, 1), (0,), (1,), (0, 1, 2), (2,)])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_norm_backward_rules(batched_args, mask):
    x, w, b = torch.randn(2, 4, 3, 3), torch.randn(4), torch.randn(4)
    go = torch.randn_like(x)
    args, dims = [go, x, w], [None, None, None]
    for i in batched_args:
        args[i], dims[i] = maybe(args[i], True)
    mask = list(mask)

    def layer(go, x, w):
        _, mean, rstd = aten.native_layer_norm(x, [3], None, None, 1e-5)
        return aten.native_layer_norm_backward(go, x, [3], mean, rstd, w[:3], b[:3], mask)

    def layer_2d(go, x, w):  # normalized over two dims, no bias
        _, mean, rstd = aten.native_layer_norm(x, [3, 3], None, None, 1e-5)
        w2 = w[:3, None] * w[1:]
        return aten.native_layer_norm_backward(go, x, [3, 3], mean, rstd, w2, None,
                                               mask[:2] + [False])

    def layer_all(go, x, w):  # normalized over every dim: no rows to sum over
        _, mean, rstd = aten.native_layer_norm(x, [2, 4, 3, 3], None, None, 1e-5)
        w4 = (w[:, None, None] * x.new_ones(2, 4, 3, 3)).sin()
        return aten.native_layer_norm_backward(go, x, [2, 4, 3, 3], mean, rstd, w4, w4.cos(),
                                               mask)

    def group(go, x, w):
        _, mean, rstd = aten.native_group_norm(x, w, b, 2, 4, 9, 2, 1e-5)
        return aten.native_group_norm_backward(go, x, mean, rstd, w, 2, 4, 9, 2, mask)

    def batch(go, x, w):
        _, mean, invstd = aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
        return aten.native_batch_norm_backward(go, x, w, None, None, mean, invstd, True,
                                               1e-5, mask)

    for f in (layer, layer_2d, layer_all, group, batch):  # the gradients asked for
        check(lambda *a, f=f: tuple(g for g in f(*a) if g is not None), *args,
              in_dims=tuple(dims), atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", ["layer", "group"])
def test_per_example_norm_gradients_in_16_bit(dtype, norm):
    # the input's gradient is the kernel's on each example's rows, bit for bit; the
    # weight's is summed in float32, where the CPU kernel accumulates in the 16-bit type
    gen = seeded(0)
    xs = torch.randn(4, 6, 5, generator=gen).to(dtype)
    w, b = (torch.randn(6, generator=gen).to(dtype) for _ in range(2))
    if norm == "layer":
        def loss(x, w, b):
            return F.layer_norm(x, (5,), w[:5], b[:5]).square().sum()
    else:
        def loss(x, w, b):
            return F.group_norm(x.unsqueeze(0), 3, w, b).square().sum()
    got = vmap(grad(loss, argnums=(0, 1, 2)), in_dims=(0, None, None))(xs, w, b)
    rows = [torch.autograd.grad(loss(x, w_, b_), (x, w_, b_)) for x, w_, b_ in
            ((x.requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_())
             for x in xs.clone().unbind())]
    expected = [torch.stack(t) for t in zip(*rows)]
    assert torch.equal(got[0], expected[0])
    for g, e in zip(got[1:], expected[1:]):
        assert g.dtype == e.dtype
        # a few ulps: the kernel's 16-bit sums, in an order that depends on torch's
        # thread count
        torch.testing.assert_close(g, e, rtol=4 * torch.finfo(dtype).eps, atol=1e-3)


# -- losses -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("shape", [(5,), (4, 5), (4, 5, 3, 2)])
@pytest.mark.parametrize("xb, tb, wb", [(True, False, None), (True, True, None),
                                        (False, True, None), (True, False, False),
                                        (True, True, True), (False, False, True)])
def test_nll_loss_and_cross_entropy(reduction, shape, xb, tb, wb):
    x, xd = maybe(torch.randn(shape), xb)
    target_shape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t, td = torch.randint(0, 5, target_shape), None
    if tb:
        t, td = torch.randint(0, 5, (B,) + target_shape), 0
        t[(0,) * t.dim()] = -100  # one ignored target in the first example
    w, wd = (None, None) if wb is None else maybe(torch.rand(5) + 0.1, wb)
    if wd is not None:
        w = w.abs() + 0.1
    if x.is_cuda and len(shape) == 1 and tb and reduction == "mean":
        pytest.skip("an example whose one target is ignored: 0/0, NaN under vmap (ours and "
                    "torch.func's) and in the CPU kernel, but not in CUDA's per-example kernel")
    for loss in (F.nll_loss, F.cross_entropy):
        check(lambda x, t, w, loss=loss: loss(x, t, w, reduction=reduction), x, t, w,
              in_dims=(xd, td, wd))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(7,), (4, 7), (1, 7), ()])
@pytest.mark.parametrize("xb,tb", [(True, True), (True, False), (False, True)])
def test_multilabel_margin_loss(reduction, shape, xb, tb):
    x, xd = maybe(torch.randn(shape, dtype=torch.float64), xb)
    classes = shape[-1] if shape else 1
    t = torch.randint(-1, classes, (B,) + shape if tb else shape)

    def loss(x, t):
        return F.multilabel_margin_loss(x, t, reduction=reduction)

    check(loss, x, t, in_dims=(xd, 0 if tb else None))
    if xb:  # per-example gradients, against autograd: the backward op batched too
        ts = t if tb else t.expand((B,) + shape)
        go = torch.randn(loss(x[0], ts[0]).shape, dtype=torch.float64)
        got = vmap_without_slow_loop(lambda x, t: grad(lambda x: (loss(x, t) * go).sum())(x),
                                     x, t, in_dims=(0, 0 if tb else None))
        leaves = [xi.clone().requires_grad_() for xi in x]
        want = [torch.autograd.grad((loss(xi, ti) * go).sum(), xi)[0]
                for xi, ti in zip(leaves, ts)]
        torch.testing.assert_close(got, torch.stack(want))


_T, _C = 10, 5


def _ctc_case(layout):
    """(ctc_loss of (log_probs, targets, target_lengths), those three batched, in_dims)."""
    g = seeded(0)
    lp = torch.randn(B, _T, 2, _C, dtype=torch.float64, generator=g).log_softmax(-1)
    lengths = torch.tensor([[4, 2], [3, 3], [1, 4]])
    if layout == "unbatched N":  # one sequence per example: [T, C], targets [S], all of it
        return (lp[:, :, 0], torch.randint(1, _C, (B, 4), generator=g), torch.tensor([4] * B))
    if layout == "concatenated":  # every example's targets one after the other: [sum(L)]
        lengths = torch.tensor([[4, 2], [3, 3], [1, 5]])
        return lp, torch.randint(1, _C, (B, 6), generator=g), lengths
    return lp, torch.randint(1, _C, (B, 2, 4), generator=g), lengths


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("layout", ["padded", "concatenated", "unbatched N"])
@pytest.mark.parametrize("batched", ["all", "log_probs", "targets"])
def test_ctc_loss(reduction, layout, batched):
    lp, targets, lengths = _ctc_case(layout)
    in_dims = (0 if batched in ("all", "log_probs") else None,
               0 if batched in ("all", "targets") else None,
               0 if batched in ("all", "targets") else None)
    args = tuple(a if d == 0 else a[0] for a, d in zip((lp, targets, lengths), in_dims))

    def loss(lp, targets, lengths):
        input_lengths = torch.full(lp.shape[1:-1], _T, dtype=torch.long)
        return F.ctc_loss(lp, targets, input_lengths, lengths, reduction=reduction)

    check(loss, *args, in_dims=in_dims, atol=1e-7, rtol=1e-7)
    if in_dims[0] == 0:  # per-example gradients: the backward op batched too
        got = vmap_without_slow_loop(lambda *a: grad(lambda lp: loss(lp, *a[1:]).sum())(a[0]),
                                     *args, in_dims=in_dims)
        leaves = [x.clone().requires_grad_() for x in lp]
        want = [torch.autograd.grad(loss(x, *(a if d is None else a[i] for a, d in
                                              zip(args[1:], in_dims[1:]))).sum(), x)[0]
                for i, x in enumerate(leaves)]
        torch.testing.assert_close(got, torch.stack(want))


def test_ctc_loss_with_int_list_lengths_and_zero_infinity():
    lp, targets, _ = _ctc_case("padded")
    short = [3, _T]  # sequence 0 is too short for its targets: an infinite loss, zeroed

    def loss(lp, targets):
        return F.ctc_loss(lp, targets, short, [4, 2], reduction="none", zero_infinity=True)

    check(loss, lp, targets)
    got = vmap_without_slow_loop(lambda lp, t: grad(lambda x: loss(x, t).sum())(lp), lp, targets)
    want = [torch.autograd.grad(loss(x := a.clone().requires_grad_(), t).sum(), x)[0]
            for a, t in zip(lp, targets)]
    torch.testing.assert_close(got, torch.stack(want))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss_ignore_index_and_label_smoothing(reduction):
    x = torch.randn(B, 6, 5)
    t = torch.randint(0, 5, (B, 6))
    t[0] = 2  # every target of example 0 ignored: mean is nan, as unbatched
    check(lambda x, t: F.nll_loss(x, t, ignore_index=2, reduction=reduction), x, t)
    p = torch.randn(B, 6, 5).softmax(-1)
    check(lambda x, p: F.cross_entropy(x, p, reduction=reduction), x, p)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("image", [False, True])
def test_per_example_gradients_of_an_example_whose_targets_are_all_ignored(
        reduction, weighted, image):
    # padded token data: an all-padding example's mean loss is nan (0 / 0), as unbatched,
    # but its gradient is zeros, as torch.func and autograd give, not nan
    shape = (B, 4, 5, 2, 2) if image else (B, 4, 5)
    x, t = torch.randn(shape), torch.randint(0, 5, (B, 4, 2, 2) if image else (B, 4))
    t[1] = -100
    t[2, 0] = -100
    w = torch.rand(5) if weighted else None

    def loss(x, t):
        return F.cross_entropy(x, t, weight=w, reduction=reduction).sum()

    ours = vmap_without_slow_loop(tl.grad(loss), x, t)
    torch.testing.assert_close(ours, ft.vmap(ft.grad(loss))(x, t))
    want = torch.stack([torch.func.grad(loss)(x[i], t[i]) for i in range(B)])
    torch.testing.assert_close(ours, want)
    assert not ours.isnan().any()


LOSSES_OF_REAL_TARGETS = {
    "mse": F.mse_loss,
    "huber": F.huber_loss,
    "smooth_l1": F.smooth_l1_loss,
    "soft_margin": lambda a, b, **k: F.soft_margin_loss(a, b.sign(), **k),
    "binary_cross_entropy": lambda a, b, **k: F.binary_cross_entropy(a.sigmoid(), b.sigmoid(),
                                                                     **k),
}


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", LOSSES_OF_REAL_TARGETS)
def test_second_derivatives_of_a_loss_followed_by_more_ops(name, reduction):
    # the loss's backward then gets a grad_output that differs per example (and, in the
    # double backward, one of self's shape): its batching rule raised, or the op's own
    # double backward refused the grad_output it was given
    t = torch.randn(3, dtype=torch.float64)
    xs = torch.randn(2, 2, 3, dtype=torch.float64)
    loss = LOSSES_OF_REAL_TARGETS[name]
    f = lambda a: (loss(a, t, reduction=reduction) ** 2).cos().sum()  # noqa: E731

    def autograd_grad(a):
        a = a.clone().requires_grad_()
        return torch.autograd.grad(f(a), a)[0]

    hessians = torch.stack([torch.autograd.functional.hessian(f, r) for r in xs[0]])
    torch.testing.assert_close(tl.hessian(f)(xs[0, 0]), hessians[0])
    torch.testing.assert_close(tl.vmap(tl.hessian(f))(xs[0]), hessians)
    torch.testing.assert_close(tl.vmap(tl.jacfwd(tl.grad(f)))(xs[0]), hessians)
    torch.testing.assert_close(tl.vmap(tl.vmap(tl.grad(f)))(xs),
                               torch.stack([torch.stack(list(map(autograd_grad, row)))
                                            for row in xs]))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_label_smoothing(reduction):
    x, t = torch.randn(B, 6, 5), torch.randint(0, 5, (B, 6))
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, reduction=reduction), x, t)
    check(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.2, ignore_index=1,
                                       reduction=reduction), x, t)


@pytest.mark.parametrize("shape", [(B, 5), (B, 4, 5), (B, 4, 5, 2)], ids=["1-d", "2-d", "image"])
@pytest.mark.parametrize("weight_in_dim", [None, 0])
def test_weighted_label_smoothing_with_examples_ignoring_different_numbers_of_targets(
        shape, weight_in_dim):
    """PyTorch divides the mean by the weights of the targets kept, gathered with
    masked_select, which has no batched form when examples keep different numbers: the
    loss and its per-example gradients now match the loop, as torch.func's do. Before,
    vmap(grad) raised; example 1 keeps no target at all (its mean is nan, as unbatched)."""
    x = torch.randn(shape, dtype=torch.float64)
    example = list(shape[1:])
    del example[0 if len(example) == 1 else 1]  # the class dim
    t = torch.randint(0, 5, (B, *example))
    t[1] = -100
    t[2].view(-1)[0] = -100
    w = torch.rand(*(B,) * (weight_in_dim == 0), 5, dtype=torch.float64)

    def loss(x, t, w):
        return F.cross_entropy(x, t, weight=w, label_smoothing=0.1)

    in_dims = (0, 0, weight_in_dim)
    ws = w if weight_in_dim == 0 else w.expand(B, 5)
    want = torch.stack([loss(x[i], t[i], ws[i]) for i in range(B)])
    torch.testing.assert_close(vmap_without_slow_loop(loss, x, t, w, in_dims=in_dims), want,
                               equal_nan=True)
    grads = vmap_without_slow_loop(tl.grad(loss), x, t, w, in_dims=in_dims)
    torch.testing.assert_close(grads, torch.stack([ft.grad(loss)(x[i], t[i], ws[i])
                                                   for i in range(B)]))
    torch.testing.assert_close(grads, ft.vmap(ft.grad(loss), in_dims=in_dims)(x, t, w))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("xb, tb", [(True, True), (True, False), (False, True)])
def test_pointwise_losses(reduction, xb, tb):
    x, xd = maybe(torch.rand(4, 3), xb, 1)
    t, td = maybe(torch.rand(4, 3), tb)
    if xd is not None:
        x = x.sigmoid()
    if td is not None:
        t = t.sigmoid()
    w = torch.rand(3)
    check(lambda x, t: F.mse_loss(x, t, reduction=reduction), x, t, in_dims=(xd, td))
    check(lambda x, t: F.binary_cross_entropy(x, t, w, reduction=reduction), x, t,
          in_dims=(xd, td))
    check(lambda x, t: F.binary_cross_entropy_with_logits(x, t, w, reduction=reduction,
                                                          pos_weight=w + 1), x, t,
          in_dims=(xd, td))


ELEMENTWISE_LOSSES = {
    "mse": F.mse_loss,
    "huber": lambda x, t, reduction: F.huber_loss(x, t, reduction=reduction, delta=0.7),
    "smooth_l1": lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.3),
    "soft_margin": lambda x, t, reduction: F.soft_margin_loss(x, t.sign(), reduction=reduction),
}


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("name", list(ELEMENTWISE_LOSSES))
@pytest.mark.parametrize("shape, dims", [((B, 4, 5), (0, 0)), ((5, B), (1, None)),
                                         ((4, 5), (None, 0)), ((B,), (0, 0))])
def test_elementwise_losses(name, reduction, shape, dims):
    """Each has its own rule (before, the decompositions); float64 against both."""
    f = ELEMENTWISE_LOSSES[name]
    x, t = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    if dims[1] is None:
        t = t.select(1, 0)
    if dims[0] is None:
        x, t = x[0], torch.randn(B, *shape, dtype=torch.float64)
    if name == "soft_margin" and dims[0] is None:  # its input does not broadcast: an error
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            f(x, t[0], reduction=reduction)
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            vmap(lambda x, t: f(x, t, reduction=reduction), in_dims=dims)(x, t)
        return
    check(lambda x, t: f(x, t, reduction=reduction), x, t, in_dims=dims)
    loss = lambda x, t: f(x, t, reduction="mean")
    if dims[0] is not None:
        got = vmap_without_slow_loop(grad(loss), x, t, in_dims=dims)
        torch.testing.assert_close(got, torch.func.vmap(torch.func.grad(loss), dims)(x, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mse", "huber", "smooth_l1"])
def test_16_bit_losses_round_as_the_op_does(name, reduction, dtype):
    """The op computes each term in float32 and rounds once; its decomposition rounded
    every step, one ulp off the loop in 16-bit floats. Bit for bit with the loop (few
    elements: the kernels' vectorised and scalar paths agree on these)."""
    f = ELEMENTWISE_LOSSES[name]
    torch.manual_seed(0)
    for shape in [(8,), (8, 5)]:
        x, t = (torch.randn(shape) * 30).to(dtype), (torch.randn(shape) * 30).to(dtype)
        loss = lambda x, t: f(x, t, reduction=reduction)
        ours = vmap_without_slow_loop(loss, x, t, in_dims=(0, 0))
        assert torch.equal(ours, torch.stack([loss(a, b) for a, b in zip(x, t)]))
        assert torch.equal(ours, torch.func.vmap(loss)(x, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_batched_scalar_keeps_its_dtype(dtype):
    """A batched 0-dim tensor promotes as a scalar would: to the inputs' result dtype, not
    the float32 the kernel computes 16-bit floats in (which the result used to take)."""
    x, m = torch.randn(B, dtype=dtype), torch.tensor(True)
    v = torch.randn(4, dtype=dtype)
    for f in (lambda a: torch.masked_fill(a, m, 10), lambda a: a * v,
              lambda w: F.prelu(torch.tensor(1.0, dtype=dtype), w),
              lambda a: F.cosine_similarity(a, a.exp(), dim=0)):
        ours = check(f, x)
        assert ours.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_op_on_batched_scalar_keeps_its_dtype(dtype):
    """``self`` of an in-place op is written: it is never cast (a float32 one plus a
    float64 scalar raised "Double did not match Float")."""
    def f(a):
        out = a.clone()
        out.add_(torch.tensor(0.1, dtype=torch.float64)).clamp_min_(torch.tensor(0.0))
        return out

    assert check(f, torch.randn(B, dtype=dtype)).dtype == dtype


@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_loss_backward_decompositions(reduction):
    x, t = torch.randn(B, 4, 5).log_softmax(-1), torch.randint(0, 5, (B, 4))
    p, q = torch.rand(B, 4, 5), torch.rand(B, 4, 5)
    go = torch.randn(B, 4) if reduction == 0 else torch.randn(B)
    go5 = torch.randn(B, 4, 5) if reduction == 0 else torch.randn(B)

    def nll(go, x, t):
        total = aten.nll_loss_forward(x, t, None, reduction, -100)[1]
        return aten.nll_loss_backward(go, x, t, None, reduction, -100, total)

    check(nll, go, x, t)
    t[0, 0] = 1
    check(lambda go, x, t: aten.nll_loss_backward(go, x, t, None, reduction, 1, torch.tensor(3.)),
          go, x, t)
    check(lambda go, x, t, w: aten.nll_loss_backward(go, x[0], t[0], w, reduction, -100,
                                                     torch.tensor(2.)),
          go if reduction else go[:, 0], x, t, torch.rand(B, 5), in_dims=(0, 0, 0, 0))
    check(lambda go, p, q: aten.mse_loss_backward(go, p, q, reduction), go5, p, q)
    if reduction == 0:
        check(lambda go, p, q: aten.binary_cross_entropy_backward(go, p, q, None, reduction),
              go5, p, q)


LOSS_BACKWARDS = {  # the op, and its arguments after (grad_output, self, target, reduction)
    "mse": (aten.mse_loss_backward, ()),
    "huber": (aten.huber_loss_backward, (0.7,)),
    "smooth_l1": (aten.smooth_l1_loss_backward, (0.3,)),
    "soft_margin": (aten.soft_margin_loss_backward, ()),
    "binary_cross_entropy": (aten.binary_cross_entropy_backward, ()),
}


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("name", list(LOSS_BACKWARDS))
@pytest.mark.parametrize("dims", [(0, 0, 0), (0, None, None), (None, 1, None), (None, None, 1),
                                  (None, 0, 1), (0, 1, None)])
def test_elementwise_loss_backward_in_one_kernel(name, reduction, dims):
    """Its own rule runs the kernel once on the batch, whichever of grad_output, self and
    target are batched: a mean becomes a sum of grad_output over one example's elements
    (the decompositions it replaces dispatched eight ops)."""
    op, rest = LOSS_BACKWARDS[name]
    shapes = ((4, 5) if reduction == 0 else (), (4, 5), (4, 5))
    args = [(torch.rand(s[:d] + (B,) + s[d:], dtype=torch.float64) if d is not None
             else torch.rand(s, dtype=torch.float64)) * 0.8 + 0.1  # probabilities, for bce
            for s, d in zip(shapes, dims)]

    def f(go, x, t):
        if op is aten.binary_cross_entropy_backward:
            return op(go, x, t, None, reduction)
        return op(go, x, t, reduction, *rest)

    with counting_dispatches(BatchLevel) as calls:
        check(f, *args, in_dims=dims)
    assert calls == [op.default], calls


def _second_derivatives(lib, loss, x, t):
    """Per-example Hessians, and the gradient of the per-example gradients' squares: reverse
    over reverse (PyTorch has no forward formula for some of these backwards)."""
    return (lib.vmap(lib.jacrev(lib.grad(loss)))(x, t),
            lib.grad(lambda x, t: lib.vmap(lib.grad(loss))(x, t).pow(2).sum())(x, t))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(ELEMENTWISE_LOSSES) + ["binary_cross_entropy"])
def test_elementwise_loss_second_derivatives(name, reduction):
    """Through the backward's rule: the native op's own derivative formulas."""
    if name == "binary_cross_entropy":
        w = torch.rand(5, dtype=torch.float64)
        f = lambda x, t, reduction: F.binary_cross_entropy(  # noqa: E731
            x.sigmoid(), t.sigmoid(), w, reduction=reduction)
    else:
        f = ELEMENTWISE_LOSSES[name]
    x, t = torch.randn(B, 4, 5, dtype=torch.float64), torch.randn(B, 4, 5, dtype=torch.float64)
    loss = lambda x, t: f(x, t, reduction=reduction) * 3  # noqa: E731
    torch.testing.assert_close(_second_derivatives(tl, loss, x, t),
                               _second_derivatives(ft, loss, x, t))


@pytest.mark.parametrize("reduction", [1, 2])
def test_binary_cross_entropy_backward_reduced(reduction):
    p, q = torch.rand(B, 4, 5), torch.rand(B, 4, 5)
    check(lambda go, p, q: aten.binary_cross_entropy_backward(go, p, q, None, reduction),
          torch.randn(B), p, q)


# -- upsampling, padding, unfold, pixel shuffle -------------------------------------------


@pytest.mark.parametrize("mode, k", [("nearest", 1), ("nearest", 2), ("nearest", 3),
                                     ("nearest-exact", 2), ("linear", 1), ("bilinear", 2),
                                     ("bicubic", 2), ("trilinear", 3)])
@pytest.mark.parametrize("size", [{"scale_factor": 2}, {"scale_factor": 1.5}, {"size": 5}])
@pytest.mark.parametrize("dim", [0, 2])
def test_interpolate(mode, k, size, dim):
    x, _ = maybe(torch.randn((2, 3) + (4, 3, 3)[:k]), True, dim)
    check(lambda x: F.interpolate(x, mode=mode, **size), x, in_dims=dim)
    if mode in ("linear", "bilinear", "bicubic", "trilinear"):
        check(lambda x: F.interpolate(x, mode=mode, align_corners=True, **size), x,
              in_dims=dim)


@pytest.mark.parametrize("op, k, kw", [
    (aten.upsample_nearest2d_backward, 2, {}),
    (aten.upsample_bilinear2d_backward, 2, {"align_corners": False}),
    (aten.upsample_linear1d_backward, 1, {"align_corners": True}),
])
def test_upsample_backward(op, k, kw):
    go = torch.randn((B, 2, 3) + (6,) * k)
    check(lambda go: op(go, [6] * k, [2, 3] + [3] * k, *kw.values()), go)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_pad(mode, k, has_n, dim):
    x, _ = maybe(torch.randn(((2,) if has_n else ()) + (3, 4, 5, 4)[: k + 1]), True, dim)
    pad = (1, 2, 2, 0, 0, 1)[: 2 * k]
    check(lambda x: F.pad(x, pad, mode=mode), x, in_dims=dim)
    if mode == "constant":
        check(lambda x: F.pad(x, (1, -1, 2, 2), value=3.0), x, in_dims=dim)


def test_pad_circular():
    check(lambda x: F.pad(x, (1, 2, 2, 0), mode="circular"), torch.randn(B, 2, 3, 4, 5))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("has_n", [True, False])
def test_pad_backward(k, has_n):
    if k == 3 and not has_n:
        pytest.skip("reflection_pad3d_backward needs the N dim")
    x = torch.randn(((2,) if has_n else ()) + (3, 5, 4, 4)[: k + 1])
    pad = [1, 2, 2, 0, 0, 1][: 2 * k]
    go = F.pad(x, pad, mode="reflect")
    for name in (f"reflection_pad{k}d_backward", f"replication_pad{k}d_backward"):
        op = getattr(aten, name)
        check(lambda go, x, op=op: op(go, x, pad), batched(go), batched(x))


@pytest.mark.parametrize("has_n", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_unfold_fold(has_n, dim):
    x, _ = maybe(torch.randn(((2,) if has_n else ()) + (3, 6, 5)), True, dim)
    check(lambda x: F.unfold(x, (2, 3), dilation=1, padding=1, stride=2), x, in_dims=dim)
    check(lambda x: F.fold(F.unfold(x, 3, padding=1), (6, 5), 3, padding=1), x, in_dims=dim)


@pytest.mark.parametrize("dim", [0, 1, 3])
def test_pixel_shuffle(dim):
    x, _ = maybe(torch.randn(2, 8, 4, 6), True, dim)
    check(lambda x: F.pixel_shuffle(x, 2), x, in_dims=dim)
    check(lambda x: F.pixel_unshuffle(x, 2), x, in_dims=dim)
    check(lambda x: F.pixel_shuffle(x[0], 2), x, in_dims=dim)


def test_pixel_shuffle_of_a_batch_laid_out_channels_last_3d():
    # A batch of 4-d examples whose first dim has stride 1 is a channels-last-3d 5-d
    # tensor, a layout the kernel refuses on its own (found by the wide fuzzer).
    x = torch.randn(B, 3, 8, 2, 2).contiguous(memory_format=torch.channels_last_3d)
    check(lambda x: F.pixel_shuffle(x, 2), x)
    check(lambda x: F.pixel_unshuffle(x, 2), x)


# -- a whole network -----------------------------------------------------------------------


def test_small_cnn_matches():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8).eval(), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3), torch.nn.GroupNorm(4, 16),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )
    x, t = torch.randn(B, 4, 3, 12, 12), torch.randint(0, 10, (B, 4))
    with torch.no_grad():
        check(lambda x, t: F.cross_entropy(net(x), t), x, t)


@pytest.mark.parametrize("k", [2, 3])
def test_adaptive_max_pool_backward_with_shared_indices(k):
    """A batched grad with unbatched self/indices: the kernel once crashed on expanded args."""
    pool = (F.adaptive_max_pool2d, F.adaptive_max_pool3d)[k - 2]
    op = (aten.adaptive_max_pool2d_backward, aten.adaptive_max_pool3d_backward)[k - 2]
    x = torch.randn((1, 2) + (4,) * k)
    out, idx = pool(x, 2, return_indices=True)
    grads = torch.randn(B, *out.shape)
    check(lambda g: op(g, x, idx), grads)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape, target_shape", [
    ((7,), ()), ((4, 7), (4,)),
    # the unreduced loss takes the target's shape: (1,) for one row given as (1,)
    ((7,), (1,)), ((1, 7), ()), ((), (1,)), ((), ())])
@pytest.mark.parametrize("xb,tb,wb", [(True, True, None), (True, False, False),
                                      (False, True, True), (True, True, True)])
def test_multi_margin_loss_per_example_gradients(reduction, shape, target_shape, xb, tb, wb):
    """The backward op batched (a batched class weight scales each row's gradient), against
    autograd per example; p=2 and a margin other than 1 reach the kernel as given."""
    x, xd = maybe(torch.randn(shape, dtype=torch.float64), xb)
    classes = shape[-1] if shape else 1
    t, td = (torch.randint(0, classes, (B,) + target_shape), 0) if tb else (
        torch.randint(0, classes, target_shape), None)
    w, wd = (None, None) if wb is None else maybe(torch.rand(classes, dtype=torch.float64),
                                                  wb)
    if wd is not None:
        w = w.abs() + 0.1

    def loss(x, t, w):
        return F.multi_margin_loss(x, t, p=2, margin=0.7, weight=w, reduction=reduction)

    check(loss, x, t, w, in_dims=(xd, td, wd))
    go = torch.randn(loss(x[0] if xb else x, t[0] if tb else t, w[0] if wd is not None else w
                          ).shape, dtype=torch.float64)
    got = vmap_without_slow_loop(
        lambda x, t, w: grad(lambda x: (loss(x, t, w) * go).sum())(x), x, t, w,
        in_dims=(xd, td, wd))
    want = []
    for k in range(B):
        xk = (x[k] if xb else x).clone().requires_grad_()
        out = loss(xk, t[k] if tb else t, w[k] if wd is not None else w)
        want.append(torch.autograd.grad((out * go).sum(), xk)[0])
    torch.testing.assert_close(got, torch.stack(want))


def test_multi_margin_loss_checks_the_weight_size():
    x, t = torch.randn(B, 4, 7), torch.randint(0, 7, (B, 4))
    for w, in_dims in [(torch.rand(9), (0, 0, None)), (torch.rand(B, 5), (0, 0, 0))]:
        with pytest.raises(RuntimeError, match="inconsistent weight size"):
            vmap(lambda x, t, w: F.multi_margin_loss(x, t, weight=w), in_dims)(x, t, w)
        with pytest.raises(RuntimeError, match="inconsistent weight size"):
            F.multi_margin_loss(x[0], t[0], weight=w[0] if in_dims[2] == 0 else w)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("name, f, shapes", [
    ("max_unpool2d", lambda o, i: F.max_unpool2d(o, i, 2), [(B, 2, 2, 2), None]),
    ("max_unpool1d", lambda o, i: F.max_unpool1d(o, i, 2), [(B, 2, 4), None]),
    ("prelu", F.prelu, [(B, 2, 4), (B, 1)]),
    ("multi_margin_loss", F.multi_margin_loss, [(B, 2, 5), "target"]),
])
def test_a_dtype_the_ops_kernel_lacks_raises_its_error(name, f, shapes, dtype):
    if name.startswith("max_unpool") and dtype == torch.int64 and torch.empty(0).is_cuda:
        pytest.skip("CUDA's max_unpool has an int64 kernel")
    # these ops are batched in other ops (a decomposition), which took integer, bool and
    # complex input that each example's call refuses ("... not implemented for 'Long'")
    x = torch.randn(shapes[0]).to(dtype)
    if shapes[1] is None:  # max_unpool's indices: where max pooling found each maximum
        y = torch.arange(0, 2 * x[0, 0].numel(), 2).view(x.shape[2:]).expand(x.shape)
    elif shapes[1] == "target":
        y = torch.randint(0, 5, (B, 2))
    else:
        y = torch.ones(shapes[1]).to(dtype)
    with pytest.raises(NotImplementedError, match="not implemented for") as expected:
        ft.vmap(f)(x, y)
    with pytest.raises(NotImplementedError, match=str(expected.value).split('"')[1]):
        vmap(f)(x, y)


@pytest.mark.cpu_only("CUDA's multi_margin_loss has a float16 kernel")
def test_multi_margin_loss_of_float16_raises_where_its_cpu_kernel_does():
    x, target = torch.randn(B, 2, 5).half(), torch.randint(0, 5, (B, 2))
    with pytest.raises(NotImplementedError, match="not implemented for 'Half'"):
        ft.vmap(F.multi_margin_loss)(x, target)
    with pytest.raises(NotImplementedError, match="not implemented for 'Half'"):
        vmap(F.multi_margin_loss)(x, target)
