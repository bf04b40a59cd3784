"""torchlevels.dim reports bad input with clear errors that name the offending dim or sizes.

Dims get distinctive variable names here so that "the message names the dim" cannot be
satisfied by an accidental one-letter match.
"""

import re

import numpy as np
import pytest
import torch


@pytest.fixture
def dimlib():
    import torchlevels.dim

    return torchlevels.dim


def _has_number(message, n):
    return re.search(rf"(?<!\d){n}(?!\d)", message) is not None


def test_dimension_bind_error_is_a_value_error(dimlib):
    assert issubclass(dimlib.DimensionBindError, ValueError)


# --------------------------------------------------------------------------------------
# Too many indices
# --------------------------------------------------------------------------------------


def test_more_indices_than_positional_dims(dimlib):
    rows, cols, depth = dimlib.dims(3)
    A = torch.rand(3, 4)
    with pytest.raises(
        ValueError, match="at least 3 indices were supplied but the tensor only has 2 dimensions"
    ):
        A[rows, cols, depth]


def test_indexing_a_tensor_with_only_first_class_dims(dimlib):
    # README: positional indexing applies only to positional dims.
    batch, channel = dimlib.dims(2)
    input_fc = torch.rand(2, 3)[batch, channel]
    with pytest.raises(
        ValueError, match="at least 1 indices were supplied but the tensor only has 0 dimensions"
    ):
        input_fc[0]


# --------------------------------------------------------------------------------------
# Unbound dims
# --------------------------------------------------------------------------------------


def test_size_of_unbound_dim(dimlib):
    unsized_rows = dimlib.dims(1)
    with pytest.raises(dimlib.DimensionBindError) as info:
        _ = unsized_rows.size
    message = str(info.value)
    assert "unsized_rows" in message and "unbound" in message


def test_order_of_unbound_dim(dimlib):
    # Rule 3: a dim is a tensor over itself, so ordering it needs its size.
    unsized_cols = dimlib.dims(1)
    with pytest.raises(dimlib.DimensionBindError) as info:
        unsized_cols.order(unsized_cols)
    message = str(info.value)
    assert "unsized_cols" in message and "unbound" in message


def test_unbound_dim_is_not_bound(dimlib):
    unsized = dimlib.dims(1)
    assert not unsized.is_bound
    unsized.size = 2
    assert unsized.is_bound and unsized.size == 2


# --------------------------------------------------------------------------------------
# Size conflicts
# --------------------------------------------------------------------------------------


def test_setting_a_different_size(dimlib):
    width = dimlib.dims(1)
    width.size = 7
    width.size = 7  # same size again is fine
    with pytest.raises(
        dimlib.DimensionBindError,
        match="Dim 'width' previously bound to a dimension of size 7 cannot bind to a "
        "dimension of size 11",
    ):
        width.size = 11
    assert width.size == 7


def test_binding_to_tensors_of_different_sizes(dimlib):
    height = dimlib.dims(1)
    torch.rand(7)[height]
    assert height.size == 7
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(11)[height]
    message = str(info.value)
    assert "height" in message
    assert _has_number(message, 7) and _has_number(message, 11), message
    assert height.size == 7


def test_binding_mismatch_inside_one_indexing(dimlib):
    channel = dimlib.dims(1)
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(7, 11)[channel, channel]
    message = str(info.value)
    assert "channel" in message
    assert _has_number(message, 7) and _has_number(message, 11), message


# --------------------------------------------------------------------------------------
# Splitting a dim with a tuple of dims
# --------------------------------------------------------------------------------------


def test_dim_repeated_in_split_tuple(dimlib):
    repeated = dimlib.dims(1)
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(6)[(repeated, repeated),]
    assert "repeated" in str(info.value)


def test_two_unsized_dims_in_split_tuple(dimlib):
    outer_part, inner_part = dimlib.dims(2)
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(6)[(outer_part, inner_part),]
    message = str(info.value)
    assert "outer_part" in message and "inner_part" in message


def test_split_sizes_do_not_multiply_to_dim_size(dimlib):
    outer_part, inner_part = dimlib.dims(2)
    outer_part.size = 4
    inner_part.size = 3
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(10)[(outer_part, inner_part),]
    message = str(info.value)
    assert _has_number(message, 10), message
    assert _has_number(message, 12) or (_has_number(message, 4) and _has_number(message, 3)), (
        message
    )


def test_inferred_split_size_does_not_divide(dimlib):
    outer_part, inner_part = dimlib.dims(2)
    inner_part.size = 4
    with pytest.raises(dimlib.DimensionBindError) as info:
        torch.rand(10)[(outer_part, inner_part),]
    message = str(info.value)
    assert _has_number(message, 10) and _has_number(message, 4), message


# --------------------------------------------------------------------------------------
# order
# --------------------------------------------------------------------------------------


