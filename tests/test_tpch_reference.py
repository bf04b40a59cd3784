"""benchmarks/tpch_reference.py: the Polars and pandas TPC-H Q1, Q3, Q6 against DuckDB (SF0.01)."""

import datetime
import decimal
import os
import subprocess
import sys

import duckdb
import pandas as pd
import pytest

from benchmarks import tpch_reference as ref

pytestmark = pytest.mark.xdist_group("tpch")

SQL = {
    "q1": """
        select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty,
               sum(l_extendedprice) as sum_base_price,
               sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
               sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
               avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price,
               avg(l_discount) as avg_disc, count(*) as count_order
        from lineitem where l_shipdate <= date '1998-09-02'
        group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus""",
    "q3": """
        select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue,
               o_orderdate, o_shippriority
        from customer, orders, lineitem
        where c_mktsegment = 'BUILDING' and c_custkey = o_custkey and l_orderkey = o_orderkey
          and o_orderdate < date '1995-03-15' and l_shipdate > date '1995-03-15'
        group by l_orderkey, o_orderdate, o_shippriority
        order by revenue desc, o_orderdate limit 10""",
    "q6": """
        select sum(l_extendedprice * l_discount) as revenue from lineitem
        where l_shipdate >= date '1994-01-01' and l_shipdate < date '1995-01-01'
          and l_discount between 0.05 and 0.07 and l_quantity < 24""",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tpch"))
    exe = os.path.join(os.path.dirname(sys.executable), "tpchgen-cli")
    subprocess.run([exe, "parquet", "-s", "0.01", "-o", folder,
                    "--tables", "lineitem,orders,customer"], check=True)
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
    cursor = con.execute(SQL[name])
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
    (expected,), = con.execute(SQL["q6"]).fetchall()
    result = getattr(ref, f"{engine}_q6")(tables[engine])
    assert isinstance(result, float)
    assert result == pytest.approx(float(expected), rel=1e-9)
