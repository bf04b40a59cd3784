"""The functorch.dim README examples, run against functorch.dim and torchlevels.dim.

Every example is a function taking the dims module ``D`` and returning ``(got, expected)``:
``got`` is computed with first-class dims, ``expected`` with plain PyTorch. Inputs are drawn
from a freshly seeded generator inside the example, so two calls see the same inputs, which is
what the cross-check at the bottom relies on (torchlevels.dim must agree with functorch.dim).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from vmap_reference import seeded

MODULES = {"functorch": "functorch.dim", "torchlevels": "torchlevels.dim"}
SEED = 20240611


def _gen():
    return seeded(SEED)


def _rand(g, *shape):
    return torch.rand(*shape, generator=g)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


@pytest.fixture(params=list(MODULES.values()), ids=list(MODULES))
def dimlib(request):
    return importlib.import_module(request.param)


def _on_both(functorch_xfail=None):
    """Parametrize ``dimlib`` over both modules; optionally xfail only the functorch one."""
    marks = (
        () if functorch_xfail is None else pytest.mark.xfail(strict=True, reason=functorch_xfail)
    )
    return pytest.mark.parametrize(
        "dimlib",
        [
            pytest.param(MODULES["functorch"], id="functorch", marks=marks),
            pytest.param(MODULES["torchlevels"], id="torchlevels"),
        ],
        indirect=True,
    )


# --------------------------------------------------------------------------------------
# The examples
# --------------------------------------------------------------------------------------


def _mm(D, A, B):
    i, j, k = D.dims(3)
    r = (A[i, k] * B[k, j]).sum(k)
    return r.order(i, j)


def ex_mm(D):
    g = _gen()
    A, B = _rand(g, 3, 4), _rand(g, 4, 5)
    return _mm(D, A, B), A @ B


def ex_gram_matrix(D):
    g = _gen()
    y = _rand(g, 2, 3, 4, 5)
    b, c, c2, h, w = D.dims()
    r = (y[b, c, h, w] * y[b, c2, h, w]).sum((h, w))
    r = r / (h.size * w.size)
    got = r.order(b, c, c2)
    expected = torch.einsum("bchw,bdhw->bcd", y, y) / (4 * 5)
    return got, expected


def ex_attention(D):
    g = _gen()
    K, Q, V = (_rand(g, 2, 3, 4) for _ in range(3))
    batch, channel, key, query = D.dims(4)
    k = K[batch, channel, key]
    q = Q[batch, channel, query]
    v = V[batch, channel, key]
    a = (k * q).sum(channel)
    a = D.softmax(a * (channel.size**-0.5), dim=key)
    r = (v * a).sum(key)
    got = torch.cat((r.order(batch, channel, query), Q), dim=1)

    scores = torch.einsum("bck,bcq->bkq", K, Q) * (3**-0.5)
    probs = torch.softmax(scores, dim=1)
    ctx = torch.einsum("bck,bkq->bcq", V, probs)
    return got, torch.cat((ctx, Q), dim=1)


def ex_pixel_shuffle(D):
    g = _gen()
    upscale_factor = 2
    img = _rand(g, 2, 3 * upscale_factor**2, 3, 4)
    h2, w2, c, b, h, w = D.dims(6)
    h2.size = w2.size = upscale_factor
    got = img[b, (c, h2, w2), h, w].order(b, c, (h, h2), (w, w2))
    return got, F.pixel_shuffle(img, upscale_factor)


def ex_rearrange(D):
    g = _gen()
    x = _rand(g, 2, 3, 4, 5)
    b, c, h, w = D.dims(4)
    # 'b c h w -> b (h w) c'
    flat = x[b, c, h, w].order(b, (h, w), c)
    flat_expected = x.permute(0, 2, 3, 1).reshape(2, 4 * 5, 3)

    # 'b (h1 h) (w1 w) c -> (b h1 w1) h w c' with h1 = w1 = 2
    y = _rand(g, 2, 6, 8, 3)
    b, h1, h, w1, w, c = D.dims(6)
    h1.size = w1.size = 2
    split = y[b, (h1, h), (w1, w), c].order((b, h1, w1), h, w, c)
    split_expected = y.reshape(2, 2, 3, 2, 4, 3).permute(0, 1, 3, 2, 4, 5).reshape(8, 3, 4, 3)
    return (flat, split), (flat_expected, split_expected)


def ex_batch_unbatched_model(D):
    g = _gen()
    batch_size, feature_size = 3, 5
    weights = _randn(g, feature_size)
    examples = _randn(g, batch_size, feature_size)

    def model(feature_vec):
        assert feature_vec.dim() == 1
        return feature_vec.dot(weights).relu()

    batch = D.dims(1)
    r = model(examples[batch])
    return r.order(batch), (examples @ weights).relu()


def ex_bmm(D):
    g = _gen()
    A, B = _rand(g, 2, 3, 4), _rand(g, 2, 4, 5)
    i = D.dims(1)
    got = _mm(D, A[i], B[i]).order(i)
    return got, torch.bmm(A, B)


def ex_multihead_attention(D):
    g = _gen()
    n_batch, n_seq, n_heads, n_features = 2, 3, 2, 4
    q_in, k_in, v_in = (_rand(g, n_batch, n_seq, n_heads * n_features) for _ in range(3))

    batch, query_sequence, key_sequence, heads, features = D.dims(5)
    heads.size = n_heads
    q = q_in[batch, query_sequence, [heads, features]]
    k = k_in[batch, key_sequence, [heads, features]]
    v = v_in[batch, key_sequence, [heads, features]]
    attention_scores = (q * k).sum(features) * (features.size**-0.5)
    attention_probs = D.softmax(attention_scores, dim=key_sequence)
    attention_probs = F.dropout(attention_probs, p=0.0)
    context_layer = (attention_probs * v).sum(key_sequence)
    got = context_layer.order(batch, query_sequence, [heads, features])

    def split(t):
        return t.reshape(n_batch, n_seq, n_heads, n_features)

    scores = torch.einsum("bqhf,bkhf->bhqk", split(q_in), split(k_in)) * n_features**-0.5
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.einsum("bhqk,bkhf->bqhf", probs, split(v_in))
    return got, ctx.reshape(n_batch, n_seq, n_heads * n_features)


def ex_triu(D):
    g = _gen()
    A = _rand(g, 3, 4)
    i, j = D.dims()
    a = A[i, j]
    got = torch.where(i <= j, a, 0).order(i, j)

    i, j = D.dims(sizes=[4, 4])
    mask = (i <= j).order(i, j)
    return (got, mask), (torch.triu(A), torch.ones(4, 4).triu().bool())


def ex_embedding_bag(D):
    g = _gen()
    W = _rand(g, 5, 2)
    inp = torch.randint(0, 5, (3, 4), generator=g)
    batch, sequence, features = D.dims(3)
    r = W[inp[batch, sequence], features].sum(sequence)
    got = r.order(batch, features)
    return got, F.embedding_bag(inp, W, mode="sum")


def ex_relative_positional_embedding(D):
    g = _gen()
    n_batch, n_query, n_key, n_heads, n_features = 2, 3, 4, 2, 3
    n_embeddings = 2 * max(n_query, n_key) + 1
    q_in = _rand(g, n_batch, n_query, n_heads * n_features)
    k_in = _rand(g, n_batch, n_key, n_heads * n_features)
    distance_embedding_weight = _rand(g, n_embeddings, n_features)

    batch, query_sequence, key_sequence, heads, features = D.dims(5)
    heads.size = n_heads
    q = q_in[batch, query_sequence, [heads, features]]
    k = k_in[batch, key_sequence, [heads, features]]
    distance = query_sequence - key_sequence
    index_bias = n_embeddings // 2
    assert key_sequence.size + index_bias <= n_embeddings
    positional_embedding = distance_embedding_weight[distance + index_bias, features]
    scores_query = (q * positional_embedding).sum(features)
    scores_key = (k * positional_embedding).sum(features)
    got = (scores_query + scores_key).order(batch, heads, key_sequence, query_sequence)

    dist = torch.arange(n_query)[:, None] - torch.arange(n_key)[None, :]
    pos = distance_embedding_weight[dist + index_bias]  # (query, key, features)
    qh = q_in.reshape(n_batch, n_query, n_heads, n_features)
    kh = k_in.reshape(n_batch, n_key, n_heads, n_features)
    expected = torch.einsum("bqhf,qkf->bhkq", qh, pos) + torch.einsum("bkhf,qkf->bhkq", kh, pos)
    return got, expected


def ex_split_flatten(D):
    g = _gen()
    i, j, k = D.dims(3)
    j.size = 2
    A = _rand(g, 6, 4)
    a = A[(i, j), k]
    assert (i.size, j.size, k.size) == (3, 2, 4)
    r = a.order(i, (j, k))
    assert r.shape == (3, 8)
    return r, A.reshape(3, 2, 4).reshape(3, 8)


def ex_ndim_and_dims(D):
    g = _gen()
    batch, channel, width, height = D.dims(4)
    inp = _rand(g, 2, 3, 5, 6)
    assert inp.ndim == 4
    input_fc = inp[batch, channel, width, height]
    assert len(input_fc.dims) == 4
    assert all(a is b for a, b in zip(input_fc.dims, (batch, channel, width, height)))
    assert input_fc.ndim == 0
    assert inp.ndim == 4  # indexing made a new tensor

    input_mixed = inp[batch, :, :, height]
    assert len(input_mixed.dims) == 2
    assert input_mixed.dims[0] is batch and input_mixed.dims[1] is height
    assert input_mixed.ndim == 2

    x = D.dims(1)
    _ = _rand(g, 3)[x]
    assert x.size == 3

    i = D.dims(1)
    i.size = 5
    i.size = 5
    with pytest.raises(D.DimensionBindError):
        i.size = 3
    assert i.size == 5

    j = D.dims(sizes=[4])
    assert j.size == 4

    got = (input_fc.order(height, batch, width, channel), input_mixed.order(height, batch))
    expected = (inp.permute(3, 0, 2, 1), inp.permute(3, 0, 1, 2))
    return got, expected


def ex_implicit_batching(D):
    # Rule 1, and the Rule 3 embedding lookup `embeddings[words[sequence], features]`.
    g = _gen()
    input_positional, bias_positional = _rand(g, 4, 3), _rand(g, 3)
    batch, channel = D.dims(2)
    result = input_positional[batch, channel] + bias_positional[channel]
    assert len(result.dims) == 2
    assert result.dims[0] is batch and result.dims[1] is channel

    sequence, features = D.dims(2)
    embeddings = _rand(g, 8, 5)
    words = torch.randint(0, 8, (3,), generator=g)
    state = embeddings[words[sequence], features]
    assert len(state.dims) == 2
    assert state.dims[0] is sequence and state.dims[1] is features

    got = (result.order(batch, channel), state.order(sequence, features))
    return got, (input_positional + bias_positional, embeddings[words])


def ex_dims_are_tensors(D):
    channel = D.dims(1)
    channel.size = 3
    got = (channel + 1000).order(channel)
    return got, torch.arange(3) + 1000


def ex_dim_own_dims(D):
    # README, Rule 3: `print(channel.dims)` -> `(channel,)`
    channel = D.dims(1)
    channel.size = 3
    assert len(channel.dims) == 1 and channel.dims[0] is channel
    assert channel.ndim == 0
    return channel.order(channel), torch.arange(3)


def ex_order_transposes(D):
    g = _gen()
    i, j = D.dims(2)
    A = _rand(g, 3, 4)
    A_T = A[i, j].order(j, i)
    B = _rand(g, 3, 4, 5)
    B_T = B[i, j].order(j, i)
    return (A_T, B_T), (A.T, B.permute(1, 0, 2))


def ex_index_method(D):
    g = _gen()
    i, j = D.dims(2)
    A = _rand(g, 3, 4)
    got = A[i, j].index(i, 0).order(j)
    return got, A[0]


def ex_puzzle_outer(D):
    g = _gen()
    a, b = _rand(g, 3), _rand(g, 4)
    i, j = D.dims(2)
    return (a[i] * b[j]).order(i, j), torch.outer(a, b)


def ex_puzzle_diag(D):
    g = _gen()
    a = _rand(g, 4, 4)
    i = D.dims(1)
    return a[i, i].order(i), torch.diagonal(a)


def ex_puzzle_eye(D):
    n = 4
    i, j = D.dims(sizes=[n, n])
    got = torch.where(i == j, 1, 0).order(i, j)
    return got, torch.eye(n, dtype=torch.long)


def ex_puzzle_triu(D):
    n = 4
    i, j = D.dims(sizes=[n, n])
    got = torch.where(i <= j, 1, 0).order(i, j)
    return got, torch.ones(n, n, dtype=torch.long).triu()


def ex_puzzle_diff(D):
    g = _gen()
    a = _rand(g, 5)
    i = D.dims(1)
    d = a[i] - a[i - 1]
    got = torch.where(i - 1 >= 0, d, a[i]).order(i)
    return got, torch.cat((a[:1], a[1:] - a[:-1]))


def ex_puzzle_vstack(D):
    g = _gen()
    a, b = _rand(g, 4), _rand(g, 4)
    v, i = D.dims(sizes=[2, None])
    got = torch.where(v == 0, a[i], b[i]).order(v, i)
    return got, torch.stack((a, b))


def ex_puzzle_roll(D):
    g = _gen()
    a = _rand(g, 5)
    i = D.dims(sizes=[a.size(0)])
    got = a[torch.where(i + 1 < i.size, i + 1, 0)].order(i)
    return got, torch.roll(a, -1)


def ex_puzzle_flip(D):
    g = _gen()
    a = _rand(g, 5)
    i = D.dims(sizes=[a.size(0)])
    got = a[i.size - i - 1].order(i)
    return got, torch.flip(a, (0,))


def ex_puzzle_sequence_mask(D):
    g = _gen()
    values = _rand(g, 3, 5)
    length = torch.randint(0, 6, (3,), generator=g)
    j, i = D.dims()
    v = values[i, j]
    got = torch.where(j < length[i], v, 0).order(i, j)
    mask = torch.arange(5)[None, :] < length[:, None]
    return got, torch.where(mask, values, 0)


def ex_dimlists(D):
    g = _gen()
    x = _rand(g, 2, 3, 4)
    b = D.dimlists()
    k = D.dims(1)
    y = x[b, k]
    assert len(b) == 2
    assert len(y.dims) == 3
    assert y.dims[2] is k
    assert (b[0].size, b[1].size, k.size) == (2, 3, 4)
    s = y.sum(k)
    got = (s.order(*b), s.order(b), y.order(k, b))
    expected = (x.sum(-1), x.sum(-1), x.permute(2, 0, 1))
    return got, expected


def ex_cat_stack(D):
    g = _gen()
    X, Y = _rand(g, 2, 4), _rand(g, 2, 4)
    i, k, m, n = D.dims(4)
    c = D.cat([X[i, k], Y[i, k]], i, m)
    assert m.size == 4
    s = D.stack([X[i, k], Y[i, k]], n)
    assert n.size == 2
    s_torch = torch.stack([X[i, k], Y[i, k]], n)
    got = (c.order(m, k), s.order(n, i, k), s_torch.order(n, i, k))
    stacked = torch.stack((X, Y))
    return got, (torch.cat((X, Y)), stacked, stacked)


def ex_reductions(D):
    g = _gen()
    x = _rand(g, 2, 3, 4, 5)
    b, c, h, w = D.dims(4)
    xd = x[b, c, h, w]
    avg_pixel_color = xd.mean((h, w))
    assert len(avg_pixel_color.dims) == 2
    assert avg_pixel_color.dims[0] is b and avg_pixel_color.dims[1] is c
    got = (
        avg_pixel_color.order(b, c),
        xd.sum(w).order(b, c, h),
        D.softmax(xd, dim=h).order(b, c, h, w),
        torch.softmax(xd, h).order(b, c, h, w),
        xd.softmax(w).order(b, c, h, w),
    )
    expected = (
        x.mean((2, 3)),
        x.sum(3),
        torch.softmax(x, 2),
        torch.softmax(x, 2),
        torch.softmax(x, 3),
    )
    return got, expected


def ex_grad(D):
    g = _gen()
    A = _rand(g, 3, 4).requires_grad_()
    B = _rand(g, 4, 5).requires_grad_()
    loss = (_mm(D, A, B) ** 2).sum()
    got = torch.autograd.grad(loss, (A, B))
    expected = torch.autograd.grad(((A @ B) ** 2).sum(), (A, B))
    return got, expected


# README examples that functorch.dim itself (the Python port in torch 2.13) gets wrong.
# Maps example name -> reason; used both for the functorch param and the cross-check.
FUNCTORCH_BROKEN = {
    "ex_dim_own_dims": "functorch.dim: Dim.dims raises NotImplementedError (_get_levels)",
}

EXAMPLES = [
    ex_mm,
    ex_gram_matrix,
    ex_attention,
    ex_pixel_shuffle,
    ex_rearrange,
    ex_batch_unbatched_model,
    ex_bmm,
    ex_multihead_attention,
    ex_triu,
    ex_embedding_bag,
    ex_relative_positional_embedding,
    ex_split_flatten,
    ex_ndim_and_dims,
    ex_implicit_batching,
    ex_dims_are_tensors,
    ex_dim_own_dims,
    ex_order_transposes,
    ex_index_method,
    ex_puzzle_outer,
    ex_puzzle_diag,
    ex_puzzle_eye,
    ex_puzzle_triu,
    ex_puzzle_diff,
    ex_puzzle_vstack,
    ex_puzzle_roll,
    ex_puzzle_flip,
    ex_puzzle_sequence_mask,
    ex_dimlists,
    ex_cat_stack,
    ex_reductions,
    ex_grad,
]


def _run(example, D):
    got, expected = example(D)
    assert_close(got, expected)


# --------------------------------------------------------------------------------------
# One test per example, on both modules
# --------------------------------------------------------------------------------------


def test_mm(dimlib):
    _run(ex_mm, dimlib)


def test_gram_matrix(dimlib):
    _run(ex_gram_matrix, dimlib)


def test_attention(dimlib):
    _run(ex_attention, dimlib)


def test_pixel_shuffle(dimlib):
    _run(ex_pixel_shuffle, dimlib)


def test_rearrange(dimlib):
    _run(ex_rearrange, dimlib)


def test_batch_unbatched_model(dimlib):
    _run(ex_batch_unbatched_model, dimlib)


def test_bmm(dimlib):
    _run(ex_bmm, dimlib)


def test_multihead_attention(dimlib):
    _run(ex_multihead_attention, dimlib)


def test_triu(dimlib):
    _run(ex_triu, dimlib)


def test_embedding_bag(dimlib):
    _run(ex_embedding_bag, dimlib)


def test_relative_positional_embedding(dimlib):
    _run(ex_relative_positional_embedding, dimlib)


def test_split_flatten(dimlib):
    _run(ex_split_flatten, dimlib)


def test_ndim_and_dims(dimlib):
    _run(ex_ndim_and_dims, dimlib)


def test_implicit_batching(dimlib):
    _run(ex_implicit_batching, dimlib)


def test_dims_are_tensors(dimlib):
    _run(ex_dims_are_tensors, dimlib)


@_on_both(functorch_xfail=FUNCTORCH_BROKEN["ex_dim_own_dims"])
def test_dim_own_dims(dimlib):
    _run(ex_dim_own_dims, dimlib)


def test_order_transposes(dimlib):
    _run(ex_order_transposes, dimlib)


def test_index_method(dimlib):
    _run(ex_index_method, dimlib)


def test_puzzle_outer(dimlib):
    _run(ex_puzzle_outer, dimlib)


def test_puzzle_diag(dimlib):
    _run(ex_puzzle_diag, dimlib)


def test_puzzle_eye(dimlib):
    _run(ex_puzzle_eye, dimlib)


def test_puzzle_triu(dimlib):
    _run(ex_puzzle_triu, dimlib)


def test_puzzle_diff(dimlib):
    _run(ex_puzzle_diff, dimlib)


def test_puzzle_vstack(dimlib):
    _run(ex_puzzle_vstack, dimlib)


def test_puzzle_roll(dimlib):
    _run(ex_puzzle_roll, dimlib)


def test_puzzle_flip(dimlib):
    _run(ex_puzzle_flip, dimlib)


def test_puzzle_sequence_mask(dimlib):
    _run(ex_puzzle_sequence_mask, dimlib)


def test_dimlists(dimlib):
    _run(ex_dimlists, dimlib)


def test_cat_stack(dimlib):
    _run(ex_cat_stack, dimlib)


def test_reductions(dimlib):
    _run(ex_reductions, dimlib)


def test_grad(dimlib):
    _run(ex_grad, dimlib)


def test_every_example_has_a_test():
    names = {f"test_{ex.__name__.removeprefix('ex_')}" for ex in EXAMPLES}
    assert names <= set(globals())


# --------------------------------------------------------------------------------------
# torchlevels.dim must agree with functorch.dim on the same inputs
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(
            ex,
            id=ex.__name__.removeprefix("ex_"),
            marks=[pytest.mark.skip(reason=FUNCTORCH_BROKEN[ex.__name__])]
            if ex.__name__ in FUNCTORCH_BROKEN
            else [],
        )
        for ex in EXAMPLES
    ],
)
def test_torchlevels_agrees_with_reference(example):
    import functorch.dim as fdim

    tdim = importlib.import_module("torchlevels.dim")
    got_functorch, _ = example(fdim)
    got_torchlevels, _ = example(tdim)
    assert_close(got_torchlevels, got_functorch)
