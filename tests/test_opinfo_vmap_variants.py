"""torchlevels.vmap of the OpInfos' method variants (``x.add(y)``) and in-place variants
(``x.add_(y)`` on a copy of ``x``) against a per-example loop, as tests/test_opinfo_vmap.py
checks their functions: a shortcut or rule keyed on a method sees its own argument forms,
and an in-place op writing batched values into an unbatched input must raise vmap's
error (the harness expects it there). Known failures are in tests/opinfo_xfails.py.
"""

from __future__ import annotations

import pytest
from opinfo_harness import Variant, op_id, run_op
from opinfo_xfails import VARIANT_XFAILS
from torch.testing._internal.common_methods_invocations import op_db

import torchlevels

pytestmark = pytest.mark.cpu_only("the OpInfo expected-failure lists were made on the CPU")

TIMEOUT = 60.0


def _params(kind: str) -> list:
    params = []
    for op in op_db:
        if getattr(op, f"{kind}_variant") is None:
            continue
        key = f"{op_id(op)}.{kind}"
        marks = ([pytest.mark.xfail(reason=VARIANT_XFAILS[key], strict=True)]
                 if key in VARIANT_XFAILS else [])
        params.append(pytest.param(Variant(op, kind), id=key, marks=marks))
    return params


def test_xfail_list_names_real_variants():
    keys = {f"{op_id(op)}.{kind}" for op in op_db for kind in ("method", "inplace")
            if getattr(op, f"{kind}_variant") is not None}
    assert not set(VARIANT_XFAILS) - keys


@pytest.mark.parametrize("variant", _params("method") + _params("inplace"))
def test_variant_matches_loop(variant):
    outcome = run_op(variant, torchlevels.vmap, timeout=TIMEOUT)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail
