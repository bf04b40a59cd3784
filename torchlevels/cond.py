"""``torch.cond`` inside transforms: the branch its predicate picks, or, where the
predicate differs from example to example under vmap, both branches and a ``where``.

PyTorch runs ``torch.cond`` eagerly by compiling it with dynamo, which cannot trace the
tensors of a level made per call (see _torch_compile.py), so inside a transform it
raised. torch.func runs it, branching as above. So importing torchlevels wraps
``torch.cond`` once: a call made while a level is live, or on a level's tensors, runs
here; every other call is PyTorch's own.

Example::

    >>> import torch
    >>> from torchlevels import vmap
    >>> x = torch.tensor([[0.5, 1.0], [-0.5, -1.0]])
    >>> vmap(lambda r: torch.cond(r.sum() > 0, torch.neg, torch.exp, (r,)))(x)
    tensor([[-0.5000, -1.0000],
            [ 0.6065,  0.3679]])
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from torchlevels._level import LevelTensor, enclosing_classes, innermost
from torchlevels.autodiff import GradLevel, requires_grad_within
from torchlevels.vmap import BatchLevel

pytorch_cond = torch.cond  # PyTorch's own


@functools.wraps(pytorch_cond)
def cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: Any = ()) -> Any:
    # PyTorch's docstring (functools.wraps): this is torch.cond from now on
    if innermost() is None and not any(
            isinstance(t, LevelTensor) for t in tree_leaves((pred, operands))):
        return pytorch_cond(pred, true_fn, false_fn, operands)
    _check_arguments(pred, true_fn, false_fn, operands)
    if not _differs_per_example(pred):
        return true_fn(*operands) if pred else false_fn(*operands)
    if _reverse_mode(operands):
        raise NotImplementedError(
            "torch.cond under vmap, with a predicate that differs from example to example, "
            "runs both branches and picks each example's with torch.where. Reverse mode "
            "(grad, vjp, jacrev, hessian, or autograd outside) would differentiate the "
            "branch an example did not take at that example's values, where it may be "
            "undefined (nan: sqrt of a negative number). torch.func refuses this too. Use "
            "forward mode (jvp, jacfwd), which is right here, or torch.where over inputs "
            "that each branch is defined at.")
    taken, spec = tree_flatten(true_fn(*operands))
    other, other_spec = tree_flatten(false_fn(*operands))
    _check_same_outputs(taken, spec, other, other_spec)
    pred = pred.reshape(())
    return tree_unflatten([torch.where(pred, t, f) for t, f in zip(taken, other)], spec)


def _differs_per_example(pred: Any) -> bool:
    """Whether ``pred`` is batched by a vmap level (its value differs per example)."""
    while isinstance(pred, LevelTensor):
        if isinstance(pred._level, BatchLevel):
            return True
        pred = pred._inner
    return False


def _reverse_mode(operands: Any) -> bool:
    """Whether reverse mode may differentiate the call: a grad level is live, or autograd
    outside tracks an operand."""
    return (any(isinstance(c._level, GradLevel) for c in enclosing_classes(innermost()))
            or any(map(requires_grad_within, tree_leaves(operands))))


def _check_arguments(pred: Any, true_fn: Callable, false_fn: Callable, operands: Any) -> None:
    """PyTorch's checks of torch.cond's arguments, with its errors."""
    if not isinstance(pred, (bool, torch.Tensor, torch.SymBool)):
        raise RuntimeError(f"Expected pred to be bool or tensor, but got {pred}.")
    if isinstance(pred, torch.Tensor) and pred.numel() != 1:
        raise RuntimeError(f"Expected pred to be bool or single-element tensor, but got "
                           f"{pred}.")
    if not callable(true_fn) or not callable(false_fn):
        raise RuntimeError("Expect both branches to be callable.")
    if not isinstance(operands, (tuple, list)) or not all(
            isinstance(t, torch.Tensor) for t in tree_leaves(operands)):
        raise RuntimeError("Expect operands to be a tuple of possibly nested dict/list/tuple "
                           f"that only consists of tensor leaves, but got {operands}.")


def _check_same_outputs(taken: list, spec: Any, other: list, other_spec: Any) -> None:
    """Both branches return tensors of one structure, shapes and dtypes (torch.cond's rule),
    which a ``where`` picks between per example."""
    if spec != other_spec:
        raise RuntimeError(f"torch.cond: the branches returned different structures, "
                           f"{spec} and {other_spec}: they must return the same")
    for k, (t, f) in enumerate(zip(taken, other)):
        if not (isinstance(t, torch.Tensor) and isinstance(f, torch.Tensor)):
            raise RuntimeError(f"torch.cond: output {k} of a branch is not a tensor: under "
                               "vmap with a predicate that differs per example, both "
                               "branches must return tensors only")
        if t.shape != f.shape or t.dtype != f.dtype:
            raise RuntimeError(
                f"torch.cond: output {k} of the branches differs, {tuple(t.shape)} "
                f"{t.dtype} and {tuple(f.shape)} {f.dtype}: they must return tensors of the "
                "same shapes and dtypes")


def install() -> None:
    """Route ``torch.cond`` calls inside transforms here (done on import)."""
    torch.cond = cond


install()
