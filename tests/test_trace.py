"""trace and compile: graphs of plain aten ops through every level, replayed equal to
eager torch.func on the autodiff workloads."""

import io
import warnings

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from test_compositions import FUNCTIONS, PAIRS, TRANSFORMS, TRIPLES, _chain_id, compose, make_input
from test_workloads import (
    HVP,
    assert_tree_close,
    configurations,
    detached_params,
    ensemble_step,
    lennard_jones_energy,
    make_cnn,
    make_mlp,
    maml_meta_grad,
    maml_setup,
    per_sample_grads,
    smooth_loss,
)

import torchlevels as tl


def call_functions(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_trace_of_vmap_grad_is_plain_aten_ops_and_reproduces_the_outputs():
    loss = lambda w, x: (x @ w).tanh().sum()
    w, xs = torch.randn(4, 3), torch.randn(5, 2, 4)
    gm = tl.trace(tl.vmap(tl.grad(loss), in_dims=(None, 0)))(w, xs)
    assert isinstance(gm, torch.fx.GraphModule)
    assert all(isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"
               for t in call_functions(gm))
    assert torch.ops.aten.tanh_backward.default in call_functions(gm)  # the backward is in it
    w2, xs2 = torch.randn(4, 3), torch.randn(5, 2, 4)  # a graph is not tied to its inputs
    (out,) = gm(w2, xs2)
    torch.testing.assert_close(out, tf.vmap(tf.grad(loss), in_dims=(None, 0))(w2, xs2))


def test_trace_through_jvp_hessian_and_a_user_level():
    x = torch.randn(5, dtype=torch.float64)
    v = torch.randn(5, dtype=torch.float64)
    gm = tl.trace(lambda x, v: tl.jvp(smooth_loss, (x,), (v,)))(x, v)
    assert_tree_close(tuple(gm(x, v)), tf.jvp(smooth_loss, (x,), (v,)))
    gm = tl.trace(tl.jacfwd(tl.jacrev(smooth_loss)))(x)
    torch.testing.assert_close(gm(x)[0], tf.hessian(smooth_loss)(x))
    gm = tl.trace(tl.hessian(smooth_loss))(x)
    torch.testing.assert_close(gm(x)[0], tf.hessian(smooth_loss)(x))
    log = io.StringIO()
    gm = tl.trace(tl.log_ops(tl.vmap(torch.sin), file=log))(torch.randn(3, 2))
    assert call_functions(gm) == [torch.ops.aten.sin.default]
    device = "" if torch.get_default_device().type == "cpu" else "@cuda:0"
    assert log.getvalue().startswith(f"aten.sin.default(f32[3, 2]{device})")


def test_trace_of_jvp_of_grad():
    # make_fx runs ones_like (autograd.grad's seed) through its Python dispatcher, whose
    # TLS snapshot lies below autograd: the jvp level must let autograd back in
    x, v = torch.randn(5), torch.randn(5)
    gm = tl.trace(lambda x, v: tl.jvp(tl.grad(smooth_loss), (x,), (v,)))(x, v)
    assert_tree_close(tuple(gm(x, v)), tf.jvp(tf.grad(smooth_loss), (x,), (v,)))
    assert torch.ops.aten.alias.default not in call_functions(gm)  # read through
    gm = tl.trace(lambda x, v: tl.jvp(lambda x: torch.ones_like(x) * x.sin(), (x,), (v,)))(x, v)
    assert_tree_close(tuple(gm(x, v)), tf.jvp(lambda x: torch.ones_like(x) * x.sin(), (x,), (v,)))


@pytest.mark.parametrize("fname", list(FUNCTIONS))
@pytest.mark.parametrize("chain", [(t,) for t in TRANSFORMS] + PAIRS + TRIPLES, ids=_chain_id)
def test_trace_of_every_composition_replays_torch_func_on_new_inputs(chain, fname):
    f = FUNCTIONS[fname]
    x = make_input(chain)
    try:
        compose(tf, chain, f)(x)
    except Exception as e:
        pytest.skip(f"torch.func rejects this composition: {str(e)[:200]}")
    gm = tl.trace(compose(tl, chain, f))(x)
    for new in (x * 1.3 + 0.1, -x):  # a graph stands for every input of the signature
        torch.testing.assert_close(gm(new)[0], compose(tf, chain, f)(new))


def test_an_alias_written_in_place_stays_in_the_graph():
    def f(x):
        a = torch.ops.aten.alias(x)
        a.t_()  # changes the alias's shape alone
        return a + 1, x * 2

    x = torch.randn(2, 3)
    gm = tl.trace(f)(x)
    assert torch.ops.aten.alias.default in call_functions(gm)
    assert_tree_close(tuple(gm(x)), f(x))


def test_trace_must_be_outside_every_transform():
    with pytest.raises(ValueError, match="trace.vmap.f.. rather than vmap.trace.f.."):
        tl.vmap(tl.trace(torch.sin))(torch.randn(3, 2))


def test_trace_and_compile_refuse_data_dependent_control_flow():
    def branchy(x):
        return x * 2 if x.sum() > 0 else -x

    with pytest.raises(tl.DataDependentError, match="branchy reads a tensor's value"):
        tl.trace(branchy)(torch.randn(3))
    with pytest.raises(tl.DataDependentError, match="torch.where"):
        tl.compile(tl.grad(lambda x: branchy(x).sum()))(torch.randn(3))
    with pytest.raises(tl.DataDependentError, match="reads a tensor.s value"):
        tl.compile(lambda x: x + 1 if torch.equal(x, x) else x)(torch.randn(3))


def test_a_data_dependent_read_is_reported_at_the_users_line():
    def branchy(x):
        return x * 2 if x.sum() > 0 else -x  # the read

    def listed(x):
        return x * len(x.tolist())  # the read

    for f in (branchy, listed):
        with pytest.raises(tl.DataDependentError) as error:
            tl.trace(tl.vmap(tl.grad(lambda x, f=f: f(x).sum())))(torch.randn(2, 3))
        line = f.__code__.co_firstlineno + 1
        assert f"at {__file__}:{line} (`return x * " in str(error.value)


def test_a_distributions_argument_check_is_named_with_its_fix():
    def log_likelihood(mu, x):
        normal = torch.distributions.Normal(mu, mu.exp(), validate_args=True)
        return normal.log_prob(x).sum()  # (a test may have turned the default off)

    with pytest.raises(tl.DataDependentError, match="validate_args=False"):
        tl.compile(tl.vmap(tl.grad(log_likelihood)))(torch.randn(4, 3), torch.randn(4, 3))
    no_check = tl.compile(tl.vmap(tl.grad(lambda mu, x: torch.distributions.Normal(
        mu, mu.exp(), validate_args=False).log_prob(x).sum())))
    mu, x = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(no_check(mu, x), tf.vmap(tf.grad(log_likelihood))(mu, x))


# -- compile: equal to eager on the autodiff workloads ----------------------------------


@pytest.mark.parametrize("make", [make_mlp, make_cnn], ids=["mlp", "cnn"])
def test_compiled_per_sample_grads_equal_torch_func(make):
    model = make()
    params = detached_params(model)
    shape = (8, 10) if make is make_mlp else (8, 1, 12, 12)
    xs, ys = torch.randn(shape), torch.randint(0, 3, (8,))
    compiled = tl.compile(lambda p, x, y: per_sample_grads(tl, model, p, {}, x, y))
    for _ in range(2):  # the trace, then a replay
        assert_tree_close(compiled(params, xs, ys), per_sample_grads(tf, model, params, {}, xs, ys))
    assert len(compiled.cache) == 1


def test_compiled_ensemble_hvp_maml_and_forces_equal_torch_func():
    models = [make_mlp() for _ in range(3)]
    params, buffers = tf.stack_module_state(models)
    base = make_mlp().to("meta")
    xs, ys = torch.randn(3, 6, 10), torch.randint(0, 5, (3, 6))
    assert_tree_close(tl.compile(ensemble_step(tl, base))(params, buffers, xs, ys),
                      ensemble_step(tf, base)(params, buffers, xs, ys))

    x, v = torch.randn(8), torch.randn(8)
    for hvp in HVP.values():
        compiled = tl.compile(lambda x, v, hvp=hvp: hvp(tl, smooth_loss, x, v))
        assert_tree_close(compiled(x, v), hvp(tf, smooth_loss, x, v))

    net, p, tasks = maml_setup()
    compiled = tl.compile(lambda p, tasks: maml_meta_grad(tl, net, p, tasks))
    assert_tree_close(compiled(p, tasks), maml_meta_grad(tf, net, p, tasks))

    pos = configurations()
    compiled = tl.compile(tl.vmap(tl.jacrev(lennard_jones_energy)))
    assert_tree_close(compiled(pos), tf.vmap(tf.jacrev(lennard_jones_energy))(pos))


def test_compile_traces_once_per_signature():
    traces = []

    def f(x, scale):
        traces.append(1)
        return tl.vmap(tl.grad(lambda x: (x.sin() * scale).sum()))(x)

    compiled = tl.compile(f)
    x = torch.randn(4, 3)
    for _ in range(3):
        torch.testing.assert_close(compiled(x, 2.0), 2 * x.cos())
    assert len(traces) == 1
    compiled(torch.randn(5, 3), 2.0)  # a new shape
    compiled(x.double(), 2.0)  # a new dtype
    torch.testing.assert_close(compiled(x, 3.0), 3 * x.cos())  # a new non-tensor value
    assert len(traces) == len(compiled.cache) == 4


def test_compile_traces_again_when_a_module_switches_between_train_and_eval():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Tanh())
    params = {k: v.detach() for k, v in model.named_parameters()}

    def grads(lib):  # the module is captured, not an argument
        return lib.grad(lambda p, x: lib.functional_call(model, p, (x,)).square().sum())

    compiled = tl.compile(grads(tl))
    x = torch.randn(8, 4)
    for mode in ["train", "eval", "train", "eval"]:
        getattr(model, mode)()
        compiled(params, x)  # traces the first time in each mode (drawing numbers too)
        torch.manual_seed(1)
        got = compiled(params, x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, grads(tf)(params, x))
    assert len(compiled.cache) == 1 and len(next(iter(compiled.cache.values()))) == 2


