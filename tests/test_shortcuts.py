"""vmap's shortcuts (batching/shortcuts.py): each call taken or declined as designed, and
every result equal to torch.func.vmap's on the same inputs."""

import functools
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap as func_vmap
from torch.overrides import TorchFunctionMode
from vmap_reference import counting_dispatches

import torchlevels
from torchlevels import EscapedTensorError, vmap
from torchlevels.autodiff import GradLevel
from torchlevels.batching import registry, shortcuts
from torchlevels.batching.pointwise import pointwise_rule
from torchlevels.batching.shortcuts import (
    ACTIVATIONS,
    POINTWISE_DUNDERS,
    POINTWISE_NAMES,
    SHORTCUTS,
)
from torchlevels.vmap import BatchLevel

assert_close = torch.testing.assert_close


def same(f, *args, shortcut: bool, in_dims=0):
    """torchlevels.vmap(f) equals torch.func.vmap(f); ``shortcut``: no op reached dispatch."""
    with counting_dispatches(BatchLevel) as calls:
        ours = vmap(f, in_dims=in_dims)(*args)
    assert_close(ours, func_vmap(f, in_dims=in_dims)(*args), equal_nan=True)
    assert (not calls) == shortcut, f"ops that reached dispatch: {calls}"
    return ours


def _inputs(func, batch: int, shape: tuple) -> list[torch.Tensor]:
    """As many batched inputs as ``func`` takes: floats in (0.1, 0.9), inside every
    function's domain, or integers for the bitwise ops."""
    makers = (lambda: torch.rand(batch, *shape) * 0.8 + 0.1,
              lambda: torch.randint(1, 9, (batch, *shape)))
    for make in makers:
        for n in (1, 2, 3):
            try:
                out = func(*[make()[0] for _ in range(n)])
            except (TypeError, RuntimeError):
                continue
            if isinstance(out, torch.Tensor):  # not NotImplemented from a dunder
                return [make() for _ in range(n)]
    raise AssertionError(f"{func} takes none of 1-3 float or int tensors")


POINTWISE = [getattr(torch, n) for n in POINTWISE_NAMES] + [
    getattr(torch.Tensor, n) for n in POINTWISE_NAMES + POINTWISE_DUNDERS
]


@pytest.mark.parametrize("func", POINTWISE, ids=lambda f: f"{getattr(f, '__qualname__', f)}")
def test_every_pointwise_shortcut_is_elementwise(func):
    """The list is honest: each function, run on the physical batch, is vmap's answer."""
    xs = _inputs(func, 4, (3,))
    same(func, *xs, shortcut=True)
    if len(xs) > 1:  # a second operand unbatched, of lower rank: still one physical call
        same(func, xs[0], xs[1][0, :1].clone(), *xs[2:], in_dims=(0, None, *[0] * (len(xs) - 2)),
             shortcut=True)


def _in_place_capable(func) -> bool:
    try:
        return "inplace" in inspect.signature(func).parameters
    except ValueError:  # a builtin: none of them takes inplace
        return False


@pytest.mark.parametrize("func", ACTIVATIONS, ids=lambda f: f.__name__)
def test_every_activation_shortcut_is_elementwise(func):
    """Each activation, run on the physical batch, is vmap's answer; and under vmap(grad),
    the grad level's shortcut runs it on the inner tensors (no op reaches its dispatch)."""
    act = functools.partial(func, threshold=0.1, value=20.0) if func is F.threshold else func
    xs = torch.randn(4, 3, 5) * 3
    same(act, xs, shortcut=True)
    same(lambda x: act(x.t()), xs, shortcut=True)
    same(act, xs, in_dims=1, shortcut=False)  # the batch dim not first: the usual way
    loss = lambda x: act(x).pow(2).sum()  # noqa: E731
    with counting_dispatches(GradLevel) as calls:
        ours = vmap(torchlevels.grad(loss))(xs)
    assert_close(ours, func_vmap(torch.func.grad(loss))(xs))
    assert not calls, calls
    if _in_place_capable(func):  # asked to work in place: declined
        same(lambda x: act(x.clone(), inplace=True), xs, shortcut=False)


