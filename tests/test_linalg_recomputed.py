"""The decompositions of linalg_recomputed.py give what the aten ops give, LU factors
included (the autodiff levels run them in the ops' place)."""

from __future__ import annotations

import pytest
import torch
from vmap_reference import seeded

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
