"""Ops on tensors with first-class dims that once went wrong: each case is checked against
plain PyTorch (a loop over the dims, or the same op on positional dims) or against
functorch.dim on the same inputs."""

import functorch.dim as fdim
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from vmap_reference import seeded

import torchlevels.dim as tdim
from torchlevels.dim import dimlists, dims


@pytest.fixture
def A():
    return torch.randn(3, 4, 5)


# -- max / min / where: pointwise only when elementwise -----------------------------------
@pytest.mark.parametrize("call, expected", [
    (lambda x: x.max(1), lambda A: A.max(2)),
    (lambda x: x.min(0), lambda A: A.min(1)),
    (lambda x: torch.max(x, dim=1), lambda A: A.max(2)),
    (lambda x: x.min(-1), lambda A: A.min(2)),
], ids=["max", "min", "max_keyword", "min_negative"])
def test_max_and_min_over_a_positional_dim_reduce_it(A, call, expected):
    i = dims(1)
    got, want = call(A[i]), expected(A)
    assert got.values.dims == (i,) and got.values.shape == want.values.shape[1:]
    assert_close(got.values.order(i), want.values)
    assert_close(got.indices.order(i), want.indices)


def test_max_and_min_without_arguments_reduce_the_positional_dims(A):
    i, j, k = dims(3)
    assert_close(A[i].max().order(i), A.amax((1, 2)))
    assert_close(A[i].min().order(i), A.amin((1, 2)))
    r = A[i, j, k].max()  # one value per element: nothing positional to reduce
    assert r.dims == (i, j, k)
    assert_close(r.order(i, j, k), A)


def test_max_and_min_with_a_tensor_stay_elementwise(A):
    B = torch.randn(4, 5)
    i = dims(1)
    assert_close(torch.max(A[i], B).order(i), torch.maximum(A, B))
    assert_close(A[i].min(other=B).order(i), torch.minimum(A, B))


def test_where_with_a_condition_only_follows_the_loop_or_says_shapes_differ():
    i = dims(1)
    same = torch.tensor([[True, False, True], [False, True, True]])
    got = torch.where(same[i])
    loop = [torch.where(row) for row in same]
    assert_close(got[0].order(i), torch.stack([r[0] for r in loop]))
    differ = torch.tensor([[True, False, False], [False, True, True]])
    with pytest.raises(RuntimeError, match="dynamic shape"):
        torch.where(differ[i])


def test_where_with_three_arguments_is_elementwise(A):
    i = dims(1)
    assert_close(torch.where(A[i] > 0, A[i], 0.0).order(i), A.clamp(min=0))


def test_masked_fill_takes_a_scalar_a_0d_tensor_or_a_tensor_with_dims(A):
    i = dims(1)
    mask, values = A > 0, torch.arange(3.0)
    for value, want in [(7.0, A.masked_fill(mask, 7.0)),
                        (torch.tensor(7.0), A.masked_fill(mask, 7.0)),
                        (values[i], torch.where(mask, values[:, None, None], A))]:
        assert torch.equal(A[i].masked_fill(mask[i], value).order(i), want)


# -- type promotion with plain 0-d tensors ---------------------------------------------
_DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64]


def _promoted_dtypes(D, a, b):
    """The result dtypes of ops mixing tensors with dims of dtype ``a`` and a plain 0-d
    tensor of dtype ``b`` (or the name of the error an op raises)."""
    i, j = D.dims(2)
    x = (torch.rand(3, 4) * 3).to(a)
    z = (torch.rand(()) * 3).to(b)
    calls = [lambda: x[i, j] + z, lambda: z * x[i, j], lambda: x[i] - z, lambda: i * z,
             lambda: torch.where(x[i, j] != 0, x[i, j], z)]
    out = []
    for call in calls:
        try:
            out.append(call().dtype)
        except Exception as e:  # noqa: BLE001  the same error in both is what is checked
            out.append(type(e).__name__)
    return out