def test_compile_writes_in_place_once_per_call_the_first_call_too():
    def writes(buffer, x):  # into a captured tensor, an argument, and one example each
        buffer.add_(x.sum(0))
        x.mul_(2)
        return tl.vmap(lambda row: row.mul_(3))(x)

    buffers, xs = [torch.zeros(3), torch.zeros(3)], [torch.ones(2, 3), torch.ones(2, 3)]
    compiled = tl.compile(lambda x: writes(buffers[0], x))
    for _ in range(3):
        out = compiled(xs[0])
        expected = writes(buffers[1], xs[1])
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(xs[0], xs[1])
        torch.testing.assert_close(buffers[0], buffers[1])


def test_compile_keys_nan_arguments_as_one_value_and_refuses_unhashable_ones():
    traces = []

    def f(x, fill):
        traces.append(1)
        return tl.vmap(lambda x: x.clamp(max=0) + fill)(x)

    compiled = tl.compile(f)
    x = torch.randn(3, 2)
    for _ in range(3):  # a new NaN object each time: one trace, not one per call
        torch.testing.assert_close(compiled(x, float("nan")), x.clamp(max=0) + float("nan"),
                                   equal_nan=True)
    assert len(traces) == 1
    with pytest.raises(TypeError, match="neither a tensor nor hashable"):
        compiled(x, {1.0})


