"""Which kernels dims code runs: a product summed over a shared dim is one matmul-class
kernel, and no tensor as large as the full product is ever made."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vmap_reference import seeded

from torchlevels.dim import dims, softmax


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []  # (op name, largest output numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        numel = max((o.numel() for o in outs if isinstance(o, torch.Tensor)), default=0)
        self.ops.append((func.overloadpacket.__name__, numel))
        return out


def mm(A, B):
    i, j, k = dims(3)
    return (A[i, k] * B[k, j]).sum(k).order(i, j)


def gram(y):
    b, c, c2, h, w = dims()
    return ((y[b, c, h, w] * y[b, c2, h, w]).sum((h, w)) / (h.size * w.size)).order(b, c, c2)


def attention(K, Q, V):
    batch, channel, key, query = dims(4)
    k, q, v = K[batch, channel, key], Q[batch, channel, query], V[batch, channel, key]
    a = softmax((k * q).sum(channel) * channel.size ** -0.5, dim=key)
    return (v * a).sum(key).order(batch, channel, query)


CASES = {
    "mm": (mm, lambda: (torch.rand(6, 7), torch.rand(7, 8)), 6 * 7 * 8, 1),
    "gram": (gram, lambda: (torch.rand(2, 3, 4, 5),), 2 * 3 * 3 * 4 * 5, 1),
    "attention": (attention, lambda: tuple(torch.rand(2, 3, 5) for _ in range(3)),
                  2 * 3 * 5 * 5, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_products_summed_over_dims_run_as_matmuls(name):
    fn, make, full_product, matmuls = CASES[name]
    args = make()
    with Recorder() as rec:
        fn(*args)
    names = [op for op, _ in rec.ops]
    assert sum(op in ("mm", "bmm") for op in names) == matmuls, names
    assert max(n for _, n in rec.ops) < full_product, rec.ops  # never the full product


def test_a_product_read_as_a_tensor_is_computed():
    """Delaying the product must not change what any other use of it sees."""
    A, B = torch.rand(3, 4), torch.rand(4, 5)
    i, j, k = dims(3)
    p = A[i, k] * B[k, j]
    torch.testing.assert_close(p.order(i, k, j), A[:, :, None] * B[None])
    torch.testing.assert_close((p + 1).sum(k).order(i, j), A @ B + 4)
    torch.testing.assert_close(p.mean(k).order(i, j), (A @ B) / 4)


def embedding_bag(ids, W, reduce="sum"):
    batch, sequence, features = dims(3)
    looked_up = W[ids[batch, sequence], features]
    return getattr(looked_up, reduce)(sequence).order(batch, features)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_an_embedding_lookup_summed_over_the_ids_is_one_embedding_bag(reduce):
    g = seeded(0)
    W, ids = torch.randn(50, 8, generator=g), torch.randint(0, 50, (6, 5), generator=g)
    with Recorder() as rec:
        out = embedding_bag(ids, W, reduce)
    torch.testing.assert_close(out, torch.nn.functional.embedding_bag(ids, W, mode=reduce))
    names = [op for op, _ in rec.ops]
    assert any(op.startswith("_embedding_bag") for op in names), names
    assert max(n for _, n in rec.ops) < 6 * 5 * 8, rec.ops  # never the (b, s, f) gather


def test_a_lookup_read_as_a_tensor_or_differentiated_is_the_gather():
    g = seeded(1)
    W, ids = torch.randn(50, 8, generator=g), torch.randint(0, 50, (6, 5), generator=g)
    b, s, f = dims(3)
    looked_up = W[ids[b, s], f]
    torch.testing.assert_close(looked_up.order(b, s, f), W[ids])
    torch.testing.assert_close(looked_up.amax(s).order(b, f), W[ids].amax(1))
    W.requires_grad_()
    embedding_bag(ids, W).pow(2).sum().backward()
    ref = torch.autograd.grad(W[ids].sum(1).pow(2).sum(), W)[0]
    torch.testing.assert_close(W.grad, ref)
