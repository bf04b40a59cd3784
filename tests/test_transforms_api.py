"""The public autodiff transforms keep torch.func's semantics, result structures and errors.

Every value is compared with torch.func (or torch.autograd) on the same inputs; every
error with the type torch.func raises for the same call.
"""

import contextvars
import doctest
import gc
import sys
import tracemalloc

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from vmap_reference import seeded

import torchlevels
import torchlevels as tl
from torchlevels import EscapedTensorError, grad_level, jvp_level
from torchlevels._level import LevelTensor


def assert_tree_close(actual, expected, **kwargs):
    """Same pytree structure, same non-tensor leaves, close tensor leaves."""
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    assert spec_a == spec_e, f"structure differs:\n{spec_a}\nvs torch.func's\n{spec_e}"
    for a, e in zip(flat_a, flat_e):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and type(a) is torch.Tensor, type(a)
            torch.testing.assert_close(a, e, **kwargs)
        else:
            assert a == e


def error_of(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def assert_same_error(make_call, match=None):
    """``make_call(lib)`` raises with torchlevels the exception type torch.func raises (or
    a subclass of it: every ``except`` clause that catches one catches the other)."""
    expected = error_of(lambda: make_call(tf))
    assert expected is not None, "torch.func did not raise: the case is wrong"
    with pytest.raises(type(expected)) as info:
        make_call(tl)
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


# -- inputs shared by many tests ------------------------------------------------------

X = torch.randn(3, generator=seeded(1))
Y = torch.randn(3, generator=seeded(2))
M = torch.randn(2, 3, generator=seeded(3))
PARAMS = {
    "w": torch.randn(3, 3, generator=seeded(4)),
    "b": torch.randn(3, generator=seeded(5)),
}


def two_args(a, b):
    return (a.sin() * b.exp()).sum()


def three_args(a, b, c):
    return (a * b.cos() + c ** 2).sum()


def mlp_loss(params, inp):
    return (torch.tanh(inp @ params["w"] + params["b"]) ** 2).sum()


def tree_fn(tup):
    """A pytree in (a tuple holding a tensor and a dict) and a pytree out."""
    a, d = tup
    return {"s": a.sin() * d["z"], "t": (a.cos(), d["z"] ** 2)}


TREE_IN = (X, {"z": Y})
TREE_TANGENT = (torch.ones(3), {"z": torch.full((3,), 0.5)})
TREE_COTANGENT = {"s": torch.ones(3), "t": (torch.full((3,), 2.0), torch.full((3,), -1.0))}


def multi_out(a, b):
    return {"u": a * b.sum(), "v": (a[:2] * b[:2].exp(), b.exp())}


# -- argnums --------------------------------------------------------------------------

@pytest.mark.parametrize("api", ["grad", "grad_and_value", "jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize("argnums", [0, 1, 2, (0,), (0, 2), (2, 0, 1)])
def test_argnums_matches_torch_func(api, argnums):
    args = (X, Y, M[0])
    ours = getattr(tl, api)(three_args, argnums=argnums)(*args)
    theirs = getattr(tf, api)(three_args, argnums=argnums)(*args)
    assert_tree_close(ours, theirs)


@pytest.mark.parametrize("api", ["grad", "grad_and_value", "jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize(("negative", "positive"), [(-1, 2), (-3, 0), ((-1, 0), (2, 0)),
                                                    ((-2, -1), (1, 2))])
def test_negative_argnums_mean_counting_from_the_end(api, negative, positive):
    # Compared with torch.func at the equivalent positive argnums: torch.func's own
    # jacfwd/hessian return zeros for negative argnums (an upstream bug, not a spec).
    args = (X, Y, M[0])
    ours = getattr(tl, api)(three_args, argnums=negative)(*args)
    theirs = getattr(tf, api)(three_args, argnums=positive)(*args)
    assert_tree_close(ours, theirs)


@pytest.mark.parametrize("api", ["grad", "grad_and_value", "jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize(("argnums", "match"), [
    (2, "argnum=2"), (-3, "argnum=-3"), ((0, 5), "argnum=5"), ((), "non-empty"),
    ((0, 0), "unique"), (1.0, "argnums must be int"), ([0, 1], "argnums must be int"),
])
def test_bad_argnums_raise_like_torch_func(api, argnums, match):
    assert_same_error(lambda lib: getattr(lib, api)(two_args, argnums=argnums)(X, Y), match)


@pytest.mark.parametrize(("ours", "theirs"), [(0, 0), (1, 1), ((0, 1), (0, 1)), (-2, 0)])
def test_argnums_with_pytree_argument(ours, theirs):
    assert_tree_close(tl.grad(mlp_loss, argnums=ours)(PARAMS, M),
                      tf.grad(mlp_loss, argnums=theirs)(PARAMS, M))


def test_kwargs_are_passed_through_and_not_differentiated():
    f = lambda a, *, scale: (a * scale).pow(2).sum()
    assert_tree_close(tl.grad(f)(X, scale=Y), tf.grad(f)(X, scale=Y))
    assert_tree_close(tl.grad_and_value(f, argnums=0)(X, scale=Y),
                      tf.grad_and_value(f, argnums=0)(X, scale=Y))


# -- has_aux --------------------------------------------------------------------------

def aux_scalar(a):
    return (a ** 2).sum(), {"m": a.mean(), "pair": (a.sin(), a * 2)}


def aux_vector(a):
    return a.sin() * 2, {"c": a.cos(), "t": (a.exp(),)}


def test_has_aux_grad_and_grad_and_value():
    assert_tree_close(tl.grad(aux_scalar, has_aux=True)(X), tf.grad(aux_scalar, has_aux=True)(X))
    assert_tree_close(tl.grad_and_value(aux_scalar, has_aux=True)(X),
                      tf.grad_and_value(aux_scalar, has_aux=True)(X))


def test_has_aux_aux_is_a_plain_tensor_without_history():
    _, aux = tl.grad(aux_scalar, has_aux=True)(X)
    for t in tree_flatten(aux)[0]:
        assert type(t) is torch.Tensor and not t.requires_grad


def test_has_aux_vjp():
    out, fn, aux = tl.vjp(aux_vector, X, has_aux=True)
    out_f, fn_f, aux_f = tf.vjp(aux_vector, X, has_aux=True)
    assert_tree_close((out, fn(Y), aux), (out_f, fn_f(Y), aux_f))


def test_has_aux_jvp():
    assert_tree_close(tl.jvp(aux_vector, (X,), (Y,), has_aux=True),
                      tf.jvp(aux_vector, (X,), (Y,), has_aux=True))


@pytest.mark.parametrize("api", ["jacrev", "jacfwd"])
def test_has_aux_jacobians(api):
    assert_tree_close(getattr(tl, api)(aux_vector, has_aux=True)(X),
                      getattr(tf, api)(aux_vector, has_aux=True)(X))


def test_has_aux_jacobians_with_argnums_tuple():
    f = lambda a, b: (a * b, {"ab": (a + b).sum()})
    for api in ("jacrev", "jacfwd"):
        assert_tree_close(getattr(tl, api)(f, argnums=(0, 1), has_aux=True)(X, Y),
                          getattr(tf, api)(f, argnums=(0, 1), has_aux=True)(X, Y))


NOT_PAIRS = {
    "single": lambda a: a.sin().sum(),
    "triple": lambda a: (a.sin().sum(), a, a),
    "list": lambda a: [a.sin().sum(), a],
}


@pytest.mark.parametrize("bad", list(NOT_PAIRS))
@pytest.mark.parametrize("api", ["grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd"])
def test_has_aux_requires_a_pair(api, bad):
    f = NOT_PAIRS[bad]

    def call(lib):
        if api == "vjp":
            return lib.vjp(f, X, has_aux=True)
        if api == "jvp":
            return lib.jvp(f, (X,), (Y,), has_aux=True)
        return getattr(lib, api)(f, has_aux=True)(X)

    assert_same_error(call, "(output, aux)")


# -- pytrees of inputs and outputs ----------------------------------------------------

def test_grad_pytree_input():
    assert_tree_close(tl.grad(mlp_loss)(PARAMS, M), tf.grad(mlp_loss)(PARAMS, M))
    assert_tree_close(tl.grad_and_value(mlp_loss, argnums=(0, 1))(PARAMS, M),
                      tf.grad_and_value(mlp_loss, argnums=(0, 1))(PARAMS, M))


def test_grad_nested_pytree_input():
    f = lambda tree: tree[0].sum() * tree[1]["k"][0].exp().sum() + tree[1]["k"][1].sin().sum()
    tree = (X, {"k": [Y, M]})
    assert_tree_close(tl.grad(f)(tree), tf.grad(f)(tree))


def test_vjp_pytrees():
    out, fn = tl.vjp(tree_fn, TREE_IN)
    out_f, fn_f = tf.vjp(tree_fn, TREE_IN)
    assert_tree_close((out, fn(TREE_COTANGENT)), (out_f, fn_f(TREE_COTANGENT)))


def test_vjp_several_primals_and_repeated_calls():
    out, fn = tl.vjp(multi_out, X, Y)
    out_f, fn_f = tf.vjp(multi_out, X, Y)
    assert_tree_close(out, out_f)
    for scale in (1.0, -2.0):
        ct = {"u": torch.full((3,), scale), "v": (torch.ones(2) * scale, torch.ones(3))}
        assert_tree_close(fn(ct), fn_f(ct))


def test_jvp_pytrees():
    assert_tree_close(tl.jvp(tree_fn, (TREE_IN,), (TREE_TANGENT,)),
                      tf.jvp(tree_fn, (TREE_IN,), (TREE_TANGENT,)))


@pytest.mark.parametrize("api", ["jacrev", "jacfwd"])
def test_jacobian_pytrees(api):
    assert_tree_close(getattr(tl, api)(tree_fn)(TREE_IN), getattr(tf, api)(tree_fn)(TREE_IN))


@pytest.mark.parametrize("api", ["jacrev", "jacfwd"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0)])
def test_jacobian_pytree_output_with_argnums(api, argnums):
    assert_tree_close(getattr(tl, api)(multi_out, argnums=argnums)(X, Y),
                      getattr(tf, api)(multi_out, argnums=argnums)(X, Y))


@pytest.mark.parametrize("api", ["jacrev", "jacfwd"])
def test_jacobian_of_a_sliced_output(api):
    f = lambda a: a[1:] * 2
    assert_tree_close(getattr(tl, api)(f)(X), getattr(tf, api)(f)(X))


@pytest.mark.parametrize("api", ["jacrev", "jacfwd"])
def test_jacobian_matrix_input_and_output(api):
    f = lambda m: (m @ m.T).sin()
    assert_tree_close(getattr(tl, api)(f)(M), getattr(tf, api)(f)(M))


def test_hessian_of_inputs_of_different_dtypes_gives_each_block_its_row_inputs_dtype():
    f = lambda a, b, c: (a * b.half()).float().sum() * c.float().sum() + (b * b).sum()
    args = (torch.randn(3).half(), torch.randn(3), torch.randn(2).double())
    expected = tf.hessian(f, argnums=(0, 1, 2))(*args)
    got = tl.hessian(f, argnums=(0, 1, 2))(*args)
    assert [[h.dtype for h in row] for row in got] == [[h.dtype for h in row] for row in expected]
    assert_tree_close(got, expected)
    g = lambda d: (d["a"].double() * d["b"].sum()).sum() + d["a"].pow(3).sum()
    d = {"a": torch.randn(2), "b": torch.randn(3).double()}
    assert_tree_close(tl.hessian(g)(d), tf.hessian(g)(d))


# -- errors on outputs and inputs -----------------------------------------------------

@pytest.mark.parametrize("api", ["grad", "grad_and_value"])
def test_grad_of_non_scalar_output_raises(api):
    e = assert_same_error(lambda lib: getattr(lib, api)(lambda a: a * 2)(X), "scalar")
    assert "1 dims" in str(e)


@pytest.mark.parametrize("api", ["grad", "grad_and_value"])
def test_grad_of_non_tensor_output_raises(api):
    assert_same_error(lambda lib: getattr(lib, api)(lambda a: 3.0)(X), "Tensor")


def test_vjp_and_jvp_of_non_tensor_output_raise():
    assert_same_error(lambda lib: lib.vjp(lambda a: (a, 3), X), "only")
    assert_same_error(lambda lib: lib.jvp(lambda a: (a, 3), (X,), (Y,)), "only")


@pytest.mark.parametrize("api", ["vjp", "jacrev"])
@pytest.mark.parametrize("out", [lambda a: a > 0, lambda a: (a * 2, a.argmax())],
                         ids=["bool", "int in a tuple"])
def test_vjp_and_jacrev_of_integer_output_raise(api, out):
    call = {"vjp": lambda lib: lib.vjp(out, X), "jacrev": lambda lib: lib.jacrev(out)(X)}[api]
    assert_same_error(call, "must be floating-point or complex")


def test_vjp_fn_passes_retain_graph_and_create_graph_on():
    x = X.clone().requires_grad_()
    f = lambda a: (a.sin() * a).exp()
    for lib in (tl, tf):
        _, fn = lib.vjp(f, x)
        (once,) = fn(Y, create_graph=False)
        assert not once.requires_grad
        (first,) = fn(Y, create_graph=True)  # differentiable in x, like torch.func's
        (second,) = torch.autograd.grad(first.sum(), x, retain_graph=True)
        fn(Y, retain_graph=False)
        with pytest.raises(RuntimeError, match="second time"):
            fn(Y)
        if lib is tl:
            ours = (once, first, second)
    assert_tree_close(ours, (once, first, second))


INT = torch.arange(3)


@pytest.mark.parametrize("api", ["grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd",
                                 "hessian", "linearize"])
def test_integer_inputs_raise_like_torch_func(api):
    f = lambda a: (a * 1.5).sum()

    def call(lib):
        if api == "vjp":
            return lib.vjp(f, INT)
        if api == "jvp":
            return lib.jvp(f, (INT,), (INT,))
        if api == "linearize":
            return lib.linearize(f, INT)
        return getattr(lib, api)(f)(INT)

    assert_same_error(call)


def test_integer_input_is_fine_when_not_differentiated():
    f = lambda a, idx: (a[idx] ** 2).sum()
    assert_tree_close(tl.grad(f)(X, torch.tensor([0, 2])), tf.grad(f)(X, torch.tensor([0, 2])))


def test_non_tensor_input_raises_like_torch_func():
    assert_same_error(lambda lib: lib.grad(lambda a: a * 2)(3.0))


# -- jvp and vjp argument checks ------------------------------------------------------

@pytest.mark.parametrize(("case", "match"), [
    ("fewer tangents", "same python structure"),
    ("tangent not a tuple", "same python structure"),
    ("primals not a tuple", "Expected primals to be a tuple"),
    ("tangent is a float", None),
    ("tangent of another shape", None),
    ("integer tangent", "Expected tangent to be floating point or complex"),
])
def test_jvp_mismatched_primals_and_tangents_raise(case, match):
    calls = {
        "fewer tangents": lambda lib: lib.jvp(two_args, (X, Y), (X,)),
        "tangent not a tuple": lambda lib: lib.jvp(torch.sin, (X,), X),
        "primals not a tuple": lambda lib: lib.jvp(torch.sin, X, (X,)),
        "tangent is a float": lambda lib: lib.jvp(torch.sin, (X,), (1.0,)),
        "tangent of another shape": lambda lib: lib.jvp(two_args, (X, Y), (X, torch.ones(4))),
        "integer tangent": lambda lib: lib.jvp(torch.sin, (X,), (torch.ones(3, dtype=torch.long),)),
    }
    assert_same_error(calls[case], match)


@pytest.mark.parametrize("case", ["bare tensor", "list", "one too few", "wrong dict keys",
                                  "wrong shape"])
def test_vjp_fn_with_wrongly_structured_cotangent_raises(case):
    cotangents = {
        "bare tensor": torch.ones(3),
        "list": [torch.ones(3), torch.ones(3)],
        "one too few": (torch.ones(3),),
        "wrong dict keys": {"a": torch.ones(3), "b": torch.ones(3)},
        "wrong shape": (torch.ones(4), torch.ones(3)),
    }

    def call(lib):
        _, fn = lib.vjp(lambda a: (a.sin(), a.cos()), X)
        return fn(cotangents[case])

    assert_same_error(call)


def test_vjp_fn_of_dict_output_rejects_other_keys():
    def call(lib):
        _, fn = lib.vjp(tree_fn, TREE_IN)
        return fn({"s": torch.ones(3), "x": (torch.ones(3), torch.ones(3))})

    assert_same_error(call, "pytree structure")


# -- linearize, hessian, jacrev chunk_size, jacfwd randomness -------------------------

def test_linearize_matches_jvp_and_torch_func():
    f = lambda a, b: a.sin() * b + (a * b).exp()
    out, fn = tl.linearize(f, X, Y)
    out_f, fn_f = tf.linearize(f, X, Y)
    assert_tree_close(out, out_f)
    for scale in (1.0, 0.5, -3.0):
        tangents = (torch.ones(3) * scale, torch.full((3,), 2.0))
        assert_tree_close(fn(*tangents), fn_f(*tangents))


_C = torch.rand(3, generator=seeded(40), dtype=torch.float64) + 0.5
_MAT = torch.randn(3, 3, generator=seeded(41), dtype=torch.float64)
SCALED_BY_A_NUMBER = {
    "add alpha": lambda x: torch.add(x, _C, alpha=0.5) + torch.sub(x.exp(), x, alpha=2),
    "addcmul value": lambda x: torch.addcmul(_C, x, x.sin(), value=0.5),
    "addcdiv value": lambda x: torch.addcdiv(x, x.sin(), _C, value=-2),
    "addmm and kin": lambda x: (torch.addmm(_MAT, x[:, None], x[None], beta=0.5, alpha=2)
                                + torch.addr(_MAT, x, _C, alpha=3)
                                + torch.baddbmm(_MAT[None], x[None, :, None], x[None, None],
                                                beta=0, alpha=0.5)[0]
                                + torch.addmv(x, _MAT, x, beta=2).sum()),
    "in place": lambda x: (x * 1).add_(_C, alpha=0.3).addcdiv_(x, _C, value=0.3).addcmul_(
        x, _C, value=2),
    "beta 0 ignores nan": lambda x: torch.addmm(_MAT.log() * -_MAT.abs(), x[:, None], x[None],
                                                beta=0, alpha=0.5),
}


@pytest.mark.parametrize("name", SCALED_BY_A_NUMBER)
def test_linearize_and_compile_of_ops_scaled_by_a_number(name):
    """PyTorch's forward-AD formulas of these ops crash the interpreter under make_fx,
    which linearize's and torchlevels.compile's traces run (torch.func.linearize crashes
    there too): while tracing, a jvp level runs them without the coefficient argument."""
    f = SCALED_BY_A_NUMBER[name]
    x, t = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    expected = tf.jvp(f, (x,), (t,))
    out, jvp_fn = tl.linearize(f, x)
    assert_tree_close((out, jvp_fn(t)), expected, equal_nan=True)
    compiled = tl.compile(lambda x, t: tl.jvp(f, (x,), (t,)))
    assert_tree_close(compiled(x, t), expected, equal_nan=True)


def test_linearize_pytrees():
    out, fn = tl.linearize(tree_fn, TREE_IN)
    out_f, fn_f = tf.linearize(tree_fn, TREE_IN)
    assert_tree_close((out, fn(TREE_TANGENT)), (out_f, fn_f(TREE_TANGENT)))


def test_linearize_is_differentiable_in_its_primals_as_jvp_is():
    # torch.func's linearize traces its primals as constants, so autograd outside sees
    # only the tangent's path; the reference is torch.func.jvp, which sees both
    f = lambda b: b.sin() * b
    x = X.clone().requires_grad_()
    (ours,) = torch.autograd.grad(tl.linearize(f, x)[1](x).sum(), x)
    (theirs,) = torch.autograd.grad(tf.jvp(f, (x,), (x,))[1].sum(), x)
    assert_tree_close(ours, theirs)


def test_linearize_under_vmap_of_tangents():
    _, fn = tl.linearize(lambda a: (a ** 3).sin(), X)
    _, fn_f = tf.linearize(lambda a: (a ** 3).sin(), X)
    assert_tree_close(tl.vmap(fn)(torch.eye(3)), torch.func.vmap(fn_f)(torch.eye(3)))


def test_linearize_runs_the_function_once_more_and_jvp_fn_replays_a_fixed_linear_map():
    # as torch.func's (and JAX's): f runs for the output and once, traced, for jvp_fn;
    # jvp_fn then runs no Python of f, so state f reads later is not seen
    calls, scale = [], [1.0]

    def f(a):
        calls.append(1)
        return (a * scale[0]).sin()

    out, fn = tl.linearize(f, X)
    out_f, fn_f = tf.linearize(f, X)
    scale[0] = 5.0
    before = len(calls)
    assert_tree_close((out, fn(Y)), (out_f, fn_f(Y)))
    assert len(calls) == before  # neither runs f again


def test_linearize_of_random_ops_is_a_linear_map():
    # dropout's mask and a random scale are drawn once, when linearize traces: every call
    # of jvp_fn applies the same linear map (torch.func's redraws the mask per call)
    torch.manual_seed(0)
    _, fn = tl.linearize(lambda a: F.dropout(a, 0.5) * torch.rand(3), X)
    t1, t2 = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(fn(t1) + fn(t2), fn(t1 + t2))
    torch.testing.assert_close(fn(t1), fn(t1))


def test_linearize_through_a_buffer_written_with_tangent_values():
    # a buffer made inside f and written in place: its tangent is written per call, so it
    # is made per call, not once (the results of two calls would be one tensor)
    def f(a):
        out = a.new_zeros(4)
        out[1:] = a.sin()
        return out

    _, fn = tl.linearize(f, X)
    _, fn_f = tf.linearize(f, X)
    first, second = fn(Y), fn(2 * Y)
    assert_tree_close((first, second), (fn_f(Y), fn_f(2 * Y)))


def test_linearize_reads_a_buffer_before_it_is_written_in_place():
    # the tangent part reads buf, which f writes afterwards: run once, the write would
    # come before every later read
    def f(a):
        buf = a.new_ones(3) * 2
        r = a * buf
        buf.mul_(3)
        return r + buf

    _, fn = tl.linearize(f, X)
    assert_tree_close((fn(Y), fn(2 * Y)), (tf.jvp(f, (X,), (Y,))[1], tf.jvp(f, (X,), (2 * Y,))[1]))


def test_linearize_keeps_no_traced_source_behind():
    # torch.fx keeps the source of every module it compiles (make_fx's, once per call)
    import linecache

    def sources():  # (those of traces other tests made may go meanwhile)
        return {key for key in linecache.cache if key.startswith("<eval_with_key>")}

    tl.linearize(torch.sin, X)[1](Y)
    before = sources()
    for _ in range(20):
        tl.linearize(lambda a: a.sin() * a, X)[1](Y)
    assert not sources() - before


def test_linearize_of_a_function_that_reads_a_value_runs_jvp_per_call():
    # torch.cond reads its predicate: a trace could not hold it
    f = lambda a: torch.cond(a.sum() > 0, torch.sin, torch.cos, (a,))  # noqa: E731
    for x in (X, -X.abs()):
        _, fn = tl.linearize(f, x)
        assert_tree_close(fn(Y), tl.jvp(f, (x,), (Y,))[1])
        assert_tree_close(fn(Y), x.cos() * Y if x.sum() > 0 else -x.sin() * Y)


def test_linearize_inside_vmap_runs_jvp():
    def per_example(x, t):
        return tl.linearize(lambda a: a.sin() * a, x)[1](t)

    xs, ts = torch.randn(4, 3), torch.randn(4, 3)
    expected = torch.stack([tf.jvp(lambda a: a.sin() * a, (x,), (t,))[1]
                            for x, t in zip(xs, ts)])
    assert_tree_close(tl.vmap(per_example)(xs, ts), expected)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0)])
