"""Own and family rules for views, shape ops, reductions, scans and pointwise ops.

Each case runs under torchlevels.vmap, torch.func.vmap and a Python loop + stack, over
several in_dims, and must not fall back to the slow per-example loop.
"""

import functools
import math
import re

import pytest
import torch
from torch.func import vmap as func_vmap
from vmap_reference import (
    check_vmap,
    counting_dispatches,
    loop_reference,
    vmap_without_slow_loop,
)

import torchlevels
from torchlevels import vmap
from torchlevels.vmap import BatchLevel

aten = torch.ops.aten


def check(f, *shapes, in_dims=None):
    """f under vmap equals torch.func and the loop, for each in_dims pattern given.

    Each pattern gets fresh ``torch.randn`` inputs of ``shapes``; the default patterns are
    everything batched at 0, then everything batched at -1. Any warning fails.
    """
    patterns = in_dims or [(0,) * len(shapes), (-1,) * len(shapes)]
    for dims in patterns:
        args = [torch.randn(s) for s in shapes]
        check_vmap(f, *args, in_dims=dims, equal_nan=True, warnings_are_errors=True)


VIEWS = {
    "view": (lambda x: x.view(-1, 2), [(3, 4, 2)]),
    "reshape_noncontig": (lambda x: x.t().reshape(-1), [(3, 4, 5)]),
    "permute": (lambda x: x.permute(2, 0, 1), [(3, 4, 5, 2)]),
    "transpose": (lambda x: x.transpose(-1, 0), [(3, 4, 5)]),
    "t": (lambda x: x.t(), [(3, 4, 5)]),
    "expand": (lambda x: x.expand(2, 3, -1), [(3, 1, 3)]),
    "squeeze": (lambda x: x.squeeze(), [(3, 1, 4, 1)]),
    "squeeze_dim": (lambda x: x.squeeze(-1), [(3, 4, 1)]),
    "unsqueeze": (lambda x: x.unsqueeze(-1).unsqueeze(0), [(3, 4)]),
    "select": (lambda x: x[:, 1], [(3, 4, 5)]),
    "slice": (lambda x: x[1:3, ::2], [(3, 4, 5)]),
    "unbind": (lambda x: x.unbind(1), [(3, 4, 2)]),
    "split": (lambda x: x.split(2, dim=-1), [(3, 4, 5)]),
    "split_sizes": (lambda x: x.split([1, 3], dim=0), [(4, 4, 4)]),
    "chunk": (lambda x: x.chunk(2, dim=1), [(3, 4, 4)]),
    "cat": (lambda x, y: torch.cat([x, y], dim=-1), [(3, 4, 2), (3, 4, 2)]),
    "stack": (lambda x, y: torch.stack([x, y], dim=1), [(3, 4, 2), (3, 4, 2)]),
    "flatten": (lambda x: x.flatten(0, 1), [(3, 4, 5, 2)]),
    "diagonal": (lambda x: x.diagonal(1, -1, -2), [(3, 4, 4)]),
    "narrow": (lambda x: x.narrow(-1, 1, 2), [(3, 4, 5)]),
    "movedim": (lambda x: x.movedim(0, -1), [(3, 4, 5, 2)]),
    "repeat": (lambda x: x.repeat(2, 1, 3), [(3, 4, 5)]),
    "roll": (lambda x: x.roll(1, -1) + x.roll(2), [(3, 4, 5)]),
    "flip": (lambda x: x.flip(0, -1), [(3, 4, 5)]),
    "unfold": (lambda x: x.unfold(-1, 2, 1), [(3, 4, 5)]),
}


@pytest.mark.parametrize("name", VIEWS)
def test_views(name):
    f, shapes = VIEWS[name]
    check(f, *shapes)


# The gradients of views, as autograd's backward of x[:, 2], x[-7::2], x.diagonal(1, 2, 0):
# the op, an example's gradient shape.
VIEW_BACKWARDS = {
    "select_backward": (lambda g: aten.select_backward(g, [3, 6, 4], -2, 2), (3, 4)),
    "slice_backward": (lambda g: aten.slice_backward(g, [9, 4], 0, -7, 100, 2), (4, 4)),
    "diagonal_backward": (lambda g: aten.diagonal_backward(g, [4, 5, 3], 1, 2, 0), (5, 3)),
}


@pytest.mark.parametrize("in_dim", [0, 1, -1])
@pytest.mark.parametrize("name", VIEW_BACKWARDS)
def test_view_backwards(name, in_dim):
    f, example = VIEW_BACKWARDS[name]
    grads = torch.randn(7, *example).movedim(0, in_dim)
    check_vmap(f, grads, in_dims=(in_dim,), warnings_are_errors=True)


