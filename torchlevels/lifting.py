"""Composite ops whose decomposition writes into tensors made only from captured ones.

PyTorch's recurrent layers decompose (on the CPU) into ops that write in place into
intermediates: a GRU step adds the input's gates into the hidden state's,
``hidden_gates.add_(input_gates)``. Where the hidden state and the weights are captured
(plain tensors, as in ``grad`` with respect to the input), the hidden state's gates are
plain too, and a grad or jvp level must refuse writing its values into them. torch.func
makes every tensor inside a transform one of its own; here these ops take their captured
tensor arguments into the live grad and jvp levels (as constants) before they decompose,
so every intermediate is a level's and the writes are ordinary in-place ops.

The single-step cells run out of place instead (the same arithmetic in the same order):
under vmap their hidden state is often unbatched (``GRUCell`` starts from zeros) while the
input's gates are batched, and no level could take those in-place writes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torchlevels._level import LevelTensor, innermost
from torchlevels._process_state import cudnn_off, mkldnn_off
from torchlevels.autodiff import autodiff_classes, constant_throughout
from torchlevels.batching.predispatch import intercept, passed_by

aten = torch.ops.aten

RECURRENT = [
    getattr(packet, name)
    for packet in (aten.gru, aten.lstm, aten.rnn_tanh, aten.rnn_relu, aten.gru_cell,
                   aten.lstm_cell, aten.rnn_tanh_cell, aten.rnn_relu_cell)
    for name in packet.overloads()
]


def _with_captured_lifted(op, args: tuple, kwargs: dict) -> Any:
    cell = _CELLS.get(op)
    if cell is not None:  # out of place: no write to take into a level
        return cell(*args, **kwargs)
    live = innermost()
    if autodiff_classes(live):

        def lift(a: Any) -> Any:
            if isinstance(a, (list, tuple)):
                return type(a)(map(lift, a))
            if isinstance(a, torch.Tensor):
                return constant_throughout(live, a)
            return a

        args = tuple(map(lift, args))
    # an LSTM whose arguments do not require grad (a level's tensors never report it, and
    # under no_grad or inference_mode nothing does) takes oneDNN's layer kernel, which has
    # no forward AD, whose differentiable backward writes batched cotangents into plain
    # buffers, and whose tuple of outputs vmap cannot batch; on CUDA, cuDNN's, which has
    # no forward AD or batching rule either: under any level, plain ops
    # (what runs inside the decomposition is still intercepted: dropout)
    if live is None:
        out = op.decompose(*args, **kwargs)
    else:
        with mkldnn_off, cudnn_off:
            out = op.decompose(*args, **kwargs)
    return passed_by(op, args, kwargs) if out is NotImplemented else out


def _gru_cell(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    i_r, i_z, i_n = F.linear(x, w_ih, b_ih).chunk(3, 1)
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, 1)
    reset = (h_r + i_r).sigmoid()
    update = (h_z + i_z).sigmoid()
    new = (i_n + h_n * reset).tanh()
    return (h - new) * update + new


def _lstm_cell(x, hc, w_ih, w_hh, b_ih=None, b_hh=None):
    h, c = hc
    gates = F.linear(h, w_hh, b_hh) + F.linear(x, w_ih, b_ih)
    in_gate, forget_gate, cell_gate, out_gate = gates.chunk(4, 1)
    cy = forget_gate.sigmoid() * c + in_gate.sigmoid() * cell_gate.tanh()
    return out_gate.sigmoid() * cy.tanh(), cy


def _simple_cell(nonlinearity):
    def cell(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
        return nonlinearity(F.linear(h, w_hh, b_hh) + F.linear(x, w_ih, b_ih))

    return cell


_CELLS = {
    aten.gru_cell.default: _gru_cell,
    aten.lstm_cell.default: _lstm_cell,
    aten.rnn_tanh_cell.default: _simple_cell(torch.tanh),
    aten.rnn_relu_cell.default: _simple_cell(torch.relu),
}

for _op in RECURRENT:
    intercept(_op, _with_captured_lifted)

_flatten_parameters = torch.nn.RNNBase.flatten_parameters


def _flatten_plain_parameters(self: torch.nn.RNNBase) -> None:
    """``nn.RNNBase.flatten_parameters``, which copies the weights into one cuDNN buffer
    by their storage: a level's tensors (an ensemble's stacked weights under vmap) have
    none of their own, and RNN ops under a level run without cuDNN, so it skips them."""
    if not any(isinstance(w, LevelTensor) for w in self._flat_weights):
        _flatten_parameters(self)


torch.nn.RNNBase.flatten_parameters = _flatten_plain_parameters