x4, y4 = torch.randn(4, 5), torch.randn(4, 5)
CASES = {
    # name: (function, args, in_dims, whether the shortcut takes it)
    "scalar operand": (lambda x: torch.mul(x, 0.5), (x4,), 0, True),
    "alpha keyword": (lambda x, y: torch.add(x, y, alpha=2), (x4, y4), 0, True),
    "clamp with numbers": (lambda x: x.clamp(min=-0.5, max=0.5), (x4,), 0, True),
    "clamp with a tensor bound": (lambda x, y: x.clamp(min=y), (x4, y4), 0, False),
    "batch dim not first": (torch.sin, (x4.t(),), 1, False),
    "unbatched operand of higher rank": (torch.add, (x4, torch.randn(2, 5)), (0, None), False),
    "batched 0-dim and unbatched 0-dim of another dtype": (
        torch.add, (torch.randn(4), torch.tensor(2.0, dtype=torch.float64)), (0, None), False),
    "batched 0-dim and a number": (lambda x: x + 2, (torch.randint(0, 5, (4,)),), 0, True),
    "operands of different logical rank": (torch.mul, (x4, torch.randn(4, 3, 5)), 0, True),
    "operands of three logical ranks and an unbatched one": (
        lambda x, y, z, w: torch.addcmul(x, y, z) * w,
        (torch.randn(4, 2, 1, 5), x4, torch.randn(4, 3, 1), torch.randn(3, 5)), (0, 0, 0, None),
        True),
    "outer product of batched vectors": (lambda x, y: x[:, None] * y, (x4, y4), 0, True),
    "masked_fill by a mask of more dims": (lambda x, m: x.masked_fill(m, 0.0), (
        x4, torch.rand(4, 3, 5) > 0.5), 0, True),
    "batched 0-dim and batched 1-dim of another dtype": (
        torch.add, (torch.randn(4, 3), torch.randn(4, dtype=torch.float64)), 0, False),
    "batched 0-dim ints and batched floats": (
        torch.mul, (torch.randint(0, 5, (4,)), torch.randn(4, 3)), 0, False),
    "norm along a dim": (lambda x: x.norm(dim=-1), (torch.randn(4, 3, 5),), 0, True),
    "torch.norm, p and dims positional": (lambda x: torch.norm(x, 3, (0, 1), True), (
        torch.randn(4, 3, 5),), 0, True),
    "nuclear norm over two dims": (lambda x: x.norm("nuc", dim=(1, 2)), (
        torch.randn(4, 2, 3, 5),), 0, True),
    "norm of all elements": (lambda x: x.norm(), (torch.randn(4, 3, 5),), 0, True),
    "torch.norm of all elements, p=1, keepdim": (lambda x: torch.norm(x, 1, keepdim=True), (
        torch.randn(4, 3, 5),), 0, True),
    "norm of all elements, p=None, dtype": (lambda x: x.norm(None, dtype=torch.float64), (
        torch.randn(4, 3, 5),), 0, True),
    "nuclear norm of a whole example": (lambda x: x.norm("nuc"), (torch.randn(4, 3, 5),), 0,
                                        False),
    "norm of a 0-dim example": (lambda x: x.norm(), (torch.randn(4),), 0, False),
    "relu": (F.relu, (x4,), 0, True),
    "relu in place": (lambda x: F.relu(x.clone(), inplace=True), (x4,), 0, False),
    "leaky_relu, slope positional": (lambda x: F.leaky_relu(x, 0.1), (x4,), 0, True),
    "gelu tanh": (lambda x: F.gelu(x, approximate="tanh"), (x4,), 0, True),
    "linear": (lambda x, w, b: F.linear(x, w, b), (torch.randn(4, 3, 5), torch.randn(2, 5),
                                                   torch.randn(2)), (0, None, None), True),
    "linear, batched weight": (F.linear, (x4, torch.randn(4, 2, 5)), 0, False),
    "linear of a vector": (F.linear, (x4, torch.randn(2, 5)), (0, None), True),
    "conv2d of one image": (lambda x, w: F.conv2d(x, w, padding=1), (
        torch.randn(4, 3, 6, 6), torch.randn(2, 3, 3, 3)), (0, None), True),
    "conv2d of an image batch": (lambda x, w: F.conv2d(x, w), (
        torch.randn(4, 2, 3, 6, 6), torch.randn(2, 3, 3, 3)), (0, None), True),
    "conv2d of an image batch of one": (lambda x, w: F.conv2d(x.unsqueeze(0), w, stride=2), (
        torch.randn(4, 3, 7, 7), torch.randn(2, 3, 3, 3)), (0, None), True),
    "conv2d of an image batch, batched weight": (F.conv2d, (
        torch.randn(4, 2, 3, 6, 6), torch.randn(4, 2, 3, 3, 3)), 0, False),
    "max_pool2d with indices of an image batch": (
        lambda x: F.max_pool2d(x, 2, return_indices=True), (torch.randn(4, 2, 3, 6, 6),), 0,
        True),
    "avg_pool1d of a batch of zero": (lambda x: F.avg_pool1d(x, 2), (torch.randn(4, 0, 3, 6),),
                                      0, True),
    "conv1d, bias keyword": (lambda x, w, b: F.conv1d(x, w, bias=b, stride=2), (
        torch.randn(4, 3, 9), torch.randn(2, 3, 3), torch.randn(2)), (0, None, None), True),
    "max_pool2d with indices": (lambda x: F.max_pool2d(x, 2, return_indices=True), (
        torch.randn(4, 3, 6, 6),), 0, True),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), (torch.randn(4, 3, 6),), 0, True),
    "adaptive_avg_pool2d": (lambda x: F.adaptive_avg_pool2d(x, 2), (
        torch.randn(4, 3, 6, 6),), 0, True),
    "flatten": (lambda x: x.flatten(), (torch.randn(4, 2, 3, 5),), 0, True),
    "flatten(1)": (lambda x: x.flatten(1), (torch.randn(4, 2, 3, 5),), 0, True),
    "torch.flatten(x, 0, -2)": (lambda x: torch.flatten(x, 0, -2), (torch.randn(4, 2, 3, 5),),
                                0, True),
    "flatten(start_dim=1)": (lambda x: x.flatten(start_dim=1), (torch.randn(4, 2, 3, 5),), 0,
                             True),
    "flatten of a 0-dim example": (lambda x: x.flatten(), (torch.randn(4),), 0, False),
    "unsqueeze(0)": (lambda x: x.unsqueeze(0), (torch.randn(4, 2, 3),), 0, True),
    "unsqueeze(-1)": (lambda x: torch.unsqueeze(x, -1), (torch.randn(4, 2, 3),), 0, True),
    "unsqueeze(dim=2) at the end": (lambda x: x.unsqueeze(dim=2), (torch.randn(4, 2, 3),), 0,
                                    True),
    "unsqueeze(-3) at the front": (lambda x: x.unsqueeze(-3), (torch.randn(4, 2, 3),), 0, True),
    "unsqueeze of a 0-dim example": (lambda x: x.unsqueeze(0), (torch.randn(4),), 0, True),
    "view(-1, 3)": (lambda x: x.view(-1, 3), (torch.randn(4, 2, 3, 5),), 0, True),
    "view(torch.Size)": (lambda x: x.view(torch.Size([6, 5])), (torch.randn(4, 2, 3, 5),), 0,
                         True),
    "reshape of a transposed example": (lambda x: x.t().reshape(10), (torch.randn(4, 2, 5),),
                                        0, True),
    "torch.reshape(x, [5, -1])": (lambda x: torch.reshape(x, [5, -1]), (x4,), 0, True),
    "view as a dtype": (lambda x: x.view(torch.int32), (x4,), 0, False),
    "view of no examples": (lambda x: x.view(6), (torch.randn(0, 2, 3),), 0, False),
    "reshape, batch dim not first": (lambda x: x.reshape(-1), (torch.randn(2, 4, 3),), 1, False),
    "transpose(0, -1)": (lambda x: x.transpose(0, -1), (torch.randn(4, 2, 3, 5),), 0, True),
    "torch.transpose(x, 1, 0)": (lambda x: torch.transpose(x, 1, 0), (torch.randn(4, 2, 3),),
                                 0, True),
    "transpose of a 0-dim example": (lambda x: x.transpose(0, -1), (torch.randn(4),), 0, False),
    "t()": (lambda x: x.t(), (torch.randn(4, 2, 3),), 0, True),
    "torch.t of a vector": (torch.t, (x4,), 0, False),
    "permute(2, 0, 1)": (lambda x: x.permute(2, 0, 1), (torch.randn(4, 2, 3, 5),), 0, True),
    "torch.permute(x, (-1, 0))": (lambda x: torch.permute(x, (-1, 0)), (torch.randn(4, 2, 3),),
                                  0, True),
    "clone (no shortcut)": (lambda x: x.clone(), (x4,), 0, False),
}