@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_as_strided_is_relative_to_each_examples_storage(in_dim):
    """As torch.func reads it: each example's sizes, strides and offset are relative to its
    own storage (the loop model would read example 0's storage for every example)."""
    x = torch.randn(3, 4, 5).movedim(0, in_dim)  # 3 examples of (4, 5)
    f = lambda x: x.as_strided((2, 3), (5, 2), 1)  # noqa: E731
    ours = vmap_without_slow_loop(f, x, in_dims=in_dim)
    torch.testing.assert_close(ours, func_vmap(f, in_dims=in_dim)(x))
    g = lambda x: x.t().as_strided((4,), (6,))  # no offset: the tensor's own  # noqa: E731
    torch.testing.assert_close(vmap_without_slow_loop(g, x, in_dims=in_dim),
                               func_vmap(g, in_dims=in_dim)(x))
    # in place, the tensor takes the same view (torch.func loops and keeps its old shape)
    h = lambda x: x.clone().as_strided_((2, 3), (5, 2), 1)  # noqa: E731
    torch.testing.assert_close(vmap_without_slow_loop(h, x, in_dims=in_dim), ours)


AS_STRIDED_BATCHES = {  # 5 examples of (2, 3), each laid out differently in memory
    "contiguous": lambda: torch.randn(5, 2, 3),
    "transposed": lambda: torch.randn(5, 3, 2).transpose(1, 2),
    "batch last": lambda: torch.randn(3, 2, 5).movedim(-1, 0).transpose(1, 2),
    "offset": lambda: torch.randn(2, 5, 2, 3)[1],
    "strided, offset": lambda: torch.randn(5, 2, 4, 3, 7)[:, :, 2, :, 1],
}


@pytest.mark.parametrize("layout", AS_STRIDED_BATCHES)
def test_as_strided_within_each_example_matches_the_loop_of_relative_offsets(layout):
    """Views that stay inside each example's memory are each example's own call with the
    offset taken relative to the example's storage offset."""
    x = AS_STRIDED_BATCHES[layout]()
    s0, s1 = x.stride()[1:]
    start = x.storage_offset()
    for size, stride, offset in [((5, 2, 3), (0, s0, s1), start), ((3, 2), (s1, s0), start),
                                 ((2,), (s0,), start + s1), ((2,), (s0 + s1,), start)]:
        view = functools.partial(torch.as_strided, size=size, stride=stride,
                                 storage_offset=offset)
        ours = vmap_without_slow_loop(view, x)
        torch.testing.assert_close(ours, func_vmap(view)(x))
        loop = torch.stack([t.as_strided(size, stride, offset + t.storage_offset() - start)
                            for t in x])
        torch.testing.assert_close(ours, loop)


@pytest.mark.parametrize("batch, size, stride, offset, levels", [
    (lambda: torch.randn(5, 3), [3], [1], 1, 1),  # past the example's end
    (lambda: torch.randn(5, 3, 5), [4, 4], [4, 1], 0, 1),
    (lambda: torch.randn(2, 5, 3)[1], [3], [1], 14, 1),  # before the example's start
    (lambda: torch.randn(5, 0, 3), [3], [1], None, 1),  # an empty example
    (lambda: torch.randn(5, 7, 3, 5), [4, 4], [4, 1], 0, 2),  # past the end, nested
], ids=["past the end", "past the end, 2-D", "before the start", "empty", "nested"])
def test_as_strided_outside_an_examples_memory_raises_as_torch_func_does(
        batch, size, stride, offset, levels):
    """Where an example's view would reach outside its own memory, the batched view reads
    other examples' memory (or none's): torch.func raises, and so does vmap."""
    x = batch()
    for mapped in (func_vmap, vmap):
        f = lambda t: t.as_strided(size, stride, offset)  # noqa: E731
        for _ in range(levels):
            f = mapped(f)
        with pytest.raises(RuntimeError, match="can access memory outside of `tensor`"):
            f(x)


def test_in_place_as_strided_under_grad_of_vmap_matches_a_loop():
    def f(x):
        y = x.clone()
        y.as_strided_((2, 3), (5, 2), 1)
        return (y * y).sum()

    xs = torch.randn(3, 4, 5)
    loop = torch.stack([torch.func.grad(f)(x.clone()) for x in xs])
    torch.testing.assert_close(torchlevels.grad(lambda x: vmap(f)(x).sum())(xs), loop)
    torch.testing.assert_close(vmap(torchlevels.grad(f))(xs), loop)


def _resized(size, prepare=torch.clone):
    """A function resizing a tensor made from its argument in place to ``size``."""
    def f(a):
        y = prepare(a)
        y.resize_(size)
        return y
    return f


def _kept(y: torch.Tensor, batch: int, count: int) -> torch.Tensor:
    """Each example's first ``count`` elements (a resized example is contiguous)."""
    return y[:batch].reshape(batch, -1)[:, :count]


