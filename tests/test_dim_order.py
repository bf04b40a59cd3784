"""The order of a result's first-class dims (``t.dims``, and so the layout ``t.order(*t.dims)``
gives) is functorch.dim's: each program runs on both libraries and the dims' names, the
values, ``ndim``, the positional shape and the dtype must agree."""

import functorch.dim as fdim
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from vmap_reference import seeded

import torchlevels.dim as tdim

g = seeded(0)
A = torch.randn(3, 4, 5, generator=g)
B = torch.randn(4, 5, generator=g)
M = torch.randn(3, 4, generator=g)
X = torch.randn(3, 4, 5, 6, generator=g)
P = torch.randn(3, 2, 4, generator=g)  # (i, b, k)
Q = torch.randn(4, 6, 2, generator=g)  # (k, j, b)
W = torch.randn(10, 6, generator=g)
IDS = torch.randint(0, 10, (3, 4), generator=g)
I4 = torch.randint(0, 4, (3, 2), generator=g)
I5 = torch.randint(0, 5, (2, 3), generator=g)
Y = torch.randn(5, 3, 6, generator=g)
BND = torch.tensor([-1.0, 0.0, 1.0])
S = torch.sort(torch.randn(2, 7, generator=g)).values


def _x(D):
    """X[i, j] with j made first: the input's order (i, j) is not the creation order."""
    j, i = D.dims(2)
    return X[i, j]


def _xy(D):
    """X[i, j, 0] and Y[k, i], with k, j, i made in this order."""
    k, j, i = D.dims(3)
    return X[i, j, 0], Y[k, i]


