"""Indexing batching rules, checked against torch.func.vmap and a per-example loop."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._pytree import tree_map
from vmap_reference import loop_reference, seeded, vmap_without_slow_loop

import torchlevels
from torchlevels.batching import registry

aten = torch.ops.aten
# torch.func's own slow-path warnings are noise here; ours are checked in run_ours
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
B = 3
DIMS = (None, 0, -1)  # unbatched, batched in front, batched last


def batched(make, d):
    """One example from ``make()``, or B of them stacked at ``d``."""
    if d is None:
        return make()
    return torch.stack([make() for _ in range(B)], d)


def combos(n):
    """Every assignment of DIMS to n tensors with at least one batched."""
    return [c for c in itertools.product(DIMS, repeat=n) if any(d is not None for d in c)]


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def run_ours(fn, args, in_dims):
    """torchlevels.vmap, failing if any op fell back to the slow loop."""
    return vmap_without_slow_loop(fn, *args, in_dims=in_dims)


def check(fn, args, in_dims, ref_fn=None, torch_func=True):
    """ours == torch.func.vmap == loop, outputs and (for in-place fns) mutated inputs.

    ``ref_fn``, an out-of-place equivalent of ``fn``, replaces ``fn`` under torch.func
    where torch.func gets the in-place op wrong (then only the loop checks mutation).
    ``torch_func=False`` skips torch.func where its answer is wrong (the loop disagrees).
    """
    in_dims = tuple(in_dims)
    ours_args, ref_args, loop_args = _clone(args), _clone(args), _clone(args)
    ours = run_ours(fn, ours_args, in_dims)
    loop = loop_reference(fn, loop_args, in_dims)
    assert_close(ours, loop)
    assert_close(ours_args, loop_args)
    if torch_func:
        ref = torch.func.vmap(ref_fn or fn, in_dims=in_dims)(*ref_args)
        assert_close(ours, ref)
        if ref_fn is None:
            assert_close(ours_args, ref_args)


def check_raises(fn, args, in_dims, match=None):
    """Both ours and torch.func refuse."""
    with pytest.raises(RuntimeError):
        torch.func.vmap(fn, in_dims=tuple(in_dims))(*_clone(args))
    with pytest.raises(RuntimeError, match=match):
        run_ours(fn, _clone(args), tuple(in_dims))


def randint(high, *shape):
    return lambda: torch.randint(0, high, shape)


def randn(*shape):
    return lambda: torch.randn(shape)


def perm(n, k):
    """k distinct indices below n (so writes with duplicates cannot race)."""
    return lambda: torch.randperm(n)[:k]


def fixed(t):
    return lambda: t.clone()


# -- index.Tensor ---------------------------------------------------------------------------

# (name, make indices, f(x, *index tensors)) over x of logical shape (4, 5, 6)
INDEX_CASES = [
    ("i", [randint(4, 2, 3)], lambda i: [i]),
    ("_i", [randint(5, 3)], lambda i: [None, i]),
    ("__i", [randint(6, 2, 2)], lambda i: [None, None, i]),
    ("ij", [randint(4, 3), randint(5, 2, 3)], lambda i, j: [i, j]),
    ("_ij", [randint(5, 3, 1), randint(6, 2)], lambda i, j: [None, i, j]),
    ("i_j", [randint(4, 3), randint(6, 1, 3)], lambda i, j: [i, None, j]),
    ("ijk", [randint(4, 2), randint(5, 2), randint(6, 2)], lambda i, j, k: [i, j, k]),
    ("scalar", [lambda: torch.tensor(2)], lambda i: [None, i]),
    ("scalar_i", [lambda: torch.tensor(1), randint(6, 4)], lambda i, j: [i, None, j]),
]
MASK3 = torch.tensor([True, False, True, False, False, True])  # three entries: pairs with (3,)


@pytest.mark.parametrize("name,makers,pattern", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index(name, makers, pattern):
    for dims in combos(1 + len(makers)):
        args = [batched(randn(4, 5, 6), dims[0])]
        args += [batched(m, d) for m, d in zip(makers, dims[1:])]
        check(lambda x, *idx: aten.index.Tensor(x, pattern(*idx)), args, dims)


@pytest.mark.parametrize("pattern", [
    lambda x, m, i: x[m],
    lambda x, m, i: x[:, m[0]],
    lambda x, m, i: x[i, :, MASK3],
    lambda x, m, i: x[:, i, MASK3],
    lambda x, m, i: x[..., MASK3],
])
def test_index_unbatched_mask(pattern):
    mask = torch.rand(4, 5) > 0.5
    for dx, di in combos(2):
        args = [batched(randn(4, 5, 6), dx), mask, batched(randint(4, 3), di)]
        check(pattern, args, (dx, None, di))


def test_index_python_sugar():
    x = torch.randn(B, 4, 5)
    i = torch.randint(0, 4, (B, 2))
    check(lambda x, i: x[i, 1:], [x, i], (0, 0))
    check(lambda x, i: x[[0, 2], i], [x, torch.randint(0, 5, (B, 2))], (0, 0))
    check(lambda x, i: x[None, :, i], [x, torch.randint(0, 5, (3,))], (0, None))


def test_index_batched_mask_raises():
    x, m = torch.randn(B, 4), torch.rand(B, 4) > 0.5
    check_raises(lambda x, m: x[m], [x, m], (0, 0), match="dynamic shape")
    check_raises(lambda x, m: x[m], [x[0], m], (None, 0), match="dynamic shape")


# -- index_put ------------------------------------------------------------------------------

PUT_CASES = [
    ("i", [perm(4, 3)], lambda i: [i]),
    ("_i", [perm(5, 2)], lambda i: [None, i]),
    ("ij", [perm(4, 3), perm(5, 3)], lambda i, j: [i, j]),
    ("_ij", [perm(5, 3), perm(6, 3)], lambda i, j: [None, i, j]),
    ("i_j", [perm(4, 2), perm(6, 2)], lambda i, j: [i, None, j]),
    ("i_2d", [lambda: torch.randperm(4).view(2, 2)], lambda i: [None, i]),
]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("values_rank", ["full", "last", "scalar"])
@pytest.mark.parametrize("name,makers,pattern", PUT_CASES, ids=[c[0] for c in PUT_CASES])
def test_index_put(name, makers, pattern, values_rank, accumulate):
    example = [m() for m in makers]
    indexed = aten.index.Tensor(torch.randn(4, 5, 6), pattern(*example)).shape
    vshape = {"full": indexed, "last": indexed[-1:], "scalar": ()}[values_rank]
    for op in (aten.index_put.default, aten.index_put_.default):
        for dims in combos(2 + len(makers)):
            if op is aten.index_put_.default and dims[0] is None:
                continue  # the error case, tested below
            args = [batched(randn(4, 5, 6), dims[0]), batched(randn(*vshape), dims[1])]
            args += [batched(m, d) for m, d in zip(makers, dims[2:])]

            def fn(x, v, *idx, op=op):
                return op(x, pattern(*idx), v, accumulate)

            def ref_fn(x, v, *idx):
                return aten.index_put.default(x, pattern(*idx), v, accumulate)

            # torch.func's index_put_ rule fails on leading-None or split index lists
            check(fn, args, dims, ref_fn=ref_fn)


def test_index_put_duplicates_accumulate():
    for dims in combos(3):
        args = [batched(randn(4, 5), dims[0]), batched(randint(4, 7), dims[1]),
                batched(randn(7, 5), dims[2])]
        check(lambda x, i, v: x.index_put([i], v, accumulate=True), args, dims)


def test_index_put_python_sugar():
    mask = torch.rand(4, 5) > 0.5

    def fill(x, v):
        x[mask] = v
        return x

    for dims in [(0, None), (0, 0), (-1, 0)]:
        check(fill, [batched(randn(4, 5), dims[0]), batched(randn(), dims[1])], dims)

    def assign(x, i, v):
        x[:, i] = v
        return x

    for dims in combos(3):
        if dims[0] is None:
            continue
        args = [batched(randn(4, 5), dims[0]), batched(perm(5, 2), dims[1]),
                batched(randn(4, 2), dims[2])]
        check(assign, args, dims, ref_fn=lambda x, i, v: aten.index_put(x, [None, i], v))


@pytest.mark.parametrize("op", [aten.index_put_.default, aten._index_put_impl_.default])
def test_index_put_inplace_unbatched_self_raises(op):
    x, i, v = torch.randn(4), torch.tensor([0, 1]), torch.randn(B, 2)
    check_raises(lambda x, v: op(x, [i], v), [x, v], (None, 0), match="vmapped over")
    check_raises(lambda x, i: op(x, [i], v[0]), [x, torch.randint(0, 4, (B, 2))], (None, 0))


# -- gather / scatter -----------------------------------------------------------------------

GATHER_CASES = [  # (self shape, dim, index shape)
    ((4, 5), 0, (3, 5)),
    ((4, 5), 1, (4, 2)),
    ((4, 5), -1, (2, 3)),
    ((4,), 0, ()),
    ((), 0, ()),
    ((), 0, (2,)),
]


@pytest.mark.parametrize("shape,dim,ishape", GATHER_CASES)
def test_gather(shape, dim, ishape):
    high = shape[dim] if shape else 1
    for dims in combos(2):
        args = [batched(randn(*shape), dims[0]), batched(randint(high, *ishape), dims[1])]
        check(lambda x, i: torch.gather(x, dim, i), args, dims)


def _unique_index(dim):
    """Indices along ``dim`` of a (4, 5) tensor, distinct within each line: shape (3, 5)
    for dim 0, (4, 3) for dim 1 (so plain scatter has no write races)."""
    if dim == 0:
        return lambda: torch.rand(4, 5).argsort(0)[:3]
    return lambda: torch.rand(4, 5).argsort(1)[:, :3]


SCATTER_FNS = {
    "src": lambda x, i, s, d: x.scatter(d, i, s),
    "value": lambda x, i, s, d: x.scatter(d, i, 2.5),
    "src_add": lambda x, i, s, d: x.scatter(d, i, s, reduce="add"),
    "src_multiply": lambda x, i, s, d: x.scatter(d, i, s, reduce="multiply"),
    "value_add": lambda x, i, s, d: x.scatter(d, i, 2.0, reduce="add"),
    "add": lambda x, i, s, d: x.scatter_add(d, i, s),
    **{
        f"reduce_{r}_{incl}": (
            lambda x, i, s, d, r=r, incl=incl: x.scatter_reduce(d, i, s, r, include_self=incl)
        )
        for r in ("sum", "prod", "mean", "amax", "amin") for incl in (True, False)
    },
}
SCATTER_INPLACE_FNS = {
    "src_": lambda x, i, s, d: x.scatter_(d, i, s),
    "value_": lambda x, i, s, d: x.scatter_(d, i, 2.5),
    "reduce_": lambda x, i, s, d: x.scatter_(d, i, s, reduce="add"),
    "value_reduce_": lambda x, i, s, d: x.scatter_(d, i, 3.0, reduce="multiply"),
    "add_": lambda x, i, s, d: x.scatter_add_(d, i, s),
    "reduce_mean_": lambda x, i, s, d: x.scatter_reduce_(d, i, s, "mean", include_self=False),
}


@pytest.mark.parametrize("dim", [0, 1, -2])
@pytest.mark.parametrize("name", list(SCATTER_FNS) + list(SCATTER_INPLACE_FNS))
def test_scatter(name, dim):
    fn = SCATTER_FNS.get(name) or SCATTER_INPLACE_FNS[name]
    sshape = (3, 5) if dim % 2 == 0 else (4, 3)
    for dims in combos(3):
        if name in SCATTER_INPLACE_FNS and dims[0] is None:
            continue
        args = [batched(randn(4, 5), dims[0]), batched(_unique_index(dim % 2), dims[1]),
                batched(randn(*sshape), dims[2])]
        check(lambda x, i, s: fn(x, i, s, dim), args, dims)


def test_scatter_add_duplicates_and_scalars():
    for dims in combos(3):
        args = [batched(randn(4, 5), dims[0]), batched(randint(4, 6, 5), dims[1]),
                batched(randn(6, 5), dims[2])]
        check(lambda x, i, s: x.scatter_add(0, i, s), args, dims)
        args = [batched(randn(), dims[0]), batched(randint(1), dims[1]),
                batched(randn(), dims[2])]
        check(lambda x, i, s: x.scatter_add(0, i, s), args, dims)


@pytest.mark.parametrize("name", list(SCATTER_INPLACE_FNS))
def test_scatter_inplace_unbatched_self_raises(name):
    fn = SCATTER_INPLACE_FNS[name]
    x, i, s = torch.randn(4, 5), torch.zeros(B, 1, 5, dtype=torch.long), torch.randn(B, 1, 5)
    check_raises(lambda x, i, s: fn(x, i, s, 0), [x, i, s], (None, 0, 0), match="vmapped over")


# -- index_select and the index_* updates ---------------------------------------------------


@pytest.mark.parametrize("shape,dim,index", [
    ((4, 5), 0, randint(4, 3)),
    ((4, 5), 1, randint(5, 2)),
    ((4, 5, 2), -2, randint(5, 6)),
    ((4, 5), 0, lambda: torch.tensor(2)),
    ((4,), 0, randint(4, 5)),
    ((), 0, lambda: torch.tensor([0])),
    ((), 0, lambda: torch.tensor(0)),
])
def test_index_select(shape, dim, index):
    for dims in combos(2):
        args = [batched(randn(*shape), dims[0]), batched(index, dims[1])]
        # torch.func returns the whole dim for a 0-dim index (the loop keeps one row)
        scalar_index = index().dim() == 0 and len(shape) > 0
        check(lambda x, i: torch.index_select(x, dim, i), args, dims,
              torch_func=not scalar_index)


UPDATE_FNS = {
    "add": lambda x, d, i, s: x.index_add(d, i, s),
    "add_alpha": lambda x, d, i, s: x.index_add(d, i, s, alpha=-2.0),
    "copy": lambda x, d, i, s: x.index_copy(d, i, s),
    "fill": lambda x, d, i, s: x.index_fill(d, i, 7.0),
    "fill_tensor": lambda x, d, i, s: x.index_fill(d, i, s.sum()),
    **{
        f"reduce_{r}_{incl}": (
            lambda x, d, i, s, r=r, incl=incl: x.index_reduce(d, i, s, r, include_self=incl)
        )
        for r in ("prod", "mean", "amax", "amin") for incl in (True, False)
    },
}
UPDATE_INPLACE_FNS = {
    "add_": lambda x, d, i, s: x.index_add_(d, i, s),
    "copy_": lambda x, d, i, s: x.index_copy_(d, i, s),
    "fill_": lambda x, d, i, s: x.index_fill_(d, i, -1.0),
    "fill_tensor_": lambda x, d, i, s: x.index_fill_(d, i, s.sum()),
    "reduce_": lambda x, d, i, s: x.index_reduce_(d, i, s, "amax"),
}


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", list(UPDATE_FNS) + list(UPDATE_INPLACE_FNS))
def test_index_update(name, dim):
    fn = UPDATE_FNS.get(name) or UPDATE_INPLACE_FNS[name]
    sshape = (3, 5) if dim == 0 else (4, 3)
    length = 4 if dim == 0 else 5
    for dims in combos(3):
        if name in UPDATE_INPLACE_FNS and dims[0] is None:
            continue
        args = [batched(randn(4, 5), dims[0]), batched(perm(length, 3), dims[1]),
                batched(randn(*sshape), dims[2])]
        # torch.func fills an unbatched self with a batched value wrongly (the loop disagrees)
        wrong = name == "fill_tensor" and dims[0] is None and dims[2] is not None
        check(lambda x, i, s: fn(x, dim, i, s), args, dims, torch_func=not wrong)


def test_index_update_scalars_and_duplicates():
    for dims in combos(3):
        # 0-dim self: one entry
        args = [batched(randn(), dims[0]), batched(lambda: torch.tensor([0]), dims[1]),
                batched(randn(), dims[2])]
        check(lambda x, i, s: x.index_add(0, i, s), args, dims)
        # 0-dim index: one entry, duplicates across examples and within with accumulation
        args = [batched(randn(4, 5), dims[0]), batched(lambda: torch.tensor(1), dims[1]),
                batched(randn(1, 5), dims[2])]
        check(lambda x, i, s: x.index_add(0, i, s), args, dims)
        args = [batched(randn(4, 5), dims[0]), batched(randint(4, 7), dims[1]),
                batched(randn(7, 5), dims[2])]
        check(lambda x, i, s: x.index_add(0, i, s), args, dims)


@pytest.mark.parametrize("name", list(UPDATE_INPLACE_FNS))
def test_index_update_inplace_unbatched_self_raises(name):
    fn = UPDATE_INPLACE_FNS[name]
    x, s = torch.randn(4, 5), torch.randn(B, 2, 5)
    i = torch.tensor([0, 2])
    if "tensor" in name or "fill" not in name:  # index_fill_ with a Scalar ignores s
        check_raises(lambda x, i, s: fn(x, 0, i, s), [x, i, s], (None, None, 0))
    check_raises(lambda x, i, s: fn(x, 0, i, s), [x, i.expand(B, 2), s[0]], (None, 0, None))


# -- take / take_along_dim ------------------------------------------------------------------


def test_take():
    for dims in combos(2):
        args = [batched(randn(4, 5), dims[0]), batched(lambda: torch.randint(-20, 20, (2, 3)),
                                                        dims[1])]
        check(torch.take, args, dims)
        args = [batched(randn(), dims[0]), batched(lambda: torch.tensor([0, -1]), dims[1])]
        check(torch.take, args, dims)


@pytest.mark.parametrize("accumulate", [False, True])
def test_put(accumulate):
    for dims in combos(3):
        index = lambda: torch.randperm(20)[:6] - 10  # noqa: E731  (distinct, some negative)
        args = [batched(randn(4, 5), dims[0]), batched(index, dims[1]), batched(randn(6), dims[2])]
        check(lambda x, i, s: x.put(i, s, accumulate=accumulate), args, dims)


_DEVICE_ASSERT = pytest.mark.cpu_only(
    "an out-of-range index is a device-side assert on CUDA, which ends the process's CUDA "
    "context")


@_DEVICE_ASSERT
def test_put_out_of_range_raises_for_its_own_example():
    # an index past one example's end must not land in the next example
    x, i = torch.randn(B, 4), torch.tensor([[0], [4], [1]])
    with pytest.raises(RuntimeError, match="out of bounds"):
        run_ours(lambda x, i: x.put(i, torch.ones(1)), [x, i], (0, 0))


@_DEVICE_ASSERT
def test_take_out_of_range_raises():
    x, i = torch.randn(B, 4), torch.tensor([[0], [1], [4]])
    with pytest.raises((RuntimeError, IndexError)):
        run_ours(torch.take, [x, i], (0, 0))


@pytest.mark.parametrize("dim", [None, 0, 1])
def test_take_along_dim(dim):
    ishape = {None: (6,), 0: (2, 5), 1: (4, 2)}[dim]
    for dims in combos(2):
        args = [batched(randn(4, 5), dims[0]), batched(randint(4, *ishape), dims[1])]
        check(lambda x, i: torch.take_along_dim(x, i, dim), args, dims)


# -- masked_fill / where / masked_select / nonzero ------------------------------------------


@pytest.mark.parametrize("mshape", [(4, 5), (5,), ()])
def test_masked_fill(mshape):
    mask = lambda: torch.rand(mshape) > 0.5  # noqa: E731
    for dims in combos(3):
        args = [batched(randn(4, 5), dims[0]), batched(mask, dims[1]), batched(randn(), dims[2])]
        check(lambda x, m, v: x.masked_fill(m, v), args, dims)
        check(lambda x, m, v: x.masked_fill(m, 3.0), args, dims)
        if dims[0] is not None:
            check(lambda x, m, v: x.masked_fill_(m, v), args, dims)
            check(lambda x, m, v: x.masked_fill_(m, -1.0), args, dims)


def test_masked_fill_mask_bigger_than_self():
    for dims in combos(3):
        args = [batched(randn(5), dims[0]), batched(lambda: torch.rand(4, 5) > 0.5, dims[1]),
                batched(randn(), dims[2])]
        check(lambda x, m, v: x.masked_fill(m, v), args, dims)


@pytest.mark.parametrize("value_dtype", [torch.float64, torch.int64, torch.float16])
@pytest.mark.parametrize("self_dtype", [torch.float32, torch.int32, torch.uint8])
def test_masked_fill_keeps_selfs_dtype_for_examples_of_0_dims(self_dtype, value_dtype):
    # a batched 0-dim self is a vector physically, which would promote with a 0-dim value
    value = torch.tensor(7, dtype=value_dtype)
    for dims in combos(2):
        args = [batched(lambda: (randn()() * 9).to(self_dtype), dims[0]),
                batched(lambda: torch.rand(()) > 0.5, dims[1])]
        check(lambda x, m: x.masked_fill(m, value), args, dims)
        assert run_ours(lambda x, m: x.masked_fill(m, value), args, dims).dtype == self_dtype


@pytest.mark.parametrize(("values", "dtype"), [
    ([1.5, 2.5, 300.7], torch.uint8), ([1.0, -200.0, 3.0], torch.int8),
    ([1.0, 1e300, 2.0], torch.float32), ([1 + 0j, 2 + 1j, 3 + 0j], torch.float32)])
def test_masked_fill_with_fill_values_that_overflow_raises_as_each_example_would(values, dtype):
    x, v = torch.zeros(3, 2, dtype=dtype), torch.tensor(values, dtype=torch.complex128
                                                        if isinstance(values[1], complex)
                                                        else torch.float64)
    fill = lambda x, v: x.masked_fill(torch.tensor([True, False]), v)  # noqa: E731
    check_raises(fill, [x, v], (0, 0), match="cannot be converted to type")
    fits = v.real.clamp(-100, 100).to(v.dtype) if v.is_complex() else v.clamp(-100, 100)
    check(fill, [x, fits if not v.is_complex() else fits.real + 0j], (0, 0))


def test_masked_fill_inplace_unbatched_self_raises():
    x, m, v = torch.randn(4), torch.rand(B, 4) > 0.5, torch.randn(B)
    check_raises(lambda x, m: x.masked_fill_(m, 1.0), [x, m], (None, 0), match="vmapped over")
    check_raises(lambda x, v: x.masked_fill_(m[0], v), [x, v], (None, 0), match="vmapped over")


def test_where():
    shapes = [(4, 5), (5,), ()]
    for sc, sx, sy in itertools.product(shapes, repeat=3):
        for dims in combos(3):
            args = [batched(lambda sc=sc: torch.rand(sc) > 0.5, dims[0]),
                    batched(randn(*sx), dims[1]), batched(randn(*sy), dims[2])]
            check(torch.where, args, dims)
    for dims in combos(2):
        args = [batched(lambda: torch.rand(4, 5) > 0.5, dims[0]), batched(randn(5), dims[1])]
        check(lambda c, x: torch.where(c, x, 0.0), args, dims)
        check(lambda c, x: torch.where(c, 1.0, x), args, dims)


def test_masked_select_shared_mask():
    for shape, mshape in [((4, 5), (4, 5)), ((4, 5), (5,)), ((5,), (4, 5)),
                          ((), ()), ((), (3,)), ((3,), ())]:  # 0-dim examples and masks
        mask = torch.rand(mshape) > 0.5
        for d in (0, -1):
            check(torch.masked_select, [batched(randn(*shape), d), mask], (d, None))


def test_masked_select_batched_mask_of_different_counts_raises():
    x = torch.randn(B, 4)
    m = torch.tensor([[True, False, True, False], [True, True, True, False],
                      [False, False, False, True]])
    check_raises(torch.masked_select, [x, m], (0, 0), match="different numbers of elements")
    check_raises(torch.masked_select, [x[0], m], (None, 0), match="mask")


def test_masked_select_batched_mask_of_equal_counts():
    # as a loop stacks them (cross_entropy's label smoothing with class weights selects
    # every target that is not ignored: all of them, per example)
    m = torch.tensor([[True, False, True, False], [False, True, True, False],
                      [True, False, False, True]])
    for dims, x in [((0, 0), torch.randn(B, 4)), ((None, 0), torch.randn(4)),
                    ((1, 0), torch.randn(4, B))]:
        check(torch.masked_select, [x, m], dims, torch_func=False)
    check(torch.masked_select, [torch.randn(B, 2, 4), m], (0, 0), torch_func=False)


def test_cross_entropy_with_class_weights_and_label_smoothing_per_example_gradients():
    w, cw = torch.randn(5, 6), torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0])
    x, y = torch.randn(4, 7, 6), torch.randint(0, 5, (4, 7))

    def loss(w, x, y):
        return F.cross_entropy(x @ w.T, y, weight=cw, label_smoothing=0.1)

    ours = vmap_without_slow_loop(torchlevels.grad(loss), w, x, y, in_dims=(None, 0, 0))
    assert_close(ours, torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(w, x, y))


@pytest.mark.parametrize("shape,mshape", [((4, 5), (4, 5)), ((4, 5), (5,)), ((5,), (4, 5))])
def test_masked_scatter(shape, mshape):
    for dims in combos(3):
        args = [batched(randn(*shape), dims[0]), batched(lambda: torch.rand(mshape) > 0.5, dims[1]),
                batched(randn(4, 6), dims[2])]
        check(lambda x, m, s: x.masked_scatter(m, s), args, dims)
        if dims[0] is not None and len(shape) == 2:
            check(lambda x, m, s: x.masked_scatter_(m, s), args, dims)
    check_raises(lambda x, m, s: x.masked_scatter_(m, s),
                 [torch.randn(4, 5), torch.rand(B, 4, 5) > 0.5, torch.randn(20)], (None, 0, None),
                 match="vmapped over")


def test_nonzero_with_equal_counts_matches_loop_and_different_counts_raise():
    same = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 4.0]])
    for f in (torch.nonzero, torch.argwhere, lambda x: x.nonzero(as_tuple=True)[0]):
        torch.testing.assert_close(run_ours(f, [same], (0,)), torch.stack([f(r) for r in same]))
    differ = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 4.0]])
    check_raises(torch.nonzero, [differ], (0,), match="dynamic shape")


_DATA_DEPENDENT = {
    "nonzero": torch.nonzero,
    "masked_select": lambda t: torch.masked_select(3 * t, t > 0),
    "unique": lambda t: torch.unique(t, return_inverse=True, return_counts=True),
}


@pytest.mark.parametrize("name", _DATA_DEPENDENT)
@pytest.mark.parametrize("in_dims", [(0, 0), (1, 0), (0, -1)])
def test_ops_of_data_dependent_shape_under_nested_vmap(name, in_dims):
    """Examples of both levels that agree on their count stack as a double loop does; the
    counts are read outside the inner level (they once raised reading a batched value)."""
    f = _DATA_DEPENDENT[name]
    e = torch.zeros(2, 3, 5)  # [outer, inner, elements of one example]
    e[..., 1], e[..., 3] = 1.0, 2.0
    e[1] *= torch.arange(1.0, 4.0).unsqueeze(-1)  # other values, the same counts

    def run(e):
        x = e.movedim(1, 1 + in_dims[1] % 2).movedim(0, in_dims[0])
        return vmap_without_slow_loop(torchlevels.vmap(f, in_dims=in_dims[1]), x,
                                      in_dims=in_dims[0])

    stack = lambda *ts: torch.stack(ts)  # noqa: E731
    assert_close(run(e), tree_map(stack, *[tree_map(stack, *map(f, row)) for row in e]))
    e[1, 2, 0] = 5.0  # one example has one more
    with pytest.raises(RuntimeError, match="differ|dynamic shape"):
        run(e)


@pytest.mark.parametrize("shape", [(), (5,), (3, 4)])
@pytest.mark.parametrize("size", [0, 2, 7, 20])
@pytest.mark.parametrize("in_dim", [0, -1])
def test_nonzero_static_pads_each_example_with_fill_value(shape, size, in_dim):
    """Examples with different counts of nonzeros are fine: the size is static."""
    g = seeded(size)
    x = torch.randint(0, 2, (4, *shape), generator=g) * torch.randn(4, *shape, generator=g)
    x = x.movedim(0, in_dim)  # the batch dim last, for in_dim=-1
    f = lambda t: torch.nonzero_static(t, size=size, fill_value=-7)  # noqa: E731
    got = vmap_without_slow_loop(f, x, in_dims=in_dim)
    assert_close(got, torch.stack([f(x.select(in_dim, b)) for b in range(4)]))


# -- embedding ------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding(padding_idx):
    for dims in combos(2):
        args = [batched(randint(10, 2, 3), dims[0]), batched(randn(10, 4), dims[1])]
        check(lambda i, w: torch.nn.functional.embedding(i, w, padding_idx), args, dims)


@pytest.mark.parametrize("padding_idx", [-1, 2])
@pytest.mark.parametrize("scale", [False, True])
def test_embedding_dense_backward(padding_idx, scale):
    for dims in combos(2):
        args = [batched(randn(2, 3, 4), dims[0]), batched(randint(10, 2, 3), dims[1])]
        check(lambda g, i: aten.embedding_dense_backward(g, i, 10, padding_idx, scale), args,
              dims)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_grad_through_vmap(padding_idx):
    """grad outside vmap: the padding row gets no gradient in any example."""
    indices = torch.randint(0, 10, (B, 2, 3))
    indices[:, 0, 0] = 2
    weight, cot = torch.randn(B, 10, 4), torch.randn(B, 2, 3, 4)

    def embed(i, w):
        return torch.nn.functional.embedding(i, w, padding_idx)

    def weight_grad(vm):
        w = weight.clone().requires_grad_()
        return torch.autograd.grad(vm(embed)(indices, w), w, cot)[0]

    ours = weight_grad(torchlevels.vmap)
    assert_close(ours, weight_grad(lambda f: lambda i, w: loop_reference(f, [i, w], (0, 0))))
    if padding_idx is None:  # torch.func lets the padding row of examples 1.. get gradient
        assert_close(ours, weight_grad(torch.func.vmap))


# -- gradients through vmap -----------------------------------------------------------------


@pytest.mark.parametrize("fn", [
    lambda x, s, i: x[i] * s[:2].sum(),
    lambda x, s, i: x.index_put([i], s[:2], accumulate=True),
    lambda x, s, i: x.gather(0, i),
    lambda x, s, i: x.scatter_add(0, i, s[:2]),
    lambda x, s, i: x.index_add(0, i, s[:2]),
    lambda x, s, i: x.index_select(0, i) * s[0],
])
def test_grad_through_vmap(fn):
    x, s, i = torch.randn(B, 4), torch.randn(B, 4), torch.randint(0, 4, (B, 2))
    grads = []
    for vm in (torchlevels.vmap, torch.func.vmap):
        xs, ss = x.clone().requires_grad_(), s.clone().requires_grad_()
        out = vm(fn)(xs, ss, i)
        grads.append(torch.autograd.grad(out, (xs, ss), torch.ones_like(out),
                                         allow_unused=True))
    for ours, ref in zip(*grads):
        assert_close(ours, ref)



@pytest.mark.parametrize("inner_dims", [(0, 0), (None, 0), (0, None)])
def test_nested_vmap(inner_dims):
    """Rules running on tensors of an enclosing level (two vmaps, batch dims apart)."""

    def f(x, i):
        rows = x[i] + x.index_select(0, i) + x.gather(0, i[:, None].expand(3, 6))
        return rows + torch.zeros(6, 6).index_add(0, i, x[:3])[:3] + x[:, i].T

    xs = torch.randn((2, 3, 6, 6) if inner_dims[0] is not None else (2, 6, 6))
    ii = torch.randint(0, 6, (3, 2, 3) if inner_dims[1] is not None else (2, 3))
    outer_dims = (0, 1 if inner_dims[1] is not None else 0)
    ours = run_ours(torchlevels.vmap(f, inner_dims), [xs, ii], outer_dims)
    ref = torch.func.vmap(torch.func.vmap(f, inner_dims), outer_dims)(xs, ii)
    assert_close(ours, ref)
    inner = torch.func.vmap(f, inner_dims)  # one level checked by the tests above
    assert_close(ours, torch.stack([inner(xs[b], ii.select(outer_dims[1], b)) for b in range(2)]))


# -- embedding_bag ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag(mode, include_last_offset, padding_idx):
    """F.embedding_bag (the forward-only kernel) and aten._embedding_bag (with every
    output: offset2bag, bag sizes and max indices per example), and per-sample gradients."""
    rows, length = 10, 8

    def offsets():  # four bags, some empty
        cuts = torch.sort(torch.randint(0, length + 1, (3,))).values
        return torch.cat([torch.zeros(1, dtype=torch.long), cuts]
                         + [torch.tensor([length])] * include_last_offset)

    for dims in combos(4 if mode == "sum" else 3):
        args = [batched(randn(rows, 4), dims[0]), batched(randint(rows, length), dims[1]),
                batched(offsets, dims[2])]
        if mode == "sum":  # per-sample weights
            args.append(batched(lambda: torch.rand(length), dims[3]))

        def bags(w, i, o, p=None):
            return F.embedding_bag(i, w, o, mode=mode, include_last_offset=include_last_offset,
                                   padding_idx=padding_idx, per_sample_weights=p)

        check(bags, args, dims)
        for op in (aten._embedding_bag.default, aten._embedding_bag_forward_only.default):
            def raw(w, i, o, p=None, op=op):  # the kernel wants contiguous indices
                code = ("sum", "mean", "max").index(mode)
                pad = -1 if padding_idx is None else padding_idx
                return op(w, i.contiguous(), o.contiguous(), False, code, False, p,
                          include_last_offset, pad)

            ours = run_ours(raw, _clone(args), tuple(dims))
            loop = loop_reference(raw, _clone(args), tuple(dims))
            assert_close(ours[0], loop[0])
            # bag sizes and max indices per example, and offset2bag unless the kernel left
            # it empty (as it does for some weight layouts; the backward then recomputes
            # it). The forward-only kernel's other outputs vary with the weight's layout.
            # Kernels that give one entry per offset leave the last offset's unset
            # (uninitialized on CUDA): only the bags' entries are compared.
            if op is aten._embedding_bag.default:
                assert [t.shape for t in ours[2:]] == [t.shape for t in loop[2:]]
                assert_close([t[:, :4] for t in ours[2:]], [t[:, :4] for t in loop[2:]])
                if ours[1].numel() and loop[1].numel():
                    assert_close(ours[1], loop[1])

        def loss(w, i, o, p=None):
            return bags(w, i, o, p).sin().sum()

        argnums = (0, 3) if mode == "sum" else 0
        ours = run_ours(torchlevels.grad(loss, argnums), _clone(args), tuple(dims))
        assert_close(ours, loop_reference(torch.func.grad(loss, argnums), args, tuple(dims)))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_jacrev_of_embedding_bag_batches_its_backward(mode):
    weight = torch.randn(10, 3, dtype=torch.float64)
    indices, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4, 4])

    def bags(w):
        return F.embedding_bag(indices, w, offsets, mode=mode, padding_idx=4)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow loop
        ours = torchlevels.jacrev(bags)(weight)
    assert_close(ours, torch.func.jacrev(bags)(weight))


def test_one_hot_of_a_batched_tensor_needs_num_classes():
    labels = torch.tensor([[1, 2], [3, 0]])
    assert_close(torchlevels.vmap(lambda y: F.one_hot(y, 5))(labels),
                 torch.func.vmap(lambda y: F.one_hot(y, 5))(labels))
    with pytest.raises(RuntimeError, match="one_hot of a batched tensor needs an explicit "
                       "num_classes"):
        torchlevels.vmap(F.one_hot)(labels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32, torch.uint8])
def test_one_hot_of_labels_not_int64_raises_as_each_examples_call(dtype):
    # the decomposition it is batched by took labels of any dtype
    labels = torch.tensor([[1, 2], [3, 0]]).to(dtype)
    with pytest.raises(RuntimeError, match="one_hot is only applicable to index tensor"):
        torch.func.vmap(lambda y: F.one_hot(y, 5))(labels)
    with pytest.raises(RuntimeError, match="one_hot is only applicable to index tensor"):
        torchlevels.vmap(lambda y: F.one_hot(y, 5))(labels)


_W = torch.randn(4, 5)
_BY_ONE_INDEX = {  # x of shape (4, 5, 6) per example, i one example's index (0-dim)
    "x[i]": lambda x, i: x[i],
    "x[:, i]": lambda x, i: x[:, i],
    "x[i, i]": lambda x, i: x[i, i],
    "x[..., i]": lambda x, i: x[..., i],
    "x[None, i]": lambda x, i: x[None, i],
    "x[:, i, None]": lambda x, i: x[:, i, None],
    "x[i, 1:3]": lambda x, i: x[i, 1:3],
    "x[1, i]": lambda x, i: x[1, i],
    "x[i, index]": lambda x, i: x[i, torch.tensor([0, 2])],
    "x[index, i]": lambda x, i: x[torch.tensor([0, 2]), i],
    "captured w[i]": lambda x, i: _W[i],
    "captured w[:, i]": lambda x, i: _W[:, i],
    "x[i] = 1": lambda x, i: _set(x, i, 1.0),
    "x[:, i] = v": lambda x, i: _set(x, (slice(None), i), x[:, 0, :].exp()),
    "x[:, i] = row": lambda x, i: _set(x, (slice(None), i), x[0, 0, :].exp()),
    "x[i] = v": lambda x, i: _set(x, i, x[0] * 2),
}


def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


@pytest.mark.parametrize("name", list(_BY_ONE_INDEX))
def test_index_by_one_examples_int_tensor(name):
    """``x[i]`` with ``i`` a 0-dim integer tensor per example: PyTorch reads such an index
    as a Python int (.item()), which vmap refused; torch.func indexes with it."""
    f = _BY_ONE_INDEX[name]
    xs, idx = torch.randn(B, 4, 5, 6), torch.tensor([3, 0, 1])
    assert_close(torchlevels.vmap(f)(xs, idx), torch.func.vmap(f)(xs, idx))
    loss = lambda x, i: f(x, i).sin().sum() + x.pow(2).sum()  # noqa: E731
    expected = torch.stack([torch.autograd.grad(loss(x.requires_grad_(), i), x)[0]
                            for x, i in zip(xs.clone(), idx)])  # torch.func's grad refuses
    assert_close(torchlevels.vmap(torchlevels.grad(loss))(xs, idx), expected)


@pytest.mark.parametrize("shape,mshape", [((4, 5), (4, 5)), ((4, 5), (5,)), ((5,), (4, 5)),
                                          ((), ())])
def test_masked_scatter_backward(shape, mshape):
    """The source's gradient: the k-th True's gradient is the k-th source value's."""
    sizes = [4, 6]  # room for every True of a (4, 5) mask

    def backward(g, m):
        return torch.ops.aten.masked_scatter_backward(g, m, sizes)

    for dims in combos(2):
        check(backward, [batched(randn(*shape), dims[0]),
                         batched(lambda: torch.rand(mshape) > 0.5, dims[1])], dims)


