"""Compare tables made by torchlevels.relational with DuckDB's results, row by row."""

from __future__ import annotations

import datetime
import decimal
import math

import duckdb


def duck_rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[tuple]:
    """DuckDB's result rows with decimals as floats."""
    return [tuple(float(v) if isinstance(v, decimal.Decimal) else v for v in row)
            for row in con.execute(sql).fetchall()]


def our_rows(table) -> list[tuple]:
    """A Table's rows as tuples of Python values (dates as datetime.date)."""
    data = table.to_arrow().to_pylist()
    return [tuple(row.values()) for row in data]


def same_value(a, b, rel: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True  # SQL's NaN equals NaN
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-9)
    if isinstance(a, datetime.datetime) != isinstance(b, datetime.datetime):
        a, b = _as_datetime(a), _as_datetime(b)  # DuckDB's date arithmetic gives midnights
    return a == b


def _as_datetime(v):
    if isinstance(v, datetime.date) and not isinstance(v, datetime.datetime):
        return datetime.datetime.combine(v, datetime.time())
    return v


def assert_same_rows(ours: list[tuple], theirs: list[tuple], ordered: bool = True) -> None:
    """Every row equal (floats to 1e-9 relative); unordered compares sorted rows."""
    assert len(ours) == len(theirs), f"{len(ours)} rows, DuckDB has {len(theirs)}"
    if not ordered:
        key = lambda row: tuple((v is None, str(v) if not isinstance(v, float) or math.isnan(v)
                                 else round(v, 6)) for v in row)
        ours, theirs = sorted(ours, key=key), sorted(theirs, key=key)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b), f"row {k}: {len(a)} columns, DuckDB has {len(b)}"
        assert all(same_value(x, y) for x, y in zip(a, b)), f"row {k}: {a} != DuckDB {b}"
