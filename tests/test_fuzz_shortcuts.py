"""vmap's ``__torch_function__`` shortcuts against the dispatcher path and torch.func.vmap,
found by a round of differential fuzzing of the shortcuts (layouts, dtypes, nesting,
results then viewed or written in place), each compared on the same inputs."""

import pytest
import torch
import torch.nn.functional as F
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


@pytest.mark.parametrize("op", [
    lambda a: F.conv2d(a, torch.ones(4, 3, 3, 3)),
    lambda a: F.avg_pool2d(a, 2),
    lambda a: F.max_pool2d(a, 2),
    lambda a: F.adaptive_avg_pool2d(a, 2),
])
def test_convolution_and_pooling_of_a_channels_last_batch_then_viewed(op):
    # a batch of 3-d examples laid out channels-last: the shortcut pooled the 4-d batch,
    # whose output PyTorch lays out channels-last too, so each example was not contiguous
    # and .view raised where a loop views it (torch.func raises too: the loop is the
    # reference)
    x = torch.randn(3, 3, 6, 6).contiguous(memory_format=torch.channels_last)

    def f(a):
        return op(a).view(-1)

    assert_close(vmap(f)(x), torch.stack([f(a) for a in x]))


@pytest.mark.parametrize("op", [
    lambda a: a.contiguous(memory_format=torch.channels_last),
    lambda a: a.clone(memory_format=torch.channels_last),
    lambda a: a.to(memory_format=torch.channels_last),
])
def test_channels_last_of_an_example_of_the_wrong_rank_raises(op):
    # a 3-d example cannot be laid out channels-last; the batch of them, 4-d, can, and
    # vmap returned it unchanged where each example's call raises
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(RuntimeError) as expected:
        op(x[0])
    with pytest.raises(RuntimeError, match=str(expected.value)):
        vmap(op)(x)


@pytest.mark.parametrize("op", [torch.mm, torch.matmul])
def test_a_matrix_product_into_an_out_tensor_of_another_dtype_raises(op):
    # mm's out= kernel takes only its result's dtype; vmap ran mm, then copied the result
    # into the float64 out tensor, casting it, where each example's call raises
    x, w = torch.randn(2, 2, 3), torch.randn(3, 2)
    out = torch.empty(2, 2, 2, dtype=torch.float64)

    def f(a, o):
        return op(a, w, out=o)

    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype"):
        f(x[0], out[0])
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype"):
        vmap(f)(x, out)
    assert_close(vmap(f)(x, out.float()), torch.stack([f(a, o) for a, o in zip(x, out.float())]))


@pytest.mark.parametrize("op", [
    lambda a, o: torch.exp(a, out=o),
    lambda a, o: torch.mul(a, 2, out=o),
    lambda a, o: torch.sum(a, 0, keepdim=True, out=o[:1]),
])
def test_an_out_call_on_a_tensor_that_requires_grad_raises_as_autograd_does(op):
    # autograd refuses out= of a tensor it tracks; vmap ran the functional op and copied
    # its result into the out tensor, silently
    x, out = torch.randn(2, 3, requires_grad=True), torch.zeros(2, 3)
    with pytest.raises(RuntimeError) as expected:
        op(x[0], out[0].clone())
    with pytest.raises(RuntimeError, match=r"arguments don't support automatic differentiation"):
        vmap(op)(x, out.clone())
    assert "arguments don't support automatic differentiation" in str(expected.value)
    with torch.no_grad():
        ours, loop = out.clone(), out.clone()
        assert_close(vmap(op)(x, ours), torch.stack([op(a, o) for a, o in zip(x, loop)]))
        assert_close(ours, loop)


@pytest.mark.parametrize("op", [
    lambda a, o: torch.cat([a, a], out=o),
    lambda a, o: torch.stack([a, a], out=o.view(2, 3)),
])
@pytest.mark.parametrize("case", ["tracked", "int64 out"])
def test_cat_and_stack_into_an_out_tensor_check_it_as_each_example_does(op, case):
    # cat and stack take their tensors in a list, which the out= path took for a
    # factory's arguments, skipping its checks: the result was cast into an int64 out
    # tensor, and written into one while autograd tracked the inputs
    x, out = torch.randn(2, 3, requires_grad=case == "tracked"), torch.zeros(2, 6)
    if case == "int64 out":
        out = out.long()
    with pytest.raises((RuntimeError, TypeError)):  # (cat's cast error is a TypeError)
        op(x[0], out[0].clone())
    with pytest.raises((RuntimeError, TypeError), match="(cast|automatic differentiation)"):
        vmap(op)(x, out.clone())


@pytest.mark.parametrize("op", [
    lambda a: a.squeeze_(0), lambda a: a.unsqueeze_(0), lambda a: a.t_(),
    lambda a: a.transpose_(0, 1), lambda a: a[0].t_(), lambda a: a.squeeze_(1),
])
def test_an_in_place_view_op_on_a_leaf_that_requires_grad_raises(op):
    # squeeze_ and kin change only the wrapper's metadata, so autograd never checked the
    # leaf they were called on, where each example's call raises
    x = torch.randn(2, 1, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        op(x[0])
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        vmap(op)(x)
    with torch.no_grad():
        assert_close(vmap(op)(x.clone()), torch.stack([op(a) for a in x.clone()]))


@pytest.mark.parametrize("weight", [None, torch.ones(6)])
def test_rms_norm_of_a_channels_last_batch_then_viewed(weight):
    # as for convolution: rms_norm of the 4-d channels-last batch kept its layout, so each
    # 3-d example's output was not contiguous, and .view raised where a loop views it
    x = torch.randn(3, 4, 5, 6).contiguous(memory_format=torch.channels_last)

    def f(a):
        return F.rms_norm(a, (6,), weight).view(-1)

    assert_close(vmap(f)(x), torch.stack([f(a) for a in x]))