@pytest.mark.parametrize("in_dim", [0, 1])
@pytest.mark.parametrize("size", [(4, 2), (2,), (3, 2), (), (0,), (11,), (3, 4)])
def test_resize_resizes_each_example_as_a_loop_does(in_dim, size):
    x = torch.randn(3, 4, 2)
    f = _resized(size)
    out, loop = vmap_without_slow_loop(f, x, in_dims=in_dim), loop_reference(f, [x], in_dim)
    assert out.shape == loop.shape
    batch, kept = x.shape[in_dim], min(math.prod(size), x.select(in_dim, 0).numel())
    # (a growth leaves the new elements uninitialized)
    torch.testing.assert_close(_kept(out, batch, kept), _kept(loop, batch, kept))
    # torch.func resizes the physical tensor as one (batched at 0 only), so that its
    # examples read each other's elements where a loop's keep their own
    if in_dim == 0 and 0 < math.prod(size) < 8:
        assert not torch.equal(_kept(func_vmap(f)(x), batch, kept), _kept(loop, batch, kept))


@pytest.mark.parametrize("prepare", [
    lambda a: a * 1,  # batched at 1: the batch interleaves the examples' elements
    lambda a: a.mT.contiguous().mT,  # examples laid out transposed, as in a loop
    lambda a: a.clone()[:, ::2],  # a view whose elements are not all its block's
], ids=["interleaved", "transposed", "strided"])
@pytest.mark.parametrize("size", [(3,), (20,)])
def test_resize_keeps_each_examples_elements_in_memory_order(prepare, size):
    x = torch.randn(4, 3, 4).movedim(0, 1)  # examples at dim 1
    f = _resized(size, prepare)
    out, loop = vmap_without_slow_loop(f, x, in_dims=1), loop_reference(f, [x], 1)
    assert out.shape == loop.shape
    kept = min(size[0], prepare(x[:, 0]).numel())
    torch.testing.assert_close(_kept(out, 4, kept), _kept(loop, 4, kept))


def test_resize_that_shrinks_leaves_views_of_the_tensor_seeing_it():
    def f(a):
        y = a.clone()
        head = y[:2]
        y.resize_(3)
        y.mul_(2)
        return head

    x = torch.randn(5, 6)
    torch.testing.assert_close(vmap_without_slow_loop(f, x), loop_reference(f, [x], 0))


def test_resize_errors_as_eager():
    x = torch.randn(3, 4, requires_grad=True)
    for size in [(2,), (4,)]:  # (even to each example's own size, as eager raises)
        with pytest.raises(RuntimeError, match="cannot resize variables that require grad"):
            vmap(lambda a, size=size: a.resize_(size))(x)
    with pytest.raises(RuntimeError, match="only the contiguous format can be batched"):
        vmap(lambda a: a.clone().resize_(1, 2, 2, 1, memory_format=torch.channels_last))(
            x.detach())


@pytest.mark.parametrize("in_dims", [(0, 0), (0, None), (1, 1)])
def test_resize_as_resizes_each_example_to_the_templates_size(in_dims):
    def f(a, template):
        y = a.clone()
        y.resize_as_(template)
        return y

    x = torch.randn(3, 3, 2)
    template = torch.randn(3, 1) if in_dims[1] is None else torch.randn(3, 3, 1)  # a shrink
    torch.testing.assert_close(vmap_without_slow_loop(f, x, template, in_dims=in_dims),
                               loop_reference(f, [x, template], in_dims))


def test_resize_as_of_an_unbatched_tensor_to_a_batched_template_resizes_it_once():
    def f(template, out):
        out.resize_as_(template)
        return template * 2

    template = torch.randn(3, 2)
    out, expected = torch.zeros(5), torch.zeros(5)
    vmap_without_slow_loop(f, template, out, in_dims=(0, None))
    for example in template:
        f(example, expected)
    assert out.shape == expected.shape


def test_resize_under_nested_vmap():
    f = _resized((2, 3))
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(vmap(vmap(f))(x), torch.stack([loop_reference(f, [e], 0)
                                                              for e in x]))


@pytest.mark.parametrize("in_dims", [(0, 0), (1, None), (2, 1), (None, 0)])
def test_as_strided_scatter_writes_each_examples_own_clone(in_dims):
    """Each example's result is a clone of its input written through as_strided of the
    clone's storage. torch.func has no rule, and a loop over views of the batch would
    address the batch's storage: the reference clones each example first."""
    def f(x, src):
        return torch.as_strided_scatter(x, src, (2, 2), (1, 3), 1)

    xs, srcs = torch.randn(3, 4, 5), torch.randn(3, 2, 2)
    x = xs[0] if in_dims[0] is None else xs.movedim(0, in_dims[0])
    src = srcs[0] if in_dims[1] is None else srcs.movedim(0, in_dims[1])
    expected = torch.stack([f(xs[0 if in_dims[0] is None else b].clone(),
                              srcs[0 if in_dims[1] is None else b]) for b in range(3)])
    torch.testing.assert_close(vmap_without_slow_loop(f, x, src, in_dims=in_dims), expected)
    columns = torch.randn(3, 5, 4).transpose(1, 2)  # examples laid out column-major
    torch.testing.assert_close(vmap(f)(columns, srcs),
                               torch.stack([f(c.clone(), s) for c, s in zip(columns, srcs)]))
    with pytest.raises(RuntimeError, match="expected src to have a size equal to the slice"):
        vmap(f)(xs, srcs[:, :1])


