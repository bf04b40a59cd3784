"""torch.library custom ops inside torchlevels transforms: vmap runs the op's own
``register_vmap`` rule, as torch.func does; reverse mode runs its ``register_autograd``
formula; forward mode, which PyTorch does not give custom ops, is refused.

Each op computes in NumPy, so no aten op inside it can be batched or differentiated:
only the registered rules can give the answer.
"""

import warnings

import numpy as np
import pytest
import torch
import torch.func as tf

import torchlevels as tl

rule_calls: list[tuple] = []


@torch.library.custom_op("tltest::np_sin_cos", mutates_args=())
def np_sin_cos(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.detach().cpu().numpy()
    return (torch.tensor(np.sin(a) * scale, device=x.device),
            torch.tensor(np.cos(a), device=x.device))


@np_sin_cos.register_fake
def _(x, scale):
    return torch.empty_like(x), torch.empty_like(x)


@np_sin_cos.register_vmap
def _(info, in_dims, x, scale):
    rule_calls.append((info.batch_size, info.randomness, in_dims))
    s, c = np_sin_cos(x, scale)
    return (s, c), (in_dims[0], in_dims[0])


def _sin_cos_backward(ctx, gs, gc):
    (x,) = ctx.saved_tensors
    return gs * ctx.scale * x.cos() - gc * x.sin(), None


def _sin_cos_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


np_sin_cos.register_autograd(_sin_cos_backward, setup_context=_sin_cos_setup)


@torch.library.custom_op("tltest::np_exp", mutates_args=())
def np_exp(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(np.exp(x.detach().cpu().numpy()), device=x.device)


@np_exp.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("tltest::np_argmax", mutates_args=())
def np_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(np.argmax(x.detach().cpu().numpy(), axis=-1), device=x.device)


@np_argmax.register_fake
def _(x):
    return x.new_empty(x.shape[:-1], dtype=torch.long)


def _loop(f, *args):
    return torch.stack([f(*a) for a in zip(*args)])


def test_vmap_runs_the_registered_rule_as_torch_func_does():
    x = torch.randn(4, 5, dtype=torch.float64)
    rule_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow loop
        got = tl.vmap(np_sin_cos, in_dims=(1, None), randomness="same")(x, 2.0)
    assert rule_calls == [(5, "same", (1, None))]
    want = tf.vmap(np_sin_cos, in_dims=(1, None), randomness="same")(x, 2.0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got[0], 2.0 * x.sin().T)


def test_nested_vmap_runs_the_rule_at_each_level():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    rule_calls.clear()
    got = tl.vmap(tl.vmap(lambda t: np_sin_cos(t, 1.0)[1], in_dims=1))(x)
    assert [c[0] for c in rule_calls] == [5, 3]
    torch.testing.assert_close(got, tf.vmap(tf.vmap(lambda t: np_sin_cos(t, 1.0)[1], in_dims=1))(x))


def test_without_a_rule_the_slow_loop_runs_and_a_later_rule_is_used():
    @torch.library.custom_op("tltest::np_square", mutates_args=())
    def np_square(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(x.detach().cpu().numpy() ** 2, device=x.device)

    np_square.register_fake(lambda x: torch.empty_like(x))
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="no batching rule for tltest.np_square.default"):
        torch.testing.assert_close(tl.vmap(np_square)(x), x ** 2)

    calls = []

    @np_square.register_vmap
    def _(info, in_dims, x):
        calls.append(in_dims)
        return np_square(x), in_dims[0]

    torch.testing.assert_close(tl.vmap(np_square)(x), x ** 2)
    assert calls == [(0,)]


def test_grad_through_the_rule_uses_the_registered_backward():
    x = torch.randn(4, 3, dtype=torch.float64)

    def loss(t):
        s, c = np_sin_cos(t, 3.0)
        return (s * c).sum()

    def per_example(t):
        t = t.clone().requires_grad_()
        return torch.autograd.grad(loss(t), t)[0]

    torch.testing.assert_close(tl.vmap(tl.grad(loss))(x), _loop(per_example, x))
    torch.testing.assert_close(
        tl.grad(lambda t: tl.vmap(loss)(t).sum())(x), _loop(per_example, x))
    # plain autograd outside vmap records the op run by the rule
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(tl.vmap(loss)(leaf).sum(), leaf)
    torch.testing.assert_close(g, _loop(per_example, x))


@torch.library.custom_op("tltest::exp_saving_output", mutates_args=())
def exp_saving_output(x: torch.Tensor) -> torch.Tensor:
    return x.exp()


@exp_saving_output.register_fake
def _(x):
    return torch.empty_like(x)


def _exp_setup(ctx, inputs, output):
    ctx.save_for_backward(output)  # the output: its derivative is the op again


exp_saving_output.register_autograd(lambda ctx, g: g * ctx.saved_tensors[0],
                                    setup_context=_exp_setup)


@pytest.mark.parametrize("op", ["exp_saving_output", "np_sin_cos"])
def test_second_derivatives_differentiate_the_registered_backward(op):
    # the levels around the op's node record its forward (PyTorch's apply ran it with grad
    # mode off: a grad level around took the saved output as a constant, a zero Hessian)
    f = ((lambda t: (exp_saving_output(t) ** 2).sum()) if op == "exp_saving_output" else
         (lambda t: (np_sin_cos(t, 3.0)[0] * t).sum()))
    x = torch.randn(3, dtype=torch.float64)
    expected = torch.autograd.functional.hessian(f, x)
    torch.testing.assert_close(tl.hessian(f)(x), expected)
    torch.testing.assert_close(tl.jacrev(tl.grad(f))(x), expected)
    torch.testing.assert_close(tl.vmap(tl.hessian(f))(x.expand(2, 3)), expected.expand(2, 3, 3))


@torch.library.custom_op("tltest::cos_batch_last", mutates_args=())
def cos_batch_last(x: torch.Tensor) -> torch.Tensor:
    return x.cos()


@cos_batch_last.register_fake
def _(x):
    return torch.empty_like(x)


@cos_batch_last.register_vmap
def _(info, in_dims, x):  # the batch dim last, given as -1 (torch.func takes that)
    return cos_batch_last(x.movedim(in_dims[0], 0)).movedim(0, -1), -1


def test_a_rule_may_give_a_negative_out_dim():
    x = torch.randn(4, 3, 2)
    torch.testing.assert_close(tl.vmap(tl.vmap(cos_batch_last))(x), x.cos())
    torch.testing.assert_close(tl.vmap(lambda t: cos_batch_last(t).reshape(-1))(x),
                               x.cos().reshape(4, -1))
    torch.testing.assert_close(tl.vmap(lambda t: cos_batch_last(t).movedim(0, 1))(x),
                               x.cos().movedim(1, 2))


@torch.library.custom_op("tltest::np_split", mutates_args=())
def np_split(x: torch.Tensor, splits: list[int], dim: int) -> tuple[list[torch.Tensor], int]:
    pieces = np.split(x.detach().cpu().numpy(), splits, axis=dim)
    return [torch.tensor(p, device=x.device) for p in pieces], len(splits)


@np_split.register_fake
def _(x, splits, dim):
    return [t.clone() for t in torch.tensor_split(x, splits, dim)], len(splits)


@np_split.register_vmap
def _(info, in_dims, x, splits, dim):  # out_dims with the output's structure, every other
    pieces, n = np_split(x.movedim(in_dims[0], 0), splits, dim + 1)  # piece batched last
    pieces = [p.movedim(0, -1) if k % 2 else p for k, p in enumerate(pieces)]
    return (pieces, n), ([-1 if k % 2 else 0 for k in range(len(pieces))], None)


@pytest.mark.parametrize("in_dim", [0, 1])
def test_a_rule_may_give_out_dims_with_the_structure_of_its_output(in_dim):
    """out_dims is a pytree prefix of the output, as torch.func reads it: here a list of
    tensors and an int take ``([d, d, d, d], None)``."""
    x = torch.randn(3, 2, 9).movedim(0, in_dim)
    f = lambda t: np_split(t, [1, 3, 6], 1)  # noqa: E731
    loop = [torch.stack(p) for p in zip(*(f(e)[0] for e in x.unbind(in_dim)))]
    for out_dims in [([0, 0, 0, 0], None), (0, None)]:
        ours = tl.vmap(f, in_dim, out_dims)(x)
        torch.testing.assert_close(ours, tf.vmap(f, in_dim, out_dims)(x))
        torch.testing.assert_close(ours, (loop, 3))


def test_a_registered_rule_may_give_out_dims_as_a_prefix_of_its_output():
    @torch.library.custom_op("tltest::np_halves", mutates_args=())
    def np_halves(x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        return [torch.tensor(p) for p in np.split(x.numpy(), 2, axis=-1)], 2

    np_halves.register_fake(lambda x: (list(x.clone().chunk(2, -1)), 2))
    tl.register_batching_rule(torch.ops.tltest.np_halves.default)(
        lambda func, args, dims, kwargs: (func(args[0].movedim(dims[0], 0)), (0, None)))
    x = torch.randn(4, 6)
    halves, n = tl.vmap(np_halves, out_dims=(0, None))(x)
    assert n == 2
    loop = [torch.stack(p) for p in zip(*(np_halves(e)[0] for e in x))]
    torch.testing.assert_close(halves, loop)


def test_jvp_refuses_a_custom_op_instead_of_a_silent_zero():
    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="tltest.np_exp.default is a torch.library "
                       "custom op.*no forward-mode derivative.*reverse mode"):
        tl.jacfwd(np_exp)(x)
    with pytest.raises(NotImplementedError, match="tltest.np_sin_cos.default"):
        tl.jvp(lambda t: np_sin_cos(t, 1.0)[0], (x,), (torch.ones_like(x),))
    # reverse mode has its formula; an op without a tangent going in is fine under jvp
    torch.testing.assert_close(tl.jacrev(lambda t: np_sin_cos(t, 1.0)[0])(x),
                               torch.diag(x.cos()))
    y, t = tl.jvp(lambda a: a * np_exp(x), (x,), (torch.ones_like(x),))
    torch.testing.assert_close(t, x.exp())


def test_jvp_lets_a_custom_op_with_integer_outputs_through():
    x = torch.randn(4, 5, dtype=torch.float64)
    _, got = tl.jvp(lambda a: a.sum(-1) * np_argmax(a), (x,), (torch.ones_like(x),))
    _, want = tf.jvp(lambda a: a.sum(-1) * a.argmax(-1), (x,), (torch.ones_like(x),))
    torch.testing.assert_close(got, want)


def test_a_rule_that_returns_the_wrong_shape_of_answer_is_named():
    @torch.library.custom_op("tltest::np_neg", mutates_args=())
    def np_neg(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(-x.detach().cpu().numpy(), device=x.device)

    np_neg.register_fake(lambda x: torch.empty_like(x))
    np_neg.register_vmap(lambda info, in_dims, x: np_neg(x))
    with pytest.raises(RuntimeError, match="rule registered for tltest.np_neg.default must "
                       "return a pair"):
        tl.vmap(np_neg)(torch.randn(2, 3))

    @torch.library.custom_op("tltest::np_pair", mutates_args=())
    def np_pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x.detach().cpu().numpy()
        return torch.tensor(a, device=x.device), torch.tensor(a, device=x.device)

    np_pair.register_fake(lambda x: (torch.empty_like(x), torch.empty_like(x)))
    np_pair.register_vmap(lambda info, in_dims, x: (np_pair(x), (0, 0, 0)))
    with pytest.raises(RuntimeError, match=r"out_dims=\(0, 0, 0\).*one out_dim per output"):
        tl.vmap(np_pair)(torch.randn(2, 3))


def test_a_registered_rule_that_answers_wrongly_is_named():
    # register_batching_rule's rules are checked as register_vmap's are, and for the batch
    @torch.library.custom_op("tltest::twice_thrice", mutates_args=())
    def twice_thrice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3

    twice_thrice.register_fake(lambda x: (torch.empty_like(x), torch.empty_like(x)))
    op, x = torch.ops.tltest.twice_thrice.default, torch.randn(4, 3)
    bad_rules = {
        "must return a pair.*got list": lambda f, a, d, k: list(f(a[0])),
        "returned 1 output.*the op returns 2": lambda f, a, d, k: ((f(a[0])[0],), (0,)),
        r"output 1 of shape \(2, 3\).*not a batch of the 4 examples": (
            lambda f, a, d, k: ((f(a[0])[0], f(a[0])[1][:2]), 0)),
        "output 0 .* out_dim 5": lambda f, a, d, k: (f(a[0]), (5, 0)),
    }
    for message, rule in bad_rules.items():
        tl.register_batching_rule(op)(rule)
        with pytest.raises(RuntimeError, match=message):
            tl.vmap(twice_thrice)(x)
    tl.register_batching_rule(op)(lambda f, a, d, k: (f(a[0]), (d[0], d[0])))
    torch.testing.assert_close(tl.vmap(twice_thrice, in_dims=1)(x.t()), (x * 2, x * 3))


def test_jvp_refuses_a_prim_instead_of_a_silent_zero():
    with pytest.raises(NotImplementedError, match="prims such as prims.sin.default"):
        tl.jacfwd(torch.ops.prims.sin.default)(torch.randn(3, dtype=torch.float64))


def test_jvp_refuses_pytorchs_own_chunked_linear_cross_entropy():
    """F.linear_cross_entropy with chunking is a custom op of PyTorch's own: torch.func's
    jvp returns a zero tangent for it, where the derivative is not zero."""
    import torch.nn.functional as F

    x, w = torch.randn(3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)

    def f(x):
        return F.linear_cross_entropy(x, w, torch.tensor(1), options=options)

    t = torch.ones_like(x)
    assert torch.autograd.functional.jvp(f, x, t)[1] != 0  # the true derivative
    with pytest.raises(NotImplementedError, match="_linear_cross_entropy_batch_chunked"):
        tl.jvp(f, (x,), (t,))
    torch.testing.assert_close(tl.grad(f)(x) @ t, torch.autograd.functional.jvp(f, x, t)[1])
