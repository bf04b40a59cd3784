"""Random ops under vmap, per the level's ``randomness``: "error", "different" or "same".

Random ops that take a batched tensor reach the level's ``__torch_dispatch__`` like any
op. But ``torch.randn(3)`` takes no tensor, and ``torch.bernoulli(p)`` may take none of a
level's tensors, so that level never sees them: every random op is also intercepted
before dispatch (see predispatch.py) to apply each live level's randomness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchlevels._level import LevelTensor, enclosing_classes, innermost
from torchlevels._torch_compile import compiling, tracing_user_code
from torchlevels.batching.dims import logical_shape, to_front
from torchlevels.batching.pointwise import pointwise_rule
from torchlevels.batching.predispatch import intercept, passed_by
from torchlevels.batching.registry import bound_arguments, register, writes_first_argument

aten = torch.ops.aten

ERROR = (
    "vmap: called random operation while in randomness error mode. Please either use the "
    "'same' or 'different' randomness flags on vmap or perform the randomness operation "
    "out of vmap"
)


# Ops that draw random numbers (the nondeterministic_seeded tag also marks ops like
# scaled_dot_product_attention that are random only with dropout, so it is not used).
_PACKETS = {
    getattr(aten, name) for name in (
        "rand", "randn", "randint", "randperm", "normal", "normal_", "bernoulli", "bernoulli_",
        "multinomial", "poisson", "uniform_", "random_", "exponential_", "geometric_",
        "cauchy_", "log_normal_", "native_dropout", "rand_like", "randn_like",
        "randint_like", "_standard_gamma", "binomial", "_sample_dirichlet", "uniform",
    )
}
# rrelu draws its negative slopes in training mode only; the composite forms are
# intercepted so that an unbatched input gets each level's randomness
_RRELU = {aten.rrelu_with_noise, aten.rrelu_with_noise_, aten.rrelu_with_noise_functional}
_RRELU_COMPOSITE = {aten.rrelu, aten.rrelu_}
# Composite dropouts decompose into in-place bernoulli_ on a fresh tensor: the hook sees
# them first, so an unbatched input is batched before it decomposes.
_DROPOUTS = {aten.dropout, aten.feature_dropout, aten.alpha_dropout, aten.feature_alpha_dropout}


# random ops whose tensor argument gives only the shape, dtype and device of the draw
_LIKE = {aten.rand_like, aten.randn_like, aten.randint_like, aten.uniform}


def rule(level, func, args, dims, kwargs):
    """The batching rule of every random op that takes a batched tensor."""
    if func.overloadpacket in _RRELU:
        return _rrelu(level, func, args, dims, kwargs)
    randomness = level.randomness
    if randomness == "error":
        raise RuntimeError(f"{ERROR} (got {func})")
    inplace = writes_first_argument(func)
    if randomness == "different":
        if inplace and dims[0] is None:
            _raise_different_inplace(func)
        if func.overloadpacket is aten.multinomial:
            return _multinomial(func, args, dims, kwargs)
        return pointwise_rule(func, args, dims, kwargs)
    # randomness == "same": draw once with the logical shape and share it
    if func.overloadpacket in _LIKE:
        return func(_an_example(args[0], dims[0]), *args[1:], **kwargs), None
    if inplace and all(d is None for d in dims[1:]):
        self = to_front(args[0], dims[0])
        sample = torch.empty_like(_an_example(self, 0))
        func(sample, *args[1:], **kwargs)
        self.copy_(sample)
        return self, 0
    if func is aten.native_dropout.default and all(d is None for d in dims[1:]):
        x, p, train = args
        if not train:
            return pointwise_rule(func, args, dims, kwargs)
        mask = torch.empty(logical_shape(x, dims[0]), device=x.device).bernoulli_(1 - p).bool()
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        return (to_front(x, dims[0]) * mask * scale, mask), (0, None)
    raise RuntimeError(
        f"vmap: randomness='same' is not supported for {func} with a batched tensor input: "
        "the random values would depend on each example. Use randomness='different', or "
        "move the random op out of vmap."
    )


def _an_example(x: torch.Tensor, bdim: int) -> torch.Tensor:
    """The first example of batched ``x``, to draw one example's numbers like it; for a
    batch of none, an empty tensor of one example's shape (there is no first to select)."""
    if x.shape[bdim]:
        return x.select(bdim, 0)
    return x.new_empty(logical_shape(x, bdim))


