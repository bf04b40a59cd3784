"""Which aten ops torchlevels' vmap batches, and how: writes docs/coverage.md.

Run ``python -m torchlevels.coverage`` (or ``make coverage``). It runs a few float32 CPU
sample inputs of every OpInfo in PyTorch's ``op_db`` under a dispatch mode that records
each aten overload reaching ``__torch_dispatch__`` (the ops a vmap level sees), asks the
batching registry how each one is batched, and ranks the ops by popularity from
``torch._functorch.top_operators_github_usage``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

import torchlevels.vmap  # noqa: F401  (registers every batching rule)
from torchlevels.batching.composite import composite_ops
from torchlevels.batching.registry import How, resolve

COMMAND = "python -m torchlevels.coverage"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
SAMPLES_PER_OP = 3
CATEGORY_ORDER = [How.OWN, How.FAMILY, How.DECOMPOSITION, How.LOOP]


class RecordOps(TorchDispatchMode):
    """A dispatch mode that records every aten overload it sees, then runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[OpOverload] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, OpOverload) and func.namespace == "aten":
            self.seen.add(func)
        return func(*args, **(kwargs or {}))


def collect(samples_per_op: int = SAMPLES_PER_OP, verbose: bool = True) -> dict[OpOverload, set]:
    """Map each aten overload seen running OpInfo samples to the OpInfo names that used it."""
    from torch.testing._internal.common_methods_invocations import op_db

    used_by: dict[OpOverload, set[str]] = defaultdict(set)
    start = time.perf_counter()
    for i, opinfo in enumerate(op_db, 1):
        name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
        for func in _ops_of(opinfo, samples_per_op):
            used_by[func].add(name)
        if verbose and (i % 50 == 0 or i == len(op_db)):
            print(
                f"  [{i:4d}/{len(op_db)}] {name:<40} {len(used_by):4d} aten ops so far "
                f"({time.perf_counter() - start:.0f}s)",
                file=sys.stderr, flush=True,
            )
    return used_by


def _ops_of(opinfo, samples_per_op: int) -> set[OpOverload]:
    """The aten overloads reached by the first few float32 CPU samples of ``opinfo``."""
    if torch.float32 not in opinfo.supported_dtypes("cpu"):
        return set()
    mode = RecordOps()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            samples = opinfo.sample_inputs("cpu", torch.float32, requires_grad=False)
            for n, sample in enumerate(samples):
                if n >= samples_per_op:
                    break
                try:
                    with mode:
                        opinfo.op(sample.input, *sample.args, **sample.kwargs)
                except Exception:
                    pass  # a sample may legitimately raise (e.g. error inputs); keep what ran
        except Exception:
            pass  # sample generation failed for this OpInfo on this build
    return mode.seen


@dataclass(frozen=True)
class Row:
    op: OpOverload
    how: How
    family: str
    public_name: str
    usage: int | None
    opinfos: int
    factory: bool


def takes_no_tensor(func: OpOverload) -> bool:
    """Whether ``func`` has no tensor argument (a factory): no vmap level ever sees it."""
    return not any("Tensor" in str(arg.type) for arg in func._schema.arguments)


def how_batched(func: OpOverload) -> tuple[How, str]:
    """How vmap batches ``func``: the registry's answer, and the family name for families."""
    resolved = resolve(func)
    return resolved.how, resolved.family


def popularity(func: OpOverload) -> tuple[str, int | None]:
    """The public name that ranks ``func`` in the GitHub usage data, and its count."""
    from torch._functorch.top_operators_github_usage import usage_count

    base = func.overloadpacket.__name__.rstrip("_")
    best: tuple[str, int | None] = (base, None)
    for name in (base, f"nn.functional.{base}"):
        count = usage_count.get(name)
        if count is not None and (best[1] is None or count > best[1]):
            best = (name, count)
    return best


def build_rows(used_by: dict[OpOverload, set]) -> list[Row]:
    """One row per op, ranked ops first by usage (descending), unranked alphabetically."""
    rows = []
    for func, opinfos in used_by.items():
        how, family = how_batched(func)
        public_name, usage = popularity(func)
        factory = takes_no_tensor(func)
        rows.append(Row(func, how, family, public_name, usage, len(opinfos), factory))
    rows.sort(key=lambda r: (r.usage is None, -(r.usage or 0), str(r.op)))
    return rows