x3, m3 = torch.randn(4, 2, 1, 3), torch.rand(4, 2, 1, 3) > 0.5
w3 = torch.randn(3)
# calls along dims, indexing, products (the example's dims shift by one)
CASES.update({
    "sum(-1)": (lambda x: x.sum(-1), (x3,), 0, True),
    "sum() of every dim": (lambda x: x.sum(), (x3,), 0, True),
    "sum of a 0-dim example": (lambda x: x.sum(), (torch.randn(4),), 0, False),
    "sum(dim=[]), every dim": (lambda x: x.sum(dim=[]), (x3,), 0, False),
    "sum, dtype keyword": (lambda x: torch.sum(x, 0, dtype=torch.float64), (x3,), 0, True),
    "mean((0, -1), keepdim=True)": (lambda x: x.mean((0, -1), keepdim=True), (x3,), 0, True),
    "amax()": (lambda x: x.amax(), (x3,), 0, True),
    "amin(dim=1)": (lambda x: torch.amin(x, dim=1), (x3,), 0, True),
    "std(unbiased) of every dim": (lambda x: x.std(False), (x3,), 0, False),
    "var(0, correction=0)": (lambda x: x.var(0, correction=0), (x3,), 0, True),
    "std()": (lambda x: torch.std(x), (x3,), 0, True),
    "logsumexp(-1)": (lambda x: x.logsumexp(-1), (x3,), 0, True),
    "prod(1)": (lambda x: x.prod(1), (x3,), 0, True),
    "argmax(-1)": (lambda x: x.argmax(-1), (x3,), 0, True),
    "argmax() of the flattened example": (lambda x: x.argmax(), (x3,), 0, False),
    "F.softmax(dim=-1)": (lambda x: F.softmax(x, dim=-1), (x3,), 0, True),
    "F.log_softmax(x, 0)": (lambda x: F.log_softmax(x, 0), (x3,), 0, True),
    "Tensor.softmax(1, dtype)": (lambda x: x.softmax(1, dtype=torch.float64), (x3,), 0, True),
    "softmax, batch dim not first": (lambda x: x.softmax(-1), (x3,), 1, False),
    "cumsum(dim=1)": (lambda x: x.cumsum(dim=1), (x3,), 0, True),
    "split(2, -1)": (lambda x: x.split(2, -1), (x3,), 0, True),
    "torch.split(x, [1, 1], dim=0)": (lambda x: torch.split(x, [1, 1], dim=0), (x3,), 0, True),
    "chunk(2)": (lambda x: x.chunk(2), (x3,), 0, True),
    "unbind(-1)": (lambda x: x.unbind(-1), (x3,), 0, True),
    "narrow(-1, 1, 2)": (lambda x: x.narrow(-1, 1, 2), (x3,), 0, True),
    "select(2, -1)": (lambda x: x.select(2, -1), (x3,), 0, True),
    "F.normalize(x)": (lambda x: F.normalize(x), (x3,), 0, True),
    "F.normalize(x, p=1, dim=-1)": (lambda x: F.normalize(x, p=1, dim=-1), (x3,), 0, True),
    "linalg.vector_norm(x)": (torch.linalg.vector_norm, (x3,), 0, True),
    "linalg.vector_norm(x, 3, -1)": (lambda x: torch.linalg.vector_norm(x, 3, -1), (x3,), 0,
                                     True),
    "squeeze()": (lambda x: x.squeeze(), (x3,), 0, True),
    "squeeze() of a batch of one": (lambda x: x.squeeze(), (torch.randn(1, 2, 1),), 0, True),
    "squeeze(1)": (lambda x: torch.squeeze(x, 1), (x3,), 0, True),
    "squeeze((1, 0))": (lambda x: x.squeeze((1, 0)), (x3,), 0, True),
    "layer_norm": (lambda x: F.layer_norm(x, (3,), w3, w3 * 2), (x3,), 0, True),
    "layer_norm, shape as a torch.Size": (lambda x: F.layer_norm(x, x.shape[-2:]), (x3,), 0,
                                          True),
    "layer_norm, batched weight": (lambda x, w: F.layer_norm(x, (3,), w), (
        x3, torch.randn(4, 3)), 0, False),
    "rms_norm": (lambda x: F.rms_norm(x, [1, 3], eps=1e-3), (x3,), 0, True),
    "x[0, ..., None, 1:]": (lambda x: x[0, ..., None, 1:], (x3,), 0, True),
    "x[-1]": (lambda x: x[-1], (x3,), 0, True),
    "x[()]": (lambda x: x[()], (x3,), 0, True),
    "x[::2, 0]": (lambda x: x[::2, 0], (x3,), 0, True),
    "x[tensor]": (lambda x: x[torch.tensor([1, 0])], (x3,), 0, False),
    "x[True]": (lambda x: x[True], (x3,), 0, False),
    "x[[1, 0]]": (lambda x: x[[1, 0]], (x3,), 0, False),
    "expand(5, 2, 2, -1)": (lambda x: x.expand(5, 2, 2, -1), (x3,), 0, True),
    "expand(torch.Size)": (lambda x: x.expand(torch.Size([2, 2, 3])), (x3,), 0, True),
    "expand of a 0-dim example": (lambda x: x.expand(3), (torch.randn(4),), 0, True),
    "torch.where(mask, x, 0.0)": (lambda m, x: torch.where(m, x, 0.0), (m3, x3), 0, True),
    "x.where(mask, y), y unbatched": (lambda x, m, y: x.where(m, y), (x3, m3, w3),
                                      (0, 0, None), True),
    "masked_fill(mask, -inf)": (lambda x, m: x.masked_fill(m, float("-inf")), (x3, m3), 0,
                                True),
    "masked_fill, unbatched mask": (lambda x, m: x.masked_fill(m, 1), (x3, m3[0, 0]),
                                    (0, None), True),
    "masked_fill of an unbatched tensor": (lambda m: x3[0].masked_fill(m, 1), (m3,), 0, False),
    "masked_fill, batched value": (lambda x, m, v: x.masked_fill(m, v), (
        x3, m3, torch.randn(4)), 0, False),
    "cat(dim=-1)": (lambda x: torch.cat([x, x * 2], dim=-1), (x3,), 0, True),
    "cat with an unbatched tensor": (lambda x: torch.cat([x, x3[0]]), (x3,), 0, False),
    "stack(dim=3)": (lambda x: torch.stack((x, x), 3), (x3,), 0, True),
    "stack of 0-dim examples": (lambda x: torch.stack([x, x]), (torch.randn(4),), 0, True),
    "matmul": (lambda a, b: a @ b, (torch.randn(4, 2, 3), torch.randn(4, 3, 5)), 0, True),
    "matmul, unbatched stack of higher rank": (torch.matmul, (
        torch.randn(4, 2, 3), torch.randn(6, 3, 5)), (0, None), True),
    "matmul, unbatched on the left": (lambda a, b: a.matmul(b), (
        torch.randn(6, 2, 3), torch.randn(4, 3, 5)), (None, 0), True),
    "batched vector @ matrix": (lambda a, b: a @ b, (x4, torch.randn(5, 3)), (0, None), True),
    "matrix @ batched vector": (lambda a, b: a @ b, (torch.randn(3, 5), x4), (None, 0), True),
    "batched matrices @ vector": (torch.matmul, (torch.randn(4, 2, 5), torch.randn(5)), (
        0, None), True),
    "vector @ batched matrices": (torch.matmul, (torch.randn(2), torch.randn(4, 2, 5)), (
        None, 0), True),
    "vector @ batched vector": (torch.matmul, (torch.randn(5), x4), (None, 0), True),
    "batched vectors @ each other": (torch.matmul, (x4, y4), 0, True),
    "batched vector @ batched matrices": (torch.matmul, (x4, torch.randn(4, 5, 2)), 0, True),
    "batched matrices @ batched vector": (torch.matmul, (torch.randn(4, 2, 5), x4), 0, True),
    "batched vector @ unbatched stack": (torch.matmul, (x4, torch.randn(6, 5, 2)), (0, None),
                                         True),
    "unbatched stack @ batched vector": (torch.matmul, (torch.randn(6, 2, 5), x4), (None, 0),
                                         True),
    "batched vector @ batched stack": (torch.matmul, (x4, torch.randn(4, 6, 5, 2)), 0, True),
    "dot": (torch.dot, (x4, y4), 0, True),
    "Tensor.dot, one unbatched": (torch.Tensor.dot, (torch.randn(5), y4), (None, 0), True),
    "mv": (torch.mv, (torch.randn(4, 3, 5), y4), 0, True),
    "mm": (torch.mm, (torch.randn(4, 3, 5), torch.randn(5, 2)), (0, None), True),
    "bmm": (torch.bmm, (torch.randn(4, 6, 3, 5), torch.randn(6, 5, 2)), (0, None), True),
    "einsum": (lambda a, b: torch.einsum("ij, kj -> ik", a, b), (
        torch.randn(4, 2, 3), torch.randn(5, 3)), (0, None), True),
    "einsum with ellipses, both batched": (lambda a, b: torch.einsum("...ij,...jk->...ik", a, b), (
        torch.randn(4, 6, 2, 3), torch.randn(4, 3, 5)), 0, True),
    "einsum of a list": (lambda a: torch.einsum("ii->", [a]), (torch.randn(4, 3, 3),), 0, True),
    "einsum, implicit output": (lambda a: torch.einsum("ij", a), (torch.randn(4, 2, 3),), 0,
                                False),
})
q4, k4 = torch.randn(4, 2, 5, 8), torch.randn(4, 2, 3, 8)
mask53 = torch.rand(5, 3) > 0.5
sdpa = F.scaled_dot_product_attention
CASES.update({
    "sdpa": (sdpa, (q4, k4, k4), 0, True),
    "sdpa of 2-d examples": (sdpa, (q4[:, 0], k4[:, 0], k4[:, 0]), 0, True),
    "sdpa, causal, scale keyword": (lambda q: sdpa(q, q, q, None, 0.0, True, scale=0.2),
                                    (q4,), 0, True),
    "sdpa, unbatched mask": (lambda q, k: sdpa(q, k, k, attn_mask=mask53), (q4, k4), 0, True),
    "sdpa of 4-d examples": (sdpa, (q4[:, None].repeat(1, 2, 1, 1, 1),) * 3, 0, True),
    "sdpa of 4-d examples, key broadcast": (
        sdpa, (q4[:, None].repeat(1, 2, 1, 1, 1), k4[:, None], k4[:, None]), 0, False),
    "sdpa, batched mask": (lambda q, k, m: sdpa(q, k, k, m), (
        q4, k4, torch.rand(4, 5, 3) > 0.5), 0, False),
    "sdpa, unbatched key": (sdpa, (q4, k4[0], k4), (0, None, 0), False),
})