def test_as_strided_scatter_rule_differentiates_right_where_autograd_does_not():
    """grad(vmap) differentiates the rule's clone and writes, which gives the right
    derivative; PyTorch's own formula for the input's does not (gradcheck fails), so a
    loop with torch.autograd is no reference for it (tests/test_opinfo_compositions.py)."""
    def f(x, src):
        return torch.as_strided_scatter(x, src, (2, 2), (1, 3), 1)

    xs = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    srcs = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(vmap(f), (xs, srcs))
    with pytest.raises(RuntimeError, match="Jacobian mismatch"):  # GradcheckError
        torch.autograd.gradcheck(f, (xs[0].detach().requires_grad_(), srcs[0]))


def test_new_empty_strided_is_batched():
    """autograd's CopySlices writes a batched gradient into ``new_empty_strided`` of it."""
    def f(x):
        r = x.new_empty_strided((4, 5), (1, 4))  # column-major
        r.copy_(x)
        return r.as_strided((2, 2), (4, 1), 1), r.stride()

    x = torch.randn(3, 4, 5)
    ours, stride = vmap(f, out_dims=(0, None))(x)
    theirs, their_stride = func_vmap(f, out_dims=(0, None))(x)
    torch.testing.assert_close(ours, theirs)
    assert stride == their_stride == (1, 4)


@pytest.mark.parametrize("size, stride", [((0, 2, 0), (12, 4, 1)), ((2, 3, 4), (2, 4, 6)),
                                          ((3, 0), (1, 3)), ((), ())])
def test_new_empty_strided_lays_out_a_block_per_example_as_torch_func_does(size, stride):
    """A batch stride of one example's extent: 0 for examples of no elements."""
    f = lambda a: a.new_empty_strided(size, stride)  # noqa: E731
    x = torch.randn(7)
    ours, theirs = vmap(f)(x), func_vmap(f)(x)
    assert (ours.shape, ours.stride()) == (theirs.shape, theirs.stride())


def test_cat_with_unbatched_and_legacy_empty():
    check(lambda x, y: torch.cat([x, y, torch.empty(0)], 0), (3, 2, 4), (2, 4),
          in_dims=[(0, None), (1, None)])


@pytest.mark.parametrize("in_dims", [(None, 0, 0), (0, 0, 0), (1, None, 1), (None, 1, None)])
def test_cat_keeps_a_legacy_empty_tensor_in_the_graph(in_dims):
    """cat skips a 1-D empty tensor, but it stays an input of the result, as in each
    example's call: its requires_grad (and its dtype) reach the result."""
    def cat(*ts):
        return torch.cat(ts, 0)

    examples = [((0,), torch.float32), ((2,), torch.float32), ((0,), torch.float64)]
    made = [torch.rand(shape if d is None else shape[:d] + (5,) + shape[d:], dtype=dtype)
            for (shape, dtype), d in zip(examples, in_dims)]
    ours, theirs, loop_inputs = ([t.clone().requires_grad_() for t in made] for _ in range(3))
    out = vmap(cat, in_dims=in_dims)(*ours)
    loop = torch.stack([cat(*(t if d is None else t.select(d, b)
                              for t, d in zip(loop_inputs, in_dims))) for b in range(5)])
    for expected in (torch.func.vmap(cat, in_dims=in_dims)(*theirs), loop):
        torch.testing.assert_close(out, expected)
        assert out.requires_grad == expected.requires_grad
    out.sum().backward()
    loop.sum().backward()
    for t, expected in zip(ours, loop_inputs):
        torch.testing.assert_close(t.grad, expected.grad)


@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_view_of_examples_that_cannot_be_viewed_raises(in_dim):
    """As a loop and torch.func do: a copy in place of the view would let a write through
    it miss the base."""
    def f(x):
        x.t().view(12).add_(1)
        return x

    x = torch.randn(5, 4, 3).movedim(0, in_dim)
    for run in (lambda: loop_reference(f, (x.clone(),), in_dims=in_dim),
                lambda: func_vmap(f, in_dims=in_dim)(x.clone()),
                lambda: vmap(f, in_dims=in_dim)(x.clone())):
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            run()
    g = lambda x: x.t().contiguous().view(12)  # noqa: E731
    check_vmap(g, x, in_dims=in_dim)


@pytest.mark.parametrize("in_dim", [0, 2])
@pytest.mark.parametrize("t", [torch.t, torch.Tensor.t, torch.Tensor.t_])
def test_t_of_examples_of_more_than_two_dims_raises_as_in_torch_func(t, in_dim):
    x = torch.randn(5, 2, 4, 3).movedim(0, in_dim)
    for run in (lambda: loop_reference(t, (x.clone(),), in_dims=in_dim),
                lambda: func_vmap(t, in_dims=in_dim)(x.clone()),
                lambda: vmap(t, in_dims=in_dim)(x.clone())):
        with pytest.raises(RuntimeError, match=r"expects a tensor with <= 2 dimensions"):
            run()
    if t is not torch.Tensor.t_:  # (check_vmap runs each way on the same input)
        check_vmap(t, x[..., 0].clone(), in_dims=min(in_dim, 1))


@pytest.mark.parametrize("in_dim", [0, 1, 2])
def test_view_copy_of_examples_that_cannot_be_viewed(in_dim):
    """view_copy copies, so like eager it takes examples that a view could not."""
    x = torch.randn(5, 4, 3).movedim(0, in_dim)
    out = check_vmap(lambda v: torch.view_copy(v.t(), (12,)), x, in_dims=in_dim)
    assert out.is_contiguous()
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("in_dim", [1, 2, -1])
def test_contiguous_makes_each_example_contiguous(in_dim):
    # examples already contiguous in the batch's own layout, the batch dim inside: a
    # contiguous copy that kept it there left the examples unviewable (instance_norm views)
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64).transpose(0, 2).movedim(1, in_dim)
    check_vmap(lambda v: v.contiguous().view(-1), x, in_dims=in_dim)
    check_vmap(torch.nn.functional.instance_norm, x, in_dims=in_dim)
    strides = vmap(lambda v: torch.tensor(v.contiguous().stride()), in_dim)(x)
    assert strides.tolist() == [list(x.select(in_dim, 0).contiguous().stride())] * 3


def test_views_alias_their_base():
    def f(x):
        y = x.clone()
        y.transpose(0, 1)[0].mul_(0)  # write through a view
        return y

    check(f, (3, 4, 5))


REDUCTIONS = {
    "sum_all": lambda x: x.sum(),
    "sum_dims": lambda x: x.sum((0, -1)),
    "sum_keepdim": lambda x: x.sum(1, keepdim=True),
    "mean": lambda x: x.mean(-1),
    "mean_all": lambda x: x.mean(),
    "prod": lambda x: x.prod(1),
    "amax": lambda x: x.amax((0, 1)),
    "max_dim": lambda x: x.max(1),
    "max_all": lambda x: x.max(),
    "min_dim_keepdim": lambda x: x.min(0, keepdim=True),
    "argmax": lambda x: x.argmax(-1),
    "argmax_all": lambda x: x.argmax(),
    "var": lambda x: x.var(1),
    "std_all": lambda x: x.std(),
    "var_mean": lambda x: torch.var_mean(x, 0),
    "logsumexp": lambda x: x.logsumexp(-1),
    "norm": lambda x: x.norm(),
    "vector_norm": lambda x: torch.linalg.vector_norm(x, 3, dim=(0, 1)),
    "any": lambda x: (x > 0).any(-1),
    "all_all": lambda x: (x > 0).all(),
    "median": lambda x: x.median(1),
    "median_all": lambda x: x.median(),
    "nansum": lambda x: x.nansum(0),
    "count_nonzero": lambda x: (x > 0).count_nonzero(1),
    "cumsum": lambda x: x.cumsum(1),
    "cumprod": lambda x: x.cumprod(-1),
    "cummax": lambda x: x.cummax(0),
    "logcumsumexp": lambda x: x.logcumsumexp(1),
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(0),
    "sort": lambda x: x.sort(1, descending=True),
    "argsort": lambda x: x.argsort(-1),
    "topk": lambda x: x.topk(2, dim=0),
    "kthvalue": lambda x: x.kthvalue(2, 1),
    "hash_tensor_all": lambda x: torch.hash_tensor(x),  # no reduction tag: dim=[] is all
    "hash_tensor_dims": lambda x: torch.hash_tensor(x, (0, -1), keepdim=True),
}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions_and_scans(name):
    check(REDUCTIONS[name], (3, 4, 5))


def test_argmax_keepdim_without_dim_matches_eager():
    # torch.func.vmap returns (B, 1) here although eager gives (1, 1) per example
    x = torch.randn(3, 4, 5)
    f = lambda v: v.argmax(keepdim=True)
    torch.testing.assert_close(vmap(f)(x), loop_reference(f, (x,), (0,)))


@pytest.mark.parametrize("name", ["sum_all", "sum_keepdim", "softmax", "cumsum", "max_all",
                                  "hash_tensor"])
def test_dim_ops_on_zero_dim_logical_tensors(name):
    f = {"sum_all": lambda x: x.sum(0), "sum_keepdim": lambda x: x.sum(0, keepdim=True),
         "softmax": lambda x: x.softmax(0), "cumsum": lambda x: x.cumsum(0),
         "max_all": lambda x: x.max(), "hash_tensor": torch.hash_tensor}[name]
    check(f, (5,), in_dims=[(0,)])