def render(rows: list[Row], n_opinfos: int, samples_per_op: int) -> str:
    """The markdown of docs/coverage.md."""
    counts = Counter(r.how for r in rows)
    families = Counter(r.family for r in rows if r.how is How.FAMILY)
    ranked = [r for r in rows if r.usage is not None]
    lines = [
        "# vmap coverage: how torchlevels batches each aten op",
        "",
        f"Generated by `{COMMAND}` (or `make coverage`) on torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}. Do not edit by hand.",
        "",
        f"The ops are every aten overload reached by the first {samples_per_op} float32 CPU "
        f"sample inputs of each of the {n_opinfos} OpInfos in "
        "`torch.testing._internal.common_methods_invocations.op_db` (recorded with a "
        "`TorchDispatchMode`, so they are the ops a vmap level's `__torch_dispatch__` sees). "
        "\"How\" is `torchlevels.batching.registry.resolve(op).how` (with the family's name "
        "for family rules).",
        "",
        "Ordering: by usage count in `torch._functorch.top_operators_github_usage` (an op "
        "is matched by its packet name with trailing underscores stripped, as `name` or "
        "`nn.functional.name`), then unranked ops alphabetically.",
        "",
        "## Summary",
        "",
        "| how | ops | of the ranked ops |",
        "|---|---:|---:|",
    ]
    ranked_counts = Counter(r.how for r in ranked)
    for how in CATEGORY_ORDER:
        lines.append(f"| {how.value} | {counts[how]} | {ranked_counts[how]} |")
    lines.append(f"| **total** | **{len(rows)}** | **{len(ranked)}** |")
    lines += ["", "Family rules: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(families.items(), key=lambda kv: -kv[1])
    ) + ".", ""]
    factories = [r for r in rows if r.factory]
    lines += [
        f"{len(factories)} of the ops take no tensor argument (factories such as "
        "`aten.empty.memory_format`; marked *factory* below): no vmap level's "
        "`__torch_dispatch__` ever sees them (random factories are intercepted before "
        "dispatch instead, see `batching/predispatch.py`), so their \"how\" does not "
        "matter in practice.",
        "",
        "Composite ops never reach `__torch_dispatch__` whole, so they are not listed; "
        "those with a rule of their own, applied before they decompose "
        "(`batching/composite.py`): " + ", ".join(f"`{op}`" for op in composite_ops()) + ".",
        "",
    ]
    loops = [r for r in ranked if r.how is How.LOOP and not r.factory]
    if loops:
        lines += [
            "Most popular ops still on the slow loop: "
            + ", ".join(f"`{r.op}`" for r in loops[:15]) + ".",
            "",
        ]
    lines += [
        "## All ops",
        "",
        "| # | aten op | how | family | note | ranked as | usage | OpInfos using it |",
        "|---:|---|---|---|---|---|---:|---:|",
    ]
    for i, r in enumerate(rows, 1):
        usage = f"{r.usage:,}" if r.usage is not None else ""
        ranked_as = f"`{r.public_name}`" if r.usage is not None else ""
        lines.append(
            f"| {i} | `{r.op}` | {r.how.value} | {r.family} | {'factory' if r.factory else ''} | "
            f"{ranked_as} | {usage} | "
            f"{r.opinfos} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Collect the ops, classify them and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--samples", type=int, default=SAMPLES_PER_OP,
                        help="sample inputs run per OpInfo (default %(default)s)")
    args = parser.parse_args(argv)

    from torch.testing._internal.common_methods_invocations import op_db

    print(f"running {args.samples} samples of each of {len(op_db)} OpInfos...", file=sys.stderr)
    used_by = collect(args.samples)
    rows = build_rows(used_by)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render(rows, len(op_db), args.samples))
    counts = Counter(r.how for r in rows)
    summary = ", ".join(f"{how.value}: {counts[how]}" for how in CATEGORY_ORDER)
    print(f"wrote {args.output} ({len(rows)} ops; {summary})", file=sys.stderr)


if __name__ == "__main__":
    main()
