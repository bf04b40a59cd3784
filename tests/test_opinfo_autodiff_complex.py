"""torchlevels' grad and jvp against torch.autograd on op_db's complex128 samples.

The harness of tests/test_opinfo_autodiff.py with complex inputs: the gradient of a
complex input is the conjugate Wirtinger derivative that torch.autograd gives, and a
complex output is differentiated through the real part of its weighted sum. (jacrev and
jacfwd refuse complex inputs, as torch.func's do.) The one expected failure is the
float64 sweep's too (tests/opinfo_autodiff_xfails.py).
"""

from __future__ import annotations

import pytest
import torch
from opinfo_autodiff_harness import op_id, run_op
from opinfo_autodiff_xfails import XFAILS
from torch.testing._internal.common_methods_invocations import op_db

import torchlevels

pytestmark = pytest.mark.cpu_only("the samples and their dtypes are the CPU's")

TIMEOUT = 30.0
XFAILS = {"jvp": {}, "grad": {"sparse.sampled_addmm": XFAILS["grad"]["sparse.sampled_addmm"]}}


def _params(transform: str) -> list:
    return [pytest.param(op, id=op_id(op), marks=[pytest.mark.xfail(
                reason=XFAILS[transform][op_id(op)], strict=True)]
                if op_id(op) in XFAILS[transform] else [])
            for op in op_db
            if op.supports_autograd and torch.complex128 in op.supported_backward_dtypes("cpu")]


def _check(op, transform: str) -> None:
    outcome = run_op(op, transform, torchlevels, timeout=TIMEOUT, dtype=torch.complex128)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail


@pytest.mark.parametrize("op", _params("grad"))
def test_grad(op):
    _check(op, "grad")


@pytest.mark.parametrize("op", _params("jvp"))
def test_jvp(op):
    _check(op, "jvp")
