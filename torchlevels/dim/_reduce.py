"""Rule 2, dims wherever torch takes a ``dim``: ``x.sum(k)``, ``x.mean((h, w))``,
``softmax(x, dim=key)``; and a product summed over shared dims runs as one matmul.

``A[i, k] * B[k, j]`` is delayed: if ``.sum(k)`` follows, the pair becomes one matmul
(``A @ B``; batched over shared dims that are kept), and the full product never exists;
any other use computes the product. Either reads ``A`` and ``B`` then, so if one was
modified in place since the product was written, it raises (see ``_ops.Delayed``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim, DimList
from torchlevels.dim._lookup import DelayedLookup, bag
from torchlevels.dim._ops import (
    Delayed,
    Tensor,
    _axes,
    _created,
    find,
    order,
    pointwise,
    reorder,
    storage,
    torch_function,
    union,
    wrap,
)

# name -> (position of the dim argument, whether the dim is reduced away, one dim only)
_DIM_ARGUMENTS = {
    **{n: (1, True, False) for n in (
        "sum", "mean", "amax", "amin", "all", "any", "logsumexp", "nansum", "nanmean",
        "std", "var", "count_nonzero", "std_mean", "var_mean")},
    **{n: (1, True, True) for n in (
        "prod", "max", "min", "argmax", "argmin", "median", "nanmedian", "mode", "aminmax",
        "unbind", "select")},
    **{n: (2, True, True) for n in ("kthvalue", "quantile", "nanquantile")},
    "norm": (2, True, False),
    **{n: (1, False, True) for n in (
        "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cumsum_", "cumprod_",
        "cummax", "cummin", "logcumsumexp", "sort", "argsort")},
    "renorm": (2, False, True),
    "flip": (1, False, False),
    "roll": (2, False, False),
}


@functools.cache
def _table() -> dict:
    table = {}
    for name, spec in _DIM_ARGUMENTS.items():
        for owner in (torch.Tensor, torch, torch.nn.functional):
            f = getattr(owner, name, None)
            if f is not None:
                table[f] = spec
    return table


def dim_argument(func) -> tuple[int, bool, bool] | None:
    """``(position, reduces, one dim only)`` of ``func``'s dim argument, or None."""
    return _table().get(func)


def _names_dims(spec: Any) -> bool:
    if isinstance(spec, (Dim, DimList)):
        return True
    return isinstance(spec, (tuple, list)) and any(isinstance(e, (Dim, DimList)) for e in spec)