@pytest.mark.parametrize("a", _DTYPES)
@pytest.mark.parametrize("b", _DTYPES)
def test_a_plain_0d_tensor_promotes_as_in_functorch_dim(a, b):
    assert _promoted_dtypes(tdim, a, b) == _promoted_dtypes(fdim, a, b)


def test_a_dims_only_tensor_and_a_0d_tensor_promote_as_under_vmap(A):
    i, j, k = dims(3)
    for x, z in [(A, torch.tensor(1.0, dtype=torch.float64)),
                 (A.to(torch.int32), torch.tensor(3)),
                 (A.to(torch.float16), torch.tensor(2.0))]:
        want = torch.vmap(torch.vmap(torch.vmap(lambda e, z=z: e + z)))(x)
        got = x[i, j, k] + z
        assert got.dtype == want.dtype
        assert_close(got.order(i, j, k), want)


# -- in-place methods that change the shape --------------------------------------------
@pytest.mark.parametrize("op", [
    lambda t: t.unsqueeze_(0), lambda t: t.t_(), lambda t: t.transpose_(0, 1),
    lambda t: t.squeeze_(1), lambda t: t.unsqueeze_(-1),
], ids=["unsqueeze_", "t_", "transpose_", "squeeze_", "unsqueeze_last"])
def test_in_place_shape_changes_change_the_tensor(op):
    A = torch.randn(3, 4, 1)
    i = dims(1)
    y = A.clone()[i]
    assert op(y) is y
    want = torch.stack([op(A[n].clone()) for n in range(3)])
    assert y.shape == want.shape[1:]
    assert_close(y.order(i), want)


def test_an_in_place_shape_change_leaves_the_indexed_tensor_alone(A):
    i = dims(1)
    y = A[i]
    y.unsqueeze_(0)
    assert A.shape == (3, 4, 5) and y.shape == (1, 4, 5)


def test_a_dim_cannot_be_changed_in_place():
    i = dims(1)
    i.size = 3
    with pytest.raises(TypeError, match="dim i cannot be modified in place"):
        i.add_(1)
    with pytest.raises(TypeError, match="dim i cannot be modified in place"):
        i.unsqueeze_(0)


@pytest.mark.parametrize("write", [
    lambda i, j: i.order(i).add_(10),
    lambda i, j: i.contiguous().add_(10),
    lambda i, j: i.expand(j).order(j, i).add_(10),
], ids=["order", "contiguous", "expand"])
def test_writing_to_a_tensor_made_from_a_dim_leaves_the_dim_alone(write):
    i, j = dims(2)
    i.size, j.size = 4, 1
    write(i, j)
    assert torch.equal((i * 1).order(i), torch.arange(4))
    assert torch.equal(i.order(i), torch.arange(4))


def test_augmented_assignment_to_a_dim_rebinds_the_name():
    i = dims(1)
    i.size = 3
    d = i
    i += 1  # as for an int: i is now the tensor d + 1
    assert i is not d and i.dims == (d,)
    assert torch.equal(i.order(d), torch.arange(3) + 1)
    i *= 2
    assert torch.equal(i.order(d), (torch.arange(3) + 1) * 2)


# -- first-class dims as dim arguments ----------------------------------------------------
@pytest.mark.parametrize("call, expected", [
    (lambda x, j: x.unbind(j), lambda A: A.unbind(1)),
    (lambda x, j: x.renorm(2, j, 1.0), lambda A: A.renorm(2, 1, 1.0)),
    (lambda x, j: x.flip(j), lambda A: A.flip(1)),
    (lambda x, j: torch.flip(x, [j]), lambda A: A.flip(1)),
    (lambda x, j: x.roll(1, j), lambda A: A.roll(1, 1)),
    (lambda x, j: x.select(j, 2), lambda A: A.select(1, 2)),
    (lambda x, j: torch.aminmax(x, dim=j), lambda A: torch.aminmax(A, dim=1)),
    (lambda x, j: torch.std_mean(x, j), lambda A: torch.std_mean(A, 1)),
    (lambda x, j: x.quantile(0.5, j), lambda A: A.quantile(0.5, 1)),
    (lambda x, j: F.softmin(x, j), lambda A: F.softmin(A, 1)),
], ids=["unbind", "renorm", "flip", "flip_list", "roll", "select", "aminmax", "std_mean",
        "quantile", "softmin"])
