"""Plain tensors written in place with a grad or jvp level's values (torchlevels/lifted.py):
a buffer made by a factory inside the function gives torch.func's results; a captured one
gives eager PyTorch's; one other tensors read as plain is refused with a clear error."""

import functools

import pytest
import torch
import torch.func as tf
from torch import nn
from vmap_reference import seeded

import torchlevels as tl
from torchlevels._level import LiftedTensor
from torchlevels.lifted import CapturedMutationError

X = torch.randn(6, 4, generator=seeded(11), dtype=torch.float64)
T = torch.randn(6, 4, generator=seeded(12), dtype=torch.float64)
SRC = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2])
DST = torch.tensor([1, 2, 3, 4, 5, 0, 3, 5])


def message_passing(x):  # a GNN layer's aggregation, as the scientific-ML sweep wrote it
    agg = torch.zeros(6, 4, dtype=x.dtype)
    agg.index_add_(0, DST, x[SRC])
    return (agg.tanh() * x).sum()


def rows_written_in_a_loop(x):  # out[i] = ...: each write is into a view of out
    out = torch.empty(6, 4, dtype=x.dtype)
    for i in range(6):
        out[i] = x[i] * x[(i + 1) % 6]
    return (out.sin() * out).sum()


def chained_factory_and_its_result(x):
    buf = torch.zeros(6, dtype=x.dtype).scatter_add_(0, torch.tensor([0, 0, 2, 5]), x[0])
    same = buf.mul_(x[1, :1])  # an in-place method gives back the object it was called on
    assert same is buf
    return (buf ** 3).sum() + buf.prod()


def columns_and_masks(x):
    buf = torch.zeros(4, 6, dtype=x.dtype)
    buf[:, 1] = x[:4, 0]
    buf[buf > 0] = 2 * x[4, 0]  # a mask read from the tensor once taken in
    buf += x[:4, :].sum(1, keepdim=True)
    return (buf.exp() * buf).sum()


def a_view_of_a_factory(x):  # the buffer itself is a view of the factory's tensor
    grid = torch.zeros(24, dtype=x.dtype).view(6, 4)
    grid.copy_(x.cos())
    grid[2:4].mul_(x[2:4])
    return (grid * x).sum()


def through_views_of_views(x):  # each first write goes through a temporary view of a view
    a = torch.zeros(6, 4, dtype=x.dtype)
    a[0][1] = x[0, 0] * x[1, 1]  # a[0] is a temporary; its __setitem__ writes a[0][1]
    b = torch.zeros(4, 6, dtype=x.dtype)
    b.T[2] = x[2] ** 2
    g = torch.zeros(24, dtype=x.dtype).reshape(6, 4)  # the buffer is itself a view
    g[:, 0] = x[:, 1].sin()
    return (a * x).sum() + (b ** 2).sum() + (g * x).sum()


def methods_the_level_answers(x):  # detach_, tolist, f-strings, as torch.func's tensors
    buf = torch.zeros(6, dtype=x.dtype)
    buf.copy_(x[:, 0] ** 2)
    total = buf.sum() * 2
    scale = torch.zeros((), dtype=x.dtype)
    scale.add_(x.sum())
    assert f"{scale:.3f}" == f"{x.detach().sum().item():.3f}"
    assert buf.tolist() == (x[:, 0] ** 2).tolist()
    buf.detach_()  # from here on the level does not track it
    return total + (buf * x[:, 1]).sum() + scale * 2


def pair_forces(x):  # molecular dynamics: each atom's force accumulated pair by pair
    forces = torch.zeros(6, 4, dtype=x.dtype)
    for i, j in ((0, 1), (1, 2), (2, 5), (3, 4), (0, 4)):
        r = x[i] - x[j]
        f = r / ((r * r).sum() + 0.5) ** 2
        forces[i] += f
        forces[j] -= f
    return (forces ** 2).sum()