def _raise_different_inplace(func) -> None:
    raise RuntimeError(
        f"vmap: Cannot ask for different inplace randomness on an unbatched tensor ({func}). "
        "This will appear like same randomness. Make the tensor batched first, e.g. "
        "x = x.expand(batch_size, *x.shape).clone() outside vmap."
    )


def _rrelu(level, func, args, dims, kwargs):
    """``rrelu_with_noise`` (and its in-place and functional forms): in training, each
    non-positive element of ``self`` times a slope drawn from U(lower, upper), and the
    slopes (1 for the other elements) written to ``noise``; in eval mode, leaky_relu with
    the mean slope, ``noise`` untouched."""
    p = bound_arguments(func, args, kwargs)
    self, noise, lower, upper = p["self"], p["noise"], p["lower"], p["upper"]
    self_dim, noise_dim = dims[0], dims[1]
    inplace = writes_first_argument(func)
    out_dim = None if self_dim is None else 0
    x = to_front(self, self_dim)
    if not p["training"]:
        out, slopes = F.leaky_relu(x, (lower + upper) / 2), None
    elif level.randomness == "error":
        raise RuntimeError(f"{ERROR} (got {func})")
    elif level.randomness == "different":  # the kernel on the batch: a slope per element
        if self_dim is None:
            if inplace:
                _raise_different_inplace(func)
            x, out_dim = x.expand(level.batch_size, *x.shape), 0
        slopes = torch.empty_like(x)
        out = aten.rrelu_with_noise.default(x, slopes, lower, upper, True, p["generator"])
    else:  # "same": one example's slopes, drawn once, for every example
        shape = x.shape if self_dim is None else x.shape[1:]
        drawn = torch.empty(shape, dtype=x.dtype, device=x.device)
        drawn.uniform_(lower, upper, generator=p["generator"])
        negative = x <= 0
        out, slopes = torch.where(negative, x * drawn, x), torch.where(negative, drawn, 1)
    if func.overloadpacket is aten.rrelu_with_noise_functional:
        if slopes is None:  # eval: the noise is returned as it was
            return (out, noise.clone()), (out_dim, noise_dim)
        return (out, slopes), (out_dim, out_dim)
    if slopes is not None:
        if noise_dim is None and out_dim is not None:
            raise RuntimeError(
                f"vmap: {func} writes each example's random slopes into `noise`, which is "
                "not batched at this level. Pass a batched noise tensor (e.g. "
                "torch.empty_like of the batched input), or call F.rrelu."
            )
        to_front(noise, noise_dim).copy_(slopes)
    if inplace:  # self is batched whenever out is (an unbatched one raised above)
        return x.copy_(out), out_dim
    return out, out_dim


def _multinomial(func, args, dims, kwargs):
    probs = to_front(args[0], dims[0])
    flat = probs.reshape(-1, probs.shape[-1])
    out = func(flat, *args[1:], **kwargs)
    return out.reshape(*probs.shape[:-1], out.shape[-1]), 0


register(*_PACKETS, *_RRELU, takes_level=True)(rule)


# -- random ops whose tensors are not batched at some level: torch.randn(3) inside vmap --