def test_ops_taking_a_dim_take_a_first_class_dim(A, call, expected):
    i, j, k = dims(3)
    got, want = call(A[i, j, k], j), expected(A)
    if isinstance(want, torch.Tensor):
        got, want = [got], [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        kept = (i, j, k) if w.shape == A.shape else (i, k)
        assert g.dims == kept
        assert_close(g.order(*kept), w)


def test_cumsum_in_place_along_a_first_class_dim(A):
    X = A.clone()
    i, j, k = dims(3)
    x = X[i, j, k]
    assert x.cumsum_(j) is x
    assert_close(X, A.cumsum(1))


@pytest.mark.parametrize("call, expected", [
    (lambda x, i, k: x.flip(i, k), lambda A: A.flip(0, 2)),
    (lambda x, i, k: x.flip(k, 0), lambda A: A.flip(2, 1)),
    (lambda x, i, k: x.flip(0, k), lambda A: A.flip(1, 2)),
], ids=["dims", "dim_then_positional", "positional_then_dim"])
def test_flip_takes_several_dims_as_separate_arguments_as_torch_does(A, call, expected):
    """functorch.dim raises for these: the reference is flip on positional dims."""
    i, k = dims(2)
    assert_close(call(A[i, :, k], i, k).order(i, k), expected(A).permute(0, 2, 1))


@pytest.mark.parametrize("call", [
    lambda x, q, k: torch.quantile(x, q, dim=k),
    lambda x, q, k: torch.quantile(x, q, k),
    lambda x, q, k: x.nanquantile(q=q, dim=k),
], ids=["function", "positional", "method_keywords"])
def test_a_reduction_whose_other_argument_has_dims_batches_over_them(call):
    """``q`` has a dim of its own, j (functorch.dim raises): the result has i and j, and
    is the loop over both."""
    A, Q = torch.randn(3, 5), torch.tensor([0.0, 0.3, 0.5, 1.0])
    i, j, k = dims(3)
    r = call(A[i, k], Q[j], k)
    assert set(r.dims) == {i, j} and r.ndim == 0
    loop = torch.stack([torch.stack([torch.quantile(a, q) for q in Q]) for a in A])
    assert_close(r.order(i, j), loop)
    x = A[i, k]  # and shared dims: q's i is x's, so each row takes its own q
    assert_close(torch.quantile(x, Q[:3][i], dim=k).order(i),
                 torch.stack([torch.quantile(a, q) for a, q in zip(A, Q[:3])]))


def test_an_op_keeping_a_dim_whose_other_argument_has_dims_is_a_clear_error():
    i, j, k = dims(3)
    with pytest.raises(ValueError, match="takes no other argument with first-class dims"):
        torch.randn(3, 5)[i, k].renorm(2, k, torch.ones(2)[j])


@pytest.mark.parametrize("name, call", [
    ("narrow", lambda x, j: x.narrow(j, 0, 2)), ("diff", lambda x, j: x.diff(dim=j)),
    ("topk", lambda x, j: x.topk(2, j)), ("chunk", lambda x, j: x.chunk(2, j)),
    ("index_select", lambda x, j: x.index_select(j, torch.tensor([0]))),
    ("transpose", lambda x, j: x.transpose(j, 0)),
])
def test_a_first_class_dim_where_an_op_does_not_support_one_is_a_clear_error(A, name, call):
    i, j, k = dims(3)
    with pytest.raises(TypeError, match=rf"{name}: a first-class dim \(j\) .* not supported"):
        call(A[i, j, k], j)


def test_a_dim_named_twice_is_an_error_for_products_and_tensors():
    i, j, k = dims(3)
    C, B = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(ValueError, match="appears multiple times"):
        (C[i, k] * B[k, j]).sum((k, k))
    with pytest.raises(ValueError, match="appears multiple times"):
        (C[i, k] + B[k, j]).sum((k, k))


def test_a_product_changed_in_place_is_summed_as_changed():
    i, j, k = dims(3)
    C, B = torch.randn(3, 4), torch.randn(4, 5)
    p = C[i, k] * B[k, j]
    p.mul_(2)
    assert_close(p.sum(k).order(i, j), 2 * C @ B)


@pytest.mark.parametrize("read", ["sum", "product"])
@pytest.mark.parametrize("changed", ["lhs", "rhs"])
def test_a_product_whose_operand_changed_in_place_since_is_refused(changed, read):
    """The product is delayed (to run its sum as a matmul), so it would read the operand
    as changed, where functorch.dim gives the product as it was written (ours without the
    change): refused, as autograd refuses a saved tensor changed in place."""
    C, B = torch.randn(3, 4), torch.randn(4, 5)

    def program(D, change):
        i, j, k = D.dims(3)
        C2, B2 = C.clone(), B.clone()
        p = C2[i, k] * B2[k, j]
        if change:
            (C2 if changed == "lhs" else B2).add_(100.0)
        return p.sum(k).order(i, j) if read == "sum" else p.order(i, k, j)

    assert_close(program(tdim, False), program(fdim, True))
    with pytest.raises(RuntimeError, match="modified in place after it was made"):
        program(tdim, True)


@pytest.mark.parametrize("read", ["sum", "mean", "lookup"])
def test_a_lookup_whose_table_changed_in_place_since_is_refused(read):
    """As for products: the lookup is delayed (to run as embedding_bag)."""
    W, ids = torch.randn(6, 3), torch.randint(0, 6, (2, 4))

    def program(D, change):
        b, s, f = D.dims(3)
        W2 = W.clone()
        e = W2[ids[b, s], f]
        if change:
            W2.zero_()
        return getattr(e, read)(s).order(b, f) if read != "lookup" else e.order(b, s, f)

    assert_close(program(tdim, False), program(fdim, True))
    with pytest.raises(RuntimeError, match="modified in place after it was made"):
        program(tdim, True)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64),
                                    (torch.float16, torch.float32)], ids=["f32_f64", "f16_f32"])
