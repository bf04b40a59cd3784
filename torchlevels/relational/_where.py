"""``where``: filters make a new dim, joins make a dim of matching row pairs, and the
3-argument form picks values (SQL's CASE WHEN).

A filter keeps its columns' physical rows and a mask (``Selection``), so aggregates over
its dim apply the mask in their kernel and nothing is gathered unless needed. A join
never makes the outer product: an equality between columns of the two dims looks keys
up in a position table (integer keys of small range) or runs a sort-merge join; any
other predicate is evaluated on those pairs, or, when there is no equality, on blocks of
the outer product of bounded size.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch

from torchlevels.dim import Dim
from torchlevels.dim._dims import _assigned_names
from torchlevels.relational._column import (
    Column,
    Cross,
    _aligned,
    _and_valid,
    _broadcast_const,
    _common_kind,
    _comparable,
    _rows,
)
from torchlevels.relational._floats import order_key
from torchlevels.relational._fuse import Expr, evaluate, evaluate_at, reduce
from torchlevels.relational._table import Rows, unbound

_MISSING = object()
BLOCK_ELEMENTS = 1 << 22  # pairs evaluated at once by a join with no equality


def where(condition, rows, other=_MISSING, *, keep: Dim | None = None):
    """Filter rows (or join them), or pick between two values.

    - ``where(mask, rows)`` -> ``(D2, rows2)``: the rows where ``mask`` is true (not
      null), over a new dim ``D2``. The same mask object always gives the same dim.
    - ``where(condition, cat(a, b))`` with ``condition`` over two dims (``a["k"] ==
      b["k"]``): an inner join; ``keep=A`` keeps every row of dim ``A`` (a LEFT JOIN,
      with nulls where nothing matches).
    - ``where(mask, x, y)``: ``x`` where ``mask`` is true, else ``y`` (CASE WHEN).

    Example::

        >>> from torchlevels.dim import dims
        >>> from torchlevels.relational import Table, where
        >>> L = dims(1)
        >>> l = Table({"q": [5, 30, 10], "p": [1.0, 2.0, 3.0]})[L]
        >>> L2, small = where(l["q"] < 24, l)
        >>> L2.size, small["p"].sum(L2).item()
        (2, 4.0)
        >>> where(l["q"] < 24, l["p"], 0.0).order(L).to_arrow().to_pylist()
        [1.0, 0.0, 3.0]
    """
    if other is not _MISSING:
        return _case(condition, rows, other)
    frame = inspect.currentframe().f_back
    try:
        names = _assigned_names(frame.f_code, frame.f_lasti)
    finally:
        del frame
    name = names[0] if names else "where"
    if isinstance(condition, Cross):
        return _join(condition, rows, keep, name)
    if not isinstance(condition, Column):
        raise TypeError(f"where: the condition must be a boolean column, got {condition!r}")
    if keep is not None:
        raise ValueError("where(..., keep=D) is for joins: the condition must span two dims")
    condition._expect("bool", "where")
    if len(condition.dims) != 1 or condition.groups is not None:
        positional = not condition.dims and not condition._is_scalar()
        hint = (": it is positional (computed from a Table's columns); compute it from a row "
                "view, table[D]") if positional else ""
        raise ValueError(f"where: filter by a condition over one dim, got "
                         f"{condition.describe()}{hint}")
    (dim,) = condition.dims
    _check_over(rows, (dim,), condition)
    cache = condition._where_cache
    if cache is None:
        selection = Selection(_physical_mask(condition))
        cache = condition._where_cache = (FilterDim(name, selection), selection)
    new, selection = cache
    if isinstance(rows, Column):
        return new, _filtered(rows, condition, selection, new)
    return new, Rows({name: _filter_taker(rows, name, condition, selection, new)
                      for name in rows.column_names}, (new,))


class Selection:
    """The rows a filter keeps: the physical rows where ``mask`` (an expression or bool
    tensor over them) holds. Columns over the filter's dim keep their physical values;
    aggregates apply the mask inside their kernel, anything else gathers the rows."""

    def __init__(self, mask: torch.Tensor | Expr) -> None:
        self.mask = mask
        self._count: int | None = None
        self._index: torch.Tensor | None = None

    def count(self) -> int:
        if self._count is None:
            self._count = int(reduce(self.mask, None, None, 0, "count")) if isinstance(
                self.mask, Expr) else int(torch.count_nonzero(self.mask))
        return self._count

    def tensor(self) -> torch.Tensor:
        self.mask = evaluate(self.mask)
        return self.mask

    def index(self) -> torch.Tensor:
        if self._index is None:
            self._index = torch.nonzero(self.tensor()).squeeze(1)
        return self._index


class FilterDim(Dim):
    """The dim of a filter's rows: its size, the number of rows kept, is counted on first
    use (aggregates over it apply the mask and need no count)."""

    __slots__ = ("_selection",)

    def __init__(self, name: str, selection: Selection) -> None:
        super().__init__(name)
        self._selection = selection

    @property
    def size(self) -> int:
        if self._size < 0:
            self._size = self._selection.count()
        return self._size

    @size.setter
    def size(self, size: int) -> None:
        _ = self.size  # counted first, so that a different size is an error naming both
        Dim.size.fset(self, size)

    @property
    def is_bound(self) -> bool:
        return True


def _physical_mask(condition: Column):
    """The rows a filter keeps, over the condition's physical rows (true, not null)."""
    if condition.selection is not None:  # filtering filtered rows: both masks hold
        return Expr("and", (condition.selection.mask, condition.data))
    if condition.valid is not None:
        return condition.is_true()
    return condition.data


