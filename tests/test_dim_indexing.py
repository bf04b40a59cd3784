"""Indexing with dims against the loop model: for every value of the result's dims,
``result`` at those values equals plain torch indexing with each dim replaced by its
value (an int) and each index tensor with dims replaced by its entry there.
"""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from vmap_reference import seeded

import torchlevels.dim
from torchlevels.dim import Dim, DimensionBindError, Tensor, dims


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
    g = seeded(seed)
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


def check_assignment_against_loops(x, index):
    """``y[index] = y[index] * 2 + 1`` (dims on both sides) against the loop model, which
    assigns element by element. Every written element gets the value read from it, so
    repeated index entries agree on what they write."""
    ours = x.clone()
    read = ours[index]
    result_dims = read.dims if isinstance(read, Tensor) else ()
    ours[index] = read * 2 + 1
    expected = x.clone()
    for values in itertools.product(*(range(d.size) for d in result_dims)):
        env = {id(d): v for d, v in zip(result_dims, values)}
        plain_index = tuple(_value_at(i, env) for i in index)
        expected[plain_index] = x[plain_index] * 2 + 1
    assert_close(ours, expected, msg=lambda m: f"{index}: {m}")


@settings(max_examples=200, deadline=None)
@given(cases())
def test_assignment_matches_the_loop_model(case):
    x, index = case
    check_assignment_against_loops(x, index)


@pytest.mark.parametrize("make_index", [
    lambda d, m1, m2: (d, m1),  # a mask over one dim
    lambda d, m1, m2: (m1, d),
    lambda d, m1, m2: (d, m2),  # a mask over two dims
    lambda d, m1, m2: (d, None, m1, slice(1, None)),
    lambda d, m1, m2: (m1, slice(None), d),  # mask and dim apart
])
def test_boolean_masks_beside_dims_read_and_write_as_torch(make_index):
    g = seeded(1)
    x = torch.randn(3, 4, 5, generator=g)
    d = dims(1)
    index = make_index(d, torch.rand(4, generator=g) > 0.5, torch.rand(4, 5, generator=g) > 0.5)
    if index[0] is not d:  # the mask indexes dim 0 of size 3
        index = make_index(d, torch.rand(3, generator=g) > 0.5, None)
    check_against_loops(x, index)
    check_assignment_against_loops(x, index)


def test_a_boolean_mask_of_the_wrong_shape_is_an_error():
    i = dims(1)
    with pytest.raises(IndexError, match=r"mask \(2,\) at index 1 does not match the shape"):
        torch.randn(3, 4)[i, torch.tensor([True, False])]


def test_assignment_through_tensor_indices_matches_functorch_dim():
    fdim = pytest.importorskip("functorch.dim")
    a, w, idx = torch.randn(3, 4, 5), torch.tensor([1, 3, 0]), torch.tensor([0, 2])
    results = []
    for lib in (fdim, torchlevels.dim):
        i, j = lib.dims(2)
        c, d = torch.zeros(3, 4, 5), torch.zeros(3, 4, 5)
        c[i, idx] = a[i, idx] + 1  # a plain index tensor
        d[i, w[i], j] = a[i, w[i], j] * 3  # an index computed from a dim
        results.append((c, d))
    assert_close(results[0], results[1])
    i, j = torchlevels.dim.dims(2)
    with pytest.raises(DimensionBindError, match="not among them"):
        torch.zeros(3, 4, 5)[i, idx] = a[i, idx, j]  # j is not in the left side


def test_a_split_binds_a_dim_a_later_split_needs_as_in_functorch_dim():
    """Splits bind sizes left to right: (a, b) makes b 1, so (b, c) can split the next dim."""
    fdim = pytest.importorskip("functorch.dim")
    x, v = torch.randn(2, 3, 3), torch.randn(3)
    results = []
    for lib in (fdim, torchlevels.dim):
        a, b, c = lib.dims(3)
        a.size = 2
        read = x[(a, b), (b, c)]
        written = torch.zeros(2, 3, 3)
        written[(a, b), (b, c)] = v[c]
        results.append((read.order(a, b, c), b.size, c.size, written))
    assert_close(results[0], results[1])


