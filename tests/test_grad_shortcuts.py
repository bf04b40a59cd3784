"""A grad level's shortcuts (grad_shortcuts.py): each call taken or declined as designed,
and every result equal to torch.func's on the same inputs."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as ft
import torch.nn.functional as F
from vmap_reference import counting_dispatches

import torchlevels as tl
from torchlevels.autodiff import GradLevel, grad_level
from torchlevels.grad_shortcuts import CALLS

assert_close = torch.testing.assert_close


W, B = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
LOSSES = {  # losses of weights w (6, 5) and an example x (5,)
    "pointwise": lambda w, x: (torch.sin(w * x) + x.exp() / 3 - w ** 2).tanh().sum(),
    "activations": lambda w, x: (F.gelu(w) * F.silu(x) + F.relu(w - x)).sum(),
    "linear of a vector": lambda w, x: F.linear(x, w, B).square().sum(),
    "linear of a computed weight": lambda w, x: F.linear(x, w.sin() * 2).square().sum(),
    "linear of a matrix": lambda w, x: F.linear(x.unsqueeze(0), w).sin().sum(),
    "matmul and views": lambda w, x: (w @ x).view(2, 3).t().reshape(-1).log_softmax(0).sum(),
    "cross entropy": lambda w, x: F.cross_entropy(F.linear(x, w)[None], torch.tensor([2])),
    "layer norm": lambda w, x: F.layer_norm(w * x, (5,), w[0], w[1]).pow(3).mean(),
    "einsum, softmax, masked_fill": lambda w, x: torch.einsum("ij,j->i", w, x).softmax(0)
    .masked_fill(torch.arange(6) > 3, 0.5).log().sum(),
    "indexing and splitting": lambda w, x: (
        w[1:, None, :3].expand(5, 2, 3).sin().sum() + x.split(2)[0].sum()
        + w.unflatten(0, (2, 3)).unbind(0)[1].square().sum() + w.chunk(3)[2].amax()
        + w.narrow(1, 1, 2).select(0, -1).logsumexp(0) + w[torch.tensor([0, 2]), 1:].sum()
        + w[w > 0].exp().sum() + torch.cat([w, x[None]]).sin().sum()
        + torch.stack((w[0], x), 1).cos().sum()),
    "norms and reductions": lambda w, x: (
        F.normalize(w * x, dim=-1).sum() + F.rms_norm(w, (5,)).pow(3).sum()
        + torch.linalg.vector_norm(w - x) + w.std(0).sum() + w.var() + x.cumsum(0).sum()
        + torch.where(w > 0, w, x).exp().sum() + w.amin(1).sum() + w.norm(dim=1).sum()
        + torch.norm(w * x, 3, (0, 1)) + (w[:, None] * x).norm()),
}


@pytest.mark.parametrize("name", LOSSES)
def test_per_example_gradients_equal_torch_func(name):
    """The weights unbatched and the examples batched: calls that mix a grad level's plain
    leaves with a vmap level's tensors, composite ones among them."""
    loss = LOSSES[name]
    w, x = W.clone(), torch.randn(4, 5, dtype=torch.float64)
    for argnums in (0, 1, (0, 1)):
        ours = tl.vmap(tl.grad(loss, argnums), in_dims=(None, 0))(w, x)
        theirs = ft.vmap(ft.grad(loss, argnums), in_dims=(None, 0))(w, x)
        assert_close(ours, theirs)


@pytest.mark.parametrize("name", LOSSES)
def test_gradients_equal_torch_func_in_every_nesting(name):
    loss = LOSSES[name]
    w, x = W.clone(), torch.randn(5, dtype=torch.float64)
    assert_close(tl.grad(loss)(w, x), ft.grad(loss)(w, x))
    assert_close(tl.jacrev(tl.grad(loss, 1), 1)(w, x), ft.jacrev(ft.grad(loss, 1), 1)(w, x))
    assert_close(tl.hessian(loss, 1)(w, x), ft.hessian(loss, 1)(w, x))
    xs = torch.randn(3, 5, dtype=torch.float64)
    assert_close(tl.grad(lambda w: tl.vmap(loss, in_dims=(None, 0))(w, xs).sum())(w),
                 ft.grad(lambda w: ft.vmap(loss, in_dims=(None, 0))(w, xs).sum())(w))


