"""Small helpers shared by batching rules: where the batch dim is and moving it."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch


def wrap_dim(dim: int, rank: int) -> int:
    """``dim`` as a non-negative index into a tensor of ``rank`` dims (0-dim counts as 1)."""
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-bound}, {bound - 1}], "
            f"but got {dim})"
        )
    return dim % bound


def logical_rank(x: torch.Tensor, bdim: int | None) -> int:
    """The number of dims the user sees: the physical ones less the batch dim."""
    return x.dim() - (bdim is not None)


def logical_shape(x: torch.Tensor, bdim: int | None) -> tuple[int, ...]:
    """The shape the user sees."""
    shape = tuple(x.shape)
    return shape if bdim is None else shape[:bdim] + shape[bdim + 1 :]


def example_meta(args, dims) -> list:
    """One example's arguments, its tensors as meta tensors (the rest as they are): to
    learn what one example's call gives, or raise its error, without computing."""
    return [torch.empty(logical_shape(a, d), dtype=a.dtype, device="meta")
            if isinstance(a, torch.Tensor) else a for a, d in zip(args, dims)]


def example_zeros(args, dims) -> list:
    """One example's arguments, its tensors as zeros (the rest as they are): to run an op's
    own kernel on one example, where its meta kernel cannot say what that call does."""
    return [torch.zeros(logical_shape(a, d), dtype=a.dtype, device=a.device)
            if isinstance(a, torch.Tensor) else a for a, d in zip(args, dims)]


_KERNEL_TAKES: set[tuple] = set()  # (op, its tensors' dtypes and devices) run once


def kernel_on_zeros(key: tuple, call: Callable[[], object],
                    refused: Callable[[Exception], bool]) -> None:
    """The first time ``key`` (an op, its tensors' dtypes and devices) is met, run ``call``:
    the op's own kernel on zeros shaped as one example (made inside ``call``), unseen by
    any level, mode or autograd. Raise what it raises where ``refused(error)``: the error
    each example's call raises. Other errors (the zeros may be bad values) are left to the
    call itself."""
    if key in _KERNEL_TAKES:
        return
    try:
        with torch._C._DisableTorchDispatch(), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (an out= tensor's resize)
            call()
    except Exception as error:
        if refused(error):
            raise
    _KERNEL_TAKES.add(key)


def refuse_dtypes_the_kernel_refuses(func, args, dims, kwargs) -> None:
    """Raise the error each example's call raises when ``func``'s own kernel has no
    version for its tensors' dtypes (``"prelu_cpu" not implemented for 'Long'``). A rule
    that computes ``func`` in other ops (a decomposition) would answer instead.

    The first time ``func`` meets a combination of dtypes and devices, its kernel runs on
    zeros shaped as one example, unseen by any level, mode or autograd; any other error
    there (the zeros may be bad values) is the rule's to find. (Ops given lists of
    tensors, or tensors as keywords, are not run.)
    """
    if any(isinstance(a, (list, tuple)) and any(isinstance(i, torch.Tensor) for i in a)
           for a in args) or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return
    key = (func, *((a.dtype, a.device.type) for a in args if isinstance(a, torch.Tensor)))
    if len(key) == 1 or key in _KERNEL_TAKES:  # (every decomposed op asks: no closures then)
        return

    def call():
        func(*example_zeros(args, dims), **kwargs)

    kernel_on_zeros(key, call, lambda error: isinstance(error, NotImplementedError)
                    and "not implemented for" in str(error))


def span(sizes, strides) -> int:
    """How many storage elements a layout reaches from its first: 0 when it is empty."""
    if not all(sizes):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(sizes, strides))


def to_front(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    """``x`` with its batch dim first (unchanged when unbatched or already first)."""
    if bdim is None or bdim == 0:
        return x
    return x.movedim(bdim, 0)


def rows(x: torch.Tensor) -> torch.Tensor:
    """Batch-first ``x`` as ``[batch, elements of one example]``. Unlike
    ``x.reshape(x.shape[0], -1)``, it works for an empty batch too."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def per_example(x: torch.Tensor, mean: bool) -> torch.Tensor:
    """Each example's mean (or, ``mean=False``, sum) of batch-first ``x``: a loss's terms
    reduced as the loss of one example reduces them."""
    flat = rows(x)
    return flat.mean(1) if mean else flat.sum(1)


def materialize(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    """``x`` with a batch dim of ``size`` first: moved there, or expanded when unbatched."""
    if bdim is None:
        return x.expand(size, *x.shape)
    return to_front(x, bdim)


def pad_to_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    """A front-batched ``x`` with size-1 dims after the batch dim up to logical ``rank``."""
    missing = rank + 1 - x.dim()
    if missing <= 0:
        return x
    if missing == 1:
        return x.unsqueeze(1)
    shape = list(x.shape)
    shape[1:1] = [1] * missing
    return x.view(shape)
