"""Columns: a 1-D tensor of values bound to first-class dims, with a type and nulls.

A column's ``values`` has one entry per row of its dims: ``dims == (L,)`` for a table
bound to ``L``, ``()`` for a scalar (or for a positional column, whose values are 1-D),
and ``(G, J)`` for a grouped column, stored flat with the group of each row in
``groups``. Strings are dictionary-encoded: ``values`` are codes into ``dictionary``, a
sorted arrow array, so code order is string order and string predicates run once per
distinct string. Nulls are a ``valid`` mask (None when every value is valid).

An op on columns bound to different dims (``o["o_custkey"] == c["c_custkey"]``) does
not make the outer product: it returns a lazy :class:`Cross` that ``where`` turns into a
join.
"""

from __future__ import annotations

import datetime
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from torchlevels.dim import Dim
from torchlevels.relational._floats import comparison
from torchlevels.relational._fuse import OPS, Expr, evaluate
from torchlevels.relational._ints import CHECKED, check_constant

if TYPE_CHECKING:
    from torchlevels.relational._where import Selection

KINDS = ("int", "float", "bool", "date", "timestamp", "timestamptz", "str")
_EPOCH = datetime.date(1970, 1, 1)
_EPOCH_TIME = datetime.datetime(1970, 1, 1)
_TIMES = ("date", "timestamp")  # a date or datetime constant takes the kind of such a column
_NUMERIC = ("int", "float", "bool")


@dataclass(eq=False)
class Grouping:
    """Rows split into groups: ``gid[row]`` in ``0 .. size - 1`` (``size`` for a row left
    out by a filter), a tensor or an expression that fused kernels compute inline;
    ``G`` numbers the groups and the jagged ``J`` the rows inside one; ``sizes`` counts
    the rows of each group."""

    gid: torch.Tensor | Expr
    size: int
    G: Dim
    J: Dim
    sizes: torch.Tensor

    def ids(self) -> torch.Tensor:
        """``gid`` as a tensor (run once if it is an expression)."""
        self.gid = evaluate(self.gid)
        return self.gid

    def in_a_group(self) -> Expr:
        """True at the rows of some group, false at those a filter left out."""
        return Expr("lt", (self.gid, self.size))


