"""torchlevels.vmap against a per-example loop on every OpInfo in PyTorch's op_db.

The harness is tests/opinfo_harness.py; known failures, each with its cause, are in
tests/opinfo_xfails.py (strict: an op listed there that passes fails the test, so the
list stays honest). Run with ``pytest -n 2 tests/test_opinfo_vmap.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from opinfo_harness import Outcome, op_id, run_op
from opinfo_xfails import SLOW_LOOP_XFAILS, XFAILS
from torch._functorch.top_operators_github_usage import usage_count
from torch.testing._internal.common_methods_invocations import op_db

import torchlevels

# The expected failures below were found on the CPU (scripts/opinfo_*sweep.py), where CI runs.
pytestmark = pytest.mark.cpu_only("the OpInfo expected-failure lists were made on the CPU")

TIMEOUT = 60.0
POPULAR = 100

_outcomes: dict[str, Outcome] = {}


def outcome_of(op) -> Outcome:
    """The harness's result for ``op`` under torchlevels.vmap, computed once per process."""
    key = op_id(op)
    if key not in _outcomes:
        _outcomes[key] = run_op(op, torchlevels.vmap, timeout=TIMEOUT)
    return _outcomes[key]


def _params(ops, xfails: dict[str, str]) -> list:
    return [
        pytest.param(op, id=op_id(op), marks=pytest.mark.xfail(reason=xfails[op_id(op)],
                                                                 strict=True))
        if op_id(op) in xfails else pytest.param(op, id=op_id(op))
        for op in ops
    ]


def popular_ops(n: int = POPULAR) -> list:
    """OpInfos of the ``n`` most used public ops (GitHub usage) that have an OpInfo."""
    by_name: dict[str, list] = {}
    for op in op_db:
        for name in (op.name, *(alias.name for alias in op.aliases)):
            by_name.setdefault(name, []).append(op)
    ranked = sorted(usage_count.items(), key=lambda item: item[1], reverse=True)
    names = [name for name, _ in ranked if name in by_name][:n]
    return [op for name in names for op in by_name[name]]


def test_xfail_lists_name_real_ops():
    ids = {op_id(op) for op in op_db}
    assert len(ids) == len(op_db)
    assert not set(XFAILS) - ids
    assert not set(SLOW_LOOP_XFAILS) - {op_id(op) for op in popular_ops()}


@pytest.mark.parametrize("op", _params(op_db, XFAILS))
def test_vmap_matches_loop(op):
    outcome = outcome_of(op)
    if outcome.status == "skip":
        pytest.skip(outcome.detail)
    assert outcome.status == "pass", outcome.detail


@pytest.mark.parametrize("op", _params(popular_ops(), SLOW_LOOP_XFAILS))
def test_popular_op_has_batching_rule(op):
    outcome = outcome_of(op)
    if outcome.status != "pass":
        pytest.skip(f"{outcome.status} in test_vmap_matches_loop: {outcome.detail}")
    assert not outcome.slow_loop, f"used the slow loop for {sorted(outcome.slow_loop)}"


def test_harness_catches_a_wrong_rule():
    """The harness must fail a vmap that mixes up examples (a harness that cannot fail is
    a defect)."""
    neg = next(op for op in op_db if op.name == "neg")

    def flipped_vmap(fn, in_dims=0, randomness="error"):
        def run(*args):
            return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*args).flip(0)

        return run

    outcome = run_op(neg, flipped_vmap)
    assert outcome.status == "fail", outcome.detail
    assert run_op(neg, torch.func.vmap).status == "pass"


def test_harness_records_the_slow_loop():
    neg = next(op for op in op_db if op.name == "neg")

    def warning_vmap(fn, in_dims=0, randomness="error"):
        def run(*args):
            warnings.warn("no batching rule for aten.neg.default; using a slow loop",
                          stacklevel=2)
            return torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*args)

        return run

    outcome = run_op(neg, warning_vmap)
    assert outcome.status == "pass", outcome.detail
    assert outcome.slow_loop == {"aten.neg.default"}