def _filtered(col: Column, condition: Column, selection: Selection, new: Dim) -> Column:
    """``col`` over the filter's new dim: its physical values under the filter's mask
    when it has the condition's physical rows, else its kept rows gathered."""
    if (col.valid is None and col.selection is condition.selection
            and _rows(col) == _rows(condition)):
        return Column(col.data, col.kind, dims=(new,), dictionary=col.dictionary,
                      selection=selection, name=col.name)
    return col.take(torch.nonzero(condition.is_true()).squeeze(1), (new,))


def _filter_taker(rows: Rows, name: str, condition: Column, selection: Selection, new: Dim):
    return lambda: _filtered(rows[name], condition, selection, new)


def _check_over(rows, dims: tuple[Dim, ...], condition) -> None:
    if not isinstance(rows, Rows | Column) or not rows.dims:
        raise unbound(rows, "where(condition, rows)")
    if not set(rows.dims) <= set(dims):
        raise ValueError(f"where: the rows are over {rows.dims!r} but the condition "
                         f"{condition.describe()} is over {dims!r}")


def _gather(rows, index: dict[Dim, torch.Tensor], new: Dim):
    """``rows`` (or a column) at the chosen rows of each of its dims, over ``new``."""
    if isinstance(rows, Column):
        (d,) = rows.dims
        return rows.take(index[d], (new,))
    return Rows({name: _taker(rows, name, index, new) for name in rows.column_names}, (new,))


def _taker(rows: Rows, name: str, index: dict[Dim, torch.Tensor], new: Dim):
    def take() -> Column:
        col = rows[name]
        (d,) = col.dims
        return col.take(index[d], (new,))
    return take