def same_dims(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    """Whether two tuples hold the same dims in the same order (dims compare by identity:
    ``==`` on dims is elementwise, as on tensors)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def date_to_days(d: datetime.date) -> int:
    """Days since 1970-01-01, how date columns store a date. A datetime must be at
    midnight: date columns hold whole days, and its time of day would be lost."""
    if isinstance(d, datetime.datetime):
        if d.time() != datetime.time(0):
            raise ValueError(f"{d!r} has a time of day, but date columns hold whole days: "
                             "use a datetime.date (or a datetime at midnight)")
        d = d.date()
    return (d - _EPOCH).days


def to_microseconds(d: datetime.date) -> int:
    """Microseconds since 1970-01-01 00:00, how timestamp columns store a time (a date is
    its midnight; a datetime with a time zone is its UTC time, as timestamptz columns
    hold it)."""
    if not isinstance(d, datetime.datetime):
        d = datetime.datetime.combine(d, datetime.time(0))
    if d.utcoffset() is not None:
        d = d.astimezone(datetime.timezone.utc).replace(tzinfo=None)
    return (d - _EPOCH_TIME) // datetime.timedelta(microseconds=1)


def _time_value(value: datetime.date, kind: str) -> int:
    """A date or datetime constant as a column of ``kind`` stores it."""
    return date_to_days(value) if kind == "date" else to_microseconds(value)


def _describe(x: object) -> str:
    return x.describe() if isinstance(x, Column) else f"{x!r} ({_const_kind(x)})"


def _python(x: object) -> object:
    """A NumPy scalar as the Python value it holds (``np.int64(2)`` is ``2``), as pandas
    and DuckDB take it; anything else as it is."""
    return x.item() if isinstance(x, np.generic) else x


def _const_kind(x: object, column_kind: str | None = None) -> str:
    """The kind of constant ``x``; next to a date or timestamp column (``column_kind``),
    a date or a datetime without a time zone takes the column's kind, as SQL casts it."""
    if isinstance(x, datetime.datetime):
        kind = "timestamptz" if x.utcoffset() is not None else "timestamp"
        return column_kind if kind in _TIMES and column_kind in _TIMES else kind
    if isinstance(x, datetime.date):
        return column_kind if column_kind in _TIMES else "date"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    if x is None:
        raise TypeError(
            "cannot use None in a column expression: a null is no value to compute with "
            "(SQL's x = NULL is null, never true); test for nulls with .is_null(), replace "
            "them with .fill_null(value), keep rows with where(mask, rows)"
        )
    raise TypeError(
        f"cannot use {x!r} ({type(x).__name__}) in a column expression: use an int, "
        "float, bool, str, datetime.date, datetime.datetime or a Column"
    )


def _result_kind(op: str, a: str, b: str) -> str:
    if op in ("add", "sub") and a == "date" and b == "int":
        return "date"
    if op == "add" and b == "date" and a == "int":
        return "date"
    if op == "sub" and a == b == "date":
        return "int"
    if "bool" in (a, b):  # as SQL: true + true is an error, not 2 (nor true)
        raise TypeError(f"cannot {op} {a} and {b} values: SQL has no arithmetic on bools; "
                        "where(b, 1, 0) turns a bool column into ints")
    if a not in _NUMERIC or b not in _NUMERIC:
        raise TypeError(f"cannot {op} {a} and {b} values")
    if op in ("truediv", "pow") or "float" in (a, b):
        return "float"
    return "int"


def _checked(op: str, kind: str) -> str:
    """The op to record: int arithmetic raises on overflow, and a date plus or minus days
    out of the dates' range, as SQL's does (``_ints``)."""
    if kind == "date" and op in ("add", "sub"):
        return f"{op}_date"
    return f"{op}_int" if kind == "int" and op in ("add", "sub", "mul", "neg", "abs") else op


def _common_kind(a: str, b: str, what: str) -> str:
    """The kind of a value that is either an ``a`` or a ``b`` (COALESCE, CASE WHEN)."""
    if a == b:
        return a
    if a in _NUMERIC and b in _NUMERIC:
        return max(a, b, key=("bool", "int", "float").index)  # as SQL casts them
    raise TypeError(f"{what}: cannot mix {a} and {b} values")


def _constant(value, col: Column):
    """``value`` as an operand of an op with ``col``: dates as days, datetimes as
    microseconds, ints checked to fit in 64 bits, and a float with an int or bool column
    as a float64 0-d tensor (torch would compute in float32, SQL computes in DOUBLE)."""
    kind = _const_kind(value, col.kind)
    if kind in ("date", "timestamp", "timestamptz"):
        return _time_value(value, kind)
    if kind == "int" and col.kind == "float":  # exact enough: SQL casts it to DOUBLE
        return value if -(2**63) <= value < 2**63 else float(value)
    if kind == "int":
        return check_constant(value, col.describe())
    if kind == "float" and col.kind != "float":
        return torch.tensor(value, dtype=torch.float64, device=_device(col))
    return value


class Column:
    """A typed column of values, bound to first-class dims (see the module docstring).

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table
        >>> t = Table({"x": [1, 2, 3], "y": [10.0, 20.0, 30.0]})
        >>> R = dims(1)
        >>> r = t[R]
        >>> ((r["x"] * r["y"]).sum(R)).item()
        140.0
    """

    __slots__ = ("data", "kind", "dims", "valid", "dictionary", "groups", "selection", "name",
                 "_values", "_where_cache", "__weakref__")

    def __init__(
        self,
        values: torch.Tensor | Expr,
        kind: str,
        *,
        dims: tuple[Dim, ...] = (),
        valid: torch.Tensor | None = None,
        dictionary: pa.Array | None = None,
        groups: Grouping | None = None,
        selection: Selection | None = None,
        name: str = "column",
    ) -> None:
        assert kind in KINDS, kind
        assert selection is None or valid is None, "filtered columns with nulls are gathered"
        self.data = values  # over the physical rows: all of them, before a filter
        self.kind = kind
        self.dims = dims
        self.valid = valid
        self.dictionary = dictionary
        self.groups = groups
        self.selection = selection
        self.name = name
        self._values: torch.Tensor | None = None
        self._where_cache = None

    @property
    def values(self) -> torch.Tensor:
        """The values, one per row (a filter's rows gathered, an expression run)."""
        if self._values is None:
            data = self.physical()
            self._values = data if self.selection is None else data[self.selection.index()]
        return self._values

    def physical(self) -> torch.Tensor:
        """The values over the physical rows (before a filter's gather)."""
        if isinstance(self.data, Expr):
            self.data = evaluate(self.data)
        return self.data

    def num_rows(self) -> int:
        """The number of rows, without running anything."""
        if self.selection is not None:
            return self.selection.count()
        data = self.data
        if isinstance(data, Expr):
            return data.rows
        if data.ndim == 0:
            raise TypeError(f"{self.describe()} is a scalar: it has no rows")
        return data.shape[0]

    def _is_scalar(self) -> bool:
        return not self.dims and isinstance(self.data, torch.Tensor) and self.data.ndim == 0

    def rebound(self, dims: tuple[Dim, ...] = (), groups: Grouping | None = None,
                name: str | None = None) -> Column:
        """The same values (and nulls, and filter) bound to ``dims`` (``()``: positional)."""
        return Column(self.data, self.kind, dims=dims, valid=self.valid,
                      dictionary=self.dictionary, groups=groups, selection=self.selection,
                      name=name or self.name)

    def is_true(self) -> torch.Tensor:
        """Where a boolean column is true and not null, one entry per row."""
        return self.values if self.valid is None else self.values & self.valid

    def _lazy(self, expr: Expr, kind: str, name: str) -> Column:
        """A column over the same (physical) rows, computed by ``expr``."""
        return Column(expr, kind, dims=self.dims, dictionary=self.dictionary if kind == "str"
                      else None, groups=self.groups, selection=self.selection, name=name)

    # -- facts ---------------------------------------------------------------------------
    def describe(self) -> str:
        bound = f" over {', '.join(map(repr, self.dims))}" if self.dims else ""
        return f"column '{self.name}' ({self.kind}{bound})"

    def __repr__(self) -> str:
        body = self.item() if self._is_scalar() else self.to_arrow().to_pylist()
        if isinstance(body, list) and len(body) > 10:
            body = f"{body[:10]!r}... ({len(body)} values)"
        return f"Column({self.describe()}: {body})"

    def __len__(self) -> int:
        return self.num_rows()

    def __bool__(self) -> bool:
        raise TypeError(
            f"the truth value of {self.describe()} is ambiguous: combine conditions with "
            "&, |, ~ (not and/or/not) and filter with where(mask, rows)"
        )

    def _like(self, values, kind=None, valid=..., name=None, dictionary=None) -> Column:
        """A column of ``values`` (one per row, gathered) over the same rows (same nulls
        unless ``valid`` is given)."""
        valid = self.valid if valid is ... else valid
        kind = kind or self.kind
        if kind == "str" and dictionary is None:
            dictionary = self.dictionary
        return Column(values, kind, dims=self.dims, valid=valid, dictionary=dictionary,
                      groups=self.groups, name=name or self.name)

    def to(self, device: str | torch.device) -> Column:
        """The column with its values (and nulls) on ``device``."""
        valid = None if self.valid is None else self.valid.to(device)
        return Column(self.values.to(device), self.kind, dims=self.dims, valid=valid,
                      dictionary=self.dictionary, groups=self.groups, name=self.name)

    def take(self, index: torch.Tensor, dims: tuple[Dim, ...] = (), groups=None) -> Column:
        """The column at rows ``index`` (``-1`` gives a null), as a column over ``dims``."""
        missing = index < 0
        has_missing = bool(missing.any())
        safe = index.clamp(min=0) if has_missing else index
        if self.values.numel():
            values = self.values[safe]
            valid = None if self.valid is None else self.valid[safe]
        else:  # no rows: every index is -1, a null
            values = self.values.new_zeros(index.shape)
            valid = None if self.valid is None else self.valid.new_zeros(index.shape)
        if has_missing:
            valid = ~missing if valid is None else valid & ~missing
        return Column(values, self.kind, dims=dims, valid=valid, dictionary=self.dictionary,
                      groups=groups, name=self.name)

    # -- scalars -------------------------------------------------------------------------
    def item(self):
        """The Python value of a scalar column (``None`` for a null).

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"x": [1.5, 2.5]})["x"].sum().item()
            4.0
        """
        if self.values.ndim != 0:
            raise TypeError(f"{self.describe()} has {self.values.shape[0]} values, not one")
        if self.valid is not None and not bool(self.valid):
            return None
        v = self.values.item()
        if self.kind == "date":
            return _EPOCH + datetime.timedelta(days=int(v))
        if self.kind in ("timestamp", "timestamptz"):
            t = _EPOCH_TIME + datetime.timedelta(microseconds=int(v))
            return t.replace(tzinfo=datetime.timezone.utc) if self.kind == "timestamptz" else t
        if self.kind == "str":
            return self.dictionary[int(v)].as_py()
        if self.kind == "bool":
            return bool(v)
        return v

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    # -- arrow ---------------------------------------------------------------------------
    def to_arrow(self) -> pa.Array:
        """The values as an arrow array (strings decoded, dates as date32, timestamps in
        microseconds (timestamptz in UTC), nulls as null)."""
        values = self.values.reshape(-1).cpu()
        mask = None if self.valid is None else (~self.valid.reshape(-1)).cpu().numpy()
        if self.kind == "str":
            return pc.take(self.dictionary, pa.array(values.numpy(), mask=mask))
        np_values = values.numpy()
        if self.kind == "date":
            return pa.array(np_values.astype("int32"), type=pa.int32(), mask=mask).cast(
                pa.date32())
        if self.kind in ("timestamp", "timestamptz"):
            tz = "UTC" if self.kind == "timestamptz" else None
            return pa.array(np_values, mask=mask).cast(pa.timestamp("us", tz))
        return pa.array(np_values, mask=mask)

    # -- elementwise ops -----------------------------------------------------------------
    def _binary(self, other, op: str, symbol: str, compare=False, flip=False):
        other = _python(other)
        if isinstance(other, Cross) or (
            isinstance(other, Column) and _crosses(self, other)
        ):
            a, b = (other, self) if flip else (self, other)
            return Cross(op, (a, b), symbol)
        left, right = (other, self) if flip else (self, other)
        name = f"({_name(left)} {symbol} {_name(right)})"
        if isinstance(other, Column):
            kind = "bool" if compare else _result_kind(op, left.kind, right.kind)
            op = _checked(op, kind)
            rows = _fusable(left, right)
            if rows is not None and (not compare or left.kind != "str"):
                if compare:
                    _comparable(left, right, symbol)  # raises on kinds that do not compare
                    op = comparison(op, left.data, right.data)
                return rows._lazy(Expr(op, (_data(left, op), _data(right, op))), kind, name)
            a, b = _aligned(left, right, symbol)
            if compare:
                a, b = _comparable(a, b, symbol)
                op = f"{op}_nan"  # SQL's order of floats (the same as PyTorch's for others)
            return _combine(a, b, OPS[op](_values(a, op), _values(b, op)), kind, name)
        if compare:
            return _compare_const(self, other, op, symbol, flip, name)
        ck = _const_kind(other, self.kind)
        kind = _result_kind(op, *((ck, self.kind) if flip else (self.kind, ck)))
        op = _checked(op, kind)
        c = _constant(other, self)
        if self.valid is None and not self._is_scalar():
            args = (c, _data(self, op)) if flip else (_data(self, op), c)
            return self._lazy(Expr(op, args), kind, name)
        args = (c, _values(self, op)) if flip else (_values(self, op), c)
        return self._like(OPS[op](*args), kind, self.valid, name)

    def __add__(self, o):
        return self._binary(o, "add", "+")

    def __radd__(self, o):
        return self._binary(o, "add", "+", flip=True)

    def __sub__(self, o):
        return self._binary(o, "sub", "-")

    def __rsub__(self, o):
        return self._binary(o, "sub", "-", flip=True)

    def __mul__(self, o):
        return self._binary(o, "mul", "*")

    def __rmul__(self, o):
        return self._binary(o, "mul", "*", flip=True)

    def __truediv__(self, o):
        return self._binary(o, "truediv", "/")

    def __rtruediv__(self, o):
        return self._binary(o, "truediv", "/", flip=True)

    def __pow__(self, o):
        return self._binary(o, "pow", "**")

    def __rpow__(self, o):
        return self._binary(o, "pow", "**", flip=True)

    def __floordiv__(self, o):
        raise _no_integer_division("//")

    __rfloordiv__ = __floordiv__

    def __mod__(self, o):
        raise _no_integer_division("%")

    __rmod__ = __mod__

    def __neg__(self) -> Column:
        return self._unary("neg", "negate", f"-{self.name}")

    def __abs__(self) -> Column:
        return self._unary("abs", "take abs of", f"abs({self.name})")

    def _unary(self, op: str, verb: str, name: str) -> Column:
        """``op`` of a number column (``verb`` names it in the error for other kinds)."""
        if self.kind not in ("int", "float"):
            raise TypeError(f"cannot {verb} {self.describe()}")
        op = _checked(op, self.kind)
        if self.valid is None and not self._is_scalar():
            return self._lazy(Expr(op, (_data(self, op),)), self.kind, name)
        return self._like(OPS[op](_values(self, op)), valid=self.valid, name=name)

    def __lt__(self, o):
        return self._binary(o, "lt", "<", compare=True)

    def __le__(self, o):
        return self._binary(o, "le", "<=", compare=True)

    def __gt__(self, o):
        return self._binary(o, "gt", ">", compare=True)

    def __ge__(self, o):
        return self._binary(o, "ge", ">=", compare=True)

    def __eq__(self, o):  # type: ignore[override]
        return self._binary(o, "eq", "==", compare=True)

    def __ne__(self, o):  # type: ignore[override]
        return self._binary(o, "ne", "!=", compare=True)

    __hash__ = object.__hash__

    def __and__(self, o):
        return _logical(self, o, "and")

    def __rand__(self, o):
        return _logical(self, o, "and")

    def __or__(self, o):
        return _logical(self, o, "or")

    def __ror__(self, o):
        return _logical(self, o, "or")

    def __invert__(self) -> Column:
        self._expect("bool", "~")
        if self.valid is None and not self._is_scalar():
            return self._lazy(Expr("invert", (self.data,)), "bool", f"~{self.name}")
        return self._like(~self.values, valid=self.valid, name=f"~{self.name}")

    def between(self, low, high) -> Column:
        """``low <= self <= high`` (SQL's BETWEEN, both ends included).

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"x": [1, 5, 9]})["x"].between(2, 9).to_arrow().to_pylist()
            [False, True, True]
        """
        return (self >= low) & (self <= high)

    def is_null(self) -> Column:
        """True where the value is null (never null itself)."""
        v = torch.zeros_like(self.values, dtype=torch.bool) if self.valid is None else ~self.valid
        return self._like(v, "bool", None, f"{self.name} IS NULL")

    def fill_null(self, value) -> Column:
        """The column with nulls replaced by ``value`` (SQL's COALESCE)."""
        value = _python(value)
        kind = _common_kind(self.kind, _const_kind(value, self.kind),
                            f"coalesce({_describe(self)}, {_describe(value)})")
        if self.valid is None:
            if kind == self.kind:
                return self
            return self._like(self.values.to(_DTYPES[kind]), kind, None, self.name)
        a, b = _comparable(self, _broadcast_const(self, value), "coalesce")
        return a._like(torch.where(a.valid, a.values, b.values), kind, None,
                       f"coalesce({self.name}, {value!r})", a.dictionary)

    # -- strings, evaluated once per distinct string -------------------------------------
    def isin(self, values: Iterable) -> Column:
        """True where the value is one of ``values`` (SQL's IN).

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"s": ["a", "b", "c"]})["s"].isin(["a", "c"]).to_arrow().to_pylist()
            [True, False, True]
        """
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise TypeError(
                f"isin takes a collection of values (a list, tuple, set or array), got "
                f"{values!r} ({type(values).__name__}); to compare with one value use =="
            )
        values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
        values = [_python(v) for v in values]
        if self.kind == "str":
            for v in values:
                if not isinstance(v, str):
                    raise TypeError(f"cannot compare {self.describe()} with {_describe(v)}")
            return self._on_dictionary(pc.is_in(self.dictionary, pa.array(values, pa.string())),
                                       f"{self.name} IN {values!r}")
        out = None
        for v in values:
            hit = self == v
            out = hit if out is None else out | hit
        if out is None:
            return self._like(torch.zeros_like(self.values, dtype=torch.bool), "bool", self.valid)
        return out

    def startswith(self, prefix: str) -> Column:
        """True where the string starts with ``prefix``."""
        return self._string_predicate(pc.starts_with, prefix, "LIKE '{}%'")

    def endswith(self, suffix: str) -> Column:
        """True where the string ends with ``suffix``."""
        return self._string_predicate(pc.ends_with, suffix, "LIKE '%{}'")

    def contains(self, text: str) -> Column:
        """True where the string contains ``text``."""
        return self._string_predicate(pc.match_substring, text, "LIKE '%{}%'")

    def like(self, pattern: str) -> Column:
        """SQL LIKE: ``%`` matches any run of characters, ``_`` any one character, and
        every other character itself (a backslash too: as in DuckDB, there is no escape
        character).

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"s": ["green tea", "red"]})["s"].like("%tea").to_arrow().to_pylist()
            [True, False]
        """
        return self._string_predicate(_match_like, pattern, "LIKE '{}'")

    def _string_predicate(self, fn, text: str, sql: str) -> Column:
        self._expect("str", sql.format(text))
        if not isinstance(text, str):
            raise TypeError(f"cannot match {self.describe()} against {_describe(text)}")
        return self._on_dictionary(fn(self.dictionary, text), f"{self.name} {sql.format(text)}")

    def _on_dictionary(self, per_string: pa.Array, name: str) -> Column:
        lut = torch.from_numpy(per_string.to_numpy(zero_copy_only=False).copy())
        if not lut.numel():  # an empty dictionary: every value is null
            lut = torch.zeros(1, dtype=torch.bool)
        if self.valid is None and not self._is_scalar():
            lut = lut.to(self.data.device)
            return self._lazy(Expr("lookup", (self.data, lut)), "bool", name)
        return self._like(lut.to(self.values.device)[self.values], "bool", self.valid, name)

    def _expect(self, kind: str, what: str) -> None:
        if self.kind != kind:
            raise TypeError(f"{what} needs a {kind} column, got {self.describe()}")

    # -- aggregates over a dim -----------------------------------------------------------
    def sum(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Sum over ``dim`` (all dims when None), skipping nulls; null where all are null."""
        return aggregate(self, dim, "sum")

    def mean(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Mean over ``dim`` of the non-null values."""
        return aggregate(self, dim, "mean")

    def min(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Smallest non-null value over ``dim``."""
        return aggregate(self, dim, "min")

    def max(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Largest non-null value over ``dim``."""
        return aggregate(self, dim, "max")

    def count(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Number of non-null values over ``dim`` (SQL's COUNT(column))."""
        return aggregate(self, dim, "count")

    def count_distinct(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """Number of distinct non-null values over ``dim`` (COUNT(DISTINCT column))."""
        return aggregate(self, dim, "count_distinct")

    def order(self, *dims: Dim) -> Column:
        """The column with its dim made positional (a column of a :class:`Table`).

        Example::

            >>> from torchlevels.dim import dims
            >>> from torchlevels.relational import Table
            >>> R = dims(1)
            >>> (Table({"x": [1, 2]})[R]["x"] * 10).order(R).to_arrow().to_pylist()
            [10, 20]
        """
        if not same_dims(dims, self.dims) or len(dims) != 1:
            raise ValueError(f"order{dims!r}: {self._not_orderable()}")
        return Column(self.values, self.kind, valid=self.valid, dictionary=self.dictionary,
                      name=self.name)

    def _not_orderable(self) -> str:
        """Why ``order`` does not take the dims it was given."""
        if self._is_scalar():
            return (f"{self.describe()} is a single value (an aggregate), with no rows to "
                    "order: read it with .item()")
        if not self.dims:
            return (f"{self.describe()} is positional (a column of a Table): it is already "
                    "in row order")
        if self.groups is not None and len(self.dims) == 2:
            G, J = self.dims
            return (f"{self.describe()} is grouped, with a jagged dim {J!r} inside each "
                    f"group: reduce over {J!r} for a column over {G!r} (x.sum({J!r})"
                    f".order({G!r})), or list the grouped rows with rows.order({G!r}, {J!r})")
        own = ", ".join(map(repr, self.dims))
        return f"{self.describe()} is ordered by its own dim: .order({own})"


def _no_integer_division(symbol: str) -> TypeError:
    """The error for ``//`` and ``%``, which SQL and Python define differently."""
    return TypeError(
        f"'{symbol}' is not supported on columns: SQL's // and % round the quotient toward "
        "zero (-7 // 2 is -3 and -7 % 2 is -1, where Python's give -4 and 1) and raise on a "
        "zero divisor; divide with / (in floats), or compute on the tensors (column.values, "
        "with column.valid marking the non-null values)"
    )


def _match_like(strings: pa.Array, pattern: str) -> pa.Array:
    # as a regex: Arrow's LIKE takes a backslash as an escape character, SQL's has none
    regex = "".join({"%": ".*", "_": "."}.get(ch) or re.escape(ch) for ch in pattern)
    return pc.match_substring_regex(strings, f"(?s)^{regex}$")


def _name(x) -> str:
    return x.name if isinstance(x, Column) else repr(x)


def _crosses(a: Column, b: Column) -> bool:
    """Whether an op on ``a`` and ``b`` spans two different dims (a lazy outer product)."""
    return bool(a.dims and b.dims and not set(a.dims) & set(b.dims))


def _fusable(a: Column, b: Column) -> Column | None:
    """The operand whose rows an op on ``a`` and ``b`` can record as an expression over
    physical rows (no nulls, the same filter and grouping, or a scalar), else None."""
    if a.valid is not None or b.valid is not None:
        return None
    if a._is_scalar() or b._is_scalar():
        return None if a._is_scalar() and b._is_scalar() else (b if a._is_scalar() else a)
    if (same_dims(a.dims, b.dims) and a.groups is b.groups and a.selection is b.selection
            and _rows(a) == _rows(b)):
        return a
    return None


def _data(col: Column, op: str):
    """``col.data`` as an operand of ``op``. A checked int op (``_ints``) reads 0 at the
    physical rows the column does not hold (a filter's rows left out, rows in no group):
    their values must not raise an overflow no one asked about."""
    if op not in CHECKED:
        return col.data
    if col.selection is not None:
        return Expr("select", (col.selection.mask, col.data, 0))
    if _rows_in_no_group(col):
        return Expr("select", (col.groups.in_a_group(), col.data, 0))
    return col.data


def _values(col: Column, op: str) -> torch.Tensor:
    """``col.values`` as an operand of ``op``: for a checked int op, 0 at nulls and at rows
    in no group (see :func:`_data`)."""
    values, held = col.values, col.valid
    if op not in CHECKED:
        return values
    if col.selection is None and _rows_in_no_group(col):
        in_group = col.groups.ids() < col.groups.size
        held = in_group if held is None else held & in_group
    return values if held is None else torch.where(held, values, 0)


def _rows_in_no_group(col: Column) -> bool:
    """Whether a grouped column has rows that a filter before the groupby left out."""
    return col.groups is not None and int(col.groups.sizes.sum()) < _rows(col)


def _device(c: Column) -> torch.device:
    return c.data.device


def _rows(c: Column) -> int:
    return c.data.rows if isinstance(c.data, Expr) else c.data.shape[0]


def _aligned(a: Column, b: Column, symbol: str) -> tuple[Column, Column]:
    """``a`` and ``b`` over the same rows: equal dims, a scalar, or a per-group value
    broadcast to the rows of its groups."""
    if same_dims(a.dims, b.dims) and a.groups is b.groups:
        if not a._is_scalar() and not b._is_scalar() and a.num_rows() != b.num_rows():
            raise ValueError(
                f"{a.describe()} has {a.num_rows()} rows but {b.describe()} has "
                f"{b.num_rows()}: positional columns must have the same length"
            )
        return a, b
    if a._is_scalar():
        return _broadcast(a, b), b
    if b._is_scalar():
        return a, _broadcast(b, a)
    for x, y in ((a, b), (b, a)):
        if y.groups is not None and same_dims(x.dims, (y.groups.G,)):
            gid = y.groups.ids()  # a row in no group (gid == size) takes a null
            expanded = x.take(torch.where(gid < y.groups.size, gid, -1), y.dims, y.groups)
            return (expanded, y) if x is a else (y, expanded)
    raise ValueError(
        f"cannot combine {a.describe()} with {b.describe()} in '{symbol}': bind both to the "
        "same dims (a positional column must first be bound: table[D])"
    )


def _broadcast(scalar: Column, like: Column) -> Column:
    valid = None if scalar.valid is None else scalar.valid.expand_as(like.values)
    return Column(scalar.values.expand_as(like.values), scalar.kind, dims=like.dims,
                  valid=valid, dictionary=scalar.dictionary, groups=like.groups,
                  name=scalar.name)


def _broadcast_const(like: Column, value, column_kind: str | None = None) -> Column:
    """``value`` as a column over ``like``'s rows, of the kind it takes next to a column of
    ``column_kind`` (``like``'s kind unless given: see :func:`_const_kind`)."""
    value = _python(value)
    kind = _const_kind(value, column_kind or like.kind)
    if kind == "str":
        dictionary = pa.array([value], pa.string())
        return Column(torch.zeros_like(like.values, dtype=torch.int64), "str", dims=like.dims,
                      dictionary=dictionary, groups=like.groups, name=repr(value))
    if kind == "int":
        check_constant(value, f"a constant with {like.describe()}")
    v = _time_value(value, kind) if kind in ("date", "timestamp", "timestamptz") else value
    return Column(torch.full_like(like.values, v, dtype=_DTYPES[kind]), kind, dims=like.dims,
                  groups=like.groups, name=repr(value))


_DTYPES = {"int": torch.int64, "float": torch.float64, "bool": torch.bool,
           "date": torch.int32, "timestamp": torch.int64, "timestamptz": torch.int64,
           "str": torch.int64}


def _and_valid(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a & b


def _combine(a: Column, b: Column, values: torch.Tensor, kind: str, name: str) -> Column:
    return Column(values, kind, dims=a.dims, valid=_and_valid(a.valid, b.valid),
                  groups=a.groups, name=name)


def _comparable(a: Column, b: Column, symbol: str) -> tuple[Column, Column]:
    """``a`` and ``b`` with values that compare as their kinds do (strings re-coded into
    one shared dictionary)."""
    ok = (a.kind in _NUMERIC and b.kind in _NUMERIC) or a.kind == b.kind
    if not ok:
        raise TypeError(f"cannot compare {a.describe()} with {b.describe()} ('{symbol}')")
    if a.kind != "str" or a.dictionary is b.dictionary or a.dictionary.equals(b.dictionary):
        return a, b
    merged, (ra, rb) = unify_dictionaries([a.dictionary, b.dictionary])
    return (a._like(ra.to(a.values.device)[a.values], dictionary=merged),
            b._like(rb.to(b.values.device)[b.values], dictionary=merged))


def unify_dictionaries(dicts: list[pa.Array]) -> tuple[pa.Array, list[torch.Tensor]]:
    """One sorted dictionary holding every string of ``dicts`` and, per input, the
    tensor mapping its codes to codes of the merged one."""
    merged = pc.unique(pa.concat_arrays([d.cast(pa.string()) for d in dicts]))
    merged = merged.take(pc.array_sort_indices(merged))
    remaps = [torch.from_numpy(pc.index_in(d.cast(pa.string()), merged).to_numpy().astype("int64"))
              if len(d) else torch.zeros(1, dtype=torch.int64)  # all null, with codes 0
              for d in dicts]
    return merged, remaps


def _compare_const(col: Column, value, op, symbol, flip, name) -> Column:
    kind = _const_kind(value, col.kind)
    if not ((col.kind in _NUMERIC and kind in _NUMERIC) or col.kind == kind):
        raise TypeError(f"cannot compare {col.describe()} with {_describe(value)} ('{symbol}')")
    if col.kind == "str":
        arrow_op = {"lt": pc.less, "le": pc.less_equal, "gt": pc.greater,
                    "ge": pc.greater_equal, "eq": pc.equal, "ne": pc.not_equal}[op]
        scalar = pa.scalar(value, pa.string())
        args = (scalar, col.dictionary) if flip else (col.dictionary, scalar)
        return col._on_dictionary(arrow_op(*args), name)
    c = _constant(value, col)
    if col.valid is None and not col._is_scalar():
        args = (c, col.data) if flip else (col.data, c)
        return col._lazy(Expr(comparison(op, *args), args), "bool", name)
    fn = OPS[f"{op}_nan"]
    if flip:
        values = fn(torch.as_tensor(c, device=col.values.device), col.values)
    else:
        values = fn(col.values, c)
    return col._like(values, "bool", col.valid, name)


def _logical(a, b, op: str):
    b = _python(b)
    if isinstance(b, Cross) or (isinstance(b, Column) and _crosses(a, b)):
        return Cross(op, (a, b), "&" if op == "and" else "|")
    if isinstance(b, bool):
        b = _broadcast_const(a, b)
    if not isinstance(b, Column):
        raise TypeError(f"cannot combine {a.describe()} with {_describe(b)} using {op}")
    a._expect("bool", op)
    b._expect("bool", op)
    name = f"({a.name} {'&' if op == 'and' else '|'} {b.name})"
    rows = _fusable(a, b)
    if rows is not None:
        return rows._lazy(Expr(op, (a.data, b.data)), "bool", name)
    a, b = _aligned(a, b, op)
    values = a.values & b.values if op == "and" else a.values | b.values
    if a.valid is None and b.valid is None:
        return Column(values, "bool", dims=a.dims, groups=a.groups, name=name)
    # SQL's three-valued logic: false AND null is false, true OR null is true.
    va = torch.ones_like(values) if a.valid is None else a.valid
    vb = torch.ones_like(values) if b.valid is None else b.valid
    decided = (a.values if op == "or" else ~a.values), (b.values if op == "or" else ~b.values)
    valid = (va & vb) | (va & decided[0]) | (vb & decided[1])
    return Column(values, "bool", dims=a.dims, valid=valid, groups=a.groups, name=name)


class Cross:
    """A lazy expression over columns bound to different dims: the outer product it
    stands for is never made. ``where`` turns it into a join; ``at(index)`` evaluates it
    on chosen row pairs.

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table, where, cat
        >>> a, b = Table({"k": [1, 2]}), Table({"k2": [2, 2, 3]})
        >>> A, B = dims(2)
        >>> AB, ab = where(a[A]["k"] == b[B]["k2"], cat(a[A], b[B]))
        >>> AB.size
        2
    """

    def __init__(self, op: str, args: tuple, symbol: str) -> None:
        self.op, self.args, self.symbol = op, args, symbol
        dims: list[Dim] = []
        for a in args:
            for d in getattr(a, "dims", ()):
                if not any(d is e for e in dims):
                    dims.append(d)
        self.dims = tuple(dims)
        self._where_cache = None

    @property
    def name(self) -> str:
        if len(self.args) == 1:
            return f"({self.symbol}{_name(self.args[0])})"
        return f"({_name(self.args[0])} {self.symbol} {_name(self.args[1])})"

    def describe(self) -> str:
        return f"the predicate {self.name} over {', '.join(map(repr, self.dims))}"

    @property
    def device(self) -> torch.device:
        """Where the columns it reads live."""
        for a in self.args:
            if isinstance(a, Column | Cross):
                return a.data.device if isinstance(a, Column) else a.device
        return torch.get_default_device()

    def __repr__(self) -> str:
        return f"Cross({self.describe()})"

    def __bool__(self) -> bool:
        raise TypeError(f"the truth value of {self.describe()} is ambiguous: filter with where")

    def __getattr__(self, name: str):
        if name.startswith("_") or not hasattr(Column, name):
            raise AttributeError(name)
        raise ValueError(
            f"{self.describe()} is an outer product of rows of different dims, which is never "
            f"made: filter it with where(condition, cat(...)) (a join) before .{name}()"
        )

    # the operators of columns, recorded ((a.x + b.y) > 3, ~(a.x < b.y)) for ``at`` to run
    def _with(self, o, op: str, symbol: str, flip: bool = False) -> Cross:
        return Cross(op, (o, self) if flip else (self, o), symbol)

    def __and__(self, o):
        return self._with(o, "and", "&")

    def __rand__(self, o):
        return self._with(o, "and", "&", flip=True)

    def __or__(self, o):
        return self._with(o, "or", "|")

    def __ror__(self, o):
        return self._with(o, "or", "|", flip=True)

    def __add__(self, o):
        return self._with(o, "add", "+")

    def __radd__(self, o):
        return self._with(o, "add", "+", flip=True)

    def __sub__(self, o):
        return self._with(o, "sub", "-")

    def __rsub__(self, o):
        return self._with(o, "sub", "-", flip=True)

    def __mul__(self, o):
        return self._with(o, "mul", "*")

    def __rmul__(self, o):
        return self._with(o, "mul", "*", flip=True)

    def __truediv__(self, o):
        return self._with(o, "truediv", "/")

    def __rtruediv__(self, o):
        return self._with(o, "truediv", "/", flip=True)

    def __pow__(self, o):
        return self._with(o, "pow", "**")

    def __rpow__(self, o):
        return self._with(o, "pow", "**", flip=True)

    def __lt__(self, o):
        return self._with(o, "lt", "<")

    def __le__(self, o):
        return self._with(o, "le", "<=")

    def __gt__(self, o):
        return self._with(o, "gt", ">")

    def __ge__(self, o):
        return self._with(o, "ge", ">=")

    def __eq__(self, o):  # type: ignore[override]
        return self._with(o, "eq", "==")

    def __ne__(self, o):  # type: ignore[override]
        return self._with(o, "ne", "!=")

    __hash__ = object.__hash__  # (== builds a predicate, as for columns)

    def __invert__(self) -> Cross:
        return Cross("invert", (self,), "~")

    def __neg__(self) -> Cross:
        return Cross("neg", (self,), "-")

    def __abs__(self) -> Cross:
        return Cross("abs", (self,), "abs")

    def conjuncts(self) -> list:
        """The parts of an AND chain (one part for anything else)."""
        if self.op != "and":
            return [self]
        return [p for a in self.args
                for p in (a.conjuncts() if isinstance(a, Cross) else [a])]

    def at(self, index: dict[Dim, torch.Tensor], dim: Dim) -> Column:
        """The expression on the rows ``index[d]`` of each of its dims, over ``dim``."""
        args = [at(a, index, dim) for a in self.args]
        return getattr(operator, {"and": "and_", "or": "or_"}.get(self.op, self.op))(*args)


def at(x, index: dict[Dim, torch.Tensor], dim: Dim):
    """``x`` (a column, cross expression or constant) on chosen rows of its dims."""
    if isinstance(x, Cross):
        return x.at(index, dim)
    if isinstance(x, Column) and x.dims:
        (d,) = x.dims
        return x.take(index[d], (dim,))
    return x


# the aggregates build columns: imported once Column exists
from torchlevels.relational._aggregate import aggregate  # noqa: E402
