"""Flop counting and op logging as levels, checked against FlopCounterMode and the shapes
each position sees."""

import io

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import torchlevels as tl

# -- count_flops --------------------------------------------------------------------------


def make_mlp():
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def make_cnn():
    return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(16 * 11 * 11, 10))


def make_transformer_block():
    return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)


MODELS = {
    "mlp": (make_mlp, lambda: (torch.randn(16, 784), torch.randint(0, 10, (16,))),
            F.cross_entropy),
    "cnn": (make_cnn, lambda: (torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))),
            F.cross_entropy),
    "transformer block": (make_transformer_block,
                          lambda: (torch.randn(4, 10, 32), torch.randn(4, 10, 32)), F.mse_loss),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_count_flops_of_grad_equals_flop_counter_mode_forward_and_backward(name):
    make, data, loss = MODELS[name]
    model, (x, y) = make(), data()
    params = {k: v.detach() for k, v in model.named_parameters()}
    cf = tl.count_flops(tl.grad(lambda p: loss(tl.functional_call(model, p, (x,)), y)))
    grads = cf(params)
    with FlopCounterMode(display=False) as mode:
        loss(model(x), y).backward()
    assert cf.total == mode.get_total_flops() > 0
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad)


def test_count_flops_outside_vmap_counts_the_batched_ops_and_inside_one_examples():
    w = torch.randn(32, 16)
    xs = torch.randn(5, 10, 32)
    f = lambda x: (x @ w).relu() @ w.T
    with FlopCounterMode(display=False) as batched:
        f(xs)
    with FlopCounterMode(display=False) as one:
        f(xs[0])
    outside = tl.count_flops(tl.vmap(f))
    torch.testing.assert_close(outside(xs), tf.vmap(f)(xs))
    inside = tl.count_flops(f)
    torch.testing.assert_close(tl.vmap(inside)(xs), tf.vmap(f)(xs))
    assert outside.total == batched.get_total_flops() == 5 * one.get_total_flops()
    assert inside.total == one.get_total_flops()


def test_count_flops_counts_forward_and_backward_of_vmap_grad():
    w = torch.randn(16, 8)
    xs = torch.randn(6, 3, 16)
    loss = lambda w, x: (x @ w).tanh().sum()
    cf = tl.count_flops(tl.vmap(tl.grad(loss), in_dims=(None, 0)))
    torch.testing.assert_close(cf(w, xs), tf.vmap(tf.grad(loss), in_dims=(None, 0))(w, xs))
    with FlopCounterMode(display=False) as mode:  # the same ops with batched autograd
        wb = w.expand(6, 16, 8).clone().requires_grad_()
        torch.autograd.grad(loss(wb, xs), wb)
    assert cf.total == mode.get_total_flops()



def _products(graph_module):
    return sorted(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"
                  and any(k in str(n.target) for k in ("mm", "mv", "dot", "conv")))


_SEEN_AS_RUN = {  # (function, its arguments, in_dims): the batched vector or matrix cases
    "matrix @ vector": (torch.matmul, (torch.randn(3, 4, 5), torch.randn(5)), (0, None)),
    "vector @ vector": (torch.matmul, (torch.randn(3, 5), torch.randn(5)), (0, None)),
    "batch @ broadcast": (torch.matmul, (torch.randn(3, 2, 4, 5), torch.randn(3, 5, 6)), 0),
    "linear": (lambda x, w: F.linear(x, w), (torch.randn(3, 7, 5), torch.randn(6, 5)),
               (0, None)),
    "conv2d": (lambda x, w: F.conv2d(x, w), (torch.randn(3, 2, 3, 8, 8),
                                             torch.randn(4, 3, 3, 3)), (0, None)),
    "grad of vector @ batch": (
        tl.grad(lambda a, b: torch.matmul(a, b).sin().sum(), argnums=(0, 1)),
        (torch.randn(3), torch.randn(4, 1, 3, 3)), (None, 0)),
}


@pytest.mark.parametrize("name", list(_SEEN_AS_RUN))
def test_count_flops_outside_vmap_counts_the_ops_that_run_without_it(name):
    # the counter's level must not change how vmap and grad batch the calls inside it:
    # the reference is the graph of the plain ops they run with no tool outside (make_fx)
    from torch.fx.experimental.proxy_tensor import make_fx

    f, args, in_dims = _SEEN_AS_RUN[name]
    transformed = tl.vmap(f, in_dims=in_dims)
    plain_ops = make_fx(transformed)(*args)
    with FlopCounterMode(display=False) as mode:
        plain_ops(*args)
    counted = tl.count_flops(transformed)
    counted(*args)
    assert counted.total == mode.get_total_flops()
    assert _products(make_fx(tl.count_flops(transformed))(*args)) == _products(plain_ops)

