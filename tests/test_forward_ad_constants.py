"""jvp through arithmetic with numbers and with tensors that have no tangent.

Forward AD gives such an operand a ZeroTensor tangent, and PyTorch's ZeroTensor kernels
of the arithmetic ops find their result's shape through Python references (100-300 us
an op). The jvp level runs these ops as their Scalar overloads, or, for a sum, with an
explicit zero tangent, and a product with one operand's tangent by its formula less the
ZeroTensor: the results must stay torch.func's (jvp's bit for bit where the formula is the
same), with infinities and NaNs in the primals too.
"""

import pytest
import torch
import torch.func as tf
import torch.nn.functional as F
from test_transforms_api import assert_tree_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import torchlevels as tl

aten = torch.ops.aten


class _ZeroTensors(TorchDispatchMode):
    """Records the shapes of the ZeroTensors made under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._efficientzerotensor.default:
            self.shapes.append(list(args[0]))
        return func(*args, **(kwargs or {}))


B = torch.randn(4)  # captured tensors, with no tangent
W = torch.randn(4, 4)
FUNCTIONS = {
    "times a number": lambda x: x * 0.5 + 2 * x,
    "plus and minus numbers": lambda x: (x + 1.5) - 3 + (1 - x),
    "divided by numbers": lambda x: x / 4 + torch.div(x, 3, rounding_mode=None),
    "add with alpha": lambda x: torch.add(x, 2.0, alpha=3) + torch.sub(x, 1, alpha=0.5),
    "complex number": lambda x: (x * 1j + 2j).abs(),
    "bool number": lambda x: x * True + x,
    "plus a captured tensor": lambda x: x + B - B.exp() + (B - x),
    "plus a captured tensor with alpha":
        lambda x: torch.add(x, B, alpha=2) + torch.sub(B, x, alpha=3),
    "in place": lambda x: x.clone().mul_(0.5).add_(1).sub_(B).div_(2),
    "broadcast": lambda x: x[:, None] + B + 0.5,
    "plus an expanded captured tensor": lambda x: x + B[None].expand(3, 4) + x.expand(3, 4),
    "float64 number into float32": lambda x: x * 1e-3 + 1e300 * 0,
    "linear with a bias": lambda x: F.linear(x[None], W, B) + F.linear(x, W, B),
    "addmm, addmv, baddbmm": lambda x: (torch.addmm(B, x[None], W, beta=2).sum()
                                        + torch.addmv(B, W, x, alpha=3)
                                        + torch.baddbmm(B, x[None, None], W[None])),
    "layer norm with an affine weight": lambda x: F.layer_norm(x, (4,), B, B)
                                                  + F.layer_norm(x, (4,), B),
    "group norm": lambda x: F.group_norm(x.view(1, 4, 1), 2, B, B),
    "batch norm in training": lambda x: F.batch_norm(x.view(2, 2, 1).repeat(1, 2, 1), None,
                                                     None, B, B, training=True),
    "batch norm in eval": lambda x: F.batch_norm(x.view(1, 4), B, B.abs() + 1, B, B),
    "convolution with a bias": lambda x: F.conv1d(x.view(1, 1, 4), W[:2, None, :2], B[:2]),
    "maximum and minimum": lambda x: (torch.maximum(x, B) + torch.minimum(B, x)
                                      + torch.fmax(x, B.where(B > 0, float("nan")))
                                      + torch.fmin(B, x) + torch.rsub(x, B, alpha=2)),
    "addcmul and addcdiv": lambda x: torch.addcmul(B, x, x, value=2)
                                     + torch.addcdiv(B, x, x.exp()),
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_jvp_and_jacfwd_of_arithmetic_with_constants_equal_torch_func(name):
    f = FUNCTIONS[name]
    x, t = torch.randn(4), torch.randn(4)
    assert_tree_close(tl.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)), rtol=0, atol=0)
    # (jacfwd runs small pointwise ops on one copy of the primal per basis tangent, see
    # jvp_over_vmap.py, where a kernel's vector loop may round differently in the last bit)
    assert_tree_close(tl.jacfwd(f)(x), tf.jacfwd(f)(x))
    xs = torch.randn(3, 4)
    assert_tree_close(tl.vmap(tl.jacfwd(f))(xs), tf.vmap(tf.jacfwd(f))(xs))
    assert_tree_close(tl.jvp(tl.grad(lambda x: f(x).sum()), (x,), (t,)),
                      tf.jvp(tf.grad(lambda x: f(x).sum()), (x,), (t,)))


def test_tangents_stay_finite_where_the_primal_is_infinite():
    # a ZeroTensor is a strong zero (0 * inf = 0): the Scalar overloads keep that
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0])
    t = torch.ones(4)
    norms = ["layer norm with an affine weight", "group norm", "batch norm in training",
             "batch norm in eval", "convolution with a bias", "addcmul and addcdiv",
             "maximum and minimum"]
    for f in (lambda x: x * 0.5, lambda x: x / 2, lambda x: x + B, lambda x: 3.0 - x * 2,
              lambda x: F.linear(x[None], W, B),
              lambda x: torch.maximum(x, x.detach().nan_to_num(0.0)) + torch.fmin(B, x),
              lambda x: F.layer_norm(x.view(2, 2), (2,), B[:2], B[:2]),
              *map(FUNCTIONS.get, norms)):
        assert_tree_close(tl.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,)), equal_nan=True)


def test_no_zero_tensor_is_made_for_numbers_added_constants_biases_and_norm_weights():
    x, t = torch.randn(4), torch.randn(4)
    names = ["plus a captured tensor", "times a number", "linear with a bias",
             "layer norm with an affine weight", "group norm", "batch norm in training",
             "addcmul and addcdiv", "maximum and minimum"]
    for f in map(FUNCTIONS.get, names):
        with _ZeroTensors() as ours:
            tl.jvp(f, (x,), (t,))
        with _ZeroTensors() as theirs:
            tf.jvp(f, (x,), (t,))
        assert [4] not in ours.shapes and [4] in theirs.shapes


Wc = torch.randn(4, 4, dtype=torch.complex64)
PRODUCTS = {  # a product with a captured operand: its tangent is the product with the tangent
    "mul": lambda x: x * B + B * x + x * torch.arange(4) + x * B.double(),
    "div": lambda x: x / B + x / torch.arange(4) + x / B.double() + ((x * 1j) / Wc[0]).real + B / x,
    "complex mul": lambda x: (x * Wc[0]).real + (Wc[1] * x).imag,
    "mm": lambda x: x[None].mm(W) + W.mm(x[:, None]).T,
    "mv": lambda x: W.mv(x) + x.view(2, 2).mv(B[:2]).repeat(2),
    "bmm": lambda x: (torch.bmm(x.view(1, 2, 2), W[None, :2, :2])
                      + torch.bmm(W[None, :2, :2], x.view(1, 2, 2))).flatten(),
    "addmm, addmv, baddbmm": lambda x: (torch.addmm(B, x[None], W, alpha=2, beta=3)
                                        + torch.addmm(B[:, None], W, x[:, None]).T
                                        + torch.addmv(B, W, x, alpha=0.5)
                                        + torch.baddbmm(B[:2], x.view(1, 2, 2),
                                                        W[None, :2, :2]).flatten()),
    "linear, matmul, einsum": lambda x: (F.linear(x, W, B) + F.linear(x.view(2, 2), W[:, :2]).sum(0)
                                         + x @ W + torch.einsum("i,ij->j", x, W)),
    "complex mm": lambda x: x.to(torch.complex64)[None].mm(Wc).imag,
    "convolution": lambda x: (F.conv1d(x.view(1, 1, 4), W[:2, None, :2], B[:2])
                              + F.conv1d(x.view(1, 1, 4), W[:2, None, :2]),
                              F.conv_transpose1d(x.view(1, 1, 4), W[:1, None, :2], B[:1])),
    "convolution's weight": lambda x: F.conv1d(W[:1, None, :], x.view(1, 1, 4)[:, :, :2], B[:1]),
}
PRIMALS = {
    "random": torch.randn(4),
    "infinite": torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0]),
    "signed zeros": torch.tensor([-0.0, 0.0, 1.0, -1.0]),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, its NaNs and infinities as numbers, to compare bit for bit."""
    return (torch.view_as_real(t) if t.is_complex() else t).nan_to_num(7.0, 8.0, 9.0)