def test_a_contraction_sums_a_dim_of_one_operand_in_the_promoted_dtype(dtypes):
    """k is in A only, so it is summed before the matmul: in the product's dtype, as
    functorch.dim sums the product."""
    g = seeded(0)
    A = torch.randn(4, 4000, generator=g).to(dtypes[0])
    B = torch.randn(4, 2, generator=g, dtype=dtypes[1])

    def program(D):
        i, j, k = D.dims(3)
        return (A[i, k] * B[i, j]).sum((i, k)).order(j)

    ours, theirs = program(tdim), program(fdim)
    assert ours.dtype == theirs.dtype == dtypes[1]
    assert_close(ours, theirs)


# -- reducing over an empty dim list -------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda x, b: x.sum(b), lambda x, b: x.mean(b), lambda x, b: x.sum(b, keepdim=True),
    lambda x, b: x.amax(b), lambda x, b: x.sum((b,)),
], ids=["sum", "mean", "sum_keepdim", "amax", "sum_tuple"])
def test_reducing_over_an_empty_dim_list_reduces_nothing(A, call):
    b = dimlists()
    k, m = dims(2)
    x = A[k, m, :, b]
    assert len(b) == 0
    r = call(x, b)
    assert r.dims == (k, m) and r.shape == (5,)
    assert_close(r.order(k, m), A)


def test_summing_a_product_over_an_empty_dim_list_is_the_product():
    b = dimlists()
    i, k = dims(2)
    C, B = torch.randn(3, 4), torch.randn(4)
    x = torch.randn(3, 4)[i, k, b]
    assert len(b) == 0
    assert_close((C[i, k] * B[k]).sum(b).order(i, k), C * B)
    assert_close(x.sum(b).order(i, k), x.order(i, k))


