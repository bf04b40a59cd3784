"""torchlevels' grad, jvp, linearize, jacrev, jacfwd and hessian against torch.autograd on op_db.

In float64; grad and jvp also in complex128, where the gradient of a complex input is the
conjugate Wirtinger derivative torch.autograd gives and a complex output is
differentiated through the real part of its weighted sum (jacrev and jacfwd refuse
complex inputs, as torch.func's do).

The harness is tests/opinfo_autodiff_harness.py; known failures, each with its cause,
are in tests/opinfo_autodiff_xfails.py (strict: an op listed there that passes fails
the test, so the list stays honest). Run with ``pytest -n 2 tests/test_opinfo_autodiff.py``.
scripts/opinfo_autodiff_sweep.py runs the same checks for torch.func as well.
"""

from __future__ import annotations

import pytest
import torch
from opinfo_autodiff_harness import TRANSFORMS, op_id, run_op
from opinfo_autodiff_xfails import CRASHES, XFAILS
from torch.testing._internal.common_methods_invocations import op_db

import torchlevels

# The expected failures were found on the CPU (scripts/opinfo_autodiff_sweep.py), where CI runs.
pytestmark = pytest.mark.cpu_only("the OpInfo expected-failure lists were made on the CPU")

TIMEOUT = 30.0
AUTODIFF_OPS = [op for op in op_db if op.supports_autograd]
# in complex128, the one failure is the float64 sweep's too
COMPLEX_XFAILS = {"grad": {"sparse.sampled_addmm": XFAILS["grad"]["sparse.sampled_addmm"]}}


def _params(transform: str, dtype: torch.dtype = torch.float64) -> list:
    xfails = (XFAILS if dtype == torch.float64 else COMPLEX_XFAILS).get(transform, {})
    return [
        pytest.param(op, id=op_id(op), marks=pytest.mark.xfail(reason=xfails[op_id(op)],
                                                                 strict=True))
        if op_id(op) in xfails else pytest.param(op, id=op_id(op))
        for op in AUTODIFF_OPS
        if dtype == torch.float64 or dtype in op.supported_backward_dtypes("cpu")
    ]


def _check(op, transform: str, dtype: torch.dtype = torch.float64) -> None:
    crash = CRASHES.get(transform, {}).get(op_id(op))
    if crash:
        pytest.xfail(f"not run: {crash}")
    outcome = run_op(op, transform, torchlevels, timeout=TIMEOUT, dtype=dtype)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail


def test_xfail_lists_name_real_ops():
    ids = {op_id(op) for op in AUTODIFF_OPS}
    assert set(XFAILS) <= set(TRANSFORMS)
    for transform, crashes in CRASHES.items():
        assert set(crashes) <= set(XFAILS[transform]), transform
    for transform, xfails in XFAILS.items():
        assert not set(xfails) - ids, transform
        assert all(reason.split(":")[0] in ("core", "both") for reason in xfails.values())


@pytest.mark.parametrize("op", _params("grad"))
def test_grad(op):
    _check(op, "grad")


@pytest.mark.parametrize("op", _params("jvp"))
def test_jvp(op):
    _check(op, "jvp")


@pytest.mark.parametrize("op", _params("linearize"))
def test_linearize(op):
    """jvp_fn of linearize against forward AD: linearize traces the jvp with make_fx and
    replays the part that depends on the tangents, a path of its own through every op."""
    _check(op, "linearize")


@pytest.mark.parametrize("op", _params("grad", torch.complex128))
def test_grad_complex(op):
    _check(op, "grad", torch.complex128)


@pytest.mark.parametrize("op", _params("jvp", torch.complex128))
def test_jvp_complex(op):
    _check(op, "jvp", torch.complex128)


@pytest.mark.parametrize("op", _params("jacrev"))
def test_jacrev(op):
    _check(op, "jacrev")


@pytest.mark.parametrize("op", _params("jacfwd"))
def test_jacfwd(op):
    _check(op, "jacfwd")


@pytest.mark.parametrize("op", _params("hessian"))
def test_hessian(op):
    _check(op, "hessian")


def _op(name: str):
    return next(op for op in op_db if op_id(op) == name)


class _WrongGrad:
    """torch.func with a gradient that is off by a factor: the harness must catch it."""

    def __getattr__(self, name):
        return getattr(torch.func, name)

    @staticmethod
    def grad(fn, argnums=0):
        def run(*args):
            return tuple(1.5 * g for g in torch.func.grad(fn, argnums)(*args))

        return run

    @staticmethod
    def jvp(fn, primals, tangents):
        out, tangent_out = torch.func.jvp(fn, primals, tangents)
        return out, tuple(t.flip(0) if t.dim() else -t for t in tangent_out)


@pytest.mark.parametrize("transform", ["grad", "jvp", "jacrev", "jacfwd", "hessian"])
def test_harness_passes_torch_func(transform):
    assert run_op(_op("sin"), transform, torch.func).status == "pass"


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_harness_catches_wrong_derivatives(transform):
    """A harness that cannot fail is a defect."""
    outcome = run_op(_op("sin"), transform, _WrongGrad())
    assert outcome.status == "fail", outcome.detail