POINTWISE = {
    "unary": (lambda x: x.sin().exp().tanh(), [(3, 4)]),
    "binary_broadcast": (lambda x, y: x * y + x, [(3, 3, 3), (3, 3)]),
    "ternary_where": (lambda c, x, y: torch.where(c > 0, x, y), [(3, 3, 3), (3, 3), (3, 3, 3)]),
    "clamp_tensors": (lambda x, lo: x.clamp(min=lo), [(3, 4), (3, 4)]),
    "lerp": (lambda a, b, w: torch.lerp(a, b, w), [(3, 4), (3, 4), (3, 4)]),
    "pow_scalar": (lambda x: x.abs().pow(1.5), [(3, 4)]),
    "comparison": (lambda x, y: (x > y) & (x > 0), [(3, 4), (3, 4)]),
    "frexp": (lambda x: torch.frexp(x), [(3, 4)]),
    "scalar_then_tensor": (lambda s, x: s * x, [(3,), (3, 3, 3)]),
    "addcmul": (lambda x, y, z: torch.addcmul(x, y, z, value=0.5), [(3, 3), (3, 3, 3), (3, 3)]),
}


@pytest.mark.parametrize("name", POINTWISE)
def test_pointwise(name):
    f, shapes = POINTWISE[name]
    patterns = [(0,) * len(shapes), (-1,) * len(shapes), (0,) + (None,) * (len(shapes) - 1)]
    for dims in patterns:
        args = [torch.randn(s) for s in shapes]
        args = [a if d is not None else a[0] for a, d in zip(args, dims)]
        check_vmap(f, *args, in_dims=dims, warnings_are_errors=True)


UNTAGGED_ELEMENTWISE = {  # aten ops PyTorch does not tag pointwise, each called on x and y
    "hardswish": (aten.hardswish.default, lambda x, y: aten.hardswish.default(x * 3 - y)),
    "hardswish_": (aten.hardswish_.default, lambda x, y: aten.hardswish_.default(x * 3 - y)),
    "floor_divide": (aten.floor_divide.default, lambda x, y: aten.floor_divide.default(x * 9, y)),
    "floor_divide.Scalar": (aten.floor_divide.Scalar,
                            lambda x, y: aten.floor_divide.Scalar(x * 9 - y, 2)),
    "floor_divide_": (aten.floor_divide_.Tensor,
                      lambda x, y: aten.floor_divide_.Tensor(x * 9 + y, y)),
    "floor_divide_.Scalar": (aten.floor_divide_.Scalar,
                             lambda x, y: aten.floor_divide_.Scalar(x * 9 + y, 2)),
    "rsub": (aten.rsub.Tensor, lambda x, y: aten.rsub.Tensor(x, y, alpha=2)),
    "fill": (aten.fill.Scalar, lambda x, y: aten.fill.Scalar(x + y, 2.5)),
}


@pytest.mark.parametrize("name", UNTAGGED_ELEMENTWISE)
def test_untagged_elementwise_ops_batch_in_one_call(name):
    """Batched as pointwise ops, in one call where their decompositions dispatch several:
    either operand batched, at any dim, one of lower rank broadcasting."""
    op, f = UNTAGGED_ELEMENTWISE[name]
    x, y = torch.rand(3, 4, 5), torch.rand(3, 4, 5) + 0.5
    for args, dims in [((x, y), (0, 0)), ((x, y[0, 0]), (0, None)),
                       ((x[0], y.permute(1, 2, 0)), (None, 2)),
                       ((x.transpose(0, 1), y[:, :, :1]), (1, 0))]:
        with counting_dispatches(BatchLevel) as calls:
            check_vmap(f, *args, in_dims=dims, warnings_are_errors=True)
        assert calls.count(op) == 1 and len(calls) <= 2, (dims, calls)  # and x * 3 or so


def test_pointwise_mixed_dtypes_and_int_tensors():
    f = lambda a, b: a * b + (a // 2)
    x, y = torch.randint(0, 5, (3, 4)), torch.randn(4)
    for dims, args in [((0, None), (x, y)), ((None, 0), (x[0], torch.randn(3, 4))), ((1, 0), (
            x, torch.randn(4, 3)))]:
        torch.testing.assert_close(vmap(f, in_dims=dims)(*args), func_vmap(f, in_dims=dims)(*args))


# one example of 0 dims (physically a vector) meeting a tensor of another dtype: ops that
# promote promote as one example would; ops that take one dtype raise, as eager does
ZERO_DIM_EXAMPLES_OF_ANOTHER_DTYPE = {
    "add": (lambda a, b: a + b, True),
    "eq": (lambda a, b: a == b, True),
    "where": (lambda a, b: torch.where(a > 0, a, b), True),
    "masked_fill": (lambda a, b: b.masked_fill(b > 0, a), True),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.5), False),
    "complex": (lambda a, b: torch.complex(a, b[0]), False),
    "polar": (lambda a, b: torch.polar(a, b[0]), False),
}


