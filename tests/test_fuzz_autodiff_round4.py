"""Edge cases of the autodiff transforms found by a fourth round of differential fuzzing
against torch.func, on everyday training and scientific code (nn.Module workloads through
functional_call, per-sample gradients and ensembles, pytree primals with auxiliary
outputs, in-place ops on intermediates, higher-order compositions, chunk_size, and grad
modes around and inside the transforms): each test runs torchlevels and torch.func (or,
where torch.func refuses the call, a loop or plain autograd) on the same inputs and
compares."""

import copy

import pytest
import torch
import torch.func as tf
from test_transforms_api import assert_tree_close

import torchlevels as tl

pytestmark = pytest.mark.filterwarnings("ignore")


# vjp's backward pass called inside the user's torch.inference_mode under vmap (as
# jacrev's rows are): the level recorded its graph with inference mode off, and the pass
# made inference tensors for the views of it a matmul's derivative takes, which raised
# "Cannot set version_counter for inference tensor".
_VJP_IN_INFERENCE_MODE = {
    "vmap of vjp": lambda T, x: T.vmap(
        lambda a: T.vjp(lambda b: b @ b.mT, a)[1](torch.ones(3, 3))[0])(x),
    "vmap of jacrev": lambda T, x: T.vmap(T.jacrev(lambda a: a.cos() * (a @ a.mT).sum()))(x),
    "jacrev with chunks, under vmap": lambda T, x: T.vmap(
        T.jacrev(lambda a: (a @ a.mT).tanh(), chunk_size=2))(x),
}


@pytest.mark.parametrize("case", _VJP_IN_INFERENCE_MODE)
def test_backward_pass_of_vjp_inside_inference_mode(case):
    x = torch.randn(2, 3, 3)
    with torch.inference_mode():
        expected = _VJP_IN_INFERENCE_MODE[case](tf, x)
        got = _VJP_IN_INFERENCE_MODE[case](tl, x)
    assert_tree_close(got, expected)


def _det_of_complex(xy):
    z = torch.complex(xy[0], xy[1])
    return torch.linalg.det(torch.diag(z) + 2 * torch.eye(3, dtype=z.dtype)).real


def _svd_of_complex(xy):
    u, s, vh = torch.linalg.svd(torch.complex(xy[0], xy[1]).reshape(2, 2))
    return (u.abs() ** 2 * torch.arange(4.0).reshape(2, 2)).sum() + s.sum()


# The Hessian (jacrev of jacrev here) of a function through a complex det or svd: the
# outer jacrev runs svd's backward under vmap, and its phase check (torch.allclose)
# raised vmap's error telling the user to rewrite a torch.allclose they never called.
@pytest.mark.parametrize("func", [_det_of_complex, _svd_of_complex])
def test_hessian_through_a_complex_decomposition(func):
    xy = torch.randn(2, 4 if func is _svd_of_complex else 3, dtype=torch.float64)
    # torch.func's raises for the svd, and on CUDA for the det too (an internal assert)
    expected = (tf.hessian(func)(xy) if func is _det_of_complex and not xy.is_cuda
                else torch.autograd.functional.hessian(func, xy))
    assert_tree_close(tl.hessian(func)(xy), expected)


def test_allclose_in_user_code_under_vmap_still_raises():
    with pytest.raises(RuntimeError, match="torch.allclose returns one Python bool"):
        tl.vmap(lambda a: torch.allclose(a, a + 1))(torch.randn(2, 3))


# vmap over an nn.LSTM under torch.no_grad or torch.inference_mode (an ensemble's
# evaluation): with nothing requiring grad, PyTorch took oneDNN's layer kernel, whose tuple
# of outputs vmap cannot batch ("aten.mkldnn_rnn_layer.default returned tuple"), where the
# same call with grad enabled worked. torch.func has no batching rule for LSTMs: the
# reference is a loop.
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("layers", [dict(), dict(num_layers=2, bidirectional=True)])
def test_lstm_under_vmap_without_grad(mode, layers):
    lstm = torch.nn.LSTM(4, 5, batch_first=True, **layers)
    copies = [lstm, copy.deepcopy(lstm)]
    with torch.no_grad():
        copies[1].weight_ih_l0.mul_(2)
    xs = torch.randn(3, 2, 6, 4)
    with mode():
        got = tl.vmap(lambda x: lstm(x)[0])(xs)
        expected = torch.stack([lstm(x)[0] for x in xs])
        params, buffers = tl.stack_module_state(copies)
        ensemble = tl.vmap(lambda p, x: tl.functional_call(lstm, p, (x,))[0],
                           in_dims=(0, None))(params, xs[0])
        each = torch.stack([m(xs[0])[0] for m in copies])
    assert_tree_close((got, ensemble), (expected, each))
