"""SQL's integer arithmetic: an int64 result that does not fit is an error, never a wrap
(and a date plus or minus days out of the dates' range too).

PyTorch's integers wrap around (``2**62 + 2**62`` is ``-2**63``); SQL raises instead
(DuckDB: "Overflow in addition of INT64"). So an expression of int columns records the
checked ops of this module, which look for overflow with a few vectorized bit tests,
and a sum of int64 values is taken as two sums, of the high and of the low 32 bits of
each value: each fits in an int64 for fewer than 2**31 rows, and together they give
the exact total, or tell that it does not fit. Float columns never come here.

Example::

    >>> import torch
    >>> from torchlevels.relational._ints import CHECKED, summed_halves, whole
    >>> x = torch.tensor([2**62, 5])
    >>> CHECKED["add_int"](x, 1).tolist()
    [4611686018427387905, 6]
    >>> CHECKED["add_int"](x, x)
    Traceback (most recent call last):
    ...
    OverflowError: int64 overflow: 4611686018427387904 + 4611686018427387904 does not fit
    in 64 bits (SQL's BIGINT); compute in floats instead (multiply a column by 1.0)
    >>> whole(summed_halves(x)).item()
    4611686018427387909
"""

from __future__ import annotations

import torch

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LOW_BITS = 0xFFFFFFFF


def _overflow(where: torch.Tensor, symbol: str, *operands) -> None:
    """Raise for the first row of ``where`` (a bool tensor) whose ``symbol`` of
    ``operands`` (one: a prefix op or a function; two: an infix op) overflowed."""
    if not bool(where.any()):
        return
    values = _first_where(where, operands)
    if len(values) == 2:
        text = f" {symbol} ".join(map(str, values))
    else:
        text = f"{symbol}({values[0]})" if symbol.isalpha() else f"{symbol}{values[0]}"
    raise OverflowError(f"int64 overflow: {text} does not fit in 64 bits (SQL's BIGINT); "
                        "compute in floats instead (multiply a column by 1.0)")


def _first_where(where: torch.Tensor, operands: tuple) -> list:
    """The operands' values at the first row where ``where`` holds."""
    row = torch.nonzero(where.reshape(-1))[0]
    return [v.expand_as(where).reshape(-1)[row].item() if isinstance(v, torch.Tensor)
            else v for v in operands]


def _add(a, b):
    out = a + b
    _overflow(((a ^ out) & (b ^ out)) < 0, "+", a, b)  # the sign of out differs from both
    return out


def _sub(a, b):
    a, b = _int64(a), _int64(b)  # date - date: days are int32, their difference a BIGINT
    out = a - b
    _overflow(((a ^ b) & (a ^ out)) < 0, "-", a, b)  # a's sign differs from b's and out's
    return out


def _mul(a, b):
    out = a * b
    # a float64 product is within a relative 2**-50 of the true one: only products near
    # 2**63 need a look with Python's exact ints
    near = (_double(a) * _double(b)).abs() >= 2.0**62
    if bool(near.any()):
        xs, ys = (torch.as_tensor(v, device=near.device).expand_as(near)[near].tolist()
                  for v in (a, b))
        bad = torch.tensor([not INT64_MIN <= x * y <= INT64_MAX for x, y in zip(xs, ys)])
        _overflow(near.masked_scatter(near, bad.to(near.device)), "*", a, b)
    return out


def _neg(a):
    _overflow(a == INT64_MIN, "-", a)
    return -a


def _abs(a):
    _overflow(a == INT64_MIN, "abs", a)
    return a.abs()


def _double(x):
    return x.double() if isinstance(x, torch.Tensor) else float(x)


def _int64(x):
    return x.long() if isinstance(x, torch.Tensor) else x


# SQL's DATE holds int32 days, but for the two values that stand for +-infinity
DAYS_MIN, DAYS_MAX = -(2**31) + 2, 2**31 - 2


def _add_days(a, b):
    return _in_date_range(_add(_int64(a), _int64(b)), "+", a, b)


def _sub_days(a, b):
    return _in_date_range(_sub(a, b), "-", a, b)


def _in_date_range(days: torch.Tensor, symbol: str, *operands) -> torch.Tensor:
    """``days`` (int64) as a date column's int32 days; one out of SQL's DATE range raises,
    as DuckDB's "Date out of range" (int32 arithmetic would wrap to some other date)."""
    where = (days < DAYS_MIN) | (days > DAYS_MAX)
    if bool(where.any()):
        a, b = _first_where(where, operands)
        raise OverflowError(
            f"date out of range: {a} {symbol} {b} (in days since 1970-01-01) is beyond "
            f"SQL's DATE, days in [{DAYS_MIN}, {DAYS_MAX}]; add or subtract fewer days"
        )
    return days.int()


CHECKED = {"add_int": _add, "sub_int": _sub, "mul_int": _mul, "neg_int": _neg, "abs_int": _abs,
           "add_date": _add_days, "sub_date": _sub_days}


def check_constant(value: int, what: str) -> int:
    """``value`` if it fits in an int64, else an OverflowError naming it and ``what``."""
    if not INT64_MIN <= value <= INT64_MAX:
        raise OverflowError(
            f"the constant {value} does not fit in 64 bits, the type of {what}: use a "
            f"constant in [{INT64_MIN}, {INT64_MAX}] (or a float)"
        )
    return value


def halves(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer ``values`` as their high (signed) and low (unsigned) 32 bits: ``values ==
    high * 2**32 + low``, and sums of either over fewer than 2**31 rows fit in an int64."""
    values = values.long()
    return values >> 32, values & _LOW_BITS


def summed_halves(values: torch.Tensor) -> torch.Tensor:
    """The sums of the :func:`halves` of all ``values``, as a tensor of 2 for
    :func:`whole` (two contiguous sums: summing a stacked (n, 2) runs at half the speed)."""
    high, low = halves(values)
    return torch.stack([high.sum(), low.sum()])


def whole(sums: torch.Tensor) -> torch.Tensor:
    """The int64 totals ``high * 2**32 + low`` of sums of :func:`halves` (stacked in a last
    dim of 2), or an OverflowError where one does not fit in 64 bits."""
    high, low = sums[..., 0], sums[..., 1]
    high = high + (low >> 32)  # carry the low sums' high bits over
    low = low & _LOW_BITS
    if bool(((high < -(2**31)) | (high >= 2**31)).any()):
        raise OverflowError("int64 overflow: a sum does not fit in 64 bits (SQL's BIGINT); "
                            "sum in floats instead (multiply the column by 1.0)")
    return high * 2**32 + low


def whole_float(sums: torch.Tensor) -> torch.Tensor:
    """The totals of sums of :func:`halves` as float64, however large (for means)."""
    return sums[..., 0].double() * 2.0**32 + sums[..., 1].double()