def test_compile_keys_signed_zeros_and_the_autocast_state():
    # 0.0 == -0.0 (and they hash alike), but the traces differ; autocast sets ops' dtypes
    compiled = tl.compile(lambda x, s: 1 / (x * s))
    x = torch.ones(2)
    compiled(x, 0.0)
    torch.testing.assert_close(compiled(x, -0.0), 1 / (x * -0.0))
    w = torch.randn(3, 3)
    f = tl.vmap(lambda r: r @ w)
    compiled, xs = tl.compile(f), torch.randn(4, 3)
    with torch.autocast(torch.get_default_device().type, dtype=torch.bfloat16):
        assert compiled(xs).dtype == torch.bfloat16
    assert compiled(xs).dtype == f(xs).dtype == torch.float32


def test_compile_replays_random_ops_as_eager_draws_them():
    f = tl.vmap(lambda x: F.dropout(x, 0.5), randomness="different")
    compiled = tl.compile(f)
    x = torch.ones(4, 64)
    compiled(x)  # the trace
    torch.manual_seed(0)
    replayed = compiled(x)
    torch.manual_seed(0)
    torch.testing.assert_close(replayed, f(x))
    assert not torch.equal(compiled(x), compiled(x))  # fresh numbers on every replay


def test_compiled_function_is_differentiable_and_sees_captured_tensors_change():
    w = torch.randn(3, 3)
    compiled = tl.compile(lambda x: (x @ w).sin())
    x = torch.randn(2, 3, requires_grad=True)
    compiled(x).sum().backward()
    expected = torch.autograd.grad((x @ w).sin().sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)
    w.mul_(2)  # the graph holds w itself, not a copy
    torch.testing.assert_close(compiled(x.detach()), (x.detach() @ w).sin())


