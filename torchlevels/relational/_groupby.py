"""``groupby``: group ids from the key columns, then a jagged dim inside each group.

Keys of small range (dictionary codes, bools, small ints) are combined by mixed radix
and counted with one ``bincount``; others are ranked with ``torch.unique``. Either way
groups come sorted by key (nulls last), and reductions over the jagged dim scatter by
group id, so rows are never reordered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchlevels.dim import Dim
from torchlevels.relational._column import Column, Grouping, Selection
from torchlevels.relational._fuse import Expr, evaluate
from torchlevels.relational._table import Rows, Table, _unknown

DENSE_LIMIT = 1 << 20  # the most candidate groups counted without sorting


class Grouped:
    """Rows split by key: ``g.keys`` has one row per group (sorted by key) and ``g[G, J]``
    binds the groups to ``G`` and the rows of each group to the jagged dim ``J``.

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table, groupby
        >>> t = Table({"k": ["b", "a", "b"], "v": [1.0, 2.0, 4.0]})
        >>> g = groupby(t, "k")
        >>> G, J = dims(2)
        >>> r = g[G, J]
        >>> g.keys["k"].to_arrow().to_pylist(), r["v"].sum(J).order(G).to_arrow().to_pylist()
        (['a', 'b'], [2.0, 5.0])
    """

    def __init__(self, rows: Rows, selection: Selection | None, gid: torch.Tensor, size: int,
                 key_names: list[str]) -> None:
        self._rows, self._selection, self._gid, self.size = rows, selection, gid, size
        self.key_names = key_names
        self._sizes: torch.Tensor | None = None

    @property
    def keys(self) -> Table:
        """One row per group with its key values, in the order of the group dim."""
        n = self._gid.shape[0]
        first = torch.full((self.size + 1,), n, dtype=torch.long).scatter_reduce_(
            0, self._gid, torch.arange(n), "amin")[:self.size]
        return Table({k: self._physical(k).take(first) for k in self.key_names})

    @property
    def sizes(self) -> torch.Tensor:
        """The number of rows in each group."""
        if self._sizes is None:
            self._sizes = torch.bincount(self._gid, minlength=self.size + 1)[:self.size]
        return self._sizes

    def _physical(self, name: str) -> Column:
        """Column ``name`` over the rows ``gid`` numbers (before the filter, if any)."""
        return on_physical_rows(self._rows[name], self._selection)

    def __getitem__(self, dims) -> Rows:
        if not (isinstance(dims, tuple) and len(dims) == 2
                and all(isinstance(d, Dim) for d in dims)):
            raise TypeError(f"bind grouped rows with two dims, g[G, J], not g[{dims!r}]")
        G, J = dims
        G.size = self.size
        grouping = Grouping(self._gid, self.size, G, J, self.sizes)
        columns = {name: self._regrouped(name, grouping) for name in self._rows.column_names}
        return Rows(columns, (G, J), grouping)

    def _regrouped(self, name: str, grouping: Grouping):
        def bind() -> Column:
            c = self._physical(name)
            return Column(c.data, c.kind, dims=(grouping.G, grouping.J), valid=c.valid,
                          dictionary=c.dictionary, groups=grouping, name=name)
        return bind

    def __repr__(self) -> str:
        return f"Grouped({self.size} groups by {self.key_names})"


def on_physical_rows(col: Column, selection: Selection | None) -> Column:
    """``col`` (over a filter's dim) as values over the filter's physical rows: its own
    when it has them, else its kept rows scattered back (the others null). With no
    selection: its rows, gathered."""
    if selection is None or col.selection is selection:
        data = col.values if selection is None else col.data
        return Column(data, col.kind, valid=col.valid, dictionary=col.dictionary,
                      name=col.name)
    index = selection.index()
    n = selection.tensor().shape[0]
    values = col.values.new_zeros(n).index_put_((index,), col.values)
    valid = torch.zeros(n, dtype=torch.bool).index_put_(
        (index,), col.valid if col.valid is not None else torch.ones_like(index, dtype=torch.bool))
    return Column(values, col.kind, valid=valid, dictionary=col.dictionary, name=col.name)


def groupby(source: Table | Rows, keys: str | Sequence[str]) -> Grouped:
    """Group a table's rows (or filtered rows over one dim) by the values of ``keys``.

    Example::

        >>> from torchlevels.relational import Table, groupby
        >>> groupby(Table({"a": [1, 1, 2], "b": [True, False, True]}), ["a", "b"]).size
        3
    """
    keys = [keys] if isinstance(keys, str) else list(keys)
    if not keys:
        raise ValueError("groupby needs at least one key column")
    if isinstance(source, Table):
        rows = source[Dim("rows", source.num_rows)]
    elif isinstance(source, Rows):
        if source.groups is not None or len(source.dims) != 1:
            raise ValueError(f"groupby: group rows over one dim, got rows over "
                             f"{source.dims!r}")
        rows = source
    else:
        raise TypeError(f"groupby takes a Table or Rows, got {source!r}")
    for k in keys:
        if k not in rows.column_names:
            raise _unknown(k, rows.column_names, "the grouped rows")
    columns = [rows[k] for k in keys]
    # filtered rows whose keys kept their physical rows: group those, the others left out
    selection = columns[0].selection
    if selection is not None and not all(c.selection is selection for c in columns):
        selection = None
    if selection is None:
        columns = [on_physical_rows(c, None) for c in columns]
        mask = None
    else:
        columns = [on_physical_rows(c, selection) for c in columns]
        mask = selection.mask
    gid, size = group_ids(columns, mask)
    return Grouped(rows, selection, gid, size, keys)


def group_ids(keys: list[Column], mask: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Each row's group number (groups sorted by key, nulls last) and the group count;
    rows where ``mask`` is false get the number of groups (no group)."""
    codes, ranges = zip(*(_codes(k) for k in keys))
    total = 1
    for r in ranges:
        total *= r
    n = keys[0].num_rows()
    if total <= max(DENSE_LIMIT, 2 * n):
        combined = codes[0]
        for c, r in zip(codes[1:], ranges[1:]):
            combined = Expr("radix", (combined, r, c))
        if mask is not None:
            combined = Expr("select", (mask, combined, total))
        combined = evaluate(combined)
        present = torch.bincount(combined, minlength=total + 1)[:total] > 0
        size = int(present.sum())
        remap = torch.cat([torch.cumsum(present, 0) - 1, torch.tensor([size])])
        return remap[combined], size
    if mask is not None:  # rank only the rows kept
        kept = torch.nonzero(evaluate(mask)).squeeze(1)
        gid, size = group_ids([k.take(kept) for k in keys])
        return torch.full((n,), size, dtype=torch.long).index_put_((kept,), gid), size
    ranked = [torch.unique(c, return_inverse=True) for c in codes]
    sizes = [u.shape[0] for u, _ in ranked]
    combined, span = torch.zeros_like(codes[0]), 1
    for (_, inv), s in zip(ranked, sizes):
        if span * s >= 2 ** 62:  # re-rank the keys so far, in order, to stay in int64
            uniq, combined = torch.unique(combined, return_inverse=True)
            span = uniq.shape[0]
        combined, span = combined * s + inv, span * s
    uniq, gid = torch.unique(combined, return_inverse=True)
    return gid, uniq.shape[0]


def _codes(key: Column) -> tuple[torch.Tensor, int]:
    """Key values as non-negative int64 codes that sort like the values, and their range
    (nulls get the largest code)."""
    v = key.values
    if key.kind == "str":
        codes, r = v, len(key.dictionary)
    elif key.kind == "bool":
        codes, r = v.long(), 2
    elif key.kind == "float":
        uniq, codes = torch.unique(v, return_inverse=True)
        r = uniq.shape[0]
    else:
        lo = int(v.min()) if v.numel() else 0
        codes = v.long() - lo
        r = (int(v.max()) - lo + 1) if v.numel() else 1
    if key.valid is not None:
        codes = torch.where(key.valid, codes, r)
        r += 1
    return codes, max(r, 1)