@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_count_flops_counts_jacobians_and_hessians(transform):
    w = torch.randn(6, 6, dtype=torch.float64)
    f = (lambda x: (w @ x.sin()).pow(2).sum()) if transform == "hessian" else (
        lambda x: w @ (w @ x).tanh())
    x = torch.randn(6, dtype=torch.float64)
    ours = getattr(tl, transform)(f)
    cf = tl.count_flops(ours)
    torch.testing.assert_close(cf(x), getattr(tf, transform)(f)(x))
    graph = tl.trace(ours)(x)  # the same physical ops, counted by PyTorch's own counter
    with FlopCounterMode(display=False) as mode:
        graph(x)
    assert cf.total == mode.get_total_flops() > 0
    if transform != "hessian":  # (torch.func's hessian batches one product as bmm, ours not)
        with FlopCounterMode(display=False) as mode:
            getattr(tf, transform)(f)(x)
        assert cf.total == mode.get_total_flops()


_W, _K = torch.randn(16, 16), torch.randn(4, 3, 3)
_UNDER_FLOP_COUNTER = {
    "vmap": lambda L, x: L.vmap(lambda a: (a @ _W).relu() @ _W)(x),
    "vmap conv": lambda L, x: L.vmap(lambda a: F.conv1d(a[None], _K))(x),
    "vmap(grad)": lambda L, x: L.vmap(L.grad(lambda a: (a @ _W).tanh().sum()))(x),
    "grad(vmap)": lambda L, x: L.grad(lambda a: L.vmap(lambda b: b @ _W)(a).sum())(x),
    "per-sample grads": lambda L, x: L.vmap(L.grad(lambda k, a: F.conv1d(a[None], k).sum()),
                                            in_dims=(None, 0))(_K, x),
    "jacrev": lambda L, x: L.jacrev(lambda a: a @ _W)(x[0]),
    "jacfwd": lambda L, x: L.jacfwd(lambda a: a @ _W)(x[0]),
    "jvp": lambda L, x: L.jvp(lambda a: a @ _W, (x,), (x,)),
    "vmap(vmap)": lambda L, x: L.vmap(L.vmap(lambda a: a @ _W))(x),
}


@pytest.mark.parametrize("name", list(_UNDER_FLOP_COUNTER))
def test_flop_counter_mode_around_a_transform_counts_what_it_counts_around_torch_func(name):
    # the mode sees the batched ops every level runs, not one example's (which it would
    # see on the levels' tensors if they did not make it decline them)
    run, x = _UNDER_FLOP_COUNTER[name], torch.randn(8, 3, 16)
    with FlopCounterMode(display=False) as ours:
        out = run(tl, x)
    with FlopCounterMode(display=False) as theirs:
        expected = run(tf, x)
    torch.testing.assert_close(out, expected)
    assert ours.get_total_flops() == theirs.get_total_flops() > 0
    with ours:  # the same mode, entered again with no transform: it counts as it did
        x @ _W
    with FlopCounterMode(display=False) as fresh:
        x @ _W
    assert ours.get_total_flops() == fresh.get_total_flops() > 0


def test_count_flops_lists_ops_with_no_formula_instead_of_counting_zero():
    w, x = torch.randn(8, 4), torch.randn(4)
    cf = tl.count_flops(lambda w: (w @ x).exp().sum())
    cf(w)
    with FlopCounterMode(display=False) as mode:
        (w @ x).exp().sum()
    assert cf.total == mode.get_total_flops()
    assert {"aten.mv", "aten.exp", "aten.sum"} <= set(cf.uncounted)
    table = cf.table()
    assert "no flop formula" in table and "aten.mv" in table


def test_count_flops_context_manager_and_table():
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    with tl.count_flops() as FC:
        y = FC(a) @ b
        y = y @ b.T
    with FlopCounterMode(display=False) as mode:
        (a @ b) @ b.T
    assert FC.total == mode.get_total_flops()
    assert FC.by_op == {"aten.mm": mode.get_total_flops()}
    assert FC.calls["aten.mm"] == 2
    rows = FC.table().splitlines()
    assert rows[0].split() == ["op", "calls", "FLOPs", "share"]
    assert rows[1].split()[:2] == ["aten.mm", "2"] and rows[1].endswith("100.0%")