def _case(mask, x, y) -> Column:
    if not isinstance(mask, Column):
        raise TypeError(f"where(mask, x, y): mask must be a boolean column, got {mask!r}")
    mask._expect("bool", "where(mask, x, y)")
    x = x if isinstance(x, Column) else _broadcast_const(mask, x, getattr(y, "kind", None))
    y = y if isinstance(y, Column) else _broadcast_const(mask, y, x.kind)
    mask, x = _aligned(mask, x, "where")
    mask, y = _aligned(mask, y, "where")
    kind = _common_kind(x.kind, y.kind, f"where({mask.name}, {x.describe()}, {y.describe()})")
    x, y = _comparable(x, y, "where")
    take_x = mask.is_true()
    values = torch.where(take_x, x.values, y.values)
    valid = None
    if x.valid is not None or y.valid is not None:
        vx = torch.ones_like(take_x) if x.valid is None else x.valid
        vy = torch.ones_like(take_x) if y.valid is None else y.valid
        valid = torch.where(take_x, vx, vy)
    return Column(values, kind, dims=mask.dims, valid=valid, dictionary=x.dictionary,
                  groups=mask.groups, name=f"CASE WHEN {mask.name} THEN {x.name} ELSE {y.name}")


# -- joins -------------------------------------------------------------------------------
def _join(condition: Cross, rows, keep: Dim | None, name: str):
    if len(condition.dims) != 2:
        raise ValueError(f"where: a join condition spans exactly two dims, got "
                         f"{condition.describe()}")
    A, B = condition.dims
    _check_over(rows, (A, B), condition)
    if keep is not None and keep is not A and keep is not B:
        raise ValueError(f"where(..., keep={keep!r}): keep must be one of the joined dims "
                         f"{A!r}, {B!r}")
    cache = condition._where_cache
    if cache is None or cache[0] is not keep:
        ia, ib = _join_pairs(condition, A, B)
        if keep is not None:
            ia, ib = _keep_unmatched(ia, ib, keep is A, (A if keep is A else B).size)
        new = Dim(name, ia.shape[0])
        cache = condition._where_cache = (keep, new, {A: ia, B: ib})
    _, new, index = cache
    return new, _gather(rows, index, new)