@pytest.mark.parametrize("shape, make_index", [
    # tensor indices separated only by a dim (an int in the loop model): adjacent
    ((2, 1, 1, 1), lambda d, t: (slice(None), t, d, t)),
    ((3, 2, 2, 2), lambda d, t: (t, slice(None), d, t)),  # separated by a slice: first
    ((2, 2, 3, 2), lambda d, t: (slice(None), t, 0, d)),
])
def test_tensor_indices_around_dims_and_ints_go_where_torch_puts_them(shape, make_index):
    x = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    d = dims(1)
    check_against_loops(x, make_index(d, torch.tensor([0, 1][:min(shape)])))


def test_diagonal_and_gather_of_a_dims_tensor():
    """Indexing a tensor that already has dims with an index over the same dim gathers
    along it per element (Rule 1), as the loop model says."""
    g = seeded(0)
    values, lengths = torch.randn(4, 6, generator=g), torch.randint(0, 6, (4,), generator=g)
    i = dims(1)
    row = values[i]
    got = row[lengths[i]].order(i)
    assert_close(got, values[torch.arange(4), lengths])


_OWN_DIM_INDEXES = {
    "getitem": lambda D, A: (lambda i: A[i][i])(D.dims(1)),
    "index_method": lambda D, A: (lambda i, j: A[i, j].index(j, i))(*D.dims(2)),
    "with_another_dim": lambda D, A: (lambda j, i: A[None].expand(2, 3, 4)[j, i][i])(*D.dims(2)),
    "beside_a_tensor_index": lambda D, A: (
        lambda i, j: A[None].expand(2, 3, 4)[i][torch.tensor([[1, 0], [0, 1]])[i, j], i])(
            *D.dims(2)),
}


@pytest.mark.parametrize("name", list(_OWN_DIM_INDEXES))
def test_a_dim_the_tensor_has_indexes_a_dim_of_another_size_by_its_values(name):
    """``A[i][i]`` for a 3x4 ``A``: i is the tensor of its values 0, 1, 2 (Rule 3), which
    index the dim of size 4, as in functorch.dim."""
    import functorch.dim as functorch_dim

    A = torch.arange(12.).reshape(3, 4)
    ours = _OWN_DIM_INDEXES[name](torchlevels.dim, A)
    theirs = _OWN_DIM_INDEXES[name](functorch_dim, A)
    assert tuple(map(repr, ours.dims)) == tuple(map(repr, theirs.dims))
    assert torch.equal(ours.order(*ours.dims), theirs.order(*theirs.dims))


def test_assigning_through_a_dim_the_tensor_has_writes_where_it_reads():
    import functorch.dim as functorch_dim

    def program(D):
        A = torch.arange(12.).reshape(3, 4)
        i = D.dims(1)
        x = A[i]
        x[i] = -1.0
        return A

    assert torch.equal(program(torchlevels.dim), program(functorch_dim))


@pytest.mark.parametrize("case", ["positional", "first-class", "bound", "uneven", "torch.split"])
def test_split_into_dims_matches_functorch_dim(case):
    import functorch.dim as functorch_dim

    import torchlevels.dim as torchlevels_dim

    x = torch.arange(2 * 14.).reshape(2, 14)

    def program(D):
        i, j, a, b, c = D.dims(5)
        if case == "positional":
            pieces = x[i].split([a, b], dim=0)
        elif case == "first-class":
            pieces = x[i, j].split([a, b], dim=j)
        elif case == "bound":
            a.size = 4
            pieces = x[i].split([a, b, c], dim=-1)
        elif case == "uneven":
            pieces = x[i].split([a, b, c], dim=0)
        else:
            pieces = torch.split(x[i], [a, b], 0)
        dims = (a, b, c)[:len(pieces)]
        return [p.order(i, d) for p, d in zip(pieces, dims)], [d.size for d in dims]

    ours, theirs = program(torchlevels_dim), program(functorch_dim)
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0], theirs[0]):
        assert torch.equal(a, b)


