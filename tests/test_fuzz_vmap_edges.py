"""Edge cases of vmap found by differential fuzzing against torch.func.vmap (dtypes, odd
shapes, nested levels with their own in_dims), each compared on the same inputs."""

import re
import warnings

import pytest
import torch
from torch.func import vmap as func_vmap
from vmap_reference import loop_reference

from torchlevels import vmap

assert_close = torch.testing.assert_close


pytestmark = pytest.mark.filterwarnings("ignore")  # torch.func's slow-fallback warnings


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



@pytest.mark.parametrize("f", [
    lambda s, v: torch.copysign(v, s),
    lambda s, v: v / s,
    lambda s, v: torch.atan2(s, v),
    lambda s, v: torch.xlogy(v, s),
], ids=["copysign", "div", "atan2", "xlogy"])
def test_int_to_float_ops_with_batched_signed_scalars_and_an_unsigned_vector(f):
    # each example: an int8 0-dim tensor and a uint8 vector, computed in float32 (torch.func
    # casts the -3 to the vector's uint8 first: 253)
    scalars = torch.tensor([-3, 2, -5], dtype=torch.int8)
    vectors = torch.tensor([[1, 253, 3], [4, 0, 9]], dtype=torch.uint8)
    assert_close(vmap(f, in_dims=(0, 1))(scalars, vectors),
                 loop_reference(f, (scalars, vectors), (0, 1)), equal_nan=True)


def test_contiguous_of_a_batch_of_no_examples_is_contiguous():
    def f(x):
        y = x.mT.contiguous()
        assert y.is_contiguous()
        return torch.view_as_complex(y)  # needs a last dim of stride 1

    x = torch.randn(0, 2, 3)
    assert_close(vmap(f)(x), func_vmap(f)(x))


def test_nested_vmap_inner_batch_of_no_examples_keeps_the_outer_batch_for_writes():
    def f(x, y):
        z = x.clone()  # computed for no examples: still batched at the outer level
        z[..., :1] = y[..., :1]
        return z + x

    x, y = torch.randn(3, 0, 4), torch.randn(3, 0, 4)
    assert_close(vmap(vmap(f))(x, y), func_vmap(func_vmap(f))(x, y))


@pytest.mark.parametrize("f", [
    lambda x: x.masked_fill(x > 0, x),
    lambda x: x.clone().masked_fill_(x > 0, x),
], ids=["masked_fill", "masked_fill_"])
def test_masked_fill_with_a_batched_value_of_dims_raises_as_each_example(f):
    x = torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="0-dimensional value tensor") as expected:
        f(x[0])
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        vmap(f)(x)


@pytest.mark.cpu_only("CUDA's pow has a ComplexHalf kernel")
def test_an_op_with_no_kernel_for_its_dtype_raises_as_each_example():
    # float16 vectors ** a complex64 0-dim tensor is ComplexHalf, which pow has no kernel
    # for; expanding the 0-dim tensor and retrying computed in complex64 instead
    exponent = torch.tensor(2 + 1j)
    x = torch.rand(1, 2, 3, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="ComplexHalf"):
        x[:, 0] ** exponent
    with pytest.raises(NotImplementedError, match="ComplexHalf"):
        vmap(lambda v: v ** exponent, in_dims=1)(x)


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)])
def test_cross_of_examples_of_different_ranks_raises_as_each_example(in_dims):
    a, b = torch.randn(3, 2, 3), torch.randn(3, 3)
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        torch.linalg.cross(a[0], b[0])
    with pytest.raises(RuntimeError, match="same number of dimensions"):
        vmap(torch.linalg.cross, in_dims=in_dims)(a, b if in_dims[1] is not None else b[0])


OUT_OF_RANGE = {  # ops that fold the batch into one dim and offset each example's indices
    "index_add": lambda x, i: x.index_add(0, i, torch.ones(i.shape[0], 2)),
    "index_copy": lambda x, i: x.index_copy(0, i, torch.ones(i.shape[0], 2)),
    "index_fill": lambda x, i: x.index_fill(0, i, 1.0),
    "index_fill, a tensor value": lambda x, i: x.index_fill(0, i, torch.tensor(2.0)),
    "index_reduce": lambda x, i: x.index_reduce(0, i, torch.ones(i.shape[0], 2), "amax"),
    "embedding": lambda x, i: torch.nn.functional.embedding(i, x),
    "embedding_bag": lambda x, i: torch.nn.functional.embedding_bag(i, x, torch.tensor([0])),
}


@pytest.mark.parametrize("index", [[[1], [4], [0]], [[1], [-5], [2]], [[0], [-1], [0]]],
                         ids=["past the end", "before the start", "negative"])
@pytest.mark.parametrize("name", OUT_OF_RANGE)
@pytest.mark.cpu_only("out-of-range indices are device-side asserts on CUDA, fatal to the process")
def test_an_index_out_of_one_examples_range_does_not_reach_another_example(name, index):
    f = OUT_OF_RANGE[name]
    x, index = torch.randn(3, 4, 2), torch.tensor(index)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # index_reduce is in beta
        try:
            expected = loop_reference(f, (x, index), (0, 0))
        except (IndexError, RuntimeError):
            with pytest.raises((IndexError, RuntimeError)):
                vmap(f)(x, index)
        else:
            assert_close(vmap(f)(x, index), expected)


INVALID_FOR_EACH_EXAMPLE = {  # (f, example shapes): each example's call raises
    "bmm of different batch sizes": (torch.bmm, [(2, 2, 3), (1, 3, 2)]),
    "index_select with a 2-dim index": (
        lambda x, i: x.index_select(0, i.long().abs()), [(3,), (1, 1)]),
    "index_fill with a 1-dim value": (
        lambda x, v: x.index_fill(0, torch.tensor([0]), v), [(3,), (1,)]),
    "view of a 0-dim tensor as a smaller dtype": (
        lambda x, y: x.view(torch.uint8) + y.view(torch.uint8), [(), ()]),
}


@pytest.mark.parametrize("in_dims", [(0, 0), (None, 0), (0, None)])
@pytest.mark.parametrize("name", INVALID_FOR_EACH_EXAMPLE)
def test_arguments_each_example_refuses_raise(name, in_dims):
    if name == "index_select with a 2-dim index" and torch.get_default_device().type == "cuda":
        pytest.skip("out-of-range indices are device-side asserts on CUDA, fatal to the process")
    f, shapes = INVALID_FOR_EACH_EXAMPLE[name]
    args = [torch.randn(shape) if d is None else torch.randn(3, *shape)
            for shape, d in zip(shapes, in_dims)]
    with pytest.raises((IndexError, RuntimeError)) as expected:
        loop_reference(f, args, in_dims)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        vmap(f, in_dims=in_dims)(*args)


def test_view_of_0_dim_examples_as_a_dtype_of_the_same_size():
    x = torch.randn(3)
    f = lambda v: v.view(torch.int32)  # noqa: E731
    assert torch.equal(vmap(f)(x), loop_reference(f, (x,), (0,)))


@pytest.mark.parametrize("index", [[0], 0, [0, 0], [1], [-1], []], ids=str)
@pytest.mark.parametrize("in_dims", [(0, None), (0, 0), (None, 0)])
@pytest.mark.cpu_only("out-of-range indices are device-side asserts on CUDA, fatal to the process")
def test_index_select_of_0_dim_examples_checks_the_index_as_each_example(index, in_dims):
    def f(x, i):
        return x.index_select(0, i)

    x = torch.randn(3) if in_dims[0] == 0 else torch.randn(())
    index = torch.tensor(index, dtype=torch.long)
    index = index.expand(3, *index.shape).clone() if in_dims[1] == 0 else index
    try:
        expected = loop_reference(f, (x, index), in_dims)
    except (IndexError, RuntimeError):
        with pytest.raises((IndexError, RuntimeError)):
            vmap(f, in_dims=in_dims)(x, index)
    else:
        assert_close(vmap(f, in_dims=in_dims)(x, index), expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.bool])
@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (None, 0)])
def test_isin_as_each_example_and_its_dtype_check(dtype, in_dims):
    def f(elements, test):
        return torch.isin(elements, test, invert=True)

    args = [torch.randint(0, 3, (3, 4) if d is not None else (4,)).to(dtype) for d in in_dims]
    try:
        expected = loop_reference(f, args, in_dims)
    except RuntimeError as error:  # complex and bool: "Unsupported input type"
        with pytest.raises(RuntimeError, match="Unsupported input type"):
            vmap(f, in_dims=in_dims)(*args)
        assert "Unsupported input type" in str(error)
    else:
        assert torch.equal(vmap(f, in_dims=in_dims)(*args), expected)


@pytest.mark.cpu_only("CUDA's trace has a bool kernel")
def test_trace_of_bool_examples_raises_as_each_example():
    x = torch.ones(2, 3, 3, dtype=torch.bool)
    with pytest.raises(NotImplementedError, match="Bool") as expected:
        torch.trace(x[0])
    with pytest.raises(NotImplementedError, match=re.escape(str(expected.value))):
        vmap(torch.trace)(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
@pytest.mark.parametrize("loss", [torch.nn.functional.nll_loss,
                                  torch.nn.functional.multi_margin_loss])
def test_losses_of_input_that_is_not_floating_point_raise_as_each_example(loss, dtype):
    x, target = torch.ones(2, 4, 3).to(dtype), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(NotImplementedError):
        loss(x[0], target[0])
    with pytest.raises(NotImplementedError, match="not implemented for"):
        vmap(loss)(x, target)
