"""Conj and neg views of tensors autograd tracks, meeting a level's tensors
(torchlevels/math_bits.py): autograd outside keeps its graph through them, compared with
torch.func on the same inputs; and outside the levels PyTorch's results stay as they were."""

import pytest
import torch
import torch.func as tf
from vmap_reference import seeded

import torchlevels as tl
from torchlevels import math_bits

X = torch.randn(6, generator=seeded(1), dtype=torch.float64)
W = torch.randn(6, generator=seeded(2), dtype=torch.float64)
A = torch.randn(3, 3, generator=seeded(3), dtype=torch.complex128).triu() + 3 * torch.eye(3)


def fft_product(x, w):  # a convolution by FFT: mul's backward is grad * other.conj()
    return (torch.fft.fft(x) * torch.fft.fft(w)).real


def complex_quotient(x, w):  # div's backward: grad / other.conj()
    return (torch.complex(x, w) / torch.complex(w.exp(), x.sin())).imag


def matrix_vector(x, w):  # mv's backward runs mv on the conj of the matrix
    m = torch.complex(w, w.cos()).view(2, 3)
    return torch.view_as_real(torch.mv(m, torch.complex(x[:3], x[3:]))).flatten()


def cross_product(x, w):  # linalg_cross's backward: cross(other.conj(), grad)
    a, b = torch.complex(x[:3], x[3:]), torch.complex(w[:3], w[3:].sin())
    return torch.view_as_real(torch.linalg.cross(a, b)).flatten()


def triangular(x, w):  # triangular_solve's backward solves with A.conj()
    a = A * torch.complex(w[:3], w[3:]).exp()[:, None]
    b = torch.complex(x[:3], x[3:]).unsqueeze(1)
    return torch.view_as_real(torch.triangular_solve(b, a).solution).flatten()


def linear_solve(x, w):  # linalg_solve's backward, with grad mode on, solves with A.mH
    a = A * torch.complex(w[:3], w[3:]).exp()[:, None]
    return torch.view_as_real(torch.linalg.solve(a, torch.complex(x[:3], x[3:]))).flatten()


def _transformed(lib, name, f):
    if name == "jacrev":
        return lib.jacrev(f)(X)
    if name == "vmap(vjp)":
        out, vjp_fn = lib.vjp(f, X)
        return lib.vmap(vjp_fn)(torch.eye(out.numel(), dtype=out.dtype))[0]
    scalar = lambda x: f(x).sin().sum()  # noqa: E731  (nonlinear: a second derivative)
    if name == "hessian":
        return lib.hessian(scalar)(X)
    if name == "vmap(grad)":
        return lib.vmap(lib.grad(scalar))(torch.stack([X, X.cos()]))
    if name == "grad(grad)":
        return lib.grad(lambda x: lib.grad(scalar)(x).cos().sum())(X)
    assert name == "jvp(grad)"
    return lib.jvp(lib.grad(scalar), (X,), (X.cos(),))[1]


def _double_backward(name, f):
    """hessian or jvp(grad) by PyTorch's own reverse over reverse: the reference where
    torch.func's forward mode over linalg.solve's backward is wrong outside (it treats
    the LU factors it saved as constants)."""
    scalar = lambda x: f(x).sin().sum()  # noqa: E731  (as _transformed's)
    if name == "hessian":
        return torch.autograd.functional.hessian(scalar, X, create_graph=True)
    return torch.autograd.functional.hvp(scalar, X, X.cos(), create_graph=True)[1]


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
@pytest.mark.parametrize("transform", ["jacrev", "vmap(vjp)", "hessian", "vmap(grad)",
                                       "grad(grad)", "jvp(grad)"])
@pytest.mark.parametrize("fn", [fft_product, complex_quotient, matrix_vector, cross_product,
                                triangular, linear_solve],
                         ids=lambda f: f.__name__)
def test_backward_formulas_on_conj_views_keep_the_graph_outside(fn, transform):
    """Autograd outside tracks ``w``; the backward formulas run under the transforms
    meet conj views of tensors made from it (found by hypothesis with a complex op)."""

    def run(lib):
        w = W.clone().requires_grad_()
        f = lambda x: fn(x, w)  # noqa: E731
        out = _double_backward(transform, f) if lib is None else _transformed(lib, transform, f)
        return out.detach(), torch.autograd.grad((out * out).sum(), w)[0]

    forward_over_solve = fn is linear_solve and transform in ("hessian", "jvp(grad)")
    expected = run(None if forward_over_solve else tf)
    torch.testing.assert_close(run(tl), expected)