def test_hessian_with_argnums(argnums):
    assert_tree_close(tl.hessian(two_args, argnums=argnums)(X, Y),
                      tf.hessian(two_args, argnums=argnums)(X, Y))


@pytest.mark.parametrize("composition", ["hessian", "jacrev(jacrev)", "vmap(hessian)"])
def test_second_derivatives_of_logsigmoid(composition):
    """log_sigmoid's backward reads a buffer saved by its forward: a derivative through it
    must come from the native double backward (the decomposition gave zero Hessians)."""
    f = lambda x: F.logsigmoid(x * 1.5).sum()  # noqa: E731
    xs = torch.randn(3, 5, dtype=torch.float64)

    def run(lib):
        return {"hessian": lambda: lib.hessian(f)(xs[0]),
                "jacrev(jacrev)": lambda: lib.jacrev(lib.jacrev(f))(xs[0]),
                "vmap(hessian)": lambda: lib.vmap(lib.hessian(f))(xs)}[composition]()

    assert_tree_close(run(tl), run(tf))


def test_jvp_through_in_place_writes_to_views_of_a_fresh_tensor():
    """``out = x.new_empty(...); out.narrow(...).copy_(x...)``, as circular padding does:
    the tangent written through each view reaches the base and the other views."""
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    t = torch.randn(2, 3, 4, dtype=torch.float64)

    def f(x):
        out = x.new_empty(2, 3, 7)
        out.narrow(2, 1, 4).copy_(x)
        out.narrow(2, 0, 1).copy_(out.narrow(2, 4, 1))  # reads what the first write wrote
        out.narrow(2, 5, 2).copy_(out.narrow(2, 1, 2))
        return out

    assert_tree_close(tl.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)))
    g = lambda x: F.pad(x, (1, 2), mode="circular")  # noqa: E731
    assert_tree_close(tl.jvp(g, (x,), (t,)), tf.jvp(g, (x,), (t,)))
    assert_tree_close(tl.jacfwd(g)(x), tf.jacfwd(g)(x))


def _writes_between_ops(x):
    y = x.sin()
    y.mul_(2)  # in place: a new primal, the tangent written into the old one
    v = y[:2]
    v.add_(x[:2].exp())  # through a view: the base's tangent too
    z = y.cos() * v.sum()
    z[1:].zero_()  # a constant part
    w = z * 2
    w.copy_(w.detach())  # no tangent at all from here
    return y.exp() + z + w


@pytest.mark.parametrize("where", ["jvp", "vmap(jvp)", "jacfwd", "jvp(jvp)", "jvp(grad)",
                                   "jvp in the user's dual level"])
def test_a_results_dual_is_reused_and_stays_right_through_writes(where, monkeypatch):
    """A jvp level keeps the dual tensor an op gave and hands it to the next op on that
    result, where making one anew checks its layout (two trips through each enclosing
    vmap level): only the inputs are made duals. In-place writes, views, zeroed and
    detached values give torch.func's tangents; in a dual level the user entered (which
    the user may exit and enter anew, clearing every tangent), every dual is made anew."""
    import torch.autograd.forward_ad as fwAD

    import torchlevels.autodiff as autodiff

    x, t = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    xs, ts = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)

    def chain(x):
        return x.sin().cos().exp().tanh().sin()

    def run(lib, f):
        return {
            "jvp": lambda: lib.jvp(f, (x,), (t,)),
            "vmap(jvp)": lambda: lib.vmap(lambda x, t: lib.jvp(f, (x,), (t,)))(xs, ts),
            "jacfwd": lambda: lib.jacfwd(f)(x),
            "jvp(jvp)": lambda: lib.jvp(lambda x: lib.jvp(f, (x,), (t,))[1], (x,), (t,)),
            "jvp(grad)": lambda: lib.jvp(lib.grad(lambda x: f(x).sum()), (x,), (t,)),
            "jvp in the user's dual level": lambda: lib.jvp(f, (x,), (t,)),
        }[where]()

    made = []
    make_dual = autodiff._make_dual
    monkeypatch.setattr(autodiff, "_make_dual",
                        lambda *a, **k: made.append(1) or make_dual(*a, **k))
    if where == "jvp in the user's dual level":  # (where torch.func's jvp refuses to run)
        want = run(tf, chain), run(tf, _writes_between_ops)
        with fwAD.dual_level():
            assert_tree_close(run(tl, chain), want[0])
            assert len(made) == 5  # its input, then each of the 4 results
            assert_tree_close(run(tl, _writes_between_ops), want[1])
        return
    assert_tree_close(run(tl, chain), run(tf, chain))
    if where == "jvp":
        assert len(made) == 1  # the input's dual only
    if where in ("vmap(jvp)", "jacfwd"):
        assert not made  # each op made its duals of the physical tensors (jvp_over_vmap.py)
    assert_tree_close(run(tl, _writes_between_ops), run(tf, _writes_between_ops))


@pytest.mark.parametrize("decomposition", ["cholesky", "eigh"])
def test_hessian_is_reverse_over_reverse(decomposition):
    """torchlevels.hessian is jacrev(jacrev). Through a function of a symmetric matrix
    (``op(a + a.mT)``) it equals torch.func.hessian (jacfwd(jacrev)). Applied to the raw
    matrix, of which these ops read one triangle, PyTorch's derivative formulas (which
    assume symmetric perturbations) make the second derivative depend on the AD order:
    it then gives torch.func's jacrev(jacrev) numbers."""
    op = {"cholesky": torch.linalg.cholesky, "eigh": lambda a: torch.linalg.eigh(a)[1]}[
        decomposition]
    w = torch.randn(4, 4, dtype=torch.float64)
    b = torch.randn(4, 4, dtype=torch.float64)
    a = b @ b.T + 4 * torch.eye(4, dtype=torch.float64)
    symmetrized = lambda a: (op(a + a.mT) * w).sum()  # noqa: E731
    raw = lambda a: (op(a) * w).sum()  # noqa: E731
    assert_tree_close(tl.hessian(symmetrized)(a), tf.hessian(symmetrized)(a))
    assert_tree_close(tl.hessian(raw)(a), tf.jacrev(tf.jacrev(raw))(a))
    # what the docstring says to write for torch.func's numbers there
    assert_tree_close(tl.jacfwd(tl.jacrev(raw))(a), tf.hessian(raw)(a))
    # both orders agree on symmetric directions
    e1, e2 = b + b.T, w + w.T
    along = lambda h: torch.einsum("ij,ijkl,kl->", e1, h, e2)  # noqa: E731
    torch.testing.assert_close(along(tl.hessian(raw)(a)), along(tf.hessian(raw)(a)))