def test_split_errors():
    from torchlevels.dim import DimensionBindError, dims

    i, j, a, b = dims(4)
    x = torch.rand(2, 6)
    a.size, b.size = 2, 2
    with pytest.raises(DimensionBindError, match="add up to 4, not the split dim's size 6"):
        x[i].split([a, b], dim=0)
    with pytest.raises(TypeError, match="all ints or all dims"):
        x[i].split([a, 4], dim=0)
    with pytest.raises(TypeError, match="split sizes must be dims too"):
        x[i, j].split(3, dim=j)


@pytest.mark.parametrize("case", ["unbound_none", "bound_exceed"])
def test_split_sections_that_do_not_add_up_raise_what_functorch_dim_raises(case):
    """functorch.dim raises TypeError; ours is that and a DimensionBindError."""
    import functorch.dim as functorch_dim

    def program(D):
        a, b, c = D.dims(3)
        a.size, b.size = (3, 4) if case == "unbound_none" else (8, 6)
        if case == "unbound_none":
            c.size = 6
        D.split(torch.rand(2, 12), [a, b, c], dim=1)

    with pytest.raises(Exception) as theirs:
        program(functorch_dim)
    with pytest.raises(theirs.type, match="add up to (13|14)") as ours:
        program(torchlevels.dim)
    assert isinstance(ours.value, DimensionBindError)


def test_from_positional_matches_functorch_dim():
    fdim = pytest.importorskip("functorch.dim")
    from functorch.dim._dim_entry import DimEntry

    x = torch.randn(3, 4, 5)
    fi = fdim.dims(1)
    theirs = fdim.Tensor.from_positional(x, [DimEntry(-2), DimEntry(fi), DimEntry(-1)], True)
    i = dims(1)
    ours = Tensor.from_positional(x, [-2, i, -1], True)
    assert ours.dims == (i,) and i.size == 4
    assert_close(ours.order(i), theirs.order(fi))
    assert Tensor.from_positional(x, [-3, -2, -1], True) is x
    with pytest.raises(ValueError, match="count up to -1"):
        Tensor.from_positional(x, [i, -1, -2], True)
    with pytest.raises(ValueError, match="3 dims but 2 levels"):
        Tensor.from_positional(x, [i, -1], True)
    with pytest.raises(TypeError, match="a Dim or a negative int"):
        Tensor.from_positional(x, [i, "a", -1], True)


def test_module_index_matches_functorch_dim():
    """``index(x, positions, dims)``: bind positional dims of a plain tensor to dims."""
    fdim = pytest.importorskip("functorch.dim")
    a = torch.randn(3, 4, 5)
    fi, fj = fdim.dims(2)
    theirs = fdim.index(a, (0, 2), (fi, fj)).order(fi, fj)
    i, j = dims(2)
    assert_close(torchlevels.dim.index(a, (0, 2), (i, j)).order(i, j), theirs)
    k = dims(1)
    assert_close(torchlevels.dim.index(a[k], 1, j).order(k, j),
                 fdim.index(a[fi], 1, fj).order(fi, fj))
    assert issubclass(torchlevels.dim.DimensionMismatchError, Exception)


def test_a_dim_used_as_a_tensor_is_made_on_the_default_device():
    # as functorch.dim does: torch.set_default_device("cuda") puts a dim's range on the GPU
    i = dims(sizes=[3])
    with torch.device("meta"):
        assert (i + 0)._tensor.device.type == "meta"
    assert (i + 0)._tensor.device == torch.get_default_device()