def test_elementwise_calls_reach_no_grad_dispatch():
    x = torch.randn(4, 5)
    f = lambda x: (torch.sin(x) * x + 2 - x.exp() / (1 + x.abs())).sum()  # noqa: E731
    with counting_dispatches(GradLevel) as calls:
        ours = tl.vmap(tl.grad(f))(x)
    assert_close(ours, ft.vmap(ft.grad(f))(x))
    assert not calls, calls


@pytest.mark.parametrize("name", [name for name in LOSSES if name != "cross entropy"])
def test_calls_of_a_loss_reach_no_grad_dispatch(name):
    """Composite calls (einsum, F.normalize) run whole on the inner tensors: autograd
    records their pieces there, and none goes through the grad level's dispatch."""
    loss, w, x = LOSSES[name], W.clone(), torch.randn(5, dtype=torch.float64)
    with counting_dispatches(GradLevel) as calls:
        ours = tl.grad(loss)(w, x)
    assert_close(ours, ft.grad(loss)(w, x))
    assert not calls, calls


def _double(*shape):
    return torch.randn(*shape, dtype=torch.float64)


# calls of an example (first argument) and weights, with the shapes of both
MIXED_CALLS = {
    "linear": (lambda x, w, b: F.linear(x, w, b), (3, 5), ((6, 5), (6,))),
    "linear of a vector": (lambda x, w: F.linear(x, w), (5,), ((6, 5),)),
    "linear of a 3-d example": (lambda x, w, b: F.linear(x, w, b), (2, 3, 5), ((6, 5), (6,))),
    "layer norm": (lambda x, w, b: F.layer_norm(x, (5,), w, b), (3, 5), ((5,), (5,))),
    "rms norm": (lambda x, w: F.rms_norm(x, (5,), w), (3, 5), ((5,),)),
    "group norm": (lambda x, w, b: F.group_norm(x, 3, w, b), (2, 6, 5), ((6,), (6,))),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), (2, 7), ((3, 2, 3), (3,))),
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=2), (1, 2, 5, 5), ((3, 2, 3, 3),)),
}


@pytest.mark.parametrize("name", MIXED_CALLS)
def test_calls_of_a_batch_and_tracked_weights_run_whole(name):
    """Per-example gradients in the weights of F.linear, norms and convolutions: each call
    runs whole on the inner tensors, and the vmap level records no graph of its own on
    its physical tensors (the view ``w.t()`` that F.linear makes of a weight the grad level
    tracks counts as tracked by that level alone)."""
    call, example, weights = MIXED_CALLS[name]
    xs, ws = _double(4, *example), [_double(*s) for s in weights]
    loss = lambda x, *w: call(x, *w).sin().sum()  # noqa: E731
    argnums = tuple(range(1, len(ws) + 1))
    in_dims = (0, *(None for _ in ws))
    with counting_dispatches(GradLevel) as calls:
        ours = tl.vmap(tl.grad(loss, argnums), in_dims)(xs, *ws)
    assert_close(ours, ft.vmap(ft.grad(loss, argnums), in_dims)(xs, *ws))
    assert not calls, calls
    assert not any(g.requires_grad for g in ours)
    with tl.vmap() as V, grad_level() as G:
        out = G.unwrap(call(V(xs), *map(G, ws)))
        assert out.requires_grad and not V.unwrap(out).requires_grad


def test_a_named_tuple_of_tensors_is_unwrapped():
    """torch.stack of aminmax's named tuple: its tensors are unwrapped like a tuple's (a
    grad level's tensor handed on as it is would be wrapped twice)."""
    loss = lambda w, x: torch.stack(torch.aminmax(w * x, dim=0)).exp().sum()  # noqa: E731
    w, xs = W.clone(), torch.randn(4, 5, dtype=torch.float64)
    assert_close(tl.grad(loss)(w, xs[0]), ft.grad(loss)(w, xs[0]))
    assert_close(tl.vmap(tl.grad(loss), in_dims=(None, 0))(w, xs),
                 ft.vmap(ft.grad(loss), in_dims=(None, 0))(w, xs))