PROGRAMS = {
    # ops run under vmap: the batch dims come out where the batching rule leaves them
    "sum_no_dim": lambda D: _x(D).sum(),
    "transpose": lambda D: _x(D).T,
    "linear": lambda D: F.linear(_x(D), torch.ones(2, 6)),
    "cat_positional": lambda D: (lambda x: torch.cat([x, x], 0))(_x(D)),
    "clone_keeps": lambda D: _x(D).clone(),
    "topk": lambda D: _x(D).topk(2, 0),
    "sum_function": lambda D: torch.sum(_x(D), 0),
    # functorch.dim's Tensor methods given a dim keep the dims in order
    "sum_method": lambda D: _x(D).sum(0),
    "sort_method": lambda D: _x(D).sort(1),
    "softmax_method": lambda D: _x(D).softmax(-1),
    "torch_softmax": lambda D: torch.softmax(_x(D), -1),
    "module_softmax": lambda D: D.softmax(_x(D), -1),
    "chunk_method": lambda D: _x(D).chunk(2, 1),
    "unbind_method": lambda D: _x(D).unbind(0),
    "max_method": lambda D: _x(D).max(0),
    # pointwise here, vmapped by functorch.dim (creation order), and the reverse
    "torch_mul": lambda D: torch.mul(*_xy(D)),
    "mul_method_summed": lambda D: (lambda x, y: x.mul(y).sum(x.dims[0]))(*_xy(D)),
    "fmax": lambda D: torch.fmax(*_xy(D)),
    "masked_fill": lambda D: (lambda x, y: x.masked_fill(y > 0, 0.0))(*_xy(D)),
    "where_method": lambda D: (lambda x, y: x.where(y > 0, 0.0))(*_xy(D)),
    "max_other": lambda D: torch.max(*_xy(D)),
    "floor_divide": lambda D: (lambda x, y: x // y)(*_xy(D)),
    "isclose": lambda D: torch.isclose(*_xy(D)),
    # vmapped by both; functorch.dim's rules leave the input's batch dims in place
    "bucketize": lambda D: torch.bucketize(_x(D), BND),
    "searchsorted": lambda D: torch.searchsorted(BND, _x(D)),
    "index_fill": lambda D: _x(D).index_fill(1, torch.tensor([2, 0]), 0.0),
    "torch_index_fill": lambda D: torch.index_fill(_x(D), 0, torch.tensor([1]), 0.0),
}


def _searchsorted_in_sequences_with_dims(D):
    """k is the sequence's, made first; x's dims, made after it, keep x's order."""
    k, j, i = D.dims(3)
    return torch.searchsorted(S[k], X[i, j])


def _bucketize_dims_made_before_and_after(D):
    """x's dims made after k (m, i) keep x's order, after j and k."""
    j, k, m, i = D.dims(4)
    return torch.bucketize(X[i, m, j], S[k])


def _products(D):
    b, i, j, k = D.dims(4)
    return (P[i, b, k] * Q[k, j, b]).sum(k)


def _product_kept_shared(D):
    i, j, k = D.dims(3)
    return (A[i, j, k] * B[j, k]).sum(k)


def _inplace(D):
    j, i = D.dims(2)
    x = X.clone()[i, j]
    x.cumsum_(0)
    return x


def _stack(D):
    i, j, n = D.dims(3)
    return D.stack([M[i, j], B[j, 0] + M[i, j]], n)


def _stack_before_a_dim(D):
    i, j, n = D.dims(3)
    return D.stack([M[i, j], B[j, 0] + M[i, j]], n, j)


def _torch_stack(D):
    i, n = D.dims(2)
    return torch.stack([A[i], A[i]], n)


def _cat_dim(D):
    k, i, n = D.dims(3)
    return D.cat([A[k, i], A.permute(1, 0, 2)[i, k]], i, n)


def _cat_positional(D):
    i, n = D.dims(2)
    return D.cat([A[i], A[i]], 0, n)


def _lookup_feature_first(D):
    b, s, f = D.dims(3)
    return W.T[f, IDS[b, s]]


def _index_after_own_dim(D):
    i, j, k = D.dims(3)
    return A[k][I4[i, j]]


def _dim_expression(D):
    j, i = D.dims(2)
    i.size = 2
    return A[j, i + 1]


def _dim_twice(D):
    i, j = D.dims(2)
    return torch.arange(48.).reshape(4, 3, 4)[i, j, i]


def _own_dim_again(D):
    i, j = D.dims(2)
    return torch.arange(48.).reshape(4, 3, 4)[i][j, i]


def _two_index_tensors_apart(D):
    a, b, c = D.dims(3)
    return X[I4.T[a, b] % 3, :, I5[a, c]]


def _index_method(D):
    i, j, k, m = D.dims(4)
    return A[i, j, k].index(j, I4[m, 0])


def _index_function(D):
    i, j = D.dims(2)
    return D.index(A, (2, 0), (i, j))


def _index_pack(D):
    i, j, k, n = D.dims(4)
    return A[i, j, k].index([k, i], n)


def _index_method_of_a_plain_tensor(D):
    i, k = D.dims(2)
    return A.index((0, 2), (i, k))


def _split_a_plain_tensor(D):
    x, y, b, z = D.dims(4)
    b.size = 3
    return [*B[0].split([x, y], dim=0), *B[:, 1].split([b, z], dim=0)]


# a float64 tensor with dims only beside a float32 tensor: one example's promotion (float32)
# where functorch.dim runs the op under vmap, the aligned tensors' (float64) where it aligns
D64 = torch.rand(3, dtype=torch.float64, generator=g) + 0.5
F32 = torch.rand(4, generator=g) + 0.5


def _mixed(op):
    def program(D):
        i = D.dims(1)
        return op(D64[i], F32)
    return program


PROGRAMS.update({f"mixed_dtypes_{name}": _mixed(op) for name, op in {
    "torch_mul": torch.mul, "mul_method": lambda x, b: x.mul(b), "mul_operator": lambda x, b: x * b,
    "rmul_operator": lambda x, b: b * x, "mul_method_of_plain": lambda x, b: b.mul(x),
    "fmax": torch.fmax, "fmin": torch.fmin, "logaddexp": torch.logaddexp,
    "logaddexp2": torch.logaddexp2, "max": torch.max, "min": torch.min, "add": torch.add,
    "floor_divide": torch.floor_divide, "floordiv": lambda x, b: x // b,
    "rfloordiv": lambda x, b: b // x, "masked_fill": lambda x, b: x.masked_fill(b > 1, 2.0),
    "where": lambda x, b: x.where(b > 1, b),
}.items()})


PROGRAMS.update({f.__name__.lstrip("_"): f for f in (
    _searchsorted_in_sequences_with_dims, _bucketize_dims_made_before_and_after, _products,
    _product_kept_shared, _inplace, _stack, _stack_before_a_dim, _torch_stack, _cat_dim,
    _cat_positional, _lookup_feature_first, _index_after_own_dim, _dim_expression,
    _dim_twice, _own_dim_again, _two_index_tensors_apart, _index_method, _index_function,
    _index_pack, _index_method_of_a_plain_tensor, _split_a_plain_tensor,
)})


def _describe(r):
    if isinstance(r, (tuple, list)):
        return [_describe(x) for x in r]
    names = tuple(map(repr, r.dims))
    by_name = sorted(r.dims, key=repr)  # values in one layout, whatever the order
    return names, r.ndim, tuple(r.shape), r.dtype, r.order(*by_name)


def _compare(ours, theirs):
    if isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _compare(a, b)
        return
    assert ours[:4] == theirs[:4]
    assert_close(ours[4], theirs[4])


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_dims_come_in_functorch_dims_order(name):
    program = PROGRAMS[name]
    theirs = _describe(program(fdim))
    ours = _describe(program(tdim))
    _compare(ours, theirs)


def test_a_contraction_in_order_is_the_matmul_itself():
    """The matmul's output is already in the product's order: no permuted view."""
    i, j, k = tdim.dims(3)
    r = (M[i, k] * torch.randn(4, 6)[k, j]).sum(k)
    assert r.dims == (i, j) and r._tensor.is_contiguous()
    b = tdim.dims(1)
    r = (P[i, b, k] * Q[k, j, b]).sum(k)
    assert r.dims == (i, b, j)
    assert_close(r.order(b, i, j), torch.bmm(P.permute(1, 0, 2), Q.permute(2, 0, 1)))


def test_dims_lie_ahead_of_positional_dims_where_functorch_dim_interleaves_them():
    """The one layout that differs (README): functorch.dim keeps a dim bound after a
    positional dim there; here first-class dims come first. Named orders agree."""
    x, idx = torch.randn(3, 4), torch.tensor([2, 0, 1, 1])
    i, j = tdim.dims(2)
    assert x[:, i][j].dims == (i, j)
    assert_close(x[:, i].index(i, idx), x[:, idx].T)
    fi, fj = fdim.dims(2)
    assert x[:, fi][fj].dims == (fj, fi)
    assert_close(x[:, fi].index(fi, idx), x[:, idx])
    assert_close(x[:, i][j].order(i, j), x[:, fi][fj].order(fi, fj))
