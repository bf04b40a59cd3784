"""torchlevels.relational: misuse found by an audit, against DuckDB and pandas.

Each test checks the exception type the reference raises (where it raises) and the key
words of the message, or the values the reference gives for the same input.
"""

import operator

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from tests.relational_reference import assert_same_rows, duck_rows, our_rows
from torchlevels.dim import dims
from torchlevels.relational import Table, cat, groupby, where

DATA = pa.table({
    "id": pa.array([1, 2, 3, 4, 5], pa.int64()),
    "x": pa.array([1.5, None, -2.0, 4.0, 0.5]),
    "s": pa.array(["a", "b", None, "d", "b"]),
    "ok": pa.array([True, False, None, True, False]),
})


@pytest.fixture(scope="module")
def con():
    c = duckdb.connect()
    c.register("t", DATA)
    return c


@pytest.fixture
def table():
    return Table.from_arrow(DATA)


def _column(x) -> list:
    return x.to_arrow().to_pylist()


def _duck_column(con, sql: str) -> list:
    return [row[0] for row in con.execute(sql).fetchall()]


# -- head and take ---------------------------------------------------------------------
def test_head_of_a_negative_count_is_refused_as_by_limit(con, table):
    for n in (0, 2, 99):
        assert_same_rows(our_rows(table.head(n)), duck_rows(con, f"select * from t limit {n}"))
    with pytest.raises(duckdb.BinderException, match="cannot be negative"):
        con.execute("select * from t limit -1")
    with pytest.raises(ValueError, match=r"head\(n=-1\): n must be >= 0"):
        table.head(-1)
    with pytest.raises(Exception) as pandas_error:
        table.to_pandas().head(2.5)
    with pytest.raises(pandas_error.type, match=r"head\(n=2.5\): n must be an int"):
        table.head(2.5)


def test_take_counts_negative_indices_from_the_end_as_pandas(table):
    df = table.to_pandas()
    for index in ([4, 0, -1], [-5, -2], []):
        ours = table.take(torch.tensor(index, dtype=torch.long)).to_pandas()
        pd.testing.assert_frame_equal(ours, df.take(index).reset_index(drop=True))
        pd.testing.assert_frame_equal(table.take(index).to_pandas(), ours)


@pytest.mark.parametrize("index", [[10], [0, -6]])
def test_take_out_of_range_names_the_index_and_the_row_count(table, index):
    with pytest.raises(Exception) as pandas_error:
        table.to_pandas().take(index)
    with pytest.raises(pandas_error.type,
                       match=rf"index {index[-1]} is out of range for a table of 5 rows"):
        table.take(torch.tensor(index))


def test_take_with_a_float_index_is_a_type_error(table):
    # pandas truncates 0.5 to row 0; a float is no row number
    with pytest.raises(TypeError, match="take: the index must hold ints.*float32"):
        table.take(torch.tensor([0.5]))


# -- isin ------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [3, "ab", None])
def test_isin_of_a_non_collection_is_a_type_error_as_in_pandas(table, values):
    with pytest.raises(Exception) as pandas_error:
        table.to_pandas()["s"].isin(values)
    R = dims(1)
    with pytest.raises(pandas_error.type, match="isin takes a collection of values"):
        table[R]["s"].isin(values)


# -- NumPy scalars are values, as in pandas and DuckDB (given as Python values) ---------
# (np.float64 and np.str_ subclass float and str, and np.int64(3) <= column is reflected to
# the column: those worked already)
_NUMPY_CASES = [
    (lambda r: r["x"] > np.float32(0.5), "x > 0.5"),
    (lambda r: r["id"] == np.int64(2), "id = 2"),
    (lambda r: r["id"] * np.int32(3) - np.int64(1), "id * 3 - 1"),
    (lambda r: r["x"] + np.int64(1), "x + 1"),
    (lambda r: r["ok"] & np.bool_(True), "ok and true"),
    (lambda r: r["id"].isin(np.array([1, 4, 9])), "id in (1, 4, 9)"),
    (lambda r: r["id"].isin(torch.tensor([2, 5])), "id in (2, 5)"),
    (lambda r: r["x"].fill_null(np.float32(0.25)), "coalesce(x, 0.25)"),
    (lambda r: r["x"].between(np.int64(0), np.float64(2.0)), "x between 0 and 2.0"),
    (lambda r: where(r["x"] > 0, np.int64(1), np.int64(0)),
     "case when x > 0 then 1 else 0 end"),
]


