"""Columns from and to Arrow: the one place that knows Arrow's types.

Columns read from Arrow (and so from Parquet, CSV, pandas and lists) are made on torch's
default device.

Integers stay integers (int64), decimals and floats become float64, dates are int32
days since 1970-01-01, timestamps int64 microseconds since 1970-01-01 00:00 (those with a
time zone as UTC instants, as DuckDB's TIMESTAMPTZ), and strings are dictionary-encoded
with a sorted dictionary. A type that does not fit, or values that would change on the
way, raise an error naming the column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from torchlevels.relational._column import Column


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor on torch's default device (the CPU unless
    ``torch.set_default_device`` named another)."""
    return torch.from_numpy(array).to(torch.get_default_device())


def column_from_arrow(arr: pa.Array | pa.ChunkedArray, name: str) -> Column:
    """One Arrow column as a :class:`Column` (nulls become a validity mask)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    t = arr.type
    valid = None
    if arr.null_count:
        valid = _tensor(arr.is_valid().to_numpy(zero_copy_only=False).copy())
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        encoded = pc.dictionary_encode(arr.cast(pa.string()), null_encoding="mask")
        dictionary = encoded.dictionary
        order = pc.array_sort_indices(dictionary).to_numpy()
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        codes = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        codes = rank[codes] if len(rank) else np.zeros(len(arr), np.int64)
        values = _tensor(codes.astype(np.int64))
        return Column(values, "str", valid=valid, dictionary=dictionary.take(order), name=name)
    if pa.types.is_date(t):
        kind, arr = "date", arr.cast(pa.date32()).cast(pa.int32())
    elif pa.types.is_timestamp(t):
        kind, arr = "timestamptz" if t.tz else "timestamp", _microseconds(arr, name)
    elif pa.types.is_boolean(t):
        kind = "bool"
    elif pa.types.is_integer(t):
        largest = pc.max(arr).as_py() if t == pa.uint64() else None
        if largest is not None and largest > 2**63 - 1:
            raise OverflowError(
                f"column '{name}' (uint64) holds {largest}, past the largest value of int "
                "columns (2**63 - 1): cast it to float64 first")
        kind, arr = "int", arr.cast(pa.int64())
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        kind, arr = "float", arr.cast(pa.float64())
    else:
        hint = ("it holds only nulls: cast it to the type it stands for"
                if pa.types.is_null(t) else
                "use int, float, decimal, bool, date, timestamp or string columns")
        raise TypeError(f"column '{name}' has Arrow type {t}, which tables do not support: "
                        f"{hint}")
    filled = arr.fill_null(False if kind == "bool" else 0) if arr.null_count else arr
    values = _tensor(filled.to_numpy(zero_copy_only=False).copy())
    return Column(values, kind, valid=valid, name=name)


def _microseconds(arr: pa.Array, name: str) -> pa.Array:
    """A timestamp array as int64 microseconds since 1970 (UTC instants where it has a
    time zone); an error where that would drop nanoseconds or overflow."""
    try:
        return arr.cast(pa.timestamp("us", arr.type.tz)).cast(pa.int64())
    except pa.ArrowInvalid as e:
        raise ValueError(f"column '{name}' ({arr.type}) does not fit in timestamp columns, "
                         f"which hold microseconds: {e}; round it to microseconds first "
                         "(pyarrow.compute.floor_temporal)") from None


def column_from_values(values, name: str) -> Column:
    """A column from a tensor, NumPy array, list or pandas Series."""
    if isinstance(values, Column):
        if values.dims or values._is_scalar():
            raise ValueError(
                f"column '{name}' is {values.describe()}: a table takes positional 1-D "
                "columns; call .order(dim) on a column bound to a dim first"
            )
        return values.rebound(name=name)
    if isinstance(values, torch.Tensor):
        if values.ndim != 1:
            raise ValueError(f"column '{name}' must be 1-D, got a tensor of shape "
                             f"{tuple(values.shape)}")
        if values.dtype == torch.bool:
            kind = "bool"
        elif values.is_floating_point():
            kind, values = "float", values.double()
        elif values.is_complex():
            raise TypeError(f"column '{name}' is a {values.dtype} tensor, which tables do not "
                            "support: use int, float or bool tensors")
        else:
            if values.dtype == torch.uint64 and bool((values.view(torch.int64) < 0).any()):
                raise OverflowError(f"column '{name}' (torch.uint64) holds values past the "
                                    "largest of int columns (2**63 - 1): use float64 values")
            kind, values = "int", values.long()
        return Column(values, kind, name=name)
    try:
        array = pa.array(values)
    except (pa.ArrowException, OverflowError) as e:
        raise type(e)(f"column '{name}': {e}") from e
    return column_from_arrow(array, name)
