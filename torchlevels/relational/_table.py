"""Tables (positional columns) and row views (a table's columns bound to dims)."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence

import pyarrow as pa
import torch

from torchlevels.dim import Dim
from torchlevels.relational._column import Column, Grouping
from torchlevels.relational._io import column_from_arrow, column_from_values


def _unknown(name: object, available: Sequence[str], where: str) -> KeyError:
    return KeyError(f"no column {name!r} in {where}; available columns: {list(available)}")


def unbound(x: object, what: str) -> TypeError:
    """The error for ``x`` given to ``what``, which takes rows bound to dims: a Table and
    its columns are positional, and are bound to a dim first (``table[D]``)."""
    if isinstance(x, Table):
        got = "a Table: bind its rows to a dim first (table[D])"
    elif isinstance(x, Column):
        got = f"{x.describe()}, not bound to a dim: take it from a row view (table[D][name])"
    else:
        got = f"a {type(x).__name__}: bind a table's rows to a dim (table[D])"
    return TypeError(f"{what} takes rows bound to dims, got {got}")


class Table:
    """A table of named 1-D columns of one length: ints, floats, bools, dates, timestamps,
    strings (dictionary-encoded), each with nulls. Index it with a dim to get a row view.

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table, where
        >>> t = Table({"name": ["ann", "bob", "cy"], "age": [31, 17, 45]})
        >>> P = dims(1)
        >>> p = t[P]
        >>> A, adults = where(p["age"] >= 18, p)
        >>> adults.order(A).to_pandas()["name"].tolist()
        ['ann', 'cy']
    """

    def __init__(self, columns: Mapping[str, object]) -> None:
        if not hasattr(columns, "items"):  # a dict, or a pandas DataFrame
            raise TypeError(f"Table(columns): expected a mapping of column names to values, "
                            f"got a {type(columns).__name__}")
        for name in columns:
            if not isinstance(name, str):
                raise TypeError(f"Table: column names must be str, got {name!r} "
                                f"({type(name).__name__})")
        self._columns: dict[str, Column] = {
            name: column_from_values(v, name) for name, v in columns.items()
        }
        lengths = {name: len(c) for name, c in self._columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"table columns must have one length, got {lengths}")
        self._num_rows = next(iter(lengths.values()), 0)

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_arrow(cls, table: pa.Table) -> Table:
        """A table from a ``pyarrow.Table`` (decimals become float64, strings are
        dictionary-encoded)."""
        return cls({name: column_from_arrow(table.column(name), name)
                    for name in table.column_names})

    @classmethod
    def read_parquet(cls, path: str, columns: Sequence[str] | None = None) -> Table:
        """Read a Parquet file (only ``columns``, if given)."""
        import pyarrow.parquet as pq

        return cls.from_arrow(pq.read_table(path, columns=columns))

    @classmethod
    def read_csv(cls, path: str, delimiter: str = ",", **convert_options) -> Table:
        """Read a CSV file with a header row; empty fields (only they, as in DuckDB) are
        nulls, and a column of empty fields only is of strings. ``convert_options`` go to
        ``pyarrow.csv.ConvertOptions`` (``column_types=``, ``null_values=``, ...)."""
        from pyarrow import csv

        convert_options.setdefault("strings_can_be_null", True)
        convert_options.setdefault("null_values", [""])  # Arrow's default has "NA", "nan"...
        table = csv.read_csv(path, parse_options=csv.ParseOptions(delimiter=delimiter),
                             convert_options=csv.ConvertOptions(**convert_options))
        schema = pa.schema([pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f
                            for f in table.schema])
        return cls.from_arrow(table.cast(schema))

    @classmethod
    def from_pandas(cls, df) -> Table:
        """A table from a pandas DataFrame."""
        return cls.from_arrow(pa.Table.from_pandas(df, preserve_index=False))

    # -- reading -------------------------------------------------------------------------
    @property
    def columns(self) -> dict[str, Column]:
        """The columns by name (positional: bind the table to a dim to compute on rows)."""
        return dict(self._columns)

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def __len__(self) -> int:
        return self._num_rows

    def __getitem__(self, key):
        if isinstance(key, Dim):
            key.size = self._num_rows  # raises DimensionBindError naming both sizes
            return Rows(dict(self._columns), (key,))
        if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], Dim):
            return self[key[0]]
        if isinstance(key, str):
            if key not in self._columns:
                raise _unknown(key, self._columns, "the table")
            return self._columns[key]
        if isinstance(key, list):
            return Table({name: self[name] for name in key})
        raise TypeError(f"index a Table with a Dim, a column name or a list of names, not "
                        f"{key!r}")

    def sort(self, by: str | Sequence[str], descending: bool | Sequence[bool] = False) -> Table:
        """Rows sorted by the columns ``by`` (nulls last), stable.

        Example::

            >>> from torchlevels.relational import Table
            >>> t = Table({"k": ["b", "a", "b"], "v": [1, 2, 3]})
            >>> t.sort(["k", "v"], descending=[False, True])["v"].to_arrow().to_pylist()
            [2, 3, 1]
        """
        by = [by] if isinstance(by, str) else list(by)
        desc = [descending] * len(by) if isinstance(descending, bool) else list(descending)
        if len(desc) != len(by):
            raise ValueError(f"sort: {len(by)} columns but {len(desc)} descending flags")
        index = torch.arange(self._num_rows, device=self.device)
        for name, d in reversed(list(zip(by, desc))):
            col = self[name]
            values = col.values[index]
            if col.valid is not None:  # a null's value is no key: nulls tie, keeping order
                values = torch.where(col.valid[index], values, values.new_zeros(()))
            index = index[torch.argsort(values, stable=True, descending=d)]
            if col.valid is not None:
                index = index[torch.argsort((~col.valid[index]).to(torch.int8), stable=True)]
        return self._take(index)

    def take(self, index: torch.Tensor | Sequence[int]) -> Table:
        """The rows at ``index`` (row numbers: an int tensor or a list of ints), in that
        order; a negative number counts from the end, as in pandas.

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"x": [1, 2, 3]}).take([2, 0, -1])["x"].to_arrow().to_pylist()
            [3, 1, 3]
        """
        index = torch.as_tensor(index, device=self.device)
        if not index.numel():
            index = index.long()  # torch.as_tensor([]) is of floats
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"take: the index must hold ints (row numbers), got a "
                            f"{index.dtype} tensor; to filter rows use where(mask, rows)")
        if index.ndim != 1:
            raise ValueError(f"take: the index must be 1-D, got shape {tuple(index.shape)}")
        n = self._num_rows
        if index.numel():
            bad = index[(index < -n) | (index >= n)]
            if bad.numel():
                raise IndexError(f"take: index {int(bad[0])} is out of range for a table of "
                                 f"{n} rows (valid: {-n} to {n - 1})")
            index = torch.where(index < 0, index + n, index)
        return self._take(index)

    def _take(self, index: torch.Tensor) -> Table:
        return Table({name: c.take(index) for name, c in self._columns.items()})

    def head(self, n: int = 5) -> Table:
        """The first ``n`` rows (all of them if there are fewer)."""
        if not isinstance(n, numbers.Integral):
            raise TypeError(f"head(n={n!r}): n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"head(n={n}): n must be >= 0, the number of rows to keep; for "
                             f"all rows but the last {-n} (pandas' head({n})) use "
                             f"take(range(len(table) - {-n}))")
        return self._take(torch.arange(min(n, self._num_rows), device=self.device))

    @property
    def device(self) -> torch.device:
        """Where the columns live."""
        first = next(iter(self._columns.values()), None)
        return first.data.device if first is not None else torch.get_default_device()

    def to(self, device: str | torch.device) -> Table:
        """The table with every column on ``device`` (e.g. ``"cuda"``).

        Example::

            >>> from torchlevels.relational import Table
            >>> Table({"x": [1, 2]}).to("cpu").device
            device(type='cpu')
        """
        return Table({name: c.to(device) for name, c in self._columns.items()})

    def to_arrow(self) -> pa.Table:
        """The table as a ``pyarrow.Table``."""
        return pa.table({name: c.to_arrow() for name, c in self._columns.items()})

    def to_pandas(self):
        """The table as a pandas DataFrame (ints and bools with nulls as pandas' nullable
        Int64 and boolean)."""
        import pandas as pd

        nullable = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}
        return self.to_arrow().to_pandas(types_mapper=nullable.get)

    def __repr__(self) -> str:
        shown = self.head(10).to_pandas().to_string(index=False)
        more = f"\n... ({self._num_rows} rows)" if self._num_rows > 10 else ""
        return f"Table({self._num_rows} rows x {len(self._columns)} columns)\n{shown}{more}"


class Rows:
    """A row view: a table's columns bound to first-class dims (``table[L]``), or the
    rows made by ``where``, ``cat`` or ``groupby``. ``rows["x"]`` is a column over those
    dims; columns of filtered or joined rows are gathered on first use.

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table
        >>> L = dims(1)
        >>> l = Table({"q": [1.0, 2.0, 4.0]})[L]
        >>> l["q"].sum(L).item(), l.count(L).item()
        (7.0, 3)
    """

    def __init__(self, columns: Mapping[str, Column | Callable[[], Column]],
                 dims: tuple[Dim, ...], groups: Grouping | None = None) -> None:
        self._columns = dict(columns)
        self.dims = dims
        self.groups = groups

    @property
    def column_names(self) -> list[str]:
        return list(self._columns)

    @property
    def columns(self) -> dict[str, Column]:
        return {name: self[name] for name in self._columns}

    def __getitem__(self, key):
        if isinstance(key, list):
            for name in key:
                if name not in self._columns:
                    raise _unknown(name, self._columns, f"rows over {self.dims!r}")
            return Rows({name: self._columns[name] for name in key}, self.dims, self.groups)
        if key not in self._columns:
            raise _unknown(key, self._columns, f"rows over {self.dims!r}")
        col = self._columns[key]
        if not isinstance(col, Column):
            col = self._columns[key] = col()
        if not col.dims:  # a positional column, bound on first use
            col = self._columns[key] = col.rebound(self.dims, self.groups, key)
        return col

    def count(self, dim: Dim | tuple[Dim, ...] | None = None) -> Column:
        """The number of rows over ``dim`` (SQL's COUNT(*)); per group over a jagged dim."""
        dims = self.dims if dim is None else (dim if isinstance(dim, tuple) else (dim,))
        g = self.groups
        if g is not None and len(dims) == 1 and dims[0] is g.J:
            return Column(g.sizes, "int", dims=(g.G,), name="count(*)")
        if set(dims) == set(self.dims) and len(dims) == len(self.dims) and (
                g is not None or len(dims) == 1):
            n = g.sizes.sum() if g is not None else torch.tensor(dims[0].size)
            n = n.to(g.sizes.device) if g is not None else n
            return Column(n, "int", name="count(*)")
        raise ValueError(f"count{dims!r}: these rows are over {self.dims!r}; count over all "
                         "of them (or over the jagged dim of grouped rows)")

    def order(self, *dims: Dim) -> Table:
        """The rows as a positional :class:`Table`; grouped rows (``order(G, J)``) come
        group by group.

        Example::

            >>> from torchlevels.dim import dims
            >>> from torchlevels.relational import Table
            >>> R = dims(1)
            >>> Table({"x": [3, 1]})[R].order(R)["x"].to_arrow().to_pylist()
            [3, 1]
        """
        if set(dims) != set(self.dims) or len(dims) != len(self.dims):
            raise ValueError(f"order{dims!r}: these rows are over {self.dims!r}; list "
                             "exactly those dims")
        if self.groups is not None:
            if dims[0] is not self.groups.G:
                raise ValueError(f"order{dims!r}: the jagged dim {self.groups.J!r} must come "
                                 f"after the group dim {self.groups.G!r}")
            kept = int(self.groups.sizes.sum())  # rows a filter left out sort last
            index = torch.argsort(self.groups.ids(), stable=True)[:kept]
            return Table({name: c.take(index) for name, c in self.columns.items()})
        if len(self.dims) != 1:
            raise ValueError(f"order{dims!r}: rows over several dims are a lazy outer "
                             "product; make them one dim with where(condition, rows)")
        return Table({name: c.rebound(name=name) for name, c in self.columns.items()})

    def __repr__(self) -> str:
        return f"Rows(over {self.dims!r}, columns {self.column_names})"


def cat(*parts: Rows) -> Rows:
    """The columns of several row views side by side; over different dims they form a
    lazy outer product that ``where`` filters (a join).

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table, cat
        >>> C, O = dims(2)
        >>> c, o = Table({"id": [1]})[C], Table({"cust": [1, 1]})[O]
        >>> cat(o[["cust"]], c[["id"]])
        Rows(over (O, C), columns ['cust', 'id'])
    """
    columns: dict[str, Column | Callable[[], Column]] = {}
    dims: list[Dim] = []
    for p in parts:
        if not isinstance(p, Rows):
            raise unbound(p, "cat")
        if p.groups is not None:
            raise ValueError("cat of grouped rows: reduce the groups first")
        for name in p.column_names:
            if name in columns:
                raise ValueError(f"cat: column {name!r} appears in more than one input; "
                                 "select distinct names with rows[[...]]")
            columns[name] = _bound(p, name)
        dims += [d for d in p.dims if not any(d is e for e in dims)]
    return Rows(columns, tuple(dims))


def _bound(rows: Rows, name: str) -> Callable[[], Column]:
    return lambda: rows[name]
