"""Max pooling in the layout PyTorch pools fastest in on the CPU.

vmap folds its batch into the N dim of a contiguous ``[N, C, *spatial]`` input. PyTorch's
CPU max pool vectorises over channels only in channels-last layout: there it is 2-5x
faster from 4 channels up, both conversions included (``python -m benchmarks.run
--groups max_pool`` measures it), so the batched max pool runs there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def faster_in_channels_last(x: torch.Tensor) -> bool:
    """Whether a max pool of the plain ``[N, C, *spatial]`` ``x`` is faster in channels-last
    layout, conversions included: on the CPU, for floats with 4 channels or more (8 for
    16-bit floats: below, the conversions cost what the kernel saves).

    >>> faster_in_channels_last(torch.randn(8, 16, 26, 26))
    True
    """
    return (x.dim() in _CHANNELS_LAST and x.device.type == "cpu" and type(x) is torch.Tensor
            and x.is_floating_point()  # uint8 fails in channels_last_3d
            and x.shape[1] >= (4 if x.element_size() >= 4 else 8))


def max_pool(func: Callable, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``func(x, *args, **kwargs)`` for a max pool ``func`` of a plain ``[N, C, *spatial]``
    ``x``, in channels-last layout when :func:`faster_in_channels_last`.

    Values and indices are those of the call on ``x``, and so is the outputs' (contiguous)
    layout.

    >>> pool = torch.ops.aten.max_pool2d_with_indices
    >>> x = torch.randn(8, 16, 26, 26)
    >>> out, idx = max_pool(pool, x, [2, 2])
    >>> out.is_contiguous() and torch.equal(idx, pool(x, [2, 2])[1])
    True
    """
    if not faster_in_channels_last(x):
        return func(x, *args, **kwargs)
    out = func(x.contiguous(memory_format=_CHANNELS_LAST[x.dim()]), *args, **kwargs)
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    return tuple(o.contiguous() for o in out)
