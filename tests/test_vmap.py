"""vmap's public semantics, each compared with torch.func.vmap on the same inputs."""

import functools
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import vmap as func_vmap

import torchlevels
from torchlevels import vmap

assert_close = torch.testing.assert_close


def same(f, *args, **kw):
    """Run f under torchlevels.vmap and torch.func.vmap with the same options; compare."""
    ours = vmap(f, **kw)(*args)
    theirs = func_vmap(f, **kw)(*args)
    assert_close(ours, theirs, equal_nan=True)
    return ours


def same_error(f, *args, match=None, **kw):
    """Both implementations raise the same exception type (our message matches `match`)."""
    with pytest.raises(Exception) as theirs:
        func_vmap(f, **kw)(*args)
    with pytest.raises(theirs.type, match=match):
        vmap(f, **kw)(*args)


def test_pytrees_in_and_out():
    def f(d, pair):
        a, b = pair
        return {"sum": d["x"] + a, "prod": (d["y"] * b, b.sum())}

    d = {"x": torch.randn(4, 3), "y": torch.randn(4, 3)}
    pair = (torch.randn(4, 3), torch.randn(4, 3))
    same(f, d, pair)
    same(f, {"x": d["x"], "y": torch.randn(3, 4)}, pair, in_dims=({"x": 0, "y": 1}, (None, 0)))
    same(f, d, pair, out_dims={"sum": 1, "prod": (0, 0)})


def test_in_dims_none_and_negative():
    x, w = torch.randn(3, 5), torch.randn(5)
    same(torch.mul, x, w, in_dims=(0, None))
    same(torch.mul, x.T.contiguous(), w, in_dims=(-1, None))
    same(lambda a, b: a @ b, torch.randn(2, 3, 4), torch.randn(4, 2), in_dims=(0, 1))


def test_unmapped_pytrees_beside_mapped_tensors():
    # vmap(f, in_dims=(None, 0)) with a dict of parameters: the common per-sample case,
    # which skips flattening; the same results, and the same errors, as the general path
    def f(params, x, n):
        return (params["w"] * x).sum() + params["b"][0] * n

    params = {"w": torch.randn(3), "b": [torch.randn(2)]}
    x = torch.randn(4, 3)
    same(f, params, x, 2, in_dims=(None, 0, None))
    same(f, params, x.T, 2, in_dims=(None, -1, None))
    same_error(f, params, x, torch.randn(5), in_dims=(None, 0, 0), match=r"sizes \[4, 5\]")
    same_error(f, params, x, 2, in_dims=(None, 2, None), match="in_dim=2")
    same_error(f, params, x, 2, in_dims=(None, 0, 0), match="non-Tensor")
    same_error(f, params, x, 2, in_dims=(0, 0, None), match=r"sizes \[3, 2, 4\]")


def test_kwargs_are_not_batched():
    def f(x, *, scale):
        return x * scale

    x, s = torch.randn(4, 3), torch.randn(3)
    assert_close(vmap(f)(x, scale=s), func_vmap(f)(x, scale=s))


def test_out_dims_and_unbatched_outputs():
    x = torch.randn(4, 3)
    same(lambda x: x * 2, x, out_dims=1)
    same(lambda x: torch.ones(2), x)  # unbatched output expands to the batch
    same(lambda x: (x, torch.ones(2)), x, out_dims=(0, None))


@pytest.mark.parametrize("out_dims", [2, -3, 5])
def test_out_dims_out_of_range_raise(out_dims):
    x = torch.randn(4, 3)
    same_error(lambda x: x * 2, x, out_dims=out_dims, match=rf"out_dims={out_dims} .*\[-2, 1\]")
    # an unbatched output: torch.func's expand fails for some such out_dims, so no same_error
    with pytest.raises(IndexError, match=rf"out_dims={out_dims} .*shape \(2,\)"):
        vmap(lambda x: torch.ones(2), out_dims=out_dims)(x)


def test_unbatched_output_at_a_later_out_dim():
    x, w = torch.randn(4, 3), torch.randn(2)
    for out_dims in (1, -1):  # torch.func's expand fails here: compare with the stacked loop
        expected = torch.stack([w for _ in x], dim=out_dims)
        assert_close(vmap(lambda x: w, out_dims=out_dims)(x), expected)


def test_batch_size_mismatch():
    same_error(torch.add, torch.randn(3), torch.randn(4), match=r"sizes \[3, 4\]")


def test_bad_in_dims():
    same_error(torch.sin, torch.randn(3), in_dims=2, match="in_dim=2")
    same_error(torch.sin, torch.randn(3), in_dims=(0, 0), match="not compatible")
    same_error(torch.sin, torch.randn(3), in_dims=(None,), match="at least one Tensor")
    with pytest.raises(ValueError, match=r"in_dims=\(None,\).*maps no input.*an int in_dim"):
        vmap(torch.sin, in_dims=(None,))(torch.randn(3))
    same_error(torch.sin, torch.randn(3), in_dims=None, match="expected `in_dims`.*NoneType")
    same_error(lambda x, n: x * n, torch.randn(3), 2, in_dims=(0, 0), match="non-Tensor")
    same_error(torch.sin, torch.randn(3), in_dims=[0], match="expected `in_dims`")
    same_error(lambda: torch.ones(1), match="got no inputs")


