"""The decompositions of linalg_recomputed.py give what the aten ops give, LU factors
included (the autodiff levels run them in the ops' place)."""

from __future__ import annotations

import pytest
import torch
from vmap_reference import seeded

import torchlevels as tl
from torchlevels import linalg_recomputed

aten = torch.ops.aten


def _matrices(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = seeded(0)
    square = torch.randn(3, 3, dtype=dtype, generator=gen)
    batch = torch.randn(2, 4, 4, dtype=dtype, generator=gen)
    # contiguous and not: det and slogdet factor a contiguous real matrix transposed
    return [square, square.mT, batch, batch.mT]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("op", ["det", "slogdet"])
def test_determinants_match_the_aten_ops(dtype, op):
    for a in _matrices(dtype):
        got = getattr(linalg_recomputed, op)(a)
        expected = getattr(aten, f"_linalg_{op}")(a)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_solve_matches_the_aten_op(dtype):
    gen = seeded(1)
    for a in _matrices(dtype):
        n = a.shape[-1]
        rhs = {"vector": torch.randn(n, dtype=dtype, generator=gen),
               "batch of vectors": torch.randn(a.shape[:-1], dtype=dtype, generator=gen),
               "matrix": torch.randn(n, 2, dtype=dtype, generator=gen),
               "rows": torch.randn(3, n, dtype=dtype, generator=gen)}
        for name, b in rhs.items():
            left = name != "rows"
            got = linalg_recomputed.solve_ex(a, b, left=left)
            expected = aten._linalg_solve_ex(a, b, left=left)
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, msg=lambda m, name=name: f"{name}: {m}")


def test_singular_matrices_give_what_the_aten_ops_give():
    singular = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0]])
    torch.testing.assert_close(linalg_recomputed.det(singular)[0], aten._linalg_det(singular)[0])
    for g, e in zip(linalg_recomputed.slogdet(singular)[:2], aten._linalg_slogdet(singular)[:2]):
        torch.testing.assert_close(g, e)
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        linalg_recomputed.solve_ex(torch.zeros(2, 2), torch.ones(2), check_errors=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_triangular_solve_matches_the_aten_op(dtype):
    gen = seeded(2)
    a = torch.randn(2, 4, 4, dtype=dtype, generator=gen)
    b = torch.randn(2, 4, 3, dtype=dtype, generator=gen)
    for upper in (True, False):
        for transpose in (True, False):
            for unitriangular in (True, False):
                got = linalg_recomputed.triangular_solve(b, a, upper, transpose, unitriangular)
                expected = aten.triangular_solve(b, a, upper, transpose, unitriangular)
                for g, e in zip(got, expected, strict=True):
                    torch.testing.assert_close(g, e)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("shape, reflections", [((4, 3), 3), ((4, 3), 2), ((2, 5, 5), 5)])
def test_householder_product_matches_the_aten_op(dtype, shape, reflections):
    gen = seeded(3)
    v = torch.randn(shape, dtype=dtype, generator=gen)
    tau = torch.randn(*shape[:-2], reflections, dtype=dtype, generator=gen)
    torch.testing.assert_close(linalg_recomputed.householder_product(v, tau),
                               torch.linalg.householder_product(v, tau))


_MATRIX = torch.randn(3, 3, dtype=torch.float64, generator=seeded(9)) + 3 * torch.eye(3)
_X = torch.randn(3, dtype=torch.float64, generator=seeded(10))
_W = torch.randn(3, dtype=torch.float64, generator=seeded(11))
_SOLVES = {
    "triangular_solve": lambda a, x: torch.triangular_solve(x.unsqueeze(1), a).solution[:, 0],
    "linalg.solve": torch.linalg.solve,
    "linalg.solve_triangular": lambda a, x: torch.linalg.solve_triangular(
        a, x.unsqueeze(1), upper=True)[:, 0],
}


def _second_derivative(transform: str, f, x: torch.Tensor, lib=None) -> torch.Tensor:
    """A second derivative of scalar ``f`` at ``x`` along fixed directions: with ``lib``
    (torchlevels) as its transforms give it, else with plain autograd's double backward."""
    v1, v2 = x.cos(), x.sin()
    if lib is not None:
        if transform == "hessian":
            return lib.hessian(f)(x)
        if transform == "jvp(grad)":
            return lib.jvp(lib.grad(f), (x,), (v1,))[1]
        if transform == "grad(grad)":
            return lib.grad(lambda y: lib.grad(f)(y).cos().sum())(x)
        return lib.jvp(lambda y: lib.jvp(f, (y,), (v1,))[1], (x,), (v2,))[1]
    if transform == "hessian":
        return torch.autograd.functional.hessian(f, x, create_graph=True)
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    if transform == "jvp(grad)":  # H v1 (H is symmetric)
        return torch.autograd.grad(g, x, v1, create_graph=True)[0]
    if transform == "grad(grad)":
        return torch.autograd.grad(g.cos().sum(), x, create_graph=True)[0]
    return torch.autograd.grad((g * v1).sum(), x, create_graph=True)[0] @ v2  # jvp(jvp)


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
@pytest.mark.parametrize("transform", ["hessian", "jvp(grad)", "grad(grad)", "jvp(jvp)"])
@pytest.mark.parametrize("solve", list(_SOLVES))
def test_a_captured_matrix_autograd_tracks_keeps_second_derivatives(solve, transform):
    """A second derivative in ``x`` of a solve with a matrix the function captures, made
    from ``w`` that autograd outside tracks: the derivative and its gradient in ``w``
    match plain autograd's. (The decomposition a level runs reads the matrix with plain
    ops, which autograd must record; a jvp level's tangent formula reads the matrix too.
    torch.func's linalg.solve misses the gradient in ``w`` here.)"""
    def run(lib):
        w = _W.clone().requires_grad_()
        matrix = _MATRIX * w.exp()[:, None]
        out = _second_derivative(transform, lambda x: _SOLVES[solve](matrix, x).sin().sum(),
                                 _X, lib)
        return out.detach(), torch.autograd.grad((out * out).sum(), w)[0]

    torch.testing.assert_close(run(tl), run(None))
