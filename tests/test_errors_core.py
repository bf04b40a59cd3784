"""Clear errors for misuse of the core transforms, each compared with torch.func (or
torch.autograd.forward_ad) on the same input: the exception type it raises, or the same
values where it works.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tf
from test_transforms_api import assert_same_error, assert_tree_close, error_of
from vmap_reference import seeded

import torchlevels as tl
from torchlevels import EscapedTensorError, jvp_level


def assert_same_values(make_call):
    """``make_call(lib)`` gives with torchlevels what it gives with torch.func."""
    assert_tree_close(make_call(tl), make_call(tf))


X = torch.randn(3, generator=seeded(0))


# -- transpose of a 0-dim example ---------------------------------------------------------

TRANSPOSES = {
    "method": lambda a, d0, d1: a.transpose(d0, d1),
    "function": lambda a, d0, d1: torch.transpose(a, d0, d1),
    "swapaxes": lambda a, d0, d1: a.swapaxes(d0, d1),
    "in place": lambda a, d0, d1: a.clone().transpose_(d0, d1),
}


@pytest.mark.parametrize("dims", [(0, 5), (0, 1), (1, 1), (0, -2)])
@pytest.mark.parametrize("form", list(TRANSPOSES))
def test_transpose_of_a_0_dim_example_out_of_range(form, dims):
    # it returned the example unchanged
    assert_same_error(lambda lib: lib.vmap(lambda a: TRANSPOSES[form](a, *dims))(X),
                      "Dimension out of range")


@pytest.mark.parametrize("dims", [(0, 0), (-1, 0), (0, -1)])
@pytest.mark.parametrize("form", list(TRANSPOSES))
def test_transpose_of_a_0_dim_example_in_range(form, dims):
    assert_same_values(lambda lib: lib.vmap(lambda a: TRANSPOSES[form](a, *dims))(X))


# -- non-tensor aux -----------------------------------------------------------------------

AUX = {"float": 1.5, "str": "s", "dict of int": {"a": 1}, "None": None,
       "tensor and int": (torch.ones(2), 3)}
AUX_CALLS = {
    "grad": lambda lib, f: lib.grad(lambda a: ((a * a).sum(), f()), has_aux=True)(X),
    "grad_and_value": lambda lib, f: lib.grad_and_value(
        lambda a: ((a * a).sum(), f()), has_aux=True)(X),
    "vjp": lambda lib, f: lib.vjp(lambda a: (a * a, f()), X, has_aux=True),
    "jvp": lambda lib, f: lib.jvp(lambda a: (a * a, f()), (X,), (X,), has_aux=True),
    "jacrev": lambda lib, f: lib.jacrev(lambda a: (a * a, f()), has_aux=True)(X),
    "jacfwd": lambda lib, f: lib.jacfwd(lambda a: (a * a, f()), has_aux=True)(X),
    "vmap(jacrev)": lambda lib, f: lib.vmap(lib.jacrev(lambda a: (a * a, f()), has_aux=True))(
        X.expand(2, 3)),
}


@pytest.mark.parametrize("aux", list(AUX))
@pytest.mark.parametrize("api", list(AUX_CALLS))
def test_non_tensor_aux_is_refused_by_every_transform(api, aux):
    # grad, vjp, jvp and jacrev returned it; jacfwd raised vmap's ValueError about `push`
    e = assert_same_error(lambda lib: AUX_CALLS[api](lib, lambda: AUX[aux]),
                          "aux output of f (has_aux=True) to contain only Tensors")
    assert "push" not in str(e)


def test_tensor_aux_still_works():
    assert_same_values(lambda lib: lib.jacfwd(lambda a: (a * a, {"s": a.sum()}), has_aux=True)(X))
    assert_same_values(lambda lib: lib.grad(lambda a: ((a * a).sum(), [a]), has_aux=True)(X))


# -- errors name the transform the user called --------------------------------------------

NAMED = {
    "jacrev returns None": ("jacrev", lambda lib: lib.jacrev(lambda a: None)(X)),
    "jacrev returns a float": ("jacrev", lambda lib: lib.jacrev(lambda a: 1.0)(X)),
    "jacrev returns ints": ("jacrev", lambda lib: lib.jacrev(lambda a: (a > 0).long())(X)),
    "jacrev int input": ("jacrev", lambda lib: lib.jacrev(lambda a: a)(torch.ones(3).long())),
    "jacrev aux not a pair": ("jacrev", lambda lib: lib.jacrev(lambda a: a, has_aux=True)(X)),
    "hessian returns None": ("hessian", lambda lib: lib.hessian(lambda a: None)(X)),
    "jacfwd returns None": ("jacfwd", lambda lib: lib.jacfwd(lambda a: None)(X)),
    "jacfwd returns a float": ("jacfwd", lambda lib: lib.jacfwd(lambda a: [a, 1.0])(X)),
    "jacfwd aux not a pair": ("jacfwd", lambda lib: lib.jacfwd(lambda a: [a], has_aux=True)(X)),
    "linearize tangent shape": ("linearize", lambda lib: lib.linearize(torch.sin, X)[1](
        torch.ones(4))),
    "linearize tangent count": ("linearize", lambda lib: lib.linearize(torch.sin, X)[1](X, X)),
}


@pytest.mark.parametrize("case", list(NAMED))
def test_errors_name_the_transform_called(case):
    # they named vjp or jvp, which jacrev, hessian, jacfwd and linearize run
    api, call = NAMED[case]
    e = assert_same_error(call)
    assert str(e).startswith(api), str(e)


# -- escaped tensors ----------------------------------------------------------------------

ESCAPES = {
    "vmap": lambda f: tl.vmap(f)(X.expand(2, 3)),
    "grad": lambda f: tl.grad(lambda a: f(a).sum())(X),
    "vjp": lambda f: tl.vjp(f, X),
    "jvp": lambda f: tl.jvp(f, (X,), (X,)),
    "jacrev": lambda f: tl.jacrev(f)(X),
    "jacfwd": lambda f: tl.jacfwd(f)(X),
    "hessian": lambda f: tl.hessian(lambda a: f(a).sum())(X),
    "linearize": lambda f: tl.linearize(f, X)[1](X),
}


@pytest.mark.parametrize("api", list(ESCAPES))
def test_escape_from_a_transformed_function_suggests_returning_it(api):
    # torch.func lets the tensor go (a wrapper of a dead level); here it raises, and the
    # message suggested `B.unwrap(t)`, which only a `with vmap() as B` block has, and
    # named vjp or jvp for the transforms that run them
    box = []
    ESCAPES[api](lambda a: box.append(a * 2) or a * 2)
    with pytest.raises(EscapedTensorError, match="Return it from that function") as info:
        box[-1] + 1
    assert "unwrap" not in str(info.value)
    assert f"a tensor of {api} " in str(info.value)


def test_escape_from_a_with_block_suggests_unwrapping_it():
    with tl.vmap() as B:
        escaped = B(torch.ones(3, 2))
    with pytest.raises(EscapedTensorError, match=r"B\.unwrap\(t\)"):
        escaped + 1


# -- the imperative API -------------------------------------------------------------------

def test_jvp_level_tangent_must_be_a_tensor():
    # an AttributeError about 'is_inference' (make_dual: one about 'is_floating_point')
    with jvp_level() as J, pytest.raises(TypeError, match="tangent must be a Tensor"):
        J(torch.ones(3), None)
    with jvp_level() as J, pytest.raises(TypeError, match="primal must be a Tensor"):
        J(1.0, torch.ones(3))


@pytest.mark.parametrize(("primal", "tangent"), [
    (torch.ones(3), torch.ones(3, dtype=torch.long)),  # PyTorch's internal assert at an op
    (torch.ones(3, dtype=torch.long), torch.ones(3)),  # accepted
    (torch.ones(3), torch.ones(4)),  # raised at the first op
])
def test_jvp_level_wrap_raises_make_duals_error(primal, tangent):
    with fwAD.dual_level():
        expected = error_of(lambda: fwAD.make_dual(primal, tangent))
    assert expected is not None
    with jvp_level() as J, pytest.raises(type(expected), match="DualTensor"):
        J(primal, tangent) * 2


def test_unwrap_out_dim_must_be_an_int():
    with tl.vmap() as B:
        t = B(torch.ones(3, 2))
        with pytest.raises(TypeError, match="out_dim must be an int"):
            B.unwrap(t, out_dim="x")
        with pytest.raises(TypeError, match="dim must be an int"):
            B(torch.ones(3), dim="x")


@pytest.mark.parametrize("out_dim", [2, -3, 5])
def test_unwrap_out_dim_out_of_range_names_unwrap_and_the_range(out_dim):
    # as vmap's out_dims: IndexError, torch.func's type; it named vmap's out_dims
    expected = error_of(lambda: tf.vmap(lambda a: a, out_dims=out_dim)(torch.ones(3, 2)))
    with tl.vmap() as B:
        t = B(torch.ones(3, 2))
        with pytest.raises(type(expected), match=r"unwrap: out_dim=.* must be in \[-2, 1\]"):
            B.unwrap(t, out_dim=out_dim)


def test_a_vmap_context_manager_is_entered_once():
    # contextlib raised AttributeError: '_GeneratorContextManager' object has no attribute 'args'
    block = tl.vmap()
    with block, pytest.raises(RuntimeError, match="entered already"):
        block.__enter__()


# -- vmap's out_dims and inputs -----------------------------------------------------------

@pytest.mark.parametrize("out_dims", [3, -4, 2**70, -2**70])
def test_out_dims_out_of_range(out_dims):
    # a dim no int64 holds raised IndexError, where torch.func raises TypeError
    assert_same_error(lambda lib: lib.vmap(torch.sin, out_dims=out_dims)(torch.ones(3, 4)),
                      "must be in [-2, 1]")


def test_bool_out_dims_reads_as_an_int_as_in_torch_func():
    # movedim raised a TypeError about a bool argument
    x = torch.randn(3, 4)
    assert_same_values(lambda lib: lib.vmap(torch.sin, out_dims=True)(x))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_vmap_over_a_nested_tensor_is_refused_clearly(layout):
    # an internal error ("NestedTensorImpl doesn't support sizes", or an AttributeError
    # about NestedIntNode). torch.func maps over one with a slow per-example fallback;
    # torchlevels' levels cannot wrap one
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with pytest.raises(NotImplementedError, match="nested tensor"):
        tl.vmap(torch.sin)(nt)
