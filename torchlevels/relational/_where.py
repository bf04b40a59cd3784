"""``where``: filters make a new dim, joins make a dim of matching row pairs, and the
3-argument form picks values (SQL's CASE WHEN).

A join never makes the outer product: an equality between columns of the two dims runs
as a sort-merge join (sort one side's keys, binary-search the other's); any other
predicate is evaluated on those pairs, or, when there is no equality, on blocks of the
outer product of bounded size.
"""

from __future__ import annotations

import inspect

import torch

from torchlevels.dim import Dim
from torchlevels.dim._dims import _assigned_names
from torchlevels.relational._column import Column, Cross, _aligned, _and_valid, _comparable
from torchlevels.relational._table import Rows

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
        raise ValueError(f"where: filter by a condition over one dim, got "
                         f"{condition.describe()}")
    (dim,) = condition.dims
    if isinstance(rows, Column) or not set(rows.dims) <= {dim}:
        _check_over(rows, (dim,), condition)
    cache = condition._where_cache
    if cache is None:
        mask = condition.values if condition.valid is None else condition.values & condition.valid
        new = Dim(name, int(mask.sum()))
        cache = condition._where_cache = (new, _Index(mask), mask)
    new, index, mask = cache
    out = _gather(rows, {dim: index}, new)
    if isinstance(out, Rows) and rows.groups is None:
        out.selection = (rows, mask)
    return new, out


def _check_over(rows, dims: tuple[Dim, ...], condition) -> None:
    if not set(rows.dims) <= set(dims):
        raise ValueError(f"where: the rows are over {rows.dims!r} but the condition "
                         f"{condition.describe()} is over {dims!r}")


class _Index:
    """The positions of a filter's true values, found on first use: grouping filtered
    rows needs only the mask."""

    def __init__(self, mask: torch.Tensor) -> None:
        self._mask, self._index = mask, None

    def __call__(self) -> torch.Tensor:
        if self._index is None:
            self._index = torch.nonzero(self._mask).squeeze(1)
        return self._index


def _gather(rows, index: dict[Dim, torch.Tensor | _Index], new: Dim):
    """``rows`` (or a column) at the chosen rows of each of its dims, over ``new``."""
    if isinstance(rows, Column):
        (d,) = rows.dims
        return rows.take(_positions(index[d]), (new,))
    return Rows({name: _taker(rows, name, index, new) for name in rows.column_names}, (new,))


def _positions(index: torch.Tensor | _Index) -> torch.Tensor:
    return index if isinstance(index, torch.Tensor) else index()


def _taker(rows: Rows, name: str, index: dict[Dim, torch.Tensor | _Index], new: Dim):
    def take() -> Column:
        col = rows[name]
        (d,) = col.dims
        return col.take(_positions(index[d]), (new,))
    return take


def _case(mask, x, y) -> Column:
    if not isinstance(mask, Column):
        raise TypeError(f"where(mask, x, y): mask must be a boolean column, got {mask!r}")
    mask._expect("bool", "where(mask, x, y)")
    x = x if isinstance(x, Column) else _const_like(mask, x)
    y = y if isinstance(y, Column) else _const_like(mask, y)
    mask, x = _aligned(mask, x, "where")
    mask, y = _aligned(mask, y, "where")
    x, y = _comparable(x, y, "where")
    take_x = mask.values if mask.valid is None else mask.values & mask.valid
    values = torch.where(take_x, x.values, y.values)
    kind = "float" if "float" in (x.kind, y.kind) else x.kind
    valid = None
    if x.valid is not None or y.valid is not None:
        vx = torch.ones_like(take_x) if x.valid is None else x.valid
        vy = torch.ones_like(take_x) if y.valid is None else y.valid
        valid = torch.where(take_x, vx, vy)
    return Column(values, kind, dims=mask.dims, valid=valid, dictionary=x.dictionary,
                  groups=mask.groups, name=f"CASE WHEN {mask.name} THEN {x.name} ELSE {y.name}")


def _const_like(like: Column, value) -> Column:
    from torchlevels.relational._column import _broadcast_const

    return _broadcast_const(like, value)


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
    masks: dict[Dim, torch.Tensor] = {}
    equal, rest = None, []
    for part in condition.conjuncts():
        if isinstance(part, Column) and len(part.dims) == 1 and part.dims[0] in {A, B}:
            m = part.values if part.valid is None else part.values & part.valid
            d = part.dims[0]
            masks[d] = m if d not in masks else masks[d] & m
        elif equal is None and _is_equality(part):
            equal = part
        else:
            rest.append(part)
    ia, ib = (torch.nonzero(masks[d]).squeeze(1) if d in masks else torch.arange(d.size)
              for d in (A, B))
    if equal is not None:
        ka, kb = equal.args if equal.args[0].dims[0] is A else equal.args[::-1]
        ia, ib = _equi_join(ka, kb, ia, ib)
        return _filter_pairs(rest, A, B, ia, ib)
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
        m = m.values if m.valid is None else m.values & m.valid
        keep = m if keep is None else keep & m
    return ia[keep], ib[keep]


