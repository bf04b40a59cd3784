"""torch.cond inside transforms (torchlevels/cond.py), against torch.func's vmap, a loop
and torch.autograd (torch.func's grad of torch.cond fails on torch 2.13)."""

import pytest
import torch
import torch.func as tf

import torchlevels as tl

X = torch.tensor([[0.5, 1.0], [-0.5, -1.0], [2.0, -3.0]], dtype=torch.float64)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # torch.func's cond traces its branches with dynamo, whose state outlives a test: after
    # other tests' torch.cond calls it marks shapes dynamic, and torch.func's vmap of cond
    # fails on the SymInts that gives its branches ("Cond inputs must be a list of tensors")
    torch._dynamo.reset()


def branchy(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return torch.cond(p.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos() - t, (r,))


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0)])
def test_vmap_of_cond_with_a_batched_or_a_shared_predicate(in_dims):
    args = (X, X[0]) if in_dims[1] is None else (X[1], X) if in_dims[0] is None else (X, X)
    ours = tl.vmap(branchy, in_dims=in_dims)(*args)
    torch.testing.assert_close(ours, tf.vmap(branchy, in_dims=in_dims)(*args))
    loop = torch.stack([branchy(args[0] if in_dims[0] is None else args[0][i],
                                args[1] if in_dims[1] is None else args[1][i])
                        for i in range(3)])
    torch.testing.assert_close(ours, loop)


def _autograd(f, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_()
    return torch.autograd.grad(f(x), x)[0]


def test_gradients_of_cond_take_the_branch_each_example_takes():
    loss = lambda r: branchy(r, r).sum()  # noqa: E731
    torch.testing.assert_close(tl.grad(loss)(X[0]), _autograd(loss, X[0]))
    torch.testing.assert_close(tl.jacfwd(lambda r: branchy(r, r))(X[1]),
                               torch.autograd.functional.jacobian(lambda r: branchy(r, r), X[1]))
    shared = lambda r, p: branchy(r, p).sum()  # noqa: E731 (one predicate for all examples)
    torch.testing.assert_close(tl.vmap(tl.grad(shared), in_dims=(0, None))(X, X[2]),
                               torch.stack([_autograd(lambda r: shared(r, X[2]), r) for r in X]))


def _piecewise(x: torch.Tensor) -> torch.Tensor:
    # the branch not taken is undefined there: sqrt of a negative number
    return torch.cond(x > 0, lambda a: a.sqrt(), lambda a: -a, (x,))


def test_forward_mode_through_cond_with_a_predicate_per_example():
    xs = torch.tensor([4.0, -1.0], dtype=torch.float64)
    expected = torch.stack([torch.autograd.functional.jacobian(_piecewise, x) for x in xs])
    torch.testing.assert_close(tl.vmap(tl.jacfwd(_piecewise))(xs), expected)
    tangent = lambda x: tl.jvp(_piecewise, (x,), (torch.ones_like(x),))[1]  # noqa: E731
    torch.testing.assert_close(tl.vmap(tangent)(xs), expected)


@pytest.mark.parametrize("transform", ["vmap(grad)", "grad(vmap)", "vmap(jacrev)", "autograd"])
def test_reverse_mode_through_cond_with_a_predicate_per_example_raises(transform):
    # both branches run: the one an example did not take would give its gradient a nan
    xs = torch.tensor([4.0, -1.0], dtype=torch.float64)
    run = {
        "vmap(grad)": lambda: tl.vmap(tl.grad(_piecewise))(xs),
        "grad(vmap)": lambda: tl.grad(lambda x: tl.vmap(_piecewise)(x).sum())(xs),
        "vmap(jacrev)": lambda: tl.vmap(tl.jacrev(_piecewise))(xs),
        "autograd": lambda: tl.vmap(_piecewise)(xs.clone().requires_grad_()),
    }[transform]
    with pytest.raises(NotImplementedError, match="Use forward mode"):
        run()


def test_cond_in_a_with_block_level_and_plain_cond_outside():
    with tl.vmap() as B:
        out = B.unwrap(torch.cond(torch.tensor(True), torch.sin, torch.cos, (B(X),)))
    torch.testing.assert_close(out, X.sin())
    torch.testing.assert_close(branchy(X[0], X[0]), X[0].sin() * 2)  # PyTorch's own cond


def test_branches_of_different_shapes_under_a_batched_predicate_raise():
    f = lambda r: torch.cond(r.sum() > 0, lambda t: t.sum(), lambda t: t, (r,))  # noqa: E731
    with pytest.raises(RuntimeError, match="output 0 of the branches differs"):
        tl.vmap(f)(X)
    with pytest.raises(RuntimeError, match="single-element tensor"):
        tl.vmap(lambda r: torch.cond(r > 0, torch.sin, torch.cos, (r,)))(X)
