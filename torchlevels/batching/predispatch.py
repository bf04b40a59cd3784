"""Ops a vmap level must see before PyTorch decomposes them or passes them by.

Subclass dispatch sees only ops that take a level's tensor, and only after composite
ops have decomposed. Two kinds of op need more: random ops (``torch.randn(3)`` takes no
tensor at all) and composite ops that batch better whole than decomposed (``F.linear``
on a batched vector becomes view + addmm + view). While a vmap level is live, PyTorch's
``PreDispatch`` key is in this thread's dispatch set: it falls through for every op but
those registered here, the way functorch uses its ``FuncTorchVmapMode`` key.
"""

from __future__ import annotations

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

    A class rather than a generator: it runs on every vmap call.
    """

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = torch._C._dispatch_tls_is_dispatch_key_included(_PRE_DISPATCH)
        torch._C._dispatch_tls_set_dispatch_key_included(_PRE_DISPATCH, True)

    def __exit__(self, *exc: object) -> None:
        torch._C._dispatch_tls_set_dispatch_key_included(_PRE_DISPATCH, self.before)