def hidden_states_stored(x):  # a recurrent loop keeping each state in a tensor made for it
    states = torch.empty(6, 4, dtype=x.dtype)
    h = torch.zeros(4, dtype=x.dtype)
    for t in range(6):
        h = torch.tanh(x[t] + 0.5 * h.roll(1))
        states[t] = h
    return (states.T @ torch.arange(6.0, dtype=x.dtype)).sum()


def views_taken_before_the_first_write(x, rows=lambda agg: [agg[i] for i in range(6)]):
    agg = torch.zeros(6, 4, dtype=x.dtype)
    each, head, column = rows(agg), agg[:2], agg.T[1]
    agg.index_add_(0, DST, x[SRC])  # the views read what it writes
    return (each[1] * x[1]).sum() + (head.exp() * x[:2]).sum() + (column ** 3).sum()


def written_through_one_view_read_through_another(x):
    buf = torch.zeros(7, dtype=x.dtype)
    first, last, grid = buf[:4], buf[3:], buf[:6].view(2, 3)
    first.copy_(x[0])
    buf[5:].mul_(x[1, :2])  # (a write into `last` itself: PyTorch's autograd refuses it)
    return (buf * buf.sum()).sum() + (last ** 2).sum() + (grid @ x[:3, :2]).sum()


PROGRAMS = [message_passing, rows_written_in_a_loop, chained_factory_and_its_result,
            columns_and_masks, a_view_of_a_factory, through_views_of_views,
            methods_the_level_answers, pair_forces, hidden_states_stored,
            views_taken_before_the_first_write,
            written_through_one_view_read_through_another]


def run(lib, api, f):
    if api == "grad":
        return lib.grad(f)(X)
    if api == "vjp":
        out, pull = lib.vjp(f, X)
        return out, pull(torch.ones_like(out))
    if api == "jvp":
        return lib.jvp(f, (X,), (T,))
    if api == "hessian":
        return lib.hessian(f)(X)
    if api == "jacrev(grad)":
        return lib.jacrev(lib.grad(f))(X)
    if api == "grad(jvp)":
        return lib.grad(lambda x: lib.jvp(f, (x,), (T,))[1])(X)
    raise AssertionError(api)


@pytest.mark.parametrize("api", ["grad", "vjp", "jvp", "hessian", "jacrev(grad)",
                                 "grad(jvp)"])
@pytest.mark.parametrize("f", PROGRAMS, ids=lambda f: f.__name__)
def test_a_buffer_made_inside_and_written_matches_torch_func(f, api):
    actual, expected = run(tl, api, f), run(tf, api, f)
    for a, e in zip(torch.utils._pytree.tree_leaves(actual),
                    torch.utils._pytree.tree_leaves(expected)):
        assert type(a) is torch.Tensor
        torch.testing.assert_close(a, e)


def test_a_batched_write_into_an_unbatched_buffer_raises_as_in_torch_func():
    xs = X.expand(3, 6, 4)
    with pytest.raises(RuntimeError, match="index_add_") as ours:
        tl.vmap(tl.grad(message_passing))(xs)
    with pytest.raises(RuntimeError, match="index_add_") as theirs:
        tf.vmap(tf.grad(message_passing))(xs)
    assert "vmapped over but `self` not being vmapped over" in str(ours.value)
    assert "vmapped over but `self` not being vmapped over" in str(theirs.value)
    # per-example buffers made from the input are batched, and the same program runs
    def batched_buffer(x):
        agg = x.new_zeros(6, 4)
        agg.index_add_(0, DST, x[SRC])
        return (agg.tanh() * x).sum()

    torch.testing.assert_close(tl.vmap(tl.grad(batched_buffer))(xs),
                               tf.vmap(tf.grad(batched_buffer))(xs))