def test_grad_of_masked_scatter_under_vmap_takes_no_slow_loop():
    x, m = torch.randn(B, 8, dtype=torch.float64), torch.rand(B, 8) > 0.5

    def loss(s, m):
        return torch.zeros(8, dtype=s.dtype).masked_scatter(m, s).pow(2).sum()

    ours = run_ours(torchlevels.grad(loss), [x, m], (0, 0))
    assert_close(ours, torch.func.vmap(torch.func.grad(loss))(x, m))


# -- keyword-only tensors -----------------------------------------------------------------


def _at(x, d):
    """A batch (B, ...) as a physical argument batched at ``d``, or example 0 for None."""
    return x[0] if d is None else x.movedim(0, d)


@pytest.mark.parametrize("dims", [(0, 0, 0), (None, 0, 0), (0, None, 0), (None, None, 0),
                                  (-1, 0, -1), (0, 0, None)])
@pytest.mark.parametrize("rows", [(), (2,)])
def test_searchsorted_with_a_sorter(dims, rows):
    """``sorter`` is keyword-only: a batched one sorts each example's boundaries (shared
    boundaries too: then every example sorts them alike)."""
    base = torch.randn(*rows, 6).sort(-1).values
    perm = torch.randn(B, *rows, 6).argsort(-1)
    if dims[0] is None or dims[2] is None:  # one of them is shared: so is the permutation
        perm = perm[:1].expand(B, *rows, 6)
    boundaries = base.expand(B, *rows, 6).gather(-1, perm)
    values = torch.randn(B, *rows, 4)
    args = [_at(t, d) for t, d in zip((boundaries, values, perm.argsort(-1)), dims)]
    check(lambda b, v, s: torch.searchsorted(b, v, sorter=s, right=True), args, dims)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("how", ["lengths", "offsets"])
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (-1, 0)])
def test_segment_reduce(reduce, how, dims):
    """Each example's segments, by its own ``lengths``/``offsets`` (keyword-only) or shared
    ones, along axis 1 of (2, 6, 3) data, empty segments included."""
    data = torch.randn(B, 2, 6, 3)
    lengths = torch.tensor([[[1, 2, 3], [3, 3, 0]], [[0, 6, 0], [2, 2, 2]],
                            [[6, 0, 0], [1, 0, 5]]])
    if reduce == "mean":  # the mean of an empty segment is NaN: none here
        lengths = torch.tensor([[[1, 2, 3], [3, 2, 1]], [[1, 4, 1], [2, 2, 2]],
                                [[4, 1, 1], [1, 1, 4]]])
    lens = lengths if how == "lengths" else torch.cat(
        [torch.zeros(B, 2, 1, dtype=torch.long), lengths.cumsum(-1)], -1)
    initial = 1.0 if reduce == "prod" else None

    def f(d, ls):
        return torch.segment_reduce(d, reduce, axis=-2, initial=initial, **{how: ls})

    check(f, [_at(data, dims[0]), _at(lens, dims[1])], dims)


