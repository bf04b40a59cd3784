"""Ops with a number coefficient, run as plain products while make_fx traces forward AD.

PyTorch's forward-AD formulas of ops that scale an operand by a number argument
(``torch.add(x, y, alpha=0.5)``, ``addcdiv(s, a, b, value=0.5)``, ``addmm``'s ``beta`` and
``alpha``) crash the interpreter (a segmentation fault) when they run under make_fx's
proxy mode: plain ``torch.autograd.forward_ad`` under ``make_fx`` does, and so does
``torch.func.linearize``. ``linearize`` traces its jvp that way (as does
``torchlevels.compile`` of a function that calls ``jvp``), so while such a trace runs, a
jvp level runs these ops as the same arithmetic without the coefficient argument
(``x + y * 0.5``), whose formulas do not crash. Eager calls are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_PRODUCTS = {"addmm": torch.mm, "addmv": torch.mv, "addr": torch.outer,
             "baddbmm": torch.bmm, "addbmm": lambda a, b: torch.bmm(a, b).sum(0)}
SCALED = frozenset(
    getattr(getattr(aten, name + suffix), overload)
    for name, overload in (("add", "Tensor"), ("sub", "Tensor"), ("addcmul", "default"),
                           ("addcdiv", "default"), *((p, "default") for p in _PRODUCTS))
    for suffix in ("", "_"))


def unscaled(func, args: tuple, kwargs: dict) -> Any:
    """``func`` (one of :data:`SCALED`) run as its arithmetic without the coefficient, if
    make_fx is tracing and a coefficient is not 1; NotImplemented otherwise."""
    coefficients = {k: kwargs[k] for k in ("alpha", "beta", "value") if k in kwargs}
    if (all(c == 1 for c in coefficients.values())
            or torch._C._get_dispatch_mode(_PROXY) is None or len(coefficients) != len(kwargs)):
        return NotImplemented
    name = func._schema.name.split("::")[1]
    base = name.rstrip("_")
    self, *operands = args
    if base in ("add", "sub"):
        term = operands[0] * coefficients.get("alpha", 1)
        out = self + term if base == "add" else self - term
    elif base in ("addcmul", "addcdiv"):
        a, b = operands
        out = self + (a * b if base == "addcmul" else a / b) * coefficients.get("value", 1)
    else:
        out = _PRODUCTS[base](*operands) * coefficients.get("alpha", 1)
        beta = coefficients.get("beta", 1)
        if beta != 0:  # (beta 0 ignores self, NaNs included, as PyTorch does)
            out = self * beta + out
    return self.copy_(out) if name != base else out
