"""The benchmark groups: one function per group, each returning its benchmarks.

To add a group, write a function returning a list of :class:`Benchmark` and add a
:class:`Group` for it to ``GROUPS``. Every benchmark has three implementations of the
same computation: the plain batched call (no vmap, a reference), torch.func.vmap and
torchlevels.vmap, each a zero-argument callable with its inputs already bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torchlevels

PLAIN, TORCH_FUNC, TORCHLEVELS = "plain (no vmap)", "torch.func", "torchlevels"
FLOOR = "minimal subclass"  # optional: the cheapest possible per-op __torch_dispatch__


@dataclass(frozen=True)
class Benchmark:
    """One computation, three ways: ``impls`` maps PLAIN / TORCH_FUNC / TORCHLEVELS to calls."""

    name: str
    impls: dict[str, Callable[[], torch.Tensor]]
    target: float | None  # the largest acceptable torchlevels / torch.func ratio


@dataclass(frozen=True)
class Group:
    """A section of BENCHMARKS.md: a title, what it measures, and how to build it."""

    title: str
    description: str
    build: Callable[[], list[Benchmark]]


def _three_ways(name, fn, plain_fn, args, target, in_dims=0) -> Benchmark:
    """A benchmark of ``fn`` vmapped over ``args`` (built once) and ``plain_fn(*args)``."""
    tf = torch.func.vmap(fn, in_dims=in_dims)
    tl = torchlevels.vmap(fn, in_dims=in_dims)
    return Benchmark(name, {
        PLAIN: lambda: plain_fn(*args),
        TORCH_FUNC: lambda: tf(*args),
        TORCHLEVELS: lambda: tl(*args),
    }, target)


# -- (a) per-op overhead: a long chain of small pointwise ops ---------------------------

# Ten ops, repeated ten times; the mix keeps values bounded (exp only after tanh).
POINTWISE_OPS = [
    lambda x, y: torch.mul(x, y),
    lambda x, y: torch.sin(x),
    lambda x, y: torch.add(x, y),
    lambda x, y: torch.tanh(x),
    lambda x, y: torch.exp(x),
    lambda x, y: torch.sub(x, y),
    lambda x, y: torch.cos(x),
    lambda x, y: torch.sigmoid(x),
    lambda x, y: torch.mul(x, 0.5),
    lambda x, y: torch.maximum(x, y),
]


def pointwise_chain(x: torch.Tensor, y: torch.Tensor, length: int = 100) -> torch.Tensor:
    """``length`` pointwise ops (one aten op each) cycling through ``POINTWISE_OPS``."""
    for i in range(length):
        x = POINTWISE_OPS[i % len(POINTWISE_OPS)](x, y)
    return x


def overhead_group() -> list[Benchmark]:
    """(a) 100-op pointwise chain on (8, 16) inputs: measures dispatch overhead per op."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    bench = _three_ways("pointwise chain, 100 ops, (8, 16)", pointwise_chain, pointwise_chain,
                        (x, y), target=1.5)
    bench.impls[FLOOR] = lambda: _MinimalBatched.run(pointwise_chain, x, y)
    return [bench]


class _MinimalBatched(torch.Tensor):
    """The floor for any per-op design: unwrap, call, rewrap; no levels, checks or rules.

    Correct only for this benchmark (pointwise ops, batch dim 0, equal shapes).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*[a.inner if type(a) is cls else a for a in args], **(kwargs or {}))
        return cls.wrap(out)

    @classmethod
    def wrap(cls, inner):
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape[1:], dtype=inner.dtype)
        out.inner = inner
        return out

    @classmethod
    def run(cls, fn, *args):
        return fn(*map(cls.wrap, args)).inner


# -- (b) an MLP forward ---------------------------------------------------------------------


def _frozen(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters as plain tensors (no autograd: these are forward benchmarks)."""
    return [p.detach() for p in module.parameters()]


def mlp_group() -> list[Benchmark]:
    """(b) MLP 784-256-256-10 forward at batch 64, vmapped over single examples."""
    torch.manual_seed(0)
    w1, b1 = _frozen(nn.Linear(784, 256))
    w2, b2 = _frozen(nn.Linear(256, 256))
    w3, b3 = _frozen(nn.Linear(256, 10))

    def mlp(x):
        x = F.relu(F.linear(x, w1, b1))
        x = F.relu(F.linear(x, w2, b2))
        return F.linear(x, w3, b3)

    x = torch.randn(64, 784)
    return [_three_ways("MLP 784-256-256-10, batch 64", mlp, mlp, (x,), target=1.1)]


# -- (c) a small CNN forward ------------------------------------------------------------------


def cnn_group() -> list[Benchmark]:
    """(c) small CNN forward at batch 32 on 1x28x28 examples, vmapped over single examples."""
    torch.manual_seed(0)
    c1, cb1 = _frozen(nn.Conv2d(1, 16, 3))
    c2, cb2 = _frozen(nn.Conv2d(16, 32, 3))
    w, b = _frozen(nn.Linear(32 * 5 * 5, 10))

    def features(x):  # works on (1, 28, 28) and on (N, 1, 28, 28)
        x = F.max_pool2d(F.relu(F.conv2d(x, c1, cb1)), 2)
        return F.max_pool2d(F.relu(F.conv2d(x, c2, cb2)), 2)

    def cnn(x):  # one example
        return F.linear(features(x).flatten(), w, b)

    def cnn_batched(x):
        return F.linear(features(x).flatten(1), w, b)

    x = torch.randn(32, 1, 28, 28)
    return [_three_ways("CNN conv16-conv32-linear, batch 32", cnn, cnn_batched, (x,),
                        target=1.1)]


GROUPS: dict[str, Group] = {
    "overhead": Group(
        "Per-op overhead",
        "A chain of 100 small pointwise ops (mul, sin, add, tanh, exp, sub, cos, sigmoid, "
        "mul by a scalar, maximum), vmapped over 8 examples of shape (16,). The ops are "
        "tiny, so this measures the Python cost of dispatching one op through a vmap level. "
        "Target from the issue: ratio <= 1.5.",
        overhead_group,
    ),
    "mlp": Group(
        "MLP forward",
        "`F.linear`/`F.relu` MLP 784-256-256-10 with unbatched weights, vmapped over a batch "
        "of 64 single examples of shape (784,). Target: ratio <= 1.1.",
        mlp_group,
    ),
    "cnn": Group(
        "CNN forward",
        "conv 1->16 3x3, relu, maxpool 2, conv 16->32 3x3, relu, maxpool 2, flatten, linear "
        "800->10, unbatched weights, vmapped over a batch of 32 examples of shape "
        "(1, 28, 28). Target: ratio <= 1.1.",
        cnn_group,
    ),
}