def test_compile_with_inductor_equals_eager():
    # vmap(hessian): torch.compile over torch.func's own vmap(hessian) fails on torch 2.13
    pytest.importorskip("torch._inductor")
    a = torch.randn(8, 8, dtype=torch.float64)
    f = lambda x: x.tanh() @ (a @ x.sin()) + x.pow(2).sum()
    xs = torch.randn(4, 8, dtype=torch.float64)
    compiled = tl.compile(lambda xs: (tl.vmap(tl.hessian(f))(xs), 1.5), backend="inductor")
    for _ in range(2):  # (a number among the outputs, which inductor does not return)
        torch.testing.assert_close(compiled(xs), (tf.vmap(tf.hessian(f))(xs), 1.5))


def test_trace_and_compile_refuse_values_read_with_no_aten_op():
    # .tolist() and .numpy() read memory directly: make_fx saw no op and baked the values in
    for reads in (lambda x: x * x.tolist()[0], lambda x: x * float(x.numpy()[0])):
        with pytest.raises(tl.DataDependentError, match="reads a tensor.s value"):
            tl.trace(reads)(torch.randn(3))
        with pytest.raises(tl.DataDependentError, match="reads a tensor.s value"):
            tl.compile(reads)(torch.randn(3))


def test_compile_traces_again_when_one_tensor_is_passed_for_two_arguments():
    def f(a, b):  # make_fx traces f(x, x) with one input, read for both arguments
        a.add_(1)
        return a * 2 + b

    compiled = tl.compile(f)
    for same in (True, False, True):
        x, y = torch.randn(3), torch.randn(3)
        x_eager, y_eager = x.clone(), y.clone()
        if same:
            torch.testing.assert_close(compiled(x, x), f(x_eager, x_eager))
        else:
            torch.testing.assert_close(compiled(x, y), f(x_eager, y_eager))
        torch.testing.assert_close(x, x_eager)
    assert len(compiled.cache) == 2


def test_compile_traces_again_for_a_storage_offset_that_an_as_strided_view_holds():
    # vmap's as_strided rule passes each example's storage offset, which the graph holds
    f = tl.vmap(lambda x: x.as_strided((2,), (1,)))
    compiled = tl.compile(f)
    base = torch.arange(12.0).reshape(2, 6)
    for start in (0, 3, 0):
        x = base[:, start:start + 3]
        torch.testing.assert_close(compiled(x), tf.vmap(lambda x: x.as_strided((2,), (1,)))(x))
    assert len(next(iter(compiled.cache.values()))) == 2
    plain = tl.compile(lambda x: x.sin())  # no as_strided: one trace for every offset
    for start in (0, 3):
        plain(base[:, start:start + 3])
    assert len(next(iter(plain.cache.values()))) == 1


def test_compile_keeps_at_most_cache_size_limit_traces_then_runs_eagerly():
    traces = []

    def f(x):
        traces.append(1)
        return tl.vmap(tl.grad(lambda x: x.sin().sum()))(x)

    compiled = tl.compile(f, cache_size_limit=3)
    for n in (2, 3, 4):
        compiled(torch.randn(n, 3))
    assert len(traces) == 3
    with pytest.warns(UserWarning, match="cache_size_limit"):
        x = torch.randn(5, 3)
        torch.testing.assert_close(compiled(x), tf.vmap(tf.grad(lambda x: x.sin().sum()))(x))
    assert len(traces) == 4 and sum(map(len, compiled.cache.values())) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        compiled(torch.randn(6, 3))  # eager again
        compiled(torch.randn(2, 3))  # a kept signature still replays
    assert len(traces) == 5


def test_compile_of_views_at_ever_new_offsets_stops_tracing_at_the_limit():
    # each offset is a new trace for a graph with an as_strided view: without a bound,
    # a loop over the rows of a buffer would keep one graph per row
    f = tl.vmap(lambda x: x.as_strided((2,), (1,)))
    compiled = tl.compile(f)
    base = torch.arange(60.0).reshape(2, 30)
    with pytest.warns(UserWarning, match="run eagerly"):
        for start in range(20):
            x = base[:, start:start + 3]
            torch.testing.assert_close(compiled(x), tf.vmap(lambda x: x.as_strided((2,), (1,)))(x))
    assert sum(map(len, compiled.cache.values())) == compiled.cache_size_limit == 8


def test_compile_drops_the_traces_of_modules_that_no_longer_exist():
    def f(model, x):
        return tl.vmap(model)(x)

    compiled = tl.compile(lambda x: f(models[-1], x), cache_size_limit=2)
    x = torch.randn(4, 3)
    models = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):  # each call a new module; the last one's trace is kept
            models[:] = [torch.nn.Linear(3, 2)]
            torch.testing.assert_close(compiled(x), tf.vmap(models[-1])(x))
    assert sum(map(len, compiled.cache.values())) == 1


