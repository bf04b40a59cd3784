"""Differential fuzzer: a chain of views, then an in-place write through the last one.

Each case draws an example shape, up to three views (narrow, select, diagonal, unfold,
expand, permute, unflatten, ...) and one write (``add_``, ``fill_``, ``copy_``,
``index_put_``, ``scatter_``, ...), then runs the function under a transform:

- ``vmap`` over any dim, nested vmap, and ``vmap(grad)``, against a Python loop over the
  examples (and, for writes into the inputs, the inputs the loop leaves behind);
- ``grad``, ``grad(grad)``, ``jacrev``, ``jacfwd``, ``jvp``, ``hessian`` and their ``vmap``s,
  against torch.func on the same function (cases torch.func refuses are skipped).

Windows that overlap (``unfold`` with a step below its size) are left out: a write
through them is ill-defined, and forward and reverse mode disagree there in PyTorch too.

Usage: ``.venv/bin/python scripts/fuzz_view_writes.py --cases 2000 --start 0``. It prints
progress, each mismatch with the seed that replays it (``--cases 1 --start SEED``), and
exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import random
import sys
import warnings
from collections import Counter
from collections.abc import Callable

import torch
import torch.func as ft

import torchlevels as tl

DTYPE = torch.float64
View = tuple[str, Callable[[torch.Tensor], torch.Tensor]]


def random_view(rng: random.Random, t: torch.Tensor) -> View | None:
    """A view of a tensor shaped like ``t``, or None if the draw does not fit it."""
    r = t.dim()
    if r == 0:
        return rng.choice([("unsqueeze(0)", lambda x: x.unsqueeze(0)),
                           ("expand(2)", lambda x: x.expand(2))])
    d = rng.randrange(r)
    n = t.shape[d]
    kind = rng.choice(["flat", "narrow", "select", "unsqueeze", "transpose", "permute",
                       "unflatten", "expand", "diagonal", "unfold", "movedim", "split"])
    if kind == "flat":
        return "view(-1)", lambda x: x.view(-1)
    if kind == "narrow" and n:
        s = rng.randrange(n)
        length = rng.randrange(n - s + 1)
        return f"narrow({d},{s},{length})", lambda x: x.narrow(d, s, length)
    if kind == "select" and n:
        i = rng.randrange(-n, n)
        return f"select({d},{i})", lambda x: x.select(d, i)
    if kind == "unsqueeze":
        u = rng.randrange(-r - 1, r + 1)
        return f"unsqueeze({u})", lambda x: x.unsqueeze(u)
    if kind == "transpose":
        a, b = rng.randrange(-r, r), rng.randrange(-r, r)
        return f"transpose({a},{b})", lambda x: x.transpose(a, b)
    if kind == "permute":
        p = rng.sample(range(r), r)
        return f"permute{p}", lambda x: x.permute(*p)
    if kind == "unflatten" and n:
        k = rng.choice([k for k in range(1, n + 1) if n % k == 0])
        return f"unflatten({d},({k},-1))", lambda x: x.unflatten(d, (k, -1))
    if kind == "expand":
        k = rng.randrange(1, 3)
        return f"expand({k},...)", lambda x: x.expand(k, *x.shape)
    if kind == "diagonal" and r >= 2:
        o = rng.randrange(-2, 3)
        a, b = rng.sample(range(r), 2)
        return f"diagonal({o},{a},{b})", lambda x: x.diagonal(o, a, b)
    if kind == "unfold" and n:
        size = rng.randrange(1, n + 1)
        step = rng.randrange(size, size + 2)  # no overlapping windows
        return f"unfold({d},{size},{step})", lambda x: x.unfold(d, size, step)
    if kind == "movedim":
        a = rng.randrange(r)
        return f"movedim({d},{a})", lambda x: x.movedim(d, a)
    if kind == "split" and n:
        k = rng.randrange(1, n + 1)
        i = rng.randrange((n + k - 1) // k)
        return f"split({k},{d})[{i}]", lambda x: x.split(k, d)[i]
    return None


def random_write(rng: random.Random, v: torch.Tensor) -> View:
    """An in-place write into a tensor shaped like ``v``; its constants are fixed here."""
    c = torch.randn(v.shape, dtype=DTYPE)
    row = torch.randn(v.shape[-1:], dtype=DTYPE)
    kinds = ["add_", "mul_", "copy_", "fill_", "zero_", "sin_", "addcmul_", "setitem",
             "clamp_"]
    if v.dim() and v.shape[0]:
        kinds += ["index_put_", "index_add_", "scatter_"]
    kind = rng.choice(kinds)
    simple = {
        "add_": lambda x: x.add_(c), "mul_": lambda x: x.mul_(c.cos()),
        "copy_": lambda x: x.copy_(row), "fill_": lambda x: x.fill_(1.5),
        "zero_": lambda x: x.zero_(), "sin_": lambda x: x.sin_(),
        "addcmul_": lambda x: x.addcmul_(c, c, value=0.5),
        "setitem": lambda x: x.__setitem__(..., c.exp()),
        "clamp_": lambda x: x.clamp_(min=-0.2),
    }
    if kind in simple:
        return kind, simple[kind]
    n = v.shape[0]
    index = torch.tensor([rng.randrange(n) for _ in range(rng.randrange(1, 3))])
    rows = c[:1].expand(len(index), *c.shape[1:]).clone()
    if kind == "index_put_":
        return kind, lambda x: x.index_put_((index,), rows * 2, accumulate=True)
    if kind == "index_add_":
        return kind, lambda x: x.index_add_(0, index, rows)
    scatter_index = torch.randint(0, n, v.shape)
    return kind, lambda x: x.scatter_(0, scatter_index, c)


class Case:
    """A shape, a chain of views and a write that works on a plain example."""

    def __init__(self, rng: random.Random) -> None:
        self.shape = tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 4)))
        probe = torch.zeros(self.shape, dtype=DTYPE)
        self.views: list[View] = []
        for _ in range(rng.randrange(1, 4)):
            view = random_view(rng, probe)
            if view is not None:
                self.views.append(view)
                probe = view[1](probe)
        self.write = random_write(rng, probe)
        self.function(clone=True)(torch.randn(self.shape, dtype=DTYPE))  # raises if invalid

    def function(self, clone: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """Writes into a clone of ``x`` (returned), or into ``x`` itself (returns a sum)."""
        def f(x):
            y = x.clone() if clone else x
            v = y
            for _, view in self.views:
                v = view(v)
            self.write[1](v)
            return y * 1.0 if clone else y.sum()
        return f

    def __str__(self) -> str:
        return (f"shape {self.shape}, views {[name for name, _ in self.views]}, "
                f"write {self.write[0]}")


def _scalar(f):
    return lambda x: (f(x) ** 2).sum() + (f(x.sin()) * x).sum()


AUTODIFF = {
    "grad": lambda L, f: L.grad(_scalar(f)),
    "grad(grad)": lambda L, f: L.grad(lambda x: L.grad(_scalar(f))(x).sum()),
    "jacrev": lambda L, f: L.jacrev(f),
    "jacfwd": lambda L, f: L.jacfwd(f),
    "jvp": lambda L, f: lambda x: L.jvp(f, (x,), (x.cos(),)),
    "hessian": lambda L, f: L.hessian(_scalar(f)),
    "jvp(grad)": lambda L, f: lambda x: L.jvp(L.grad(_scalar(f)), (x,), (x.cos(),)),
    "vmap(jvp)": lambda L, f: L.vmap(lambda x: L.jvp(f, (x,), (x.cos(),))),
    "vmap(jacrev)": lambda L, f: L.vmap(L.jacrev(f)),
    "vmap(jacfwd)": lambda L, f: L.vmap(L.jacfwd(f)),
    "vmap(hessian)": lambda L, f: L.vmap(L.hessian(_scalar(f))),
}
MODES = ["vmap", "vmap into inputs", "nested vmap", "vmap(grad)", *AUTODIFF]


def _run(fn: Callable) -> tuple[str, object]:
    try:
        return "ok", fn()
    except Exception as e:  # a fuzzer compares what each side raises too
        return "error", f"{type(e).__name__}: {str(e)[:200]}"


def _close(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a, b, atol=1e-6, equal_nan=True))
    return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
            and all(map(_close, a, b)))


def against_a_loop(case: Case, mode: str, rng: random.Random) -> tuple[tuple, tuple]:
    """(loop, torchlevels) results for the vmap modes."""
    batch = rng.randrange(1, 4)
    dim = rng.randrange(len(case.shape) + 1)
    x = torch.randn((batch, *case.shape), dtype=DTYPE).movedim(0, dim)
    if mode == "vmap into inputs":
        f = case.function(clone=False)

        def loop():
            xs = x.clone()
            return torch.stack([f(xs.select(dim, b)) for b in range(batch)]), xs

        def ours():
            xs = x.clone()
            return tl.vmap(f, in_dims=dim)(xs), xs

        return _run(loop), _run(ours)
    f = case.function(clone=True)
    if mode == "nested vmap":
        inner = rng.randrange(len(case.shape) + 1)
        x = torch.randn((batch, 2, *case.shape), dtype=DTYPE).movedim(1, inner + 1)
        x = x.movedim(0, dim)
        loop = lambda: torch.stack([  # noqa: E731
            torch.stack([f(x.select(dim, a).select(inner, b)) for b in range(2)])
            for a in range(batch)])
        return _run(loop), _run(lambda: tl.vmap(tl.vmap(f, in_dims=inner), in_dims=dim)(x))
    if mode == "vmap(grad)":
        loss = _scalar(f)

        def loop():
            grads = []
            for b in range(batch):
                xb = x.select(dim, b).detach().requires_grad_()
                grads.append(torch.autograd.grad(loss(xb), xb)[0])
            return torch.stack(grads)

        return _run(loop), _run(lambda: tl.vmap(tl.grad(loss), in_dims=dim)(x))
    return _run(lambda: torch.stack([f(x.select(dim, b)) for b in range(batch)])), _run(
        lambda: tl.vmap(f, in_dims=dim)(x))


def against_torch_func(case: Case, mode: str, rng: random.Random) -> tuple[tuple, tuple]:
    """(torch.func, torchlevels) results for the autodiff modes."""
    shape = ((rng.randrange(1, 4),) if mode.startswith("vmap") else ()) + case.shape
    x = torch.randn(shape, dtype=DTYPE)
    f = case.function(clone=True)
    return (_run(lambda: AUTODIFF[mode](ft, f)(x.clone())),
            _run(lambda: AUTODIFF[mode](tl, f)(x.clone())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--start", type=int, default=0, help="the first case's seed")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    counts: Counter = Counter()
    bad = 0
    for seed in range(options.start, options.start + options.cases):
        done = seed - options.start
        if done and done % 500 == 0:
            print(f"{done}/{options.cases} cases, {bad} mismatches", flush=True)
        rng = random.Random(seed)
        torch.manual_seed(seed)
        try:
            case = Case(rng)
        except Exception:  # the write does not apply to a plain example: no case
            continue
        mode = rng.choice(MODES)
        compare = against_torch_func if mode in AUTODIFF else against_a_loop
        reference, ours = compare(case, mode, rng)
        if reference[0] == "error" and mode in AUTODIFF:
            counts["torch.func refuses"] += 1
            continue
        if reference[0] != ours[0] or (ours[0] == "ok" and not _close(reference[1], ours[1])):
            bad += 1
            print(f"MISMATCH seed {seed} {mode}: {case}\n  reference {reference[0]} "
                  f"{reference[1] if reference[0] == 'error' else ''}\n  torchlevels "
                  f"{ours[0]} {ours[1] if ours[0] == 'error' else ''}")
        counts[f"both {ours[0]}" if reference[0] == ours[0] else "differ"] += 1
    print(dict(counts), f"mismatches: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
