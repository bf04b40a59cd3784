"""Edge cases of the autodiff transforms found by a third round of differential fuzzing
against torch.func (linalg, reductions and losses, attention, pooling, vmap's dims around
the derivative transforms): each test runs torchlevels and torch.func on the same inputs
and compares."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from test_transforms_api import assert_tree_close
from torch.utils._pytree import tree_map

import torchlevels as tl

# F.scaled_dot_product_attention differentiated in its float attention mask: on CPU the
# flash kernel has no derivative for the mask (torchlevels raised that the mask "cannot
# have requires_grad True"); eager PyTorch and torch.func run the math kernel then.
_ATTENTION_IN_THE_MASK = {
    "grad": lambda T, f, m: T.grad(lambda m: f(m).pow(2).sum())(m),
    "jacrev": lambda T, f, m: T.jacrev(f)(m),
    "hessian": lambda T, f, m: T.hessian(lambda m: f(m).pow(2).sum())(m),
    "vmap of grad": lambda T, f, m: T.vmap(T.grad(lambda m: f(m).pow(2).sum()))(
        torch.stack([m, 2 * m])),
}


@pytest.mark.parametrize("case", _ATTENTION_IN_THE_MASK)
def test_attention_differentiated_in_its_mask(case):
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.randn(3, 5)

    def attention(m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def on_the_cpu(m):  # PyTorch's CUDA kernel saves nothing for a mask's gradient alone
        return F.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=m)

    if case == "hessian" and mask.is_cuda:
        pytest.skip("PyTorch has no double backward for CUDA's memory-efficient attention")
    run = _ATTENTION_IN_THE_MASK[case]
    expected = (run(tf, on_the_cpu, mask.cpu()) if mask.is_cuda
                else run(tf, attention, mask))
    assert_tree_close(run(tl, attention, mask), tree_map(lambda t: t.to(mask.device), expected))


@pytest.mark.parametrize("mask", [False, True])
def test_per_example_attention_gradients_in_the_query(mask):
    # on CUDA, memory-efficient attention's forward and backward batched in one call each
    # (the batch folded into N), its bias laid out as the kernel needs
    q, k, v = torch.randn(4, 2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    m = torch.randn(3, 5) if mask else None

    def loss(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m).sin().sum()

    assert_tree_close(tl.vmap(tl.grad(loss))(q), tf.vmap(tf.grad(loss))(q))
    assert_tree_close(tl.vmap(loss)(q), tf.vmap(loss)(q))


# torch.utils.checkpoint (use_reentrant=False) recomputes under saved-tensor hooks whose
# pack hook detaches what it saves: inside a grad level nested in another autodiff level
# that dropped the outer level's tracking, so jvp(grad(f)) and grad(grad(f)) came out as
# zeros. Such a grad level refuses the hooks, as torch.func's every grad does.
def _checkpointed(x):
    return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum()


_X = torch.tensor([0.5, 1.0, -2.0], dtype=torch.double)
_OVER_A_CHECKPOINTED_GRAD = {
    "jvp of grad": lambda T: T.jvp(T.grad(_checkpointed), (_X,), (torch.ones_like(_X),)),
    "jacfwd of grad": lambda T: T.jacfwd(T.grad(_checkpointed))(_X),
    "grad of grad": lambda T: T.grad(lambda x: T.grad(_checkpointed)(x).sum())(_X),
    "hessian": lambda T: T.hessian(_checkpointed)(_X),
    "jvp of vmap of grad": lambda T: T.jvp(T.vmap(T.grad(_checkpointed)), (_X[None],),
                                           (torch.ones_like(_X[None]),)),
}


@pytest.mark.parametrize("case", _OVER_A_CHECKPOINTED_GRAD)
def test_checkpoint_in_a_grad_nested_in_another_derivative_is_refused(case):
    run = _OVER_A_CHECKPOINTED_GRAD[case]
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        run(tf)
    with pytest.raises(RuntimeError, match="saved-tensor hooks .* checkpoint"):
        run(tl)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()  # put back after the error
    x = _X.clone().requires_grad_()  # and checkpointing in a single grad still works
    expected = torch.autograd.grad(_checkpointed(x), x)[0]
    torch.testing.assert_close(tl.grad(_checkpointed)(_X), expected)
    torch.testing.assert_close(tl.vmap(tl.grad(_checkpointed))(_X[None])[0], expected)


@pytest.mark.parametrize("api", ["vjp", "jacrev"])
def test_checkpoint_recomputed_after_its_transform_exited_says_so(api):
    # vjp_fn and jacrev's backward run after the function returned: the recomputation
    # meets the exited level's tensors, and the error names checkpoint, not a closure
    run = {"vjp": lambda: tl.vjp(_checkpointed, _X)[1](torch.tensor(1.0, dtype=_X.dtype)),
           "jacrev": lambda: tl.jacrev(_checkpointed)(_X)}[api]
    with pytest.raises(tl.EscapedTensorError, match="torch.utils.checkpoint recomputed"):
        run()


def test_checkpoint_in_vmap_of_grad_over_inputs_autograd_tracks_is_refused():
    # the examples' tensors that the grad level saves are a vmap level's: the pack hook's
    # detach reached the tensor autograd outside tracks, and the results came back with no
    # graph to it (torch.func refuses saved-tensor hooks in every grad)
    x = _X[:, None].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="under vmap over inputs that require grad"):
        tl.vmap(tl.grad(_checkpointed))(x)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    expected = torch.autograd.grad(_checkpointed(x), x)[0]
    torch.testing.assert_close(tl.vmap(tl.grad(_checkpointed))(x.detach()), expected)
    grads = tl.grad(_checkpointed)(x)  # a plain input: PyTorch restores its graph
    torch.testing.assert_close(torch.autograd.grad(grads.sum(), x)[0], -x.detach().sin())
