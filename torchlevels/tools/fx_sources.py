"""The Python source torch.fx keeps of each module it compiles, dropped when unneeded.

torch.fx puts the source of every GraphModule's ``forward`` in ``linecache`` (for
tracebacks) and keeps it for the rest of the process, about 1 KB each, even after the
module is gone: ``trace(f)(x)`` called anew in a loop would grow the process by that
much per call. The sources of modules compiled only to read their graphs are dropped at
once; those of the modules handed out, when each module is freed.

Example::

    >>> import gc, linecache, torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> with sources_forgotten() as kept:
    ...     gm = make_fx(torch.sin)(torch.randn(3))
    ...     kept.append(gm)
    >>> key = type(gm).forward.__code__.co_filename
    >>> key in linecache.cache  # gm's source, for its tracebacks
    True
    >>> del gm; _ = gc.collect()
    >>> key in linecache.cache
    False
"""

from __future__ import annotations

import contextlib
import linecache
import weakref
from collections.abc import Iterator

from torch.fx import GraphModule
from torch.fx.graph_module import _loader

_FX_KEY = "<eval_with_key>"


@contextlib.contextmanager
def sources_forgotten() -> Iterator[list[GraphModule]]:
    """Drop the sources torch.fx keeps of the modules compiled in the block, except those
    of the modules appended to the list it yields, each dropped when its module is."""
    before = set(linecache.cache)
    kept: list[GraphModule] = []
    try:
        yield kept
    finally:
        keep = set()
        for gm in kept:
            key = type(gm).forward.__code__.co_filename
            keep.add(key)
            weakref.finalize(gm, _forget, key)
        kept.clear()  # (the list would keep them alive)
        for key in set(linecache.cache) - before - keep:
            if key.startswith(_FX_KEY):
                _forget(key)


def _forget(key: str) -> None:
    linecache.cache.pop(key, None)
    _loader.eval_cache.pop(key, None)
