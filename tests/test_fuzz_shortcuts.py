"""vmap's ``__torch_function__`` shortcuts against the dispatcher path and torch.func.vmap,
found by a round of differential fuzzing of the shortcuts (layouts, dtypes, nesting,
results then viewed or written in place), each compared on the same inputs."""

import pytest
import torch
from torch.func import vmap as func_vmap

from torchlevels import vmap

assert_close = torch.testing.assert_close


pytestmark = pytest.mark.filterwarnings("ignore")  # torch.func's slow-fallback warnings


@pytest.mark.parametrize("equation", ["ii->i", "ij->ji"])
@pytest.mark.parametrize("write", ["result", "input"])
def test_einsum_of_one_operand_is_a_view_of_it(equation, write):
    # einsum of one operand gives a view of it (a diagonal, a permutation); the shortcut
    # made each example contiguous, a copy, so writes no longer went through
    def f(a):
        r = torch.einsum(equation, a)
        (r if write == "result" else a).mul_(2)
        return r, a

    x = torch.randn(2, 3, 3)
    ours, expected = x.clone(), x.clone()
    assert_close(vmap(f)(ours), func_vmap(f)(expected))
    assert_close(ours, expected)
