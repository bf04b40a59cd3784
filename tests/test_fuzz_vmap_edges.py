"""Edge cases of vmap found by differential fuzzing against torch.func.vmap (dtypes, odd
shapes, nested levels with their own in_dims), each compared on the same inputs."""

import warnings

import pytest
import torch
from torch.func import vmap as func_vmap

from torchlevels import vmap

assert_close = torch.testing.assert_close


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's slow-fallback warnings
        yield


def test_nested_vmap_masked_fill_with_a_value_batched_at_both_levels():
    def f(value, x):
        return x.masked_fill(x != 0, value)

    values = torch.tensor([[1, 2]], dtype=torch.int32)
    x = torch.tensor([[3, 0, 4]])
    ours = vmap(vmap(f, in_dims=(0, None)), in_dims=(1, None))(values, x)
    assert_close(ours, func_vmap(func_vmap(f, in_dims=(0, None)), in_dims=(1, None))(values, x))


def test_nested_vmap_masked_fill_value_that_overflows_raises_as_torch_func():
    def f(value, x):
        return x.masked_fill(x != 0, value)

    values = torch.tensor([[1, 300]])
    x = torch.tensor([3, 0, 4], dtype=torch.int8)
    nested = vmap(vmap(f, in_dims=(0, None)), in_dims=(1, None))
    with pytest.raises(RuntimeError, match="overflow"):
        func_vmap(func_vmap(f, in_dims=(0, None)), in_dims=(1, None))(values, x)
    with pytest.raises(RuntimeError, match="overflow"):
        nested(values, x)
