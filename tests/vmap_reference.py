"""The references the batching-rule tests hold torchlevels.vmap to.

A case runs a function three ways on the same inputs: ``torchlevels.vmap``,
``torch.func.vmap``, and :func:`loop_reference`, a Python loop that calls the function
on each example and stacks the outputs. The results must agree, and torchlevels must
not have fallen back to its slow per-example loop (which warns ``no batching rule for
<op>; using a slow loop``) for any op.

That warning is given once per op and process, so tests/conftest.py calls
:func:`fresh_start` before every test to re-arm it (and to seed torch).

Test files import this module as a plain module (pytest puts tests/ on ``sys.path``)::

    from vmap_reference import check_vmap, loop_reference
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import torchlevels
from torchlevels.batching.registry import reset_loop_warnings

SLOW_LOOP_WARNING = "no batching rule"  # how torchlevels' slow-loop warning begins

InDims = int | None | Sequence[int | None]


def seeded(seed: int) -> torch.Generator:
    """A generator on torch's default device (the suite's: TORCHLEVELS_TEST_DEVICE), seeded."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def fresh_start(seed: int = 0) -> None:
    """Re-arm torchlevels' once-per-op slow-loop warning and seed torch's RNG."""
    reset_loop_warnings()
    torch.manual_seed(seed)


def _per_arg(in_dims: InDims, args: Sequence[Any]) -> tuple:
    """``in_dims`` as one entry per argument: a tuple as is, else repeated for each."""
    return in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)


def loop_reference(f: Callable, args: Sequence[Any], in_dims: InDims) -> Any:
    """``f`` called on each example in turn, the outputs stacked at dim 0.

    ``in_dims`` has one entry per argument (or one int/None for all): the batch dim of
    that argument, or None for an argument every example shares. The batch size is read
    from the first batched argument. Examples are views (``select``), so an in-place ``f``
    writes through to ``args`` as it would under vmap. ``f`` may return any pytree of
    tensors (a tensor, a tuple such as ``torch.max``'s, a list, a dict...): the result
    has the same structure with each leaf stacked over the examples.
    """
    in_dims = _per_arg(in_dims, args)
    size = next(a.shape[d] for a, d in zip(args, in_dims) if d is not None)
    outs = [f(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)))
            for b in range(size)]
    _, spec = tree_flatten(outs[0])
    leaves = [tree_flatten(o)[0] for o in outs]
    return tree_unflatten([torch.stack(parts) for parts in zip(*leaves)], spec)


def vmap_without_slow_loop(f: Callable, *args: Any, in_dims: InDims = 0,
                           warnings_are_errors: bool = False) -> Any:
    """``torchlevels.vmap(f, in_dims)(*args)``, failing if any op ran the slow loop.

    With ``warnings_are_errors`` every warning raised under vmap is an error (raised
    where it is warned), not only the slow-loop one.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error" if warnings_are_errors else "always")
        out = torchlevels.vmap(f, in_dims)(*args)
    slow = [str(w.message) for w in caught if SLOW_LOOP_WARNING in str(w.message)]
    assert not slow, slow
    return out


def check_vmap(f: Callable, *args: Any, in_dims: InDims = 0, atol: float | None = None,
               rtol: float | None = None, against_func: bool = True, equal_nan: bool = False,
               warnings_are_errors: bool = False) -> Any:
    """Assert ``torchlevels.vmap(f)`` == ``torch.func.vmap(f)`` == the loop; return ours.

    ``in_dims``: an int (or None) for every argument, or a tuple with one per argument.
    ``atol``/``rtol``: None for both gives torch.testing.assert_close's defaults for the
    dtype. ``against_func=False`` compares with the loop only, for the cases where
    torch.func.vmap is wrong or refuses a valid call (say so at the call). Fails if any op
    fell back to the slow loop (any warning at all with ``warnings_are_errors``).
    """
    in_dims = _per_arg(in_dims, args)
    got = vmap_without_slow_loop(f, *args, in_dims=in_dims,
                                 warnings_are_errors=warnings_are_errors)
    close = dict(atol=atol, rtol=rtol, equal_nan=equal_nan)
    if against_func:
        torch.testing.assert_close(got, torch.func.vmap(f, in_dims)(*args), **close)
    torch.testing.assert_close(got, loop_reference(f, args, in_dims), **close)
    return got


@contextlib.contextmanager
def counting_dispatches(level_type: type) -> Iterator[list]:
    """Count the ops that reach the ``dispatch`` of ``level_type`` (a ``Level`` class: a
    level's ``__torch_dispatch__``), those its shortcuts did not answer."""
    calls: list = []
    original = level_type.dispatch

    def dispatch(self, cls, func, args, kwargs):
        calls.append(func)
        return original(self, cls, func, args, kwargs)

    level_type.dispatch = dispatch
    try:
        yield calls
    finally:
        level_type.dispatch = original