def test_count_flops_counts_each_call_afresh():
    cf = tl.count_flops(lambda x: x @ x)
    cf(torch.randn(4, 4))
    first = cf.total
    cf(torch.randn(8, 8))
    assert cf.total == 8 * first  # (8/4)^3: the second call's counts only


def test_count_flops_keeps_autograd_outside_working():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 2)
    out = tl.count_flops(lambda x: (x @ w).sin().sum())(x)
    out.backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach() @ w) @ w.T)


def test_count_flops_follows_in_place_ops():
    def f(x):
        y = x.clone()
        y.mul_(2).unsqueeze_(0)
        return y @ y.mT

    cf = tl.count_flops(f)
    x = torch.randn(3, 4)
    torch.testing.assert_close(cf(x), f(x))
    assert "aten.mul_" in cf.uncounted and cf.by_op.keys() == {"aten.bmm"}


# -- log_ops -----------------------------------------------------------------------------


# how log_ops names the device of a tensor not on the CPU (the suite may run on CUDA)
_AT = "" if torch.empty(0).device.type == "cpu" else f"@{torch.empty(0).device}"


def logged_lines(run) -> list[str]:
    out = io.StringIO()
    run(out)
    return out.getvalue().splitlines()


def test_log_ops_shows_batched_shapes_outside_vmap_and_one_example_inside():
    xs = torch.randn(5, 3)
    outside = logged_lines(lambda out: tl.log_ops(tl.vmap(torch.sin), file=out)(xs))
    inside = logged_lines(lambda out: tl.vmap(tl.log_ops(torch.sin, file=out))(xs))
    assert outside == [f"aten.sin.default(f32[5, 3]{_AT}) -> f32[5, 3]{_AT}"]
    assert inside == [f"aten.sin.default(f32[3]{_AT}) -> f32[3]{_AT}"]


def test_log_ops_outside_grad_sees_the_backward_ops():
    x = torch.randn(4, dtype=torch.float64)
    lines = logged_lines(
        lambda out: tl.log_ops(tl.grad(lambda x: x.sin().sum()), file=out)(x))
    ops = [line.split("(")[0] for line in lines]
    assert ops[:2] == ["aten.sin.default", "aten.sum.default"]
    assert "aten.cos.default" in ops  # sin's derivative, run by the backward pass
    assert all(line.count("f64[") >= 1 for line in lines if "cos" in line)


def test_log_ops_outside_vmap_of_jacrev_sees_one_basis_for_the_batch():
    # the basis of cotangents is a constant: made once below vmap, not once per example
    lines = logged_lines(lambda out: tl.log_ops(
        tl.vmap(tl.jacrev(lambda x: x.sin() * x.sum())), file=out)(torch.randn(3, 4)))
    (new_zeros,) = [line for line in lines if line.startswith("aten.new_zeros")]
    assert new_zeros.endswith(f"-> f32[4, 4]{_AT}")


def test_log_ops_context_manager_and_arguments():
    out = io.StringIO()
    with tl.log_ops(file=out) as L:
        y = L(torch.ones(2, 3, dtype=torch.int64)).sum(dim=1, keepdim=True)
    assert L.unwrap(y).shape == (2, 1)
    assert out.getvalue() == f"aten.sum.dim_IntList(i64[2, 3]{_AT}, [1], True) -> i64[2, 1]{_AT}\n"


def test_tools_compose_with_each_other_in_either_order():
    x = torch.randn(4, 4)
    log = io.StringIO()
    cf = tl.count_flops(tl.log_ops(lambda x: x @ x, file=log))
    torch.testing.assert_close(cf(x), x @ x)
    assert cf.by_op == {"aten.mm": 2 * 4 * 4 * 4}
    assert log.getvalue().startswith(f"aten.mm.default(f32[4, 4]{_AT}, f32[4, 4]{_AT})")


# -- a tool changes nothing where it sits -------------------------------------------------

TOOLS = {"count_flops": tl.count_flops,
         "log_ops": lambda f: tl.log_ops(f, file=io.StringIO())}