def test_compile_refuses_a_cache_size_limit_that_is_not_a_positive_int():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="cache_size_limit must be a positive int"):
            tl.compile(lambda x: x, cache_size_limit=bad)


def _with_grad_mode_switched(x):
    with torch.no_grad():
        c = x * 2  # a constant for autograd
    torch.set_grad_enabled(False)
    d = x.exp()  # another one
    torch.set_grad_enabled(True)
    return (x * c * d).sum() + tl.grad(lambda z: (z.sin() * c).sum())(x).sum()


@pytest.mark.parametrize("backend", [None, "inductor"])
def test_compile_replays_the_grad_mode_each_op_ran_in(backend):
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    compiled = tl.compile(_with_grad_mode_switched, backend=backend)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(_with_grad_mode_switched(x), x)[0]
    for _ in range(3):  # the trace, then replays
        torch.testing.assert_close(torch.autograd.grad(compiled(x), x)[0], expected)
        assert torch.is_grad_enabled()
    with torch.no_grad():  # enable_grad inside f under no_grad outside, too
        def inside(x):
            with torch.enable_grad():
                return x.sin()

        compiled = tl.compile(inside, backend=backend)
        assert [compiled(x).requires_grad for _ in range(3)] == [True] * 3


_C = torch.tensor([0.3, 0.5, -0.2], dtype=torch.float64, requires_grad=True)  # captured


def _double_backward(x):  # PyTorch's backward of exp and logsumexp reads their outputs
    y = (x * _C).exp().sum() + x.logsumexp(0)
    return torch.autograd.grad(y, x, create_graph=True)[0] * x.sin()


def _data_reads(x):  # `.data` is a shallow copy as a saved output is, but stops history
    y = x.exp()
    return y * y.data + x.data * x


def _detaches(x):
    y = x.exp()
    return y * y.detach() + torch.tanh(x).detach() * x


def _per_example_grads(lib):
    def f(x):
        return lib.vmap(lib.grad(lambda v: (v * _C).sigmoid().sum() * v.logsumexp(0)))(
            torch.stack([x, x.cos()]))
    return f


def _grads(lib):
    return lib.grad(lambda v: (v * _C).abs().logsumexp(0))


def _hessian(lib):
    return lib.hessian(lambda v: (v.exp() * _C).sum() * v.logsumexp(0))


@pytest.mark.parametrize("name", ["double backward", ".data", ".detach()", "grad", "vmap(grad)",
                                  "hessian"])
def test_autograd_outside_a_replay_differentiates_as_outside_eager(name):
    """Autograd's saved outputs, unpacked in a backward pass, keep the output's history;
    make_fx records them as detaches, which a replay would cut (a wrong gradient of a
    gradient outside). `.data` and `.detach()` do cut it."""
    f, eager = {
        "double backward": (_double_backward, _double_backward),
        ".data": (_data_reads, _data_reads),
        ".detach()": (_detaches, _detaches),
        "grad": (_grads(tl), _grads(tf)),
        "vmap(grad)": (_per_example_grads(tl), _per_example_grads(tf)),
        "hessian": (_hessian(tl), _hessian(tf)),
    }[name]
    x0 = torch.tensor([1.2, -0.7, 0.4], dtype=torch.float64)

    def grads(fn):
        x = x0.clone().requires_grad_()
        out = fn(x)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
        grads = torch.autograd.grad((out * weights).sum(), (x, _C), allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (x, _C))]

    expected = grads(eager)
    compiled = tl.compile(f)
    for _ in range(2):  # the trace, then a replay
        assert_tree_close(grads(compiled), expected)
    assert_tree_close(grads(lambda x: tl.trace(f)(x)(x)[0]), expected)


def test_tracing_anew_keeps_no_source_of_the_graphs_it_frees():
    """torch.fx keeps each compiled module's source in linecache for the rest of the
    process: the trace keeps it while its graph lives (for tracebacks), no longer."""
    import gc
    import linecache

    def compiled_sources():
        return {k for k in linecache.cache if k.startswith("<eval_with_key>")}

    f = tl.vmap(tl.grad(lambda x: x.sin().sum()))
    x = torch.randn(3, 4)
    gm = tl.trace(f)(x)
    key = type(gm).forward.__code__.co_filename
    assert linecache.getline(key, 1)  # the source, while the graph lives
    before = compiled_sources()
    for _ in range(20):
        tl.trace(f)(x)
    gc.collect()  # (a module holds reference cycles; other tests' graphs may go too)
    assert not compiled_sources() - before
    del gm
    gc.collect()
    assert key not in linecache.cache
