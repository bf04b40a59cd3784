"""How torchlevels meets ``torch.compile``: its transforms run eagerly inside it.

Dynamo cannot trace a level: every transform call makes a new Tensor subclass whose
``__torch_dispatch__`` is Python, and dynamo traces only subclasses that declare how to
flatten themselves. Left alone, it would try anyway: compile pieces of the package's
code between graph breaks, recompile the user's function for every call's new level
class, and run its own work (inductor tracing its patterns) while a level is live.
So:

- dynamo skips the package's files (all but the relational queries', whose fused column
  kernels it compiles): a call into torchlevels is a graph break, and dynamo never
  compiles a level's dispatch code;
- a transform call (``vmap(f)(x)``, ``grad(f)(x)``, ``jvp(f, ...)``...) runs with dynamo
  off, the user's function inside included: under ``torch.compile`` it runs eagerly,
  with the results of eager mode;
- a compiled function called inside a transform runs as the plain function, eagerly
  (torch.compile's stance "force_eager"): dynamo would trace the level's tensors, which
  it cannot, and with ``fullgraph=True`` raise;
- ops that torch.compile runs for itself while a level is live pass the levels by (see
  batching/random.py).

``torchlevels.compile`` compiles a composition: it traces the plain ops under the levels.
``torch.export`` gets a clear error for the same reason, pointing to ``torchlevels.trace``,
whose graph of plain aten ops it exports.

Importing dynamo takes longer than importing torchlevels, and nothing compiles before
it is imported, so the two rules above are set up when dynamo is imported, by whoever.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import pkgutil
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_Fn = TypeVar("_Fn", bound=Callable)
_DYNAMO = "torch._dynamo"
_run_without_dynamo: Callable | None = None  # set once dynamo is imported
_eval_frame: Any = None  # torch._dynamo.eval_frame, once imported
_FORCE_EAGER: Any = None  # its stance that runs compiled functions as plain ones
_TRACEABLE = {"relational"}  # its fused column kernels are torch.compile'd


class _CompiledCodeRunsEagerly:
    """torch.compile's stance "force_eager" while any holder is inside ``with``. The
    stance is process-wide, so it is held by a count of live holders, under a lock (as in
    ``_process_state``): the first sets it, the last restores the stance before. Compiled
    functions of other threads run eagerly meanwhile too, with the same results. (Dynamo's
    own ``set_stance`` does the same assignment, after checks that cost ~3 us a call.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._before: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if not self._holders:
                self._before = _eval_frame._stance
                _eval_frame._stance = _FORCE_EAGER
            self._holders += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._holders -= 1
            if not self._holders:
                _eval_frame._stance = self._before


_compiled_code_runs_eagerly = _CompiledCodeRunsEagerly()


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    with _compiled_code_runs_eagerly:  # (set_stance refuses in a compiled region: not here)
        return fn(*args, **kwargs)


def _on_dynamo_import() -> None:
    """Skip the package's files, and make a runner for transform calls with dynamo off."""
    global _run_without_dynamo, _eval_frame, _FORCE_EAGER
    import torch._dynamo.eval_frame
    import torch._dynamo.trace_rules

    _eval_frame = torch._dynamo.eval_frame
    _FORCE_EAGER = _eval_frame.DynamoStance("force_eager")

    for module in pkgutil.iter_modules(sys.modules[__package__].__path__):
        if module.name not in _TRACEABLE:
            torch._dynamo.trace_rules.add(f"{__package__}.{module.name}")
    _run_without_dynamo = torch.compiler.disable(_call, recursive=True)


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_on_dynamo_import` right after ``torch._dynamo`` is first imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _on_dynamo_import()

        spec.loader.exec_module = exec_then_register
        return spec


if _DYNAMO in sys.modules:
    _on_dynamo_import()
else:
    sys.meta_path.insert(0, _AfterDynamoImport())


def eager(fn: _Fn, transform: str | None = None) -> _Fn:
    """``fn``, the call of ``transform`` (default: ``fn``'s name), run with dynamo off
    once dynamo is imported. ``torch.export`` cannot trace it: that raises.

    Example::

        >>> import torch
        >>> from torchlevels import vmap
        >>> f = torch.compile(vmap(torch.sin))  # vmap's call runs eagerly inside
        >>> x = torch.randn(3, 2)
        >>> torch.equal(f(x), torch.sin(x))
        True
    """
    name = transform or fn.__name__

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _run_without_dynamo is None:
            return fn(*args, **kwargs)
        if torch.compiler.is_exporting():
            raise RuntimeError(
                f"torch.export cannot trace torchlevels' {name}: a transform's levels are "
                "Tensor subclasses made per call, which export's tracer does not take. "
                "Trace the function with torchlevels.trace(f)(*args) instead: it returns "
                "a torch.fx.GraphModule of plain aten ops, which torch.export.export "
                "takes."
            )
        return _run_without_dynamo(fn, args, kwargs)

    return run  # type: ignore[return-value]


def compiling() -> bool:
    """Whether torch.compile is at work (tracing a function, or compiling a graph)."""
    return torch.compiler.is_compiling()


def tracing_user_code() -> bool:
    """Whether dynamo is tracing a user's function now (not running a compiler pass)."""
    return compiling() and torch._guards.TracingContext.try_get() is not None