def test_the_buffer_is_plain_again_after_the_call_and_holds_what_was_written():
    kept = []

    def f(x):
        agg = torch.zeros(6, 4, dtype=x.dtype)
        agg.index_add_(0, DST, x[SRC])
        assert type(agg) is LiftedTensor and agg.requires_grad  # as torch.func reports it
        kept.append(agg)
        return agg.sum()

    tl.grad(f)(X)
    (agg,) = kept
    assert type(agg) is torch.Tensor and not agg.requires_grad
    assert vars(agg) == {}
    torch.testing.assert_close(agg, torch.zeros(6, 4, dtype=X.dtype).index_add_(0, DST, X[SRC]))
    assert (agg + 1).sum() == agg.sum() + 24  # an everyday tensor again


CAPTURED_WRITES = {
    "add_": lambda c, v: c.add_(v),
    "copy_": lambda c, v: c.copy_(v),
    "mul_": lambda c, v: c.mul_(v),
    "index_put_": lambda c, v: c.__setitem__(slice(0, 2), v[:2]),
}


@pytest.mark.parametrize("op", list(CAPTURED_WRITES))
@pytest.mark.parametrize("api", ["grad", "jvp"])
def test_a_captured_tensor_written_gives_eager_pytorchs_values(api, op):
    # torch.func refuses this write; torchlevels runs it as eager PyTorch would: the
    # derivative flows through the tensor's later reads, and it keeps the values written
    def f(x, captured):
        CAPTURED_WRITES[op](captured, x * 2)
        return (captured * x).sum()

    x = X[0].clone()
    captured = torch.linspace(1, 2, 4, dtype=x.dtype)
    eager_captured = captured.clone()
    if api == "grad":
        ours = tl.grad(lambda x: f(x, captured))(x)
        leaf = x.clone().requires_grad_()
        expected = torch.autograd.grad(f(leaf, eager_captured), leaf)[0]
    else:
        ours = tl.jvp(lambda x: f(x, captured), (x,), (T[0],))
        with torch.autograd.forward_ad.dual_level():
            out = f(torch.autograd.forward_ad.make_dual(x, T[0]), eager_captured)
            expected = tuple(torch.autograd.forward_ad.unpack_dual(out))[:2]
        eager_captured = torch.autograd.forward_ad.unpack_dual(eager_captured).primal
    torch.testing.assert_close(ours, expected)
    assert type(captured) is torch.Tensor and not captured.requires_grad
    torch.testing.assert_close(captured, eager_captured.detach())


def test_a_captured_tensor_keeps_the_history_autograd_outside_tracks():
    # written inside grad with values autograd outside tracks: as in eager PyTorch, the
    # tensor carries that history after the call
    def f(x, buf):
        buf.copy_(x * 2)
        return (buf * x).sum()

    x = X.clone().requires_grad_()
    ours, eager = torch.zeros_like(X), torch.zeros_like(X)
    tl.grad(f)(x, ours)
    f(x, eager)
    assert type(ours) is torch.Tensor and ours.requires_grad
    torch.testing.assert_close(torch.autograd.grad((ours ** 2).sum(), x)[0],
                               torch.autograd.grad((eager ** 2).sum(), x)[0])


def test_a_buffer_the_outer_grad_took_in_written_in_an_inner_grad_is_eagers():
    # torch.func refuses the inner write (a captured tensor); torchlevels follows eager
    def outer(x, grad):
        b = torch.zeros(3, dtype=x.dtype)
        b.copy_(x.exp())  # taken into the outer grad
        inner = grad(lambda y: (b.mul_(y) * y).sum())(x)  # written with the inner's values
        return (b * x).sum() + inner.sum()

    x = X[0, :3].clone()
    leaf = x.clone().requires_grad_()
    expected = torch.autograd.grad(outer(leaf, lambda f: lambda y: _eager_grad(f, y)), leaf)[0]
    torch.testing.assert_close(tl.grad(lambda x: outer(x, tl.grad))(x), expected)


