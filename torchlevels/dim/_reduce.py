"""Rule 2, dims wherever torch takes a ``dim``: ``x.sum(k)``, ``x.mean((h, w))``,
``softmax(x, dim=key)``; and a product summed over shared dims runs as one einsum.

``A[i, k] * B[k, j]`` is delayed: if ``.sum(k)`` follows, the pair becomes
``einsum("ik,kj->ij")`` (one matmul, the full product never exists); any other use
computes the product.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim, DimList
from torchlevels.dim._ops import Tensor, _axes, find, pointwise, storage, union, wrap

# name -> (position of the dim argument, whether the dim is reduced away, one dim only)
_DIM_ARGUMENTS = {
    **{n: (1, True, False) for n in (
        "sum", "mean", "amax", "amin", "all", "any", "logsumexp", "nansum", "nanmean",
        "std", "var", "count_nonzero", "aminmax")},
    **{n: (1, True, True) for n in (
        "prod", "max", "min", "argmax", "argmin", "median", "nanmedian", "mode")},
    "kthvalue": (2, True, True),
    "norm": (2, True, False),
    **{n: (1, False, True) for n in (
        "softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
        "sort", "argsort")},
}


def _functions() -> dict:
    table = {}
    for name, spec in _DIM_ARGUMENTS.items():
        for owner in (torch.Tensor, torch, torch.nn.functional):
            f = getattr(owner, name, None)
            if f is not None:
                table[f] = spec
    return table


_RULES: dict | None = None


def rule_for(func) -> Any:
    """The Rule-2 handler if ``func`` takes a dim argument, else None."""
    global _RULES
    if _RULES is None:
        _RULES = _functions()
    spec = _RULES.get(func)
    return None if spec is None else lambda f, a, k: _with_dims(f, a, k, *spec)


def _names_dims(spec: Any) -> bool:
    if isinstance(spec, (Dim, DimList)):
        return True
    return isinstance(spec, (tuple, list)) and any(isinstance(e, (Dim, DimList)) for e in spec)


def _with_dims(func, args: tuple, kwargs: dict, pos: int, reduces: bool, single: bool) -> Any:
    in_kwargs = "dim" in kwargs
    spec = kwargs["dim"] if in_kwargs else (args[pos] if len(args) > pos else None)
    if not _names_dims(spec):
        return NotImplemented  # positional dims only: the batched path is exact
    x = args[0]
    name = getattr(func, "__name__", str(func))
    if not isinstance(x, _Tensor):
        raise ValueError(f"{name}: dims {spec} given for a tensor without first-class dims")
    entries = spec if isinstance(spec, (tuple, list)) else (spec,)
    if type(x) is _DelayedMul and name == "sum" and len(args) <= 2 and not kwargs.keys() - {
        "dim"
    } and all(isinstance(e, (Dim, DimList)) for e in entries):
        return _dot(x, tuple(d for e in entries for d in (e if isinstance(e, DimList) else [e])))
    axes = [a for e in entries for a in _axes(x, e)]
    if single and len(axes) != 1:
        raise ValueError(f"{name} takes one dim, got {spec}")
    keepdim = kwargs.get("keepdim", False)
    if reduces and keepdim and any(a < len(x._dims) for a in axes):
        raise ValueError(
            f"{name}(keepdim=True) cannot keep the first-class dims of {spec}; drop keepdim "
            "or reduce positional dims only"
        )
    dims, _, device = union([a for a in args if isinstance(a, _Tensor)])
    if not all(d is e for d, e in zip(dims, x._dims)):
        return NotImplemented  # other arguments bring dims of their own
    new = axes[0] if single else tuple(axes)
    t = storage(x, device)
    if in_kwargs:
        args, kwargs = (t, *args[1:]), {**kwargs, "dim": new}
    else:
        args = (t, *args[1:pos], new, *args[pos + 1:])
    out = func(*args, **kwargs)
    kept = tuple(d for k, d in enumerate(x._dims) if not (reduces and k in axes))
    return tree_map(lambda o: wrap(o, kept) if isinstance(o, torch.Tensor) else o, out)


# -- delayed products ---------------------------------------------------------------------
class _DelayedMul(Tensor):
    """``lhs * rhs``, computed only if something other than a sum over dims reads it."""

    __slots__ = ("_lhs", "_rhs", "_product")

    def __init__(self, lhs: Tensor, rhs: Tensor) -> None:
        self._lhs, self._rhs, self._product = lhs, rhs, None
        self._dims = union([lhs, rhs])[0]

    @property
    def _tensor(self) -> torch.Tensor:
        if self._product is None:
            self._product = pointwise(torch.mul, (self._lhs, self._rhs), {})._tensor
        return self._product


def multiply(*args: Any, **kwargs: Any) -> Any:
    """``a * b``: delayed when both have only first-class dims and are floating point."""
    if len(args) == 2 and not kwargs and all(
        type(a) is Tensor and a.ndim == 0 and a._tensor.is_floating_point() for a in args
    ):
        return _DelayedMul(*args)
    return pointwise(torch.mul, args, kwargs)


def _dot(product: _DelayedMul, summed: tuple) -> Any:
    for d in summed:
        if find(product._dims, d) < 0:
            raise ValueError(f"sum: tensor has no dim {d}: its dims are {product._dims}")
    letters: dict[int, str] = {}

    def subscripts(dims: tuple) -> str:
        return "".join(letters.setdefault(id(d), chr(97 + len(letters))) for d in dims)

    lhs, rhs = product._lhs, product._rhs
    kept = tuple(d for d in product._dims if find(summed, d) < 0)
    equation = f"{subscripts(lhs._dims)},{subscripts(rhs._dims)}->{subscripts(kept)}"
    a, b = lhs._tensor, rhs._tensor
    if a.dtype != b.dtype:
        dtype = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(dtype), b.to(dtype)
    return wrap(torch.einsum(equation, a, b), kept)