@pytest.mark.parametrize("primal", list(PRIMALS))
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_jvp_of_a_product_with_a_captured_operand_equals_torch_func_bit_for_bit(name, primal):
    """Its tangent is computed apart, as PyTorch's formula does, less the ZeroTensor of
    the captured operand; the matrix products' term of that zero is multiplied out, as
    PyTorch does (inf * 0 is nan there), and mul's adds nothing."""
    f, x, t = PRODUCTS[name], PRIMALS[primal], torch.randn(4)
    ours, theirs = tl.jvp(f, (x,), (t,)), tf.jvp(f, (x,), (t,))
    for a, b in zip(*map(tree_leaves, (ours, theirs))):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
        assert torch.equal(_bits(a).signbit(), _bits(b).signbit())
    xs = torch.randn(3, 4)
    assert_tree_close(tl.vmap(tl.jacfwd(f))(xs), tf.vmap(tf.jacfwd(f))(xs), equal_nan=True)

    def total(x):
        return sum(y.sum() for y in (f(x) if isinstance(f(x), tuple) else (f(x),)))

    assert_tree_close(tl.jacfwd(tl.jacrev(total))(xs[0]), tf.jacfwd(tf.jacrev(total))(xs[0]),
                      equal_nan=True)
    assert_tree_close(tl.jvp(tl.grad(total), (x,), (t,)), tf.jvp(tf.grad(total), (x,), (t,)),
                      equal_nan=True)


def test_no_zero_tensor_is_made_for_a_captured_operand_of_a_product():
    """Under an enclosing vmap such a ZeroTensor product took ~400 us an op."""
    x, t = torch.randn(4), torch.randn(4)
    functions = {name: PRODUCTS[name] for name in
                 ["mm", "mv", "addmm, addmv, baddbmm", "linear, matmul, einsum", "convolution"]}
    functions["mul and div"] = lambda x: x * B / B
    for name, f in functions.items():
        with _ZeroTensors() as ours:
            tl.vmap(tl.jacfwd(f))(torch.randn(3, 4))
            tl.jvp(f, (x,), (t,))
        assert ours.shapes == [], name
        if name != "addmm, addmv, baddbmm":  # (torch.func's addmm with beta=3 crashes in
            with _ZeroTensors() as theirs:  # PyTorch under a dispatch mode)
                tf.jvp(f, (x,), (t,))
            assert theirs.shapes != [], name