def test_order_with_a_dim_the_tensor_does_not_have(dimlib):
    present, absent = dimlib.dims(2)
    x = torch.rand(3, 4)[present]
    with pytest.raises(ValueError) as info:
        x.order(absent)
    assert "absent" in str(info.value)


def test_order_with_a_bound_dim_the_tensor_does_not_have(dimlib):
    present, elsewhere = dimlib.dims(2)
    torch.rand(5)[elsewhere]
    x = torch.rand(3)[present]
    with pytest.raises(ValueError) as info:
        x.order(present, elsewhere)
    assert "elsewhere" in str(info.value)


# --------------------------------------------------------------------------------------
# dims() and its debug names
# --------------------------------------------------------------------------------------


def test_dims_not_assigned_is_a_syntax_error(dimlib, capsys):
    with pytest.raises(SyntaxError):
        print(dimlib.dims())
    with pytest.raises(SyntaxError):
        len(dimlib.dims())
    assert capsys.readouterr().out == ""


def test_dims_with_a_count_need_not_be_assigned(dimlib):
    assert len(tuple(dimlib.dims(3))) == 3


def test_dims_take_names_from_assigned_variables(dimlib):
    alpha, beta = dimlib.dims(2)
    assert repr(alpha) == "alpha"
    assert repr(beta) == "beta"
    gamma = dimlib.dims(1)
    assert repr(gamma) == "gamma"
    delta, epsilon = dimlib.dims()
    assert (repr(delta), repr(epsilon)) == ("delta", "epsilon")
    zeta, eta = dimlib.dims(sizes=[2, None])
    assert (repr(zeta), repr(eta)) == ("zeta", "eta")
    assert zeta.size == 2 and not eta.is_bound


def test_dims_assigned_to_an_attribute_are_named_as_in_functorch_dim(dimlib):
    import functorch.dim

    def program(D):
        holder = type("Holder", (), {})()
        first, holder.second, third = D.dims(3)
        lists, holder.more = D.dimlists()
        return [repr(d) for d in (first, holder.second, third, lists, holder.more)]

    assert program(dimlib) == program(functorch.dim)


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_dims_of_a_bad_count_raise(dimlib, n):
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        dimlib.dims(n)


def test_no_dims_is_an_empty_tuple_as_in_functorch_dim(dimlib):
    import functorch.dim

    assert dimlib.dims(0) == functorch.dim.dims(0)
    assert dimlib.dims(sizes=[]) == functorch.dim.dims(sizes=[])


def test_sizes_of_any_int_type_are_taken_as_in_functorch_dim(dimlib):
    import functorch.dim

    def program(D):
        rows, cols = D.dims(sizes=[np.int64(3), None])
        depth = D.dims(1)
        depth.size = torch.tensor(2)
        return [int(d.size) for d in (rows, depth)], cols.is_bound

    assert program(dimlib) == program(functorch.dim)
    width = dimlib.dims(1)
    for size in (2.0, True, torch.tensor(2.0), -1):
        with pytest.raises(dimlib.DimensionBindError, match="size must be a non-negative int"):
            width.size = size


def test_unpacking_one_dim_says_dims_1_is_a_dim(dimlib):
    with pytest.raises(TypeError, match=r"dims\(1\) returns a single Dim"):
        (single,) = dimlib.dims(1)


# --------------------------------------------------------------------------------------
# Positional dim numbers on a tensor whose dims are all first-class
# --------------------------------------------------------------------------------------

# functorch.dim hangs on unbind(0), cumsum(1) and sum(7) of such a tensor: the reference
# for those is torch on a 0-dim tensor, which is what the tensor looks like positionally
_DIM_NUMBER_OPS = {
    "size(0)": (lambda x: x.size(0), True),
    "size(-1)": (lambda x: x.size(-1), True),
    "transpose(0, 1)": (lambda x: x.transpose(0, 1), True),
    "movedim(0, 1)": (lambda x: x.movedim(0, 1), True),
    "unbind(0)": (lambda x: x.unbind(0), False),
    "cumsum(1)": (lambda x: x.cumsum(1), False),
    "sum(7)": (lambda x: x.sum(7), False),
}


@pytest.mark.parametrize("op", list(_DIM_NUMBER_OPS))
def test_dim_numbers_of_a_tensor_with_no_positional_dims(dimlib, op):
    import functorch.dim

    call, functorch_answers = _DIM_NUMBER_OPS[op]
    A = torch.rand(3, 4)
    with pytest.raises(Exception) as reference:
        call(torch.tensor(1.0))
    if functorch_answers:
        rows, cols = functorch.dim.dims(2)
        with pytest.raises(Exception) as functorch_error:
            call(A[rows, cols])
        assert functorch_error.type is reference.type
    rows, cols = dimlib.dims(2)
    with pytest.raises(reference.type, match=r"0 positional dims.*first-class dims \(rows, cols\)"):
        call(A[rows, cols])