def test_hessian_through_no_grad_is_reverse_over_reverse():
    """A no_grad block is constant to both reverse passes, as in autograd's own Hessian;
    torch.func's forward pass goes through it. jacfwd(jacrev) gives torch.func's."""
    def f(x):
        with torch.no_grad():
            scale = x.exp()
        return (scale * x.exp() * x).sum()

    x = torch.randn(3, dtype=torch.float64)
    assert_tree_close(tl.hessian(f)(x), torch.autograd.functional.hessian(f, x))
    assert_tree_close(tl.jacfwd(tl.jacrev(f))(x), tf.hessian(f)(x))


@pytest.mark.parametrize("opinfo", ["linalg.norm.subgradients_at_zero", "masked.logaddexp"])
def test_hessian_at_non_differentiable_points_is_reverse_over_reverse(opinfo):
    """At a point that is not twice differentiable (a norm at zero; logaddexp where a
    mask leaves -inf), PyTorch's formulas give NaN second derivatives in
    reverse-over-reverse and numbers in forward-over-reverse: on these OpInfo samples
    torchlevels.hessian (jacrev(jacrev)) gives torch.func's jacrev(jacrev) NaNs."""
    import opinfo_autodiff_harness as harness
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if ".".join(filter(None, (o.name, o.variant_test_name))) == opinfo)

    def hessians(lib, case, order):
        xs = harness._inputs(case)
        argnums = tuple(range(len(xs)))
        return order(lib)(harness.scalar_fn(case), argnums=argnums)(*xs)

    def nan(tree):
        return any(t.isnan().any() for t in tree_flatten(tree)[0])

    hessian = lambda lib: lib.hessian  # noqa: E731  (torch.func's is forward-over-reverse)
    jacrev_jacrev = lambda lib: (  # noqa: E731
        lambda f, argnums: lib.jacrev(lib.jacrev(f, argnums=argnums), argnums=argnums))
    case = next(c for c in harness.cases(op, 4, harness.JAC_SCAN, small=True)
                if not nan(hessians(tf, c, hessian)) and nan(hessians(tf, c, jacrev_jacrev)))
    ours = hessians(tl, case, hessian)
    assert nan(ours)
    assert_tree_close(ours, hessians(tf, case, jacrev_jacrev), equal_nan=True)


@pytest.mark.parametrize("order", ["left to right", "matrix-vector first"])
def test_vmap_of_hessian_of_a_bilinear_form(order):
    """``x.tanh() @ A @ x.sin()``: a vector-matrix product first, once a failure here."""
    a = torch.randn(6, 6)
    f = {"left to right": lambda x: x.tanh() @ a @ x.sin(),
         "matrix-vector first": lambda x: x.tanh() @ (a @ x.sin())}[order]
    xs = torch.randn(4, 6)
    assert_tree_close(tl.vmap(tl.hessian(f))(xs), tf.vmap(tf.hessian(f))(xs))
    assert_tree_close(tl.hessian(f)(xs[0]), tf.hessian(f)(xs[0]))


def test_hessian_of_matrix_input_and_pytree_input():
    f = lambda m: (m @ m.T).sin().sum()
    assert_tree_close(tl.hessian(f)(M), tf.hessian(f)(M))
    assert_tree_close(tl.hessian(mlp_loss)(PARAMS, M), tf.hessian(mlp_loss)(PARAMS, M))


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 3, 5, 100])
def test_jacrev_chunk_size_gives_the_same_jacobian(chunk_size):
    args = (X, Y)
    assert_tree_close(tl.jacrev(multi_out, argnums=(0, 1), chunk_size=chunk_size)(*args),
                      tf.jacrev(multi_out, argnums=(0, 1), chunk_size=chunk_size)(*args))
    f = lambda m: m.sin() @ torch.ones(3, 4)
    assert_tree_close(tl.jacrev(f, chunk_size=chunk_size)(M),
                      tf.jacrev(f, chunk_size=chunk_size)(M))


@pytest.mark.parametrize("chunk_size", [0, -1])
def test_jacrev_bad_chunk_size_raises(chunk_size):
    assert_same_error(lambda lib: lib.jacrev(torch.sin, chunk_size=chunk_size)(X), "chunk_size")


def test_jacfwd_randomness_error_mode_raises():
    assert_same_error(lambda lib: lib.jacfwd(lambda a: a * torch.rand(3))(X), "randomness")
    assert_same_error(lambda lib: lib.jacfwd(lambda a: a * torch.rand(3),
                                             randomness="bogus")(X), "randomness")


@pytest.mark.parametrize("f", [
    lambda a: a * torch.rand(()),
    lambda a: a * torch.rand(6),
    lambda a: F.dropout(a, 0.5),
], ids=["rand scalar", "rand vector", "dropout"])
@pytest.mark.cpu_only("CUDA's generator: one draw of the batch is not the loop's")
def test_jacfwd_randomness_same_matches_torch_func_with_a_seed(f):
    a = torch.randn(6)
    torch.manual_seed(7)
    ours = tl.jacfwd(f, randomness="same")(a)
    torch.manual_seed(7)
    theirs = tf.jacfwd(f, randomness="same")(a)
    assert_tree_close(ours, theirs)


def test_jacfwd_randomness_different_draws_per_column():
    a = torch.randn(64)
    torch.manual_seed(0)
    jac = tl.jacfwd(lambda v: v * torch.rand(()), randomness="different")(a)
    diag = torch.diagonal(jac)
    assert jac.shape == (64, 64)
    assert torch.count_nonzero(jac - torch.diag(diag)) == 0  # still elementwise
    assert ((diag >= 0) & (diag < 1)).all() and diag.unique().numel() > 32  # one draw each
    torch.manual_seed(0)
    same = tl.jacfwd(lambda v: v * torch.rand(()), randomness="same")(a)
    assert torch.diagonal(same).unique().numel() == 1


def test_vmap_randomness_different_reaches_inside_grad():
    """Dropout of a grad-level tensor unbatched at the vmap level: each example draws its
    own mask, and the gradient is that mask scaled (as torch.func computes it)."""
    w, xs = torch.randn(64), torch.randn(8)
    grads = {}
    for lib in (tl, tf):
        torch.manual_seed(0)
        per_example = lambda x, lib=lib: lib.grad(lambda w: F.dropout(w, 0.5).sum())(w)
        grads[lib] = lib.vmap(per_example, randomness="different")(xs)
    for g in grads.values():
        assert g.shape == (8, 64)
        assert set(g.unique().tolist()) <= {0.0, 2.0}
        assert len({tuple(row.tolist()) for row in g}) == 8  # a different mask per example
    assert 0.3 < (grads[tl] == 2.0).float().mean() < 0.7


def test_jacfwd_randomness_different_with_dropout():
    a = torch.randn(64)
    torch.manual_seed(0)
    jac = tl.jacfwd(lambda v: F.dropout(v, 0.5), randomness="different")(a)
    diag = torch.diagonal(jac)
    assert jac.shape == (64, 64)
    assert torch.count_nonzero(jac - torch.diag(diag)) == 0
    assert set(diag.unique().tolist()) <= {0.0, 2.0}
    assert 0.2 < (diag == 2.0).float().mean() < 0.8


# -- grad mode: the torch.func docs' Case 1 and Case 2 --------------------------------

def case_f(x):
    with torch.no_grad():
        c = x ** 2
    return x - c


@pytest.mark.parametrize("api", ["grad", "grad_and_value"])
def test_case1_no_grad_inside_f_is_respected(api):
    x = torch.tensor(1.5)
    assert_tree_close(getattr(tl, api)(case_f)(x), getattr(tf, api)(case_f)(x))


def test_case1_no_grad_inside_f_for_vjp_jacrev_jacfwd():
    g = lambda v: v.sin() * case_f(v)
    out, fn = tl.vjp(g, X)
    out_f, fn_f = tf.vjp(g, X)
    assert_tree_close((out, fn(Y)), (out_f, fn_f(Y)))
    assert_tree_close(tl.jacrev(g)(X), tf.jacrev(g)(X))
    assert_tree_close(tl.jvp(g, (X,), (Y,)), tf.jvp(g, (X,), (Y,)))


@pytest.mark.parametrize("api", ["grad", "grad_and_value"])
def test_case2_grad_inside_outer_no_grad_still_differentiates(api):
    x = torch.tensor(1.5)
    with torch.no_grad():
        ours = getattr(tl, api)(case_f)(x)
        mid = tl.grad(lambda v: (v ** 3).sum())(X)
    with torch.no_grad():
        theirs = getattr(tf, api)(case_f)(x)
        mid_f = tf.grad(lambda v: (v ** 3).sum())(X)
    assert_tree_close((ours, mid), (theirs, mid_f))


def test_case2_vjp_jvp_jacrev_inside_outer_no_grad():
    g = lambda v: v.sin() ** 2
    with torch.no_grad():
        out, fn = tl.vjp(g, X)
        ours = (out, fn(Y), tl.jvp(g, (X,), (Y,)), tl.jacrev(g)(X), tl.hessian(g)(X))
        out_f, fn_f = tf.vjp(g, X)
        theirs = (out_f, fn_f(Y), tf.jvp(g, (X,), (Y,)), tf.jacrev(g)(X), tf.hessian(g)(X))
    assert_tree_close(ours, theirs)


def test_outer_no_grad_results_do_not_require_grad_like_torch_func():
    x = X.clone().requires_grad_()
    f = lambda v: (v.sin() ** 2).sum()

    def results(lib):
        with torch.no_grad():
            out, fn = lib.vjp(torch.sin, x)
            return (*lib.grad_and_value(f)(x), out, fn(Y)[0], *lib.jvp(torch.sin, (x,), (Y,)))

    assert [t.requires_grad for t in results(tl)] == [t.requires_grad for t in results(tf)]


def test_grad_level_does_not_leak_enable_grad():
    with torch.no_grad():
        tl.grad(lambda v: (v ** 2).sum())(X)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


# -- what t.requires_grad says inside the transforms -------------------------------------

def _flags_seen(lib, composition):
    """``requires_grad`` of an input, a result, a factory tensor, a detached copy and a
    captured plain tensor, as read inside ``composition``'s function."""
    seen = []
    c = torch.randn(3)

    def f(x):
        seen.append([x.requires_grad, (x * 2).requires_grad, torch.ones(3).requires_grad,
                     x.detach().requires_grad, (c * 2).requires_grad, (x * c).requires_grad])
        return (x.sin() * c).sum()

    v, g, j, h = lib.vmap, lib.grad, lib.jacfwd, lib.hessian
    run = {
        "grad": lambda x: g(f)(x[0]),
        "vmap": lambda x: v(f)(x),
        "jacfwd": lambda x: j(f)(x[0]),
        "hessian": lambda x: h(f)(x[0]),
        "vmap(grad)": lambda x: v(g(f))(x),
        "grad(vmap)": lambda x: g(lambda y: v(f)(y).sum())(x),
        "grad(grad)": lambda x: g(lambda y: g(f)(y).sum())(x[0]),
        "vmap over a tensor that requires grad": lambda x: v(f)(x.requires_grad_()),
    }[composition]
    run(torch.randn(2, 3))
    return seen


@pytest.mark.parametrize("composition", [
    "grad", "vmap", "jacfwd", "hessian", "vmap(grad)", "grad(vmap)", "grad(grad)",
    "vmap over a tensor that requires grad"])
def test_requires_grad_inside_transforms_answers_as_torch_func(composition):
    assert _flags_seen(tl, composition) == _flags_seen(tf, composition)


def test_code_that_branches_on_requires_grad_gets_the_gradient():
    def f(x, w):  # computes the gradient-carrying path only when it is needed
        return (x * w).sum() if w.requires_grad else (x * w.detach()).sum()

    x, w = torch.randn(3), torch.randn(3)
    assert_tree_close(tl.grad(f, argnums=1)(x, w), tf.grad(f, argnums=1)(x, w))
    assert_tree_close(tl.vmap(tl.grad(f, argnums=1), in_dims=(0, None))(X, w),
                      tf.vmap(tf.grad(f, argnums=1), in_dims=(0, None))(X, w))


# -- tensor hooks and grad_fn inside the transforms ----------------------------------------


def _hooked(x, scale=2.0):
    """A loss whose intermediate ``y`` and input ``x`` carry gradient hooks."""
    x.register_hook(lambda g: g * 3)
    y = x.sin()
    y.register_hook(lambda g: g * scale)
    return (y * x).sum()


HOOKED = {
    "grad": lambda lib: lib.grad(_hooked)(X),
    "vmap(grad)": lambda lib: lib.vmap(lib.grad(_hooked))(M),
    "grad(grad)": lambda lib: lib.grad(lambda x: lib.grad(lambda u: _hooked(u * x))(x).sum())(X),
    "hessian": lambda lib: lib.hessian(_hooked)(X),
    "jacrev": lambda lib: lib.jacrev(lambda x: (x.register_hook(lambda g: g * 3), x.sin())[1])(X),
    "vjp": lambda lib: lib.vjp(_hooked, X)[1](torch.tensor(1.0)),
    "jacfwd(jacrev)": lambda lib: lib.jacfwd(lib.jacrev(_hooked))(X),
}


@pytest.mark.parametrize("composition", HOOKED)
def test_tensor_hooks_inside_transforms_run_as_in_torch_func(composition):
    """Each grad level runs the hooks of its own tensors in its own backward pass (before,
    torchlevels ignored them: a silently different gradient)."""
    assert_tree_close(HOOKED[composition](tl), HOOKED[composition](tf))


def test_a_hook_runs_in_its_levels_pass_only_not_in_autograds_outside():
    """The hook's tensor is in the history autograd outside keeps too (through ``w``, or
    ``x`` requiring grad): differentiating the gradient there must not run it again."""
    w = torch.randn(3, requires_grad=True)

    def f(x, w):
        y = x * w
        y.register_hook(lambda g: g * 2)
        return (y * y).sum()

    def run(lib):
        through_w = torch.autograd.grad(lib.grad(f)(X, w).sum(), w)
        per_example = torch.autograd.grad(lib.vmap(lib.grad(f), in_dims=(0, None))(M, w).sum(), w)
        x = X.clone().requires_grad_()
        through_x = torch.autograd.grad(lib.grad(_hooked)(x).sum(), x)
        return through_w, per_example, through_x

    assert_tree_close(run(tl), run(tf))


