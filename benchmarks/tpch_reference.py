"""TPC-H Q1, Q3 and Q6 written the way a data engineer would in Polars and in pandas.

The reference implementations that torchlevels' relational queries are timed against. Tables
are loaded once into memory (decimals as float64, dates as dates / datetime64) so that a
query's timing covers only the query itself. Polars runs lazily (``.lazy()...collect()``), which
at SF1 beat the eager API on the same in-memory frames.
"""

from __future__ import annotations

import datetime
import os

import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

# The columns the three queries read.
COLUMNS = {
    "lineitem": ["l_orderkey", "l_quantity", "l_extendedprice", "l_discount", "l_tax",
                 "l_returnflag", "l_linestatus", "l_shipdate"],
    "orders": ["o_orderkey", "o_custkey", "o_orderdate", "o_shippriority"],
    "customer": ["c_custkey", "c_mktsegment"],
}


def _path(folder: str, table: str) -> str:
    return os.path.join(folder, f"{table}.parquet")


def load_polars(folder: str, columns: dict[str, list[str]]) -> dict[str, pl.DataFrame]:
    """Read ``<folder>/<table>.parquet`` (only ``columns[table]``) into Polars DataFrames."""
    tables = {}
    for table, cols in columns.items():
        df = pl.read_parquet(_path(folder, table), columns=cols)
        tables[table] = df.with_columns(pl.col(pl.Decimal).cast(pl.Float64))
    return tables


def load_pandas(folder: str, columns: dict[str, list[str]]) -> dict[str, pd.DataFrame]:
    """Read ``<folder>/<table>.parquet`` (only ``columns[table]``) into pandas DataFrames."""
    # Strings become ``category``: at SF1, Q1's group-by ran faster on it than on pandas'
    # default (Arrow-backed) ``str`` dtype, and Q3's == filter was no slower.
    tables = {}
    for table, cols in columns.items():
        arrow = pq.read_table(_path(folder, table), columns=cols)
        schema = pa.schema([
            pa.field(f.name, pa.float64() if pa.types.is_decimal(f.type) else f.type)
            for f in arrow.schema
        ])
        df = arrow.cast(schema).to_pandas(date_as_object=False)
        # astype (unlike Arrow's dictionary) sorts the categories, so group-bys sort as in SQL
        tables[table] = df.astype({c: "category" for c in df.select_dtypes("str").columns})
    return tables


# ---------------------------------------------------------------------------- Polars