def _join_pairs(condition: Cross, A: Dim, B: Dim) -> tuple[torch.Tensor, torch.Tensor]:
    """Row pairs ``(ia, ib)`` of dims ``A`` and ``B`` where ``condition`` is true."""
    filters: dict[Dim, list[Column]] = {A: [], B: []}
    equal, rest = None, []
    for part in condition.conjuncts():
        if isinstance(part, Column) and len(part.dims) == 1 and part.dims[0] in {A, B}:
            filters[part.dims[0]].append(part)
        elif equal is None and _is_equality(part):
            equal = part
        else:
            rest.append(part)
    if equal is not None:
        ka, kb = equal.args if equal.args[0].dims[0] is A else equal.args[::-1]
        ia, ib = _equi_join(ka, kb, filters[A], filters[B])
        return _filter_pairs(rest, A, B, ia, ib)
    ia, ib = (_rows_where(_mask_of(filters[d]), d.size, condition.device) for d in (A, B))
    block = max(1, BLOCK_ELEMENTS // max(1, ib.shape[0]))
    out_a, out_b = [ia[:0]], [ib[:0]]
    for start in range(0, ia.shape[0], block):
        pa_ = ia[start:start + block].repeat_interleave(ib.shape[0])
        pb_ = ib.repeat(min(block, ia.shape[0] - start))
        pa_, pb_ = _filter_pairs(rest, A, B, pa_, pb_)
        out_a.append(pa_)
        out_b.append(pb_)
    return torch.cat(out_a), torch.cat(out_b)


def _is_equality(part) -> bool:
    return (isinstance(part, Cross) and part.op == "eq"
            and all(isinstance(a, Column) and len(a.dims) == 1 for a in part.args))


def _filter_pairs(parts, A: Dim, B: Dim, ia: torch.Tensor, ib: torch.Tensor):
    if not parts:
        return ia, ib
    pairs = Dim("pairs", ia.shape[0])
    index = {A: ia, B: ib}
    keep = None
    for part in parts:
        if not isinstance(part, Cross | Column):
            raise TypeError(f"where: cannot use {part!r} in a join condition")
        m = part.at(index, pairs) if isinstance(part, Cross) else part.take(
            index[part.dims[0]], (pairs,))
        m._expect("bool", "where")
        keep = _and_valid(keep, m.is_true())
    return ia[keep], ib[keep]


def _rows_where(mask: torch.Tensor | None, n: int, device=None) -> torch.Tensor:
    return torch.arange(n, device=device) if mask is None else torch.nonzero(mask).squeeze(1)


def _equi_join(ka: Column, kb: Column, filters_a: list[Column],
               filters_b: list[Column]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row pairs with equal non-null keys among the rows each side's filters keep. The
    side with fewer rows builds (its filters first, see ``_match``); the other side's
    filters are evaluated on its matched rows only."""
    ka, kb = _comparable(ka, kb, "==")
    va, vb = ka.values, kb.values
    dtype = torch.promote_types(va.dtype, vb.dtype)
    if dtype == torch.bool:  # keys index a position table: bools would be masks
        dtype = torch.int64
    if va.dtype != dtype or vb.dtype != dtype:
        va, vb = va.to(dtype), vb.to(dtype)
    swap = va.shape[0] < vb.shape[0]
    a, b = (va, ka.valid, filters_a), (vb, kb.valid, filters_b)
    (probe, probe_valid, probe_filters), (build, build_valid, build_filters) = (
        (b, a) if swap else (a, b))
    build_rows = _rows_where(_and_valid(_mask_of(build_filters), build_valid), build.shape[0],
                             build.device)
    if build_rows.numel() == 0 or probe.numel() == 0:
        none = torch.zeros(0, dtype=torch.long, device=va.device)
        return none, none
    probe_rows, build_pos = _match(probe, probe_valid, build[build_rows])
    for f in probe_filters:
        keep = _true_at(f, probe_rows)
        probe_rows, build_pos = probe_rows[keep], build_pos[keep]
    out_build = build_rows[build_pos]
    return (out_build, probe_rows) if swap else (probe_rows, out_build)


def _mask_of(filters: list[Column]) -> torch.Tensor | None:
    """Where every filter is true (not null); None for no filters."""
    mask = None
    for f in filters:
        mask = _and_valid(mask, f.is_true())
    return mask


def _true_at(f: Column, rows: torch.Tensor) -> torch.Tensor:
    """Whether filter ``f`` is true (not null) at ``rows``, computed at those rows only."""
    if f.valid is None and f.selection is None:
        return evaluate_at(f.data, rows)
    m = f.values[rows]
    return m if f.valid is None else m & f.valid[rows]


def _match(probe: torch.Tensor, probe_mask: torch.Tensor | None, build: torch.Tensor):
    """Rows ``p`` of ``probe`` (where ``probe_mask`` holds) and positions ``b`` in
    ``build`` with ``probe[p] == build[b]``, grouped by probe row.

    Integer keys of small range are looked up in a table indexed by key: with distinct
    build keys (a join to a primary key) the table holds each key's build position, and
    every probe row looks itself up (no gather of the filtered probe keys); else it holds
    where each key's run starts in the build rows sorted by key (a counting sort). Other
    keys are sorted and binary-searched (a sort-merge join). Float keys are equal as SQL
    has them equal (NaN to NaN, ``-0.0`` to ``0.0``): as their order keys, integers."""
    if build.is_floating_point():
        build, probe = order_key(build), order_key(probe)
    else:
        (build_lo, build_hi), (probe_lo, probe_hi) = _min_max(build), _min_max(probe)
        lo = min(0, build_lo, probe_lo)
        span = max(build_hi, probe_hi) - lo + 1
        if span <= 4 * (build.shape[0] + probe.shape[0]) + 1024:
            b, p = build.long(), probe.long()  # (dates' int32 days: take() takes int64)
            if lo:
                b, p = b - lo, p - lo
            index_type = torch.int32 if build.shape[0] < 2 ** 31 else torch.long
            # the table holds build position + 1, and 0 for a key not in the build side
            rows = torch.arange(1, build.shape[0] + 1, dtype=index_type, device=build.device)
            position, lock = _position_table(probe, span, index_type)
            try:
                position[b] = rows
                distinct = bool((position[b] == rows).all())  # no key written twice
                found = torch.take(position, p) if distinct else None  # faster than [p]
            finally:
                position[b] = 0  # all 0 again, for the next join
                if lock is not None:
                    lock.release()
            if distinct:
                if probe_mask is not None:
                    found = found * probe_mask
                probe_rows = torch.nonzero(found).squeeze(1)  # no separate "found >= 0"
                return probe_rows, found[probe_rows] - 1
            per_key = torch.bincount(b, minlength=span)
            key_start = torch.cumsum(per_key, 0) - per_key
            kept = _rows_where(probe_mask, probe.shape[0], probe.device)
            pk = p[kept]
            pos, build_pos = _expand(key_start[pk], per_key[pk], torch.argsort(b, stable=True))
            return kept[pos], build_pos
    kept = _rows_where(probe_mask, probe.shape[0], probe.device)
    build_sorted, order = torch.sort(build, stable=True)
    start = torch.searchsorted(build_sorted, probe[kept], right=False)
    end = torch.searchsorted(build_sorted, probe[kept], right=True)
    pos, build_pos = _expand(start, end - start, order)
    return kept[pos], build_pos


_TABLES: dict[int, tuple] = {}


def _position_table(owner: torch.Tensor, span: int, dtype: torch.dtype):
    """A key -> position table of ``span`` entries, all 0, and the lock to release
    after use (None for a table made just for this call). The caller resets the entries
    it wrote to 0. One table is kept per probed key column while the column lives (4
    bytes per key of its range), so joining it again costs no fill of the key range."""
    key = id(owner)
    kept = _TABLES.get(key)
    if kept is not None and kept[0]() is owner:
        table, lock = kept[1], kept[2]
        if table.shape[0] == span and table.dtype == dtype and lock.acquire(blocking=False):
            return table, lock
        return torch.zeros((span,), dtype=dtype, device=owner.device), None
    table, lock = torch.zeros((span,), dtype=dtype, device=owner.device), threading.Lock()
    lock.acquire()
    _TABLES[key] = (weakref.ref(owner, lambda _: _TABLES.pop(key, None)), table, lock)
    return table, lock


_MIN_MAX: dict[int, tuple] = {}


def _min_max(keys: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest key, remembered per tensor while it lives and is not
    written to (a table's columns are joined again and again)."""
    seen = _MIN_MAX.get(id(keys))
    if seen is None or seen[0]() is not keys or seen[1] != keys._version:
        key = id(keys)
        seen = _MIN_MAX[key] = (weakref.ref(keys, lambda _: _MIN_MAX.pop(key, None)),
                                keys._version, int(keys.min()), int(keys.max()))
    return seen[2], seen[3]


def _expand(start: torch.Tensor, count: torch.Tensor, order: torch.Tensor):
    """Probe row ``p`` matches build rows ``order[start[p] : start[p] + count[p]]``."""
    probe_pos = torch.repeat_interleave(torch.arange(count.shape[0], device=count.device),
                                        count)
    offsets = torch.cumsum(count, 0) - count
    within = torch.arange(probe_pos.shape[0], device=count.device) - offsets[probe_pos]
    return probe_pos, order[start[probe_pos] + within]


def _keep_unmatched(ia, ib, keep_a: bool, n: int):
    """Add each row of the kept dim that has no match, paired with ``-1`` (a null row)."""
    kept = ia if keep_a else ib
    matched = torch.zeros(n, dtype=torch.bool, device=kept.device)
    matched[kept] = True
    lonely = torch.nonzero(~matched).squeeze(1)
    none = torch.full_like(lonely, -1)
    if keep_a:
        return torch.cat([ia, lonely]), torch.cat([ib, none])
    return torch.cat([ia, none]), torch.cat([ib, lonely])


__all__ = ["where"]