@pytest.mark.parametrize("call", [
    lambda b, z: b * z.conj(),
    lambda b, z: z.conj() / (b + 2),
    lambda b, z: torch.where(b.real > 0, b, z.conj()),
    lambda b, z: torch.cat([b, z.conj().imag.to(b.dtype)]),
    lambda b, z: b.clone().add_(z.conj()),
], ids=["mul", "div", "where", "cat_of_neg_view", "written_in_place"])
def test_a_users_call_on_a_conj_view_keeps_the_graph_outside(call):
    """The view made in the user's code under vmap, and the call given it."""
    bs = torch.randn(4, 6, generator=seeded(4), dtype=torch.complex128)

    def run(lib):
        w = W.clone().requires_grad_()
        z = torch.complex(w, w.sin())
        out = lib.vmap(lambda b: call(b, z))(bs)
        return out.detach(), torch.autograd.grad(torch.view_as_real(out).pow(2).sum(), w)[0]

    expected = run(tf)
    torch.testing.assert_close(run(tl), expected)


@pytest.mark.parametrize("transform", ["grad(grad)", "vmap(vjp)", "vmap(grad of z)"])
@pytest.mark.parametrize("call", [
    lambda x, z: x + z.conj(),
    lambda x, z: x - z.conj().imag,
], ids=["add", "sub_of_neg_view"])
def test_a_users_call_on_a_conj_view_inside_two_levels_keeps_the_graph_outside(
        call, transform):
    """A grad level over another level runs the call on its inner tensors, past the
    enclosing level's ``__torch_function__``: ``add`` (no formula op) then met the
    Conjugate key's fallback, which copied the view with no history (found by fuzzing).
    Differentiating ``z`` makes the view one of the grad level's inner tensor."""
    xs = torch.randn(2, 6, generator=seeded(9), dtype=torch.complex128)

    def run(lib):
        w = W.clone().requires_grad_()
        z = torch.complex(w, w.sin())
        f = lambda x: call(x, z).exp()  # noqa: E731
        if transform == "grad(grad)":
            out = lib.grad(lambda x: lib.grad(lambda a: f(a).real.sum())(x).abs().sum())(xs[0])
        elif transform == "vmap(grad of z)":
            out = lib.vmap(lib.grad(lambda c, x: call(x, c).exp().real.sum()),
                           in_dims=(None, 0))(z, xs)
        else:
            out = lib.vmap(lambda x: lib.vjp(f, x)[1](torch.ones_like(x))[0])(xs)
        return out.detach(), torch.autograd.grad(out.abs().pow(2).sum(), w)[0]

    expected = run(tf)
    torch.testing.assert_close(run(tl), expected)


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_the_kernels_give_pytorchs_results_outside_the_levels():
    """With the kernels registered, plain calls on conj and neg views give what the same
    calls give on resolved copies: values and dtypes, Python numbers among the arguments,
    ``out=``, a write through a conj view, and plain autograd's second derivatives."""
    math_bits.register()
    z = torch.randn(4, generator=seeded(5), dtype=torch.complex64)
    w = torch.randn(4, generator=seeded(6), dtype=torch.complex64)
    m = torch.randn(3, 4, generator=seeded(7), dtype=torch.complex64)
    b = torch.randn(3, 2, generator=seeded(8), dtype=torch.complex128)
    calls = [
        lambda v: v(z) * w, lambda v: v(z) * 2, lambda v: 2.5 * v(z), lambda v: v(z) * 1j,
        lambda v: v(torch.tensor(1 + 2j, dtype=torch.complex64)) * 2.5,
        lambda v: v(z) * v(w), lambda v: w / v(z), lambda v: 3 / v(z),
        lambda v: torch.mv(m, v(z)), lambda v: torch.mv(v(m), z),
        lambda v: torch.triangular_solve(b, v(A)).solution,
        lambda v: torch.triangular_solve(v(b), A, upper=True, transpose=True).solution,
        lambda v: v(z).imag * w.real,  # imag of a conj view: a neg view
    ]
    for call in calls:
        got, expected = call(torch.conj), call(torch.conj_physical)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)
    out = torch.empty(4, dtype=torch.complex64)
    torch.mul(z.conj(), w, out=out)
    torch.testing.assert_close(out, z.conj_physical() * w)
    written = z.clone()
    written.conj().mul_(w)
    torch.testing.assert_close(written, (z.conj_physical() * w).conj())

    def second(view):
        x = z.to(torch.complex128).requires_grad_()
        y = w.to(torch.complex128).requires_grad_()
        g = torch.autograd.grad((x * view(y)).abs().sum(), (x, y), create_graph=True)
        return torch.autograd.grad(sum(t.abs().sum() for t in g), (x, y))

    torch.testing.assert_close(second(torch.conj), second(torch.conj_physical))
