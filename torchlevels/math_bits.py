"""Conjugate and negative views that autograd tracks, meeting a level's tensors.

``z.conj()`` is a lazy view: a bit on the tensor, no copy. For most ops PyTorch resolves
the bit in a fallback at its Conjugate (or Negative) key, which runs below autograd and
above the Python key: the op gets a copy of the values with no history. Under a level
the copy is what the level's ``__torch_dispatch__`` receives, so an op on a level's
tensor and a conj view of a tensor autograd tracks lost the graph to that tensor. The
backward formulas of complex ops run such ops (``grad * other.conj()`` for ``mul``): with
autograd outside tracking ``other``, ``jacrev``, ``hessian`` or ``vmap(grad)`` of complex
code gave wrong derivatives outside, or none.

Two places hand such a view to a level, and each keeps the graph:

- a call in the user's code: the level's ``__torch_function__`` resolves the bit first,
  with autograd recording (:func:`tracked_views_resolved`);
- an op a backward formula runs, in C++, past ``__torch_function__``: a kernel at the
  Conjugate and Negative keys of the ops those formulas run on conj views (found by
  running every complex OpInfo under the transforms) hands the op on with the bit kept,
  when a level's tensor and such a view are among its arguments. The level runs the op
  with autograd recording and the dispatch keys of the call, which resolve the bit then.
  Elsewhere the kernel does what PyTorch's fallback does. The kernels are registered
  when the first level is made (a Python kernel is slower than PyTorch's fallback for
  the conj views of these ops everywhere in the process).

Example (autograd outside a vmap over a product with a conj view)::

    >>> import torch
    >>> from torchlevels import vmap
    >>> z = torch.tensor([1 + 2j, 3 - 1j], requires_grad=True)
    >>> out = vmap(lambda b: b * z.conj())(torch.ones(3, 2, dtype=torch.cfloat))
    >>> torch.autograd.grad(out.real.sum(), z)[0].real  # 3 rows of conj(z)
    tensor([3., 3.])
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from torchlevels._plain import PLAIN

# the ops backward formulas run on a conj view and a gradient (a level's tensor under a
# transform) that reach the Conjugate key: mul and div (pointwise ops, products and
# quotients), mv (addmv, addr), linalg_cross's and triangular_solve's own, and
# _linalg_solve_ex (linalg.solve's, which solves with ``A.mH`` when grad mode is on).
# Composite ops (matmul, outer) decompose above that key; mm, bmm and dot take conj views
# as they are.
_FORMULA_OPS = ("mul.Tensor", "div.Tensor", "mv", "linalg_cross", "triangular_solve",
                "_linalg_solve_ex")
_BELOW_MATH_BITS = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Conjugate)
_registered = False
_lock = threading.Lock()
_library: torch.library.Library | None = None


def _tracked_view(a: Any) -> bool:
    """Whether ``a`` is a plain tensor that autograd tracks, with a conj or neg bit."""
    return type(a) in PLAIN and a.requires_grad and (a.is_conj() or a.is_neg())


def tracked_views_resolved(args: tuple, kwargs: dict, first_written: bool = False
                           ) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call made on a level's tensors, with each plain
    tensor autograd tracks that is a conj or neg view (among them or in a list among
    them) resolved into a copy, with autograd recording; with ``first_written``, the
    first argument (which an in-place call writes) stays itself. Returns them as they
    are when there is none (the usual case: one pass over them).

    >>> z = torch.tensor([1 + 2j], requires_grad=True)
    >>> (view,), _ = tracked_views_resolved((z.conj(),), {})
    >>> view.is_conj(), view.grad_fn is not None
    (False, True)
    """
    read = args[1:] if first_written else args
    if not (_any_tracked_view(read) or (kwargs and _any_tracked_view(kwargs.values()))):
        return args, kwargs
    resolved = _resolved(read)
    return (args[:1] + resolved if first_written else resolved), _resolved_kwargs(kwargs)


def _any_tracked_view(items: Any) -> bool:
    for a in items:
        if _tracked_view(a) or (type(a) in (list, tuple) and any(map(_tracked_view, a))):
            return True
    return False


def _resolved(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.resolve_conj().resolve_neg() if a.is_conj() or a.is_neg() else a
    if type(a) in (list, tuple):
        return type(a)(map(_resolved, a))
    return a


def register() -> None:
    """The kernels at the Conjugate and Negative keys of the formula ops (once per
    process; the first level made calls this)."""
    global _registered, _library
    if _registered:  # (every transform call asks: no lock then)
        return
    with _lock:
        if _registered:
            return
        library = torch.library.Library("aten", "IMPL")
        for name in _FORMULA_OPS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            for key in ("Conjugate", "Negative"):
                library.impl(name, _kernel(op), key, with_keyset=True)
        _library, _registered = library, True


def _kernel(op: torch._ops.OpOverload):
    from torchlevels._level import LevelTensor

    tensor_positions = [i for i, a in enumerate(op._schema.arguments)
                        if not a.kwarg_only and a.type.isSubtypeOf(torch._C.TensorType.get())]

    def kernel(keyset, *args: Any, **kwargs: Any) -> Any:
        below = keyset & _BELOW_MATH_BITS
        # (a Python number given for a tensor argument, mul(z.conj(), 2), reaches us as
        # a number: redispatching needs tensors, so that call starts again from the top)
        numbers = any(i < len(args) and not isinstance(args[i], torch.Tensor)
                      for i in tensor_positions)
        if not numbers and any(isinstance(a, LevelTensor) for a in args) and any(
                map(_tracked_view, args)):
            return op.redispatch(below, *args, **kwargs)  # the level resolves the bits
        # PyTorch's own fallback: the bits resolved in copies (autograd is past already)
        if numbers:
            return op(*_resolved(args), **_resolved_kwargs(kwargs))
        return op.redispatch(below, *_resolved(args), **_resolved_kwargs(kwargs))

    return kernel


def _resolved_kwargs(kwargs: dict) -> dict:
    return {k: _resolved(v) for k, v in kwargs.items()}
