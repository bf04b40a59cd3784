"""Aggregates over a dim: whole-dim totals and per-group values over a jagged dim.

Without nulls a total is one fused kernel under the column's filter mask, and per-group
values over few groups one fused kernel with the group ids inline (``_fuse.reduce``);
otherwise they scatter by group id (``bincount``, ``index_add_``, ``scatter_reduce_``).
SQL semantics: nulls are skipped, an aggregate of no values is null, and a sum of ints
that does not fit in 64 bits is an error (``_ints``).
"""

from __future__ import annotations

import torch

from torchlevels.relational._column import Column, Grouping, _device, _rows, _rows_in_no_group
from torchlevels.relational._floats import from_order_key, order_key
from torchlevels.relational._fuse import SMALL_GROUPS, Expr, evaluate, reduce, reduce_counted
from torchlevels.relational._ints import halves, summed_halves, whole, whole_float


def aggregate(col: Column, dim, how: str) -> Column:
    """``how`` (sum, mean, min, max, count, count_distinct) of ``col`` over ``dim``."""
    dims = col.dims if dim is None else (tuple(dim) if isinstance(dim, tuple) else (dim,))
    name = f"{how}({col.name})"
    if col._is_scalar():  # SQL refuses these too: "aggregate function calls cannot be nested"
        raise ValueError(f"{how}(): {col.describe()} is one value, an aggregate already, and "
                         "an aggregate of an aggregate is not defined; aggregate the rows once")
    _check_kind(col, how)
    kind = _agg_kind(col, how)
    groups = col.groups
    if groups is not None and set(dims) == {groups.J}:
        values, valid = reduce_groups(col, groups, how)
        return Column(values, kind, dims=(groups.G,), valid=valid, dictionary=col.dictionary,
                      name=name)
    if groups is not None and set(dims) != {groups.G, groups.J}:
        raise ValueError(
            f"{how}{dims!r}: {col.describe()} is grouped by {groups.G!r} with jagged "
            f"{groups.J!r}; reduce over {groups.J!r} (per group) or over both (all rows)"
        )
    if groups is None and (set(dims) != set(col.dims) or len(dims) != len(col.dims)):
        hint = (f" (it is positional, a Table's column: .{how}() reduces all its rows; bind "
                "the table to a dim, table[D], to reduce over D)"
                if not col.dims and not col._is_scalar() else "")
        raise ValueError(f"{how}{dims!r}: {col.describe()} can only be reduced over its dims "
                         f"{col.dims!r}{hint}")
    value, is_valid = reduce_all(col, how)
    return Column(value, kind, valid=is_valid, dictionary=col.dictionary, name=name)


def _check_kind(col: Column, how: str) -> None:
    """SQL's binder refuses sums of strings and dates and means of them and of bools."""
    if how not in ("sum", "mean") or col.kind in ("int", "float") or (
            col.kind == "bool" and how == "sum"):
        return
    hint = {"bool": "sum counts the true values; where(b, 1.0, 0.0) gives numbers to average",
            "date": "min and max take dates; subtract a date to get days (ints)",
            "timestamp": "min and max take timestamps",
            "timestamptz": "min and max take timestamps",
            "str": "min, max and count take strings"}[col.kind]
    raise TypeError(f"cannot {how} {col.describe()}: {hint}")


def _agg_kind(col: Column, how: str) -> str:
    if how in ("count", "count_distinct"):
        return "int"
    if how == "mean":
        return "float"
    return "int" if col.kind == "bool" and how == "sum" else col.kind


