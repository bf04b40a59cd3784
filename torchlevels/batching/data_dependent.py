"""Ops whose result is a Python value read from a tensor: under vmap they cannot be batched.

``.item()``, ``bool(t)``, ``t.tolist()`` and friends all arrive as
``aten._local_scalar_dense``; Python control flow on such a value would differ per example.
``torch.equal`` and ``torch.allclose`` return one Python bool for the whole batch.
"""

from __future__ import annotations

import torch

from torchlevels.batching.dims import logical_rank, pad_to_rank, to_front
from torchlevels.batching.registry import register

aten = torch.ops.aten


@register(aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal)
def data_dependent(func, args, dims, kwargs):
    raise RuntimeError(
        f"vmap: {func} reads a Python value out of a batched tensor (e.g. `.item()`, "
        "`bool(t)` in an `if`, `.tolist()`, `torch.equal`). Each example would give a "
        "different value, so data-dependent Python control flow cannot be vmapped. Rewrite "
        "it with tensor ops such as torch.where(cond, a, b), or move it out of vmap."
    )


@register(aten.allclose)
def allclose(func, args, dims, kwargs):
    """In a user's code, an error, as in torch.func; in a backward formula PyTorch runs (the
    autograd engine is running a graph), a check that holds only if it holds for every
    example: svd's and eig's backward check a phase this way, and a jacrev of their
    gradient runs that backward under vmap."""
    if torch._C._current_graph_task_id() != -1:
        rank = max(logical_rank(t, d) for t, d in zip(args[:2], dims[:2]))
        a, b = (pad_to_rank(to_front(t, d) if d is not None else t.unsqueeze(0), rank)
                for t, d in zip(args[:2], dims[:2]))
        return func(a, b, *args[2:], **kwargs), None
    raise RuntimeError(
        "vmap: torch.allclose returns one Python bool, which would differ per example. Use "
        "torch.isclose(a, b, rtol, atol).all() instead: a batched tensor, one bool per "
        "example."
    )


@register(aten._is_all_true.default, aten._is_any_true.default)
def over_the_batch(func, args, dims, kwargs):
    """One bool for the whole batch (all, or any, of every example's elements), as in
    torch.func: ``torch.distributions`` checks its arguments this way, then reads the
    answer into Python (``if not torch._is_all_true(valid): raise ValueError(...)``)."""
    return func(args[0]), None


@register(aten._assert_async.default, aten._assert_async.msg)
def assert_async(func, args, dims, kwargs):
    """``torch._assert_async(cond)`` holds for every example."""
    func(args[0].all(), *args[1:])
    return None, None
