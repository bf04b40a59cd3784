"""Edge cases of the autodiff transforms found by a third round of differential fuzzing
against torch.func (linalg, reductions and losses, attention, pooling, vmap's dims around
the derivative transforms): each test runs torchlevels and torch.func on the same inputs
and compares."""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import torchlevels as tl


def _assert_same(got, expected):
    got, expected = tree_leaves(got), tree_leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


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

    run = _ATTENTION_IN_THE_MASK[case]
    _assert_same(run(tl, attention, mask), run(tf, attention, mask))
