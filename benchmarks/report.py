"""Writing the results: BENCHMARKS.md and one bar chart per group."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.groups import (
    FLOOR,
    FUNCTION_FLOOR,
    IMPL_COLORS,
    PLAIN,
    REFERENCES,
    TORCH_FUNC,
    TORCHLEVELS,
    TWO_LEVEL_FLOOR,
    Benchmark,
    Group,
)
from benchmarks.timing import Timing

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "make bench"
DEVICE_RESULTS = ROOT / "benchmarks" / "cuda.json"  # written by `benchmarks.run --device cuda`
DEVICE_COMMAND = ("python -m benchmarks.run --device cuda --groups overhead mlp cnn "
                  "grad_overhead mlp_grad cnn_grad hessian attention")


@dataclass
class Result:
    """The timings of one benchmark and how torchlevels batched its ops."""

    benchmark: Benchmark
    timings: dict[str, Timing]
    batching: dict[str, str] = field(default_factory=dict)  # aten op -> how

    @property
    def ratio(self) -> float:
        return self.timings[TORCHLEVELS].median / self.timings[TORCH_FUNC].median

    @property
    def met(self) -> bool | None:
        target = self.benchmark.target
        return None if target is None else self.ratio <= target


def machine() -> dict[str, str]:
    """What the benchmarks ran on."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "Python": platform.python_version(),
        "OS": platform.platform(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load average at start (1, 5, 15 min)": load,
        **({"GPU": torch.cuda.get_device_name()}
           if torch.get_default_device().type == "cuda" else {}),
        **({"commit": os.environ["TORCHLEVELS_COMMIT"]}
           if "TORCHLEVELS_COMMIT" in os.environ else {}),
    }


