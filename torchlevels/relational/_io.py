"""Columns from and to Arrow: the one place that knows Arrow's types.

Columns read from Arrow (and so from Parquet, CSV, pandas and lists) are made on torch's
default device.

Integers stay integers (int64), decimals and floats become float64, dates are int32
days since 1970-01-01, and strings are dictionary-encoded with a sorted dictionary.
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
    if pa.types.is_date(t) or pa.types.is_timestamp(t):
        kind, arr = "date", arr.cast(pa.date32()).cast(pa.int32())
    elif pa.types.is_boolean(t):
        kind = "bool"
    elif pa.types.is_integer(t):
        kind, arr = "int", arr.cast(pa.int64())
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        kind, arr = "float", arr.cast(pa.float64())
    else:
        raise TypeError(f"column '{name}' has Arrow type {t}, which tables do not support: "
                        "use int, float, decimal, bool, date or string columns")
    filled = arr.fill_null(False if kind == "bool" else 0) if arr.null_count else arr
    values = _tensor(filled.to_numpy(zero_copy_only=False).copy())
    return Column(values, kind, valid=valid, name=name)


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
        else:
            kind, values = "int", values.long()
        return Column(values, kind, name=name)
    return column_from_arrow(pa.array(values), name)