def test_non_tensor_output_errors():
    same_error(lambda x: 3, torch.randn(3), match="must only return Tensors")
    same_error(lambda x: x, torch.randn(3), out_dims=None, match="out_dim is None")


def test_bad_randomness_and_chunk_size():
    same_error(torch.sin, torch.randn(3), randomness="bogus", match="randomness")
    for bad in (0, -1, 2.0, True):  # (True passed for an int, then failed inside narrow())
        with pytest.raises(ValueError, match=rf"chunk_size should be None or an int .*{bad}"):
            vmap(torch.sin, chunk_size=bad)
        with pytest.raises(ValueError, match=rf"chunk_size` should be None or an int .*{bad}"):
            torchlevels.jacrev(torch.sin, chunk_size=bad)


def test_nested_vmap_depth_three():
    x = torch.randn(2, 3, 4, 5)
    f = lambda v: (v.sin() * v.sum()).softmax(0)
    assert_close(vmap(vmap(vmap(f)))(x), func_vmap(func_vmap(func_vmap(f)))(x))
    g = lambda a, b: torch.outer(a, b).sum(0)
    a, b = torch.randn(2, 3, 4), torch.randn(3, 2, 4)
    assert_close(vmap(vmap(g, (0, 0)), (0, 1))(a, b), func_vmap(func_vmap(g, (0, 0)), (0, 1))(a, b))


def test_factory_functions_inside():
    x = torch.randn(4, 3)
    same(lambda x: x + torch.arange(3.0), x)
    same(lambda x: torch.zeros_like(x) + torch.ones(3), x)
    same(lambda x: x.new_zeros(2) + x.sum(), x)
    same(lambda x: torch.full_like(x, 7.0) * x, x)


def test_inplace_on_batched():
    def f(x, y):
        x = x.clone()
        x.add_(y)
        x.mul_(2)
        x[0] = 5.0  # index_put_/copy_ into a batched tensor
        return x

    same(f, torch.randn(4, 3), torch.randn(4, 3))
    same(f, torch.randn(4, 3), torch.randn(3), in_dims=(0, None))


@pytest.mark.parametrize("in_dim", [0, 1])
def test_fill_and_zero_write_what_an_expanded_example_shares(in_dim):
    """As PyTorch's fill with a number does; a fill with a tensor refuses, as PyTorch does."""
    def f(x, v):
        y = x.clone()
        y.unsqueeze(0).expand(2, 3, 4).fill_(2.5)
        y.t().expand(2, 4, 3)[:, 1].zero_()
        y.t()[1].fill_(v)  # one value per example
        return y

    x, v = torch.randn(5, 3, 4).movedim(0, in_dim), torch.randn(5)
    loop = torch.stack([f(x.select(in_dim, b), v[b]) for b in range(5)])
    assert_close(same(f, x, v, in_dims=(in_dim, 0)), loop)

    def shared(x, v):
        x.clone().unsqueeze(0).expand(2, 3, 4).fill_(v)

    with pytest.raises(RuntimeError, match="single memory location"):
        shared(x.select(in_dim, 0), v[0])
    same_error(shared, x, v, in_dims=(in_dim, 0), match="single memory location")
    same_error(shared, x, v[0], in_dims=(in_dim, None), match="single memory location")


def test_inplace_into_unbatched_with_batched_values_errors():
    def f(x):
        buf = torch.zeros(3)
        buf.add_(x)
        return buf

    same_error(f, torch.randn(4, 3), match="out-of-place")


@pytest.mark.parametrize("write", [
    lambda x, v: x.addr_(v, v[:2]), lambda x, v: x.view(-1).put_(torch.tensor([0, 3]), v[:2]),
], ids=["addr_", "put_"])
def test_an_op_without_a_rule_writing_an_unbatched_tensor_errors(write):
    """The slow loop's examples would each write the one tensor in turn (before: silently,
    a result that matched no example)."""
    x, v = torch.randn(3, 2), torch.randn(4, 3)
    same_error(lambda v: write(x.clone(), v), v, match="out-of-place")
    assert_close(vmap(lambda x, v: write(x.clone(), v))(x.expand(4, 3, 2), v),
                 torch.stack([write(x.clone(), e) for e in v]))


def loop(f, *args):
    """f of each example, stacked (each output of a tuple)."""
    outs = [f(*example) for example in zip(*args)]
    if isinstance(outs[0], torch.Tensor):
        return torch.stack(outs)
    return tuple(torch.stack(o) for o in zip(*outs))


@pytest.mark.parametrize("f", [
    lambda x: torch.add(x, 1, out=torch.empty_like(x)),
    lambda x: torch.sum(x, 0, out=torch.empty_like(x[0])),
    lambda x: torch.norm(x, 2, 0, False, torch.empty_like(x[0])),
    lambda x: torch.max(x, 0, out=(torch.empty_like(x[0]), torch.empty_like(x[0]).long())),
    lambda x: torch.mm(x, x.t(), out=torch.empty_like(x)),
], ids=["add", "sum", "norm, out positional", "max, two outs", "mm"])
def test_out_into_a_batched_tensor_writes_it(f):
    """torch.func refuses every out= op; torchlevels runs the op and copies the result into
    ``out``, which the caller gets back, as out= does."""
    x = torch.randn(4, 3, 3)
    with pytest.raises(RuntimeError, match="out="):
        func_vmap(f)(x)
    assert_close(vmap(f)(x), loop(f, x))

    def written(x):
        out = torch.zeros_like(x[0])
        assert torch.sum(x, 0, out=out) is out
        return out

    assert_close(vmap(written)(x), x.sum(1))


