"""Transformed functions take tensors with first-class dims (``torchlevels.dim``).

``grad(f)(x[i])`` is Rule 1 applied to a transformed function: it runs once per element
of ``i``, under one vmap level per dim, like any other op on such tensors.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


def accepts_dims(transformed: Callable) -> Callable:
    """``transformed``, batched over the first-class dims of its arguments if any."""

    @functools.wraps(transformed)
    def call(*args, **kwargs):
        dim = sys.modules.get("torchlevels.dim")  # no dims tensor exists before its import
        if dim is not None and any(
            isinstance(a, dim._base._Tensor) for a in (*args, *kwargs.values())
        ):
            return dim._ops.batched(transformed, args, kwargs)
        return transformed(*args, **kwargs)

    return call
