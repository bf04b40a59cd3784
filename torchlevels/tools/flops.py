"""Flop counting as a level: ``count_flops(f)`` and ``with count_flops() as FC``.

The formulas are PyTorch's own (``torch.utils.flop_counter``, including any registered
with ``register_flop_formula``), so the totals agree with ``FlopCounterMode``. Being a
level, the counter composes with every transform, and its position decides what it
counts: ``count_flops(vmap(grad(f)))`` counts the batched forward and backward ops that
run, ``vmap(count_flops(f))`` the per-example ops f asks for.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from torchlevels._level import enter_level
from torchlevels.tools.forwarding import (
    ForwardingLevel,
    call_in_level,
    wraps_function,
)

_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


@dataclass
class FlopCounts:
    """The counts of one run: FLOPs per op with a formula, calls per op, and the ops that
    ran with no formula (not counted, listed so no cost hides as a silent 0; views,
    which move no data, are left out of that list)."""

    by_op: dict[str, int] = field(default_factory=Counter)
    calls: dict[str, int] = field(default_factory=Counter)
    uncounted: dict[str, int] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def table(self) -> str:
        """Op, calls, FLOPs and share of the total, largest first; then the ops with no
        formula."""
        total = self.total
        rows = [f"{'op':<40} {'calls':>7} {'FLOPs':>17} {'share':>7}"]
        for op, flops in sorted(self.by_op.items(), key=lambda kv: -kv[1]):
            share = f"{100 * flops / total:.1f}%" if total else "-"
            rows.append(f"{op:<40} {self.calls[op]:>7} {flops:>17,} {share:>7}")
        rows.append(f"{'total':<40} {sum(self.calls[op] for op in self.by_op):>7} "
                     f"{total:>17,} {'100.0%' if total else '-':>7}")
        if self.uncounted:
            rows.append("no flop formula (not counted): " + ", ".join(
                f"{op} x{n}" for op, n in sorted(self.uncounted.items())))
        return "\n".join(rows)


@functools.cache
def _counted_by_pieces(func) -> bool:
    """As FlopCounterMode does: an op with no flop formula of its own but a composite
    kernel is counted as the ops it decomposes into (asked once per op)."""
    return func._overloadpacket not in flop_registry and func.has_kernel_for_dispatch_key(
        _COMPOSITE)


class FlopLevel(ForwardingLevel):
    """Counts the FLOPs of every op on its tensors with PyTorch's flop formulas."""

    kind = "count_flops"

    def __init__(self) -> None:
        super().__init__()
        self.counts = FlopCounts()

    def dispatch(self, cls, func, args, kwargs):
        if _counted_by_pieces(func):
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return super().dispatch(cls, func, args, kwargs)

    def process(self, func, args, kwargs):
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        name = str(packet)
        self.counts.calls[name] += 1
        formula = flop_registry.get(packet)
        if formula is None:
            if not func.is_view:  # a view moves no data: not worth listing
                self.counts.uncounted[name] += 1
        else:
            self.counts.by_op[name] += formula(*args, **kwargs, out_val=out)
        return out


class CountedFunction:
    """``count_flops(f)``: calls ``f`` in a fresh flop-counting level; after each call,
    ``total``, ``by_op``, ``calls``, ``uncounted`` and ``table()`` describe that call."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        self.counts = FlopCounts()
        wraps_function(func, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with count_flops() as FC:
            out = call_in_level(FC, self.func, args, kwargs)
        self.counts = FC.counts
        return out

    total = property(lambda self: self.counts.total)
    by_op = property(lambda self: self.counts.by_op)
    calls = property(lambda self: self.counts.calls)
    uncounted = property(lambda self: self.counts.uncounted)

    def table(self) -> str:
        return self.counts.table()


def count_flops(func: Callable | None = None) -> Any:
    """Count the FLOPs of ``func``'s ops, by op, with PyTorch's flop formulas.

    ``count_flops(f)`` returns a function that runs ``f`` in a fresh counting level and
    returns its outputs; after each call its ``total`` (int), ``by_op`` (aten op name ->
    FLOPs), ``calls`` (op -> number of calls) and ``uncounted`` (ops that ran with no
    flop formula -> calls) describe that call, and ``table()`` formats them. With no
    function it is a context manager yielding the level's class ``FC``: ``FC(x)`` marks
    an input, and ``FC.total``, ``FC.by_op``... hold the counts so far.

    Outside other transforms it counts the ops that physically run (batched, forward and
    backward): ``count_flops(vmap(grad(f)))``; inside it counts the per-example ops:
    ``vmap(count_flops(f))``. Ops on tensors that never met an input (a ``torch.ones``
    used alone) are not seen.

    Example::

        >>> import torch
        >>> from torchlevels import count_flops, grad
        >>> w, x = torch.randn(8, 4), torch.randn(4, 3)
        >>> cf = count_flops(grad(lambda w: (w @ x).sum()))
        >>> cf(w).shape
        torch.Size([8, 4])
        >>> cf.total  # forward mm (8x4 @ 4x3) + backward mm (8x3 @ 3x4): 2 * 96 each
        384
        >>> with count_flops() as FC:
        ...     y = FC(torch.randn(3, 5)) @ torch.randn(5, 2)
        >>> FC.by_op
        Counter({'aten.mm': 60})
    """
    if func is not None:
        return CountedFunction(func)
    return _counting_level()


@contextlib.contextmanager
def _counting_level() -> Iterator[type]:
    with enter_level(FlopLevel(), "FlopCountedTensor") as FC:
        counts = FC._level.counts
        FC.counts, FC.by_op, FC.calls = counts, counts.by_op, counts.calls
        FC.uncounted, FC.table, FC.total = counts.uncounted, staticmethod(counts.table), _Total()
        yield FC


class _Total:
    """``FC.total``: the running total of the level class ``FC``."""

    def __get__(self, obj, cls):
        return cls._level.counts.total
