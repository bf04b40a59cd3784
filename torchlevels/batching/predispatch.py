"""Ops a vmap level must see before PyTorch decomposes them or passes them by.

Subclass dispatch sees only ops that take a level's tensor, and only after composite
ops have decomposed. Two kinds of op need more: random ops (``torch.randn(3)`` takes no
tensor at all) and composite ops that batch better whole than decomposed (``F.linear``
on a batched vector becomes view + addmm + view). While a vmap level is live, PyTorch's
``PreDispatch`` key is in this thread's dispatch set: it falls through for every op but
those registered here, the way functorch uses its ``FuncTorchVmapMode`` key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch
_ONLY_PRE_DISPATCH = torch._C.DispatchKeySet(_PRE_DISPATCH)
_library = torch.library.Library("aten", "IMPL")  # kept alive for the process

Handler = Callable[[OpOverload, tuple, dict], Any]


def intercept(op: OpOverload, handler: Handler) -> None:
    """While a vmap level is live, calls of ``op`` go to ``handler(op, args, kwargs)``."""
    _library.impl(op, lambda *args, **kwargs: handler(op, args, kwargs), "PreDispatch")


def passed_by(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` as if it had not been intercepted (and nothing inside it will be)."""
    with torch._C._ExcludeDispatchKeyGuard(_ONLY_PRE_DISPATCH):
        return op(*args, **kwargs)


def unintercepted() -> torch._C._ExcludeDispatchKeyGuard:
    """A context in which no op is intercepted."""
    return torch._C._ExcludeDispatchKeyGuard(_ONLY_PRE_DISPATCH)


class hook:  # lower case: used like a function, `with hook()`
    """Route intercepted ops through their handlers while the block runs (this thread).

    The key is per thread, and blocks may end out of order (asyncio tasks, levels entered
    by hand in generators): it stays on until the thread's last block ends. Handlers pass
    ops by where no level is live in their context. A class rather than a generator: it
    runs on every vmap call.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        blocks = getattr(_thread, "blocks", 0)
        if not blocks:
            _thread.before = torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)
            torch._C._dispatch_tls_set_dispatch_key_included(_PRE_DISPATCH, True)
        _thread.blocks = blocks + 1

    def __exit__(self, *exc: object) -> None:
        _thread.blocks -= 1
        if not _thread.blocks:
            torch._C._dispatch_tls_set_dispatch_key_included(_PRE_DISPATCH, _thread.before)


_thread = threading.local()  # this thread's blocks, and the key's state before the first