def _autograd_grad_of_cube(x):
    (g,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
    return g.sum()


def _detached_in_place(x):
    y = x.sin()
    y.detach_()
    return (x * y).sum()


def _hooked(x):
    y = x.sin()
    y.register_hook(lambda g: g * 10)
    return y.sum()


# functions that read what autograd says about their tensors: torch.func's grad answers as
# for a function of its input (requires_grad True, a grad_fn; .data and detach_() stop it)
READS_AUTOGRAD = {
    "requires_grad": lambda x: (x * (2.0 if x.requires_grad else 3.0)).sum(),
    "grad_fn": lambda x: (x.sin() * (2.0 if x.sin().grad_fn is not None else 3.0)).sum(),
    "is_leaf": lambda x: (x.sin() * (3.0 if x.sin().is_leaf else 2.0)).sum(),
    "data": lambda x: (x * x.data).sum(),
    "detach_": _detached_in_place,
    "register_hook": _hooked,
    "autograd.grad": _autograd_grad_of_cube,
}


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("name", list(READS_AUTOGRAD))
def test_a_tool_inside_grad_answers_autograd_as_the_grad_does(tool, name):
    f = READS_AUTOGRAD[name]
    x = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(tl.grad(TOOLS[tool](f))(x), tf.grad(f)(x))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_torch_func_differentiates_inside_a_tool(tool):
    # torch.func's grad calls torch.autograd.grad on its own wrappers, not the tool's
    f = lambda x: (x @ x.T).tanh().sum()  # noqa: E731
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(TOOLS[tool](tf.vmap(tf.grad(f)))(x), tf.vmap(tf.grad(f))(x))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_tool_alone_keeps_what_autograd_outside_tracks(tool):
    def pinn(x):  # a physics-informed loss takes du/dx of its input
        (du,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
        return du

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert TOOLS[tool](lambda x: x.requires_grad and not x.is_leaf)(x.sin()) is True
    got = TOOLS[tool](pinn)(x)
    torch.testing.assert_close(got, pinn(x))
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], 6 * x.detach())


def _vjp_of_ones(lib):
    def f(x):
        out, vjp_fn = lib.vjp(lambda t: t.abs().sin(), x)
        return vjp_fn(torch.ones_like(out))[0]
    return f


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("around", ["torch.device", "trace"])
def test_a_vjp_inside_a_tool_under_a_torch_function_mode(tool, around):
    """PyTorch hands torch.autograd.grad back once per torch function mode: vjp_fn's own
    call stays its own (it was taken for a user's call at the tool's level and raised)."""
    x = torch.randn(3, dtype=torch.float64)
    expected = tf.vmap(_vjp_of_ones(tf))(x[None])
    f = tl.vmap(TOOLS[tool](_vjp_of_ones(tl)))
    if around == "trace":
        got = tl.trace(f)(x[None])(x[None])[0]
    else:
        with torch.device("cpu"):  # a torch function mode
            got = f(x[None])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_tool_gives_an_out_tensor_the_shape_the_op_resized_it_to(tool):
    def f(x):
        o = x.new_empty(0)
        torch.sin(x, out=o)
        values, indices = x.new_empty(0), torch.empty(0, dtype=torch.long)
        torch.sort(x, 1, out=(values, indices))
        return o * o.shape[0] + values * values.shape[1] + indices

    x = torch.randn(3, 4)
    torch.testing.assert_close(TOOLS[tool](f)(x), f(x))


def test_a_tool_inside_grad_lets_it_take_in_a_buffer_written_in_place():
    def into_buffer(x):  # a factory's buffer written with a value of the grad level
        buf = torch.zeros(3, 4, dtype=x.dtype)
        buf.add_(x.sin())
        return buf.sum()

    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(tl.grad(tl.count_flops(into_buffer))(x), tf.grad(into_buffer)(x))


def test_a_tool_inside_vmap_indexes_by_each_examples_0_dim_index():
    index = lambda x, i: x[i]  # noqa: E731
    x, i = torch.randn(3, 4), torch.tensor([0, 2, 1])
    torch.testing.assert_close(tl.vmap(tl.count_flops(index))(x, i), tf.vmap(index)(x, i))

    def write_through_row(x, i):  # alone, x[i] by a 0-dim tensor is a view, as without it
        x[i].mul_(10)
        return x

    torch.testing.assert_close(tl.count_flops(write_through_row)(x.clone(), torch.tensor(1)),
                               write_through_row(x.clone(), torch.tensor(1)))