def _random_in_levels(op, args, kwargs):
    """Apply each live vmap level's randomness to a random op, from the outermost level in.

    Levels whose tensors the op already takes handle it in their own dispatch (see
    :func:`rule`); here the others raise ("error") or get an expanded input ("different").
    """
    from torchlevels.vmap import BatchLevel, wrap_batched

    if compiling():
        return _while_compiling(op, args, kwargs)
    if _draws_nothing(op, args, kwargs):
        return passed_by(op, args, kwargs)
    classes = [c for c in enclosing_classes(innermost()) if isinstance(c._level, BatchLevel)]
    for cls in classes:
        if cls._level.randomness == "error":
            raise RuntimeError(f"{ERROR} (got {op})")
    different = [c for c in reversed(classes) if c._level.randomness == "different"]
    for cls in different:
        if cls._level.batch_size is None:  # a `with vmap() as B` block before any B(t)
            raise RuntimeError(
                f"vmap: {op} draws numbers for each example of {cls._level.describe()}, "
                "which has no batch size yet: it takes the size of the first tensor "
                f"wrapped with {cls.__name__}(t, dim). Wrap a tensor first, or draw "
                "outside the block.")
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not tensors:  # a factory: draw with one leading dim per level, then wrap
        out = _draw(op, args, kwargs, [cls._level.batch_size for cls in different])
        for cls in different:  # outermost first
            out = wrap_batched(cls, out, 0)
        return out
    args = list(args)
    for cls in different:
        first = tensors[0]
        if not _batched_at(args[first], cls):
            if writes_first_argument(op):
                _raise_different_inplace(op)
            args[first] = _batch_at(args[first], cls)
    return passed_by(op, args, kwargs)


def _draws_nothing(op, args, kwargs) -> bool:
    """A dropout in eval mode or with p 0 or 1, or an rrelu in eval mode."""
    packet = op.overloadpacket
    if packet in _DROPOUTS or op is aten.native_dropout.default:
        return not args[2] or (packet in _DROPOUTS and args[1] in (0, 1))
    if packet in _RRELU or packet in _RRELU_COMPOSITE:
        return not bound_arguments(op, args, kwargs)["training"]
    return False


def _while_compiling(op, args, kwargs):
    """A random op that torch.compile runs while a vmap level is live. Its own work
    (inductor drawing with randperm as it builds its patterns) passes by. A compiled
    function called inside vmap would draw once for all examples in its graph: that is
    randomness "same", and an error for the other modes."""
    from torchlevels.vmap import BatchLevel

    if tracing_user_code():
        for cls in enclosing_classes(innermost()):
            level = cls._level
            if isinstance(level, BatchLevel) and level.randomness != "same":
                raise RuntimeError(
                    f"vmap: a function compiled with torch.compile calls {op} inside "
                    f"{level.describe()} with randomness={level.randomness!r}. Compiled "
                    "code draws its random numbers once for all examples, so this vmap "
                    "cannot give each example its own numbers or check them. Call the "
                    "function uncompiled inside vmap (or compile the whole composition "
                    "with torchlevels.compile), or use randomness='same'."
                )
    return passed_by(op, args, kwargs)


def _batch_at(t: torch.Tensor, cls) -> torch.Tensor:
    """``t`` with a batch dim (of equal entries) at vmap level ``cls``.

    A tensor of a level nested inside ``cls`` (jvp's or grad's in ``jacfwd``) cannot go
    inside a wrapper of ``cls``: it is multiplied by a batched 1 instead, so each level
    keeps its own part of ``t`` (its tangent, its graph).
    """
    from torchlevels.vmap import wrap_batched

    size = cls._level.batch_size
    if isinstance(t, LevelTensor) and issubclass(type(t), cls):
        ones = torch.ones(size, dtype=t.dtype, device=t.device)
        return t * wrap_batched(cls, ones, 0)
    return wrap_batched(cls, t.expand(size, *t.shape), 0)


def _batched_at(t: torch.Tensor, cls) -> bool:
    while isinstance(t, LevelTensor):
        if type(t) is cls:
            return True
        t = t._inner
    return False


def _draw(op, args, kwargs, sizes):
    """``op``'s output with extra leading dims ``sizes``, each entry drawn independently."""
    names = [a.name for a in op._schema.arguments]
    if "size" in names:
        i = names.index("size")
        if i < len(args):
            args = (*args[:i], [*sizes, *args[i]], *args[i + 1 :])
        else:
            kwargs = {**kwargs, "size": [*sizes, *kwargs["size"]]}
        return passed_by(op, args, kwargs)
    count = 1
    for s in sizes:
        count *= s
    draws = torch.stack([passed_by(op, args, kwargs) for _ in range(count)])
    return draws.reshape(*sizes, *draws.shape[1:])


for _packet in _PACKETS | _DROPOUTS | _RRELU | _RRELU_COMPOSITE:
    for _name in _packet.overloads():
        if "out" not in _name:
            intercept(getattr(_packet, _name), _random_in_levels)