def test_a_removed_hook_does_not_run():
    def f(x):
        y = x.sin()
        y.register_hook(lambda g: g * 2).remove()
        return (y * x).sum()

    assert_tree_close(tl.grad(f)(X), tf.grad(f)(X))


def test_hook_on_a_tensor_no_grad_level_tracks_raises_as_in_torch_func():
    assert_same_error(lambda lib: lib.grad(lambda x: lib.vmap(_hooked)(x).sum())(M),
                      "cannot register a hook on a tensor that doesn't require gradient")


def test_grad_fn_inside_grad_answers_as_torch_func():
    def names(x):
        y = x.sin()
        c = torch.ones(3) * 2
        return [None if t.grad_fn is None else type(t.grad_fn).__name__
                for t in (x, y, y * x, c, x.detach())]

    def f(lib):
        seen = []
        lib.grad(lambda x: (seen.append(names(x)), x.sum())[1])(X)
        lib.vmap(lib.grad(lambda x: (seen.append(names(x)), x.sum())[1]))(M)
        return seen

    assert f(tl) == f(tf)


def test_is_leaf_inside_grad_answers_as_torch_func():
    def leaves(lib):
        seen = []

        def f(x):
            y = x.sin()
            seen.append([t.is_leaf for t in (x, y, y * x, torch.ones(3) * 2, x.detach())])
            return y.sum()

        lib.grad(f)(X)
        lib.vmap(lib.grad(f))(M)
        return seen

    assert leaves(tl) == leaves(tf)


@pytest.mark.parametrize("flag", [False, True])
def test_requires_grad_inplace_inside_grad(flag):
    """A no-op when it changes nothing; else an error, as torch.func raises for any call
    (before, ``requires_grad_(False)`` on an intermediate was silently ignored)."""
    def f(x):
        y = x * 2 if flag is False else (x * 2).detach()
        assert y.requires_grad_(not flag) is y
        y.requires_grad_(flag)
        return (y * x).sum()

    with pytest.raises(RuntimeError, match=rf"requires_grad_\({flag}\) was called on a "
                       "tensor of grad"):
        tl.grad(f)(X)


def test_a_parameter_made_of_a_tracked_tensor_is_refused_with_functional_call_as_the_fix():
    """nn.Parameter(t) detaches t: torch.func answers a zero gradient through it."""
    linear = torch.nn.Linear(3, 2, dtype=X.dtype)

    def through_a_parameter(w):
        linear.weight = torch.nn.Parameter(w)
        return linear(X).sum()

    def through_functional_call(w):
        return tf.functional_call(linear, {"weight": w}, (X,)).sum()

    w = torch.randn(2, 3, dtype=X.dtype)
    with pytest.raises(RuntimeError, match=r"nn.Parameter\(t\) calls it too.*functional_call"):
        tl.grad(through_a_parameter)(w)
    assert not tf.grad(through_a_parameter)(w).any()
    assert_tree_close(tl.grad(through_functional_call)(w), tf.grad(through_functional_call)(w))
    assert tl.grad(through_functional_call)(w).any()


def test_code_that_branches_on_grad_fn_gets_the_gradient():
    f = lambda x: (w := x.sin()).sum() * (1.0 if w.grad_fn is None else 2.0)
    assert_tree_close(tl.grad(f)(X), tf.grad(f)(X))


@pytest.mark.parametrize("call", ["retain_grad", "backward"])
def test_retain_grad_and_backward_inside_grad_raise_clearly(call):
    def f(x):
        y = x.sin().sum()
        getattr(y, call)()
        return y

    assert_same_error(lambda lib: lib.grad(f)(X), f"{call}() was called on a tensor of grad")


# -- .data and detach_() inside the transforms ------------------------------------------

UNTRACKED = {  # each stops this level, and only it, from tracking a value
    "grad .data": lambda lib: lib.grad(lambda v: (v * v.data).sum())(X),
    "grad detach_": lambda lib: lib.grad(lambda v: (v * (v * 2).detach_()).sum())(X),
    "vmap(grad) .data": lambda lib: lib.vmap(lib.grad(lambda v: (v * v.data).sum()))(M),
    "grad(grad) .data": lambda lib: lib.grad(
        lambda u: lib.grad(lambda v: (v * v.data * u).sum())(u).sum())(X),
    "grad(grad) detach_": lambda lib: lib.grad(
        lambda u: lib.grad(lambda v: (v * (v * 1).detach_() * u).sum())(u).sum())(X),
    "grad(grad) detach": lambda lib: lib.grad(  # out of place: every level, as torch.func
        lambda u: lib.grad(lambda v: (v * v.detach() * u).sum())(u).sum())(X),
    "jvp(grad) .data": lambda lib: lib.jvp(lib.grad(lambda v: (v * v.data).sum()), (X,), (Y,)),
    "hessian .data": lambda lib: lib.hessian(lambda v: (v * v.data * v).sum())(X),
    "jvp .data": lambda lib: lib.jvp(lambda v: v * v.data, (X,), (Y,)),
    "jvp detach_": lambda lib: lib.jvp(lambda v: v * (v * 2).detach_(), (X,), (Y,)),
    "jacfwd .data": lambda lib: lib.jacfwd(lambda v: v.sin() * v.data)(X),
    "vmap(jvp) detach_": lambda lib: lib.vmap(
        lambda v: lib.jvp(lambda u: u * (u * 2).detach_(), (v,), (v.cos(),)))(M),
    "jacfwd(jacrev) .data": lambda lib: lib.jacfwd(lib.jacrev(lambda v: (v * v.data * v).sum()))(X),
}


@pytest.mark.parametrize("case", UNTRACKED)
def test_data_and_detach_inplace_inside_grad_and_jvp_as_in_torch_func(case):
    """Before, grad and jvp ignored both (``.data`` reached the level as autograd's own
    shallow copy, which keeps its history and tangent; PyTorch does ``detach_`` above the
    Python key): a silently different derivative."""
    assert_tree_close(UNTRACKED[case](tl), UNTRACKED[case](tf))


# -- torch.autograd.grad inside a grad level -----------------------------------------------


def _slope_energy(v):
    """``sum(dy/dv * v)`` for ``y = sin(v).sum()``: a loss built on a first derivative."""
    (slope,) = torch.autograd.grad(v.sin().sum(), v, create_graph=True)
    return (slope * v).sum()


def _constant_slope(v):
    (slope,) = torch.autograd.grad(v.sin().sum(), v)  # no graph: a constant to the level
    return (slope * v).sum()


def _slope_of_intermediate(v):
    a = v * 2
    y = a.sin()
    (slope,) = torch.autograd.grad(y, a, grad_outputs=torch.ones_like(y), create_graph=True)
    return (slope * v).sum()


def _two_inputs(v):
    g1, g2 = torch.autograd.grad(v.sin().sum() * v.cos().sum(), [v, v], create_graph=True)
    return (g1 * g2).sum()


AUTOGRAD_GRAD_INSIDE = {
    "grad": lambda lib: lib.grad(_slope_energy)(X),
    "grad, no create_graph": lambda lib: lib.grad(_constant_slope)(X),
    "grad, intermediate and grad_outputs": lambda lib: lib.grad(_slope_of_intermediate)(X),
    "grad, a list of inputs": lambda lib: lib.grad(_two_inputs)(X),
    "vmap(grad)": lambda lib: lib.vmap(lib.grad(_slope_energy))(M),
    "hessian": lambda lib: lib.hessian(_slope_energy)(X),
    "jacrev": lambda lib: lib.jacrev(lambda v: torch.autograd.grad(
        (v.sin() * v).sum(), v, create_graph=True)[0])(X),
    "grad(grad)": lambda lib: lib.grad(lambda v: lib.grad(_slope_energy)(v * 2).sum())(X),
}


@pytest.mark.parametrize("composition", AUTOGRAD_GRAD_INSIDE)
def test_torch_autograd_grad_inside_a_grad_level_as_in_torch_func(composition):
    """It differentiates at the innermost grad level (before: PyTorch's 'does not require
    grad', since the level's graph is on the tensors its wrappers hold)."""
    assert_tree_close(AUTOGRAD_GRAD_INSIDE[composition](tl),
                      AUTOGRAD_GRAD_INSIDE[composition](tf))


@pytest.mark.parametrize("inner", ["vjp", "vjp(jacrev)"])
def test_a_vjp_made_inside_grad_is_not_taken_for_a_call_at_the_grad_level(inner):
    """vjp_fn runs PyTorch's autograd on the grad level's tensors: with one output a
    plain tensor tracked outside (it depends on a captured c alone), it was taken for a
    user's torch.autograd.grad at the grad level and refused (found by the property
    tests)."""
    def run(lib):
        x = torch.tensor([1.2328, -0.4], dtype=torch.float64).requires_grad_()
        c = torch.tensor([0.3, 0.9], dtype=torch.float64).requires_grad_()
        f = lambda t: t * c.cos() + t  # noqa: E731  (its Jacobian depends on c alone)
        g = f if inner == "vjp" else lib.jacrev(f)

        def vjp_ones(v):
            out, vjp_fn = lib.vjp(g, v)
            return vjp_fn(torch.ones_like(out) * v)[0]

        out = lib.grad(lambda v: vjp_ones(v).sum())(x)
        grads = (torch.autograd.grad(out.sum(), (x, c), allow_unused=True)
                 if out.requires_grad else (None, None))  # no history counts as zero
        return out, [torch.zeros(2, dtype=torch.float64) if g is None else g for g in grads]

    assert_tree_close(run(tl), run(tf))


def test_torch_autograd_grad_inside_grad_on_an_unused_leaf_raises_pytorchs_error():
    def f(v):
        (g,) = torch.autograd.grad(v.sum(), torch.ones(3, requires_grad=True))
        return g.sum()

    assert_same_error(lambda lib: lib.grad(f)(X), "not have been used in the graph")


def _leaf_made_inside(v):
    """A leaf made inside ``f`` and differentiated at the level, as torch.func allows."""
    w = torch.linspace(-1, 1, 3, requires_grad=True)
    (gw,) = torch.autograd.grad((w * v.sin()).sum() * (w * v).sum(), w, create_graph=True)
    return (gw * v).sum()


def test_torch_autograd_grad_inside_grad_of_a_leaf_made_inside_as_in_torch_func():
    """Before, refused: the leaf is a plain tensor, not one of the level's."""
    assert_tree_close(tl.grad(_leaf_made_inside)(X), tf.grad(_leaf_made_inside)(X))
    assert_tree_close(tl.hessian(_leaf_made_inside)(X), tf.hessian(_leaf_made_inside)(X))


_CRITIC = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _gradient_penalty_loss(params, x):
    """A critic's loss with a gradient penalty, as WGAN-GP trains it: the input gradient
    is taken at ``x.detach().requires_grad_()`` inside the function grad differentiates
    (torch.func refuses ``requires_grad_`` there)."""
    xi = x.detach().requires_grad_()
    out = torch.func.functional_call(_CRITIC, params, (xi,))
    (slope,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
    return ((slope.norm(dim=-1) - 1) ** 2).mean() + out.mean()


def _penalty_grads_by_autograd(params, x):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    grads = torch.autograd.grad(_gradient_penalty_loss(leaves, x), list(leaves.values()))
    return dict(zip(leaves, grads))


def test_gradient_penalty_inside_grad_and_per_sample_against_torch_autograd():
    """Before, refused: ``xi`` is a plain tensor (a BatchedTensor under vmap)."""
    params = {k: v.detach() for k, v in _CRITIC.named_parameters()}
    x = torch.randn(5, 4, generator=seeded(6))
    assert_tree_close(tl.grad(_gradient_penalty_loss)(params, x),
                      _penalty_grads_by_autograd(params, x))
    per_sample = tl.vmap(tl.grad(_gradient_penalty_loss), in_dims=(None, 0))(params, x[:, None])
    rows = [_penalty_grads_by_autograd(params, x[i:i + 1]) for i in range(len(x))]
    assert_tree_close(per_sample, {k: torch.stack([r[k] for r in rows]) for k in params})


def _input_slope_loss(w, x):
    xi = x.detach().requires_grad_()
    out = (xi @ w.T).tanh().sum()
    (slope,) = torch.autograd.grad(out, xi, create_graph=True)
    return (slope ** 2).sum() + out


@pytest.mark.parametrize("second", ["jacrev", "jacfwd"])
def test_second_derivatives_through_an_input_slope_against_torch_autograd(second):
    w = torch.randn(3, 4, dtype=torch.float64, generator=seeded(7))
    x = torch.randn(4, dtype=torch.float64, generator=seeded(8))
    expected = torch.autograd.functional.jacobian(
        lambda w: torch.autograd.grad(_input_slope_loss(w, x), w, create_graph=True)[0], w)
    got = getattr(tl, second)(tl.grad(_input_slope_loss))(w, x)
    assert_tree_close(got, expected)


def test_torch_autograd_grad_inside_grad_on_a_tensor_of_an_unrelated_level_raises_clearly():
    with tl.vmap() as B:  # live, but in another context than the grad level
        kept = B(torch.ones(2, 3, requires_grad=True))

        def f(v):
            return torch.autograd.grad(v.sin().sum(), (v, kept))[0].sum()

        with pytest.raises(tl.UnrelatedLevelsError, match="not nested around it"):
            contextvars.Context().run(tl.grad(f), X)


def test_torch_autograd_grad_inside_grad_on_an_escaped_tensor_raises_clearly():
    def f(v):
        with tl.vmap() as B:
            kept = B(torch.ones(2, 3, requires_grad=True))
        return torch.autograd.grad(v.sin().sum(), (v, kept))[0].sum()

    with pytest.raises(tl.EscapedTensorError, match="used after that level exited"):
        tl.grad(f)(X)


def test_torch_autograd_grad_outside_transforms_is_pytorchs():
    leaf = X.clone().requires_grad_()
    (g,) = torch.autograd.grad((leaf.sin() ** 2).sum(), leaf)
    torch.testing.assert_close(g, 2 * X.sin() * X.cos())
    assert torch.autograd.grad.__doc__ == torchlevels.autograd_grad.pytorch_grad.__doc__


def test_checkpoint_inside_grad():
    from torch.utils.checkpoint import checkpoint

    def f(x, use_reentrant):
        return checkpoint(lambda a: a.sin() * a, x, use_reentrant=use_reentrant).sum()

    leaf = X.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(leaf, False), leaf)
    assert_tree_close(tl.grad(f)(X, False), want)
    assert_tree_close(tl.vmap(tl.grad(f), in_dims=(0, None))(X, False), want)
    # the reentrant form is an autograd.Function without setup_context: refused, as by
    # torch.func, instead of a gradient that silently misses the checkpointed part
    with pytest.raises(RuntimeError, match="CheckpointFunction does not.*use_reentrant=False"):
        tl.grad(f)(X, True)