# -- embedding lookups that embedding_bag does not take -------------------------------------
@pytest.mark.parametrize("case, reduce", [
    (case, reduce) for case in ("negative_ids", "integer_table", "empty_bag", "no_rows")
    for reduce in ("sum", "mean") if (case, reduce) != ("integer_table", "mean")
])  # the mean of an integer tensor is an error in torch too
def test_lookups_summed_over_their_ids_take_any_valid_input(case, reduce):
    W = torch.randn(10, 4)
    ids = torch.randint(0, 10, (3, 5))
    if case == "negative_ids":
        ids[0, 0], ids[2, 4] = -1, -10
    elif case == "integer_table":
        W = torch.arange(40).reshape(10, 4)
    elif case == "empty_bag":
        ids = ids[:, :0]
    else:
        ids = ids[:0]
    b, s, f = dims(3)
    got = getattr(W[ids[b, s], f], reduce)(s).order(b, f)
    assert_close(got, getattr(W[ids], reduce)(1), equal_nan=True)


@pytest.mark.cpu_only("out-of-range indices are device-side asserts on CUDA, fatal to the process")
def test_a_lookup_with_an_id_out_of_range_raises_as_torch_does():
    W, ids = torch.randn(10, 4), torch.randint(0, 10, (3, 5))
    ids[1, 1] = 10
    b, s, f = dims(3)
    with pytest.raises(IndexError, match="index 10 is out of bounds"):
        W[ids[b, s], f].sum(s)


# -- a list index at the top level -----------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")  # torch's own warning
def test_a_list_of_dims_as_the_whole_index_is_a_tuple_of_dims():
    x = torch.arange(24.).reshape(6, 4)
    for D in (fdim, tdim):
        i, j = D.dims(2)
        y = x[[i, j]]
        assert y.dims == (i, j) and y.ndim == 0 and (i.size, j.size) == (6, 4)
        assert torch.equal(y.order(i, j), x)
    i, j = dims(2)
    z = torch.zeros(6, 4)
    z[[i, j]] = x[i, j] + 1
    assert torch.equal(z, x + 1)
    k = dims(1)
    assert torch.equal(x[k][[0, 2]].order(k), x[:, [0, 2]])  # ints: still one index


# -- ops whose output size depends on the values, over two dims -----------------------------
def test_nonzero_and_masked_select_over_two_dims_follow_the_loop():
    """Every (i, j) has the same count: the result is the loop's, stacked."""
    A = torch.randn(2, 3, 4, generator=seeded(0)) + 10  # no zeros
    i, j = dims(2)
    loop = torch.stack([torch.stack([a.nonzero() for a in row]) for row in A])
    assert torch.equal(A[i, j].nonzero().order(i, j), loop)
    x = A[i, j]
    loop = torch.stack([torch.stack([a.masked_select(a > 100) for a in row]) for row in A])
    assert torch.equal(x.masked_select(x > 100).order(i, j), loop)
    loop = torch.stack([torch.stack([a.masked_select(a > 0) for a in row]) for row in A])
    assert torch.equal(x.masked_select(x > 0).order(i, j), loop)


# -- the Tensor class ----------------------------------------------------------------------
def test_the_tensor_class_has_torch_tensors_attributes_as_functorch_dims_has(A):
    public = [n for n in dir(torch.Tensor) if not n.startswith("_")]
    assert [n for n in public if not hasattr(tdim.Tensor, n)] == [
        n for n in public if not hasattr(fdim.Tensor, n)]
    ours = {n for n in public if getattr(tdim.Tensor, n).__doc__ ==
            getattr(torch.Tensor, n).__doc__}
    assert {n for n in public if getattr(fdim.Tensor, n).__doc__ ==
            getattr(torch.Tensor, n).__doc__} - ours <= {"size", "numel"}  # our own methods
    i, fi = tdim.dims(1), fdim.dims(1)
    assert torch.equal(tdim.Tensor.clamp(A[i], 0.5).order(i),
                       fdim.Tensor.clamp(A[fi], 0.5).order(fi))
