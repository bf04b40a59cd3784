"""vmap of op_db's samples in dtypes other than float32 against a per-example loop.

tests/test_opinfo_vmap.py checks every OpInfo in float32. Rules also see integers,
bools, complex numbers and half floats, where kernels refuse some dtypes and type
promotion differs: a rule computing an op from other ops could answer where each
example's call raises (prelu of integers did), or promote differently. For each dtype,
the first samples of every OpInfo are batched at dim 0 and at the last dim, and vmap must
agree with a loop over the examples (equal outputs and dtypes, or both raise) wherever
torch.func.vmap agrees with it: no op may do worse than torch.func. (Random ops and ops
listed in tests/opinfo_xfails.py for float32 are left out.)
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from opinfo_harness import (
    _time_limit,
    _Timeout,
    batched_args,
    is_random,
    op_id,
    reference,
    samples,
)
from opinfo_xfails import XFAILS
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten

import torchlevels

pytestmark = pytest.mark.cpu_only("the samples and the kernels' dtypes are the CPU's")

SAMPLES = 4
TIMEOUT = 30.0
DTYPES = [torch.int64, torch.bool, torch.uint8, torch.complex64, torch.float16,
          torch.bfloat16, torch.float64]


def _outcome(run, *args) -> list[torch.Tensor] | str:
    """The outputs of ``run(*args)``, or its error's type."""
    try:
        return run(*args)
    except _Timeout:
        raise
    except Exception as error:
        return type(error).__name__


def _agree(got: list[torch.Tensor] | str, want: list[torch.Tensor] | str,
           dtype: torch.dtype) -> bool:
    if isinstance(got, str) or isinstance(want, str):
        return isinstance(got, str) and isinstance(want, str)
    try:
        for g, w in zip(got, want, strict=True):
            # half floats: rounding in another order is off by an ulp of the largest term
            scale = w.abs().max().item() if w.numel() and w.dtype.is_floating_point else 1
            tol = 2e-2 * max(scale, 1) if dtype in (torch.float16, torch.bfloat16) else 1e-4
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, equal_nan=True)
    except (AssertionError, ValueError):
        return False
    return True


def _vmapped(lib, op, sample, dims: list) -> list[torch.Tensor]:
    """The outputs of ``lib.vmap`` of ``op`` on the sample batched at ``dims``."""
    args, in_dims = batched_args(sample, dims)
    return tree_flatten(lib.vmap(lambda *a: op(*a, **sample.kwargs), in_dims=in_dims)(*args))[0]


def _disagreements(op, dtype: torch.dtype) -> list[str]:
    """``'<op> <where>'`` for each case where torchlevels disagrees with the loop and
    torch.func agrees."""
    found = []
    for n, sample in enumerate(itertools.islice(samples(op, dtype), SAMPLES)):
        try:
            if is_random(op, sample) is not False:
                return found
        except Exception:
            pass  # the op refuses this sample: the loop raises too, vmap must
        tensors = {i for i, a in enumerate(sample.leaves) if isinstance(a, torch.Tensor)}
        for dim in (0, -1):
            dims = [dim if i in tensors else None for i in range(len(sample.leaves))]
            loop = _outcome(reference, op, sample, dims)
            ours = _outcome(_vmapped, torchlevels, op, sample, dims)
            if not _agree(ours, loop, dtype) and _agree(
                    _outcome(_vmapped, torch.func, op, sample, dims), loop, dtype):
                found.append(f"{op_id(op)} sample {n} at {dim}: loop "
                             f"{loop if isinstance(loop, str) else 'ok'}, torchlevels "
                             f"{ours if isinstance(ours, str) else 'differs'}")
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vmap_agrees_with_a_loop_wherever_torch_func_does(dtype):
    warnings.simplefilter("ignore")
    worse, checked = [], 0
    for op in op_db:
        if op_id(op) in XFAILS or "empty" in op.name:
            continue
        try:
            with _time_limit(TIMEOUT):
                worse += _disagreements(op, dtype)
        except _Timeout:
            worse.append(f"{op_id(op)}: timeout after {TIMEOUT}s")
        except Exception:
            continue  # the OpInfo makes no samples of this dtype
        checked += 1
    assert checked > 400  # the sweep did run
    assert not worse, "torch.func.vmap agrees with the loop and torchlevels does not:\n" + (
        "\n".join(worse))
