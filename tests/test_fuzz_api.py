"""The vmap API surface found by a fourth round of differential fuzzing against
torch.func.vmap and a per-example loop (in_dims/out_dims pytrees, Python operators on
batched tensors, in-place writes, randomness, the imperative API), each compared on the
same inputs."""

import re

import pytest
import torch
from torch.func import vmap as func_vmap
from vmap_reference import loop_reference

from torchlevels import vmap

pytestmark = pytest.mark.filterwarnings("ignore")  # torch.func's slow-fallback warnings



@pytest.mark.parametrize("write", [
    lambda x, y: x.mul_(y),
    lambda x, y: x.__iand__(y),
    lambda x, y: x.copy_(y),
    lambda x, y: x.clamp_min_(y),
], ids=["mul_", "&=", "copy_", "clamp_min_"])
@pytest.mark.parametrize("in_dims", [(0, None), (0, 0)])
def test_an_in_place_op_whose_other_tensor_outranks_self_raises_as_each_example(write, in_dims):
    # self was padded to the other's rank, so each 0-dim example silently became a vector
    x, y = torch.tensor([1, 2, 3]), torch.tensor([[1], [1], [1]])
    other = y[0] if in_dims[1] is None else y

    def f(x, y):
        return write(x.clone(), y)

    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape") as expected:
        loop_reference(f, (x, other), in_dims)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        vmap(f, in_dims=in_dims)(x, other)


@pytest.mark.parametrize("write", [
    lambda x, y: x.__irshift__(y),
    lambda x, y: x.__ilshift__(y),
    lambda x, y: x.__ior__(y),
], ids=[">>=", "<<=", "|="])
def test_an_in_place_operator_whose_result_self_cannot_hold_raises_as_each_example(write):
    # x >>= y ran as its decomposition, >> then copy_, which cast the int result into the
    # bool self silently
    x, y = torch.tensor([[True, False]] * 3), torch.tensor([1, 2], dtype=torch.int32)

    def f(x, y):
        return write(x.clone(), y)

    with pytest.raises(RuntimeError, match="can't be cast to the desired output type") as expected:
        loop_reference(f, (x, y), (0, None))
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        vmap(f, in_dims=(0, None))(x, y)


@pytest.mark.parametrize("f", [
    lambda x, y: x << y,
    lambda x, y: y >> x,
    lambda x, y: torch.bitwise_left_shift(x, y),
], ids=["bool << int8", "int8 >> bool", "bitwise_left_shift"])
@pytest.mark.parametrize("in_dims", [(0, None), (0, 0)])
def test_shifts_of_bool_and_int_examples_of_0_dims_as_each_example(f, in_dims):
    # the meta kernel that learns one example's dtype refuses a bool shift the CPU kernel runs
    x = torch.tensor([True, False, True])
    y = torch.tensor([2, 1, 3], dtype=torch.int8)
    y = y if in_dims[1] == 0 else y[0]
    assert torch.equal(vmap(f, in_dims=in_dims)(x, y), loop_reference(f, (x, y), in_dims))


@pytest.mark.parametrize("f", [
    lambda x: x.clone().normal_(),
    lambda x: x.clone().bernoulli_(0.3),
    lambda x: torch.randn_like(x),
    lambda x: torch.randint_like(x, 4),
], ids=["normal_", "bernoulli_", "randn_like", "randint_like"])
def test_same_randomness_over_a_batch_of_no_examples(f):
    # one example's draw selected example 0, which a batch of none does not have;
    # torch.func itself fails on randn_like there, so its "different" mode is the reference
    x = torch.randn(0, 3)
    expected = func_vmap(f, randomness="different")(x)
    out = vmap(f, randomness="same")(x)
    assert (out.shape, out.dtype) == (expected.shape, expected.dtype)


@pytest.mark.parametrize("query", [
    lambda t: len(t.untyped_storage()),
    lambda t: t.untyped_storage().nbytes(),
    lambda t: t.storage().size(),
], ids=["len(untyped_storage)", "nbytes", "storage().size()"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_the_storage_of_a_transforms_tensor_raises_as_torch_func(query, transform):
    # PyTorch gave each wrapper a storage of its logical size, which no example has
    import torchlevels

    def f(x):
        return x.sum() * query(x)

    x = torch.randn(3, 4)
    with pytest.raises(NotImplementedError, match="Cannot access storage"):
        getattr(torch.func, transform)(f)(x)
    with pytest.raises(NotImplementedError, match="Cannot access storage"):
        getattr(torchlevels, transform)(f)(x)


@pytest.mark.parametrize("draw", [
    lambda: torch.randn(2, 3),
    lambda: torch.rand_like(torch.zeros(3)),
], ids=["randn", "rand_like"])
def test_a_draw_in_a_different_randomness_block_before_its_batch_size_raises_clearly(draw):
    # the level's batch size was None, and torch.randn got the size [None, 2, 3]
    with pytest.raises(RuntimeError, match="has no batch size yet"), \
            vmap(randomness="different"):
        draw()
    with vmap(randomness="different") as B:  # after B(t), the block draws per example
        x = B(torch.zeros(4, 3))
        assert B.unwrap(draw() + x[0]).shape[0] == 4


@pytest.mark.parametrize("write", [
    lambda x, y: x.remainder_(y),
    lambda x, y: x.__imod__(y),
    lambda x, y: x.lt_(y),
    lambda x, y: x.mul_(y).add_(y),
], ids=["remainder_", "%=", "lt_", "mul_ add_"])
@pytest.mark.parametrize("dtypes", [(torch.uint8, torch.int64), (torch.float16, torch.float64)],
                         ids=str)
def test_an_in_place_op_on_0_dim_examples_computes_in_their_promoted_dtype(write, dtypes):
    # the batched self has a dim, so the kernel computed in self's dtype, where each
    # example computes in the dtype its 0-dim tensors promote to: uint8 4 % int64 -3 was
    # 4 % 253 = 4, not 254
    x = torch.tensor([4, 2, 5]).to(dtypes[0])
    y = torch.tensor(-3.0001).to(dtypes[1])

    def f(x, y):
        return write(x.clone(), y)

    assert torch.equal(vmap(f, in_dims=(0, None))(x, y), loop_reference(f, (x, y), (0, None)))
    assert torch.equal(vmap(f)(x, y.expand(3)), loop_reference(f, (x, y.expand(3)), (0, 0)))


@pytest.mark.parametrize("dtypes", [(torch.bool, torch.int64), (torch.int64, torch.float16),
                                    (torch.float32, torch.complex64)], ids=str)
@pytest.mark.parametrize("in_dims", [(0, None), (0, 0)])
def test_an_in_place_op_on_0_dim_examples_refuses_a_cast_as_each_example(dtypes, in_dims):
    x, y = torch.ones(3, dtype=dtypes[0]), torch.ones(3, dtype=dtypes[1])
    y = y if in_dims[1] == 0 else y[0]

    def f(x, y):
        return x.clone().mul_(y)

    with pytest.raises(RuntimeError, match="can't be cast to the desired output type") as expected:
        loop_reference(f, (x, y), in_dims)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        vmap(f, in_dims=in_dims)(x, y)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_assigning_data_of_a_transforms_tensor_raises_as_torch_func(transform):
    # PyTorch's setter swapped the wrapper's placeholder: the level kept the old values,
    # so vmap returned them and grad's value was computed from them
    import torchlevels

    y = torch.randn(3)

    def f(a):
        a.data = y
        return (a * 2).sum()

    x = torch.randn(3, 3)
    with pytest.raises(RuntimeError, match=r"\.data"):
        getattr(torch.func, transform)(f)(x.clone())
    with pytest.raises(RuntimeError, match=r"t\.data = value"):
        getattr(torchlevels, transform)(f)(x.clone())


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacfwd"])
def test_assigning_a_transforms_tensor_as_a_plain_tensors_data_raises_as_torch_func(transform):
    # PyTorch's setter gave the plain tensor the wrapper's TensorImpl, which holds no
    # memory: its next op crashed the interpreter
    import torchlevels

    def f(a):
        buffer = torch.zeros(3)
        buffer.data = a * 2
        return (buffer * a).sum()

    x = torch.randn(3) if transform != "vmap" else torch.randn(2, 3)
    with pytest.raises(RuntimeError, match=r"\.data"):
        getattr(torch.func, transform)(f)(x)
    with pytest.raises(RuntimeError, match=r"`t\.data = value`: value is a tensor of"):
        getattr(torchlevels, transform)(f)(x)
    # outside the transforms, .data is PyTorch's own
    p, values = torch.nn.Parameter(torch.randn(3)), torch.randn(4)
    p.data = values
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.data is not values
    assert torch.equal(p.detach(), values)


@pytest.mark.parametrize("f", [
    lambda x, v: torch.heaviside(x, v),
    lambda x, v: x.clone().heaviside_(v),
], ids=["heaviside", "heaviside_"])
@pytest.mark.parametrize("in_dims", [(0, None), (0, 0)])
def test_heaviside_of_0_dim_examples_of_two_dtypes_raises_as_each_example(f, in_dims):
    # the batched 0-dim tensors were promoted to one dtype, so the kernel's check passed
    x = torch.tensor([1, -2, 0], dtype=torch.int8)
    v = torch.tensor([4, 5, 6], dtype=torch.int32)
    v = v if in_dims[1] == 0 else v[0]
    with pytest.raises(RuntimeError, match="different dtypes") as expected:
        loop_reference(f, (x, v), in_dims)
    with pytest.raises(RuntimeError, match=re.escape(str(expected.value))):
        vmap(f, in_dims=in_dims)(x, v)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32, torch.float64),
                                    (torch.bfloat16, torch.bfloat16, torch.float16)],
                         ids=str)
@pytest.mark.parametrize("in_dims", [(0, None, None), (0, 0, None), (None, None, 0)])
def test_lerp_of_0_dim_tensors_of_mixed_dtypes_as_each_example(dtypes, in_dims):
    # every tensor of an example has 0 dims, so all take part in its promotion; the
    # batched ones were cast to the promoted dtype and the unbatched ones left as they
    # were, and lerp, which wants one dtype, raised 'expected dtype double for `end`'
    # where a loop works (torch.func gives float32 here, not the loop's float64)
    start, end, weight = (torch.randn(3).to(t) if d is not None else torch.tensor(0.5).to(t)
                          for t, d in zip(dtypes, in_dims))
    expected = loop_reference(torch.lerp, (start, end, weight), in_dims)
    got = vmap(torch.lerp, in_dims=in_dims)(start, end, weight)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected)
