"""Edge cases of vmap found by a third round of differential fuzzing against
torch.func.vmap (nn modules with stacked parameters, the Python tensor protocol,
randomness), each compared on the same inputs."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap as func_vmap

from torchlevels import vmap

assert_close = torch.testing.assert_close


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's slow-fallback warnings
        yield


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("batched_indices", [False, True])
def test_embedding_bag_of_stacked_weights_that_require_grad(mode, batched_indices):
    # stack_module_state's parameters require grad; F.embedding_bag then picked the
    # forward-only kernel for the batched weight, which refused the tracked one under it
    weight = torch.randn(3, 10, 4, requires_grad=True)
    indices = torch.randint(0, 10, (3, 2, 3) if batched_indices else (2, 3))
    in_dims = (0, 0 if batched_indices else None)

    def bag(w, i):
        return F.embedding_bag(i, w, mode=mode)

    out = vmap(bag, in_dims=in_dims)(weight, indices)
    expected = func_vmap(bag, in_dims=in_dims)(weight, indices)
    assert_close(out, expected)
    assert_close(torch.autograd.grad(out.pow(2).sum(), weight),
                 torch.autograd.grad(expected.pow(2).sum(), weight))