@pytest.mark.parametrize("ours, sql", _NUMPY_CASES, ids=[sql for _, sql in _NUMPY_CASES])
def test_numpy_scalars_are_taken_as_python_values(con, table, ours, sql):
    R = dims(1)
    assert _column(ours(table[R]).order(R)) == _duck_column(con, f"select {sql} from t")


# -- order -----------------------------------------------------------------------------
def test_order_of_an_aggregate_says_it_is_one_value(table):
    R = dims(1)
    total = table[R]["x"].sum(R)
    with pytest.raises(ValueError, match=r"order\(R,\): column 'sum\(x\)'.*single value.*"
                                         r"no rows to order.*\.item\(\)"):
        total.order(R)


def test_order_of_a_grouped_column_says_how_to_list_or_reduce_it(con, table):
    G, J = dims(2)
    r = groupby(table, "s")[G, J]
    with pytest.raises(ValueError, match=r"order\(G, J\):.*grouped.*jagged dim J.*"
                                         r"x\.sum\(J\)\.order\(G\).*rows\.order\(G, J\)"):
        r["x"].order(G, J)
    # the reduction the message suggests, as DuckDB computes it (groups sorted by key)
    assert _column(r["x"].sum(J).order(G)) == _duck_column(
        con, "select sum(x) from t group by s order by s nulls last")


# -- a table where its rows bound to a dim belong ---------------------------------------
def test_a_table_or_its_columns_where_rows_belong_say_to_bind_them(con, table):
    R, O = dims(2)
    r = table[R]
    mask = r["x"] > 0
    for ours in (lambda: where(mask, table), lambda: cat(table, r),
                 lambda: where(r["id"] == table[O]["id"], table)):
        with pytest.raises(TypeError, match=r"takes rows bound to dims, got a Table: bind its "
                                            r"rows to a dim first \(table\[D\]\)"):
            ours()
    with pytest.raises(TypeError, match=r"got column 'x' \(float\), not bound to a dim.*"
                                        r"table\[D\]\[name\]"):
        where(mask, table["x"])
    with pytest.raises(ValueError, match=r"positional.*compute it from a row view, table\[D\]"):
        where(table["x"] > 0, r)
    with pytest.raises(ValueError, match=r"positional.*\.sum\(\) reduces all its rows; bind "
                                         r"the table to a dim, table\[D\]"):
        table["x"].sum(R)
    # what the messages say to write, as DuckDB computes it
    R2, kept = where(mask, table[R])
    assert_same_rows(our_rows(kept.order(R2)), duck_rows(con, "select * from t where x > 0"))
    assert table["x"].sum().item() == _duck_column(con, "select sum(x) from t")[0]


# -- None, //, % ----------------------------------------------------------------------
def test_none_in_a_column_expression_points_to_is_null(con, table):
    R = dims(1)
    r = table[R]
    # SQL's x = NULL is null on every row: never what was meant
    assert _duck_column(con, "select x = null from t") == [None] * 5
    for ours in (lambda: r["x"] == None, lambda: r["x"] != None,  # noqa: E711
                 lambda: where(r["ok"], r["x"], None)):
        with pytest.raises(TypeError, match=r"cannot use None.*test for nulls with "
                                            r"\.is_null\(\)"):
            ours()
    assert _column(r["x"].is_null().order(R)) == _duck_column(con, "select x is null from t")


@pytest.mark.parametrize("op, symbol", [(operator.floordiv, "//"), (operator.mod, "%")])
def test_floor_division_and_modulo_are_refused_naming_the_operator(con, table, op, symbol):
    # DuckDB's // and % round the quotient toward zero, Python's toward -inf
    negated = [-i for i in _column(table["id"])]
    assert _duck_column(con, f"select -id {symbol} 2 from t") != [op(i, 2) for i in negated]
    R = dims(1)
    r = table[R]
    for ours in (lambda: op(-r["id"], 2), lambda: op(7, r["id"]), lambda: op(r["x"], r["x"])):
        with pytest.raises(TypeError, match=rf"'{symbol}' is not supported on columns: SQL's "
                                            r"// and % round the quotient toward zero.*"
                                            r"divide with /"):
            ours()


def test_an_aggregate_of_an_aggregate_is_refused_as_by_sql(con, table):
    with pytest.raises(duckdb.BinderException, match="cannot be nested"):
        con.execute("select avg(sum(x)) from t").fetchall()
    R = dims(1)
    total = table[R]["x"].sum(R)
    for how in ("mean", "sum", "count", "max"):
        with pytest.raises(ValueError, match="an aggregate of an aggregate"):
            getattr(total, how)()
