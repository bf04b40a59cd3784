"""Edge cases of the autodiff transforms found by a fourth round of differential fuzzing
against torch.func, on everyday training and scientific code (nn.Module workloads through
functional_call, per-sample gradients and ensembles, pytree primals with auxiliary
outputs, in-place ops on intermediates, higher-order compositions, chunk_size, and grad
modes around and inside the transforms): each test runs torchlevels and torch.func on the
same inputs and compares."""

import pytest
import torch
import torch.func as tf
from torch.utils._pytree import tree_leaves

import torchlevels as tl

pytestmark = pytest.mark.filterwarnings("ignore")


def _assert_same(got, expected):
    got, expected = tree_leaves(got), tree_leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# vjp's backward pass called inside the user's torch.inference_mode under vmap (as
# jacrev's rows are): the level recorded its graph with inference mode off, and the pass
# made inference tensors for the views of it a matmul's derivative takes, which raised
# "Cannot set version_counter for inference tensor".
_VJP_IN_INFERENCE_MODE = {
    "vmap of vjp": lambda T, x: T.vmap(
        lambda a: T.vjp(lambda b: b @ b.mT, a)[1](torch.ones(3, 3))[0])(x),
    "vmap of jacrev": lambda T, x: T.vmap(T.jacrev(lambda a: a.cos() * (a @ a.mT).sum()))(x),
    "jacrev with chunks, under vmap": lambda T, x: T.vmap(
        T.jacrev(lambda a: (a @ a.mT).tanh(), chunk_size=2))(x),
}


@pytest.mark.parametrize("case", _VJP_IN_INFERENCE_MODE)
def test_backward_pass_of_vjp_inside_inference_mode(case):
    x = torch.randn(2, 3, 3)
    with torch.inference_mode():
        expected = _VJP_IN_INFERENCE_MODE[case](tf, x)
        got = _VJP_IN_INFERENCE_MODE[case](tl, x)
    _assert_same(got, expected)