# a transform called under no_grad inside grad: what it computes is a constant outside
UNDER_NO_GRAD = {
    "grad_and_value value": lambda lib, x, w: lib.grad_and_value(
        lambda v: (v ** 3 * w).sum())(x)[1],
    "grad": lambda lib, x, w: lib.grad(lambda v: (v ** 3 * w).sum())(x),
    "grad has_aux aux": lambda lib, x, w: lib.grad(
        lambda v: ((v * w).sum(), v.sin() * w), has_aux=True)(x)[1],
    "vjp output": lambda lib, x, w: lib.vjp(lambda v: v.exp() * w, x)[0],
    "vjp_fn": lambda lib, x, w: lib.vjp(lambda v: v.exp() * w, x)[1](x)[0],
    "jacrev": lambda lib, x, w: lib.jacrev(lambda v: v.sin() * w)(x).sum(0),
    "hessian": lambda lib, x, w: lib.hessian(lambda v: (v.sin() * w).sum())(x).sum(0),
    "jvp output": lambda lib, x, w: lib.jvp(lambda v: v.exp() * w, (x,), (x,))[0],
}


@pytest.mark.parametrize("case", list(UNDER_NO_GRAD))
@pytest.mark.parametrize("outer", ["grad", "vmap(grad)", "grad(grad)", "jvp", "jacrev"])
def test_a_transform_called_under_no_grad_inside_grad_is_a_constant_there(case, outer):
    """torch.func keeps each grad level's grad mode as at its entry: a transform entered
    under no_grad inside grad(h) computes a constant for h's level (and the levels around),
    whose own gradient (here of x ** 3 * c) leaves it out; the captured w is h's input
    too. Forward mode, jvp outside, still sees the tangent through it."""
    def h(lib):
        def h(x, w):
            with torch.no_grad():
                c = UNDER_NO_GRAD[case](lib, x, w)
            return (x ** 3 * c * w).sum()
        return h

    def run(lib):
        f = h(lib)
        if outer == "grad":
            return lib.grad(f, argnums=(0, 1))(X, Y)
        if outer == "vmap(grad)":
            return lib.vmap(lib.grad(f, argnums=(0, 1)), in_dims=(0, None))(X.expand(2, 3), Y)
        if outer == "grad(grad)":
            return lib.grad(lambda x, w: lib.grad(f)(x, w).sum(), argnums=(0, 1))(X, Y)
        if outer == "jvp":
            return lib.jvp(f, (X, Y), (Y, X))
        return lib.jacrev(lib.grad(f), argnums=(0, 1))(X, Y)

    assert_tree_close(run(tl), run(tf))


UNDER_FORWARD_GRAD_OFF = {
    "jvp output": lambda lib, x: lib.jvp(lambda v: v.sin() * Y + v * 2 + v * v, (x,), (x,))[0],
    "jvp tangent": lambda lib, x: lib.jvp(lambda v: v.sin() * Y + v * v, (x,), (x,))[1],
    "jacfwd": lambda lib, x: lib.jacfwd(lambda v: v.exp() * x)(x).sum(0),
    "no transform": lambda lib, x: x.sin() * 2,
}


@pytest.mark.parametrize("case", list(UNDER_FORWARD_GRAD_OFF))
def test_jvp_under_forward_grad_off_computes_its_tangent_as_in_torch_func(case):
    """jvp turns forward grad on inside, as torch.func's does (it gave zero tangents); a jvp
    level entered with it off is a constant to the jvp levels around, as in torch.func."""
    def run(lib):
        def h(x):
            with fwAD._set_fwd_grad_enabled(False):
                c = UNDER_FORWARD_GRAD_OFF[case](lib, x)
            return x * c + c.sin()
        return (lib.jvp(h, (X,), (Y,)), lib.jacfwd(h)(X), lib.grad(lambda x: h(x).sum())(X),
                lib.vmap(lambda x, t: lib.jvp(h, (x,), (t,)))(X.expand(2, 3), Y.expand(2, 3)))

    assert_tree_close(run(tl), run(tf))


TANGENT_LAYOUTS = {
    "contiguous": lambda t: t.contiguous(),
    "transposed": lambda t: t.t().contiguous().t(),
    "in a larger storage": lambda t: torch.cat([t, t]).view(2, *t.shape)[1],
}


@pytest.mark.parametrize("layout", list(TANGENT_LAYOUTS))
@pytest.mark.parametrize("write", ["base", "view"])
def test_a_views_tangent_follows_a_write_whatever_the_tangents_layout(layout, write):
    """A view taken before an in-place write into its base (or the write through the view)
    has the written tangent, for a tangent laid out unlike its primal too: forward AD's
    make_dual copies such a tangent, and each op's copy once left the view a stale one."""
    x, y, xt, yt = (torch.randn(2, 6, generator=seeded(k)) for k in range(4))

    def f(x, y):
        view = x[0, ::2]
        (x if write == "base" else view).copy_(y if write == "base" else y[0, ::2])
        return view, x

    def run(lib):
        tangent = TANGENT_LAYOUTS[layout](xt)
        both = lib.vmap(lambda a, b, at, bt: lib.jvp(f, (a.clone(), b), (at, bt)),
                        in_dims=(0, 0, 1, 0))
        examples = (t.expand(3, 2, 6).clone() for t in (x, y, xt, yt))
        xs, ys, xts, yts = (t + k for k, t in enumerate(examples))
        return (lib.jvp(f, (x.clone(), y), (tangent, yt)),
                both(xs, ys, xts.movedim(0, 1), yts))  # the tangents batched at dim 1

    assert_tree_close(run(tl), run(tf))


@pytest.mark.parametrize("lib", [tf, tl], ids=["torch.func", "torchlevels"])
def test_jvp_inside_a_custom_functions_forward(lib):
    """PyTorch turns forward grad off in Function.forward; jvp there still differentiates."""
    class MinusDerivativeOfCos(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return -lib.jvp(torch.cos, (x,), (torch.ones_like(x),))[1]

        @staticmethod
        def backward(ctx, g):
            return g

    torch.testing.assert_close(MinusDerivativeOfCos.apply(X), X.sin())


SPARSE_X = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1, 0], [2, 0, 2, 0]]),  # (0, 0)
                                   torch.tensor([3.0, 4.0, 5.0, 0.0]), (2, 3)).coalesce()
SPARSE_W = torch.randn(3, 4, generator=seeded(3))
ON_SPARSE = {
    "grad of sparse.mm": lambda lib: lib.grad(
        lambda s: torch.sparse.mm(s, SPARSE_W).sum())(SPARSE_X),
    "grad of sparse.sum": lambda lib: lib.grad(torch.sparse.sum)(SPARSE_X),
    "grad of to_dense": lambda lib: lib.grad(lambda s: s.to_dense().sum())(SPARSE_X),
    "grad of to_dense of a product": lambda lib: lib.grad(
        lambda s: (s * 2).to_dense().exp().sum())(SPARSE_X),
    "grad of grad": lambda lib: lib.grad(lambda s: lib.grad(
        lambda s: (s * 2).to_dense().pow(3).sum())(s).to_dense().sum())(SPARSE_X),
    "vjp of sparse.mm": lambda lib: lib.vjp(
        lambda s: torch.sparse.mm(s, SPARSE_W), SPARSE_X)[1](torch.ones(2, 4))[0],
    "grad of the weight": lambda lib: lib.grad(
        lambda w: torch.sparse.mm(SPARSE_X, w).sum())(SPARSE_W),
}


@pytest.mark.parametrize("case", list(ON_SPARSE))
def test_sparse_inputs_keep_their_layout_inside_a_transform_as_in_torch_func(case):
    """A level's tensor of a sparse COO tensor has its layout, and the gradient is sparse,
    as torch.func's. It said strided: sparse ops refused it, and the gradient of
    ``to_dense`` came back dense, nonzero where the input stores nothing."""
    ours, theirs = ON_SPARSE[case](tl), ON_SPARSE[case](tf)
    for a, b in zip(tree_flatten(ours)[0], tree_flatten(theirs)[0], strict=True):
        assert a.layout == b.layout
        torch.testing.assert_close(a.to_dense(), b.to_dense())


def _autograd_jacobian(f, x: torch.Tensor) -> torch.Tensor:
    """d f(x) / d x for a sparse ``x``, one torch.autograd.grad per output element."""
    x = x.clone().requires_grad_()
    out = f(x).flatten()
    rows = [torch.autograd.grad(o, x, retain_graph=True, allow_unused=True)[0] for o in out]
    rows = [torch.zeros(x.shape) if r is None else r.to_dense() for r in rows]
    return torch.stack(rows).view(*f(x).shape, *x.shape)


def test_jacrev_and_hessian_of_sparse_inputs_match_autograd_where_torch_func_raises():
    """The Jacobian's rows are batched gradients of ``to_dense``, which autograd makes with
    ``sparse_mask``: vmap keeps them dense. torch.func raises on both."""
    g = lambda s: (s * 2).to_dense().sin()  # noqa: E731
    f = lambda s: (s * 2).to_dense().pow(3).sum()  # noqa: E731
    with pytest.raises(NotImplementedError):
        tf.jacrev(g)(SPARSE_X)
    torch.testing.assert_close(tl.jacrev(g)(SPARSE_X), _autograd_jacobian(g, SPARSE_X))

    def grad_f(s):
        return torch.autograd.grad(f(s), s, create_graph=True)[0].to_dense()

    torch.testing.assert_close(tl.hessian(f)(SPARSE_X), _autograd_jacobian(grad_f, SPARSE_X))


def test_per_example_gradients_through_a_sparse_constant_match_a_loop():
    """torch.func raises (expand is unsupported for sparse tensors)."""
    ws = torch.randn(4, 3, 2, generator=seeded(4))
    loss = lambda w: torch.sparse.mm(SPARSE_X, w).pow(2).sum()  # noqa: E731
    leaves = [w.clone().requires_grad_() for w in ws.unbind()]
    loop = torch.stack([torch.autograd.grad(loss(w), w)[0] for w in leaves])
    torch.testing.assert_close(tl.vmap(tl.grad(loss))(ws), loop)


def test_torch_autograd_functional_inside_grad_raises_naming_what_to_call_instead():
    """torch.func raises too (its message names autograd.functional; ours the fix)."""
    f = lambda x: torch.autograd.functional.jacobian(torch.sin, x).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="autograd.functional"):
        tf.grad(f)(X)
    with pytest.raises(RuntimeError, match="torch.autograd.functional.*torchlevels' jacrev"):
        tl.grad(f)(X)


def test_a_transform_traced_by_torch_compile_through_allow_in_graph_says_so():
    """allow_in_graph makes dynamo run a transform on FakeTensors, which reach a level: the
    error says why and what to do (it was PyTorch's 'Multiple dispatch failed')."""
    import functools

    linear = torch.nn.Linear(2, 2)
    params = (dict(linear.named_parameters()), {})
    fn = tl.vmap(tl.jacfwd(tl.jacrev(lambda p, x: tl.functional_call(linear, p, x),
                                     argnums=1), argnums=1), in_dims=(None, 0))
    traced = torch._dynamo.allow_in_graph(fn)
    call = functools.wraps(traced)(lambda *a: traced(*a))
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="(?s)allow_in_graph.*torchlevels.compile"):
            torch.compile(call, backend="eager")(params, torch.randn(4, 2))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("lib", [tf, tl], ids=["torch.func", "torchlevels"])
def test_a_refused_saved_tensor_hook_leaves_hooks_usable_afterwards(lib):
    """hessian under save_on_cpu raises in both libraries; afterwards, save_on_cpu works
    again outside any transform (torchlevels once left hooks disabled for the process)."""
    def save_on_cpu_works():
        y = X.clone().requires_grad_()
        with torch.autograd.graph.save_on_cpu():
            (y * y).sum().backward()
        torch.testing.assert_close(y.grad, 2 * X)

    save_on_cpu_works()
    with pytest.raises(RuntimeError), torch.autograd.graph.save_on_cpu():
        lib.hessian(lambda v: v.sin().sum())(X)
    save_on_cpu_works()


# -- regular autograd on top of the transforms ----------------------------------------

def leaf():
    return X.clone().requires_grad_()


AUTOGRAD_ON_TOP = {
    "grad": lambda lib, x: lib.grad(lambda v: (v.sin() ** 2).sum())(x).sum(),
    "grad_and_value value": lambda lib, x: lib.grad_and_value(lambda v: (v.sin() ** 2).sum())(x)[1],
    "grad_and_value grad": lambda lib, x: lib.grad_and_value(
        lambda v: (v.sin() ** 2).sum())(x)[0].sum(),
    "grad has_aux aux": lambda lib, x: lib.grad(
        lambda v: ((v ** 2).sum(), v.exp().sum()), has_aux=True)(x)[1],
    "vjp output": lambda lib, x: lib.vjp(lambda v: v.sin() ** 2, x)[0].sum(),
    "vjp_fn": lambda lib, x: lib.vjp(lambda v: v.sin() ** 2, x)[1](Y)[0].sum(),
    "jvp output": lambda lib, x: lib.jvp(lambda v: v.sin() ** 2, (x,), (Y,))[0].sum(),
    "jvp tangent": lambda lib, x: lib.jvp(lambda v: v.sin() ** 2, (x,), (Y,))[1].sum(),
    "jacrev": lambda lib, x: lib.jacrev(lambda v: v.sin() ** 2)(x).sum(),
    "jacfwd": lambda lib, x: lib.jacfwd(lambda v: v.sin() ** 2)(x).sum(),
    "hessian": lambda lib, x: lib.hessian(lambda v: (v.sin() ** 3).sum())(x).sum(),
    "vmap(grad)": lambda lib, x: lib.vmap(lib.grad(lambda v: v.sin() ** 3))(x).sum(),
    "grad(grad)": lambda lib, x: lib.grad(lib.grad(lambda v: v.sin() ** 3))(x[0]),
}


@pytest.mark.parametrize("case", list(AUTOGRAD_ON_TOP))
def test_backward_through_a_transform_matches_torch_func(case):
    x, x_f = leaf(), leaf()
    AUTOGRAD_ON_TOP[case](tl, x).backward()
    AUTOGRAD_ON_TOP[case](tf, x_f).backward()
    assert x_f.grad is not None
    assert x.grad is not None, "the result lost its autograd history to x"
    torch.testing.assert_close(x.grad, x_f.grad)


def _weighted(w):
    return lambda v: ((v * w).sin() ** 2).sum()


def _elementwise(w):
    return lambda v: (v * w).sin() ** 2


