"""Dual tensors that a jvp level inside the running level made, taken as their primals.

PyTorch has one forward-AD level, which nested jvp levels share. A jvp level inside the
level running an op makes duals of its own primals, and one made of a tensor that is
constant to that jvp level (``jvp(lambda b: a + b * b, (two,), ...)`` with ``a`` of the
running level) reaches the running level's op as a plain tensor with the jvp level's
tangent. Its tangent is the jvp level's to propagate (forward AD did, above the running
level's dispatch), never the running level's: a grad level's graph would save it and
differentiate it after the jvp level exits, and a vmap level's rule, run with autograd on,
would run the op's forward formula a second time on its physical tensors.
"""

from __future__ import annotations

from typing import Any

import torch

_unpack_dual = torch._VF._unpack_dual


def primals(a: Any, level: int, written: bool = False) -> Any:
    """``a`` (or a list or tuple of them) with each plain tensor's tangent at forward-AD
    ``level`` dropped, as :func:`without_tangent` drops it.

    Example::

        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level() as level:
        ...     x = fwAD.make_dual(torch.ones(2), torch.zeros(2))
        ...     p, number = primals([x, 3.0], level)
        ...     fwAD.unpack_dual(p).tangent, number
        (None, 3.0)
    """
    if type(a) in (list, tuple):
        return type(a)(primals(t, level, written) for t in a)
    if type(a) is torch.Tensor:
        return without_tangent(a, level, written)
    return a


def without_tangent(t: torch.Tensor, level: int, written: bool = False) -> torch.Tensor:
    """``t``'s primal, if it is a dual tensor at forward-AD ``level``.

    A tensor with no tangent yet may get one after the op: a jvp level's result, which
    its forward formula reads (``exp``'s tangent is ``t * result``) before forward AD
    attaches the tangent. So the primal, a view forward AD never gives a tangent, stands
    for it, unless the op writes ``t`` in place (``written``): the write must land on
    ``t`` itself.

    Example::

        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level() as level:
        ...     x = fwAD.make_dual(torch.ones(2), torch.zeros(2))
        ...     fwAD.unpack_dual(without_tangent(x, level)).tangent is None
        True
    """
    primal, tangent = _unpack_dual(t, level=level)
    return t if tangent is None and written else primal
