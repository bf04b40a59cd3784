"""Edge cases of the autodiff transforms found by differential fuzzing against torch.func:
each test runs torchlevels and torch.func on the same inputs and compares."""

import pytest
import torch
import torch.func as tf
from torch.utils._pytree import tree_leaves

import torchlevels as tl


def _cube(a):
    return a ** 3


# A transform called inside another on a tensor that no autograd outside tracks: its
# results carry no graph out of the outer transform, as torch.func's do not (a graph left
# on them failed .numpy() and grew a training loop's memory step by step).
_NESTED_ON_CONSTANTS = {
    "grad over a vjp_fn's cotangent": lambda F, x, y: F.grad(
        lambda c: F.vjp(_cube, x)[1](c)[0].sum())(y),
    "jacrev over a vjp_fn's cotangent": lambda F, x, y: F.jacrev(
        lambda c: F.vjp(_cube, x)[1](c)[0])(y),
    "jvp over a vjp_fn's cotangent": lambda F, x, y: F.jvp(
        lambda c: F.vjp(_cube, x)[1](c)[0], (y,), (y,)),
    "grad over a vjp_fn made outside": lambda F, x, y: (lambda fn: F.grad(
        lambda c: fn(c)[0].pow(2).sum())(y))(F.vjp(_cube, x)[1]),
    "grad capturing a grad of a constant": lambda F, x, y: F.grad(
        lambda c: (c * F.grad(lambda a: _cube(a).sum())(x)).sum())(y),
    "grad capturing a jacrev of a constant": lambda F, x, y: F.grad(
        lambda c: (F.jacrev(_cube)(x) @ c).sum())(y),
    "grad capturing a hessian of a constant": lambda F, x, y: F.grad(
        lambda c: (F.hessian(lambda a: _cube(a).sum())(x) @ c).sum())(y),
    "grad_and_value over a vjp_fn's cotangent": lambda F, x, y: F.grad_and_value(
        lambda c: F.vjp(_cube, x)[1](c)[0].sum())(y),
    "vmap of grad over a vjp_fn's cotangent": lambda F, x, y: F.vmap(F.grad(
        lambda c: F.vjp(_cube, x)[1](c)[0].sum()))(torch.stack([y, 2 * y])),
    "vjp_fn with create_graph=True": lambda F, x, y: F.vjp(_cube, x)[1](
        y, create_graph=True),
}


@pytest.mark.parametrize("case", _NESTED_ON_CONSTANTS)
def test_results_of_nested_transforms_over_constants_carry_no_graph(case):
    run = _NESTED_ON_CONSTANTS[case]
    x, y = torch.randn(3), torch.randn(3)
    expected, got = tree_leaves(run(tf, x, y)), tree_leaves(run(tl, x, y))
    assert [t.requires_grad for t in got] == [t.requires_grad for t in expected]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
        g.cpu().numpy()  # a tensor that requires grad refuses


def test_nested_transform_over_a_tracked_input_keeps_its_graph():
    # the graph stays where autograd outside differentiates through it
    x, y = torch.randn(3), torch.randn(3, requires_grad=True)
    grads = []
    for F in (tf, tl):
        out = F.grad(lambda c, F=F: (F.jacrev(_cube)(x) @ c).sin().sum())(y)
        assert out.requires_grad
        grads.append(torch.autograd.grad(out.sum(), y)[0])
    torch.testing.assert_close(grads[1], grads[0])


_UNDER_JVP_WITH_TRACKED_TANGENT = {
    "grad of the primal": lambda F, p: F.grad(lambda c: (c ** 3).sum())(p) * p,
    "vjp at the primal": lambda F, p: F.vjp(_cube, p)[1](p.cos())[0],
    "grad capturing the primal": lambda F, p: F.grad(
        lambda a: (a * p).sin().sum())(torch.ones(3, dtype=p.dtype)),
}