def reduce_all(col: Column, how: str):
    """``how`` of all of ``col``'s non-null values: (a 0-d value, a 0-d valid flag or
    None). Without nulls this is one fused kernel under the column's filter."""
    if how in ("min", "max") and _rows(col) == 0:  # torch has no min of nothing: SQL's null
        return col.physical().new_zeros(()), torch.tensor(False, device=_device(col))
    groups = col.groups
    if _rows_in_no_group(col):
        mask = groups.in_a_group()
        count = groups.sizes.sum
    elif col.selection is not None:
        mask = col.selection.mask
        count = lambda: torch.tensor(col.selection.count(), device=_device(col))
    else:
        mask, count = None, lambda: torch.tensor(_rows(col), device=_device(col))
    if col.valid is None and how != "count_distinct":
        if how == "count":
            if isinstance(col.data, Expr):  # SQL runs what it counts: an overflow raises
                col.physical()
            return count(), None
        total, rows = reduce_counted(col.data, mask, "sum" if how == "mean" else how)
        if int(rows) == 0:  # SQL: an aggregate of no rows is null
            zero = total.new_zeros((), dtype=torch.float64 if how == "mean" else total.dtype)
            return zero, torch.tensor(False, device=total.device)
        if how in ("sum", "mean"):
            total = _joined(total, col, how)
        return (total.double() / rows if how == "mean" else total), None
    values, valid = col.values.reshape(-1), col.valid
    if mask is not None and col.selection is None:  # grouped rows, some left out
        kept = evaluate(mask)
        valid = kept if valid is None else valid & kept
    count = valid.sum() if valid is not None else torch.tensor(values.shape[0],
                                                                device=values.device)
    if how == "count":
        return count, None
    if how == "count_distinct":
        kept = _distinct_key(values if valid is None else values[valid])
        return torch.tensor(torch.unique(kept).shape[0], device=values.device), None
    null = None if int(count) > 0 else torch.tensor(False, device=values.device)
    if how in ("sum", "mean"):
        v = values if valid is None else torch.where(valid, values, 0)
        if col.kind == "int":
            total = _joined(summed_halves(v), col, how)
        else:
            total = v.double().sum() if how == "mean" or v.is_floating_point() else v.sum()
        return (total / count.clamp(min=1) if how == "mean" else total), null
    if null is not None:
        return values.new_zeros(()), null
    kept = values if valid is None else values[valid]
    if how == "min" and kept.is_floating_point():  # SQL's: NaN only if every value is
        return from_order_key(order_key(kept).amin(), kept.dtype), None
    return (kept.amin() if how == "min" else kept.amax()), None


def reduce_groups(col: Column, groups: Grouping, how: str):
    """``how`` of ``col``'s non-null values per group (rows with ``gid == size`` are in no
    group); returns (values[size], valid[size] or None). Without nulls, over few groups,
    this is one fused kernel."""
    k = groups.size
    if col.valid is None and how in ("sum", "mean", "min", "max") and 0 < k <= SMALL_GROUPS:
        out = reduce(col.data, None, groups.gid, k, "sum" if how == "mean" else how)
        if how in ("sum", "mean"):
            out = _joined(out, col, how)
        return (out.double() / groups.sizes if how == "mean" else out), None
    gid = groups.ids()
    values, valid = col.values.reshape(-1), col.valid
    if valid is not None:
        gid = torch.where(valid.reshape(-1), gid, k)  # nulls go to the extra group
    n_valid = groups.sizes if valid is None else torch.bincount(gid, minlength=k + 1)[:k]
    if how == "count":
        return n_valid, None
    if how == "count_distinct":
        rank = torch.unique(_distinct_key(values), return_inverse=True)[1]
        base = int(rank.max()) + 1 if rank.numel() else 1
        pairs = torch.unique(gid * base + rank)  # (group, value) pairs, each once
        per_group = torch.div(pairs, base, rounding_mode="floor")
        return torch.bincount(per_group, minlength=k + 1)[:k], None
    empty = n_valid == 0
    null = empty if bool(empty.any()) else None
    if how in ("sum", "mean"):  # ints exactly, as their halves' sums (a mean's too)
        if values.is_floating_point():
            parts = values.double()
        else:
            parts = torch.stack(halves(values), 1) if col.kind == "int" else values.long()
        total = parts.new_zeros((k + 1, *parts.shape[1:]))
        total = _joined(total.index_add_(0, gid, parts)[:k], col, how)
        if how == "mean":
            total = total / n_valid.clamp(min=1)
        return total, None if null is None else ~null
    float_min = how == "min" and values.is_floating_point()  # SQL's: NaN only if all are
    keys = order_key(values) if float_min else values
    out = torch.zeros(k + 1, dtype=keys.dtype, device=values.device)
    out = out.scatter_reduce_(0, gid, keys, "amin" if how == "min" else "amax",
                              include_self=False)[:k]
    if float_min:
        out = from_order_key(out, values.dtype)
    return out, None if null is None else ~null


def _joined(sums: torch.Tensor, col: Column, how: str) -> torch.Tensor:
    """Sums as totals: an int column's come as the sums of its halves (``_ints``), whose
    total must fit in 64 bits (a mean's need not)."""
    if col.kind != "int":
        return sums
    return whole_float(sums) if how == "mean" else whole(sums)


def _distinct_key(values: torch.Tensor) -> torch.Tensor:
    """``values`` as keys that are equal where SQL counts them as one value (all NaNs)."""
    return order_key(values) if values.is_floating_point() else values