def test_dim_numbers_out_of_range_name_the_first_class_dims(dimlib):
    # functorch.dim returns a value for x.mean(dim=(rows, 5)), ignoring the 5: torch raises
    A = torch.rand(3, 4)
    with pytest.raises(Exception) as reference:
        A.mean(dim=(0, 5))
    rows = dimlib.dims(1)
    with pytest.raises(reference.type, match=r"1 positional dims.*first-class dims \(rows\)"):
        A[rows].mean(dim=(rows, 5))
    with pytest.raises(reference.type, match=r"1 positional dims.*first-class dims \(rows\)"):
        A[rows].sum((rows, -2))


# --------------------------------------------------------------------------------------
# Python values of a tensor with first-class dims
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("read", [
    lambda x: x.item(), lambda x: x.tolist(), lambda x: x.numpy(), float, int,
], ids=["item", "tolist", "numpy", "float", "int"])
def test_python_value_of_a_tensor_with_first_class_dims(dimlib, read):
    import functorch.dim

    A = torch.rand(3, 4, device="cpu")  # (numpy() of a CUDA tensor raises for that first)
    rows, cols = functorch.dim.dims(2)
    with pytest.raises(Exception) as reference:
        read(A[rows, cols])
    rows, cols = dimlib.dims(2)
    with pytest.raises(reference.type,
                       match=r"first-class dims \(rows, cols\).*\.order\(rows, cols\)"):
        read(A[rows, cols])


# --------------------------------------------------------------------------------------
# Errors of ops name the shapes the user sees
# --------------------------------------------------------------------------------------


def test_mm_of_mismatched_shapes_names_positional_shapes_and_dims(dimlib):
    import functorch.dim

    A, B = torch.rand(3, 4), torch.rand(5, 4)
    rows, cols = functorch.dim.dims(2)
    with pytest.raises(Exception) as reference:
        torch.mm(A[rows], B[cols])
    rows, cols = dimlib.dims(2)
    with pytest.raises(reference.type,
                       match=r"\(4,\) over rows \(size 3\) and \(4,\) over cols \(size 5\)"):
        torch.mm(A[rows], B[cols])


def test_broadcast_mismatch_names_positional_shapes_and_dims(dimlib):
    import functorch.dim

    A = torch.rand(3, 4)
    rows = functorch.dim.dims(1)
    with pytest.raises(Exception) as reference:
        A[rows] + torch.rand(5)
    rows = dimlib.dims(1)
    with pytest.raises(reference.type, match=r"\(4,\) over rows \(size 3\) and \(5,\)"):
        A[rows] + torch.rand(5)


# --------------------------------------------------------------------------------------
# DimList.size()
# --------------------------------------------------------------------------------------


def test_dimlist_size_is_its_length_once_bound(dimlib):
    import functorch.dim

    reference = functorch.dim.dimlists(1)
    with pytest.raises(functorch.dim.DimensionBindError):
        reference.size()
    reference.bind_len(2)
    batch = dimlib.dimlists(1)
    with pytest.raises(dimlib.DimensionBindError, match="batch.*unbound"):
        batch.size()
    torch.rand(2, 3)[batch]
    assert batch.size() == reference.size() == len(batch)


# --------------------------------------------------------------------------------------
# DimList(len_or_dims, name)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, kwargs, index", [
    ((), {}, (0, "dl")),
    ((), {"name": "rows"}, ("dl", 0)),
    ((2,), {}, ("dl", slice(None))),
    ((2,), {"name": "rows"}, (0, "dl")),
    (([3, 4],), {}, ("dl",)),
    (([3, 4],), {"name": "rows"}, ("dl", 0)),
], ids=["unbound", "unbound_named", "length", "length_named", "sizes", "sizes_named"])
def test_dimlist_constructor_is_functorch_dims(dimlib, args, kwargs, index):
    import functorch.dim

    def program(D):
        dl = D.DimList(*args, **kwargs)
        before = (dl.is_bound, repr(dl))
        x = torch.arange(60.).reshape(3, 4, 5)[tuple(dl if e == "dl" else e for e in index)]
        return before, repr(dl), [d.size for d in dl], x.ndim, x.order(*dl)

    ours, theirs = program(dimlib), program(functorch.dim)
    assert ours[:4] == theirs[:4]
    assert torch.equal(ours[4], theirs[4])


def test_dimlist_of_a_name_only_says_to_pass_the_name_by_keyword(dimlib):
    with pytest.raises(TypeError, match=r"DimList\(name='rows'\)"):
        dimlib.DimList("rows")
    with pytest.raises(TypeError, match="a Dim or a size"):
        dimlib.DimList([2.5])
