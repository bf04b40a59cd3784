"""Interleaved timing: every implementation of a benchmark is timed in the same process,
in alternating order, and summarized by the median time per call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Per-call times (seconds) of one implementation, one entry per timed block."""

    per_call: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.per_call)

    @property
    def spread(self) -> float:
        """The interquartile range relative to the median: a noise figure."""
        q1, _, q3 = statistics.quantiles(self.per_call, n=4)
        return (q3 - q1) / self.median


def calls_per_block(fn: Callable[[], object], block_s: float) -> int:
    """How many calls of ``fn`` fill about ``block_s`` seconds (at least 1)."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(1, min(10_000, round(block_s / max(once, 1e-7))))


def time_interleaved(
    impls: dict[str, Callable[[], object]],
    warmup: int = 5,
    rounds: int = 101,
    block_s: float = 0.02,
    budget_s: float = 12.0,
) -> dict[str, Timing]:
    """Time each zero-argument callable in ``impls`` and return its per-call timings.

    After ``warmup`` calls each, every round times one block of calls (about ``block_s``
    seconds) of each implementation, rotating the order every round so slow drift of the
    machine (other processes, frequency, caches) hits all implementations alike. Stops
    after ``rounds`` rounds, or earlier (but after at least 11) once ``budget_s`` is spent.
    """
    names = list(impls)
    for fn in impls.values():
        for _ in range(warmup):
            fn()
    blocks = {name: calls_per_block(fn, block_s) for name, fn in impls.items()}
    per_call: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        for name in order:
            fn, n = impls[name], blocks[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            per_call[name].append((time.perf_counter() - t0) / n)
        if r >= 10 and time.perf_counter() - start > budget_s:
            break
    return {name: Timing(times) for name, times in per_call.items()}
