"""Rules for composite ops, applied before the op decomposes into smaller aten ops.

``F.linear`` on a batched vector decomposes into view + addmm + view: three trips
through the level. Caught whole (see predispatch.py), it is one physical ``linear`` on
the batch. A composite rule has the usual signature and may return ``NotImplemented``
to let the op decompose as usual, its pieces batched one by one.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
from torch._ops import OpOverload

from torchlevels._level import LevelTensor, in_level_graph, requires_grad_flag, tracked_outside
from torchlevels.batching.dims import example_meta, pad_to_rank, to_front
from torchlevels.batching.predispatch import intercept, passed_by
from torchlevels.batching.registry import is_composite, registered_rule

aten = torch.ops.aten


def _deepest_level(args: tuple) -> type[LevelTensor] | None:
    """The class of the innermost level among the tensor arguments, if they nest."""
    found = None
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            cls = type(t)
            if not issubclass(cls, LevelTensor) or cls is found:
                continue
            if found is None or issubclass(cls, found):
                found = cls
            elif not issubclass(found, cls):
                return None  # unrelated levels: let the usual path report it
    return found


_ops: list = []


def composite_ops() -> list:
    """The composite ops that have a rule of their own."""
    return list(_ops)


# Set while forward AD records ops on the tensors of a vmap level themselves.
_recording: ContextVar[bool] = ContextVar("torchlevels_recording", default=False)


def call_recorded(func: OpOverload, args: Any, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` where forward AD records ops on the tensors of an enclosing
    vmap level themselves (a jvp level runs its ops on their duals). A composite op among
    ``func`` and its pieces decomposes there, so that its pieces are recorded, instead of
    taking vmap's rule for it, which would compute beneath the record (a jvp of matmul
    with no tangent). Autograd's records are seen by the arguments (``_recorded_on``)."""
    if not is_composite(func):
        return func(*args, **kwargs)
    token = _recording.set(True)
    try:
        return func(*args, **kwargs)
    finally:
        _recording.reset(token)


def _recorded_on(args: tuple) -> bool:
    """Whether autograd records ops on these arguments themselves, not only on the
    physical tensors under them: a tensor of a level that requires grad (a grad level runs
    whole calls on its inner tensors, grad_shortcuts.py), or a plain tensor that requires
    grad for a grad level's graph (also when autograd outside tracks it: a grad level's
    leaf of an input that requires grad). A composite rule computes beneath them, so it
    would hide the op from that record; decomposed, each piece is recorded."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and requires_grad_flag(t)
        and (isinstance(t, LevelTensor) or in_level_graph(t) or not tracked_outside(t))
        for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)))


def composite_rule(*ops):
    """Register ``rule`` for composite ``ops``, tried before they decompose under vmap."""

    def deco(rule):
        def handler(op, args, kwargs):
            if _recording.get() or _recorded_on(args):
                return passed_by(op, args, kwargs)  # decomposed by the dispatcher, each
                # piece recorded by autograd on these tensors
            cls = _deepest_level(args)
            if cls is None or not cls._level.alive or not hasattr(cls._level, "composite"):
                return passed_by(op, args, kwargs)
            users = registered_rule(op)  # a user's rule for the op wins over the library's
            return cls._level.composite(cls, op, users or rule, args, kwargs)

        for op in ops:
            intercept(op, handler)
            _ops.append(op)
        return rule

    return deco


@composite_rule(aten.linear.default)
def linear(func, args, dims, kwargs):
    """Batched input, shared weight and bias: one linear over the batch (it takes any rank)."""
    x, weight, *bias = args
    if dims[0] is None or any(d is not None for d in dims[1:]):
        return NotImplemented
    return torch.nn.functional.linear(to_front(x, dims[0]), weight, *bias), 0


@composite_rule(aten.matmul.default)
def matmul(func, args, dims, kwargs):
    """One matmul: vectors become matrices, batched operands get the batch dim first."""
    (a, b), (da, db) = args, dims
    rank_a, rank_b = a.dim() - (da is not None), b.dim() - (db is not None)
    if rank_a == 0 or rank_b == 0:
        return NotImplemented  # torch raises for these: let the decomposition say so
    a = to_front(a, da).unsqueeze(-2) if rank_a == 1 else to_front(a, da)
    b = to_front(b, db).unsqueeze(-1) if rank_b == 1 else to_front(b, db)
    rank = max(rank_a, rank_b, 2)
    if da is not None:
        a = pad_to_rank(a, rank)
    if db is not None:
        b = pad_to_rank(b, rank)
    out = torch.matmul(a, b)
    if rank_b == 1:
        out = out.squeeze(-1)
    if rank_a == 1:
        out = out.squeeze(-1 if rank_b == 1 else -2)
    return out, 0


@composite_rule(aten.one_hot.default)
def one_hot(func, args, dims, kwargs):
    """Decomposes as usual, but a batched input without ``num_classes`` cannot: the
    number of classes would be read from each example's largest label."""
    if args[0].dtype != torch.int64:  # torch's error (the decomposition takes any dtype)
        func(*example_meta(args, dims), **kwargs)
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if dims[0] is not None and num_classes == -1:
        raise RuntimeError(
            "vmap: F.one_hot of a batched tensor needs an explicit num_classes: without "
            "it the number of classes is each example's largest label plus one, which "
            "differs per example. Pass num_classes=..."
        )
    return NotImplemented


