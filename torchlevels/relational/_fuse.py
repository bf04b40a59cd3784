"""Column expressions, run as one kernel.

An elementwise op on columns records an :class:`Expr` instead of running, and the values
are made when needed, op by op. A reduction of an expression over at least
``FUSE_MIN_ROWS`` rows, under a filter's mask and per group, runs as one
``torch.compile``d kernel: ``sum(price * (1 - discount))`` over the rows a filter of five
comparisons keeps reads each input column once and writes nothing but the sums. Smaller
reductions run op by op, and so does everything when torch.compile is unavailable.

Example::

    >>> import torch
    >>> from torchlevels.relational._fuse import Expr, evaluate, reduce
    >>> x = torch.tensor([1.0, 2.0, 3.0])
    >>> e = Expr("mul", (Expr("add", (x, 1.0)), x))
    >>> evaluate(e).tolist(), reduce(e, Expr("gt", (x, 1.5)), None, 0, "sum").item()
    ([2.0, 6.0, 12.0], 18.0)
"""

from __future__ import annotations

import functools
import operator
import warnings

import torch

from torchlevels.relational._floats import COMPARISONS, from_order_key, order_key
from torchlevels.relational._ints import CHECKED, summed_halves

FUSE_MIN_ROWS = 1 << 20  # the fewest rows worth a compiled kernel
SMALL_GROUPS = 16  # per-group reductions over at most this many groups fuse (one pass)


def _true_divide(a, b):
    # SQL divides ints in DOUBLE; torch would in float32, its default float
    if isinstance(a, torch.Tensor) and not a.is_floating_point():
        a = a.double()
    elif isinstance(b, torch.Tensor) and not b.is_floating_point() and not isinstance(
            a, torch.Tensor):
        b = b.double()
    return torch.true_divide(a, b)


def _power(a, b):
    # SQL's ** (POW) computes in DOUBLE, whatever its operands. A number exponent goes in
    # as a tensor: torch.pow takes 0.5 and -0.5 for sqrt and rsqrt, which give NaN for
    # -inf, where C's pow (DuckDB's) gives inf and 0
    a, b = (x.double() if isinstance(x, torch.Tensor) else float(x) for x in (a, b))
    if isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=torch.float64, device=a.device)
    return torch.pow(a, b)


OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": _true_divide,
    "pow": _power, "neg": operator.neg, "abs": torch.abs,
    "invert": operator.invert, "and": operator.and_, "or": operator.or_,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
    "ne": torch.ne, **COMPARISONS,  # the latter for NaN, which SQL orders above all
    **CHECKED,  # int arithmetic that raises on overflow, as SQL's does
    "lookup": lambda codes, table: table[codes],
    "select": torch.where,  # select(mask, a, b): a where mask, else b
    "radix": lambda code, base, digit: code * base + digit,
}


class Expr:
    """``OPS[op](*args)``, not run yet; args are tensors (all with the same rows),
    expressions or Python scalars."""

    __slots__ = ("op", "args", "rows", "device")

    def __init__(self, op: str, args: tuple) -> None:
        self.op, self.args = op, args
        first = next(a for a in args
                     if isinstance(a, Expr) or (isinstance(a, torch.Tensor) and a.ndim == 1))
        self.rows = first.rows if isinstance(first, Expr) else first.shape[0]
        self.device = first.device

    def __repr__(self) -> str:
        return f"Expr({self.op}, {self.args!r})"


def _flatten(node, tensors: list, seen: dict[int, int], leaf: str = "leaf"):
    """A hashable description of ``node`` whose leaves index ``tensors``: ``leaf`` for a
    tensor with a value per row, ``table`` for a lookup table."""
    if isinstance(node, Expr):
        kinds = ("leaf", "table") if node.op == "lookup" else ("leaf",) * len(node.args)
        return (node.op, *(_flatten(a, tensors, seen, k) for a, k in zip(node.args, kinds)))
    if isinstance(node, torch.Tensor):
        k = seen.setdefault(id(node), len(tensors))
        if k == len(tensors):
            tensors.append(node)
        return (leaf if node.ndim == 1 else "table", k)
    return ("const", node)


def _lift(plan, tensors: list):
    """``plan`` with its number constants moved into ``tensors`` as 0-d inputs, so one
    compiled kernel serves every value of a query's parameters (a date, a threshold).
    They are made on the device of the tensors the plan reads."""
    op = plan[0]
    if op == "const":
        value = plan[1]
        if isinstance(value, bool | int | float):
            dtype = _SCALAR_DTYPES[type(value)]
            tensors.append(torch.tensor(value, dtype=dtype, device=tensors[0].device))
            return ("scalar", len(tensors) - 1)
        return plan
    if op in ("leaf", "table"):
        return plan
    return (op, *(_lift(p, tensors) for p in plan[1:]))


_SCALAR_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


def _run(plan, tensors):
    op = plan[0]
    if op in ("leaf", "table", "scalar"):
        return tensors[plan[1]]
    if op == "const":
        return plan[1]
    return OPS[op](*(_run(p, tensors) for p in plan[1:]))


