"""A jvp level's pointwise ops right inside a vmap level run once on the physical duals
(torchlevels/jvp_over_vmap.py): the same results as torch.func, in one trip through the
levels an op where the usual way takes about seven."""

import pytest
import torch
import torch.func as tf
from vmap_reference import seeded

import torchlevels as tl
from torchlevels.vmap import BatchLevel

D = torch.float64
XS = torch.randn(5, 3, 4, generator=seeded(21), dtype=D)
TS = torch.randn(5, 3, 4, generator=seeded(22), dtype=D)
ROW = torch.randn(5, 4, generator=seeded(23), dtype=D)  # examples of fewer dims
ROW_T = torch.randn(5, 4, generator=seeded(24), dtype=D)


BIAS = torch.randn(4, generator=seeded(25), dtype=D)


def pointwise(x, r):
    y = x.sin() * x + x.exp() / (1 + x * x)  # numbers where the op takes a number or not
    y = (y + BIAS) * torch.maximum(BIAS, x) - x.detach() * y  # captured and constant tensors
    y = torch.atan2(y, r) + torch.maximum(x, r) - y.pow(3) + 2 ** x.clamp(-1, 1)
    return torch.where(y > 0, y, r.tanh()) * torch.lerp(x, r, 0.25)


def in_place_views_and_others(x, r):
    y = x.clone()
    y.mul_(r)  # in place
    z = y[1:] * 2  # a view's
    return z.sum(-1) + x.mean() + (x[1:].to(torch.float32) * 3).double().sum(-1)  # others


@pytest.mark.parametrize("f", [pointwise, in_place_views_and_others], ids=lambda f: f.__name__)
@pytest.mark.parametrize("in_dims", [0, 1], ids=["batch first", "batch second"])
def test_vmap_of_jvp_matches_torch_func(f, in_dims):
    xs, ts = XS.movedim(0, in_dims), TS.movedim(0, in_dims)

    def run(lib):
        return lib.vmap(lambda x, t, r, rt: lib.jvp(f, (x, r), (t, rt)),
                        in_dims=(in_dims, in_dims, 0, 0))(xs, ts, ROW, ROW_T)

    for a, e in zip(run(tl), run(tf)):
        torch.testing.assert_close(a, e)


def test_a_pointwise_op_crosses_the_vmap_level_once(monkeypatch):
    trips = []
    dispatch = BatchLevel.dispatch
    monkeypatch.setattr(BatchLevel, "dispatch",
                        lambda *a, **k: trips.append(a[2]) or dispatch(*a, **k))

    def chain(x):
        return (x.sin().cos().exp().tanh().sin() * x + BIAS) * BIAS.exp()

    tl.vmap(lambda x, t: tl.jvp(chain, (x,), (t,)))(XS, TS)
    assert not trips  # each op ran on the physical duals, no trip through the vmap level
    expected = tf.vmap(lambda x, t: tf.jvp(chain, (x,), (t,)))(XS, TS)
    for a, e in zip(tl.vmap(lambda x, t: tl.jvp(chain, (x,), (t,)))(XS, TS), expected):
        torch.testing.assert_close(a, e)


def test_tensors_autograd_outside_tracks_take_the_usual_way():
    xs = XS.clone().requires_grad_()
    out = tl.vmap(lambda x, t: tl.jvp(lambda v: v.sin() * v, (x,), (t,))[1])(xs, TS)
    (ours,) = torch.autograd.grad(out.sum(), xs)
    out = tf.vmap(lambda x, t: tf.jvp(lambda v: v.sin() * v, (x,), (t,))[1])(xs, TS)
    (theirs,) = torch.autograd.grad(out.sum(), xs)
    torch.testing.assert_close(ours, theirs)
