"""Relational queries on first-class dims: tables are columns of 1-D tensors, a table
indexed by a dim is a row view, ``where`` filters (a new data-dependent dim) and joins
(an equality across two dims, never the outer product), ``groupby`` makes a jagged dim.

Example::

    >>> from torchlevels.dim import dims
    >>> from torchlevels.relational import Table, where, groupby
    >>> sales = Table({"shop": ["a", "b", "a"], "amount": [5.0, 7.0, 1.0]})
    >>> S = dims(1)
    >>> s = sales[S]
    >>> S2, big = where(s["amount"] > 2, s)
    >>> g = groupby(big, "shop")
    >>> G, J = dims(2)
    >>> r = g[G, J]
    >>> out = Table({**g.keys.columns, "total": r["amount"].sum(J).order(G)})
    >>> out.to_pandas().values.tolist()
    [['a', 5.0], ['b', 7.0]]
"""

from torchlevels.relational._column import Column, Cross
from torchlevels.relational._groupby import Grouped, groupby
from torchlevels.relational._table import Rows, Table, cat
from torchlevels.relational._where import where

__all__ = ["Column", "Cross", "Grouped", "Rows", "Table", "cat", "groupby", "where"]