@pytest.mark.parametrize("f", [
    lambda x: torch.add(x, 1, out=torch.empty(3, 3)),
    lambda x: torch.norm(x, 2, 0, False, torch.empty(3)),
    lambda x: torch.mm(x, x, out=torch.empty(3, 3)),
], ids=["add", "norm", "mm"])
def test_out_into_an_unbatched_tensor_errors(f):
    """Batched values cannot go into a tensor that is not batched (before, the tensor was
    resized to the batch and the result was wrong)."""
    with pytest.raises(RuntimeError, match=r"its out= tensor `out`.*empty_like"):
        vmap(f)(torch.randn(4, 3, 3))


def test_out_in_compositions():
    xs, ys = torch.randn(4, 3), torch.randn(4, 3)

    def f(x, y):  # out= on a value that is not differentiated
        return (x * torch.add(y, 1, out=torch.empty_like(y))).sum()

    assert_close(vmap(torchlevels.grad(f))(xs, ys), loop(torch.func.grad(f), xs, ys))

    def inner_into_outer(x):
        out = torch.empty_like(x[0])  # batched by the outer vmap only
        return vmap(lambda row: torch.mul(row, 2, out=out))(x)

    with pytest.raises(RuntimeError, match="out="):
        vmap(inner_into_outer)(torch.randn(2, 4, 3))
    with pytest.raises(NotImplementedError, match="out= function"):
        torchlevels.jvp(lambda x: torch.mul(x, 2, out=torch.empty(3)), (xs[0],), (ys[0],))


