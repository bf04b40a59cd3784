"""SQL's order of floating-point numbers, as DuckDB and PostgreSQL define it: NaN equals
NaN and is greater than every other number (``inf`` included), and ``-0.0`` equals
``0.0``. PyTorch follows IEEE 754 instead, where NaN equals nothing and every ordering
with it is false. So float columns compare, join, group and take their minimum through
this module: ``NaN > 1`` is true, two NaN keys join and fall in one group, and the
minimum of ``[NaN, 2.0]`` is 2.0.

Example::

    >>> import torch
    >>> from torchlevels.relational._floats import COMPARISONS, comparison, order_key
    >>> x = torch.tensor([float("nan"), 1.0])
    >>> COMPARISONS["gt_nan"](x, 0.5).tolist(), COMPARISONS["eq_nan"](x, x).tolist()
    ([True, True], [True, True])
    >>> comparison("gt", x, 0.5), comparison("gt", torch.tensor([1.0, 2.0]), 0.5)
    ('gt_nan', 'gt')
    >>> (order_key(torch.tensor(-0.0)) == order_key(torch.tensor(0.0))).item()
    True
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
         torch.float16: torch.int16, torch.bfloat16: torch.int16}


def order_key(x: torch.Tensor) -> torch.Tensor:
    """Integers that order and compare as the floats ``x`` do in SQL: one NaN, greatest of
    all, and one zero. :func:`from_order_key` turns them back into floats."""
    canonical = torch.where(torch.isnan(x), math.nan, x + 0.0)  # -0.0 + 0.0 is 0.0
    return _flip_negatives(canonical.view(_BITS[x.dtype]))


def from_order_key(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The floats of ``dtype`` whose :func:`order_key` is ``key``."""
    return _flip_negatives(key).view(dtype)


def _flip_negatives(bits: torch.Tensor) -> torch.Tensor:
    # a negative float's bits, read as an integer, grow as the float falls: flipping all
    # but the sign bit reverses that (and is its own inverse)
    return torch.where(bits < 0, bits ^ torch.iinfo(bits.dtype).max, bits)


def _nan(x: Any) -> Any:
    """Where ``x`` is NaN (a bool tensor, or True for a NaN constant); None where it
    cannot be, which leaves IEEE's answer standing."""
    if isinstance(x, torch.Tensor):
        return torch.isnan(x) if x.is_floating_point() else None
    return True if isinstance(x, float) and math.isnan(x) else None


def _not(mask: Any) -> Any:
    return not mask if isinstance(mask, bool) else ~mask


def _eq(a, b):
    out, na, nb = torch.eq(a, b), _nan(a), _nan(b)
    return out if na is None or nb is None else out | (na & nb)


def _ne(a, b):
    out, na, nb = torch.ne(a, b), _nan(a), _nan(b)
    return out if na is None or nb is None else out & _not(na & nb)


def _lt(a, b):
    return _nan_above(torch.lt(a, b), _nan(b), _nan(a))


def _gt(a, b):
    return _nan_above(torch.gt(a, b), _nan(a), _nan(b))


def _le(a, b):
    return _or_nan(torch.le(a, b), _nan(b))


def _ge(a, b):
    return _or_nan(torch.ge(a, b), _nan(a))


def _nan_above(out, high: Any, low: Any):
    """IEEE's ``<`` or ``>`` ``out``, also true where the side that should be greater is
    NaN (``high``) and the other is not (``low``: where it is NaN)."""
    if high is None:
        return out
    return out | (high if low is None else high & _not(low))


def _or_nan(out, nan: Any):
    """IEEE's ``<=`` or ``>=`` ``out``, also true where the side meant to be greater is
    NaN (NaN is at least anything)."""
    return out if nan is None else out | nan


COMPARISONS = {"lt_nan": _lt, "le_nan": _le, "gt_nan": _gt, "ge_nan": _ge, "eq_nan": _eq,
               "ne_nan": _ne}


def comparison(op: str, a: Any, b: Any) -> str:
    """The comparison to record in an expression for ``a op b`` (``op`` is ``"lt"``,
    ``"eq"``...): PyTorch's own where neither side holds a NaN, as in most columns (the
    same answer in fewer kernels), else its SQL form ``op + "_nan"``. A column's tensor is
    checked once while it lives unchanged; an expression's values are not known yet."""
    return f"{op}_nan" if _may_hold_nan(a) or _may_hold_nan(b) else op


def _may_hold_nan(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point() and _holds_nan(x)
    if isinstance(x, float):
        return math.isnan(x)
    return not isinstance(x, int)  # an int or bool constant never; an expression may


_HOLDS_NAN: dict[int, tuple] = {}


def _holds_nan(t: torch.Tensor) -> bool:
    seen = _HOLDS_NAN.get(id(t))
    if seen is None or seen[0]() is not t or seen[1] != t._version:
        key = id(t)
        seen = _HOLDS_NAN[key] = (weakref.ref(t, lambda _: _HOLDS_NAN.pop(key, None)),
                                  t._version, bool(torch.isnan(t).any()))
    return seen[2]
