"""Running torch functions on tensors with first-class dims.

Rule 1 (implicit batching over the union of the inputs' dims) has two ways to run:
pointwise ops align every input to one layout (the union's dims first, then the
broadcast positional dims) with views and call the op once; every other op runs inside
one of this project's vmap levels per dim, so its batching rules do the work. Rule 2
(dims as ``dim`` arguments) is in ``_reduce``, indexing in ``_getitem``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NoReturn

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from torchlevels.dim._base import _Tensor
from torchlevels.dim._dims import Dim, DimList
from torchlevels.vmap import batch_level, wrap_batched


class Tensor(_Tensor):
    """A tensor with first-class dims: ``_tensor`` holds them as its leading dims.

    Made by indexing a tensor with dims, and by any op on such tensors.

    Example::

        >>> import torch
        >>> from torchlevels.dim import dims
        >>> batch, channel = dims(2)
        >>> x = torch.rand(8, 3)[batch, channel] + torch.rand(3)[channel]
        >>> x.dims, x.ndim
        ((batch, channel), 0)
    """

    __slots__ = ("_tensor", "_dims")

    def __init__(self, tensor: torch.Tensor, dims: tuple[Dim, ...]) -> None:
        self._tensor = tensor
        self._dims = dims

    @classmethod
    def from_positional(
        cls, tensor: torch.Tensor, levels: list, has_device: bool = True
    ) -> Tensor | torch.Tensor:
        """``tensor`` whose dims are ``levels``, in order: each a ``Dim`` (first-class)
        or a negative int (a positional dim, counted from the end: ..., -2, -1), as
        functorch.dim's levels are. A plain tensor when no level is a ``Dim``.
        ``has_device`` is accepted for functorch.dim's signature; the device is always
        the tensor's.

        Example::

            >>> import torch
            >>> from torchlevels.dim import Tensor, dims
            >>> i = dims(1)
            >>> x = Tensor.from_positional(torch.rand(3, 4), [-1, i], True)
            >>> x.dims, x.shape
            ((i,), torch.Size([3]))
        """
        for level in levels:
            if not isinstance(level, (Dim, int)):
                raise TypeError(
                    f"Tensor.from_positional: a level is a Dim or a negative int, got {level!r}"
                )
        if tensor.dim() != len(levels):
            raise ValueError(
                f"Tensor.from_positional: the tensor has {tensor.dim()} dims but "
                f"{len(levels)} levels were given; give one level per dim"
            )
        positions = [level for level in levels if not isinstance(level, Dim)]
        if positions != list(range(-len(positions), 0)):
            raise ValueError(
                "Tensor.from_positional: the positional levels must count up to -1 in "
                f"order, here {list(range(-len(positions), 0))}; got {positions}"
            )
        dim_axes = [k for k, level in enumerate(levels) if isinstance(level, Dim)]
        if not dim_axes:
            return tensor
        dims = tuple(levels[k] for k in dim_axes)
        for d, k in zip(dims, dim_axes):
            d.size = tensor.shape[k]
        positional_axes = [k for k, level in enumerate(levels) if not isinstance(level, Dim)]
        return wrap(tensor.permute(*dim_axes, *positional_axes), dims)


class Delayed(Tensor):
    """A tensor with dims whose value is computed (once) only if something reads it, from
    ``inputs`` read then: if one was modified in place in between, the value would see the
    change, so reading it raises instead (as autograd refuses a saved tensor modified in
    place). ``_what`` says what the value is and what delaying it is for."""

    __slots__ = ("_value", "_inputs", "_versions")
    _what = ""

    def __init__(self, dims: tuple[Dim, ...], *inputs: torch.Tensor) -> None:
        self._dims = dims
        self._value = None
        self._inputs = inputs
        self._versions = tuple(t._version for t in inputs)

    def _compute(self) -> torch.Tensor:
        raise NotImplementedError

    def _check_inputs(self) -> None:
        """Raise if an input was modified in place since this tensor was made."""
        for t, version in zip(self._inputs, self._versions):
            if t._version != version:
                raise RuntimeError(
                    f"{self._what}: a tensor it reads, of shape {tuple(t.shape)}, was "
                    f"modified in place after it was made (version {version}, now "
                    f"{t._version}), so it would see the change. Use it before modifying "
                    "the tensor, or make it from a .clone()"
                )

    @property
    def _tensor(self) -> torch.Tensor:
        if self._value is None:
            self._check_inputs()
            self._value = self._compute()
        return self._value


def wrap(tensor: torch.Tensor, dims: tuple[Dim, ...]) -> Tensor | torch.Tensor:
    """``tensor`` with leading ``dims``; a plain tensor when there are none."""
    return Tensor(tensor, dims) if dims else tensor


# -- dims compare by identity: ``==`` on dims is an op (Rule 3) ------------------------
def find(dims: tuple, d: Any) -> int:
    for k, x in enumerate(dims):
        if x is d:
            return k
    return -1


def same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def union(objs) -> tuple[tuple[Dim, ...], int, torch.device | None]:
    """The dims of ``objs`` in order of first appearance, their largest positional ndim,
    and the device of the first tensor with one (dims themselves live anywhere)."""
    dims: list[Dim] = []
    ndim = 0
    device = None
    for x in objs:
        if isinstance(x, _Tensor):
            for d in x._dims:
                if find(dims, d) < 0:
                    dims.append(d)
            if type(x) is not Dim:
                ndim = max(ndim, x.ndim)
                device = device or x._tensor.device
        elif isinstance(x, torch.Tensor):
            ndim = max(ndim, x.ndim)
            device = device or x.device
    return tuple(dims), ndim, device


def storage(x: _Tensor, device: torch.device | None) -> torch.Tensor:
    """The tensor behind ``x`` (a dim's index range is made on ``device``, else on torch's
    default device)."""
    if type(x) is Dim:
        return x.range(device or torch.get_default_device())
    return x._tensor


def align(x: _Tensor, dims: tuple, ndim: int, device: torch.device | None) -> torch.Tensor:
    """A view of ``x`` laid out as ``dims`` then ``ndim`` positional dims, with size 1
    where ``x`` lacks one; ``x``'s dims must all be in ``dims``."""
    t = storage(x, device)
    own = x._dims
    pad = ndim - (t.ndim - len(own))
    if pad == 0 and same(own, dims):
        return t
    t, present = _in_order(t, own, dims)
    index = [slice(None) if k in present else None for k in range(len(dims))]
    return t[(*index, *[None] * pad)]