y3, v4, u4 = torch.randn(4, 2, 1, 3), torch.randn(4, 3), torch.randn(4, 5)
# losses, factories, the outer product
CASES.update({
    "mse_loss": (F.mse_loss, (x3, y3), 0, True),
    "l1_loss, reduction sum": (lambda x, y: F.l1_loss(x, y, reduction="sum"), (x3, y3), 0,
                               True),
    "smooth_l1_loss, beta": (lambda x, y: F.smooth_l1_loss(x, y, beta=0.5), (x3, y3), 0, True),
    "huber_loss, no reduction": (lambda x, y: F.huber_loss(x, y, "none", 0.3), (x3, y3), 0,
                                 True),
    "mse_loss of 0-dim examples": (F.mse_loss, (v4[:, 0], u4[:, 0]), 0, True),
    "mse_loss, unbatched target": (F.mse_loss, (x3, y3[0]), (0, None), True),
    "mse_loss, unbatched input, sum": (lambda x, y: F.mse_loss(x, y, reduction="sum"), (
        x3[0], y3), (None, 0), True),
    "mse_loss with a weight": (lambda x, y: F.mse_loss(x, y, weight=y.abs()), (x3, y3), 0,
                               False),
    "zeros_like": (torch.zeros_like, (x3,), 0, True),
    "full_like, dtype": (lambda x: torch.full_like(x, 2.0, dtype=torch.float64), (x3,), 0,
                         True),
    "ones_like of a transposed example": (lambda x: torch.ones_like(x.transpose(0, 2)), (
        x3,), 0, True),
    "new_zeros(2, 3)": (lambda x: x.new_zeros(2, 3), (x3,), 0, True),
    "new_ones((2,), dtype)": (lambda x: x.new_ones((2,), dtype=torch.int64), (x3,), 0, True),
    "new_zeros(torch.Size)": (lambda x: x.new_zeros(x.shape), (x3,), 0, True),
    "new_zeros(size=...)": (lambda x: x.new_zeros(size=(2,)), (x3,), 0, False),
    "outer": (torch.outer, (v4, u4), 0, True),
    "outer, unbatched second vector": (torch.outer, (v4, u4[0]), (0, None), True),
    "Tensor.ger, unbatched first vector": (torch.Tensor.ger, (v4[0], u4), (None, 0), True),
    "cosine_similarity": (F.cosine_similarity, (x3, y3), 0, True),
    "cosine_similarity(dim=-1, eps)": (lambda x, y: F.cosine_similarity(x, y, -1, 0.5), (
        x3, y3), 0, True),
    "cosine_similarity, unbatched x2 of lower rank": (
        lambda x, y: F.cosine_similarity(x, y, dim=0), (x3, w3), (0, None), True),
    "cosine_similarity of different ranks": (F.cosine_similarity, (x3, y3[:, 0]), 0, False),
    "F.pad": (lambda x: F.pad(x, (1, 2)), (x3,), 0, True),
    "F.pad of two dims, a value": (lambda x: F.pad(x, [1, 0, 0, 2], value=3.0), (x3,), 0,
                                   True),
    "F.pad, reflect": (lambda x: F.pad(x, (1, 1), mode="reflect"), (torch.randn(4, 2, 5),), 0,
                       False),
    "contiguous of a transposed example": (lambda x: x.transpose(0, 2).contiguous(), (x3,), 0,
                                           True),
    "contiguous(memory_format)": (lambda x: x.transpose(1, 2).contiguous(
        memory_format=torch.contiguous_format), (x3,), 0, True),
    "flip(-1)": (lambda x: x.flip(-1), (x3,), 0, True),
    "flip(0, 2)": (lambda x: x.flip(0, 2), (x3,), 0, True),
    "torch.flip(x, dims=[1, 0])": (lambda x: torch.flip(x, dims=[1, 0]), (x3,), 0, True),
    "triu(1)": (lambda x: x.triu(1), (x3,), 0, True),
    "torch.tril(x, -1)": (lambda x: torch.tril(x, -1), (x3,), 0, True),
})


