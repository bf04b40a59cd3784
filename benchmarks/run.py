"""Run the benchmarks and write BENCHMARKS.md: ``make bench`` or ``python -m benchmarks.run``.

Options: ``--groups overhead mlp`` runs only those groups; ``--budget 5`` caps the timing
seconds per benchmark; ``--threads 2`` sets torch's intra-op threads (default 1);
``--no-write`` prints without rewriting BENCHMARKS.md. ``--device cuda`` runs the groups on
a GPU (every tensor they make is made there, every timed call ends with a synchronize) and
writes benchmarks/cuda.json, which BENCHMARKS.md's GPU section is made from.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from benchmarks import report
from benchmarks.groups import GROUPS, TORCH_FUNC, TORCHLEVELS, Benchmark
from benchmarks.report import Result
from benchmarks.timing import time_interleaved
from torchlevels import LevelTensor
from torchlevels.batching.registry import How, resolve
from torchlevels.batching.shortcuts import SHORTCUTS


@contextlib.contextmanager
def _recording_level_ops() -> Iterator[dict]:
    """Record every op reaching a torchlevels level (decomposition pieces included)."""
    seen: dict = {}
    hook = LevelTensor.__dict__.get("__torch_dispatch__")
    if not isinstance(hook, classmethod):  # the core changed shape: record nothing
        yield seen
        return
    original = hook.__func__

    def recording(cls, func, types, args=(), kwargs=None):
        seen[func] = None
        return original(cls, func, types, args, kwargs)

    LevelTensor.__torch_dispatch__ = classmethod(recording)
    try:
        yield seen
    finally:
        LevelTensor.__torch_dispatch__ = classmethod(original)


@contextlib.contextmanager
def _recording_shortcuts() -> Iterator[dict]:
    """Record every call a vmap shortcut answered (before the dispatcher)."""
    taken: dict = {}
    original = dict(SHORTCUTS)

    def recording(shortcut):
        def run(cls, func, args, kwargs):
            out = shortcut(cls, func, args, kwargs)
            if out is not None:
                taken[func] = None
            return out
        return run

    SHORTCUTS.update({func: recording(s) for func, s in original.items()})
    try:
        yield taken
    finally:
        SHORTCUTS.update(original)


def _call_name(func) -> str:
    name = getattr(func, "__name__", str(func))
    for prefix, namespace in (("torch.", torch), ("Tensor.", torch.Tensor), ("F.", F)):
        if getattr(namespace, name, None) is func:
            return prefix + name
    return name


def describe_batching(benchmark: Benchmark) -> dict[str, str]:
    """For each call a vmap shortcut answered, and each op reaching the torchlevels level,
    how it was batched."""
    with warnings.catch_warnings(), _recording_shortcuts() as taken, \
            _recording_level_ops() as seen:
        warnings.simplefilter("ignore")
        benchmark.impls[TORCHLEVELS]()
    out = {_call_name(func): "shortcut" for func in taken}
    for func in seen:
        resolved = resolve(func)
        family = f" ({resolved.family})" if resolved.how is How.FAMILY else ""
        out[str(func)] = resolved.how.value + family
    return out


def check(benchmark: Benchmark) -> None:
    """Raise if torchlevels (or any reference implementation) disagrees with torch.func."""
    expected = benchmark.impls[TORCH_FUNC]()
    with warnings.catch_warnings():
        # slow-loop warnings: reported via describe_batching; Opacus' hook warnings
        warnings.simplefilter("ignore")
        got = benchmark.impls[TORCHLEVELS]()
        torch.testing.assert_close(got, expected, msg=lambda m: f"{benchmark.name}: "
                                   f"torchlevels differs from torch.func: {m}")
        for name, impl in benchmark.impls.items():
            if name not in (TORCH_FUNC, TORCHLEVELS):  # the references (REFERENCES)
                torch.testing.assert_close(impl(), expected, rtol=1e-4, atol=1e-4,
                                           msg=lambda m, name=name: f"{benchmark.name}: "
                                           f"{name} differs: {m}")


def _synchronized(impls: dict[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """Each call followed by a wait for the GPU, so a time per call is the GPU's work too."""
    return {name: (lambda fn=fn: (fn(), torch.cuda.synchronize())[0])
            for name, fn in impls.items()}


def run_benchmark(benchmark: Benchmark, budget_s: float) -> Result:
    """Check, then time one benchmark (on torch's default device)."""
    check(benchmark)
    batching = describe_batching(benchmark)
    impls = benchmark.impls
    if torch.get_default_device().type == "cuda":
        impls = _synchronized(impls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timings = time_interleaved(impls, budget_s=budget_s)
    return Result(benchmark, timings, batching)


def main(argv: list[str] | None = None) -> None:
    """Run the selected groups, print each result as it lands, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    parser.add_argument("--budget", type=float, default=12.0,
                        help="timing seconds per benchmark (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default %(default)s: on a small shared "
                        "machine one thread gives far steadier timings)")
    parser.add_argument("--no-write", action="store_true", help="do not rewrite BENCHMARKS.md")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the groups run (default %(default)s); cuda writes "
                        "benchmarks/cuda.json, not BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.set_default_device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 as on the CPU, both sides
        torch.backends.cudnn.allow_tf32 = False

    torch.set_num_threads(args.threads)
    info = report.machine()
    print("  ".join(f"{k}: {v}" for k, v in info.items()), file=sys.stderr)
    results: dict[str, list[Result]] = {}
    for key in args.groups:
        group = GROUPS[key]
        print(f"{group.title}:", file=sys.stderr, flush=True)
        results[key] = []
        torch.set_num_threads(group.threads or args.threads)
        for benchmark in group.build():
            result = run_benchmark(benchmark, args.budget)
            results[key].append(result)
            print(report.progress_line(result, group.labels), file=sys.stderr, flush=True)
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        report.write_device(results, GROUPS, info)
    elif not args.no_write:
        report.write(results, GROUPS, info)


if __name__ == "__main__":
    main()