def _in_order(t: torch.Tensor, own: tuple, dims: tuple) -> tuple[torch.Tensor, list[int]]:
    """``t`` with its leading dims ``own`` permuted into their order in ``dims``, and
    their (sorted) positions there."""
    where = [find(dims, d) for d in own]
    perm = sorted(range(len(own)), key=where.__getitem__)
    if perm != list(range(len(own))):
        t = t.permute(*perm, *range(len(own), t.ndim))
    return t, sorted(where)


# -- the entry point ------------------------------------------------------------------
def torch_function(func, args: tuple, kwargs: dict) -> Any:
    special = _special().get(func)
    if special is not None:
        return special(*args, **kwargs)
    from torchlevels.dim import _reduce

    dim_argument = _reduce.dim_argument(func)
    if dim_argument is not None:
        out = _reduce.with_dims(func, args, kwargs, *dim_argument)
        if out is not NotImplemented:
            return out
    if is_pointwise(func) or _pointwise_call(func, args, kwargs):
        return pointwise(func, args, kwargs)
    if func in _keeps_order() and _dim_given(func, args, kwargs):
        # functorch.dim runs these methods on the tensor itself, its dims left in order
        return tree_map(lambda o: reorder(o, args[0]._dims), batched(func, args, kwargs))
    if func in _order_rules()[1]:
        if func in _FLOOR_DIVIDE:  # functorch.dim's dtype: the aligned tensors' promotion
            flat, spec = tree_flatten((args, kwargs))
            args, kwargs = tree_unflatten(_promoted(flat, lambda x: x._tensor.shape), spec)
        out = batched(func, args, kwargs)
        dims = union(tree_flatten((args, kwargs))[0])[0]
        return tree_map(lambda o: reorder(o, dims), out)
    if func in _order_rules()[2]:
        out = batched(func, args, kwargs)
        dims = _in_place_order(func, args, kwargs)
        return tree_map(lambda o: reorder(o, dims), out)
    return batched(func, args, kwargs)