def polars_q1(t: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Q1: pricing summary report."""
    disc_price = pl.col("l_extendedprice") * (1 - pl.col("l_discount"))
    return (
        t["lineitem"].lazy()
        .filter(pl.col("l_shipdate") <= datetime.date(1998, 9, 2))
        .group_by("l_returnflag", "l_linestatus")
        .agg(
            sum_qty=pl.col("l_quantity").sum(),
            sum_base_price=pl.col("l_extendedprice").sum(),
            sum_disc_price=disc_price.sum(),
            sum_charge=(disc_price * (1 + pl.col("l_tax"))).sum(),
            avg_qty=pl.col("l_quantity").mean(),
            avg_price=pl.col("l_extendedprice").mean(),
            avg_disc=pl.col("l_discount").mean(),
            count_order=pl.len(),
        )
        .sort("l_returnflag", "l_linestatus")
        .collect()
    )


def polars_q3(t: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """Q3: shipping priority (top 10 unshipped orders by revenue)."""
    cutoff = datetime.date(1995, 3, 15)
    customer = t["customer"].lazy().filter(pl.col("c_mktsegment") == "BUILDING")
    orders = t["orders"].lazy().filter(pl.col("o_orderdate") < cutoff)
    lineitem = t["lineitem"].lazy().filter(pl.col("l_shipdate") > cutoff)
    return (
        customer.join(orders, left_on="c_custkey", right_on="o_custkey")
        .join(lineitem, left_on="o_orderkey", right_on="l_orderkey")
        .group_by(pl.col("o_orderkey").alias("l_orderkey"), "o_orderdate", "o_shippriority")
        .agg(revenue=(pl.col("l_extendedprice") * (1 - pl.col("l_discount"))).sum())
        .select("l_orderkey", "revenue", "o_orderdate", "o_shippriority")
        .sort(["revenue", "o_orderdate"], descending=[True, False])
        .head(10)
        .collect()
    )


def polars_q6(t: dict[str, pl.DataFrame]) -> float:
    """Q6: forecasting revenue change."""
    return (
        t["lineitem"].lazy()
        .filter(
            pl.col("l_shipdate").is_between(
                datetime.date(1994, 1, 1), datetime.date(1995, 1, 1), closed="left"),
            pl.col("l_discount").is_between(0.05, 0.07),
            pl.col("l_quantity") < 24,
        )
        .select((pl.col("l_extendedprice") * pl.col("l_discount")).sum())
        .collect()
        .item()
    )


# ---------------------------------------------------------------------------- pandas


def pandas_q1(t: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Q1: pricing summary report."""
    li = t["lineitem"]
    li = li.loc[li["l_shipdate"] <= pd.Timestamp("1998-09-02"),
                ["l_returnflag", "l_linestatus", "l_quantity", "l_extendedprice", "l_discount",
                 "l_tax"]]
    li["disc_price"] = li["l_extendedprice"] * (1 - li["l_discount"])
    li["charge"] = li["disc_price"] * (1 + li["l_tax"])
    # one sum() and one mean() over several columns beat a named agg() that runs per column
    groups = li.groupby(["l_returnflag", "l_linestatus"], sort=True, observed=True)
    sums = groups[["l_quantity", "l_extendedprice", "disc_price", "charge"]].sum()
    sums.columns = ["sum_qty", "sum_base_price", "sum_disc_price", "sum_charge"]
    means = groups[["l_quantity", "l_extendedprice", "l_discount"]].mean()
    means.columns = ["avg_qty", "avg_price", "avg_disc"]
    return pd.concat([sums, means, groups.size().rename("count_order")], axis=1).reset_index()


def pandas_q3(t: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Q3: shipping priority (top 10 unshipped orders by revenue)."""
    cutoff = pd.Timestamp("1995-03-15")
    cust, orders, li = t["customer"], t["orders"], t["lineitem"]
    cust = cust[cust["c_mktsegment"] == "BUILDING"]
    orders = orders[(orders["o_orderdate"] < cutoff) & orders["o_custkey"].isin(cust["c_custkey"])]
    li = li[(li["l_shipdate"] > cutoff) & li["l_orderkey"].isin(orders["o_orderkey"])]
    # o_orderkey is orders' key, so grouping by l_orderkey alone and then attaching
    # o_orderdate, o_shippriority is the SQL's group-by, without a lineitem-sized merge
    revenue = (li["l_extendedprice"] * (1 - li["l_discount"])).groupby(li["l_orderkey"]).sum()
    top = (
        orders.merge(revenue.rename("revenue"), left_on="o_orderkey", right_index=True)
        .sort_values(["revenue", "o_orderdate"], ascending=[False, True])
        .head(10)
    )
    return pd.DataFrame({
        "l_orderkey": top["o_orderkey"], "revenue": top["revenue"],
        "o_orderdate": top["o_orderdate"], "o_shippriority": top["o_shippriority"],
    }).reset_index(drop=True)


def pandas_q6(t: dict[str, pd.DataFrame]) -> float:
    """Q6: forecasting revenue change."""
    li = t["lineitem"]
    mask = (
        (li["l_shipdate"] >= pd.Timestamp("1994-01-01"))
        & (li["l_shipdate"] < pd.Timestamp("1995-01-01"))
        & li["l_discount"].between(0.05, 0.07)
        & (li["l_quantity"] < 24)
    )
    return float((li["l_extendedprice"][mask] * li["l_discount"][mask]).sum())
