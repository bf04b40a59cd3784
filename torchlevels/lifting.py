"""Composite ops whose decomposition writes into tensors made only from captured ones.

PyTorch's recurrent layers decompose (on the CPU) into ops that write in place into
intermediates: a GRU step adds the input's gates into the hidden state's,
``hidden_gates.add_(input_gates)``. Where the hidden state and the weights are captured
(plain tensors, as in ``grad`` with respect to the input), the hidden state's gates are
plain too, and a grad or jvp level must refuse writing its values into them. torch.func
makes every tensor inside a transform one of its own; here these ops take their captured
tensor arguments into the live grad and jvp levels (as constants) before they decompose,
so every intermediate is a level's and the writes are ordinary in-place ops.
"""

from __future__ import annotations

from typing import Any

import torch

from torchlevels._level import enclosing_classes, innermost
from torchlevels.autodiff import GradLevel, JvpLevel, constant
from torchlevels.batching.predispatch import intercept, passed_by

aten = torch.ops.aten

RECURRENT = [
    getattr(packet, name)
    for packet in (aten.gru, aten.lstm, aten.rnn_tanh, aten.rnn_relu, aten.gru_cell,
                   aten.lstm_cell, aten.rnn_tanh_cell, aten.rnn_relu_cell)
    for name in packet.overloads()
]


def _with_captured_lifted(op, args: tuple, kwargs: dict) -> Any:
    levels = [c for c in enclosing_classes(innermost())
              if isinstance(c._level, (GradLevel, JvpLevel))]
    if levels:
        levels.reverse()  # outermost first: an outer constant may then enter an inner level

        def lift(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(map(lift, a))
            if isinstance(a, torch.Tensor):
                for cls in levels:
                    if not isinstance(a, cls):  # below this level
                        a = constant(cls, a)
            return a

        args = tuple(map(lift, args))
    out = op.decompose(*args, **kwargs)  # what runs inside is still intercepted (dropout)
    return passed_by(op, args, kwargs) if out is NotImplemented else out


for _op in RECURRENT:
    intercept(_op, _with_captured_lifted)