@pytest.mark.parametrize("name", ZERO_DIM_EXAMPLES_OF_ANOTHER_DTYPE)
def test_examples_of_0_dims_meeting_another_dtype(name):
    f, allowed = ZERO_DIM_EXAMPLES_OF_ANOTHER_DTYPE[name]
    a, b = torch.randn(3, dtype=torch.float64), torch.randn(4)
    if allowed:
        out = vmap(f, in_dims=(0, None))(a, b)
        expected = loop_reference(f, (a, b), in_dims=(0, None))
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected)
        return
    with pytest.raises(RuntimeError):
        loop_reference(f, (a, b), in_dims=(0, None))
    with pytest.raises(RuntimeError, match="scalar type|expected dtype"):
        vmap(f, in_dims=(0, None))(a, b)


@pytest.mark.parametrize("rank_a", [1, 2, 3])
@pytest.mark.parametrize("rank_b", [1, 2, 3])
@pytest.mark.parametrize("dims", [(0, 0), (0, None), (None, 0), (-1, 1)])
def test_matmul_composite_rule(rank_a, rank_b, dims):
    """matmul is caught before it decomposes: every rank pair, batched either side."""
    shape_a, shape_b = [(2, 4, 5)[-rank_a:], (2, 5, 3)[-rank_b:]]
    shape_b = shape_b if rank_b > 1 else (5,)
    args = []
    for shape, d in zip((shape_a, shape_b), dims):
        if d is None:
            args.append(torch.randn(shape))
        else:
            full = list(shape)
            full.insert(d % (len(shape) + 1), 3)
            args.append(torch.randn(full))
    check_vmap(torch.matmul, *args, in_dims=dims, warnings_are_errors=True)


@pytest.mark.parametrize("batched", [(0, None, None), (0, 0, None), (0, None, 0), (None, 0, 0)])
def test_linear_composite_rule(batched):
    x, w, b = torch.randn(3, 4, 5), torch.randn(3, 6, 5), torch.randn(3, 6)
    args = [a if d is not None else a[0] for a, d in zip((x, w, b), batched)]
    ours = vmap(torch.nn.functional.linear, in_dims=batched)(*args)
    torch.testing.assert_close(ours, loop_reference(torch.nn.functional.linear, args, batched))
    torch.testing.assert_close(ours, func_vmap(torch.nn.functional.linear, in_dims=batched)(*args))


@pytest.mark.parametrize("dims", [(0, None), (None, 0), (1, 0)])
def test_elementwise_prims_from_ref_decompositions(dims):
    """torch._refs decompositions emit prims.* ops, which need equal shapes."""
    a, b = torch.randn(3, 4), torch.randn(4, 3) if dims == (1, 0) else torch.randn(3, 4)
    args = [t if d is not None else t[0] for t, d in zip((a, b), dims)]
    ours = vmap_without_slow_loop(torch.ops.prims.mul.default, *args, in_dims=dims)
    torch.testing.assert_close(ours, loop_reference(torch.mul, args, dims))


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "view_as_real", "view_as_complex"])
def test_fft_and_complex_views(name):
    f = {"fft": torch.fft.fft, "rfft": torch.fft.rfft,
         "irfft": lambda v: torch.fft.irfft(torch.fft.rfft(v)),
         "view_as_real": lambda v: torch.view_as_real(torch.fft.fft(v)),
         "view_as_complex": lambda v: torch.view_as_complex(torch.stack([v, v], -1))}[name]
    check(f, (3, 4, 4))


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, 1), (None, 1, None), (1, 0, None)])
def test_prims_where(in_dims):
    """prims.where needs one shape for all three tensors (decompositions of isin and the
    margin losses call it): batched or not, they are expanded alike."""
    where = torch.ops.prims.where.default
    makers = [lambda: torch.randn(4, 5) > 0, lambda: torch.randn(4, 5), lambda: torch.randn(4, 5)]
    args = [make() if d is None else torch.stack([make() for _ in range(3)], d)
            for make, d in zip(makers, in_dims)]
    ours = vmap_without_slow_loop(where, *args, in_dims=in_dims, warnings_are_errors=True)
    torch.testing.assert_close(ours, loop_reference(where, args, in_dims))


def test_isin_and_margin_losses_take_no_slow_loop():
    x, t = torch.randn(3, 6), torch.randint(0, 6, (3,))
    check_vmap(lambda a: torch.isin(a, a[:2]), x, warnings_are_errors=True)
    check_vmap(torch.nn.functional.multi_margin_loss, x, t, warnings_are_errors=True)


# -- histc: one scatter over the batch's bins, bit for bit the loop's counts ----------------