def _assert_tangent_keeps_its_graph(run, outer=torch.sum):
    """jvp of ``run`` with a tangent autograd tracks: the tangent out and the gradient of
    ``outer(tangent out)`` with respect to the tangent in, in both libraries."""
    primal = torch.randn(3, dtype=torch.double)
    tangent = torch.randn(3, dtype=torch.double)
    results = []
    for F in (tf, tl):
        t = tangent.clone().requires_grad_()
        out = F.jvp(lambda p, F=F: run(F, p), (primal,), (t,))[1]
        assert out.requires_grad
        results.append((out, torch.autograd.grad(outer(out), t)[0]))
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.parametrize("case", _UNDER_JVP_WITH_TRACKED_TANGENT)
def test_transform_inside_jvp_keeps_the_graph_of_a_tangent_autograd_tracks(case):
    _assert_tangent_keeps_its_graph(_UNDER_JVP_WITH_TRACKED_TANGENT[case])


_TENSOR_LISTS = {
    "cat": lambda F, b: torch.cat([b[:1], b]),
    "stack": lambda F, b: torch.stack([b, b.sin()]),
    "cat with a constant": lambda F, b: torch.cat([torch.ones(1, dtype=b.dtype), b]),
    "grad of prod (its backward cats)": lambda F, b: F.grad(lambda c: c.prod())(b),
}


@pytest.mark.parametrize("case", _TENSOR_LISTS)
def test_jvp_of_an_op_on_a_list_of_tensors_keeps_the_graph_of_a_tracked_tangent(case):
    # the tangents of the tensors in cat's list count for autograd outside, as an
    # argument's own tangent does (the tangent out carried no graph back to the tangent in)
    _assert_tangent_keeps_its_graph(_TENSOR_LISTS[case], lambda out: out.sin().sum())


_BATCHED_COTANGENTS = {
    "vmap of a vjp_fn": lambda F, cts, p: F.vmap(F.vjp(_cube, p)[1])(cts)[0],
    "vjp inside vmap": lambda F, cts, p: F.vmap(lambda c: F.vjp(_cube, p)[1](c)[0])(cts),
}


@pytest.mark.parametrize("case", _BATCHED_COTANGENTS)
def test_vjp_fn_under_vmap_keeps_the_graph_of_cotangents_autograd_tracks(case):
    # a batch of cotangents that require grad: the vjps carried no graph back to them
    run = _BATCHED_COTANGENTS[case]
    primal = torch.randn(3, dtype=torch.double)
    cotangents = torch.randn(2, 3, dtype=torch.double)
    results = []
    for F in (tf, tl):
        cts = cotangents.clone().requires_grad_()
        out = run(F, cts, primal)
        assert out.requires_grad
        results.append((out, torch.autograd.grad(out.sin().sum(), cts)[0]))
    torch.testing.assert_close(results[1], results[0])


_JVP_WITH_A_TANGENT_OF_A_GRAD_LEVEL = {
    "exp": torch.exp,  # its tangent reads its result, which gets a tangent only after
    "softmax": lambda a: torch.softmax(a, 0),
    "sin": torch.sin,
}


@pytest.mark.parametrize("case", _JVP_WITH_A_TANGENT_OF_A_GRAD_LEVEL)
def test_vjp_of_a_jvp_over_its_input_as_tangent_differentiates_inside_another_jvp(case):
    # the vjp level's graph saved exp's result, to which forward AD then gave a tangent
    # of the vjp level: its backward, run inside the jvp around, met that tangent after the
    # vjp level exited (EscapedTensorError)
    f = _JVP_WITH_A_TANGENT_OF_A_GRAD_LEVEL[case]
    x, primal, y = (torch.randn(3, dtype=torch.double) for _ in range(3))

    def run(F):
        def h(b):
            return F.jvp(f, (primal,), (b,))[1]
        return F.jvp(lambda c: F.vjp(h, x)[1](c)[0], (y,), (x,))

    torch.testing.assert_close(run(tl), run(tf))
