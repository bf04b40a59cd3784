"""Embedding lookups summed over their index's dims run as one ``embedding_bag``.

``W[ids[b, s], f]`` is delayed: if ``.sum(s)`` or ``.mean(s)`` follows, the pair is
``F.embedding_bag`` (no (b, s, f) tensor is made); any other use runs the gather. Either
reads ``W`` and ``ids`` then, so if one was modified in place since the lookup was
written, it raises (see ``_ops.Delayed``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torchlevels.dim._dims import Dim
from torchlevels.dim._ops import Delayed, Tensor, find, wrap


class DelayedLookup(Delayed):
    """``table[ids, feature]``: rows of a plain 2-D ``table`` picked by ``ids``, a tensor
    with dims only, and its columns bound to the dim ``feature``."""

    __slots__ = ("_table", "_ids", "_feature", "_run")
    _what = ("a lookup table[ids, feature] (delayed to run a following .sum() or .mean() as "
             "an embedding_bag)")

    def __init__(self, table: torch.Tensor, ids: Tensor, feature: Dim, run) -> None:
        super().__init__((*ids._dims, feature), table, ids._tensor)
        self._table, self._ids, self._feature, self._run = table, ids, feature, run

    def _compute(self) -> torch.Tensor:
        return self._run()._tensor


# the table dtypes embedding_bag takes; other tables (integer ones) run the gather
_BAG_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def delayed(t: torch.Tensor, own: tuple, items: list, run) -> DelayedLookup | None:
    """A delayed lookup if ``t[items]`` is one (``run()`` computes it the usual way)."""
    if own or t.ndim != 2 or type(t) is not torch.Tensor or len(items) != 2 or \
            t.dtype not in _BAG_DTYPES:
        return None
    ids, feature = items
    if not (type(ids) is Tensor and type(feature) is Dim and ids.ndim == 0):
        return None
    if type(ids._tensor) is not torch.Tensor or ids._tensor.dtype not in (torch.int64,
                                                                           torch.int32):
        return None
    if find(ids._dims, feature) >= 0:
        return None
    feature.size = t.shape[1]
    return DelayedLookup(t, ids, feature, run)


def bag(x: DelayedLookup, summed: tuple, mode: str) -> Tensor | torch.Tensor | None:
    """``x.sum(summed)`` (or mean) as ``embedding_bag``; None (run the gather) if
    ``summed`` is not a set of the ids' dims, if there are no ids (an empty bag), or if
    embedding_bag rejects an id: negative ids count from the table's end in the gather,
    which also names any id that is out of range."""
    ids = x._ids
    at = [find(ids._dims, d) for d in summed]
    if not summed or min(at) < 0 or len(set(at)) != len(at) or ids._tensor.numel() == 0:
        return None
    kept = [k for k in range(len(ids._dims)) if k not in at]
    t = ids._tensor.permute(*kept, *at)
    if not t.is_cpu:  # only the CPU embedding_bag raises for a negative id: wrap them
        t = torch.where(t < 0, t + x._table.shape[0], t)
    rows = math.prod(t.shape[:len(kept)])
    try:
        out = F.embedding_bag(t.reshape(rows, -1), x._table, mode=mode)
    except RuntimeError:  # an id out of embedding_bag's range [0, rows of the table)
        return None
    kept_dims = tuple(ids._dims[k] for k in kept)
    return wrap(out.reshape(*(d.size for d in kept_dims), out.shape[-1]),
                (*kept_dims, x._feature))
