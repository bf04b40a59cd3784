"""torchlevels' grad, jvp, jacrev, jacfwd and hessian of the OpInfos' method variants
(``x.add(y)``) and in-place variants (``x.add_(y)`` on a copy of ``x``) against
torch.autograd, as tests/test_opinfo_autodiff.py checks their functions: a level sees a
method's own argument forms, and an in-place op writes a tensor of the level, which must
follow the op's new values and shape. Known failures are in
tests/opinfo_autodiff_xfails.py (``VARIANT_XFAILS``).
"""

from __future__ import annotations

import pytest
from opinfo_autodiff_harness import TRANSFORMS, run_op
from opinfo_autodiff_xfails import VARIANT_XFAILS
from opinfo_harness import Variant, op_id
from torch.testing._internal.common_methods_invocations import op_db

import torchlevels

pytestmark = pytest.mark.cpu_only("the OpInfo expected-failure lists were made on the CPU")

TIMEOUT = 30.0
KINDS = ("method", "inplace")


def _variants() -> list[Variant]:
    return [Variant(op, kind) for op in op_db for kind in KINDS
            if op.supports_autograd and getattr(op, f"{kind}_variant") is not None]


def _key(variant: Variant) -> str:
    return f"{op_id(variant)}.{variant.kind}"


def _params() -> list:
    params = []
    for variant in _variants():
        for transform in TRANSFORMS:
            reason = VARIANT_XFAILS.get(transform, {}).get(_key(variant))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            params.append(pytest.param(variant, transform, marks=marks,
                                       id=f"{_key(variant)}-{transform}"))
    return params


def test_xfail_list_names_real_variants():
    keys = {_key(v) for v in _variants()}
    assert set(VARIANT_XFAILS) <= set(TRANSFORMS)
    for transform, xfails in VARIANT_XFAILS.items():
        assert not set(xfails) - keys, transform


@pytest.mark.parametrize(("variant", "transform"), _params())
def test_variant_matches_autograd(variant, transform):
    outcome = run_op(variant, transform, torchlevels, timeout=TIMEOUT)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail
