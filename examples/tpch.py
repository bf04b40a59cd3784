"""TPC-H Q1, Q3, Q5, Q6 and Q10 written with ``torchlevels.relational``.

Each query is a function of the tables it reads; ``SQL`` holds the same queries for
DuckDB, the reference the tests compare every row with. Data comes from ``tpchgen-cli``
(``generate(scale)``). Run ``python examples/tpch.py [scale]`` to print every query.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import date

from torchlevels.dim import dims
from torchlevels.relational import Table, cat, groupby, where

COLUMNS = {
    "lineitem": ["l_orderkey", "l_suppkey", "l_quantity", "l_extendedprice", "l_discount",
                 "l_tax", "l_returnflag", "l_linestatus", "l_shipdate"],
    "orders": ["o_orderkey", "o_custkey", "o_orderdate", "o_shippriority"],
    "customer": ["c_custkey", "c_name", "c_address", "c_nationkey", "c_phone", "c_acctbal",
                 "c_mktsegment", "c_comment"],
    "supplier": ["s_suppkey", "s_nationkey"],
    "nation": ["n_nationkey", "n_name", "n_regionkey"],
    "region": ["r_regionkey", "r_name"],
}


def q1(lineitem: Table) -> Table:
    """Pricing summary: aggregates of shipped line items per return flag and status."""
    L = dims(1)
    l = lineitem[L]
    L2, f = where(l["l_shipdate"] <= date(1998, 9, 2), l)
    g = groupby(f, ["l_returnflag", "l_linestatus"])
    G, J = dims(2)
    r = g[G, J]
    disc_price = r["l_extendedprice"] * (1 - r["l_discount"])
    return Table({
        **g.keys.columns,
        "sum_qty": r["l_quantity"].sum(J).order(G),
        "sum_base_price": r["l_extendedprice"].sum(J).order(G),
        "sum_disc_price": disc_price.sum(J).order(G),
        "sum_charge": (disc_price * (1 + r["l_tax"])).sum(J).order(G),
        "avg_qty": r["l_quantity"].mean(J).order(G),
        "avg_price": r["l_extendedprice"].mean(J).order(G),
        "avg_disc": r["l_discount"].mean(J).order(G),
        "count_order": r.count(J).order(G),
    })


def q3(customer: Table, orders: Table, lineitem: Table) -> Table:
    """Shipping priority: the 10 unshipped orders of a segment with the most revenue."""
    C, O, L = dims(3)
    c, o, l = customer[C], orders[O], lineitem[L]
    day = date(1995, 3, 15)
    CO, co = where((c["c_custkey"] == o["o_custkey"]) & (c["c_mktsegment"] == "BUILDING")
                   & (o["o_orderdate"] < day),
                   o[["o_orderkey", "o_orderdate", "o_shippriority"]])
    LO, lo = where((l["l_orderkey"] == co["o_orderkey"]) & (l["l_shipdate"] > day),
                   cat(l[["l_orderkey", "l_extendedprice", "l_discount"]],
                       co[["o_orderdate", "o_shippriority"]]))
    g = groupby(lo, ["l_orderkey", "o_orderdate", "o_shippriority"])
    G, J = dims(2)
    r = g[G, J]
    revenue = (r["l_extendedprice"] * (1 - r["l_discount"])).sum(J).order(G)
    keys = g.keys
    out = Table({"l_orderkey": keys["l_orderkey"], "revenue": revenue,
                 "o_orderdate": keys["o_orderdate"], "o_shippriority": keys["o_shippriority"]})
    return out.sort(["revenue", "o_orderdate"], descending=[True, False]).head(10)


def q5(customer: Table, orders: Table, lineitem: Table, supplier: Table, nation: Table,
       region: Table) -> Table:
    """Local supplier volume: revenue of one region's nations from local suppliers."""
    C, O, L, S, N, R = dims(6)
    c, o, l, s, n, r = (customer[C], orders[O], lineitem[L], supplier[S], nation[N],
                        region[R])
    NR, nr = where((n["n_regionkey"] == r["r_regionkey"]) & (r["r_name"] == "ASIA"),
                   n[["n_nationkey", "n_name"]])
    SN, sn = where(s["s_nationkey"] == nr["n_nationkey"],
                   cat(s[["s_suppkey", "s_nationkey"]], nr[["n_name"]]))
    CO, co = where((c["c_custkey"] == o["o_custkey"])
                   & (o["o_orderdate"] >= date(1994, 1, 1)) & (o["o_orderdate"] < date(1995, 1, 1)),
                   cat(o[["o_orderkey"]], c[["c_nationkey"]]))
    LC, lc = where(l["l_orderkey"] == co["o_orderkey"],
                   cat(l[["l_suppkey", "l_extendedprice", "l_discount"]], co[["c_nationkey"]]))
    X, x = where((lc["l_suppkey"] == sn["s_suppkey"]) & (lc["c_nationkey"] == sn["s_nationkey"]),
                 cat(lc[["l_extendedprice", "l_discount"]], sn[["n_name"]]))
    g = groupby(x, "n_name")
    G, J = dims(2)
    rows = g[G, J]
    revenue = (rows["l_extendedprice"] * (1 - rows["l_discount"])).sum(J).order(G)
    return Table({**g.keys.columns, "revenue": revenue}).sort("revenue", descending=True)


def q6(lineitem: Table) -> float | None:
    """Forecasting revenue change: revenue from small discounts on small orders."""
    L = dims(1)
    l = lineitem[L]
    m = ((l["l_shipdate"] >= date(1994, 1, 1)) & (l["l_shipdate"] < date(1995, 1, 1))
         & l["l_discount"].between(0.05, 0.07) & (l["l_quantity"] < 24))
    L2, f = where(m, l)
    return (f["l_extendedprice"] * f["l_discount"]).sum(L2).item()


def q10(customer: Table, orders: Table, lineitem: Table, nation: Table) -> Table:
    """Returned item reporting: the 20 customers who returned the most revenue."""
    C, O, L, N = dims(4)
    c, o, l, n = customer[C], orders[O], lineitem[L], nation[N]
    OL, ol = where((l["l_orderkey"] == o["o_orderkey"]) & (l["l_returnflag"] == "R")
                   & (o["o_orderdate"] >= date(1993, 10, 1))
                   & (o["o_orderdate"] < date(1994, 1, 1)),
                   cat(o[["o_custkey"]], l[["l_extendedprice", "l_discount"]]))
    CN, cn = where(c["c_nationkey"] == n["n_nationkey"], cat(c, n[["n_name"]]))
    X, x = where(ol["o_custkey"] == cn["c_custkey"], cat(ol, cn))
    keys = ["c_custkey", "c_name", "c_acctbal", "c_phone", "n_name", "c_address", "c_comment"]
    g = groupby(x, keys)
    G, J = dims(2)
    r = g[G, J]
    revenue = (r["l_extendedprice"] * (1 - r["l_discount"])).sum(J).order(G)
    k = g.keys
    out = Table({"c_custkey": k["c_custkey"], "c_name": k["c_name"], "revenue": revenue,
                 **{name: k[name] for name in keys[2:]}})
    return out.sort("revenue", descending=True).head(20)


QUERIES = {
    "q1": (q1, ["lineitem"]),
    "q3": (q3, ["customer", "orders", "lineitem"]),
    "q5": (q5, ["customer", "orders", "lineitem", "supplier", "nation", "region"]),
    "q6": (q6, ["lineitem"]),
    "q10": (q10, ["customer", "orders", "lineitem", "nation"]),
}

SQL = {
    "q1": """
        select l_returnflag, l_linestatus, sum(l_quantity) as sum_qty,
               sum(l_extendedprice) as sum_base_price,
               sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
               sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
               avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price,
               avg(l_discount) as avg_disc, count(*) as count_order
        from lineitem where l_shipdate <= date '1998-12-01' - interval '90' day
        group by l_returnflag, l_linestatus order by l_returnflag, l_linestatus""",
    "q3": """
        select l_orderkey, sum(l_extendedprice * (1 - l_discount)) as revenue, o_orderdate,
               o_shippriority
        from customer, orders, lineitem
        where c_mktsegment = 'BUILDING' and c_custkey = o_custkey and l_orderkey = o_orderkey
          and o_orderdate < date '1995-03-15' and l_shipdate > date '1995-03-15'
        group by l_orderkey, o_orderdate, o_shippriority
        order by revenue desc, o_orderdate limit 10""",
    "q5": """
        select n_name, sum(l_extendedprice * (1 - l_discount)) as revenue
        from customer, orders, lineitem, supplier, nation, region
        where c_custkey = o_custkey and l_orderkey = o_orderkey and l_suppkey = s_suppkey
          and c_nationkey = s_nationkey and s_nationkey = n_nationkey
          and n_regionkey = r_regionkey and r_name = 'ASIA'
          and o_orderdate >= date '1994-01-01' and o_orderdate < date '1995-01-01'
        group by n_name order by revenue desc""",
    "q6": """
        select sum(l_extendedprice * l_discount) as revenue from lineitem
        where l_shipdate >= date '1994-01-01' and l_shipdate < date '1995-01-01'
          and l_discount between 0.05 and 0.07 and l_quantity < 24""",
    "q10": """
        select c_custkey, c_name, sum(l_extendedprice * (1 - l_discount)) as revenue,
               c_acctbal, c_phone, n_name, c_address, c_comment
        from customer, orders, lineitem, nation
        where c_custkey = o_custkey and l_orderkey = o_orderkey
          and o_orderdate >= date '1993-10-01' and o_orderdate < date '1994-01-01'
          and l_returnflag = 'R' and c_nationkey = n_nationkey
        group by c_custkey, c_name, c_acctbal, c_phone, n_name, c_address, c_comment
        order by revenue desc limit 20""",
}


def generate(scale: float, root: str | None = None) -> str:
    """The folder of TPC-H Parquet files at ``scale``, made with ``tpchgen-cli`` if new."""
    root = root or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    folder = os.path.abspath(os.path.join(root, f"tpch-sf{scale:g}"))
    if all(os.path.exists(os.path.join(folder, f"{t}.parquet")) for t in COLUMNS):
        return folder
    exe = shutil.which("tpchgen-cli") or os.path.join(os.path.dirname(sys.executable),
                                                      "tpchgen-cli")
    print(f"generating TPC-H scale {scale:g} into {folder} with tpchgen-cli ...",
          file=sys.stderr, flush=True)
    subprocess.run([exe, "parquet", "-s", f"{scale:g}", "-o", folder,
                    "--tables", ",".join(COLUMNS)], check=True)
    return folder


def load(folder: str) -> dict[str, Table]:
    """The tables the queries read (only their columns), from ``folder``."""
    return {t: Table.read_parquet(os.path.join(folder, f"{t}.parquet"), columns=cols)
            for t, cols in COLUMNS.items()}


def run(name: str, tables: dict[str, Table]):
    """Run query ``name`` on ``tables``."""
    fn, reads = QUERIES[name]
    return fn(*(tables[t] for t in reads))


if __name__ == "__main__":
    scale = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
    tables = load(generate(scale))
    for name in QUERIES:
        print(f"--- {name} ---")
        print(run(name, tables))