def test_contiguous_of_a_contiguous_tensor_is_the_tensor():
    five_dims = torch.randn(4, 2, 3, 5, 1)
    with vmap() as B:
        x = B(x3)
        assert x.contiguous() is x
        assert x.mT.contiguous().is_contiguous()
        last = B(five_dims)  # channels_last: vmap's rule, the usual way
        assert shortcuts.contiguous(B, torch.Tensor.contiguous, (last,), {
            "memory_format": torch.channels_last}) is None


def test_factories_like_a_batched_tensor():
    """empty_like's values are unset: its shape, dtype and layout are what counts. A
    channels-last layout is the rule's (torch.func raises for 4-d examples there)."""
    x = torch.randn(4, 2, 3, 1, 5)
    with counting_dispatches(BatchLevel) as calls:
        empty = vmap(lambda x: torch.empty_like(x.transpose(0, 3), dtype=torch.float64))(x)
    assert not calls
    assert empty.shape == (4, 5, 3, 1, 2) and empty.dtype == torch.float64
    assert empty.stride()[1:] == torch.empty_like(x[0].transpose(0, 3)).stride()
    with vmap() as B:
        b = B(x)
        assert shortcuts.like(B, torch.zeros_like, (b,), {
            "memory_format": torch.channels_last}) is None
        last = torch.zeros_like(b, memory_format=torch.channels_last)
        assert last.stride() == torch.zeros_like(x[0], memory_format=torch.channels_last).stride()


