"""Linear-algebra ops written with ops whose derivatives are right at every order.

linalg.solve, det and slogdet as an LU factorization whose factors carry derivatives.
PyTorch's ``_linalg_solve_ex``, ``_linalg_det`` and ``_linalg_slogdet`` return the LU
factors they computed as outputs that are not differentiable, and their forward-AD
formulas (and det's backward formula) solve with those factors. A derivative taken of
such a tangent, forward mode twice (``jacfwd(jacfwd)``) or reverse over forward, treats
the factors as constants and misses how they depend on the matrix: the result is wrong,
in torch.func too. The same ops written with ``linalg.lu_factor_ex``, whose factors are
differentiable outputs, and ``linalg.lu_solve`` are right at every order. The autodiff
levels run these decompositions where something outside differentiates an argument.

The same holds for ``triangular_solve`` (whose derivatives of derivatives read the whole
matrix, not its triangle) and ``linalg.householder_product``: they are written here with
``linalg.solve_triangular`` and with the reflections multiplied out.

They return the factors the ops return: det and slogdet factor ``A`` transposed when it
is contiguous and real, as the ops do.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _determinant_factors(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LU, pivots) as det and slogdet compute them: of ``A`` transposed when it is
    contiguous and real (the same determinant)."""
    LU, pivots, _ = torch.linalg.lu_factor_ex(
        A.mT if A.is_contiguous() and not A.is_complex() else A)
    return LU, pivots


def solve_ex(A: torch.Tensor, B: torch.Tensor, *, left: bool = True,
             check_errors: bool = False) -> tuple[torch.Tensor, ...]:
    """``aten._linalg_solve_ex``: (X, LU, pivots, info) with ``A X = B`` (``X A = B`` when
    not ``left``); ``B`` may be a vector (a batch of them) where ``A`` has one more dim.

    >>> A, b = torch.eye(2) * 2, torch.ones(2)
    >>> solve_ex(A, b)[0]
    tensor([0.5000, 0.5000])
    """
    LU, pivots, info = torch.linalg.lu_factor_ex(A)
    if check_errors:
        aten._linalg_check_errors(info, "torch.linalg.solve_ex", is_matrix=A.dim() == 2)
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    X = torch.linalg.lu_solve(LU, pivots, B.unsqueeze(-1) if vector else B, left=left)
    return X.squeeze(-1) if vector else X, LU, pivots, info


def _permutation_sign(pivots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sign of the row permutation that LAPACK's 1-based ``pivots`` record."""
    rows = torch.arange(1, pivots.shape[-1] + 1, device=pivots.device, dtype=pivots.dtype)
    swaps = (pivots != rows).sum(-1)
    return 1 - 2 * (swaps % 2).to(dtype)


def det(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._linalg_det``: (det, LU, pivots).

    >>> det(torch.tensor([[0.0, 2.0], [3.0, 1.0]]))[0]
    tensor(-6.)
    """
    LU, pivots = _determinant_factors(A)
    diagonal = LU.diagonal(dim1=-2, dim2=-1)
    return diagonal.prod(-1) * _permutation_sign(pivots, LU.dtype), LU, pivots


def slogdet(A: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``aten._linalg_slogdet``: (sign, log of the absolute determinant, LU, pivots).

    >>> slogdet(torch.tensor([[0.0, 2.0], [3.0, 1.0]]))[:2]
    (tensor(-1.), tensor(1.7918))
    """
    LU, pivots = _determinant_factors(A)
    diagonal = LU.diagonal(dim1=-2, dim2=-1)
    sign = diagonal.sgn().prod(-1) * _permutation_sign(pivots, LU.dtype)
    return sign, diagonal.abs().log().sum(-1), LU, pivots


def triangular_solve(b: torch.Tensor, A: torch.Tensor, upper: bool = True,
                     transpose: bool = False, unitriangular: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.triangular_solve``: (X, a copy of ``A``) with ``op(T) X = b``, ``T`` the upper
    (or lower) triangle of ``A``, ``op`` a transpose or not.

    >>> triangular_solve(torch.ones(2, 1), torch.tensor([[2.0, 9.0], [9.0, 4.0]]))[0]
    tensor([[-0.6250],
            [ 0.2500]])
    """
    triangle = A.triu() if upper else A.tril()
    if transpose:
        triangle, upper = triangle.mT, not upper
    return (torch.linalg.solve_triangular(triangle, b, upper=upper, unitriangular=unitriangular),
            A.clone())


def householder_product(V: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``aten.linalg_householder_product``: the first columns of ``H_1 H_2 ... H_k``, with
    ``H_i = I - tau_i v_i v_i^H`` and ``v_i`` column ``i`` of ``V`` below the diagonal, 1 on it.

    >>> householder_product(torch.zeros(2, 1), torch.tensor([2.0]))
    tensor([[-1.],
            [ 0.]])
    """
    m, n = V.shape[-2:]
    eye = torch.eye(m, dtype=V.dtype, device=V.device)
    reflectors = V.tril(-1) + eye[:, :n]
    q = eye.expand(*V.shape[:-2], m, m)
    for i in range(tau.shape[-1]):
        v = reflectors[..., i:i + 1]
        q = q - (q @ v) * tau[..., i, None, None] @ v.mH
    return q[..., :n]


RECOMPUTED = {
    aten._linalg_solve_ex.default: solve_ex,
    aten._linalg_det.default: det,
    aten._linalg_slogdet.default: slogdet,
    aten.triangular_solve.default: triangular_solve,
    aten.linalg_householder_product.default: householder_product,
}
