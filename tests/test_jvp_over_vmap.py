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


def _count_trips(monkeypatch) -> list:
    trips = []
    dispatch = BatchLevel.dispatch
    monkeypatch.setattr(BatchLevel, "dispatch",
                        lambda *a, **k: trips.append(a[2]) or dispatch(*a, **k))
    return trips


def test_numbers_take_the_scalar_overload_on_the_physical_duals(monkeypatch):
    def f(x):
        return ((x * 0.5 + 1) / 3 - 2 + x * True + (1 - x) + x.div(2, rounding_mode=None)
                + torch.add(x, 2.0, alpha=3) + torch.sub(x, x.exp(), alpha=0.5))

    trips = _count_trips(monkeypatch)
    ours = tl.vmap(lambda x, t: tl.jvp(f, (x,), (t,)))(XS, TS)
    assert not trips
    for a, e in zip(ours, tf.vmap(lambda x, t: tf.jvp(f, (x,), (t,)))(XS, TS)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
@pytest.mark.parametrize("f", [pointwise, in_place_views_and_others], ids=lambda f: f.__name__)
def test_jacfwd_matches_torch_func(f, argnums):
    x, r = XS[0], ROW[0]
    torch.testing.assert_close(tl.jacfwd(f, argnums)(x, r), tf.jacfwd(f, argnums)(x, r))
    # and under vmap, where the primal is batched by the outer level
    torch.testing.assert_close(tl.vmap(tl.jacfwd(f, argnums))(XS, ROW),
                               tf.vmap(tf.jacfwd(f, argnums))(XS, ROW))


def test_jacfwd_runs_small_ops_on_copies_of_its_primal_and_large_ones_the_usual_way(
        monkeypatch):
    """jacfwd's primal is not batched (one for all the basis tangents): a pointwise op
    with few elements runs on one copy of it per tangent, on the physical duals; a large
    one, whose copies would cost more than the trips saved, takes the usual way."""
    def chain(x):
        return (x.sin() * x + x.exp() / (1 + x * x) + BIAS.expand_as(x)).tanh()

    trips = _count_trips(monkeypatch)
    small = torch.randn(3, 4, generator=seeded(26), dtype=D)
    torch.testing.assert_close(tl.jacfwd(chain)(small), tf.jacfwd(chain)(small))
    assert not [op for op in trips if torch.Tag.pointwise in op.tags]
    large = torch.randn(40, 4, generator=seeded(27), dtype=D)  # 160 tangents of 160
    torch.testing.assert_close(tl.jacfwd(chain)(large), tf.jacfwd(chain)(large))
    assert [op for op in trips if torch.Tag.pointwise in op.tags]


def test_jacfwds_primal_stays_one_plain_tensor():
    """Its primal results are not batched: Python control flow reads them, and has_aux
    gives them back as torch.func does."""
    def f(x):
        y = x.sin() * x
        z = y.exp() if y.sum() > 0 else y.cos()  # reads the primal
        return z * z.max().item(), (y, z)

    x = XS[0]
    (j, (y, z)), (j_tf, (y_tf, z_tf)) = [lib.jacfwd(f, has_aux=True)(x) for lib in (tl, tf)]
    torch.testing.assert_close(j, j_tf)
    for a, e in ((y, y_tf), (z, z_tf)):
        assert type(a) is torch.Tensor and a.shape == x.shape
        torch.testing.assert_close(a, e)


def test_expanded_primals_take_the_usual_way():
    """make_dual refuses a primal whose elements share memory: an expanded input, or a
    constant expanded to the input's shape, takes the usual way. (torch.func's jacfwd
    refuses an expanded input itself.)"""
    def f(v):
        return v.sin() * BIAS.expand_as(v) + v

    xs = XS[:1].expand(5, 3, 4)
    for a, e in zip(tl.vmap(lambda x, t: tl.jvp(f, (x,), (t,)))(xs, TS),
                    tf.vmap(lambda x, t: tf.jvp(f, (x,), (t,)))(xs, TS)):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(tl.jacfwd(f)(XS[0]), tf.jacfwd(f)(XS[0]))
