"""docs/relational.md: its code runs, and each result equals DuckDB's on the same tables."""

from pathlib import Path

import duckdb
import pytest
from relational_reference import assert_same_rows, duck_rows, our_rows
from test_docs_batching_rules import run_python_blocks

DOC = Path(__file__).resolve().parents[1] / "docs" / "relational.md"


@pytest.fixture(scope="module")
def doc():
    ns = run_python_blocks(DOC)
    con = duckdb.connect()
    con.register("customers", ns["customers"].to_arrow())
    con.register("orders", ns["orders"].to_arrow())
    return ns, con


def test_where(doc):
    ns, con = doc
    assert_same_rows(our_rows(ns["selected"]), duck_rows(
        con, "select o_id, o_total from orders where o_date >= date '2024-02-01' "
        "and o_total > 10"))


def test_aggregates(doc):
    ns, con = doc
    assert_same_rows([ns["totals"]], duck_rows(
        con, "select sum(o_total), avg(o_total), count(*), count(distinct o_cust) from orders"))


def test_joins(doc):
    ns, con = doc
    assert_same_rows(our_rows(ns["joined"]), duck_rows(
        con, "select o_id, c_name from orders join customers on o_cust = c_id"), ordered=False)
    assert_same_rows(our_rows(ns["left_joined"]), duck_rows(
        con, "select o_id, c_name from orders left join customers on o_cust = c_id"),
        ordered=False)


def test_group_by_having_order_by(doc):
    ns, con = doc
    assert_same_rows(our_rows(ns["top"]), duck_rows(
        con, "select c_country, count(*) as n, sum(o_total) as spent from orders join "
        "customers on o_cust = c_id group by c_country having count(*) > 1 "
        "order by spent desc limit 10"))


def test_case_coalesce_is_null(doc):
    ns, con = doc
    theirs = duck_rows(con, "select case when o_total > 30 then 'big' else 'small' end, "
                       "coalesce(o_total, 0), o_total is null from orders")
    ours = list(zip(*(ns[k].to_arrow().to_pylist() for k in ("size", "filled", "missing"))))
    assert_same_rows(ours, theirs)