def _identity(values: torch.Tensor, how: str):
    if how == "sum":
        return 0
    if values.is_floating_point():
        return float("inf") if how == "min" else float("-inf")
    info = torch.iinfo(values.dtype) if values.dtype != torch.bool else None
    if info is None:
        return how == "min"
    return info.max if how == "min" else info.min


def _reduce_one(values: torch.Tensor, keep, how: str):
    if how == "count":  # of the true values of a boolean expression
        return torch.count_nonzero(values if keep is None else values & keep)
    if how == "rows":
        if keep is not None:
            return torch.count_nonzero(keep)
        return torch.tensor(values.shape[0], device=values.device)
    if how == "sum" and values.dtype == torch.bool:  # the number of true values
        return _reduce_one(values, keep, "count")
    if how == "min" and values.is_floating_point():  # SQL's: NaN only if every value is
        return from_order_key(_reduce_one(order_key(values), keep, how), values.dtype)
    if keep is not None:
        values = torch.where(keep, values, _identity(values, how))
    if how == "sum" and not values.is_floating_point():
        return summed_halves(values)  # exact, or an overflow error: see _ints.whole
    if how == "sum":
        return values.sum(dtype=torch.float64)
    return values.amin() if how == "min" else values.amax()


def _reduction_kernel(plan_value, plan_mask, plan_gid, how: str, groups: int, tensors):
    values = _run(plan_value, tensors)
    keep = None if plan_mask is None else _run(plan_mask, tensors)
    if plan_gid is None and groups == -1:  # the total and the number of rows it covers
        return _reduce_one(values, keep, how), _reduce_one(values, keep, "rows")
    if plan_gid is None:
        return _reduce_one(values, keep, how)
    gid = _run(plan_gid, tensors)
    outs = []
    for g in range(groups):
        in_group = gid == g
        outs.append(_reduce_one(values, in_group if keep is None else in_group & keep, how))
    return torch.stack(outs)


_compile_failed: list[str] = []


@functools.lru_cache(maxsize=256)
def _compiled(kernel, *static):
    # a function of its own per plan (torch.compile keeps a few compiled variants per
    # function, and each query would otherwise take one of them)
    scope = {"kernel": kernel, "static": static}
    exec("def fused(tensors):\n    return kernel(*static, tensors)\n", scope)
    # the first call compiles for its sizes; other sizes get one size-generic kernel
    return torch.compile(scope["fused"])


def _call(kernel, static: tuple, tensors: list, rows: int):
    """``kernel(*static, tensors)``: compiled when the rows are many and compiling works,
    and no op checks for int overflow (a data-dependent raise would split the kernel)."""
    if rows >= FUSE_MIN_ROWS and not _compile_failed and not any(
            _checks_overflow(s) for s in static if isinstance(s, tuple)):
        tensors = list(tensors)
        static = tuple(_lift(s, tensors) if isinstance(s, tuple) else s for s in static)
        try:
            return _compiled(kernel, *static)(tensors)
        except Exception as e:  # no compiler here: run op by op from now on
            _compile_failed.append(repr(e))
            warnings.warn(f"torchlevels.relational: torch.compile failed ({e!r}); columns "
                          "run op by op", stacklevel=3)
    return kernel(*static, tensors)


def evaluate(node) -> torch.Tensor:
    """The values of an expression (a tensor passes through), op by op: compiled kernels
    that write whole columns (a bool mask most of all) were no faster here."""
    if not isinstance(node, Expr):
        return node
    tensors: list = []
    return _run(_flatten(node, tensors, {}), tensors)


def evaluate_at(node, rows: torch.Tensor) -> torch.Tensor:
    """The values of an expression at ``rows`` only: its columns are gathered first."""
    if not isinstance(node, Expr):
        return node[rows]
    tensors: list = []
    plan = _flatten(node, tensors, {})
    leaves = {p[1] for p in _leaves(plan) if p[0] == "leaf"}
    return _run(plan, [t[rows] if k in leaves else t for k, t in enumerate(tensors)])


def _checks_overflow(plan) -> bool:
    return plan[0] in CHECKED or (plan[0] not in ("leaf", "table", "const") and any(
        _checks_overflow(p) for p in plan[1:]))


def _leaves(plan):
    if plan[0] in ("leaf", "table"):
        yield plan
    elif plan[0] != "const":
        for p in plan[1:]:
            yield from _leaves(p)


def reduce_counted(values, mask, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``reduce(values, mask, None, 0, how)`` and the number of rows it covered, from
    one kernel."""
    return reduce(values, mask, None, -1, how)


def reduce(values, mask, gid, groups: int, how: str) -> torch.Tensor:
    """``how`` (sum, min, max, count: of true values, or rows) of ``values`` over the rows
    where ``mask`` holds (None: all), per group ``gid`` in ``0 .. groups - 1`` (None: one
    total). Sums of floats are float64, of bools int64, and of ints the sums of their
    ``_ints.halves`` (a last dim of 2) for ``_ints.whole`` to check and join."""
    tensors: list = []
    seen: dict[int, int] = {}
    plans = (_flatten(values, tensors, seen),
             None if mask is None else _flatten(mask, tensors, seen),
             None if gid is None else _flatten(gid, tensors, seen))
    rows = values.rows if isinstance(values, Expr) else values.shape[0]
    return _call(_reduction_kernel, (*plans, how, groups), tensors, rows)
