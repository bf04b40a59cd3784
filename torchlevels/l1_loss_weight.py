"""``F.l1_loss(input, target, weight=w)`` on the tensors of a level keeps its weight.

PyTorch's ``F.l1_loss`` hands a call on tensors with ``__torch_function__`` on without
its ``weight``: every subclass, a level's tensors among them, gets the unweighted loss,
silently (torch.func's tensors are not subclasses: it weighs). So importing torchlevels
wraps ``F.l1_loss`` once: a weighted call on such tensors goes to ``__torch_function__``
with its weight; every other call is PyTorch's own.

Example::

    >>> import torch
    >>> import torch.nn.functional as F
    >>> from torchlevels import vmap
    >>> x, w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([1.0, 0.0, 0.0])
    >>> vmap(lambda x: F.l1_loss(x, torch.zeros(3), weight=w))(x)  # unweighted: [2., 5.]
    tensor([1., 4.])
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

pytorch_l1_loss = F.l1_loss  # PyTorch's own


@functools.wraps(pytorch_l1_loss)
def l1_loss(input: Tensor, target: Tensor, size_average: bool | None = None,
            reduce: bool | None = None, reduction: str = "mean",
            weight: Tensor | None = None) -> Tensor:
    # PyTorch's docstring (functools.wraps): this is F.l1_loss from now on
    if weight is not None and has_torch_function_variadic(input, target):
        return handle_torch_function(
            l1_loss, (input, target, weight), input, target, size_average=size_average,
            reduce=reduce, reduction=reduction, weight=weight,
        )
    return pytorch_l1_loss(input, target, size_average, reduce, reduction, weight)


def install() -> None:
    """Route weighted ``F.l1_loss`` calls on subclasses through ``__torch_function__``
    with their weight (done on import)."""
    F.l1_loss = l1_loss


install()