def _eager_grad(f, y):
    """``torch.func.grad(f)(y)`` written with torch.autograd, for eager references."""
    y = y.view_as(y)  # a non-leaf: f's in-place writes into captured tensors record on it
    (g,) = torch.autograd.grad(f(y), y, create_graph=True)
    return g


def test_requires_grad_false_on_a_buffer_the_level_tracks_raises_as_eager():
    def f(x):
        buf = torch.zeros(6, dtype=x.dtype)
        buf.copy_(x[:, 0])
        buf.requires_grad_(False)
        return buf.sum()

    with pytest.raises(RuntimeError, match="requires_grad_"):
        tl.grad(f)(X)


@pytest.mark.parametrize("api", ["grad", "jvp", "hessian"])
def test_the_rows_of_unbind_taken_before_the_first_write_read_what_it_writes(api):
    """As rows taken one by one do under torch.func (which refuses unbind's rows there:
    PyTorch's autograd cannot replay a view of an op with several outputs)."""
    by_unbind = functools.partial(views_taken_before_the_first_write, rows=torch.unbind)
    torch.testing.assert_close(run(tl, api, by_unbind),
                               run(tf, api, views_taken_before_the_first_write))


def test_a_tensor_whose_memory_an_alias_that_is_no_view_holds_is_refused():
    def f(x):
        agg = torch.zeros(6, 4, dtype=x.dtype)
        alias = agg.detach()  # no view: it would read the memory untracked
        agg.index_add_(0, DST, x[SRC])
        return (alias[1] * x[1]).sum()

    with pytest.raises(CapturedMutationError, match="something else holds its memory"):
        tl.grad(f)(X)
    with pytest.raises(CapturedMutationError, match="x.new_zeros"):
        tl.jvp(f, (X,), (T,))


def test_the_views_taken_in_with_a_buffer_are_plain_again_after_the_call():
    held = {}

    def f(x):
        buf = torch.zeros(6, 4, dtype=x.dtype)
        held["rows"], held["head"] = buf.unbind(0), buf[:2]
        buf[3] = x[3] * 2
        return (held["rows"][3] * x[3]).sum()

    tl.grad(f)(X)
    for view in (*held["rows"], held["head"]):
        assert type(view) is torch.Tensor
    torch.testing.assert_close(held["rows"][3], X[3] * 2)


def test_parameters_and_tensors_autograd_tracks_are_refused():
    layer = nn.Linear(4, 4, dtype=X.dtype)
    tracked = torch.zeros(4, dtype=X.dtype, requires_grad=True) * 1

    def write_parameter(x):
        with torch.no_grad():
            layer.bias.copy_(x[0])
        return layer(x).sum()

    with pytest.raises(CapturedMutationError, match="it is a Parameter"):
        tl.grad(write_parameter)(X)
    # torch.func refuses it too; its words (which PyTorch's own tests match) begin ours
    torch_funcs = "During a grad .* attempted to call in-place operation"
    for lib in (tl, tf):
        with pytest.raises(RuntimeError, match=torch_funcs):
            lib.grad(write_parameter)(X)
    with pytest.raises(CapturedMutationError, match="requires grad"):
        tl.grad(lambda x: tracked.add_(x[0]).sum())(X)
    assert type(layer.bias) is nn.Parameter and type(tracked) is torch.Tensor


def test_a_write_that_fails_leaves_the_tensor_plain():
    captured = torch.zeros(6, 4, dtype=X.dtype)

    def f(x):
        captured.index_add_(0, DST, x[SRC])
        raise ValueError("the user's own error")

    with pytest.raises(ValueError, match="the user's own error"):
        tl.grad(f)(X)
    assert type(captured) is torch.Tensor
    torch.testing.assert_close(captured, torch.zeros_like(captured).index_add_(0, DST, X[SRC]))