def test_grad_of_segment_reduce_under_vmap_takes_no_slow_loop():
    """``_segment_reduce_backward`` takes each example's lengths too."""
    data = torch.randn(B, 6, 2, dtype=torch.float64)
    lengths = torch.tensor([[1, 2, 3], [0, 4, 2], [6, 0, 0]])

    def loss(d, ls):
        return torch.segment_reduce(d, "mean", lengths=ls).pow(2).sum()

    expected = torch.stack([torch.autograd.grad(loss(d.requires_grad_(), ls), d)[0]
                            for d, ls in zip(data.clone(), lengths)])
    assert_close(run_ours(torchlevels.grad(loss), [data, lengths], (0, 0)), expected)


@pytest.mark.cpu_only("histogram has no CUDA kernel")
def test_the_loop_takes_keyword_only_tensors_apart():
    """An op with no rule for its batched keyword-only tensor (``histogram``'s
    ``weight``) runs once per example, with that example's tensor: as a loop, and as
    torch.func, whose fallback does the same."""
    x, w = torch.randn(B, 20), torch.rand(B, 20)
    bins = torch.linspace(-2, 2, 5)

    def f(x, w):
        return torch.histogram(x, bins, weight=w).hist

    registry.reset_loop_warnings()  # it warns once per op
    with pytest.warns(UserWarning, match=r"no batching rule for aten\.histogram\.bins_tensor "
                      r"with batched keyword-only arguments \['weight'\]"):
        ours = torchlevels.vmap(f)(x, w)
    assert_close(ours, loop_reference(f, [x, w], (0, 0)))
    assert_close(ours, torch.func.vmap(f)(x, w))


def test_batched_keywords_over_no_examples():
    """A batch of none gives what a loop over none gives: outputs shaped like one
    example's, found from the op's meta kernel with the keyword tensors' batch dims."""
    def f(d, ls):
        return torch.segment_reduce(d, "sum", lengths=ls)

    one = f(torch.randn(6, 2), torch.tensor([1, 2, 3]))
    out = torchlevels.vmap(f)(torch.randn(0, 6, 2), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, *one.shape)
