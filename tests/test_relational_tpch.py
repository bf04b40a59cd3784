"""TPC-H Q1, Q3, Q5, Q6, Q10 (examples/tpch.py) against DuckDB on the same SF0.01 files."""

import os
import sys

import duckdb
import pytest

from tests.relational_reference import assert_same_rows, duck_rows, our_rows

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import tpch  # noqa: E402

pytestmark = pytest.mark.xdist_group("tpch")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tpch.generate(0.01, str(tmp_path_factory.mktemp("tpch")))
    con = duckdb.connect()
    for t in tpch.COLUMNS:
        con.execute(f"create view {t} as select * from read_parquet("
                    f"'{os.path.join(folder, t + '.parquet')}')")
    return tpch.load(folder), con


@pytest.mark.parametrize("name", ["q1", "q3", "q5", "q10"])
def test_query_matches_duckdb(data, name):
    tables, con = data
    result = tpch.run(name, tables)
    expected = duck_rows(con, tpch.SQL[name])
    assert len(expected) > 0
    assert_same_rows(our_rows(result), expected)


def test_q6_matches_duckdb(data):
    tables, con = data
    (expected,), = duck_rows(con, tpch.SQL["q6"])
    assert tpch.run("q6", tables) == pytest.approx(expected, rel=1e-12)


def test_q1_column_names_match_sql(data):
    tables, con = data
    names = [d[0] for d in con.execute(tpch.SQL["q1"]).description]
    assert tpch.run("q1", tables).column_names == names


@pytest.mark.parametrize("name", ["q1", "q6"])
def test_compiled_kernels_match_duckdb(data, name, monkeypatch):
    """The fused path (torch.compile'd reductions) that large tables take, forced here."""
    from torchlevels.relational import _fuse

    def kernel_lookups():  # compiled, or found compiled by an earlier test in this process
        info = _fuse._compiled.cache_info()
        return info.hits + info.misses

    monkeypatch.setattr(_fuse, "FUSE_MIN_ROWS", 0)
    lookups_before = kernel_lookups()
    tables, con = data
    if name == "q6":
        (expected,), = duck_rows(con, tpch.SQL["q6"])
        assert tpch.run("q6", tables) == pytest.approx(expected, rel=1e-12)
    else:
        assert_same_rows(our_rows(tpch.run(name, tables)), duck_rows(con, tpch.SQL[name]))
    assert kernel_lookups() > lookups_before and not _fuse._compile_failed


def test_the_issue_example_runs_as_written(data):
    """The API sketch of the issue, line for line, against DuckDB."""
    from datetime import date

    from torchlevels.dim import dims
    from torchlevels.relational import Table, cat, groupby, where

    tables, con = data
    lineitem, customers, orders = tables["lineitem"], tables["customer"], tables["orders"]
    L = dims(1)
    l = lineitem[L]
    m = (l["l_shipdate"] < date(1995, 1, 1)) & (l["l_quantity"] < 24)
    L2, f = where(m, l)
    assert where(m, l)[0] is L2  # the same mask gives the same dim
    revenue = (f["l_extendedprice"] * f["l_discount"]).sum(L2)
    (expected,), = duck_rows(con, "select sum(l_extendedprice * l_discount) from lineitem "
                             "where l_shipdate < date '1995-01-01' and l_quantity < 24")
    assert revenue.item() == pytest.approx(expected, rel=1e-12)

    C, O = dims(2)
    c, o = customers[C], orders[O]
    CO, co = where(o["o_custkey"] == c["c_custkey"], cat(o[["o_orderkey"]], c[["c_name"]]))
    joined = co.order(CO)
    assert_same_rows(our_rows(joined), duck_rows(
        con, "select o_orderkey, c_name from orders join customer on o_custkey = c_custkey"),
        ordered=False)

    g = groupby(lineitem, ["l_returnflag", "l_linestatus"])
    G, J = dims(2)
    r = g[G, J]
    out = Table({**g.keys.columns, "sum_qty": r["l_quantity"].sum(J).order(G),
                 "avg_price": r["l_extendedprice"].mean(J).order(G), "n": r.count(J).order(G)})
    top = out.sort(["sum_qty"], descending=[True]).head(10).to_pandas()
    theirs = duck_rows(con, "select l_returnflag, l_linestatus, sum(l_quantity) as s, "
                       "avg(l_extendedprice), count(*) from lineitem group by 1, 2 "
                       "order by s desc limit 10")
    assert_same_rows([tuple(row) for row in top.itertuples(index=False)], theirs)
