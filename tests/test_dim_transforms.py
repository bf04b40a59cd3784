"""First-class dims with this project's transforms, in both orders, against torch.func.

Dims code inside vmap/grad/jacrev/jacfwd/hessian, and transformed functions called on
tensors with dims (batched over their dims by Rule 1).
"""

import pytest
import torch
import torch.func as tf
from torch.testing import assert_close
from vmap_reference import seeded

import torchlevels as tl
from torchlevels.dim import dims, softmax


def attention_dims(K, Q, V):
    batch, channel, key, query = dims(4)
    k, q, v = K[batch, channel, key], Q[batch, channel, query], V[batch, channel, key]
    a = softmax((k * q).sum(channel) * channel.size ** -0.5, dim=key)
    return torch.cat(((v * a).sum(key).order(batch, channel, query), Q), dim=1)


def attention_plain(K, Q, V):
    a = torch.softmax(K.transpose(-1, -2) @ Q * K.shape[-2] ** -0.5, dim=-2)
    return torch.cat((V @ a, Q), dim=-2)


def embedding_bag_dims(W, idx):
    batch, sequence, features = dims(3)
    return W[idx[batch, sequence], features].sum(sequence).order(batch, features)


def model_dims(weights, examples):
    """Unbatched code (a dot product) batched by binding a dim: runs under vmap levels."""
    batch = dims(1)
    return examples[batch].dot(weights).relu().order(batch)


def _inputs(seed=0):
    g = seeded(seed)
    K, Q, V = (torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64) for _ in range(3))
    return K, Q, V


def test_vmap_of_dims_code():
    K, Q, V = _inputs()
    assert_close(tl.vmap(attention_dims)(K, Q, V), tf.vmap(attention_plain)(K, Q, V))


def test_grad_of_dims_code():
    K, Q, V = (t[0] for t in _inputs())
    ours = tl.grad(lambda *a: attention_dims(*a).sin().sum(), argnums=(0, 1, 2))(K, Q, V)
    ref = tf.grad(lambda *a: attention_plain(*a).sin().sum(), argnums=(0, 1, 2))(K, Q, V)
    assert_close(ours, ref)


def test_vmap_of_grad_and_grad_of_vmap_of_dims_code():
    K, Q, V = _inputs()
    f = lambda *a: attention_dims(*a).sin().sum()  # noqa: E731
    g = lambda *a: attention_plain(*a).sin().sum()  # noqa: E731
    assert_close(tl.vmap(tl.grad(f))(K, Q, V), tf.vmap(tf.grad(g))(K, Q, V))
    ours = tl.grad(lambda *a: tl.vmap(attention_dims)(*a).sum())(K, Q, V)
    assert_close(ours, tf.grad(lambda *a: tf.vmap(attention_plain)(*a).sum())(K, Q, V))


def test_autograd_through_dims_code():
    K, Q, V = (t[0].requires_grad_() for t in _inputs())
    attention_dims(K, Q, V).pow(2).sum().backward()
    ours = [t.grad for t in (K, Q, V)]
    ref = torch.autograd.grad(attention_plain(K, Q, V).pow(2).sum(), (K, Q, V))
    assert_close(ours, list(ref))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd"])
def test_jacobians_of_a_gather(transform):
    g = seeded(1)
    W = torch.randn(10, 4, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 10, (3, 6), generator=g)
    ours = getattr(tl, transform)(embedding_bag_dims)(W, idx)
    assert_close(ours, getattr(tf, transform)(lambda W: W[idx].sum(1))(W))


def test_hessian_through_the_vmap_path():
    g = seeded(2)
    w, ex = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g,
                                                                          dtype=torch.float64)
    f = lambda w: model_dims(w, ex).pow(3).sum()  # noqa: E731
    ref = lambda w: (ex @ w).relu().pow(3).sum()  # noqa: E731
    assert_close(tl.hessian(f)(w), tf.hessian(ref)(w))


@pytest.mark.parametrize("transform", ["grad", "jacrev", "jacfwd", "hessian"])
def test_transforms_called_on_tensors_with_dims(transform):
    g = seeded(3)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    f = lambda v: (v.sin() * v).sum()  # noqa: E731
    i = dims(1)
    ours = getattr(tl, transform)(f)(x[i])
    assert ours.dims[0] is i
    assert_close(ours.order(i), tf.vmap(getattr(tf, transform)(f))(x))


def test_vmap_called_on_tensors_with_dims():
    g = seeded(4)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    j = dims(1)
    out = tl.vmap(lambda a, b: b @ a, in_dims=(None, 0))(x[j], y[j])
    assert_close(out.order(j), torch.einsum("ik,ink->in", x, y))


def test_grad_with_respect_to_dims_inputs_inside_dims_code():
    """Per-example gradients by binding a dim instead of vmap."""
    g = seeded(5)
    w = torch.randn(5, generator=g, dtype=torch.float64)
    ex = torch.randn(7, 5, generator=g, dtype=torch.float64)
    b = dims(1)
    per_example = tl.grad(lambda w, e: (e * w).sum().tanh())(w, ex[b]).order(b)
    assert_close(per_example, tf.vmap(tf.grad(lambda w, e: (e * w).sum().tanh()),
                                      in_dims=(None, 0))(w, ex))


@pytest.mark.parametrize("name", ["", "._dims", "._base", "._ops", "._functions"])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    module = importlib.import_module(f"torchlevels.dim{name}")
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(module):
        # the Tensor class has torch.Tensor's methods with their docs: their examples are torch's
        torch_attribute = getattr(torch.Tensor, test.name.rpartition(".")[2], None)
        if test.docstring != getattr(torch_attribute, "__doc__", None):
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0