def fmt_time(seconds: float) -> str:
    """A duration with a unit that keeps 3 significant figures readable."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def references(results: list[Result]) -> list[str]:
    """The reference implementations timed in any of ``results``, in REFERENCES order."""
    return [name for name in REFERENCES if any(name in r.timings for r in results)]


def columns(results: list[Result]) -> list[str]:
    """Every implementation timed in ``results``: the plain reference first, then
    torch.func and torchlevels, then the other references."""
    refs = references(results)
    return ([PLAIN] if PLAIN in refs else []) + [TORCH_FUNC, TORCHLEVELS] + [
        name for name in refs if name != PLAIN]


def progress_line(result: Result, labels: tuple[str, str] = (TORCH_FUNC, TORCHLEVELS)) -> str:
    """One line for the terminal as a benchmark finishes (``labels``: the group's names
    for the anchor and torchlevels columns)."""
    t = result.timings
    met = {True: "met", False: "NOT met", None: "no target"}[result.met]
    label = dict(zip((TORCH_FUNC, TORCHLEVELS), labels))
    times = "  ".join(f"{label.get(name, name)} {fmt_time(t[name].median)}"
                      for name in columns([result]))
    return (f"  {result.benchmark.name}: {times}  "
            f"ratio {result.ratio:5.2f} (target {result.benchmark.target}: {met})")


def plot_group(key: str, group: Group, results: list[Result]) -> Path:
    """A horizontal bar chart of median time per call for each implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = columns(results)
    longest = max(t.median for r in results for t in r.timings.values())
    scale, unit = (1e3, "ms") if longest >= 0.01 else (1e6, "µs")
    height = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.3 * len(impls) * len(results)))
    for j, impl in enumerate(impls):
        rows = [(i, r.timings[impl].median * scale) for i, r in enumerate(results)
                if impl in r.timings]  # a reference may be missing from some rows
        ys = [i + (j - (len(impls) - 1) / 2) * height for i, _ in rows]
        us = [u for _, u in rows]
        label = dict(zip((TORCH_FUNC, TORCHLEVELS), group.labels)).get(impl, impl)
        bars = ax.barh(ys, us, height, label=label, color=IMPL_COLORS[impl])
        ax.bar_label(bars, labels=[fmt_time(u / scale) for u in us], padding=3, fontsize=8)
    ax.set_yticks(range(len(results)))
    ax.set_yticklabels(
        [f"{r.benchmark.name}\nratio {r.ratio:.2f}" for r in results], fontsize=8
    )
    ax.invert_yaxis()
    ax.set_xlabel(f"median time per call ({unit})")
    ax.set_xlim(0, 1.3 * longest * scale)
    ax.set_title(group.title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(impls), fontsize=8)
    fig.tight_layout()
    path = ROOT / "benchmarks" / f"{key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(results: dict[str, list[Result]], groups: dict[str, Group], info: dict) -> str:
    """The markdown of BENCHMARKS.md."""
    lines = [
        "# Benchmarks: torchlevels against torch.func",
        "",
        f"Regenerate with `{COMMAND}` (runs `.venv/bin/python -m benchmarks.run`, which "
        "rewrites this file and the charts under `benchmarks/`).",
        "",
        "## Method",
        "",
        "All implementations run in one process. Before timing, the output of torchlevels "
        "and of every reference implementation is checked against torch.func with "
        "`assert_close`, so a broken implementation cannot post a good time. Each "
        "implementation is warmed up, then "
        "timed in rounds: one block of calls (about 20 ms) per implementation per round, "
        "rotating and reversing the order every round so drift of the machine hits all "
        "alike. Reported: the median time per call over the rounds; ratio = "
        "median(torchlevels) / median(torch.func). Lower is better; the anchor is torch.func. "
        "The garbage collector stays on, as in real use.",
        "",
        "Reference implementations, shown as extra columns (time, and in brackets its ratio "
        "to torch.func) and bars where a group has them:",
        "",
        *(f"- {name}: {ref.note}." for name, ref in REFERENCES.items()),
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items()),
        "",
        "## Summary",
        "",
        "| group | benchmark | ratio | target | met? |",
        "|---|---|---:|---:|---|",
    ]
    for key, group_results in results.items():
        for r in group_results:
            lines.append(f"| {groups[key].title} | {r.benchmark.name} | {r.ratio:.2f} | "
                         f"{_target(r)} | {_met(r)} |")
    for key, group_results in results.items():
        group = groups[key]
        refs = references(group_results)
        lines += [
            "",
            f"## {group.title}",
            "",
            group.description,
            "",
            f"| benchmark | {group.labels[0]} median | {group.labels[1]} median | ratio | "
            "target | met? |"
            + "".join(f" {name} |" for name in refs),
            "|---|---:|---:|---:|---:|---|" + "---:|" * len(refs),
        ]
        for r in group_results:
            lines.append(
                f"| {r.benchmark.name} | {fmt_time(t_func(r))} | {fmt_time(t_ours(r))} | "
                f"{r.ratio:.2f} | {_target(r)} | {_met(r)} |"
                + "".join(f" {_ref_cell(r, name)} |" for name in refs)
            )
        lines += ["", f"![{group.title}](benchmarks/{key}.png)", ""]
        for r in group_results:
            rounds = len(r.timings[TORCH_FUNC].per_call)
            noise = ", ".join(f"{k} {v.spread:.0%}" for k, v in r.timings.items())
            lines.append(f"- {r.benchmark.name}: {rounds} rounds; interquartile spread / "
                         f"median: {noise}.")
            if FLOOR in r.timings and FUNCTION_FLOOR in r.timings:
                floor, function_floor = r.timings[FLOOR].median, r.timings[FUNCTION_FLOOR].median
                lines.append(
                    f"  The floors: a minimal `__torch_dispatch__` wrapper that only unwraps, "
                    f"calls and rewraps (no levels, no rule lookup; `_MinimalBatched` in "
                    f"benchmarks/groups.py) takes {fmt_time(floor)}, "
                    f"{floor / t_func(r):.2f}x torch.func; the same in `__torch_function__`, "
                    f"before the dispatcher (`_MinimalFunction`), takes "
                    f"{fmt_time(function_floor)}, {function_floor / t_func(r):.2f}x torch.func "
                    f"(same rounds). Any design that handles each call in Python pays at "
                    f"least the second. torchlevels answers these calls with its shortcuts, "
                    f"in `__torch_function__`: {t_ours(r) / function_floor:.2f}x that floor."
                )
            if TWO_LEVEL_FLOOR in r.timings:
                floor = r.timings[TWO_LEVEL_FLOOR].median
                lines.append(
                    f"  The floor: two minimal `__torch_dispatch__` levels, a grad level "
                    f"recording autograd over a pass-through one (`_RecordingLevel` over "
                    f"`_PassThrough` in benchmarks/groups.py), take {fmt_time(floor)}, "
                    f"{floor / t_func(r):.2f}x torch.func (same rounds). Any design with two "
                    f"Python levels per op pays at least that; torchlevels takes "
                    f"{t_ours(r) / floor:.2f}x that floor."
                )
            others = [n for n in r.timings if n in REFERENCES
                      and n not in (PLAIN, FLOOR, FUNCTION_FLOOR, TWO_LEVEL_FLOOR)]
            if others:
                vs = ", ".join(f"{t_ours(r) / r.timings[n].median:.2f}x {n}" for n in others)
                lines.append(f"  torchlevels against the other references: {vs} "
                             "(below 1: torchlevels is faster).")
            lines += [f"  {note}" for note in r.benchmark.notes]
            if r.batching:
                how = "; ".join(f"`{op}` {h}" for op, h in r.batching.items())
                lines.append(f"  How torchlevels batched the calls and ops reaching its level: "
                             f"{how}.")
    if DEVICE_RESULTS.exists():
        lines += device_section(json.loads(DEVICE_RESULTS.read_text()))
    return "\n".join(lines) + "\n"