# -- the order of a result's dims, as functorch.dim gives it ------------------------------
# Its pointwise ops (a list of its own) align the inputs to the union of their dims; its
# Tensor methods below that are given a dim keep the tensor's dims in order; every other op
# runs under one vmap level per dim, nested in creation order, and its dims come in the
# order the batching rule leaves the batch dims (creation order when it moves them to the
# front, as binary ops do; the input's order when it keeps them in place, as unary ops do).
# batched() follows the batch dims; these tables name where the two libraries' lists differ.
_KEEPS_ORDER = (
    "mean", "sum", "all", "amax", "amin", "aminmax", "any", "count_nonzero", "logsumexp",
    "nanmean", "nansum", "prod", "std", "var", "max", "min", "argmax", "argmin", "kthvalue",
    "median", "nanmedian", "mode", "sort", "argsort", "unbind", "chunk", "cummax", "cummin",
    "cumprod", "cumprod_", "cumsum", "cumsum_", "logcumsumexp", "renorm", "softmax",
)
_DIM_AFTER = {"chunk": 2, "renorm": 2}  # where the dim argument is (else 1)
# pointwise here, under vmap in functorch.dim (their batching rules move the batch dims
# to the front: creation order); torch.mul and Tensor.mul too (see _reduce.mul)
_VMAPPED = ("fmax", "fmin", "logaddexp", "logaddexp2", "masked_fill", "max", "min")
# under vmap here, pointwise in functorch.dim (the union's order)
_ALIGNED = ("floor_divide", "__floordiv__", "__rfloordiv__", "isclose", "isreal", "kron",
            "outer", "addr", "polar", "trapz", "prelu", "dropout", "feature_dropout",
            "threshold", "glu", "hardswish", "logsigmoid")
# under vmap in both, but where the argument at this position is the only one batched,
# functorch.dim's batching rule leaves its batch dim in place, and this project's moves it
# to the front (see _in_place_order)
_IN_PLACE = {"bucketize": 0, "searchsorted": 1, "index_fill": 0}
_FLOOR_DIVIDE = (torch.floor_divide, torch.Tensor.floor_divide, torch.Tensor.__floordiv__,
                 torch.Tensor.__rfloordiv__)


def _promoted(flat: list, shape_of: Any) -> list:
    """Two tensor operands cast to the dtype they promote to with the shapes ``shape_of``
    gives a tensor with dims. Under vmap a tensor whose dims are all first-class is one
    0-d value per example: beside a plain tensor of its kind it promotes as a number
    does (a float64 one times a float32 tensor is float32), where aligned it is a tensor
    of its dims (float64): each of the two libraries does one for some ops."""
    operands = [x for x in flat if isinstance(x, (torch.Tensor, _Tensor))]
    if len(operands) != 2 or not any(isinstance(x, _Tensor) for x in operands) or any(
            x.dtype == torch.bool for x in operands):  # (a mask: masked_fill, where)
        return flat
    want = torch.result_type(*(torch.empty(shape_of(x) if isinstance(x, _Tensor) else x.shape,
                                           dtype=x.dtype, device="meta") for x in operands))
    return [x.to(want) if isinstance(x, (torch.Tensor, _Tensor)) and x.dtype != want else x
            for x in flat]