def test_factories_like_a_tensor_that_requires_grad():
    """The values do not depend on the tensor's: the shortcut takes an input that requires
    grad outside vmap, and the result needs no grad, as under torch.func (also inside
    vmap(grad))."""
    x = torch.randn(4, 3, requires_grad=True)
    with counting_dispatches(BatchLevel) as calls:
        ones = vmap(lambda x: torch.full_like(x, 2.0))(x)
    assert not calls and not ones.requires_grad
    assert_close(ones, func_vmap(lambda x: torch.full_like(x, 2.0))(x))

    def f(x):
        ones = torch.ones_like(x)
        assert not ones.requires_grad
        return (x * ones + x.new_ones(3) * x).sin().sum()

    assert_close(vmap(torchlevels.grad(f))(x), func_vmap(torch.func.grad(f))(x))


def test_attention_with_dropout_is_left_to_the_randomness_rules():
    with vmap() as B:
        q = B(q4)
        assert shortcuts.attention(B, sdpa, (q, q, q), {"dropout_p": 0.5}) is None
        assert shortcuts.attention(B, sdpa, (q, q, q, None, 0.5), {}) is None


@pytest.mark.parametrize("call", [
    lambda x: x.view(2, 2), lambda x: x.transpose(0, 2), lambda x: x.permute(0),
    lambda x: x.reshape(7, -1), lambda x: x.sum(2), lambda x: x.sum((0, 0)), lambda x: x[5],
    lambda x: x[0, 0, 0], lambda x: x.expand(2), lambda x: torch.concat([x[0, 0], x[0, 0]]),
    lambda x: torch.cat([x, x], 2), lambda x: x.softmax(-3), lambda x: x.split(1, 2),
    lambda x: x.narrow(0, 1, 5), lambda x: x @ x, lambda x: torch.einsum("ij,jk->ik", x, x),
    lambda x: F.layer_norm(x, (2,)), lambda x: torch.where(x > 0, x, torch.zeros(5)),
    lambda x: F.scaled_dot_product_attention(x, x.mT, x), lambda x: x.norm(dim=(0, 1, 2)),
    lambda x: x[0] * x[:, :2], lambda x: x[0, 0] @ x[0, :, 0], lambda x: torch.mm(x[0, 0], x[0]),
    lambda x: x[0, 0, 0] @ x[0, 0], lambda x: torch.dot(x[0, 0], x[0, 0, :2]),
], ids=range(25))
def test_a_bad_view_raises_as_in_torch_func(call):
    x = torch.randn(4, 2, 3)
    with pytest.raises((RuntimeError, IndexError)) as theirs:
        func_vmap(call)(x)
    with pytest.raises((RuntimeError, IndexError)) as ours:
        vmap(call)(x)
    assert type(ours.value) is type(theirs.value)