def _equi_join(ka: Column, kb: Column, ia: torch.Tensor, ib: torch.Tensor):
    """Pairs of rows ``ia[x]``, ``ib[y]`` with equal non-null keys; the smaller side is
    the build side (see ``_match``)."""
    ka, kb = _comparable(ka, kb, "==")
    va, vb = _keys(ka, ia), _keys(kb, ib)
    if va.dtype != vb.dtype:
        dtype = torch.promote_types(va.dtype, vb.dtype)
        va, vb = va.to(dtype), vb.to(dtype)
    if ka.valid is not None:
        ok = ka.valid[ia]
        ia, va = ia[ok], va[ok]
    if kb.valid is not None:
        ok = kb.valid[ib]
        ib, vb = ib[ok], vb[ok]
    swap = va.shape[0] < vb.shape[0]
    (probe, probe_rows), (build, build_rows) = ((vb, ib), (va, ia)) if swap else (
        (va, ia), (vb, ib))
    if probe.numel() == 0 or build.numel() == 0:
        return ia[:0], ib[:0]
    probe_pos, build_pos = _match(probe, build)
    out_probe, out_build = probe_rows[probe_pos], build_rows[build_pos]
    return (out_build, out_probe) if swap else (out_probe, out_build)


def _keys(col: Column, rows: torch.Tensor) -> torch.Tensor:
    v = col.values
    return v if rows.shape[0] == v.shape[0] else v[rows]


def _match(probe: torch.Tensor, build: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``(p, b)`` with ``probe[p] == build[b]``, grouped by probe position.

    Integer keys of small range are looked up in a table indexed by key: with distinct
    build keys (a join to a primary key) the table holds each key's build position, else
    where each key's run starts in the build rows sorted by key (a counting sort). Other
    keys are sorted and binary-searched (a sort-merge join)."""
    if not build.is_floating_point():
        lo = min(0, int(build.min()), int(probe.min()))
        span = max(int(build.max()), int(probe.max())) - lo + 1
        if span <= 4 * (build.shape[0] + probe.shape[0]) + 1024:
            b, p = (build, probe) if lo == 0 else (build - lo, probe - lo)
            rows = torch.arange(build.shape[0])
            position = torch.full((span,), -1, dtype=torch.long)
            position[b] = rows
            if bool((position[b] == rows).all()):  # no key written twice: distinct keys
                found = position[p]
                probe_pos = torch.nonzero(found >= 0).squeeze(1)
                return probe_pos, found[probe_pos]
            per_key = torch.bincount(b, minlength=span)
            key_start = torch.cumsum(per_key, 0) - per_key
            return _expand(key_start[p], per_key[p], torch.argsort(b, stable=True))
    build_sorted, order = torch.sort(build, stable=True)
    start = torch.searchsorted(build_sorted, probe, right=False)
    end = torch.searchsorted(build_sorted, probe, right=True)
    return _expand(start, end - start, order)


def _expand(start: torch.Tensor, count: torch.Tensor, order: torch.Tensor):
    """Probe row ``p`` matches build rows ``order[start[p] : start[p] + count[p]]``."""
    probe_pos = torch.repeat_interleave(torch.arange(count.shape[0]), count)
    offsets = torch.cumsum(count, 0) - count
    within = torch.arange(probe_pos.shape[0]) - offsets[probe_pos]
    return probe_pos, order[start[probe_pos] + within]


def _keep_unmatched(ia, ib, keep_a: bool, n: int):
    """Add each row of the kept dim that has no match, paired with ``-1`` (a null row)."""
    kept = ia if keep_a else ib
    matched = torch.zeros(n, dtype=torch.bool)
    matched[kept] = True
    lonely = torch.nonzero(~matched).squeeze(1)
    none = torch.full_like(lonely, -1)
    if keep_a:
        return torch.cat([ia, lonely]), torch.cat([ib, none])
    return torch.cat([ia, none]), torch.cat([ib, lonely])


__all__ = ["where", "_and_valid"]
