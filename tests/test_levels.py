"""The level machinery: classes per invocation, subclass-first order, escapes, threads, memory."""

import asyncio
import contextvars
import gc
import sys
import threading
import tracemalloc

import pytest
import torch
import torch.func
from torch.func import jvp as func_jvp
from torch.func import vmap as func_vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import torchlevels
from torchlevels import EscapedTensorError, LevelTensor, UnrelatedLevelsError, vmap


def test_seed_imperative_example_shapes_and_subclassing():
    xs, ys = torch.randn(10, 2), torch.randn(15, 2)
    with vmap() as B0, vmap() as B1:
        x = B0(xs)
        y = B1(ys)
        z = x + y
        assert issubclass(B1, B0) and B1 is not B0
        assert type(x) is B0 and type(y) is B1 and type(z) is B1
        out = B0.unwrap(B1.unwrap(z))
    assert out.shape == (10, 15, 2)
    torch.testing.assert_close(out, xs[:, None, :] + ys[None, :, :])


def test_each_invocation_gets_a_fresh_class():
    seen = []
    vmap(lambda x: seen.append(type(x)) or x)(torch.randn(3))
    vmap(lambda x: seen.append(type(x)) or x)(torch.randn(3))
    assert seen[0] is not seen[1]
    assert not issubclass(seen[0], seen[1]) and not issubclass(seen[1], seen[0])


def test_nested_vmap_classes_form_a_chain():
    classes = []

    def inner(x):
        classes.append(type(x))
        return x * 2

    vmap(lambda x: vmap(inner)(x))(torch.randn(2, 3))
    inner_cls = classes[0]
    assert issubclass(inner_cls, LevelTensor)
    assert issubclass(inner_cls.__base__, LevelTensor) and inner_cls.__base__ is not LevelTensor


def test_unwrap_out_dim_and_dim_argument():
    xs = torch.randn(4, 5, 6)
    with vmap() as B:
        x = B(xs, 1)
        assert x.shape == (4, 6)
        out = B.unwrap(x * 2, out_dim=2)
    torch.testing.assert_close(out, (xs * 2).movedim(1, 2))


def test_seed_escape_example_errors():
    box = []

    def write(x):
        box.append(x)
        return x

    def read(y):
        return box[0] + y

    vmap(write)(torch.randn(10, 2))
    with pytest.raises(EscapedTensorError, match="escaped") as info:
        vmap(read)(torch.randn(20, 10, 2))
    assert "vmap" in str(info.value) and "test_levels.py" in str(info.value)


def test_escaped_tensor_used_outside_any_level_errors():
    box = []
    vmap(lambda x: box.append(x) or x)(torch.randn(3, 2))
    with pytest.raises(EscapedTensorError, match="aten.mul.Tensor"):
        box[0] * 2
    assert "escaped" in repr(box[0])


def test_escape_from_inner_level_into_outer_errors():
    box = []

    def f(x):
        vmap(lambda y: box.append(y) or y)(x.unsqueeze(0).expand(3, *x.shape))
        return x + box[0]

    with pytest.raises(EscapedTensorError):
        vmap(f)(torch.randn(4, 2))


def test_unrelated_live_levels_error():
    outside = contextvars.copy_context()  # a context in which A is not live
    xs, ys = torch.randn(3, 2), torch.randn(4, 2)
    with vmap() as A:
        a = A(xs)
        other = vmap()
        B = outside.run(other.__enter__)
        assert not issubclass(B, A) and not issubclass(A, B)
        b = B(ys)
        with pytest.raises(UnrelatedLevelsError, match="unrelated"):
            a + b
        outside.run(other.__exit__, None, None, None)