@functools.cache
def _keeps_order() -> dict:
    """functorch.dim's Tensor methods that take a dim and keep the dims' order (and
    torch.softmax), each with the position of its dim argument."""
    table = {getattr(torch.Tensor, n): _DIM_AFTER.get(n, 1) for n in _KEEPS_ORDER}
    table[torch.softmax] = 1
    return table


def _dim_given(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call names its dims as ints (dims themselves take ``_reduce``'s path)."""
    if not args or not isinstance(args[0], Tensor):
        return False
    at = _keeps_order()[func]
    d = kwargs.get("dim", args[at] if len(args) > at else None)
    return isinstance(d, int) or (
        isinstance(d, (tuple, list)) and len(d) > 0 and all(isinstance(e, int) for e in d))


@functools.cache
def _order_rules() -> tuple[frozenset, frozenset, dict]:
    """(ops pointwise here that functorch.dim vmaps, ops vmapped here that it aligns,
    ops whose batch dims its batching rule leaves in place -> the position of the input
    it leaves them in)."""
    def funcs(names):
        found = {getattr(owner, n, None) for n in names
                 for owner in (torch.Tensor, torch, torch.nn.functional)}
        return frozenset(f for f in found if f is not None)

    in_place = {f: at for n, at in _IN_PLACE.items() for f in funcs([n])}
    return funcs(_VMAPPED) | {torch.Tensor.where}, funcs(_ALIGNED), in_place


def _in_place_order(func, args: tuple, kwargs: dict) -> tuple:
    """functorch.dim's order of the dims of ``func``'s result, ``func`` in ``_IN_PLACE``:
    its vmap levels nest in creation order, and at the innermost ones, where only the
    input ``x`` is batched, the rule leaves the batch dims in place. So the dims of ``x``
    made after every dim of the other arguments keep their order in ``x``, after the rest,
    which come in creation order (all of them do for searchsorted with a sorted sequence
    of more than one dim: its rule puts each batch dim before the last dim)."""
    at = _order_rules()[2][func]
    x = args[at] if len(args) > at else None
    inner: tuple = ()
    if isinstance(x, Tensor) and not (func is torch.searchsorted and args[0].ndim > 1):
        others = [a for k, a in enumerate(args) if k != at]
        last = max((d._serial for d in union(tree_flatten((others, kwargs))[0])[0]),
                   default=-1)
        inner = tuple(d for d in x._dims if d._serial > last)
    everything = union(tree_flatten((args, kwargs))[0])[0]
    return (*sorted((d for d in everything if find(inner, d) < 0), key=_created), *inner)


def reorder(o: Any, dims: tuple) -> Any:
    """``o`` (any value) with its dims in their order in ``dims`` (a view; dims of ``o``
    not in ``dims`` follow, in their order)."""
    if not isinstance(o, Tensor) or len(o._dims) < 2:
        return o
    want = [d for d in dims if find(o._dims, d) >= 0]
    want += [d for d in o._dims if find(dims, d) < 0]
    if same(tuple(want), o._dims):
        return o
    perm = [find(o._dims, d) for d in want]
    t = o._tensor
    return Tensor(t.permute(*perm, *range(len(perm), t.ndim)), tuple(want))


@functools.cache
def _special() -> dict:
    from torchlevels.dim import _functions, _getitem, _reduce

    return {
        torch.Tensor.__getitem__: _getitem.getitem,
        torch.Tensor.__setitem__: _getitem.setitem,
        torch.Tensor.__mul__: _reduce.multiply,
        torch.Tensor.mul: _reduce.mul,
        torch.mul: _reduce.mul,
        torch.stack: _functions.stack_positional,
        torch.Tensor.split: _functions.split,
        torch.split: _functions.split,
        # what Tensor.split calls for a plain tensor: here when a section or dim is a Dim
        torch._VF.split: _functions.split,
        torch._VF.split_with_sizes: _functions.split,
        # functorch.dim raises RuntimeError for these too
        torch.Tensor.item: _no_python_value("item()"),
        torch.Tensor.tolist: _no_python_value("tolist()"),
        torch.Tensor.numpy: _no_python_value("numpy()"),
    }


def _no_python_value(what: str):
    def refuse(x: _Tensor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(python_value(x, what))
    return refuse


def python_value(x: _Tensor, what: str) -> str:
    """Why ``x.item()`` (``what``) has no value: ``x`` is one tensor per element of its dims."""
    dims = ", ".join(map(repr, x._dims))
    return (f"{what} of a tensor that still has first-class dims ({dims}): it holds one "
            f"value per element of them. Call .order({dims}) first for a plain tensor, or "
            "reduce over them (.sum(dim), ...)")


def out_of_range(x: _Tensor, what: str) -> str:
    """Why a positional dim number given to ``what`` is out of range for ``x``."""
    n = x.ndim
    dims = ", ".join(map(repr, x._dims))
    numbers = f", so a dim number is in [{-n}, {n - 1}]" if n else ", like a 0-dim tensor"
    return (f"{what}: dimension out of range: the tensor has {n} positional dims (shape "
            f"{tuple(x.shape)}){numbers}; its first-class dims ({dims}) are not numbered: "
            "pass a first-class dim itself, or .order() it to make it positional")


def _raise_explained(func, args: tuple, kwargs: dict, error: Exception) -> NoReturn:
    """Raise ``error`` from ``func``, told in terms of what the user sees where it can be,
    or as it is."""
    explained = _explained(func, tree_flatten((args, kwargs))[0], error)
    if explained is None:
        raise error
    raise explained from error


def _explained(func, flat: list, error: Exception) -> Exception | None:
    """``error`` from ``func`` on the inputs ``flat``, told in terms of what the user sees:
    dim numbers count positional dims only, and the shapes the op ran on held the
    first-class dims too. None to raise ``error`` as it is."""
    name = getattr(func, "__name__", str(func))
    message = str(error)
    if type(error) is IndexError and message.startswith(("Dimension out of range",
                                                         "Dimension specified as")):
        first = next((x for x in flat if isinstance(x, _Tensor)), None)
        return IndexError(out_of_range(first, name)) if first is not None else None
    if type(error) is not RuntimeError:
        return None
    seen = [f"{tuple(x.shape)}" + (" over " + ", ".join(f"{d!r} (size {d.size})"
                                                          for d in x._dims)
                                   if isinstance(x, _Tensor) else "")
            for x in flat if isinstance(x, (torch.Tensor, _Tensor))]
    return RuntimeError(
        f"{message}\n(in {name} on tensors with first-class dims: the inputs' positional "
        f"shapes are {' and '.join(seen)}; {name} ran batched over the first-class dims, "
        "so the sizes above may include them)"
    )


_DUNDER_OPS = {
    "add": "add", "radd": "add", "iadd": "add_", "sub": "sub", "rsub": "rsub",
    "isub": "sub_", "mul": "mul", "rmul": "mul", "imul": "mul_", "truediv": "div",
    "rtruediv": "div", "itruediv": "div_", "floordiv": "floor_divide",
    "rfloordiv": "floor_divide", "ifloordiv": "floor_divide_", "mod": "remainder",
    "rmod": "remainder", "imod": "remainder_", "pow": "pow", "rpow": "pow", "ipow": "pow_",
    "and": "bitwise_and", "rand": "bitwise_and", "iand": "bitwise_and_", "or": "bitwise_or",
    "ror": "bitwise_or", "ior": "bitwise_or_", "xor": "bitwise_xor", "rxor": "bitwise_xor",
    "ixor": "bitwise_xor_", "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift",
    "rlshift": "bitwise_left_shift", "rrshift": "bitwise_right_shift", "eq": "eq",
    "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "neg": "neg", "pos": "positive",
    "abs": "abs", "invert": "bitwise_not",
}


@functools.cache
def _aten_name(func) -> str | None:
    name = getattr(func, "__name__", None)
    if name is None:
        return None
    if name.startswith("__") and name.endswith("__"):
        return _DUNDER_OPS.get(name[2:-2])
    return name


def _tensor_other(args: tuple, kwargs: dict) -> bool:
    """``max(x, other)``, not ``max(x, dim)`` nor ``max(x)``."""
    other = args[1] if len(args) > 1 else kwargs.get("other")
    return isinstance(other, (torch.Tensor, _Tensor))


# Ops with some overloads tagged pointwise and others not: pointwise for the calls that
# pass this test, batched otherwise (max(x) and max(x, 1) reduce; where(cond) is nonzero).
_POINTWISE_CALLS = {
    "max": _tensor_other,
    "min": _tensor_other,
    "where": lambda args, kwargs: len(args) + len(kwargs) == 3,
    # a tensor fill value stays 0-d under vmap (pointwise would align it to the dims)
    "masked_fill": lambda args, kwargs: not isinstance(
        args[2] if len(args) > 2 else kwargs.get("value"), (torch.Tensor, _Tensor)),
}


@functools.cache
def is_pointwise(func) -> bool:
    """Whether every call of ``func`` is an aten op PyTorch tags pointwise (add, relu, ...);
    see ``_POINTWISE_CALLS`` for the ops that are pointwise for some calls only."""
    name = _aten_name(func)
    name = name.rstrip("_") if name else None
    packet = getattr(torch.ops.aten, name, None) if name else None
    if packet is None or name in _POINTWISE_CALLS:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def _pointwise_call(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call of an op in ``_POINTWISE_CALLS`` is elementwise."""
    test = _POINTWISE_CALLS.get((_aten_name(func) or "").rstrip("_"))
    return test is not None and test(args, kwargs)


def _is_inplace(func) -> bool:
    name = _aten_name(func)
    return name is not None and name.endswith("_")


def pointwise(func, args: tuple, kwargs: dict, vmapped_there: bool = False) -> Any:
    """A pointwise op, called once on inputs aligned to the union of their dims;
    ``vmapped_there``: one functorch.dim runs under vmap (see _VMAPPED)."""
    flat, spec = tree_flatten((args, kwargs))
    dims, ndim, device = union(flat)
    if _is_inplace(func) and isinstance(args[0], _Tensor):
        return _pointwise_inplace(func, flat, spec, dims, ndim, device)
    if vmapped_there or func in _order_rules()[0]:
        dims = tuple(sorted(dims, key=_created))  # functorch.dim's order (see _VMAPPED)
        flat = _promoted(flat, lambda x: x.shape)  # and its dtype: one example's promotion
    # a plain 0-d tensor is viewed as shape (1,): it promotes like the dims tensors it
    # meets, which are one value per element of their dims (as in vmap and functorch.dim)
    flat = [align(x, dims, ndim, device) if isinstance(x, _Tensor)
            else x.view(1) if isinstance(x, torch.Tensor) and x.ndim == 0 else x
            for x in flat]
    a, k = tree_unflatten(flat, spec)
    try:
        out = func(*a, **k)
    except (RuntimeError, IndexError) as e:
        _raise_explained(func, args, kwargs, e)
    return tree_map(lambda o: wrap(o, dims) if isinstance(o, torch.Tensor) else o, out)


def _pointwise_inplace(func, flat, spec, dims, ndim, device):
    target = flat[0]
    if type(target) is Dim and getattr(func, "__name__", "").startswith("__i"):
        return NotImplemented  # so ``i += 1`` rebinds i to ``i + 1``, as for an int
    _refuse_dim_write(func, target)
    missing = [d for d in dims if find(target._dims, d) < 0]
    if missing:
        raise ValueError(
            f"{_aten_name(func)}: an in-place op on a tensor with dims {target._dims} cannot "
            f"take values batched over {tuple(missing)}; use the out-of-place op"
        )
    own = target._dims
    flat = [target._tensor] + [
        align(x, own, target.ndim, device) if isinstance(x, _Tensor) else x for x in flat[1:]
    ]
    a, k = tree_unflatten(flat, spec)
    func(*a, **k)
    return target


def _refuse_dim_write(func, target: Any) -> None:
    """An in-place op may not write a dim: its values are its indices."""
    if type(target) is Dim:
        raise TypeError(f"{_aten_name(func)}: dim {target} cannot be modified in place")


def batched(func, args: tuple, kwargs: dict) -> Any:
    """Any op: one vmap level per dim of the inputs, so this project's batching rules
    batch it, then the outputs' batch dims become first-class dims again."""
    flat, spec = tree_flatten((args, kwargs))
    dims, _, device = union(flat)
    # one level per dim, nested in the dims' creation order, as functorch.dim nests them:
    # the result's dims come in the order its batch dims are left in
    dims = tuple(sorted(dims, key=_created))
    first = flat[0] if flat else None
    if _is_inplace(func):
        _refuse_dim_write(func, first)
    with contextlib.ExitStack() as stack:
        levels = [stack.enter_context(batch_level("different", d.size)) for d in dims]
        for k, x in enumerate(flat):
            if isinstance(x, _Tensor):
                flat[k] = _enter(x, dims, levels, device)
        a, kw = tree_unflatten(flat, spec)
        try:
            out = func(*a, **kw)
        except (RuntimeError, IndexError) as e:
            _dim_where_int_expected(func, args, kwargs, e)
            _raise_explained(func, args, kwargs, e)
        result = tree_map(lambda o: _leave(o, dims, levels), out)
    if isinstance(first, Tensor) and out is flat[0] and isinstance(result, Tensor):
        # an in-place op returns its input: the tensor itself changes (unsqueeze_ its shape)
        result = reorder(result, first._dims)
        if isinstance(first, Delayed):
            first._value = result._tensor
        else:
            first._tensor = result._tensor
        first._dims = result._dims
        return first
    return result


def _dim_where_int_expected(func, args: tuple, kwargs: dict, error: RuntimeError) -> None:
    """Name the real problem when ``func`` read a dim passed as an argument as a Python
    int (``x.narrow(j, 0, 2)``): a first-class dim is not supported for that argument."""
    passed = [x for x in tree_flatten((args[1:], kwargs))[0] if type(x) is Dim]
    if passed and "reads a Python value" in str(error):
        name = getattr(func, "__name__", str(func))
        raise TypeError(
            f"{name}: a first-class dim ({', '.join(map(repr, passed))}) was passed where "
            f"{name} takes an int (a dim, size or index); a first-class dim is not supported "
            f"for that argument of {name}. Make it positional first, e.g. "
            f"x.order({passed[0]!r}) moves it to dim 0, and pass 0"
        ) from error


def _created(d: Dim) -> int:
    return d._serial


def _enter(x: _Tensor, dims: tuple, levels: list, device) -> torch.Tensor:
    """``x``'s tensor batched at each of its dims' levels (innermost first), each batch
    dim where it lies among the axes not yet batched, as functorch.dim batches a tensor."""
    t = storage(x, device)
    axes = list(x._dims)
    for d, level in zip(dims, levels):
        k = find(tuple(axes), d)
        if k >= 0:
            t = wrap_batched(level, t, k)
            del axes[k]
    return t


def _leave(o: Any, dims: tuple, levels: list) -> Any:
    """A result of a batched op with its batch dims as first-class dims, in the order they
    lie in the result (functorch.dim's order: a batching rule that keeps a batch dim in
    place keeps the dims' order, one that moves it to the front gives creation order)."""
    if not isinstance(o, torch.Tensor):
        return o
    labels: list = [None] * o.ndim
    for d, level in zip(reversed(dims), reversed(levels)):
        if type(o) is level:
            labels.insert(o._bdim, d)
            o = o._inner
    dim_axes = [k for k, d in enumerate(labels) if d is not None]
    if dim_axes != list(range(len(dim_axes))):
        o = o.permute(*dim_axes, *[k for k, d in enumerate(labels) if d is None])
    return wrap(o, tuple(labels[k] for k in dim_axes))


# -- methods of dims tensors ------------------------------------------------------------
def _axes(x: _Tensor, spec: Any) -> list[int]:
    """Storage axes of ``x`` that ``spec`` (a dim, a dim list or a positional int) names."""
    if isinstance(spec, DimList):
        return [a for d in spec for a in _axes(x, d)]
    if isinstance(spec, Dim):
        k = find(x._dims, spec)
        if k < 0:
            raise ValueError(f"tensor has no dim {spec}: its dims are {x._dims}")
        return [k]
    if isinstance(spec, int):
        if not -x.ndim <= spec < x.ndim:
            raise IndexError(out_of_range(x, f"dim {spec}"))
        return [len(x._dims) + spec % x.ndim]
    raise TypeError(f"expected a Dim, a DimList or an int, got {type(spec).__name__}")


def order(x: _Tensor, specs: tuple) -> Any:
    t, own = storage(x, None), x._dims
    groups = []
    for s in specs:
        if isinstance(s, (tuple, list)):
            groups.append([a for e in s for a in _axes(x, e)])
        else:
            groups.extend([a] for a in _axes(x, s))
    used = [a for g in groups for a in g]
    if len(set(used)) != len(used):
        raise ValueError(f"order{specs}: a dim is named twice")
    rest = [k for k in range(len(own)) if k not in used]
    positional = [k for k in range(len(own), t.ndim) if k not in used]
    t = t.permute(*rest, *used, *positional)
    if any(len(g) != 1 for g in groups):
        sizes = [t.shape[k] for k in range(len(rest))]
        at = len(rest)
        for g in groups:
            sizes.append(t.shape[at:at + len(g)].numel())
            at += len(g)
        t = t.reshape(*sizes, *t.shape[at:])
    return wrap(t, tuple(own[k] for k in rest))


def index(x: _Tensor, dims: Any, indices: Any) -> Any:
    from torchlevels.dim._getitem import functorch_order, getitem

    if isinstance(dims, (Dim, DimList, int)):
        dims, indices = (dims,), (indices,)
    elif not isinstance(indices, (tuple, list)):
        dims, indices = (tuple(dims),), (indices,)  # one index for the dims flattened
    dims, indices = tuple(dims), tuple(indices)
    if len(dims) != len(indices):
        raise ValueError(f"index: {len(dims)} dims but {len(indices)} indices")
    out = getitem(order(x, dims), indices)
    # functorch.dim's order: each index in place of its dim (a flattened group's: in place
    # of its first dim), then x[...] with them (see functorch_order)
    at: dict = {}
    for d, i in zip(dims, indices):
        group = [e for s in (d if isinstance(d, (tuple, list)) else (d,))
                 for e in (s if isinstance(s, DimList) else (s,))]
        for k, e in enumerate(group):
            at[id(e) if isinstance(e, Dim) else e % x.ndim] = i if k == 0 else _GONE
    entries = [at.get(id(d), d) for d in x._dims]
    entries += [at.get(p, slice(None)) for p in range(x.ndim)]
    return reorder(out, functorch_order([e for e in entries if e is not _GONE]))


_GONE = object()  # a dim flattened into the one before it


def expand(x: _Tensor, sizes: tuple) -> Any:
    if not sizes or not all(isinstance(s, Dim) for s in sizes):
        return torch_function(torch.Tensor.expand, (x, *sizes), {})
    new = tuple(d for d in sizes if find(x._dims, d) < 0)
    t = storage(x, None)
    t = t[(None,) * len(new)].expand(*(d.size for d in new), *t.shape)
    return Tensor(t, new + x._dims)


def describe(x: _Tensor) -> str:
    sizes = tuple(d.size for d in x._dims)
    dims = "(" + ", ".join(map(repr, x._dims)) + ("," if len(x._dims) == 1 else "") + ")"
    return f"{storage(x, None)!r}\nwith dims={dims} sizes={sizes}"