def test_autograd_outside_sees_the_per_example_gradients():
    """A gradient penalty: the per-example gradients are differentiated by autograd
    outside, through calls the grad level ran whole (F.linear of a tracked weight)."""
    w = W.clone().requires_grad_()
    x = torch.randn(4, 5, dtype=torch.float64)

    def penalty(lib):
        g = lib.vmap(lib.grad(lambda x: F.linear(x, w).tanh().sum()))(x)
        return torch.autograd.grad(g.square().sum(), w)[0]

    assert_close(penalty(tl), penalty(ft))


def test_results_carry_no_autograd_history():
    """A per-example gradient of F.linear (run whole, its W.t() made beneath the grad
    level) comes out as plain values, as in torch.func."""
    out = tl.vmap(tl.grad(lambda w, x: F.linear(x, w).sum()), in_dims=(None, 0))(
        W, torch.randn(4, 5, dtype=torch.float64))
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("call", [
    lambda x: x.add_(1),  # in place
    lambda x: F.relu(x, inplace=True),
    lambda x: torch.add(x, 1, out=torch.empty(5)),
    lambda x: torch.roll(x, 1),
], ids=["add_", "relu inplace", "out=", "not a shortcut"])
def test_unusual_calls_take_the_usual_way(call):
    f = lambda x: call(x * 1).sum()  # noqa: E731
    x = torch.randn(5)
    with counting_dispatches(GradLevel) as calls:
        try:
            ours = tl.grad(f)(x)
        except RuntimeError as error:
            with pytest.raises(RuntimeError):
                ft.grad(f)(x)
            assert calls, error
            return
    assert_close(ours, ft.grad(f)(x))
    assert calls


def test_a_users_dual_tensor_keeps_its_tangent():
    """Forward AD the user runs inside grad: the shortcut declines, so the tangent of a
    dual made of a grad level's tensor is carried by the usual path."""
    with grad_level() as G:
        x = G(torch.tensor([0.5, 1.5]))
        with fwAD.dual_level():
            y = torch.sin(fwAD.make_dual(x, torch.ones(2)))
            tangent = fwAD.unpack_dual(y).tangent
        assert_close(G.unwrap(tangent), torch.tensor([0.5, 1.5]).cos())


def test_a_foreign_subclass_gets_the_call():
    class Logged(torch.Tensor):  # logs calls, returns plain results (as tv_tensors do)
        seen: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    c = torch.ones(5).as_subclass(Logged)
    f = lambda x: (torch.mul(x, c)).sum()  # noqa: E731
    x = torch.randn(5)
    ours = tl.grad(f)(x)
    assert torch.mul in Logged.seen
    assert_close(ours.as_subclass(torch.Tensor), ft.grad(f)(x).as_subclass(torch.Tensor))


def test_every_call_is_a_function_of_its_arguments():
    """The calls a grad level runs whole: no in-place method or property among them."""
    for call in CALLS:
        name = getattr(call, "__name__", "")
        assert not name.endswith("_") or name.startswith("__"), call
        assert not isinstance(call, property), call


def test_a_composite_call_on_a_grad_levels_inner_tensors_is_recorded():
    """vmap's rule for a composite op (F.linear) computes beneath the vmap level's
    tensors: where autograd records on those tensors themselves (a grad level's inner
    tensors, as its shortcuts use them), the op decomposes and each piece is recorded."""
    xs, w = torch.randn(4, 5), torch.randn(3, 5)
    with tl.vmap() as V, grad_level() as G:
        inner = G.unwrap(G(V(xs)))
        (g,) = torch.autograd.grad(F.linear(inner, w).square().sum(), inner)
        ours = V.unwrap(g)
    assert_close(ours, ft.vmap(ft.grad(lambda x: F.linear(x, w).square().sum()))(xs))
