"""Edge cases of vmap found by a third round of differential fuzzing against
torch.func.vmap (nn modules with stacked parameters, the Python tensor protocol,
randomness), each compared on the same inputs."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap as func_vmap

from torchlevels import vmap

assert_close = torch.testing.assert_close


pytestmark = pytest.mark.filterwarnings("ignore")  # torch.func's slow-fallback warnings


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


@pytest.mark.parametrize("x_shape", [(2, 8), (4, 2, 8)])
def test_a_view_of_linear_with_a_batched_weight_and_bias(x_shape):
    # linear's output was laid out with the batch among its columns, so each example was
    # not contiguous and .view raised where a loop (and torch.func) views it
    x = torch.randn(x_shape)
    weight, bias = torch.randn(3, 24, 8), torch.randn(3, 24)

    def f(w, b):
        return F.linear(x, w, b).view(-1, 6)

    assert_close(vmap(f)(weight, bias), func_vmap(f)(weight, bias))


def test_multihead_attention_of_stacked_modules_over_one_query_key_and_value():
    # an ensemble's in-projection is linear with a batched weight and bias, then a view
    modules = [torch.nn.MultiheadAttention(8, 2).eval() for _ in range(3)]
    params, buffers = torch.func.stack_module_state(modules)
    base = modules[0]
    query, key, value = torch.randn(3, 4, 2, 8).unbind()

    def f(p, b):
        return torch.func.functional_call(base, (p, b), (query, key, value))

    for out, expected in zip(vmap(f)(params, buffers), func_vmap(f)(params, buffers)):
        assert_close(out, expected)


_PRODUCTS = {
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [(4, 5), (3, 5, 6)], (None, 0)),
    "addr": (lambda a, b: torch.addr(torch.ones(4, 6), a, b), [(4,), (6, 3)], (None, 1)),
}


@pytest.mark.parametrize("name", list(_PRODUCTS))
def test_a_view_of_a_matrix_product_with_the_batch_on_one_side(name):
    # the batch's place in the product left each example non-contiguous, so .view raised
    # where a loop (and torch.func) views one example's fresh product
    fn, shapes, in_dims = _PRODUCTS[name]
    args = [torch.randn(s) for s in shapes]

    def f(a, b):
        return fn(a, b).view(-1)

    assert_close(vmap(f, in_dims=in_dims)(*args), func_vmap(f, in_dims=in_dims)(*args))


def test_a_view_of_index_select_with_a_batched_index():
    x, index = torch.randn(4, 5), torch.randint(0, 5, (3, 3))

    def f(i):
        return x.index_select(1, i).view(-1)

    assert_close(vmap(f)(index), func_vmap(f)(index))


@pytest.mark.parametrize("name", ["index_add", "index_copy"])
def test_a_view_of_an_index_update_with_a_batched_index(name):
    x, index, source = torch.randn(3, 4, 5), torch.randperm(5)[:2].repeat(3, 1), torch.randn(4, 2)

    def f(x, i):
        return getattr(x, name)(1, i, source).view(-1)

    assert_close(vmap(f)(x, index), func_vmap(f)(x, index))


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_data_ptr_of_a_transforms_tensor_raises_as_torch_func(transform):
    # PyTorch answered 0 for every wrapper, so x.data_ptr() == (x + 1).data_ptr() held
    import torchlevels

    def f(x):
        x.data_ptr()
        return x.sum()

    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="data pointer"):
        getattr(torch.func, transform)(f)(x)
    with pytest.raises(RuntimeError, match="data pointer"):
        getattr(torchlevels, transform)(f)(x)


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_view_of_embedding_bag_of_a_batched_weight(mode):
    weight, indices = torch.randn(3, 10, 4), torch.randint(0, 10, (2, 3))

    def f(w):
        return F.embedding_bag(indices, w, mode=mode).view(-1)

    assert_close(vmap(f)(weight), func_vmap(f)(weight))


@pytest.mark.parametrize("name", ["mul", "add", "exp", "div"])
def test_an_out_tensor_of_a_dtype_the_result_cannot_cast_to_raises_as_each_example(name):
    # the result was copied into the out= tensor, truncating floats to integers silently
    ops = {"mul": lambda x, out: torch.mul(x, 2, out=out),
           "add": lambda x, out: torch.add(x, x, out=out),
           "exp": lambda x, out: torch.exp(x, out=out),
           "div": lambda x, out: torch.div(x.long(), 2, out=out)}

    def f(x):
        out = torch.empty_like(x, dtype=torch.int64)
        ops[name](x, out)
        return out

    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        f(x[0])
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        vmap(f)(x)


_REFUSING_OUT_OPS = {
    "softmax": lambda x, out: torch.softmax(x, -1, out=out),
    "log_softmax": lambda x, out: torch.log_softmax(x, -1, out=out),
    "clamp": lambda x, out: torch.clamp(x, 0, 1, out=out),
    "amax": lambda x, out: torch.amax(x, -1, out=out),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("name", list(_REFUSING_OUT_OPS))
def test_an_out_tensor_of_another_float_dtype_raises_where_each_example_does(name, dtype):
    # these kernels refuse an out tensor of any dtype but the result's, which the copy
    # into the out tensor cast to silently
    def f(x):
        out = x.new_empty(x.shape[:-1] if name == "amax" else x.shape, dtype=dtype)
        _REFUSING_OUT_OPS[name](x, out)
        return out

    x = torch.randn(4, 3, 5)
    with pytest.raises(RuntimeError) as each:
        f(x[0])
    with pytest.raises(RuntimeError, match=re.escape(str(each.value))):
        vmap(f)(x)


_DTYPE_OUT_OPS = {
    "cumsum": lambda x, out: torch.cumsum(x, -1, out=out),
    "cumprod": lambda x, out: torch.cumprod(x, -1, out=out),
    "sum": lambda x, out: torch.sum(x, -1, out=out),
    "prod": lambda x, out: torch.prod(x, -1, out=out),
}


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float64),
                                    (torch.float32, torch.int64),
                                    (torch.int64, torch.float32)])
@pytest.mark.parametrize("name", list(_DTYPE_OUT_OPS))
def test_a_reduction_into_an_out_tensor_of_another_dtype_computes_in_its_dtype(name, dtypes):
    # ops that take a dtype compute in their out tensor's (as dtype=out.dtype); the
    # result in the input's dtype was cast instead: 2048 + 1 in float16 is 2048
    source, dtype = dtypes

    def f(x):
        out = x.new_empty(x.shape if name.startswith("cum") else x.shape[:-1], dtype=dtype)
        _DTYPE_OUT_OPS[name](x, out)
        return out

    x = (torch.rand(4, 3, 5) * 3 + 0.5).to(source)
    x[..., 0] = 2048
    got = vmap(f)(x)
    assert got.dtype == dtype
    assert torch.equal(got, torch.stack([f(e) for e in x]))


def test_an_out_tensor_of_a_wider_dtype_takes_the_result_as_each_example():
    def f(x):
        out = torch.empty_like(x, dtype=torch.float64)
        torch.add(x, x, out=out)
        return out

    x = torch.randn(4, 3)
    assert_close(vmap(f)(x), torch.stack([f(e) for e in x]))