def with_dims(func, args: tuple, kwargs: dict, pos: int, reduces: bool, single: bool) -> Any:
    """Rule 2 for ``func``; NotImplemented when its dim argument names no first-class dim."""
    if func is torch.Tensor.flip and len(args) > 2:
        args = (args[0], args[1:])  # x.flip(i, k): Tensor.flip takes dims as arguments too
    in_kwargs = "dim" in kwargs
    spec = kwargs["dim"] if in_kwargs else (args[pos] if len(args) > pos else None)
    if not _names_dims(spec):
        return NotImplemented  # positional dims only: the batched path is exact
    x = args[0]
    name = getattr(func, "__name__", str(func))
    if not isinstance(x, _Tensor):
        raise ValueError(f"{name}: dims {spec} given for a tensor without first-class dims")
    entries = spec if isinstance(spec, (tuple, list)) else (spec,)
    if type(x) in (_DelayedMul, DelayedLookup) and x._value is None and len(args) <= 2 and \
            not kwargs.keys() - {"dim"} and all(isinstance(e, (Dim, DimList)) for e in entries):
        summed = tuple(d for e in entries for d in (e if isinstance(e, DimList) else [e]))
        _check_once(name, [id(d) for d in summed], spec)
        x._check_inputs()
        if type(x) is _DelayedMul and name == "sum":
            return _dot(x, summed)
        if type(x) is DelayedLookup and name in ("sum", "mean"):
            out = bag(x, summed, name)
            if out is not None:
                return out
    axes = [a for e in entries for a in _axes(x, e)]
    if single and len(axes) != 1:
        raise ValueError(f"{name} takes one dim, got {spec}")
    _check_once(name, axes, spec)
    keepdim = kwargs.get("keepdim", False)
    if reduces and keepdim and any(a < len(x._dims) for a in axes):
        raise ValueError(
            f"{name}(keepdim=True) cannot keep the first-class dims of {spec}; drop keepdim "
            "or reduce positional dims only"
        )
    others = (args[1:], {n: v for n, v in kwargs.items() if n != "dim"}) if in_kwargs \
        else (args[1:pos] + args[pos + 1:], kwargs)
    if any(isinstance(a, _Tensor) for a in tree_flatten(others)[0]):
        # torch.quantile(x, q[j], dim=k): the op runs batched over the dims of every
        # argument, on x with the reduced dims made positional
        if not (reduces and axes):
            raise ValueError(
                f"{name} over the first-class dims {spec} takes no other argument with "
                "first-class dims (unless it reduces over them); .order() the dims first "
                "and pass positional dims"
            )
        y = order(x, tuple(entries))
        a, kw = _with_dim(args, kwargs, pos, y, 0 if single else tuple(range(len(axes))))
        return torch_function(func, a, kw)
    t = storage(x, None)
    nothing = not axes  # an empty dim list: run over a new size-1 dim, not over all dims
    if nothing:
        t, axes = t.unsqueeze(-1), [t.ndim]
    a, kw = _with_dim(args, kwargs, pos, t, axes[0] if single else tuple(axes))
    out = func(*a, **kw)
    if out is t:
        return x  # in place (cumsum_)
    kept = tuple(d for k, d in enumerate(x._dims) if not (reduces and k in axes))

    def finish(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if nothing and o.ndim == t.ndim:  # the size-1 dim was kept (keepdim, flip)
            o = o.squeeze(-1)
        return wrap(o, kept)

    return tree_map(finish, out)


def _with_dim(args: tuple, kwargs: dict, pos: int, x: Any, dim: Any) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with the input ``x`` and the dim argument ``dim``."""
    if "dim" in kwargs:
        return (x, *args[1:]), {**kwargs, "dim": dim}
    return (x, *args[1:pos], dim, *args[pos + 1:]), kwargs


def _check_once(name: str, named: list, spec: Any) -> None:
    """A dim may be named once in a dim argument (``x.sum((k, k))`` is an error)."""
    if len(set(named)) != len(named):
        raise ValueError(f"{name}: a dim appears multiple times in the dims {spec}; "
                         "name each dim once")


# -- delayed products ---------------------------------------------------------------------
class _DelayedMul(Delayed):
    """``lhs * rhs``, computed only if something other than a sum over dims reads it."""

    __slots__ = ("_lhs", "_rhs")
    _what = "a product of tensors with dims (delayed to run a following .sum() as a matmul)"

    def __init__(self, lhs: Tensor, rhs: Tensor, dims: tuple) -> None:
        super().__init__(dims, lhs._tensor, rhs._tensor)
        self._lhs, self._rhs = lhs, rhs

    def _compute(self) -> torch.Tensor:
        return reorder(pointwise(torch.mul, (self._lhs, self._rhs), {}), self._dims)._tensor


def multiply(*args: Any, **kwargs: Any) -> Any:
    """``a * b``: delayed when both have only first-class dims and are floating point; its
    dims are the union of theirs, in order, as in functorch.dim."""
    return _multiply(args, kwargs, False)


def mul(*args: Any, **kwargs: Any) -> Any:
    """``torch.mul(a, b)``, ``a.mul(b)``: ``a * b`` with the dims in creation order, as
    functorch.dim gives them (it runs these under vmap)."""
    return _multiply(args, kwargs, True)


def _multiply(args: tuple, kwargs: dict, created: bool) -> Any:
    if len(args) == 2 and not kwargs and all(
        type(a) is Tensor and a.ndim == 0 and a._tensor.is_floating_point() for a in args
    ):
        dims = union(args)[0]
        return _DelayedMul(*args, tuple(sorted(dims, key=_created)) if created else dims)
    return pointwise(torch.mul, args, kwargs, vmapped_there=created)


def _dot(product: _DelayedMul, summed: tuple) -> Any:
    """``(lhs * rhs).sum(summed)`` as one (batched) matmul: dims in both operands that
    are kept batch it, dims in both that are summed are contracted, the others are the
    rows and columns; a summed dim in one operand only is summed there first, in the
    product's dtype. The result's dims are the product's, in order, less the summed ones
    (a view of the matmul's)."""
    in_product = {id(d) for d in product._dims}
    for d in summed:
        if id(d) not in in_product:
            raise ValueError(f"sum: tensor has no dim {d}: its dims are {product._dims}")
    lhs, rhs = product._lhs, product._rhs
    is_summed = {id(d) for d in summed}
    dtype = torch.promote_types(lhs._tensor.dtype, rhs._tensor.dtype)
    (a, a_dims), (b, b_dims) = (_sum_alone(lhs, rhs, is_summed, dtype),
                                _sum_alone(rhs, lhs, is_summed, dtype))
    in_b = {id(d) for d in b_dims}
    in_a = {id(d) for d in a_dims}
    batch = [d for d in a_dims if id(d) in in_b and id(d) not in is_summed]
    contracted = [d for d in a_dims if id(d) in in_b and id(d) in is_summed]
    rows = [d for d in a_dims if id(d) not in in_b]
    cols = [d for d in b_dims if id(d) not in in_a]
    a = _grouped(a, a_dims, batch, rows, contracted)
    b = _grouped(b, b_dims, batch, contracted, cols)
    out = torch.matmul(a, b) if batch else torch.mm(a, b)
    kept = (*batch, *rows, *cols)
    sizes = [d._size for d in kept]
    out = wrap(out if out.shape == sizes else out.reshape(sizes), kept)
    want = [d for d in product._dims if id(d) not in is_summed]
    return out if all(d is e for d, e in zip(want, kept)) else reorder(out, tuple(want))


def _sum_alone(x: Tensor, other: Tensor, is_summed: set, dtype: torch.dtype
               ) -> tuple[torch.Tensor, tuple]:
    """``x``'s tensor in ``dtype`` (the product's), with the summed dims that ``other``
    lacks summed away in that dtype."""
    in_other = {id(d) for d in other._dims}
    alone = [k for k, d in enumerate(x._dims) if id(d) in is_summed and id(d) not in in_other]
    if not alone:
        return x._tensor.to(dtype), x._dims
    return (x._tensor.sum(alone, dtype=dtype),
            tuple(d for k, d in enumerate(x._dims) if k not in alone))


def _grouped(t: torch.Tensor, dims: tuple, batch: list, first: list, second: list
             ) -> torch.Tensor:
    """``t`` permuted to ``batch, first, second`` and each group flattened to one dim
    (no batch dim when ``batch`` is empty, so the result is a matrix)."""
    order = [*batch, *first, *second]
    perm = [find(dims, d) for d in order]
    if perm != list(range(len(perm))):
        t = t.permute(perm)
    sizes = [math.prod(d._size for d in g) for g in (batch, first, second) if g or g is not batch]
    return t if t.shape == sizes else t.reshape(sizes)