class ScaledMatmul(torch.autograd.Function):
    """x @ w whose backward and jvp are twice the true derivative's x-part: a transform
    that used them shows it (as torch.func's does)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, w):
        return x @ w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return 2 * g @ w.mT, x.mT @ g

    @staticmethod
    def jvp(ctx, x_t, w_t):
        x, w = ctx.saved_tensors
        return 2 * x_t @ w + x @ w_t


class NumpyCube(torch.autograd.Function):
    """Runs in numpy, so only its vmap staticmethod can batch it."""

    @staticmethod
    def forward(x):
        return torch.from_numpy(x.detach().numpy() ** 3)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def vmap(info, in_dims, x):
        return NumpyCube.apply(x), in_dims[0]


_WEIGHT = torch.randn(4, 5, dtype=torch.float64)
_MATMUL_SUM = lambda x: ScaledMatmul.apply(x, _WEIGHT).sum()  # noqa: E731
_MATMUL = lambda x: ScaledMatmul.apply(x, _WEIGHT)  # noqa: E731
_TANGENT = torch.randn(3, 4, dtype=torch.float64)
CUSTOM_FUNCTION_UNDER_A_TOOL = {  # (what torchlevels computes, with the tool, and torch.func)
    "grad(tool(f))": lambda T, tool: T.grad(tool(_MATMUL_SUM)),
    "vjp(tool(f))": lambda T, tool: lambda x: T.vjp(tool(_MATMUL), x)[1](torch.ones(3, 5).double()),
    "jvp(tool(f))": lambda T, tool: lambda x: T.jvp(tool(_MATMUL), (x,), (_TANGENT,))[1],
    "jacrev(tool(f))": lambda T, tool: T.jacrev(tool(_MATMUL)),
    "tool(jacfwd(f))": lambda T, tool: tool(T.jacfwd(_MATMUL)),
    "tool(jvp(f))": lambda T, tool: tool(lambda x: T.jvp(_MATMUL, (x,), (_TANGENT,))[1]),
    "vmap(tool(f))": lambda T, tool: T.vmap(tool(NumpyCube.apply)),
}


_SHIFT = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)


def _shifted_then_written(x):  # a captured constant added, then a view written in place
    x = x + _SHIFT
    y = x.clone()
    y.narrow(0, 0, 2).add_(x.narrow(0, 0, 2).sin())
    return y


def _jvp_of_ones(lib, f):
    return lambda x: lib.jvp(f, (x,), (torch.ones_like(x),))[1]


# a transform, a tool inside it, a jvp inside that: the jvp level gives a captured
# constant a zero tangent, which the tool must not pass on to the level outside, whose
# in-place write would then write into it
TOOL_BETWEEN_A_TRANSFORM_AND_JVP = {
    "vmap(tool(jvp(f)))": lambda T, tool: T.vmap(tool(_jvp_of_ones(T, _shifted_then_written))),
    "grad(tool(jvp(f)))": lambda T, tool: T.grad(
        lambda x: tool(_jvp_of_ones(T, _shifted_then_written))(x).sum()),
}


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize("name", [*CUSTOM_FUNCTION_UNDER_A_TOOL, *TOOL_BETWEEN_A_TRANSFORM_AND_JVP])
def test_a_tool_anywhere_changes_no_value(tool, name):
    """Custom functions keep their rules with a tool anywhere, and so do jvp's tangents."""
    program = {**CUSTOM_FUNCTION_UNDER_A_TOOL, **TOOL_BETWEEN_A_TRANSFORM_AND_JVP}[name]
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(program(tl, TOOLS[tool])(x), program(tf, lambda f: f)(x))


@pytest.mark.parametrize("transform", [lambda f: f, tl.grad, tl.vmap, tl.jacfwd])
def test_count_flops_sees_the_forward_of_a_custom_function(transform):
    x = torch.randn(3, 4, dtype=torch.float64)
    counted = tl.count_flops(transform(_MATMUL_SUM))
    counted(x)
    with FlopCounterMode(display=False) as mode:
        transform(_MATMUL_SUM)(x)
    assert counted.total == mode.get_total_flops() > 0


def test_a_custom_function_under_a_tool_alone_is_differentiable():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = tl.count_flops(_MATMUL_SUM)(x)
    assert out.requires_grad
    torch.testing.assert_close(torch.autograd.grad(out, x)[0],
                               torch.autograd.grad(_MATMUL_SUM(x), x)[0])


def test_checkpoint_in_a_tool_inside_grad_says_to_put_the_tool_outside():
    from torch.utils.checkpoint import checkpoint

    f = lambda x: checkpoint(lambda a: a.sin().exp(), x, use_reentrant=False).sum()  # noqa: E731
    x = torch.randn(3)
    with pytest.raises(tl.EscapedTensorError, match=r"checkpoint.*count_flops\(grad\(f\)\)"):
        tl.grad(tl.count_flops(f))(x)
    torch.testing.assert_close(tl.count_flops(tl.grad(f))(x), tl.grad(f)(x))