class LoggingTensor(torch.Tensor):
    """A user's wrapper subclass that logs every op, unaware of torchlevels."""

    log: list = []

    @staticmethod
    def __new__(cls, elem):
        out = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                  dtype=elem.dtype, device=elem.device)
        out.elem = elem
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.log.append((str(func), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        unwrap = lambda t: t.elem if isinstance(t, LoggingTensor) else t
        wrap = lambda t: LoggingTensor(t) if isinstance(t, torch.Tensor) else t
        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def test_foreign_subclass_inside_a_level_sees_physical_ops():
    LoggingTensor.log.clear()
    xs = torch.randn(5, 3)
    out = vmap(lambda x: (x * 2).sum())(LoggingTensor(xs))
    assert isinstance(out, LoggingTensor)
    torch.testing.assert_close(out.elem, (xs * 2).sum(1))
    assert ("aten.mul.Tensor", [(5, 3)]) in LoggingTensor.log


def test_foreign_subclass_wrapping_a_batched_tensor():
    LoggingTensor.log.clear()
    xs = torch.randn(5, 3)

    def f(x):
        logged = LoggingTensor(x)  # foreign wrapper around our batched tensor
        return (logged.exp() + 1).elem

    torch.testing.assert_close(vmap(f)(xs), xs.exp() + 1)
    assert ("aten.exp.default", [(3,)]) in LoggingTensor.log  # logged at logical shape


def test_foreign_subclass_mixed_with_batched_returns_not_implemented_first():
    xs, w = torch.randn(5, 3), torch.randn(3)

    def f(x):
        return (x + LoggingTensor(w)).elem

    torch.testing.assert_close(vmap(f)(xs), xs + w)


@pytest.mark.parametrize("transform", ["grad", "vjp", "vmap(grad)"])
def test_foreign_subclass_as_a_transform_input(transform):
    """A grad level's shortcuts find the foreign tensor inside their own: they give the
    call to it, as torch.func does."""
    xs = torch.randn(4, 3)

    def loss(x):
        return (x.sin() * 2 + x).sum()

    def run(lib):
        calls = {"grad": lambda x: lib.grad(loss)(x[0]),
                 "vjp": lambda x: lib.vjp(loss, x)[1](torch.tensor(1.0))[0],
                 "vmap(grad)": lambda x: lib.vmap(lib.grad(loss))(x)}
        out = calls[transform](LoggingTensor(xs))
        assert isinstance(out, LoggingTensor)
        return out.elem

    torch.testing.assert_close(run(torchlevels), run(torch.func))


def _run_on_logged(lib, transform, x, closure):
    """``transform`` of a function of ``x`` that also reads ``closure`` (a tensor)."""
    ones = torch.ones_like(x)
    f = lambda y: y.sin() * closure + y  # noqa: E731
    s = lambda y: f(y).sum()  # noqa: E731
    calls = {
        "vmap": lambda: lib.vmap(f)(torch.stack([x, 2 * x])),
        "jvp": lambda: lib.jvp(f, (x,), (ones,)),
        "vmap(jvp)": lambda: lib.vmap(lambda y: lib.jvp(f, (y,), (y,)))(torch.stack([x, -x])),
        "jacrev": lambda: lib.jacrev(f)(x),
        "jacfwd": lambda: lib.jacfwd(f)(x),
        "hessian": lambda: lib.hessian(s)(x),
        "vmap(jacrev)": lambda: lib.vmap(lib.jacrev(f))(torch.stack([x, -x])),
        "grad": lambda: lib.grad(s)(x),
        "vjp": lambda: lib.vjp(f, x)[1](ones),
    }
    return calls[transform]()


def _plain(t):
    return t.elem if isinstance(t, LoggingTensor) else t


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian", "vmap(jacrev)"])
def test_foreign_subclass_input_to_jacobians(transform):
    """The basis of cotangents (jacrev) is plain when the outputs are foreign below the
    levels, so the foreign tensor stays innermost, as under torch.func; vmap unwraps its
    results out of a foreign wrapper (jacfwd)."""
    x, w = torch.randn(3), torch.randn(3)
    ours = _run_on_logged(torchlevels, transform, LoggingTensor(x), w)
    theirs = _run_on_logged(torch.func, transform, LoggingTensor(x), w)
    assert type(ours) is type(theirs) is LoggingTensor
    torch.testing.assert_close(ours.elem, theirs.elem)


@pytest.mark.parametrize("transform", ["vmap", "jvp", "vmap(jvp)", "jacfwd"])
def test_foreign_subclass_from_a_closure_wraps_the_results(transform):
    """``y * LoggingTensor(w)`` lets the logging tensor go first, so it wraps the level's
    tensor: vmap and jvp unwrap their results inside it (an op it passes on)."""
    x, w = torch.randn(3), torch.randn(3)
    ours = _run_on_logged(torchlevels, transform, x, LoggingTensor(w))
    theirs = _run_on_logged(torch.func, transform, x, LoggingTensor(w))
    assert tree_map(type, ours) == tree_map(type, theirs)
    torch.testing.assert_close(tree_map(_plain, ours), tree_map(_plain, theirs))


@pytest.mark.parametrize("tool", ["count_flops", "log_ops"])
def test_foreign_subclass_from_a_closure_under_a_tool(tool):
    x, w = torch.randn(3), torch.randn(3)
    f = lambda y: y.sin() * LoggingTensor(w) + y  # noqa: E731
    out = getattr(torchlevels, tool)(f)(x)
    assert type(out) is LoggingTensor and type(out.elem) is torch.Tensor  # not the tool's
    torch.testing.assert_close(out.elem, f(x).elem)


class _Picky(LoggingTensor):
    """A subclass that refuses the ops it does not know, torchlevels' own among them."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            raise NotImplementedError(f"_Picky: no rule for {func}")
        unwrap = lambda t: t.elem if isinstance(t, _Picky) else t  # noqa: E731
        wrap = lambda t: _Picky(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return tree_map(wrap, func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {})))


def test_a_subclass_refusing_unknown_ops_is_still_an_unbatched_result():
    xs, w = torch.randn(5, 3), torch.randn(3)
    ours, theirs = vmap(lambda x: _Picky(w))(xs), func_vmap(lambda x: _Picky(w))(xs)
    assert type(ours) is _Picky and type(ours.elem) is torch.Tensor
    torch.testing.assert_close(ours.elem, theirs.elem)


def test_two_tensor_from_a_closure_under_vmap():
    from torch.testing._internal.two_tensor import TwoTensor

    xs, w = torch.randn(4, 3), torch.randn(3)
    pair = TwoTensor(w, 2 * w)
    ours, theirs = vmap(lambda x: x * pair)(xs), func_vmap(lambda x: x * pair)(xs)
    assert type(ours) is TwoTensor
    torch.testing.assert_close((ours.a, ours.b), (theirs.a, theirs.b))


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "hessian"])
def test_foreign_subclass_from_a_closure_under_reverse_mode_is_refused(transform):
    """Its ops on the level's tensors ran inside it, so the level recorded them on the
    tensors it wraps and the wrapper has no history: a clear error where torch.func works
    (this gave zero gradients before)."""
    x, w = torch.randn(3), torch.randn(3)
    with pytest.raises(NotImplementedError, match="LoggingTensor wrapping a tensor of .*closure"):
        _run_on_logged(torchlevels, transform, x, LoggingTensor(w))
    _run_on_logged(torch.func, transform, x, LoggingTensor(w))  # which works


class Tagged(torch.Tensor):  # torch.Tensor's own __torch_function__, as a bare subclass has
    pass


@pytest.mark.parametrize("transform", ["vmap", "grad", "vmap(grad)", "jvp", "jacfwd", "hessian"])
def test_a_bare_subclass_counts_as_a_plain_tensor(transform):
    """Its __torch_function__ would make the level's result a Tagged, which a level's
    tensor cannot become: as under torch.func, it counts as a plain tensor."""
    tag = torch.randn(5).as_subclass(Tagged)
    xs = torch.randn(3, 5)

    def run(lib):
        loss = lambda x: (torch.mul(x, tag) + tag.exp() * x).sin().sum()  # noqa: E731
        if transform == "vmap":
            return lib.vmap(lambda x: torch.mul(x, tag) + tag)(xs)
        if transform == "grad":
            return lib.grad(loss)(xs[0])
        if transform == "jvp":
            return lib.jvp(loss, (xs[0],), (xs[1],))[1]
        if transform in ("jacfwd", "hessian"):
            return getattr(lib, transform)(loss)(xs[0])
        return lib.vmap(lib.grad(loss))(xs)

    ours, theirs = run(torchlevels), run(torch.func)
    torch.testing.assert_close(ours.as_subclass(torch.Tensor), theirs.as_subclass(torch.Tensor))



class _Matmuls(TorchDispatchMode):
    """A user's dispatch mode: counts the plain matmuls, and if ``decline``, lets tensor
    subclasses handle their ops first, as a mode composing with subclasses does."""

    def __init__(self, decline: bool):
        super().__init__()
        self.decline, self.matmuls = decline, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.decline and any(t is not torch.Tensor for t in types):
            return NotImplemented
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.mv.default,
                                 torch.ops.aten.bmm.default, torch.ops.aten.dot.default)
        return func(*args, **(kwargs or {}))


_UNDER_A_MODE = {
    "vmap": lambda lib, f, x: lib.vmap(f)(x),
    "grad": lambda lib, f, x: lib.grad(lambda x: f(x).sum())(x[0]),
    "vmap(grad)": lambda lib, f, x: lib.vmap(lib.grad(lambda x: f(x).sum()))(x),
    "jvp": lambda lib, f, x: lib.jvp(f, (x,), (x.cos(),)),
    "jacfwd": lambda lib, f, x: lib.jacfwd(f)(x[0]),
    "jacrev": lambda lib, f, x: lib.jacrev(f)(x[0]),
    "vjp": lambda lib, f, x: lib.vjp(f, x)[1](x.cos()),
}


@pytest.mark.parametrize("transform", list(_UNDER_A_MODE))
@pytest.mark.parametrize("decline", [False, True], ids=["takes every op", "declines subclasses"])
def test_transforms_run_under_a_users_dispatch_mode(transform, decline):
    """A mode around a transform gets the transform's results (forward AD under a mode that
    passes the op on had hit an internal assert in PyTorch) and sees the plain ops under
    every level, as it does around torch.func, whether it declines subclasses itself or
    the transform makes it decline the levels' tensors."""
    w = torch.randn(4, 4)
    f = lambda x: (x @ w).sin()  # noqa: E731
    x = torch.randn(3, 4)
    run = _UNDER_A_MODE[transform]
    with _Matmuls(decline) as ours:
        out = run(torchlevels, f, x)
    with _Matmuls(decline) as theirs:
        expected = run(torch.func, f, x)
    torch.testing.assert_close(out, expected)
    assert ours.matmuls == theirs.matmuls > 0

def test_memory_flat_over_10000_calls():
    f = vmap(lambda x: (x * 2 + 1).sum())
    x = torch.randn(4, 3)
    for _ in range(200):
        f(x)
    gc.collect()
    classes = set(LevelTensor.__subclasses__())  # an earlier test's failed backward may hold one
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(10_000):
        f(x)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 256 * 1024, f"memory grew by {after - before} bytes"
    assert set(LevelTensor.__subclasses__()) <= classes  # no level class kept alive


def test_threads_run_vmap_concurrently():
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def work(name, xs, ys):
        try:
            with vmap() as B0:
                x = B0(xs)
                barrier.wait(timeout=10)  # both threads now have a live level
                with vmap() as B1:
                    out = B0.unwrap(B1.unwrap(x * B1(ys)))
            results[name] = (out, func_vmap(func_vmap(torch.mul, (None, 0)), (0, None))(xs, ys))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=("a", torch.randn(3, 2), torch.randn(4, 2))),
        threading.Thread(target=work, args=("b", torch.randn(5, 2), torch.randn(6, 2))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for out, expected in results.values():
        torch.testing.assert_close(out, expected)
    assert set(results) == {"a", "b"}


def test_a_user_levels_escape_names_where_it_was_entered():
    from torchlevels import ForwardingLevel, enter_level

    class Named(ForwardingLevel):
        def __init__(self):
            super().__init__()  # not this line

    level, kept = Named(), []
    with enter_level(level, "N") as N:  # this one
        kept.append(N(torch.ones(2)))
    line = sys._getframe().f_lineno - 2
    with pytest.raises(EscapedTensorError, match=rf"test_levels.py:{line}\)"):
        kept[0] + 1


def test_threads_run_forward_mode_concurrently():
    # PyTorch has one forward-AD level per process: the threads take turns holding it
    # (they used or deleted each other's level: wrong tangents, crashes)
    x, results = torch.randn(4, 8), {}
    f = lambda a: (a.sin() * a).tanh()  # noqa: E731

    def work(k):
        results[k] = [torchlevels.jvp(f, (x[k],), (torch.ones(8),))[1] for _ in range(50)]
        results[k].append(torchlevels.jacfwd(f)(x[k]).diagonal())

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        expected = func_jvp(f, (x[k],), (torch.ones(8),))[1]
        for got in results[k]:
            torch.testing.assert_close(got, expected)


def test_switches_levels_change_are_restored_by_the_last_thread_out():
    both_inside, release = threading.Barrier(2), threading.Event()
    shared = torch.backends.mha.get_fastpath_enabled(), torch._C._get_mkldnn_enabled()
    lstm = torch.nn.LSTM(3, 4)

    def work(first):
        def f(x):
            both_inside.wait(timeout=10)
            if not first:
                release.wait(timeout=10)  # the second thread leaves last
            return lstm(x)[0].sum()
        torchlevels.grad(f)(torch.randn(2, 1, 3))
        if first:
            release.set()

    threads = [threading.Thread(target=work, args=(k == 0,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (torch.backends.mha.get_fastpath_enabled(), torch._C._get_mkldnn_enabled()) == shared


_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


def test_with_blocks_of_asyncio_tasks_keep_their_levels():
    async def task(start, inside):
        await asyncio.sleep(start)
        with vmap(randomness="different") as B:
            b = B(torch.zeros(4, 3))
            await asyncio.sleep(inside)  # the other task enters and leaves meanwhile
            return B.unwrap(b + torch.randn(3))

    async def both():
        return await asyncio.gather(task(0, 0.05), task(0.01, 0.1))

    for rows in asyncio.run(both()):  # each example drew its own numbers
        assert len({tuple(r.tolist()) for r in rows}) == 4
    assert not torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)


def test_levels_exited_out_of_order_leave_no_level_behind():
    def batches(x):  # a generator working inside a vmap block
        with vmap() as B:
            yield B.unwrap(B(x).sin())

    first, second = batches(torch.ones(3, 2)), batches(torch.ones(5, 2))
    next(first), next(second)
    first.close()  # not the innermost: the second's level is still live
    second.close()
    assert torchlevels._level.innermost() is None
    torch.randn(2)  # no level's randomness="error" applies any more
    assert not torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)
    assert torchlevels.grad(lambda t: t.sin().sum())(torch.ones(3)).grad_fn is None


class Logged(torch.Tensor):  # a __torch_function__ that defers to torch.Tensor's
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(func)
        return super().__torch_function__(func, types, args, kwargs)


def test_a_subclass_whose_torch_function_converts_results_gets_a_clear_error():
    """torch.Tensor.__torch_function__ makes each result a Logged, which a level's tensor
    cannot become: the error names the class and what to do, rather than PyTorch's
    "already associated to a python object"."""
    w = torch.randn(3).as_subclass(Logged)
    with pytest.raises(RuntimeError, match="Logged.__torch_function__ made the result of"):
        vmap(lambda x: x * w)(torch.randn(4, 3))


def test_unwrapping_an_unbatched_tensor_before_the_batch_size_is_known_raises():
    with vmap() as B0, vmap() as B1:
        with pytest.raises(ValueError, match="no batch size to expand it to yet"):
            B0.unwrap(torch.ones(2))
        assert B0.unwrap(torch.ones(2), out_dim=None).shape == (2,)
        x = B0(torch.ones(3, 2))
        with pytest.raises(ValueError, match=r"Wrap one first"):
            B1.unwrap(x)
        assert B0.unwrap(torch.ones(2)).shape == (3, 2)


def test_unwrapping_an_outer_level_before_an_inner_live_one_raises():
    with vmap() as B0, vmap() as B1:
        z = B0(torch.ones(10, 2)) + B1(torch.ones(15, 2))
        with pytest.raises(ValueError, match="unwrap it with that level first"):
            B0.unwrap(z)
        assert B0.unwrap(B1.unwrap(z)).shape == (10, 15, 2)


def test_a_level_makes_no_tensors_after_it_exited():
    with vmap() as B:
        pass
    with pytest.raises(EscapedTensorError, match="has exited, so it makes no more tensors"):
        B(torch.ones(3, 2))


@pytest.mark.parametrize("chunk_size", [1.5, "2", 0])
def test_chunk_size_must_be_a_positive_int(chunk_size):
    with pytest.raises(ValueError, match=r"None or an int greater than 0 \(got"):
        vmap(torch.sin, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"None or an int greater than 0 \(got"):
        torchlevels.jacrev(torch.sin, chunk_size=chunk_size)(torch.randn(3))
