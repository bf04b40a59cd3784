"""Indexing with dims against the loop model: for every value of the result's dims,
``result`` at those values equals plain torch indexing with each dim replaced by its
value (an int) and each index tensor with dims replaced by its entry there.
"""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from torchlevels.dim import Dim, Tensor, dims


def _value_at(obj, env):
    """The plain value ``obj`` has in the loop body where each dim takes ``env[id(d)]``."""
    if isinstance(obj, Dim):
        return env[id(obj)]
    if isinstance(obj, Tensor):
        plain = obj.order(*obj.dims)
        return plain[tuple(env[id(d)] for d in obj.dims)]
    return obj


def check_against_loops(x, index):
    """Compare ``x[index]`` (x plain, index with dims) with the loop model."""
    result = x[index]
    result_dims = result.dims if isinstance(result, Tensor) else ()
    ordered = result.order(*result_dims) if result_dims else result
    for values in itertools.product(*(range(d.size) for d in result_dims)):
        env = {id(d): v for d, v in zip(result_dims, values)}
        plain_index = tuple(_value_at(i, env) for i in index)
        assert_close(ordered[values], x[plain_index], msg=lambda m: f"{index}: {m}")


@st.composite
def cases(draw):
    ndim = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    x = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).float()
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    pool = list(dims(4))
    n = draw(st.integers(1, 3))  # one length for all plain index tensors, so they broadcast
    index = []
    for size in shape:
        kind = draw(st.sampled_from(["dim", "dim", "slice", "int", "tensor", "dimtensor"]))
        if kind == "dim":
            # reuse a dim already bound to this size (a diagonal) or take a fresh one
            usable = [d for d in pool if not d.is_bound or d.size == size]
            if not usable:
                kind = "slice"
            else:
                d = draw(st.sampled_from(usable))
                d.size = size
                index.append(d)
                continue
        if kind == "slice":
            start = draw(st.integers(0, size - 1))
            index.append(slice(start, None, draw(st.integers(1, 2))))
        elif kind == "int":
            index.append(draw(st.integers(-size, size - 1)))
        elif kind == "tensor":
            index.append(torch.randint(0, size, (n,), generator=g))
        else:  # an index computed from a dim: (d * 3 + c) % size, with d bound or not
            free = [d for d in pool if not d.is_bound]
            d = free[0] if free else pool[0]
            if not d.is_bound:
                d.size = draw(st.integers(1, 3))
            index.append((d * 3 + draw(st.integers(0, 5))) % size)
        if draw(st.booleans()) and len(index) < 5:
            index.append(None)
    return x, tuple(index)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_indexing_matches_the_loop_model(case):
    x, index = case
    check_against_loops(x, index)


def test_diagonal_and_gather_of_a_dims_tensor():
    """Indexing a tensor that already has dims with an index over the same dim gathers
    along it per element (Rule 1), as the loop model says."""
    g = torch.Generator().manual_seed(0)
    values, lengths = torch.randn(4, 6, generator=g), torch.randint(0, 6, (4,), generator=g)
    i = dims(1)
    row = values[i]
    got = row[lengths[i]].order(i)
    assert_close(got, values[torch.arange(4), lengths])