# the function captures w, a tensor that autograd outside tracks: torch.func's results
# carry w's history, so autograd on top differentiates through the transform
CAPTURED_ON_TOP = {
    "grad": lambda lib, w: lib.grad(_weighted(w))(X).sum(),
    "grad plus w": lambda lib, w: lib.grad(_weighted(w))(X).sum() + w.sum(),
    "grad_and_value value": lambda lib, w: lib.grad_and_value(_weighted(w))(X)[1],
    "vjp output": lambda lib, w: lib.vjp(_elementwise(w), X)[0].sum(),
    "vjp_fn": lambda lib, w: lib.vjp(_elementwise(w), X)[1](Y)[0].sum(),
    "jvp tangent": lambda lib, w: lib.jvp(_elementwise(w), (X,), (Y,))[1].sum(),
    "jacrev": lambda lib, w: lib.jacrev(_elementwise(w))(X).sum(),
    "jacfwd": lambda lib, w: lib.jacfwd(_elementwise(w))(X).sum(),
    "hessian": lambda lib, w: lib.hessian(_weighted(w))(X).sum(),
    "vmap(grad)": lambda lib, w: lib.vmap(lib.grad(_weighted(w)))(X.expand(3, -1)).sum(),
    "grad(grad)": lambda lib, w: lib.grad(lambda v: lib.grad(_weighted(w))(v).sum())(X).sum(),
    "vmap(jacrev)": lambda lib, w: lib.vmap(lib.jacrev(_elementwise(w)))(X.expand(3, -1)).sum(),
}


@pytest.mark.parametrize("case", list(CAPTURED_ON_TOP))
def test_backward_through_a_captured_tensor_matches_torch_func(case):
    w, w_f = leaf(), leaf()
    (d,) = torch.autograd.grad(CAPTURED_ON_TOP[case](tl, w), w)
    (d_f,) = torch.autograd.grad(CAPTURED_ON_TOP[case](tf, w_f), w_f)
    torch.testing.assert_close(d, d_f)


def test_linearize_keeps_the_history_of_a_captured_tensor():
    # torch.func's linearize traces the function and drops w's history (its result
    # does not depend on w for autograd); ours matches jvp, whose tangent does
    w, w_f = leaf(), leaf()
    (d,) = torch.autograd.grad(tl.linearize(_elementwise(w), X)[1](Y).sum(), w)
    (d_f,) = torch.autograd.grad(tf.jvp(_elementwise(w_f), (X,), (Y,))[1].sum(), w_f)
    torch.testing.assert_close(d, d_f)


# per-sample gradients over unbatched parameters (the grad level's own leaves: the vmap
# level does not record their graph on the physical tensors) mixed with outer tensors
P = torch.randn(X.shape[-1], 3, dtype=X.dtype)
PER_SAMPLE_WITH_OUTER = {
    "captured": lambda w: lambda p, x: ((x @ p).sin() * w[:3]).sum(),
    "written in place": lambda w: lambda p, x: (x @ (p * 1).mul_(w[:3])).cos().sum(),
    "written through t_": lambda w: lambda p, x: (x @ (p * 1).t_().mul_(w[:3, None]).t_()
                                                   ).cos().sum(),
    "in a list": lambda w: lambda p, x: (torch.cat([p, w[:, None] * p]).t() @ x.repeat(2)
                                         ).tanh().sum(),
}


@pytest.mark.parametrize("case", list(PER_SAMPLE_WITH_OUTER))
def test_per_sample_gradients_with_outer_tensors_match_torch_func(case):
    xs = torch.randn(5, X.shape[-1], dtype=X.dtype)
    results = []
    for lib in (tl, tf):
        w = leaf()
        g = lib.vmap(lib.grad(PER_SAMPLE_WITH_OUTER[case](w)), in_dims=(None, 0))(P, xs)
        results.append((g, *torch.autograd.grad((g ** 2).sum(), w)))
    torch.testing.assert_close(results[0], results[1])


def test_per_sample_gradients_of_a_parameter_that_requires_grad_outside():
    xs = torch.randn(5, X.shape[-1], dtype=X.dtype)
    results = []
    for lib in (tl, tf):
        p = P.clone().requires_grad_()
        g = lib.vmap(lib.grad(lambda p, x: (x @ p).sin().sum()), in_dims=(None, 0))(p, xs)
        results.append(torch.autograd.grad((g ** 2).sum(), p))
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize("layer", ["F.linear", "nn.Linear", "F.linear of a product"])
def test_per_sample_gradients_through_linear_layers_of_weights_autograd_tracks(layer):
    # MAML's outer step, a per-example gradient penalty: F.linear is answered whole, and
    # its weight's leaf (a view of a weight autograd tracks) must stay in the grad level's
    # graph too (the per-example gradients were zeros, cut from autograd outside)
    xs = torch.randn(5, X.shape[-1], dtype=X.dtype)

    def per_example_gradients(lib):
        torch.manual_seed(0)
        net = torch.nn.Linear(X.shape[-1], 4, dtype=X.dtype)
        lam = torch.tensor(1.5, dtype=X.dtype, requires_grad=True)
        if layer == "nn.Linear":
            inputs = dict(net.named_parameters())
            f = lambda p, x: lib.functional_call(net, p, (x,)).tanh().sum()  # noqa: E731
        else:
            inputs = net.weight * lam if layer == "F.linear of a product" else net.weight
            f = lambda w, x: F.linear(x, w, net.bias).tanh().sum()  # noqa: E731
        g = torch.utils._pytree.tree_leaves(
            lib.vmap(lib.grad(f), in_dims=(None, 0))(inputs, xs))
        total = sum((t ** 2).sum() for t in g)
        return g, torch.autograd.grad(total, [net.weight, lam], allow_unused=True)

    torch.testing.assert_close(per_example_gradients(tl), per_example_gradients(tf))


def test_vmap_records_no_physical_graph_for_a_grad_levels_own_leaves():
    xs = torch.randn(5, X.shape[-1], dtype=X.dtype)
    with tl.vmap() as B, grad_level() as G:
        p = G(P)
        y = (B(xs) @ p).sin()
        physical = B.unwrap(G.unwrap(y))
        assert not physical.requires_grad  # only the grad level's graph, on B's tensors
        assert G.unwrap(y).requires_grad


# compositions of per-example transforms with autograd outside: the parameter p (not
# batched), the examples xs or a tensor w the function captures requires grad
def _outer_loss(w):
    return lambda p, x: ((x @ p) * w).tanh().pow(2).sum()


def _outer_vec(w):
    return lambda p, x: ((x @ p) * w).tanh()


OUTER_COMPOSITIONS = {
    "vmap(grad)": lambda lib, w, p, xs: lib.vmap(lib.grad(_outer_loss(w)),
                                                 in_dims=(None, 0))(p, xs),
    "vmap(grad wrt x)": lambda lib, w, p, xs: lib.vmap(lib.grad(_outer_loss(w), argnums=1),
                                                       in_dims=(None, 0))(p, xs),
    "grad(vmap)": lambda lib, w, p, xs: lib.grad(
        lambda p: lib.vmap(_outer_loss(w), in_dims=(None, 0))(p, xs).sum())(p),
    "vmap(jacrev)": lambda lib, w, p, xs: lib.vmap(lib.jacrev(_outer_vec(w)),
                                                   in_dims=(None, 0))(p, xs),
    "vmap(jacfwd)": lambda lib, w, p, xs: lib.vmap(lib.jacfwd(_outer_vec(w)),
                                                   in_dims=(None, 0))(p, xs),
    "vmap(hessian)": lambda lib, w, p, xs: lib.vmap(lib.hessian(_outer_loss(w)),
                                                    in_dims=(None, 0))(p, xs),
    "vmap(jvp)": lambda lib, w, p, xs: lib.vmap(lambda x: lib.jvp(
        lambda p: _outer_vec(w)(p, x), (p,), (torch.ones_like(p),))[1])(xs),
    "vmap(vmap(grad))": lambda lib, w, p, xs: lib.vmap(lib.vmap(
        lib.grad(_outer_loss(w)), in_dims=(None, 0)), in_dims=(None, 0))(p, xs.expand(2, -1, -1)),
}


@pytest.mark.parametrize("tracked", ["p", "xs", "captured w"])
@pytest.mark.parametrize("case", list(OUTER_COMPOSITIONS))
def test_autograd_outside_per_example_transforms_matches_torch_func(case, tracked):
    gen = seeded(0)
    p0, xs0, w0 = (torch.randn(*s, generator=gen, dtype=torch.float64)
                   for s in [(3, 3), (4, 3), (3,)])
    grads = []
    for lib in (tl, tf):
        p, xs, w = p0.clone(), xs0.clone(), w0.clone()
        wrt = {"p": p, "xs": xs, "captured w": w}[tracked].requires_grad_()
        out = OUTER_COMPOSITIONS[case](lib, w, p, xs)
        grads.append(torch.autograd.grad((out ** 2).sum(), wrt))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("transform", ["vmap(vjp)", "jacrev"])
def test_jacobians_wrt_a_layer_norms_weight_with_its_input_tracked_outside_are_autograds(
        transform):
    # torch.func's outside gradient is wrong here (found by a sweep of the OpInfos with a
    # captured argument autograd tracks); the reference is plain autograd, row by row
    gen = seeded(0)
    x0, w0, b0 = (torch.randn(*s, generator=gen, dtype=torch.float64)
                  for s in [(2, 3), (3,), (3,)])
    x, b = x0.clone().requires_grad_(), b0.clone().requires_grad_()
    f = lambda w: F.layer_norm(x, (3,), w, b)  # noqa: E731
    out, vjp_fn = tl.vjp(f, w0)
    cotangents = torch.eye(out.numel(), dtype=out.dtype).view(-1, *out.shape)
    if transform == "jacrev":
        rows = tl.jacrev(f)(w0).flatten(0, 1)
    else:
        rows = tl.vmap(vjp_fn)(cotangents)[0]
    got = torch.autograd.grad((rows * rows.cos()).sum(), x)  # (b: no part in the rows)
    w = w0.clone().requires_grad_()
    o = F.layer_norm(x, (3,), w, b)
    expected_rows = torch.stack([torch.autograd.grad(o, w, ct, create_graph=True)[0]
                                 for ct in cotangents])
    torch.testing.assert_close(rows, expected_rows)
    torch.testing.assert_close(
        got, torch.autograd.grad((expected_rows * expected_rows.cos()).sum(), x))


# ops whose forward-AD formula plain autograd cannot differentiate again (PyTorch's own
# forward AD then backward raises for them): under jvp with autograd outside
JVP_THEN_BACKWARD = {
    "softmax": lambda x: x.softmax(1),
    "log_softmax": lambda x: x.log_softmax(1),
    "logsumexp": lambda x: x.logsumexp(1),
    "1-norm": lambda x: torch.linalg.vector_norm(x, 1, 1),
    "cross_entropy": lambda x: F.cross_entropy(x, torch.tensor([0, 2])),
    "attention": lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),
    "logcumsumexp": lambda x: x.logcumsumexp(1),
    "complex logcumsumexp": lambda x: torch.view_as_real(torch.complex(x, x.cos()).logcumsumexp(0)),
}


@pytest.mark.parametrize("case", list(JVP_THEN_BACKWARD))
def test_autograd_outside_jvp_of_softmax_like_ops_matches_torch_func(case):
    x0 = torch.tensor([[1.2, 0.3, -0.5], [0.1, 2.0, -1.0]], dtype=torch.float64)
    grads = []
    for lib in (tl, tf):
        x = x0.clone().requires_grad_()
        t = lib.jvp(JVP_THEN_BACKWARD[case], (x,), (torch.ones_like(x) * 0.3 + x * 0.1,))[1]
        weights = torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)
        grads.append(torch.autograd.grad((t * weights).sum(), x))
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("order", [-0.5, 0.5, 2, 3])
@pytest.mark.parametrize("at", ["zero", "a point with a zero", "a point"])
def test_second_derivatives_of_vector_norms_with_autograd_outside_match_torch_func(order, at):
    """Every norm but the 1-norm keeps PyTorch's forward formula with autograd outside (it
    differentiates again); run as its decomposition, a negative order gave NaN at 0."""
    x0 = {"zero": torch.zeros(5), "a point with a zero": torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0]),
          "a point": torch.tensor([0.3, 1.0, -2.0, 0.5, 3.0])}[at].double()
    tangent = torch.linspace(-1, 1, 5, dtype=torch.float64)
    f = lambda x: torch.linalg.vector_norm(x, order)  # noqa: E731
    xs = [x0.clone().requires_grad_() for _ in range(2)]
    ours, theirs = (lib.jvp(lib.grad(f), (x,), (tangent,))[1] for lib, x in zip((tl, tf), xs))
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    assert not ours.isnan().any() or theirs.isnan().any()
    if at == "a point" and order < 1:  # autograd outside differentiates the tangent as
        # torch.func's (orders 2 and 3: PyTorch's formulas refuse, under torch.func too)
        torch.testing.assert_close(*(torch.autograd.grad(t.sum(), x)
                                     for t, x in zip((ours, theirs), xs)))


def test_autograd_grad_on_top_with_create_graph():
    f = lambda v: (v.sin() * v).sum()
    x, x_f = leaf(), leaf()
    g = tl.grad(f)(x)
    g_f = tf.grad(f)(x_f)
    (d,) = torch.autograd.grad(g.sum(), x, create_graph=True)
    (d_f,) = torch.autograd.grad(g_f.sum(), x_f, create_graph=True)
    torch.testing.assert_close(d, d_f)
    torch.testing.assert_close(torch.autograd.grad(d.sum(), x)[0],
                               torch.autograd.grad(d_f.sum(), x_f)[0])


def test_input_not_requiring_grad_gives_plain_results():
    g = tl.grad(lambda v: (v ** 2).sum())(X)
    out, fn = tl.vjp(torch.sin, X)
    for t in (g, out, fn(Y)[0]):
        assert type(t) is torch.Tensor and not t.requires_grad


# -- escapes and in-place mutation of captured tensors --------------------------------

def escape_through(api):
    box = []

    def stash(v):
        box.append(v * 2)
        return v

    calls = {
        "grad": lambda: tl.grad(lambda v: stash(v).sum())(X),
        "grad_and_value": lambda: tl.grad_and_value(lambda v: stash(v).sum())(X),
        "vjp": lambda: tl.vjp(stash, X),
        "jvp": lambda: tl.jvp(stash, (X,), (Y,)),
        "jacrev": lambda: tl.jacrev(stash)(X),
        "jacfwd": lambda: tl.jacfwd(stash)(X),
    }
    calls[api]()
    return box[0]


@pytest.mark.parametrize("api", ["grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd"])
@pytest.mark.parametrize("use", ["add", "sum", "matmul", "index"])
def test_tensor_escaping_a_level_raises(api, use):
    escaped = escape_through(api)
    uses = {
        "add": lambda t: t + 1,
        "sum": lambda t: t.sum(),
        "matmul": lambda t: t @ torch.ones(3),
        "index": lambda t: t[0],
    }
    with pytest.raises(EscapedTensorError, match="escaped"):
        uses[use](escaped)


def test_escaped_input_itself_raises_and_repr_says_so():
    box = []
    tl.grad(lambda v: box.append(v) or (v ** 2).sum())(X)
    with pytest.raises(EscapedTensorError):
        box[0].sum()
    assert "escaped" in repr(box[0])