def test_a_chain_of_views_writes_through_to_its_base():
    def f(x):
        y = x.clone()
        y.view(6).t().reshape(2, 3).transpose(0, 1).permute(1, 0)[0].mul_(10)
        return y

    same(f, torch.randn(4, 2, 3), shortcut=False)


@pytest.mark.parametrize("case", CASES)
def test_taken_or_declined_and_equal_to_torch_func(case):
    func, args, in_dims, shortcut = CASES[case]
    same(func, *args, in_dims=in_dims, shortcut=shortcut)


def test_nested_vmap_takes_shortcuts_at_every_level():
    w = torch.randn(3, 5)
    f = lambda x, y: F.linear(torch.tanh(x * y), w)  # noqa: E731
    x, y = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    with counting_dispatches(BatchLevel) as calls:
        ours = vmap(vmap(f))(x, y)
    assert_close(ours, func_vmap(func_vmap(f))(x, y))
    assert not calls
    # y batched at the outer level only: an unbatched operand at the inner one, which
    # hands it on; the outer level then sees operands of two ranks, and pads the lower
    with counting_dispatches(BatchLevel) as calls:
        mixed = vmap(vmap(f, in_dims=(0, None)))(x, y[:, 0])
    assert_close(mixed, func_vmap(func_vmap(f, in_dims=(0, None)))(x, y[:, 0]))
    assert not calls



def test_losses_and_products_in_nested_vmap():
    """Operands batched at the outer level only, which the inner level's shortcuts hand
    on. torch.func raises for the loss of such operands, so the reference is a loop."""
    def f(x, y):
        return (F.mse_loss(x, y) + F.l1_loss(y, x, reduction="sum")
                + torch.outer(x, y).sum(-1) + F.cosine_similarity(x, y, 0)
                + torch.zeros_like(y).sum() + x.new_ones(2).sum())

    x, y = torch.randn(2, 4, 5), torch.randn(2, 5)
    ours = vmap(vmap(f, in_dims=(0, None)))(x, y)
    assert_close(ours, torch.stack([torch.stack([f(xi, yo) for xi in xo])
                                    for xo, yo in zip(x, y)]))

def test_outer_autograd_sees_the_ops_of_inputs_that_require_grad():
    w = torch.randn(3, 5, requires_grad=True)
    x = torch.randn(4, 5, requires_grad=True)
    f = lambda x: F.linear(torch.sin(x) * 2, w).relu()  # noqa: E731
    for transform in (vmap, func_vmap):
        transform(f)(x).square().sum().backward()
    theirs = [t.grad.clone() for t in (x, w)]
    x.grad = w.grad = None
    vmap(f)(x).square().sum().backward()
    assert_close([x.grad, w.grad], [t / 2 for t in theirs])  # each ran backward once more


@pytest.mark.parametrize("outer", ["grad", "jvp", "jacrev"])
def test_shortcut_ops_under_autodiff(outer):
    w = torch.randn(5, 5)

    def f(x):
        return F.linear(torch.tanh(x) * x, w).flatten().relu().sum()

    x = torch.randn(4, 5)
    for lib in (torchlevels, torch.func):
        inner = {"grad": lib.grad(f), "jacrev": lib.jacrev(f),
                 "jvp": lambda x, lib=lib: lib.jvp(f, (x,), (torch.ones_like(x),))[1]}[outer]
        result = lib.vmap(inner)(x)
        if lib is torchlevels:
            ours = result
    assert_close(ours, result)
    ours = torchlevels.grad(lambda x: torchlevels.vmap(f)(x).sum())(x)
    assert_close(ours, torch.func.grad(lambda x: torch.func.vmap(f)(x).sum())(x))