HISTC_ARGS = {
    "own range": {}, "bins": dict(bins=7), "fixed range": dict(bins=5, min=-1.0, max=0.5),
    "min == max": dict(bins=3, min=0.5, max=0.5), "one bin": dict(bins=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
@pytest.mark.parametrize("kwargs", list(HISTC_ARGS.values()), ids=list(HISTC_ARGS))
@pytest.mark.parametrize("in_dim", [0, 1])
def test_histc(dtype, kwargs, in_dim):
    """Examples of different scales (rounded, so values fall on bin edges), one constant
    (its range widens by 1 each way); with a fixed range, NaN and out-of-range values
    count nowhere."""
    x = (torch.randn(5, 6, 9) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 1.0])[:, None, None])
    x = x.round(decimals=1)
    x[4] = 3.0
    if "min" in kwargs and kwargs["min"] != kwargs["max"]:
        x[0, 0, 0] = float("nan")
    x = x.to(dtype).movedim(0, in_dim)
    f = lambda v: torch.histc(v, **kwargs)
    if x.is_cuda and dtype in (torch.float16, torch.bfloat16):  # CUDA's histc refuses them
        with pytest.raises((RuntimeError, NotImplementedError)) as each:
            f(x.select(in_dim, 0))
        with pytest.raises(each.type, match=re.escape(str(each.value))):
            vmap(f, in_dims=in_dim)(x)
        return
    got = check_vmap(f, x, in_dims=in_dim, atol=0, rtol=0)
    assert got.dtype == dtype


def test_histc_of_empty_examples_and_an_empty_batch():
    f = lambda v: torch.histc(v, bins=3)
    check_vmap(f, torch.empty(2, 0))
    # torch.func's fallback refuses an empty batch; one example's histogram has 3 bins
    assert vmap(f)(torch.empty(0, 4)).shape == (0, 3)


@pytest.mark.cpu_only("CUDA's histc refuses other dtypes")
def test_histc_errors_name_the_example_and_keep_torchs_messages():
    x = torch.randn(3, 4)
    x[1, 2] = float("inf")
    with pytest.raises(RuntimeError, match=r"range of \[.*, inf\] is not finite .*example 1"):
        vmap(torch.histc)(x)
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        vmap(lambda v: torch.histc(v, min=2, max=1))(x)
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        vmap(torch.histc)(x.long())


# -- vander: PyTorch writes into a tensor it makes; torchlevels builds it out of place -------

VANDER_ARGS = [{}, dict(N=3), dict(N=1), dict(N=0), dict(N=6, increasing=True)]


@pytest.mark.parametrize("kwargs", VANDER_ARGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
@pytest.mark.parametrize("in_dim", [0, 1])
def test_vander(kwargs, dtype, in_dim):
    x = (torch.randn(3, 5) * 3).to(dtype).movedim(0, in_dim)
    check_vmap(lambda v: torch.vander(v, **kwargs), x, in_dims=in_dim, atol=0, rtol=0)


def _vander_by_powers(v, N=None, increasing=False):
    """The same matrix by ``pow``, which PyTorch differentiates (its vander it cannot)."""
    out = v.unsqueeze(-1) ** torch.arange(v.shape[0] if N is None else N)
    return out if increasing else out.flip(-1)


@pytest.mark.parametrize("kwargs", VANDER_ARGS)
def test_vander_differentiates_at_every_level(kwargs):
    """vmap(grad), vmap(jvp) and autograd through vmap, where torch.func's vander fails
    (PyTorch's own backward of vander raises: it modifies a tensor autograd saved)."""
    x = torch.randn(3, 5, dtype=torch.float64)
    ours = lambda v: torch.vander(v, **kwargs)
    powers = lambda v: _vander_by_powers(v, **kwargs)
    loss = lambda f: (lambda v: f(v).sin().sum())
    torch.testing.assert_close(vmap(torchlevels.grad(loss(ours)))(x),
                               torch.func.vmap(torch.func.grad(loss(powers)))(x))
    torch.testing.assert_close(
        vmap(lambda v: torchlevels.jvp(ours, (v,), (v.cos(),))[1])(x),
        torch.func.vmap(lambda v: torch.func.jvp(powers, (v,), (v.cos(),))[1])(x))
    assert torch.autograd.gradcheck(vmap(ours), (x.clone().requires_grad_(),))


@pytest.mark.parametrize("f, message", [(lambda v: torch.vander(v, N=-1), "non-negative"),
                                        (lambda v: torch.vander(v.unsqueeze(0)), "one-dim")])
def test_vander_errors_are_torchs(f, message):
    with pytest.raises(RuntimeError, match=message):
        vmap(f)(torch.randn(3, 4))


@pytest.mark.parametrize("name", ["histc", "vander", "pdist"])
def test_rules_of_this_kind_nest(name):
    """Inside another vmap their tensors are batched twice: no Python value is read from
    the outer batch, no write goes into an unbatched tensor."""
    f, shape = {"histc": (lambda v: torch.histc(v, 4), (2, 3, 10)),
                "vander": (torch.vander, (2, 3, 5)),
                "pdist": (torch.nn.functional.pdist, (2, 3, 4, 5))}[name]
    x = torch.randn(shape, dtype=torch.float64)
    expected = torch.stack([torch.stack([f(row) for row in block]) for block in x])
    torch.testing.assert_close(vmap_without_slow_loop(vmap(f), x), expected)


def test_histc_range_error_inside_another_vmap():
    x = torch.randn(2, 3, 10)
    x[1, 2, 3] = float("inf")
    with pytest.raises(RuntimeError, match="range is not finite"):
        vmap(vmap(torch.histc))(x)