def features_then_scaled(x, y):
    # per-sample gradients with respect to x alone: v depends only on the data y, so under
    # vmap it is a tensor of vmap's level, and the write makes it grad's
    v = y.sin()
    v.div_(x)
    return (v * x).sum() + v.prod()


@pytest.mark.parametrize("api", ["vmap(grad)", "vmap(jacfwd)", "vmap(hessian)"])
def test_a_tensor_of_an_enclosing_vmap_written_inside_matches_torch_func(api):
    xs, ys = X[:, :3] ** 2 + 1, T[:, :3]
    torch.testing.assert_close(_per_example(tl, api, features_then_scaled, xs, ys),
                               _per_example(tf, api, features_then_scaled, xs, ys))


def _per_example(lib, api: str, f, xs, ys):
    """``lib``'s derivative of ``f`` in its first argument by ``api``, a transform inside
    a vmap over examples of both arguments."""
    if api == "vmap(vmap(grad))":
        return lib.vmap(lib.vmap(lib.grad(f)), in_dims=(None, 0))(
            xs[:2], ys.unflatten(0, (3, 2)))
    if api == "vmap(grad) in_dims=1":
        return lib.vmap(lib.grad(f), in_dims=(None, 1))(xs[0], ys.T.contiguous())
    inner = {"vmap(grad)": lib.grad, "vmap(jacfwd)": lib.jacfwd,
             "vmap(hessian)": lib.hessian}[api]
    return lib.vmap(inner(f))(xs, ys)


def test_a_captured_tensor_of_an_enclosing_vmap_is_its_own_again_after_grad():
    # torch.func refuses the write; here v takes it, and is vmap's tensor again after grad
    def per_example(x, y):
        v = y.sin()
        g = tl.grad(lambda x: (v.mul_(x) * x).sum())(x)
        return v + g

    def eager(x, y):
        x = x.clone().requires_grad_()
        v = y.sin()
        v.mul_(x)
        return v.detach() + torch.autograd.grad((v * x).sum(), x)[0]

    xs, ys = X[:, :3], T[:, :3]
    torch.testing.assert_close(tl.vmap(per_example)(xs, ys),
                               torch.stack([eager(x, y) for x, y in zip(xs, ys)]))


def a_view_of_data_written(x, y):
    v = y.sin()
    head = v[:2]  # a view of v's memory: v reads what the write through it puts there
    head.mul_(x[:2])
    return (v * x).sum()


def rows_of_data_written(x, y):  # zeros_like(data): torch.func's grad wraps y too
    out = torch.zeros_like(y)
    out[0] = x[0] * 2
    out[1:] = x[1:].sin() * y[1:]
    return (out * y).exp().sum()


def views_taken_before_the_write(x, y):
    out = y.clone()
    first, last, tail = out[0], out[2], out[1:]
    out[0] = x[0] ** 2
    out[2] = x[2] * x[1]
    return (first * x[1] + tail.prod() + out.sum() * last).sum()


def a_transposed_view_of_data_written(x, y):
    m = torch.outer(y, y)
    m.t()[1].mul_(x)  # column 1 of m
    m.diagonal().add_(x.cos())
    return (m @ x).pow(2).sum()


@pytest.mark.parametrize("api", ["vmap(grad)", "vmap(jacfwd)", "vmap(hessian)",
                                 "vmap(vmap(grad))", "vmap(grad) in_dims=1"])
@pytest.mark.parametrize("f", [a_view_of_data_written, rows_of_data_written,
                               views_taken_before_the_write,
                               a_transposed_view_of_data_written],
                         ids=lambda f: f.__name__)
def test_a_view_of_a_tensor_of_an_enclosing_vmap_written_inside_matches_torch_func(f, api):
    """The tensor written is a view of one the enclosing vmap made from the data (an
    argument grad does not differentiate): the level takes in the base with its views."""
    xs, ys = X[:, :3] ** 2 + 1, T[:, :3]
    torch.testing.assert_close(_per_example(tl, api, f, xs, ys),
                               _per_example(tf, api, f, xs, ys))