def test_an_escaped_tensor_still_raises():
    box = []
    vmap(lambda x: box.append(x) or x)(x4)
    with pytest.raises(EscapedTensorError, match="escaped"):
        torch.sin(box[0])


def test_a_torch_function_mode_sees_the_user_call():
    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recording():
        ours = vmap(torch.sin)(x4)
    assert torch.sin in seen
    assert_close(ours, torch.sin(x4))


def test_a_foreign_torch_function_subclass_goes_first():
    calls = []

    class Tagged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    tag = torch.randn(5).as_subclass(Tagged)
    ours = vmap(lambda x: torch.add(x, tag), in_dims=0)(x4)
    assert torch.add in calls
    assert_close(ours.as_subclass(torch.Tensor), x4 + tag.as_subclass(torch.Tensor))


@pytest.mark.parametrize("fn, op", [(torch.sin, torch.ops.aten.sin.default),
                                     (torch.cos, torch.ops.aten.cos)],  # an op packet
                         ids=["overload", "packet"])
def test_a_users_rule_for_an_aten_op_switches_the_shortcuts_off(fn, op):
    seen = []

    def rule(func, args, dims, kwargs):
        seen.append(func)
        return pointwise_rule(func, args, dims, kwargs)

    try:
        torchlevels.register_batching_rule(op)(rule)
        assert not SHORTCUTS
        assert_close(vmap(fn)(x4), fn(x4))
        assert seen == [getattr(torch.ops.aten, fn.__name__).default]
    finally:  # the library's own state back: the op batched by its family, shortcuts on
        registry._own.pop(op)
        registry.resolved_by_id.clear()
        shortcuts.switch_on()
    assert SHORTCUTS


def test_vmap_and_grad_levels_have_shortcuts_of_their_own():
    """A jvp level has none, nor a grad level inside one (its shortcuts would decline every
    call under forward AD; torchlevels/grad_shortcuts.py): they only hand a foreign
    subclass its calls."""
    with torchlevels.vmap() as B:
        assert B.__torch_function__.__func__.__module__ == "torchlevels.batching.shortcuts"
        with torchlevels.grad_level() as G:
            assert G.__torch_function__.__func__.__module__ == "torchlevels.grad_shortcuts"
        with torchlevels.jvp_level() as J, torchlevels.grad_level() as G:
            assert J.__torch_function__.__func__ is shortcuts.no_shortcuts
            assert G.__torch_function__.__func__ is shortcuts.no_shortcuts
    assert len(SHORTCUTS) > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_strides_of_size_one_dims_as_torch_func_shows_them(dtype):
    """A contiguous tensor may have any stride at a dim of size 1: a shortcut's result
    (and a grad level's tensor) shows the strides PyTorch gave it, as torch.func does,
    not those a new tensor of its shape would have."""
    def strides(f, x):
        seen = []
        f(lambda a: seen.append(a.stride()) or a)(x)
        return seen

    def transposed_product(record):
        return lambda a: record(a.transpose(0, 1) * 2).sum()

    x = torch.randn(3, 1, 4, dtype=dtype)
    assert strides(lambda g: vmap(transposed_product(g)), x) == strides(
        lambda g: func_vmap(transposed_product(g)), x)
    row = torch.randn(4, 1, dtype=dtype).t()  # (1, 4), strides (1, 1)
    assert strides(lambda g: torchlevels.grad(lambda a: g(a * 1).sum()), row) == strides(
        lambda g: torch.func.grad(lambda a: g(a * 1).sum()), row)


_W = torch.randn(5, 4)
# calls of shortcut functions given their tensors as keywords (no positional argument)
KEYWORD_CALLS = {
    "sum": lambda a: torch.sum(input=a, dim=0),
    "cat": lambda a: torch.cat(tensors=[a, a]),
    "stack": lambda a: torch.stack(tensors=[a, a], dim=1),
    "zeros_like": lambda a: torch.zeros_like(input=a) + a,
    "softmax": lambda a: torch.softmax(input=a, dim=0),
    "cumsum": lambda a: torch.cumsum(input=a, dim=0),
    "unsqueeze": lambda a: torch.unsqueeze(input=a, dim=0),
    "reshape": lambda a: torch.reshape(input=a, shape=(2, 2)),
    "transpose": lambda a: torch.transpose(input=a.view(2, 2), dim0=0, dim1=1),
    "chunk": lambda a: torch.chunk(input=a, chunks=2),
    "linear": lambda a: F.linear(input=a, weight=_W),
    "avg_pool2d": lambda a: F.avg_pool2d(input=a.view(1, 2, 2), kernel_size=2),
    "vector_norm": lambda a: torch.linalg.vector_norm(x=a),
}


@pytest.mark.parametrize("call", KEYWORD_CALLS)
def test_calls_given_their_tensors_as_keywords(call):
    # the shortcuts read the tensor from the positional arguments: such a call declines
    x = torch.randn(3, 4)
    assert_close(vmap(KEYWORD_CALLS[call])(x), func_vmap(KEYWORD_CALLS[call])(x))