def vander(op, args, kwargs):
    """``torch.vander`` built as PyTorch builds it (ones, then the running product of x),
    but out of place, on the tensors of whatever levels it gets: PyTorch's decomposition
    writes x into a tensor it makes itself, which vmap cannot batch (it is unbatched) and
    grad and jvp levels refuse (it is captured). Values are PyTorch's, bit for bit."""
    x, n, increasing = (*args, *(None, False)[len(args) - 1:])
    n, increasing = kwargs.get("N", n), kwargs.get("increasing", increasing)
    if x.dim() != 1 or (n is not None and n < 0):
        return passed_by(op, args, kwargs)  # torch's own errors
    n = x.shape[0] if n is None else n
    x = x.to(torch.promote_types(x.dtype, torch.long)).unsqueeze(-1)
    powers = x.expand(x.shape[0], max(n - 1, 0)).cumprod(-1)
    out = torch.cat([torch.ones_like(x), powers], -1)[:, :n]
    return out if increasing else out.flip(-1)


intercept(aten.vander.default, vander)
_ops.append(aten.vander.default)


def cross_entropy_loss(op, args, kwargs):
    """``F.cross_entropy`` with class weights and label smoothing, averaged over class
    indices: PyTorch divides by the weights of the targets kept, which it gathers with
    ``masked_select`` unless the weights are a tensor subclass. Under vmap the targets
    are, and a batch whose examples ignore different numbers of them has no batched
    ``masked_select``: this is PyTorch's formula along its subclass path (``masked_fill``
    and ``gather``), on the tensors of whatever levels it gets, as torch.func computes it."""
    names = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    given = {**dict(zip(names, args)), **kwargs}
    x, target, weight = given["self"], given["target"], given.get("weight")
    smoothing = given.get("label_smoothing", 0.0)
    if (weight is None or not smoothing or given.get("reduction", 1) != 1
            or target.is_floating_point() or x.dim() == 0 or weight.dim() != 1):
        return passed_by(op, args, kwargs)  # no masked_select there, or torch's own errors
    ignore_index = given.get("ignore_index", -100)
    class_dim = 0 if x.dim() == 1 else 1
    logp = torch.log_softmax(x, class_dim, dtype=x.dtype)
    nll = torch.ops.aten.nll_loss_nd(logp, target, weight, 1, ignore_index)
    n_classes = logp.shape[class_dim]
    shape = [1] * logp.dim()
    shape[class_dim] = n_classes
    ignored = target == ignore_index
    smooth = -(logp * weight.view(shape)).sum(class_dim).masked_fill(ignored, 0.0)
    kept = target.masked_fill(ignored, 0)
    weight_sum = weight.gather(0, kept.flatten()).view(kept.shape).masked_fill(ignored, 0).sum()
    return (1 - smoothing) * nll + smooth.sum() / weight_sum * (smoothing / n_classes)


intercept(aten.cross_entropy_loss.default, cross_entropy_loss)
_ops.append(aten.cross_entropy_loss.default)