def test_escape_into_a_later_transform_raises():
    box = []
    tl.grad(lambda v: box.append(v * 3) or (v ** 2).sum())(X)
    with pytest.raises(EscapedTensorError):
        tl.grad(lambda v: (v * box[0]).sum())(X)


def test_inplace_on_own_tensors_is_fine():
    # (torch.func also rejects captured.add_(1.0) inside f; torchlevels cannot see an op
    # that involves none of its tensors, so that case is not tested)
    def f(v):
        y = v.clone()
        y.mul_(captured)
        y[0] = y[1] * 3
        return (y ** 2).sum()

    captured = torch.full((3,), 2.0)
    assert_tree_close(tl.grad(f)(X), tf.grad(f)(X))
    assert_tree_close(tl.jvp(f, (X,), (Y,)), tf.jvp(f, (X,), (Y,)))


def test_an_in_place_op_that_grows_its_tensor_inside_grad():
    # addbmm_ resizes a one-element self to the product's shape, as its out= form does;
    # the level's wrapper must take the new, larger shape (the OpInfo variants sweep found
    # it failing to)
    b1, b2 = torch.randn(2, 3, 3), torch.randn(2, 3, 4)

    def f(x):
        y = x.clone()
        y.addbmm_(b1, b2)
        assert y.shape == (3, 4)
        return (y * y.detach()).sum()

    x = torch.randn(1)
    assert_tree_close(tl.grad(f)(x), tf.grad(f)(x))
    # under vmap the batched write cannot resize its examples and raises, where
    # torch.func leaves y of shape (1,) and returns gradients that match no example
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        tl.vmap(tl.grad(f))(x.expand(2, 1))


def _write_then_sum(a):
    y = a.clone()
    y[..., 0].mul_(a[..., 1])  # a write through a view: autograd keeps views' bases
    return (y.sin() * 2).sum()


def _hooked_slope(v):
    """A hook, torch.autograd.grad, .data and detach_() at the grad level."""
    y = v.sin()
    y.register_hook(lambda g: g * 2)
    (slope,) = torch.autograd.grad((y * v).sum(), v, create_graph=True)
    return (slope * v.data).sum() + (v * 2).detach_().sum()


@pytest.mark.parametrize("f", [lambda t: t.abs().abs(), lambda t: t.sign() * t.abs()],
                         ids=["abs of abs", "sign times abs"])
def test_autograd_on_top_of_zero_second_derivatives(f):
    """A backward formula's ZeroTensor (``sgn``'s) times a level's tensor went past the
    level (PyTorch's ZeroTensor kernels sit above the Python key), leaving the level's
    tensors in the history of a plain result: autograd on top of ``vmap(grad(grad))``
    then hit them after vmap exited. Found by the property tests."""
    def run(lib):
        x = torch.tensor([[1.2328], [-0.5]], dtype=torch.float64).requires_grad_()
        c = torch.tensor([0.3], dtype=torch.float64).requires_grad_()
        inner = lambda r: f(r * c.cos()).sum()
        out = lib.vmap(lib.grad(lambda s: lib.grad(inner)(s).sum()))(x)
        grads = torch.autograd.grad(out.sum(), (x, c), allow_unused=True)
        # torch.func's results are ZeroTensors, which cannot be read: add them to zeros
        return [None if t is None else torch.zeros(t.shape, dtype=t.dtype) + t
                for t in (out, *grads)]

    assert_tree_close(run(tl), run(tf))


def _write_through_view_then_abs(x):
    y = x.clone()
    y[...].mul_(x.cos())
    return y.abs().sum()


@pytest.mark.parametrize("compose", [
    lambda lib, f: lib.grad(lambda x: lib.grad(lambda x: lib.grad(f)(x).sum())(x).sum()),
    lambda lib, f: lib.jacrev(lib.jacrev(lib.jacrev(f))),
    lambda lib, f: lib.grad(lambda x: lib.jacrev(lib.jacrev(f))(x).sum()),
], ids=["grad(grad(grad))", "jacrev(jacrev(jacrev))", "grad(jacrev(jacrev))"])
def test_zero_second_derivative_into_an_in_place_write_through_a_view(compose):
    """``abs``'s second derivative, zeros made in a level's backward pass, reaches the
    backward of an in-place write through a view (CopySlices), which writes the values
    of the levels around into a copy of it. Plain zeros there were a captured tensor to
    those levels (CapturedMutationError); they now belong to the levels around the one
    running backward. Found by the property tests."""
    x = torch.randn(3, 4, dtype=torch.float64)
    assert_tree_close(compose(tl, _write_through_view_then_abs)(x),
                      compose(tf, _write_through_view_then_abs)(x))


def test_zero_second_derivative_into_a_write_under_vmap_matches_a_loop():
    """Under vmap the zeros are batched (the same for every example), so that the backward
    of the write through the view copies batched values into a batched copy of them.
    torch.func leaves them unbatched there, and raises."""
    x = torch.randn(3, 4, dtype=torch.float64)

    def g3(lib):
        return lib.grad(lambda x: lib.grad(lambda x: lib.grad(
            _write_through_view_then_abs)(x).sum())(x).sum())

    loop = torch.stack([g3(tf)(example) for example in x])
    assert_tree_close(tl.vmap(g3(tl))(x), loop)
    with pytest.raises(RuntimeError, match="vmapped over"):
        tf.vmap(g3(tf))(x)


class _BackwardFailed(Exception):
    pass


def _raise_backward_failed(grad):
    raise _BackwardFailed


def _fails_in_backward(x):
    y = x.sin()
    y.register_hook(_raise_backward_failed)  # (raised in the level's backward pass)
    return (y * x).sum()


def test_memory_flat_over_repeated_failing_backward_passes():
    """PyTorch's engine keeps the last backward pass that raised (and the level tensors
    in its traceback) until the next backward pass on the thread: failing calls hold at
    most that one, and a later backward pass frees it."""
    if torch.empty(0).is_cuda:
        pytest.xfail("known gap, seen on CUDA (H200, torch 2.11) and not yet explained: every "
                     "call keeps its level classes alive there, not on the CPU")
    g2 = tl.vmap(tl.grad(lambda x: tl.grad(_fails_in_backward)(x).sum()))
    x = torch.randn(3, 4, dtype=torch.float64)
    gc.collect()
    classes = set(LevelTensor.__subclasses__())
    for _ in range(20):
        with pytest.raises(_BackwardFailed):
            g2(x)
    gc.collect()
    assert len(set(LevelTensor.__subclasses__()) - classes) <= 1
    a = torch.ones(2, requires_grad=True)
    torch.autograd.grad(a.sum(), a)
    gc.collect()
    assert set(LevelTensor.__subclasses__()) <= classes


@pytest.mark.parametrize("name", ["vmap(grad)", "jvp", "jacrev", "hessian",
                                  "vmap(grad) with hooks"])
def test_memory_flat_over_repeated_autodiff_calls(name):
    if torch.empty(0).is_cuda and name != "jvp" and name != "jacrev":
        pytest.xfail("known gap, seen on CUDA (H200, torch 2.11) and not yet explained: every "
                     "call keeps its level classes alive there, not on the CPU")
    x = torch.randn(4, 3)
    call = {
        "vmap(grad)": lambda: tl.vmap(tl.grad(_write_then_sum))(x),
        "vmap(grad) with hooks": lambda: tl.vmap(tl.grad(_hooked_slope))(x),
        "jvp": lambda: tl.jvp(_write_then_sum, (x,), (x,)),
        "jacrev": lambda: tl.jacrev(lambda a: _write_then_sum(a) * a)(x),
        "hessian": lambda: tl.hessian(_write_then_sum)(x[0]),
    }[name]
    for _ in range(100):  # caches filled
        call()
    gc.collect()
    classes = set(LevelTensor.__subclasses__())  # an earlier test's failed backward may hold one
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(500):  # a level class or graph kept per call would be >= 1 KiB each
        call()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert after - before < 256 * 1024, f"memory grew by {after - before} bytes"
    assert set(LevelTensor.__subclasses__()) <= classes  # no level class kept alive


# -- the imperative API ---------------------------------------------------------------

def test_grad_level_docstring_example():
    with grad_level() as G:
        x = G(torch.tensor(3.0))
        y = x * x
        (d,) = torch.autograd.grad(G.unwrap(y), G.unwrap(x))
    torch.testing.assert_close(d, tf.grad(lambda v: v * v)(torch.tensor(3.0)))


def test_jvp_level_docstring_example():
    with jvp_level() as J:
        y = J(torch.tensor(3.0), torch.tensor(1.0)) ** 2
        out = J.unwrap(y)
    assert_tree_close(out, tf.jvp(lambda v: v ** 2, (torch.tensor(3.0),), (torch.tensor(1.0),)))


@pytest.mark.cpu_only("the examples print CPU tensors")
def test_autodiff_and_transforms_docstrings_run():
    vmap_module = sys.modules["torchlevels.vmap"]  # the package attribute is the function
    tools = [sys.modules[f"torchlevels.tools.{name}"]
             for name in ("flops", "forwarding", "oplog", "trace", "partial_eval")]
    for module in (torchlevels.autodiff, torchlevels.transforms, vmap_module,
                   sys.modules["torchlevels._level"], sys.modules["torchlevels._torch_compile"],
                   torchlevels.autograd_grad, sys.modules["torchlevels.l1_loss_weight"],
                   sys.modules["torchlevels.data_assignment"],
                   sys.modules["torchlevels.inner_duals"], sys.modules["torchlevels.math_bits"],
                   sys.modules["torchlevels._plain"],
                   sys.modules["torchlevels.cond"], sys.modules["torchlevels._process_state"],
                   *tools):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, module.__name__
        assert result.attempted > 0


def test_grad_level_imperative_matches_grad_on_a_function():
    f = lambda v: (v.sin() * v.exp()).sum()
    with grad_level() as G:
        x = G(X)
        (d,) = torch.autograd.grad(G.unwrap(f(x)), G.unwrap(x))
    torch.testing.assert_close(d, tf.grad(f)(X))


def test_nested_grad_levels_give_second_derivatives():
    f = lambda v: (v ** 3 * v.sin()).sum()
    with grad_level() as G1:
        x = G1(X)
        with grad_level() as G2:
            xx = G2(x)
            (d,) = torch.autograd.grad(G2.unwrap(f(xx)), G2.unwrap(xx), create_graph=True)
        (dd,) = torch.autograd.grad(G1.unwrap(d.sum()), G1.unwrap(x))
    torch.testing.assert_close(dd, tf.grad(lambda v: tf.grad(f)(v).sum())(X))


def test_jvp_level_over_grad_level_is_a_hessian_vector_product():
    f = lambda v: (v ** 3 * v.sin()).sum()
    with jvp_level() as J:
        with grad_level() as G:
            x = G(J(X, Y))
            (d,) = torch.autograd.grad(G.unwrap(f(x)), G.unwrap(x), create_graph=True)
        out = J.unwrap(d)
    assert_tree_close(out, tf.jvp(tf.grad(f), (X,), (Y,)))


def test_grad_level_inside_vmap_context_manager():
    f = lambda v: (v ** 2 * v.cos()).sum()
    with tl.vmap() as B, grad_level() as G:
        x = G(B(M))
        (d,) = torch.autograd.grad(G.unwrap(f(x)), G.unwrap(x))
        out = B.unwrap(d)
    torch.testing.assert_close(out, tf.vmap(tf.grad(f))(M))


def test_grad_level_levels_are_fresh_classes_and_die_on_exit():
    with grad_level() as G1:
        pass
    with grad_level() as G2:
        t = G2(X) * 2
    assert G1 is not G2 and not issubclass(G2, G1)
    with pytest.raises(EscapedTensorError):
        t + 1


def test_jvp_level_constant_has_zero_tangent_and_escape_raises():
    with jvp_level() as J:
        x = J(X, Y)
        primal, tangent = J.unwrap(torch.ones(3) * 2)
        y = x * 2
    torch.testing.assert_close(tangent, torch.zeros(3))
    with pytest.raises(EscapedTensorError):
        y.sum()


def test_grad_level_wrap_rejects_non_tensors():
    with grad_level() as G, pytest.raises(TypeError):
        G(3.0)


def test_conjugate_views_inside_grad_match_torch_func():
    """A grad-level tensor shows its inner tensor's conj and neg bits, as a plain one would."""
    x = torch.randn(3, dtype=torch.float64)

    def f(v):
        z = torch.complex(v, 2 * v).conj()
        return z.imag.sum() + torch.fft.ifft(z).real.sum()

    expected = torch.func.grad(f)(x)
    torch.testing.assert_close(tl.grad(f)(x), expected)
    # torch.func.jacrev cannot batch the _neg_view here; for a scalar f it is the gradient
    torch.testing.assert_close(tl.jacrev(f)(x), expected)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_under_grad_takes_its_differentiable_kernel(mode):
    # the composite picks a kernel with no derivative when the weight does not require
    # grad, as a grad level's wrapper does not: the level swaps in the one with it
    g = seeded(0)
    w = torch.randn(10, 3, dtype=torch.float64, generator=g)
    ws = torch.randn(4, 10, 3, dtype=torch.float64, generator=g)
    psw = torch.rand(8, dtype=torch.float64, generator=g)
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])

    def bags(w):
        return F.embedding_bag(idx, w, off, mode=mode)

    def loss(w):
        return bags(w).sin().sum()

    for lib_f in (lambda lib: lib.grad(loss)(w), lambda lib: lib.jacrev(bags)(w),
                  lambda lib: lib.vmap(lib.grad(loss))(ws)):
        torch.testing.assert_close(lib_f(tl), lib_f(tf))
    if mode == "sum":
        def weighted(w, p):
            return F.embedding_bag(idx, w, off, mode=mode, per_sample_weights=p).sum()

        torch.testing.assert_close(tl.grad(weighted, argnums=(0, 1))(w, psw),
                                   tf.grad(weighted, argnums=(0, 1))(w, psw))


# -- the rest of torch.func's names ---------------------------------------------------

def test_every_torch_func_name_imports_from_torchlevels():
    missing = [name for name in tf.__all__ if not hasattr(tl, name)]
    assert not missing, missing


def _functional_write(a):
    y = a.clone()
    y[0].mul_(2)
    y.add_(1)
    return y.sin()


@pytest.mark.parametrize("outer", ["vmap", "grad", "jvp", "vmap(grad)"])
def test_functionalize_inside_a_transform(outer):
    x = torch.randn(3, 4)
    run = {
        "vmap": lambda lib: lib.vmap(lib.functionalize(_functional_write))(x),
        "grad": lambda lib: lib.grad(lambda a: lib.functionalize(_functional_write)(a).sum())(x),
        "jvp": lambda lib: lib.jvp(lib.functionalize(_functional_write), (x,), (x,)),
        "vmap(grad)": lambda lib: lib.vmap(
            lib.grad(lambda a: lib.functionalize(_functional_write)(a).sum()))(x),
    }[outer]
    assert_tree_close(run(tl), run(tf))