def test_data_dependent_control_flow_errors():
    def branch(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(RuntimeError, match="data-dependent"):
        vmap(branch)(torch.randn(3, 2))
    with pytest.raises(RuntimeError, match="item"):
        vmap(lambda x: x * x.sum().item())(torch.randn(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error of its own, not the slow loop's
        with pytest.raises(RuntimeError, match=r"isclose\(a, b, rtol, atol\)\.all\(\)"):
            vmap(lambda x: torch.tensor(torch.allclose(x, x)))(torch.randn(3, 2))


def test_type_promotion_with_batched_scalars():
    x = torch.randn(4, dtype=torch.float64)
    w = torch.randn(3)  # float32 vector + float64 "scalar" stays float32
    out = same(lambda s: s * w, x)
    assert out.dtype == torch.float32
    out = same(lambda s: s * torch.tensor(2.0, dtype=torch.float64), torch.randn(4))
    assert out.dtype == torch.float64  # two 0-dim tensors promote as usual


_DTYPES = [torch.bool, torch.uint8, torch.int64, torch.float16, torch.float32, torch.float64,
           torch.complex64, torch.complex128]


def _values(dtype, shape):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(1, 5, shape, dtype=dtype)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("b_dtype", _DTYPES)
@pytest.mark.parametrize("a_dtype", _DTYPES)
def test_batched_scalars_promote_as_each_example_does(a_dtype, b_dtype):
    # float64 "scalar" * complex64 vector is complex64, and a float16 "scalar" plus a
    # complex64 0-dim tensor is complex64: both came out one dtype off (torch.func: right)
    shapes = [((), ()), ((), (4,)), ((4,), ())]
    for (sa, sb), batched in itertools.product(shapes, ["a", "b", "ab"]):
        a = _values(a_dtype, (3, *sa) if "a" in batched else sa)
        b = _values(b_dtype, (3, *sb) if "b" in batched else sb)
        in_dims = (0 if "a" in batched else None, 0 if "b" in batched else None)
        for f in (torch.add, torch.mul, lambda x, y: torch.where(torch.tensor(True), x, y)):
            expected = torch.stack([f(a[i] if "a" in batched else a,
                                      b[i] if "b" in batched else b) for i in range(3)])
            out = vmap(f, in_dims=in_dims)(a, b)
            assert out.dtype == expected.dtype, (sa, sb, batched)
            assert_close(out, expected)


def test_chunk_size_matches_unchunked():
    x = torch.randn(10, 3)
    f = lambda x: (x @ x.T if x.dim() > 1 else x.outer(x)).sum(0)
    assert_close(vmap(f, chunk_size=3)(x), func_vmap(f)(x))
    assert_close(vmap(f, chunk_size=3, out_dims=1)(x), func_vmap(f, out_dims=1)(x))


@pytest.mark.parametrize("chunk_size", [None, 2, 8])
def test_a_one_tuple_out_dims_for_one_tensor(chunk_size):
    # torch.func reads out_dims=(d,) for a single tensor output as d
    x = torch.randn(3, 4)
    out = vmap(lambda a: a * 2, out_dims=(1,), chunk_size=chunk_size)(x)
    assert_close(out, func_vmap(lambda a: a * 2, out_dims=(1,))(x))
    with pytest.raises(ValueError, match="out_dims is not compatible"):
        vmap(lambda a: a * 2, out_dims=(1, 1), chunk_size=chunk_size)(x)


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_chunked_outputs_are_new_tensors(chunk_size):
    # as in torch.func, which concatenates the chunks: a view of an input, returned
    # through a chunked vmap, does not write to the input (one chunk or several)
    x = torch.ones(3, 4)
    for lib_vmap in (vmap, func_vmap):
        out = lib_vmap(lambda a: a[:2], chunk_size=chunk_size)(x)
        out.zero_()
        assert x.sum() == 12


@pytest.mark.parametrize("write", [lambda a: a.add_(1), lambda a: a[0].fill_(2),
                                   lambda a: a.copy_(torch.ones(4))])
def test_writing_an_inference_tensor_outside_inference_mode_raises(write):
    with torch.inference_mode():
        t, theirs = torch.zeros(3, 4), torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        func_vmap(write)(theirs)  # as eager does
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        vmap(write)(t)
    assert not t.any()  # (torch.func's writes before it raises)
    with torch.inference_mode():  # inside it, the write is allowed
        vmap(write)(t)
    assert t.any()


class TestRandomness:
    x = torch.randn(4, 3)

    @pytest.mark.parametrize(
        "f",
        [
            lambda x: torch.randn(3) + x,
            lambda x: torch.rand_like(x),
            lambda x: F.dropout(x, 0.5, training=True),
            lambda x: x.clone().normal_(),
        ],
        ids=["randn", "rand_like", "dropout", "normal_"],
    )
    def test_error_mode(self, f):
        same_error(f, self.x, match="randomness")

    def test_different_draws_per_example(self):
        out = vmap(lambda x: torch.randn(3) + x * 0, randomness="different")(self.x)
        assert out.shape == (4, 3) and not torch.allclose(out[0], out[1])
        out = vmap(lambda x: torch.rand_like(x), randomness="different")(self.x)
        assert not torch.allclose(out[0], out[1])
        out = vmap(lambda x: x.clone().normal_(), randomness="different")(self.x)
        assert not torch.allclose(out[0], out[1])

    def test_same_shares_one_draw(self):
        for f in (lambda x: torch.randn(3) + x * 0, torch.rand_like, lambda x: x.clone().normal_()):
            out = vmap(f, randomness="same")(self.x)
            assert out.shape == (4, 3)
            assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[3])

    def test_same_matches_torch_func_given_the_same_seed(self):
        f = lambda x: torch.randn(3) + x
        torch.manual_seed(0)
        ours = vmap(f, randomness="same")(self.x)
        torch.manual_seed(0)
        assert_close(ours, func_vmap(f, randomness="same")(self.x))

    def test_dropout_modes(self):
        x = torch.ones(6, 50)
        out = vmap(lambda x: F.dropout(x, 0.5), randomness="different")(x)
        assert not torch.equal(out[0], out[1])
        assert set(out.unique().tolist()) <= {0.0, 2.0}
        out = vmap(lambda x: F.dropout(x, 0.5), randomness="same")(x)
        assert torch.equal(out[0], out[5])

    def test_nested_different(self):
        out = vmap(vmap(lambda x: torch.rand(2) + x * 0, randomness="different"),
                   randomness="different")(torch.zeros(3, 4))
        assert out.shape == (3, 4, 2) and out.unique().numel() == 24

    def test_different_inplace_on_unbatched_errors(self):
        same_error(lambda x: torch.zeros(3).normal_() + x, self.x, randomness="different")

    def test_random_op_on_unbatched_input(self):
        p = torch.full((3,), 0.5)
        same_error(lambda x: torch.bernoulli(p) + x, self.x, match="randomness")
        p30 = torch.full((30,), 0.5)
        out = vmap(lambda x: torch.bernoulli(p30) + x * 0, randomness="different")(
            torch.zeros(4, 30))
        assert not torch.equal(out[0], out[1])

    def test_eval_dropout_is_not_random(self):
        same(lambda x: F.dropout(x, 0.5, training=False), self.x)

    @pytest.mark.cpu_only("CUDA's generator draws by kernel launch, not element by element: "
                          "one draw of the batch is not the loop's draws of each example")
    def test_functional_uniform_follows_the_mode(self):
        """``aten.uniform`` (functional, used by decompositions) decomposes into a draw of
        the logical shape: before, it drew once in every mode. torch.func falls back to a
        loop that ignores the mode, drawing each example in turn from the same stream."""
        f = lambda t: torch.ops.aten.uniform(t, -1.0, 2.0)
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(f)(self.x)
        loop = []
        for mode in ("different", "same"):
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.func's slow-fallback warning
                loop.append(func_vmap(f, randomness=mode)(self.x))
            torch.manual_seed(0)
            ours = vmap(f, randomness=mode)(self.x)
            expected = loop[-1] if mode == "different" else loop[-1][:1].expand_as(ours)
            assert_close(ours, expected, rtol=0, atol=0)
        assert not torch.equal(loop[0][0], loop[0][1])


def _rrelu_with_slopes(x, lower=0.1, upper=0.3):
    """rrelu in training mode and the slopes it drew (written to its noise)."""
    noise = torch.empty_like(x)
    return torch.ops.aten.rrelu_with_noise(x, noise, lower, upper, True), noise


def _check_rrelu(x, out, slopes, lower=0.1, upper=0.3):
    """``out`` is ``x`` times ``slopes``: drawn from [lower, upper] where ``x <= 0``, 1
    elsewhere (what PyTorch's kernel computes)."""
    negative = x <= 0
    assert torch.equal(out, torch.where(negative, x * slopes, x))
    assert torch.equal(slopes[~negative], torch.ones_like(slopes[~negative]))
    assert ((slopes[negative] >= lower) & (slopes[negative] <= upper)).all()


class TestRRelu:
    """rrelu draws its slopes in training mode, per the randomness mode (torch.func has no
    rule for rrelu; before, torchlevels' slow loop drew per example in every mode)."""

    x = torch.randn(1, 40).expand(5, 40).contiguous()  # equal examples, both signs

    @pytest.mark.parametrize("mode", ["different", "same"])
    def test_slopes_per_mode(self, mode):
        out, slopes = vmap(_rrelu_with_slopes, randomness=mode)(self.x)
        _check_rrelu(self.x, out, slopes)
        negative = self.x[0] <= 0
        assert torch.equal(slopes[0], slopes[1]) == (mode == "same")
        assert negative.any() and torch.equal(out[0], out[1]) == (mode == "same")

    def test_same_shares_slopes_between_different_examples(self):
        x = torch.randn(6, 50)
        out, slopes = vmap(_rrelu_with_slopes, randomness="same")(x)
        _check_rrelu(x, out, slopes)
        both = (x[0] <= 0) & (x[1] <= 0)
        assert both.any() and torch.equal(slopes[0][both], slopes[1][both])

    @pytest.mark.parametrize("mode", ["different", "same"])
    @pytest.mark.parametrize("form", ["F.rrelu", "inplace", "functional"])
    def test_forms(self, mode, form):
        if form == "functional":  # returns the slopes, leaves its noise argument alone
            noise = torch.zeros(40)
            out, slopes = vmap(lambda t: torch.ops.aten.rrelu_with_noise_functional(
                t, noise, 0.1, 0.3, True), randomness=mode)(self.x)
            assert not noise.any()
        else:
            f = {"F.rrelu": lambda t: F.rrelu(t, 0.1, 0.3, training=True),
                 "inplace": lambda t: F.rrelu(t.clone(), 0.1, 0.3, True, inplace=True)}[form]
            out = vmap(f, randomness=mode)(self.x)
            slopes = torch.where(self.x <= 0, out / self.x, 1)
        _check_rrelu(self.x, out, slopes)
        assert torch.equal(out[0], out[1]) == (mode == "same")

    def test_error_mode_and_eval(self):
        with pytest.raises(RuntimeError, match="randomness"):
            vmap(lambda t: F.rrelu(t, training=True))(self.x)
        x = torch.randn(4, 7)
        for f in (F.rrelu, lambda t: F.rrelu(t.clone(), inplace=True),
                  lambda t: torch.ops.aten.rrelu_with_noise(t, torch.empty_like(t))):
            assert_close(vmap(f)(x), torch.stack([f(row) for row in x]))

    @pytest.mark.parametrize("mode", ["different", "same", "error"])
    def test_unbatched_input(self, mode):
        w = torch.randn(40)
        f = lambda t: F.rrelu(w, 0.1, 0.3, training=True) + t * 0
        if mode == "error":
            with pytest.raises(RuntimeError, match="randomness"):
                vmap(f)(self.x)
            return
        out = vmap(f, randomness=mode)(self.x)
        _check_rrelu(w.expand_as(out), out, torch.where(w <= 0, out / w, 1))
        assert torch.equal(out[0], out[1]) == (mode == "same")

    def test_unbatched_noise_for_a_batched_input_errors(self):
        noise = torch.empty(40)
        with pytest.raises(RuntimeError, match="not batched"):
            vmap(lambda t: torch.ops.aten.rrelu_with_noise(t, noise, 0.1, 0.3, True),
                 randomness="different")(self.x)

    @pytest.mark.parametrize("mode", ["different", "same"])
    def test_gradient_is_the_slope(self, mode):
        def loss(x):
            out, slopes = _rrelu_with_slopes(x)
            return out.sum(), slopes

        gradient, slopes = vmap(torchlevels.grad(loss, has_aux=True), randomness=mode)(self.x)
        assert torch.equal(gradient, slopes)
        x = self.x.clone().requires_grad_()
        out, slopes = vmap(_rrelu_with_slopes, randomness=mode)(x)
        out.sum().backward()
        assert torch.equal(x.grad, slopes)


def test_autograd_flows_through_vmap_to_parameters():
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(5, 3, requires_grad=True)
    vmap(lin)(x).pow(2).sum().backward()
    ours = (lin.weight.grad.clone(), x.grad.clone())
    lin.weight.grad = None
    x.grad = None
    func_vmap(lin)(x).pow(2).sum().backward()
    assert_close(ours, (lin.weight.grad, x.grad))



_I0, _I1 = torch.randint(0, 5, (10, 1)), torch.randint(0, 5, (1, 10))
# ops vmap batches through their decomposition, where only an argument that autograd does
# not track is batched: the pieces that read the tracked one alone reach no level
DECOMPOSED_WITH_A_TRACKED_UNBATCHED_INPUT = {
    "_unsafe_masked_index, the mask batched": (
        lambda x, m: torch.ops.aten._unsafe_masked_index(x, m, [_I0, _I1], -1.0),
        lambda: (torch.randn(5, 5), torch.rand(3, 10, 10) > 0.3), (None, 0), [0]),
    "max_unpool3d, the indices batched": (
        lambda a, i: F.max_unpool3d(a, i, 3, 2, 0, (1, 2, 3, 6, 5)),
        lambda: (torch.randn(1, 2, 1, 3, 2), torch.stack(
            [torch.randperm(90)[:12].view(1, 2, 1, 3, 2) for _ in range(3)])), (None, 0), [0]),
    "_unsafe_masked_index_put_accumulate, the values unbatched": (
        lambda a, v: torch.ops.aten._unsafe_masked_index_put_accumulate(
            a, torch.ones(10, 10, dtype=torch.bool), [_I0, _I1], v),
        lambda: (torch.randn(3, 5, 5), torch.randn(10, 10)), (0, None), [0, 1]),
}


@pytest.mark.parametrize("case", list(DECOMPOSED_WITH_A_TRACKED_UNBATCHED_INPUT))
def test_autograd_outside_reaches_an_unbatched_input_of_a_decomposed_op(case):
    """The output lost its graph to the unbatched input (no gradient, or None), where
    torch.func and a loop give one."""
    f, make, in_dims, tracked = DECOMPOSED_WITH_A_TRACKED_UNBATCHED_INPUT[case]
    torch.manual_seed(0)
    args = [a.requires_grad_() if k in tracked else a for k, a in enumerate(make())]
    inputs = [args[k] for k in tracked]
    loop = torch.stack([f(*(a if d is None else a[b] for a, d in zip(args, in_dims)))
                        for b in range(3)])
    cotangent = torch.randn_like(loop)
    expected = torch.autograd.grad(loop, inputs, cotangent)
    for lib_vmap in (vmap, func_vmap):
        out = lib_vmap(f, in_dims=in_dims)(*args)
        assert_close(out, loop)
        assert_close(torch.autograd.grad(out, inputs, cotangent), expected)

def test_autograd_outside_through_an_output_the_same_for_every_example():
    """lstsq's empty residuals (driver gels) are one placeholder for all examples: returned
    plain, autograd gave them the node it recorded on the level's tensors, and a backward
    pass through them raised once vmap had exited."""
    A = torch.randn(2, 3, 2, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)

    def f(a, rhs):
        return torch.linalg.lstsq(a, rhs, driver="gels")[:2]

    loop = [torch.stack(o) for o in zip(*(f(A[..., k], b) for k in range(2)))]
    cotangents = [torch.randn_like(o) for o in loop]
    expected = torch.autograd.grad(loop, (A, b), cotangents)
    for lib_vmap in (vmap, func_vmap):
        out = lib_vmap(f, in_dims=(-1, None))(A, b)
        assert_close(list(out), loop)
        assert_close(torch.autograd.grad(out, (A, b), cotangents), expected)


def _write_then(b, view, value):
    """``b`` after ``view(b).copy_(value)``."""
    view(b).copy_(value)
    return b


# a tensor that autograd outside tracks written through a view of a buffer made inside
VIEW_WRITES = {
    "slice": lambda x, w: _write_then(x.new_zeros(3), lambda b: b[0:2], x[:2] * w[:2]),
    "view of a view": lambda x, w: _write_then(x * 1, lambda b: b.unsqueeze(0)[0, 1:],
                                               x[1:] * w[1:]),
    "select": lambda x, w: _write_then(x.new_zeros(3, 2), lambda b: b.select(1, 0),
                                       x * w).sum(1),
    "diagonal": lambda x, w: _write_then(x.new_zeros(3, 3), torch.diagonal, x * w),
    "as_strided": lambda x, w: _write_then(x.new_zeros(3), lambda b: b.as_strided((2,), (1,)),
                                           x[:2] * w[:2]),
    # the view is made before its base is written
    "base written": lambda x, w: (lambda b, v: (b.copy_(x * w), v * 1)[1])(
        *(lambda b: (b, b[1:]))(x.new_zeros(3))),
}


@pytest.mark.parametrize("inputs_require_grad", [False, True])
@pytest.mark.parametrize("case", list(VIEW_WRITES))
def test_autograd_outside_sees_writes_through_views(case, inputs_require_grad):
    xs0, w0 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    grads = []
    for vmap_ in (vmap, func_vmap):
        w = w0.clone().requires_grad_()
        xs = xs0.clone().requires_grad_(inputs_require_grad)
        out = vmap_(functools.partial(VIEW_WRITES[case], w=w))(xs)
        grads.append(torch.autograd.grad((out ** 2).sum(), [w, xs][:1 + inputs_require_grad]))
    assert_close(grads[0], grads[1])


def test_partial_and_module_names_in_errors():
    f = functools.partial(torch.add, alpha=2)
    with pytest.raises(ValueError, match="functools.partial"):
        vmap(f, in_dims=(0, 5))(torch.randn(3), torch.randn(3))


def test_common_ops_do_not_use_the_slow_loop():
    def f(x, w):
        h = F.relu(x @ w).softmax(-1)
        return h.transpose(0, 1).reshape(-1).cumsum(0)[:3].sum() + h.mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(f, torch.randn(4, 3, 5), torch.randn(5, 6), in_dims=(0, None))


def test_data_dependent_output_shape_errors_clearly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-loop warning
        with pytest.raises(RuntimeError, match="depends on the data"):
            vmap(torch.unique_consecutive)(torch.tensor([[1, 1, 2], [1, 2, 3]]))


def test_the_demos_slow_loop_example_still_has_no_rule():
    # torchlevels/demo.py shows the slow loop with torch.histogram: give it a rule, and
    # the demo needs another example
    from torchlevels.batching.registry import How, resolve

    assert resolve(torch.ops.aten.histogram.bin_ct).how is How.LOOP


@pytest.mark.parametrize("untrack", [".data", "detach_()", "detach()"])
def test_data_and_detach_inside_vmap_over_a_tensor_that_requires_grad(untrack):
    """Each is a constant for autograd outside, as in a loop (before, ``.data`` and
    ``detach_()`` kept the history: silently doubled gradients). torch.func refuses
    ``.data`` under vmap."""
    f = {".data": lambda v: v * v.data, "detach_()": lambda v: v * (v * 2).detach_(),
         "detach()": lambda v: v * v.detach()}[untrack]
    x0 = torch.randn(4, 3)
    x = x0.clone().requires_grad_()
    vmap(f)(x).sum().backward()
    ref = x0.clone().requires_grad_()
    torch.stack([f(row) for row in ref.unbind()]).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


EMPTY_BATCH = {  # every reduction over all elements flattens each example to a row
    "sum": lambda v: v.sum(),
    "mean": lambda v: v.mean(),
    "amax": lambda v: v.max(),
    "argmax": lambda v: v.argmax(),
    "std": lambda v: v.std(),
    "roll": lambda v: v.roll(1),
    "count_nonzero": lambda v: v.count_nonzero(),
    "softmax": lambda v: v.softmax(-1),
    "matmul": lambda v: v @ torch.ones(3, 2),
}


@pytest.mark.parametrize("name", [*EMPTY_BATCH, "vmap(grad)"])
def test_an_empty_batch_as_torch_func(name):
    """A batch of 0 examples gives outputs with a 0-size batch dim (before, the full
    reductions failed: reshape cannot infer -1 when there are no elements)."""
    empty = torch.randn(0, 2, 3)
    if name == "vmap(grad)":
        loss = lambda u: (u.sin() ** 2).sum()
        expected = func_vmap(torch.func.grad(loss))(empty)
        actual = vmap(torchlevels.grad(loss))(empty)
    else:
        expected, actual = func_vmap(EMPTY_BATCH[name])(empty), vmap(EMPTY_BATCH[name])(empty)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype


W, TABLE = torch.randn(4, 3, 3, 3), torch.randn(5, 4)
EMPTY_BATCH_MODELS = {  # torch.func raises or returns a wrong shape for each over none
    "conv2d": (lambda x: F.conv2d(x, W), (2, 3, 6, 6)),
    "conv2d of one image": (lambda x: F.conv2d(x, W), (3, 6, 6)),
    "batch norm (eval)": (lambda x: F.batch_norm(x, torch.zeros(3), torch.ones(3)), (2, 3, 4)),
    "group norm": (lambda x: F.group_norm(x, 1), (2, 4, 5)),
    "interpolate": (lambda x: F.interpolate(x, scale_factor=2.0), (2, 3, 4)),
    "unfold": (lambda x: F.unfold(x, 2), (2, 3, 4, 4)),
    "conv2d, weight per example": (lambda w: F.conv2d(torch.ones(1, 3, 5, 5), w), (4, 3, 3, 3)),
    "batch norm (training)": (lambda x: F.batch_norm(x, None, None, training=True), (2, 3, 4)),
    "instance norm": (lambda x: F.instance_norm(x), (2, 3, 4)),
    "embedding_bag": (lambda i: F.embedding_bag(i, TABLE), (2, 3)),
    "index_select": (lambda i: torch.arange(5.0).index_select(0, i), (3,)),
    "index_add": (lambda i: torch.zeros(5).index_add(0, i, torch.ones(3)), (3,)),
    "attention": (lambda q: F.scaled_dot_product_attention(q, q, q), (2, 3, 4)),
}


@pytest.mark.parametrize("name", EMPTY_BATCH_MODELS)
@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)"])
def test_an_empty_batch_where_kernels_refuse_empty_inputs(name, transform):
    """What a loop over no examples gives: outputs shaped like one example's, 0 of them.
    Kernels that refuse the empty inputs a batch of none folds to (0 groups, no elements
    to normalize), or crash on them (batch norm's backward: SIGFPE), are not called."""
    f, shape = EMPTY_BATCH_MODELS[name]
    integer = name in ("embedding_bag", "index_select", "index_add")
    example = torch.randint(0, 5, shape) if integer else torch.randn(shape)
    if transform == "vmap(grad)":
        if integer:
            pytest.skip("integer inputs have no gradient")
        f = torchlevels.grad(lambda v, f=f: f(v).sin().sum())
    expected = f(example)
    actual = vmap(f)(example.new_empty(0, *shape))
    assert actual.shape == (0, *expected.shape) and actual.dtype == expected.dtype


def test_an_empty_batch_again_reuses_one_examples_output_shapes(monkeypatch):
    """Over no examples, each op's one-example output shapes come from its meta kernel
    (often Python references, up to ~1 ms an op); a second call with the same shapes,
    dtypes and other arguments reuses them, and any difference among those does not."""
    from torchlevels.batching import registry

    def f(x, y, dim):
        return F.cross_entropy((TABLE.T.to(x.dtype) @ x).sum(-1)[None], y[None]) + x.sum(dim).mean()

    calls = []
    meta_key = registry._meta_call_key
    monkeypatch.setattr(registry, "_meta_call_key",
                        lambda *a: calls.append(a[0]) or meta_key(*a))
    monkeypatch.setattr(registry, "_META_OUTPUTS", {})
    y = torch.randint(0, 4, (0,))
    for x, dim in [(torch.randn(0, 5, 2), 0), (torch.randn(0, 5, 2), 0),
                   (torch.randn(0, 5, 3), 0), (torch.randn(0, 5, 2), 1),
                   (torch.randn(0, 5, 2, dtype=torch.float64), 0)]:
        out = vmap(f, in_dims=(0, 0, None))(x, y, dim)
        one = f(torch.randn(x.shape[1:], dtype=x.dtype), torch.tensor(1), dim)
        assert out.shape == (0, *one.shape) and out.dtype == one.dtype
    computed = len(registry._META_OUTPUTS)
    assert 0 < computed < len(calls)  # the second call computed nothing new
    vmap(f, in_dims=(0, 0, None))(torch.randn(0, 5, 2), y, 0)
    assert len(registry._META_OUTPUTS) == computed


def test_an_empty_batch_through_the_slow_loop():
    """The loop runs no example: one example's output shape comes from a meta kernel, and
    without one the error says so (instead of failing to stack nothing)."""
    from torchlevels.batching.registry import loop_rule

    x = torch.randn(0, 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, out_dims = loop_rule(torch.ops.aten.mm.default, (x, torch.randn(3, 2)), (0, None),
                                  {})
        assert out.shape == (0, 4, 2) and out_dims == 0
        with pytest.raises(RuntimeError, match="no meta kernel"):
            vmap(lambda v: torch.histogram(v, 3).hist)(torch.randn(0, 4))


AUTOCAST = {  # autocast casts the batched tensors, above the level; the rules see bf16
    "linear": lambda a, w, k: F.linear(a, w),
    "linear with a bias": lambda a, w, k: F.linear(a, w, w[0, :5]),
    "addmm": lambda a, w, k: torch.addmm(w[0, :5], a, w.T),
    "matmul": lambda a, w, k: a @ w.T,
    "conv1d": lambda a, w, k: F.conv1d(a, k),
    "conv2d of one image": lambda a, w, k: F.conv2d(a[None, None], k[:, :1, None]),
    "softmax of a product": lambda a, w, k: (a @ w.T).softmax(-1),
    "layer_norm of a product": lambda a, w, k: F.layer_norm(a @ w.T, (5,)),
}


@pytest.mark.parametrize("name", list(AUTOCAST))
def test_under_autocast_as_a_loop(name):
    """Dtypes and values as a loop under ``torch.autocast`` (torch.func's convolutions,
    addmm and linear with a bias return float32 there), and per-example gradients as
    torch.func's."""
    f = functools.partial(AUTOCAST[name], w=torch.randn(5, 8), k=torch.randn(2, 3, 3))
    x = torch.randn(4, 3, 8)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        ours = vmap(f)(x)
        loop = torch.stack([f(a) for a in x])
        grads = vmap(torchlevels.grad(lambda a: f(a).float().sum()))(x)
        theirs = func_vmap(torch.func.grad(lambda a: f(a).float().sum()))(x)
    assert ours.dtype == loop.dtype
    assert loop.dtype == torch.bfloat16 or x.is_cuda  # (CUDA's autocast: softmax in float32)
    assert torch.equal(ours, loop)
    # to bfloat16's precision: layer norm's backward runs as its decomposition, which
    # rounds each step to bfloat16 where the kernel rounds once
    assert_close(grads, theirs, rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("in_dims", [True, (True,), (False,)])
def test_bool_in_dims_are_refused_not_read_as_ints(in_dims):
    x = torch.randn(3, 4)
    with pytest.raises(TypeError):
        torch.func.vmap(torch.sin, in_dims=in_dims)(x)
    with pytest.raises(ValueError, match="in_dim must be either an integer dimension or None"):
        vmap(torch.sin, in_dims=in_dims)(x)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_tensor_is_refused_with_the_loop_that_gives_torch_funcs_answer(layout):
    """A level's tensor has one shape per example, which a nested tensor's components do
    not share: vmap refuses one (README), naming the loop over its components to write
    instead, which gives what torch.func's vmap over it gives."""
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=layout)

    def f(x):
        return x.sin() * 5.0 + 4.0

    with pytest.raises(NotImplementedError, match=r"(?s)nested tensor.*"
                       r"as_nested_tensor\(\[f\(t\) for t in nt.unbind\(\)\]\).*to_padded"):
        vmap(f)(nt)
    instead = torch.nested.as_nested_tensor([f(t) for t in nt.unbind()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's fallback warns
        theirs = func_vmap(f)(nt)
    for ours, expected in zip(instead.unbind(), theirs.unbind(), strict=True):
        assert_close(ours, expected)