def device_section(saved: dict) -> list[str]:
    """BENCHMARKS.md's section on the last GPU run (benchmarks/cuda.json), and its chart."""
    lines = [
        "",
        "## On a GPU",
        "",
        "Some of the groups above, timed on a GPU by "
        f"`TORCHLEVELS_COMMIT=$(git rev-parse --short HEAD) {saved.get('command', DEVICE_COMMAND)}`"
        " (CI and this machine have none; this section is rewritten from benchmarks/cuda.json, "
        "which that command writes). Same method as above; every timed call ends with "
        "`torch.cuda.synchronize()`, so a time per call includes the GPU's work, and TF32 "
        "is off on both sides. The torch there is the GPU machine's own, not the pinned one. "
        "At these sizes the GPU runs each kernel in microseconds, so these rows weigh the "
        "Python cost per op more than the CPU rows do; they are a record, not a target.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in saved["machine"].items()),
        "",
        "| group | benchmark | torch.func median | torchlevels median | ratio | target | "
        "plain (no vmap) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in saved["rows"]:
        t = row["medians"]
        plain = fmt_time(t[PLAIN]) if PLAIN in t else "—"
        target = "—" if row["target"] is None else f"<= {row['target']}"
        lines.append(f"| {row['group']} | {row['name']} | {fmt_time(t[TORCH_FUNC])} | "
                     f"{fmt_time(t[TORCHLEVELS])} | {t[TORCHLEVELS] / t[TORCH_FUNC]:.2f} | "
                     f"{target} | {plain} |")
    lines += ["", "![On a GPU](benchmarks/cuda.png)", ""]
    return lines


def plot_device(saved: dict) -> Path:
    """A bar chart of the GPU run's ratios to torch.func, with each row's target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = saved["rows"]
    ratios = [r["medians"][TORCHLEVELS] / r["medians"][TORCH_FUNC] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.3 * len(rows)))
    bars = ax.barh(range(len(rows)), ratios, color=IMPL_COLORS[TORCHLEVELS])
    ax.bar_label(bars, labels=[f"{x:.2f}" for x in ratios], padding=3, fontsize=8)
    targets = [(i, r["target"]) for i, r in enumerate(rows) if r["target"] is not None]
    ax.scatter([t for _, t in targets], [i for i, _ in targets], marker="|", s=200,
               color="black", label="target", zorder=3)
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median time per call, torchlevels / torch.func (lower is better)")
    ax.set_title(f"On a GPU ({saved['machine'].get('GPU', '?')})")
    ax.set_xlim(0, 1.15 * max(ratios + [t for _, t in targets]))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8)
    fig.tight_layout()
    path = ROOT / "benchmarks" / "cuda.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def t_func(r: Result) -> float:
    return r.timings[TORCH_FUNC].median


def t_ours(r: Result) -> float:
    return r.timings[TORCHLEVELS].median


def _ref_cell(r: Result, name: str) -> str:
    if name not in r.timings:
        return "—"
    t = r.timings[name].median
    return f"{fmt_time(t)} ({t / t_func(r):.2f}x)"


def _target(r: Result) -> str:
    return "—" if r.benchmark.target is None else f"<= {r.benchmark.target}"


def _met(r: Result) -> str:
    return {True: "yes", False: "**no**", None: "—"}[r.met]


def write(results: dict[str, list[Result]], groups: dict[str, Group], info: dict) -> Path:
    """Write BENCHMARKS.md and the charts; return the markdown's path."""
    for key, group_results in results.items():
        plot_group(key, groups[key], group_results)
    if DEVICE_RESULTS.exists():
        plot_device(json.loads(DEVICE_RESULTS.read_text()))
    path = ROOT / "BENCHMARKS.md"
    path.write_text(render(results, groups, info))
    print(f"wrote {path} and benchmarks/*.png", file=sys.stderr)
    return path


def write_device(results: dict[str, list[Result]], groups: dict[str, Group],
                 info: dict) -> Path:
    """Write a GPU run's medians to benchmarks/cuda.json, for BENCHMARKS.md's GPU section
    (rewritten by the next ``make bench``)."""
    rows = [{"group": groups[key].title, "name": r.benchmark.name,
             "target": r.benchmark.target,
             "medians": {name: t.median for name, t in r.timings.items()}}
            for key, group_results in results.items() for r in group_results]
    command = "python -m benchmarks.run " + " ".join(sys.argv[1:])
    DEVICE_RESULTS.write_text(json.dumps({"machine": info, "command": command, "rows": rows},
                                         indent=1) + "\n")
    print(f"wrote {DEVICE_RESULTS}", file=sys.stderr)
    return DEVICE_RESULTS
