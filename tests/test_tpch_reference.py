"""benchmarks/tpch_reference.py: the Polars and pandas TPC-H Q1, Q3, Q6 against DuckDB (SF0.01)."""

import datetime
import decimal
import os
import sys

import duckdb
import pandas as pd
import pytest

from benchmarks import tpch_reference as ref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import tpch  # noqa: E402  (examples/tpch.py: the queries' SQL and the data)

pytestmark = pytest.mark.xdist_group("tpch")

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tpch.generate(0.01, str(tmp_path_factory.mktemp("tpch")))
    con = duckdb.connect()
    for table in ref.COLUMNS:
        con.execute(f"create view {table} as select * from read_parquet("
                    f"'{os.path.join(folder, table + '.parquet')}')")
    return {"polars": ref.load_polars(folder, ref.COLUMNS),
            "pandas": ref.load_pandas(folder, ref.COLUMNS)}, con


def _plain(value):
    """A cell as a comparable Python value: Decimal -> float, Timestamp -> date."""
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, pd.Timestamp):
        return value.date()
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return value


def _rows(frame):
    if isinstance(frame, pd.DataFrame):
        return list(frame.itertuples(index=False, name=None))
    return frame.rows()


def _assert_same(got, expected):
    got = _plain(got)
    if isinstance(expected, float):
        assert isinstance(got, float) and got == pytest.approx(expected, rel=1e-9)
    else:
        assert type(got) is type(expected) and got == expected


@pytest.mark.parametrize("engine", ["polars", "pandas"])
@pytest.mark.parametrize("name", ["q1", "q3"])
def test_query_matches_duckdb(data, engine, name):
    tables, con = data
    result = getattr(ref, f"{engine}_{name}")(tables[engine])
    cursor = con.execute(tpch.SQL[name])
    expected = [tuple(_plain(v) for v in row) for row in cursor.fetchall()]
    assert list(result.columns) == [d[0] for d in cursor.description]
    got = _rows(result)
    assert len(expected) > 0 and len(got) == len(expected)
    for got_row, expected_row in zip(got, expected):
        assert len(got_row) == len(expected_row)
        for g, e in zip(got_row, expected_row):
            _assert_same(g, e)
    if name == "q3":
        assert all(isinstance(row[2], datetime.date) for row in expected)


@pytest.mark.parametrize("engine", ["polars", "pandas"])
def test_q6_matches_duckdb(data, engine):
    tables, con = data
    (expected,), = con.execute(tpch.SQL["q6"]).fetchall()
    result = getattr(ref, f"{engine}_q6")(tables[engine])
    assert isinstance(result, float)
    assert result == pytest.approx(float(expected), rel=1e-9)
