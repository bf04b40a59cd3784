"""Forward AD's ZeroTensor tangents, and the ops that can do without them.

Forward AD gives an operand that has no tangent a ZeroTensor one, and PyTorch's ZeroTensor
arithmetic learns its result's shape by running the op on meta tensors through Python:
100-400 us an op (x * 0.5, x + bias, a linear layer's or a norm's captured bias and
weight), where the op with tangents takes 5-60. For a number, the op's Scalar overload
has no second tangent (its formula is the same, less that term). A tensor whose tangent
the formula only adds or selects (a sum's operands, a bias, maximum's) gets an explicit
zero one, and so does a norm's weight where its tangent only multiplies the normalized
input of statistics computed here (not from running stats): where that is not finite,
so are the whole row's or group's outputs and tangents. No value changes.

Both the jvp level (autodiff.py) and its path on a vmap level's physical tensors
(jvp_over_vmap.py) use these tables.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
SCALAR_OVERLOADS = {
    aten.mul.Tensor: aten.mul.Scalar, aten.mul_.Tensor: aten.mul_.Scalar,
    aten.add.Tensor: aten.add.Scalar, aten.add_.Tensor: aten.add_.Scalar,
    aten.sub.Tensor: aten.sub.Scalar, aten.sub_.Tensor: aten.sub_.Scalar,
    aten.div.Tensor: aten.div.Scalar, aten.div_.Tensor: aten.div_.Scalar,
    aten.div.Tensor_mode: aten.div.Scalar_mode, aten.div_.Tensor_mode: aten.div_.Scalar_mode,
}


def _batch_norm_zero_tangents(args: tuple) -> tuple[int, ...]:
    """Batch norm's bias, and its weight in training (``training`` is argument 5)."""
    return (1, 2) if len(args) > 5 and args[5] else (2,)


ZERO_TANGENT_ARGUMENTS = {  # op -> the positions of the arguments that may take one
    aten.add.Tensor: (0, 1), aten.sub.Tensor: (0, 1), aten.rsub.Tensor: (0, 1),
    aten.add_.Tensor: (1,), aten.sub_.Tensor: (1,),
    # (their formulas pick or average the tangents: other_t + mask * (self_t - other_t))
    aten.maximum.default: (0, 1), aten.minimum.default: (0, 1), aten.fmax.default: (0, 1),
    aten.fmin.default: (0, 1), aten.addmm.default: (0,), aten.addmv.default: (0,),
    aten.baddbmm.default: (0,), aten.addbmm.default: (0,), aten.addcmul.default: (0,),
    aten.addcdiv.default: (0,), aten.convolution.default: (2,),
    aten.native_layer_norm.default: (2, 3), aten.native_group_norm.default: (1, 2),
    aten.native_batch_norm.default: _batch_norm_zero_tangents,
    aten._native_batch_norm_legit.default: _batch_norm_zero_tangents,
    aten._native_batch_norm_legit.no_stats: (1, 2),
    aten._native_batch_norm_legit_no_training.default: (2,),
}
WITHOUT_ZERO_TANGENTS = frozenset((*SCALAR_OVERLOADS, *ZERO_TANGENT_ARGUMENTS))
NUMBER_TYPES = (int, float, bool, complex)