@pytest.mark.parametrize("inner", ["vmap", "grad", "jacrev"])
def test_functionalize_around_a_transform_is_refused(inner):
    # PyTorch crashes the interpreter running vmap's ops on functionalize's tensors
    f = {"vmap": tl.vmap(_functional_write),
         "grad": tl.grad(lambda a: _functional_write(a).sum()),
         "jacrev": tl.jacrev(_functional_write)}[inner]
    with pytest.raises(RuntimeError, match=rf"{inner}\(functionalize\(f\)\)"):
        tl.functionalize(f)(torch.randn(3, 4))


def test_rearrange_under_vmap_and_grad():
    x = torch.randn(5, 2, 3, 4)
    g = lambda a: tl.rearrange(a, "c h w -> (h w) c").sin()
    assert_tree_close(tl.vmap(g)(x), tf.vmap(g)(x))
    assert_tree_close(tl.grad(lambda a: g(a).sum())(x[0]), tf.grad(lambda a: g(a).sum())(x[0]))


def test_debug_unwrap_gives_the_tensor_under_each_level():
    x = torch.randn(4, 3)
    seen = {}

    def f(a):
        seen["all"] = tl.debug_unwrap(a)
        seen["one"] = tl.debug_unwrap(a, recurse=False)
        return a * 2

    tl.vmap(tl.grad(lambda a: f(a).sum()))(x)
    assert type(seen["all"]) is torch.Tensor and seen["all"].shape == (4, 3)
    torch.testing.assert_close(seen["all"], x)
    assert isinstance(seen["one"], LevelTensor)  # the batched tensor under the grad level
    assert tl.debug_unwrap(x) is x


def test_replace_all_batch_norm_modules_lets_vmap_run_batch_norm_in_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    tl.replace_all_batch_norm_modules_(model)
    params = dict(model.named_parameters())
    x = torch.randn(5, 2, 3)
    run = lambda lib: lib.vmap(lambda a: lib.functional_call(model, params, (a,)))(x)
    assert_tree_close(run(tl), run(tf))


# -- mixing with torch.func's transforms ----------------------------------------------

_MIX_X = torch.randn(3, 4)


@pytest.mark.parametrize("chain", ["vmap(grad)", "grad(vmap)", "grad(grad)", "jvp(grad)",
                                   "vmap(vmap)"])
def test_torch_func_transforms_run_inside_torchlevels_ones(chain):
    outer_name, inner_name = chain[:-1].split("(")
    f = lambda a: (a.sin() * 2).sum() if a.dim() == 1 else (a.sin() * 2).sum(-1)

    def build(outer, inner):
        g = {"vmap": lambda: inner.vmap(f), "grad": lambda: inner.grad(lambda a: f(a).sum())}
        h = g[inner_name]()
        if outer_name == "vmap":
            return lambda x: outer.vmap(h)(x)
        if outer_name == "grad":
            return lambda x: outer.grad(lambda a: h(a).sum())(x)
        return lambda x: outer.jvp(h, (x,), (x,))[1]

    torch.testing.assert_close(build(tl, tf)(_MIX_X), build(tf, tf)(_MIX_X))


@pytest.mark.parametrize("chain", ["vmap(grad)", "grad(vmap)", "grad(grad)", "jvp(grad)",
                                   "vmap(vmap)", "grad(count_flops)"])
def test_torchlevels_transforms_inside_torch_func_ones_are_refused(chain):
    # before, torch.func's grad around torchlevels' grad or count_flops gave wrong gradients
    outer_name, inner_name = chain[:-1].split("(")
    f = lambda a: (a.sin() * 2).sum()
    inner = {"vmap": tl.vmap(lambda a: a.sin()), "grad": tl.grad(f),
             "count_flops": tl.count_flops(f)}[inner_name]
    call = {"vmap": lambda: tf.vmap(inner)(_MIX_X),
            "grad": lambda: tf.grad(lambda a: inner(a).sum())(_MIX_X),
            "jvp": lambda: tf.jvp(inner, (_MIX_X,), (_MIX_X,))}[outer_name]
    with pytest.raises(RuntimeError, match="take the outer transforms from torchlevels"):
        call()


# -- inference mode -------------------------------------------------------------------

@pytest.mark.parametrize("api", ["grad", "jvp", "vmap(grad)", "jacrev", "jacfwd", "hessian"])
@pytest.mark.parametrize("made_in_inference", [False, True], ids=["normal", "inference"])
def test_transforms_differentiate_inside_inference_mode(api, made_in_inference):
    # torch.func differentiates there; the levels used to return zeros without a word
    x = torch.randn(3, 3)
    with torch.inference_mode():
        captured = torch.randn(3, 3)  # an inference tensor, saved by mul's backward
        if made_in_inference:
            x = x.clone()
        f = lambda a: (a.sin() * captured).sum(0)
        run = {
            "grad": lambda lib: lib.grad(lambda a: f(a).sum())(x),
            "jvp": lambda lib: lib.jvp(f, (x,), (torch.ones_like(x),)),
            "vmap(grad)": lambda lib: lib.vmap(lib.grad(lambda a: f(a).sum()))(x),
            "jacrev": lambda lib: lib.jacrev(f)(x),
            "jacfwd": lambda lib: lib.jacfwd(f)(x),
            "hessian": lambda lib: lib.hessian(lambda a: (f(a) ** 2).sum())(x),
        }[api]
        assert_tree_close(run(tl), run(tf))


def test_a_value_computed_under_inference_mode_inside_the_function_raises_when_saved():
    # its history was not recorded: eager and torch.func refuse to save it for backward
    def f(a):
        with torch.inference_mode():
            b = a * 3
        return (a * b).sum()

    x = torch.randn(3)
    for lib in (tf, tl):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            lib.grad(f)(x)


# -- Python values read inside a transform --------------------------------------------

PYTHON_VALUES = {  # what f reads out of its input x (of shape (2,))
    "tolist": lambda x: x.tolist(),
    "tolist of a 0-dim tensor": lambda x: x.sum().tolist(),
    "format spec": lambda x: f"{x.sum():.3f}",
    "format, no spec": lambda x: format(x.sum()),
    # PyTorch reads each tensor element with the Python dispatch key off
    "torch.tensor of 0-dim tensors": lambda x: torch.tensor([x.sum(), x[0]]).tolist(),
    "torch.tensor, nested": lambda x: torch.tensor([[x[1], 1.0], [x[0], 2.0]]).tolist(),
    "torch.as_tensor": lambda x: torch.as_tensor([x.sum()]).tolist(),
    "torch.tensor, int": lambda x: torch.tensor([(x.sum() * 10).long()]).tolist(),
    "torch.tensor, bool": lambda x: torch.tensor([x[0] > 0, x[1] > 0]).tolist(),
    "torch.tensor, complex": lambda x: torch.tensor([x.sum().to(torch.complex128)]).tolist(),
    "new_tensor": lambda x: x.new_tensor([x[1]]).tolist(),
}
AUTODIFF_CALLS = {
    "grad": lambda lib, g, x: lib.grad(g)(x),
    "jvp": lambda lib, g, x: lib.jvp(g, (x,), (x.cos(),)),
    "grad(grad)": lambda lib, g, x: lib.grad(lambda y: lib.grad(g)(y).sum())(x),
    "jacfwd(grad)": lambda lib, g, x: lib.jacfwd(lib.grad(g))(x),
}


@pytest.mark.parametrize("call", AUTODIFF_CALLS)
@pytest.mark.parametrize("read", PYTHON_VALUES)
def test_python_values_read_under_autodiff_are_torch_funcs(read, call):
    """PyTorch refuses ``.tolist()`` on tensor subclasses, formats a subclass's 0-dim
    tensor as an object, and reads ``torch.tensor([t])``'s element where a wrapper has no
    data: the levels read each value as ``.item()`` does, as torch.func."""
    x = torch.tensor([1.25, -2.5], dtype=torch.float64)
    got = {}

    def g(lib):
        def f(x):
            got[lib] = PYTHON_VALUES[read](x)
            return (x ** 3).sum()
        return f

    AUTODIFF_CALLS[call](tl, g(tl), x)
    AUTODIFF_CALLS[call](tf, g(tf), x)
    assert got[tl] == got[tf] == PYTHON_VALUES[read](x)


@pytest.mark.parametrize("read", PYTHON_VALUES)
@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)"])
def test_python_values_read_under_vmap_raise(read, transform):
    def f(x):
        PYTHON_VALUES[read](x)
        return x.sum()

    f = tl.vmap(f) if transform == "vmap" else tl.vmap(tl.grad(f))
    with pytest.raises(RuntimeError, match="reads a Python value out of a batched tensor"):
        f(torch.randn(3, 2))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_weighted_l1_loss_keeps_its_weight(reduction):
    """PyTorch's F.l1_loss drops ``weight`` on its way to ``__torch_function__``; the
    levels' tensors get it, as torch.func's do."""
    x, y, w = torch.randn(4, 3), torch.randn(4, 3), torch.rand(3)

    def loss(a, b):
        return F.l1_loss(a, b, weight=w, reduction=reduction).sum()

    for make in (lambda lib: lib.vmap(loss), lambda lib: lib.vmap(lib.grad(loss)),
                 lambda lib: lib.jacrev(lib.vmap(loss)),
                 lambda lib: lib.vmap(lambda a, b: lib.jvp(loss, (a, b), (b, a))[1])):
        assert_tree_close(make(torchlevels)(x, y), make(tf)(x, y))


def test_weighted_l1_loss_reaches_a_subclass_with_its_weight():
    seen = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append((kwargs or {}).get("weight"))
            return super().__torch_function__(func, types, args, kwargs)

    x, w = torch.randn(3), torch.rand(3)
    out = F.l1_loss(x.as_subclass(Logged), torch.zeros(3), weight=w)
    assert seen[0] is w
    torch.testing.assert_close(out.as_subclass(torch.Tensor), F.l1_loss(x, torch.zeros(3),
                                                                         weight=w))


COMPLEX = torch.tensor([1 + 2j, 3 - 1j])


@pytest.mark.parametrize(("api", "make_call", "what"), [
    ("jacrev", lambda lib: lib.jacrev(lambda z: z * z)(COMPLEX), "inputs"),
    ("jacrev", lambda lib: lib.jacrev(lambda x: x * COMPLEX)(X[:2]), "outputs"),
    ("jacfwd", lambda lib: lib.jacfwd(lambda z: z * z)(COMPLEX), "inputs"),
    ("jacfwd", lambda lib: lib.jacfwd(lambda x: x * COMPLEX)(X[:2]), "outputs"),
    ("hessian", lambda lib: lib.hessian(lambda z: z.abs().sum())(COMPLEX), "inputs"),
])
def test_jacobians_of_complex_functions_are_refused_as_in_torch_func(api, make_call, what):
    # reverse mode would give the conjugate of forward mode's Jacobian (it did: jacrev of
    # z * z was diag(2 conj(z)), jacfwd's diag(2z)); torch.func's hessian names jacfwd
    assert_same_error(make_call, f"{api}: Expected all {what} to be real")


def test_jacobians_through_complex_intermediates_match_torch_func():
    def f(x):
        return (x * COMPLEX).exp().abs()

    x = X[:2]
    assert_tree_close(tl.jacrev(f)(x), tf.jacrev(f)(x))
    assert_tree_close(tl.jacfwd(f)(x), tf.jacfwd(f)(x))
    assert_tree_close(tl.hessian(lambda x: f(x).sum())(x), tf.hessian(lambda x: f(x).sum())(x))


_MISUSES = {  # each raises in torch.func too, with the same exception type
    "jvp with no primals": lambda lib, x: lib.jvp(lambda: x, (), ()),
    "jvp with a float tangent": lambda lib, x: lib.jvp(torch.sin, (x,), (1.0,)),
    "linearize with a float64 tangent": lambda lib, x: lib.linearize(torch.sin, x)[1](
        x.double()),
    "vjp_fn with a float cotangent": lambda lib, x: lib.vjp(torch.sin, x)[1](1.0),
    "jvp with a float primal": lambda lib, x: lib.jvp(torch.sin, (1.0,), (x,)),
    "jvp of a function with no output": lambda lib, x: lib.jvp(lambda a: (), (x,), (x,)),
    "vjp of a function with no output": lambda lib, x: lib.vjp(lambda a: [], x),
    "jacrev of a function with no output": lambda lib, x: lib.jacrev(lambda a: ())(x),
    "jacfwd of a function with no output": lambda lib, x: lib.jacfwd(lambda a: ())(x),
}


@pytest.mark.parametrize("name", list(_MISUSES))
def test_misuse_raises_as_torch_func_does(name):
    x = torch.randn(3)
    with pytest.raises(Exception) as theirs:
        _MISUSES[name](torch.func, x)
    with pytest.raises(type(theirs.value)):
        _MISUSES[name](torchlevels, x)


@pytest.mark.parametrize("op", ["mul_", "div_", "addcmul_", "atan2_", "add_"])
def test_jvp_of_an_in_place_op_that_reads_a_detached_alias_of_what_it_writes(op):
    """``y.mul_(y.detach())``: forward AD's formula reads the detached argument after the
    write (torch.func's tangent is wrong there); the level reads it before, as the op does,
    which gives the tangent of the same program with the argument cloned."""
    write = {"mul_": lambda y, o: y.mul_(o), "div_": lambda y, o: y.div_(o),
             "addcmul_": lambda y, o: y.addcmul_(y, o, value=0.3),
             "atan2_": lambda y, o: y.atan2_(o), "add_": lambda y, o: y.add_(o, alpha=2)}[op]

    def f(x, clone):
        y = x * 1.5
        write(y, y.detach().clone() if clone else y.detach())
        return y

    x, t = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    xs, ts = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for run in (lambda lib, g: lib.jvp(g, (x,), (t,)),
                lambda lib, g: lib.vmap(lambda x, t: lib.jvp(g, (x,), (t,)))(xs, ts),
                lambda lib, g: lib.jacfwd(g)(x)):
        assert_tree_close(run(tl, lambda x: f(x, False)), run(tf, lambda x: f(x, True)))


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp", "vmap(grad)"])
def test_backward_inside_a_transform_raises_as_in_torch_func(transform):
    """Under vmap, the .grad it would leave on a captured leaf held a tensor of the level,
    which outlives it (any later use raised); under jvp its error named no transform."""
    w = torch.randn(3, requires_grad=True)

    def f(x):
        (w * x).sum().backward()
        return x * 2

    run = {"grad": lambda lib: lib.grad(lambda x: f(x).sum())(X),
           "vmap": lambda lib: lib.vmap(f)(M),
           "jvp": lambda lib: lib.jvp(f, (X,), (Y,)),
           "vmap(grad)": lambda lib: lib.vmap(lib.grad(lambda x: f(x).sum()))(M)}[transform]
    error = assert_same_error(run, match="backward() was called on a tensor of")
    assert "call backward() on the transform's result" in str(error)
    assert w.grad is None