def test_a_view_of_a_tensor_of_an_enclosing_vmap_is_its_own_again_after_grad():
    def per_example(x, y):
        v = y.sin()
        head = v[:2]
        g = tl.grad(lambda x: (head.mul_(x[:2]).sum() * x).sum())(x)
        return torch.cat([v + g, head])

    def eager(x, y):
        x = x.clone().requires_grad_()
        v = y.sin()
        head = v[:2]
        head.mul_(x[:2])
        g = torch.autograd.grad((head.sum() * x).sum(), x)[0]
        return torch.cat([v.detach() + g, head.detach()])

    xs, ys = X[:, :3], T[:, :3]
    torch.testing.assert_close(tl.vmap(per_example)(xs, ys),
                               torch.stack([eager(x, y) for x, y in zip(xs, ys)]))


def test_a_tensor_of_an_enclosing_vmap_whose_memory_an_alias_holds_is_refused():
    def f(x, y):
        v = y.sin()
        alias = v.detach()  # no view: it would read the write untracked
        v[:2].mul_(x[:2])
        return (v * x).sum() + alias.sum()

    with pytest.raises(CapturedMutationError, match="something else holds its memory"):
        tl.vmap(tl.grad(f))(X[:, :3], T[:, :3])


def test_nothing_of_the_level_outlives_the_call():
    import gc
    import weakref

    levels = []

    def f(x):
        levels.append(weakref.ref(type(x)))
        return message_passing(x)

    kept = [tl.grad(f)(X) for _ in range(3)]
    gc.collect()
    assert len(kept) == 3 and all(ref() is None for ref in levels)


def returns_the_buffer(x):
    agg = torch.zeros(6, 4, dtype=x.dtype)
    agg.index_add_(0, DST, x[SRC].sin())
    return agg


def a_scalar_buffer(x):
    total = torch.zeros((), dtype=x.dtype)
    total.add_(x.sum())
    total.mul_(x[0, 0].exp())
    return total


@pytest.mark.parametrize("api", ["vjp", "jvp", "jacrev", "jacfwd", "vjp has_aux", "grad",
                                 "grad has_aux", "hessian"])
def test_the_buffer_itself_as_an_output_matches_torch_func(api):
    def run(lib):
        if api == "vjp":
            out, pull = lib.vjp(returns_the_buffer, X)
            return out, pull(T)
        if api == "jvp":
            return lib.jvp(returns_the_buffer, (X,), (T,))
        if api == "jacrev":
            return lib.jacrev(returns_the_buffer)(X)
        if api == "jacfwd":
            return lib.jacfwd(returns_the_buffer)(X)
        if api == "vjp has_aux":
            out, pull, aux = lib.vjp(lambda x: (x.sum(), returns_the_buffer(x)), X,
                                     has_aux=True)
            return out, pull(torch.ones(())), aux
        if api == "grad":
            return lib.grad(a_scalar_buffer)(X)
        if api == "grad has_aux":
            return lib.grad(lambda x: (a_scalar_buffer(x), returns_the_buffer(x)),
                            has_aux=True)(X)
        return lib.hessian(a_scalar_buffer)(X)

    for a, e in zip(torch.utils._pytree.tree_leaves(run(tl)),
                    torch.utils._pytree.tree_leaves(run(tf))):
        assert type(a) is torch.Tensor
        torch.testing.assert_close(a, e)


def test_a_tensor_of_an_enclosing_vmap_read_through_a_view_of_another_dtype_is_refused():
    def f(x, y):
        z = torch.complex(y, y)
        parts = torch.view_as_real(z)  # an as_strided view of z could not stand for it
        z[0] = x[0] * 2
        return (parts * x[:, None]).sum()

    with pytest.raises(CapturedMutationError, match="another dtype"):
        tl.vmap(tl.grad(f))(X[:, :3], T[:, :3])
