"""``groupby``: group ids from the key columns, then a jagged dim inside each group.

Keys of small range (dictionary codes, bools, small ints) are combined by mixed radix
and counted with one ``bincount``; others are ranked with ``torch.unique``. Either way
groups come sorted by key (nulls last), and reductions over the jagged dim scatter by
group id, so rows are never reordered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchlevels.dim import Dim
from torchlevels.relational._column import Column, Grouping
from torchlevels.relational._floats import from_order_key, order_key
from torchlevels.relational._fuse import SMALL_GROUPS, Expr, evaluate, reduce
from torchlevels.relational._table import Rows, Table, _unknown
from torchlevels.relational._where import Selection

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

    def __init__(self, rows: Rows, selection: Selection | None, key_names: list[str],
                 gid: torch.Tensor | Expr, size: int, sizes: torch.Tensor | None,
                 key_values: list[Column] | None) -> None:
        self._rows, self._selection, self.key_names = rows, selection, key_names
        self._gid, self.size, self._sizes = gid, size, sizes
        self._keys = None if key_values is None else Table(dict(zip(key_names, key_values)))

    @property
    def keys(self) -> Table:
        """One row per group with its key values, in the order of the group dim."""
        if self._keys is None:
            gid = self._gid = evaluate(self._gid)
            n = gid.shape[0]
            first = torch.full((self.size + 1,), n, dtype=torch.long, device=gid.device)
            first = first.scatter_reduce_(0, gid, torch.arange(n, device=gid.device),
                                          "amin")[:self.size]
            self._keys = Table({k: self._physical(k).take(first) for k in self.key_names})
        return self._keys

    @property
    def sizes(self) -> torch.Tensor:
        """The number of rows in each group."""
        if self._sizes is None:
            gid = self._gid = evaluate(self._gid)
            self._sizes = torch.bincount(gid, minlength=self.size + 1)[:self.size]
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
            return self._physical(name).rebound((grouping.G, grouping.J), grouping, name)
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
    valid = torch.zeros(n, dtype=torch.bool, device=index.device).index_put_(
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
    return Grouped(rows, selection, keys, *group_ids(columns, mask))


@dataclass
class _KeyCodes:
    """One key column as non-negative int64 codes that sort like its values (nulls get
    the largest), their range, and the way back from codes to values."""

    codes: torch.Tensor
    range: int
    decode: Callable[[torch.Tensor], Column]


def group_ids(keys: list[Column], mask=None):
    """Each row's group number (groups sorted by key, nulls last; a tensor, or an
    expression fused kernels compute inline), the number of groups, and, when they come
    for free, the rows per group and the key values per group (else None). Rows where
    ``mask`` is false get the number of groups (no group)."""
    coded = [_codes(k) for k in keys]
    total = 1
    for k in coded:
        total *= k.range
    n = keys[0].num_rows()
    combined = coded[0].codes  # mixed radix, last key fastest: sorts like the keys
    for k in coded[1:]:
        combined = Expr("radix", (combined, k.range, k.codes))
    if total <= max(DENSE_LIMIT, 2 * n):
        if mask is not None:
            combined = Expr("select", (mask, combined, total))
        if total <= SMALL_GROUPS:  # count the candidates in one fused pass
            counts = reduce(combined, None, combined, total, "rows")
        else:
            combined = evaluate(combined)
            counts = torch.bincount(combined, minlength=total + 1)[:total]
        present = counts > 0
        size = int(present.sum())
        remap = torch.cat([torch.cumsum(present, 0) - 1,
                           torch.tensor([size], device=present.device)])
        gid = Expr("lookup", (combined, remap)) if total <= SMALL_GROUPS else remap[combined]
        return gid, size, counts[present], _decode(coded, torch.nonzero(present).squeeze(1))
    if mask is not None:  # rank only the rows kept
        kept = torch.nonzero(evaluate(mask)).squeeze(1)
        gid, size, _, _ = group_ids([k.take(kept) for k in keys])
        out = torch.full((n,), size, dtype=torch.long, device=kept.device)
        return out.index_put_((kept,), evaluate(gid)), size, None, None
    if total < 2 ** 62:  # the codes combine in an int64: one sort
        uniq, gid = torch.unique(evaluate(combined), return_inverse=True)
        return gid, uniq.shape[0], None, None
    ranked = [torch.unique(k.codes, return_inverse=True) for k in coded]
    combined, span = torch.zeros_like(coded[0].codes), 1
    for uniq, inv in ranked:
        if span * uniq.shape[0] >= 2 ** 62:  # re-rank the keys so far, in order
            seen, combined = torch.unique(combined, return_inverse=True)
            span = seen.shape[0]
        combined, span = combined * uniq.shape[0] + inv, span * uniq.shape[0]
    uniq, gid = torch.unique(combined, return_inverse=True)
    return gid, uniq.shape[0], None, None


def _decode(coded: list[_KeyCodes], candidates: torch.Tensor) -> list[Column]:
    """The key values of the combined codes ``candidates`` (mixed radix, last key fastest)."""
    out = []
    for k in reversed(coded):
        out.append(k.decode(candidates % k.range))
        candidates = torch.div(candidates, k.range, rounding_mode="floor")
    return out[::-1]


def _codes(key: Column) -> _KeyCodes:
    v = key.values
    if key.kind == "str":
        codes, r, values = v, len(key.dictionary), lambda c: c
    elif key.kind == "bool":
        codes, r, values = v.long(), 2, lambda c: c == 1
    elif key.kind == "float":  # one group for all NaNs, one for both zeros, as in SQL
        uniq, codes = torch.unique(order_key(v), return_inverse=True)
        r, values = uniq.shape[0], lambda c: from_order_key(uniq[c], v.dtype)
    else:
        lo, hi = (int(v.min()), int(v.max())) if v.numel() else (0, 0)
        if hi - lo < 2**62:  # value - lo fits in an int64, with room for the nulls' code
            codes, r = v.long() - lo, hi - lo + 1
            values = lambda c: (c + lo).to(v.dtype)
        else:  # rank the values instead
            uniq, codes = torch.unique(v, return_inverse=True)
            r, values = uniq.shape[0], lambda c: uniq[c]
    has_nulls = key.valid is not None
    if has_nulls:
        codes = torch.where(key.valid, codes, r)

    def decode(c: torch.Tensor, base: int = r) -> Column:
        valid = c < base if has_nulls else None
        return Column(values(c.clamp(max=max(base - 1, 0))), key.kind, valid=valid,
                      dictionary=key.dictionary, name=key.name)

    return _KeyCodes(codes, max(r + has_nulls, 1), decode)
