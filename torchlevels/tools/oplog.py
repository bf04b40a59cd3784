"""Op logging as a level: ``log_ops(f)`` prints each aten op as its position sees it.

Outside ``vmap`` a line shows the batched shapes that run; inside, the per-example ones.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import torch

from torchlevels._level import enter_level
from torchlevels.tools.forwarding import (
    ForwardingLevel,
    call_in_level,
    wraps_function,
)

_SHORT_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32",
    torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def describe(a: Any) -> str:
    """A short text for an op argument: ``f32[8, 16]`` for a tensor, repr otherwise."""
    if isinstance(a, torch.Tensor):
        dtype = _SHORT_DTYPES.get(a.dtype, str(a.dtype).removeprefix("torch."))
        device = "" if a.device.type == "cpu" else f"@{a.device}"
        return f"{dtype}[{', '.join(map(str, a.shape))}]{device}"
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        inner = ", ".join(describe(t) for t in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    text = repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


class LogLevel(ForwardingLevel):
    """Writes one line per op on its tensors: the op, its arguments, its outputs."""

    kind = "log_ops"

    def __init__(self, file: TextIO | None = None) -> None:
        super().__init__()
        self.file = file

    def process(self, func, args, kwargs):
        out = func(*args, **kwargs)
        shown = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
        print(f"{func}({', '.join(shown)}) -> {describe(out)}",
              file=self.file or sys.stdout)
        return out


def log_ops(func: Callable | None = None, file: TextIO | None = None) -> Any:
    """Print each aten op ``func`` runs, with input and output shapes and dtypes as seen
    at this position among the transforms; one line per op, to ``file`` (stdout).

    ``log_ops(f)`` returns a function that runs ``f`` in a fresh logging level. With no
    function it is a context manager yielding the level's class ``L``: ``L(x)`` marks an
    input whose ops (and those of everything computed from it) are printed.

    Example::

        >>> import torch
        >>> from torchlevels import log_ops, vmap
        >>> _ = log_ops(vmap(torch.sin))(torch.zeros(5, 3))   # outside: the batched op
        aten.sin.default(f32[5, 3]) -> f32[5, 3]
        >>> _ = vmap(log_ops(torch.sin))(torch.zeros(5, 3))   # inside: one example's
        aten.sin.default(f32[3]) -> f32[3]
    """
    if func is None:
        return enter_level(LogLevel(file), "LoggedTensor")

    def logged(*args: Any, **kwargs: Any) -> Any:
        with enter_level(LogLevel(file), "LoggedTensor") as L:
            return call_in_level(L, func, args, kwargs)

    return wraps_function(func, logged)
