"""Check autodiff transforms against torch.autograd on PyTorch's OpInfo samples.

For each OpInfo that supports autograd we take float64 CPU samples made with
``requires_grad=True`` (or complex128 ones: ``dtype``). The differentiated inputs of a
sample are its floating (or complex) tensor leaves of ``(input, *args)`` that require
grad; everything else (integer tensors, keyword arguments) is held fixed. The op's floating
outputs (after the sample's ``output_process_fn_grad``) are what is differentiated. Five
transforms are checked, each against a reference computed with plain ``torch.autograd`` on
the same inputs, so that ``torch.func`` and ``torchlevels`` are measured by the same
yardstick:

- ``grad``: the gradient of a weighted sum of the outputs (fixed random weights, seeded
  per sample) w.r.t. every differentiated input, vs ``torch.autograd.grad``.
- ``jvp``: outputs and tangents along random tangents, vs ``torch.autograd.forward_ad``
  (ops with ``supports_forward_ad``).
- ``jacrev`` / ``jacfwd``: the Jacobian of every output w.r.t. every input, vs
  ``torch.autograd.functional.jacobian(vectorize=False)`` (row by row backward passes;
  jacfwd only for ops with ``supports_forward_ad``). Complex outputs are split into
  real and imaginary parts.
- ``hessian``: of the weighted sum, vs ``torch.autograd.functional.hessian(vectorize=
  False)`` (double backward; ops with ``supports_fwgrad_bwgrad``, since the transform is
  forward-over-reverse).

Jacobians and Hessians only use samples whose differentiated inputs have at most
``MAX_JAC_ELEMENTS`` elements in all (and outputs at most ``MAX_JAC_OUTPUTS``), to bound
the runtime. Random ops are run with the same seed for reference and transform; under
jacfwd and hessian (vmap with ``randomness="error"`` inside) they are skipped.

An implementation is a module-like object with ``grad``, ``jvp``, ``jacrev``, ``jacfwd``
and ``hessian`` of torch.func's signatures: pass ``torch.func`` or ``torchlevels``.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
from opinfo_harness import Outcome, _first_line, _RandomOpSpy, _time_limit, _Timeout, op_id
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from vmap_reference import seeded

TRANSFORMS = ("grad", "jvp", "linearize", "jacrev", "jacfwd", "hessian")
MAX_SAMPLES = 4  # grad, jvp: the first samples
JAC_SCAN = 12  # jacrev, jacfwd, hessian: look this far for small samples ...
JAC_SAMPLES = 2  # ... and keep this many
MAX_JAC_ELEMENTS = 50  # elements of all differentiated inputs together
MAX_JAC_OUTPUTS = 100  # elements of all differentiated outputs together
JAC_FALLBACK_ELEMENTS = 400  # when no sample is that small: the smallest one up to this ...
JAC_FALLBACK_OUTPUTS = 1000  # ... and this
RTOL = 1e-6
ATOL = 1e-6

__all__ = ["MAX_SAMPLES", "Outcome", "TRANSFORMS", "op_id", "run_op", "run_transform"]


# -- samples -------------------------------------------------------------------------


@dataclass
class Case:
    """One sample, ready to differentiate: ``fn(*inputs)`` returns the floating outputs."""

    index: int  # the sample's position in op.sample_inputs
    fn: Callable[..., tuple]
    inputs: list[torch.Tensor]  # the differentiated inputs (detached, no grad)
    weights: list[torch.Tensor]  # one per output, for the weighted-sum scalar
    tangents: list[torch.Tensor]  # one per input, for jvp
    seed: int
    random: bool  # draws random numbers (same seed gives same outputs)


def _fresh(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and (
        t.requires_grad)


def _make_fn(op, sample, leaves: list, spec, diff: list[int], outputs: list[int] | None):
    """``fn(*inputs)``: the op with ``inputs`` at positions ``diff`` of the flat args.

    Non-differentiated args are cloned per call, so ops that mutate them in place do not
    change the next call. ``outputs`` picks the floating outputs (None: all of them).
    """

    def fn(*inputs):
        flat = [_fresh(a) for a in leaves]
        for i, x in zip(diff, inputs):
            flat[i] = x
        args = tree_unflatten(flat, spec)
        kwargs = tree_map(_fresh, sample.kwargs)
        out = tree_flatten(sample.output_process_fn_grad(op(*args, **kwargs)))[0]
        return tuple(out) if outputs is None else tuple(out[i] for i in outputs)

    return fn


def _run_seeded(fn: Callable, seed: int, *args: Any) -> Any:
    torch.manual_seed(seed)
    return fn(*args)


def _same(a: tuple, b: tuple) -> bool:
    try:
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    except (AssertionError, TypeError, ValueError):
        return False
    return True


def cases(op, max_samples: int, scan: int | None = None, small: bool = False,
          dtype: torch.dtype = torch.float64) -> list[Case]:
    """Usable ``dtype`` samples of ``op``: at most ``max_samples`` of the first ``scan``.

    A sample is unusable when it has no differentiated input or no floating output, or
    when the op raises on it. With ``small`` (for Jacobians), samples over
    ``MAX_JAC_ELEMENTS`` input or ``MAX_JAC_OUTPUTS`` output elements are left out; if that
    leaves none, the smallest sample within ``JAC_FALLBACK_ELEMENTS`` and
    ``JAC_FALLBACK_OUTPUTS`` is used alone. Raises ``_Nondeterministic`` when the same
    seed gives different outputs.
    """
    torch.manual_seed(0)
    raw = op.sample_inputs(torch.get_default_device(), dtype, requires_grad=True)
    found: list[Case] = []
    fallback: list[tuple[int, Any]] = []  # (input elements, sample index) of big samples
    samples = list(itertools.islice(raw, scan or max_samples))
    for index, sample in enumerate(samples):
        if len(found) == max_samples:
            break
        case = _case(op, index, sample, small and (MAX_JAC_ELEMENTS, MAX_JAC_OUTPUTS))
        if isinstance(case, Case):
            found.append(case)
        elif case is not None:
            fallback.append((case, index))
    for _, index in sorted(fallback)[:1] if small and not found else ():
        case = _case(op, index, samples[index], (JAC_FALLBACK_ELEMENTS, JAC_FALLBACK_OUTPUTS))
        if isinstance(case, Case):
            found.append(case)
    return found


def _case(op, index: int, sample, limits: tuple[int, int] | bool) -> Case | int | None:
    """The sample as a Case; its input elements if over ``limits``; None if unusable."""
    leaves, spec = tree_flatten((sample.input, *sample.args))
    diff = [i for i, a in enumerate(leaves) if _differentiable(a)]
    if not diff:
        return None
    leaves = [a.detach() if isinstance(a, torch.Tensor) else a for a in leaves]
    inputs = [leaves[i] for i in diff]
    n_in = sum(x.numel() for x in inputs)
    if limits and n_in > limits[0]:
        return n_in
    seed = 1000 + index
    probe = _make_fn(op, sample, leaves, spec, diff, None)
    try:
        with torch.no_grad(), _RandomOpSpy() as spy:
            first = _run_seeded(probe, seed, *[_fresh(x) for x in inputs])
        second = _run_seeded(probe, seed, *[_fresh(x) for x in inputs])
    except Exception:
        return None  # the op itself rejects this sample
    outputs = [i for i, o in enumerate(first)
               if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())]
    if not outputs:
        return None
    if not _same(first, second):
        raise _Nondeterministic
    if limits and sum(first[i].numel() for i in outputs) > limits[1]:
        return n_in
    gen = seeded(seed)
    weights = [torch.randn(first[i].shape, dtype=first[i].dtype, generator=gen)
               for i in outputs]
    tangents = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in inputs]
    fn = _make_fn(op, sample, leaves, spec, diff, outputs)
    return Case(index, fn, inputs, weights, tangents, seed, spy.random)


class _Nondeterministic(Exception):
    pass


# -- the functions each transform differentiates ---------------------------------------


def weighted_sum(outputs: tuple, weights: list[torch.Tensor]) -> torch.Tensor:
    """``sum_i (outputs[i] * weights[i]).sum()``, real part for complex outputs."""
    total = None
    for o, w in zip(outputs, weights):
        term = (o * w).sum()
        if term.is_complex():
            term = term.real
        total = term if total is None else total + term
    return total


def scalar_fn(case: Case) -> Callable[..., torch.Tensor]:
    return lambda *xs: weighted_sum(case.fn(*xs), case.weights)


def real_outputs_fn(case: Case) -> Callable[..., tuple]:
    """``case.fn`` with complex outputs as (..., 2) real tensors (for Jacobians)."""

    def fn(*xs):
        return tuple(torch.stack((o.real, o.imag), -1) if o.is_complex() else o
                     for o in case.fn(*xs))

    return fn


def _inputs(case: Case, requires_grad: bool = False) -> list[torch.Tensor]:
    return [x.clone().requires_grad_(requires_grad) for x in case.inputs]


# -- references (plain torch.autograd) ------------------------------------------------


def reference(transform: str, case: Case) -> list[torch.Tensor]:
    """The flat expected result of ``transform`` on ``case``."""
    torch.manual_seed(case.seed)
    if transform == "grad":
        xs = _inputs(case, requires_grad=True)
        loss = scalar_fn(case)(*xs)
        if not loss.requires_grad:
            return [torch.zeros_like(x) for x in xs]
        return list(torch.autograd.grad(loss, xs, allow_unused=True, materialize_grads=True))
    if transform in ("jvp", "linearize"):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(_inputs(case), case.tangents)]
            pairs = [fwAD.unpack_dual(o) for o in case.fn(*duals)]
            primals = [p.clone() for p, _ in pairs]
            tangents = [torch.zeros_like(p) if t is None else t.clone() for p, t in pairs]
        return primals + tangents
    if transform == "jacrev":
        jac = torch.autograd.functional.jacobian(real_outputs_fn(case), tuple(_inputs(case)))
        return tree_flatten(jac)[0]
    if transform == "jacfwd":
        return _forward_jacobian(real_outputs_fn(case), _inputs(case))
    if transform == "hessian":
        return _forward_over_reverse_hessian(scalar_fn(case), _inputs(case))
    raise ValueError(f"unknown transform {transform!r}")


def _columns(xs: list[torch.Tensor]):
    """``(i, k, tangents)``: one-hot tangents, element ``k`` of input ``i``."""
    for i, x in enumerate(xs):
        for k in range(x.numel()):
            tangents = [torch.zeros(y.shape, dtype=y.dtype) for y in xs]
            tangents[i].view(-1)[k] = 1
            yield i, k, tangents


def _blocks(columns: dict, rows: list[torch.Tensor], xs: list[torch.Tensor]) -> list:
    """Jacobian blocks ``[row tensor][input]`` from columns ``{(r, i): [column per k]}``."""
    out = []
    for r, row in enumerate(rows):
        for i, x in enumerate(xs):
            shape = (*row.shape, *x.shape)
            cols = columns.get((r, i))
            out.append(torch.stack(cols, -1).reshape(shape) if cols
                       else torch.zeros(shape, dtype=row.dtype))
    return out


def _forward_jacobian(fn: Callable, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Jacobian blocks ``[output][input]`` by one forward-AD pass per input element."""
    outs = fn(*xs)
    columns: dict = {}
    for i, _, tangents in _columns(xs):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(xs, tangents)]
            for r, o in enumerate(fn(*duals)):
                primal, tangent = fwAD.unpack_dual(o)
                tangent = torch.zeros_like(primal) if tangent is None else tangent.clone()
                columns.setdefault((r, i), []).append(tangent)
    return _blocks(columns, list(outs), xs)


def _forward_over_reverse_hessian(fn: Callable, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Hessian blocks ``[j][i]`` = d(grad_j)/d(x_i), by forward AD over a backward pass."""
    columns: dict = {}
    for i, _, tangents in _columns(xs):
        leaves = [x.clone().requires_grad_() for x in xs]
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(leaves, tangents)]
            loss = fn(*duals)
            grads = (torch.autograd.grad(loss, duals, create_graph=True, allow_unused=True,
                                         materialize_grads=True) if loss.requires_grad
                     else [torch.zeros_like(x) for x in xs])
            for j, g in enumerate(grads):
                primal, tangent = fwAD.unpack_dual(g)
                tangent = torch.zeros_like(primal) if tangent is None else tangent.detach()
                columns.setdefault((j, i), []).append(tangent.clone())
    return _blocks(columns, xs, xs)


def apply(transform: str, impl: Any, case: Case) -> list[torch.Tensor]:
    """The flat result of ``impl``'s ``transform`` on ``case``."""
    xs = _inputs(case)
    argnums = tuple(range(len(xs)))
    torch.manual_seed(case.seed)
    if transform == "grad":
        return list(impl.grad(scalar_fn(case), argnums=argnums)(*xs))
    if transform == "jvp":
        primals, tangents = impl.jvp(case.fn, tuple(xs), tuple(case.tangents))
        return list(primals) + list(tangents)
    if transform == "linearize":
        primals, jvp_fn = impl.linearize(case.fn, *xs)
        return list(primals) + list(jvp_fn(*case.tangents))
    if transform == "jacrev":
        return tree_flatten(impl.jacrev(real_outputs_fn(case), argnums=argnums)(*xs))[0]
    if transform == "jacfwd":
        return tree_flatten(impl.jacfwd(real_outputs_fn(case), argnums=argnums)(*xs))[0]
    if transform == "hessian":
        return tree_flatten(impl.hessian(scalar_fn(case), argnums=argnums)(*xs))[0]
    raise ValueError(f"unknown transform {transform!r}")


def compare(actual: list, expected: list) -> str:
    """An empty string when they match, else what differs (one line)."""
    if len(actual) != len(expected):
        return f"{len(actual)} results, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(a, torch.Tensor):
            return f"result {i} is {type(a).__name__}, not a Tensor"
        if type(a) is not torch.Tensor:
            return f"result {i} is a {type(a).__name__}, not a plain Tensor (escaped level?)"
        try:
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as err:
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            return f"result {i}: " + "; ".join(lines[:3])
    return ""


# -- running ---------------------------------------------------------------------------


def unsupported(op, transform: str, dtype: torch.dtype = torch.float64) -> str:
    """Why ``transform`` is not checked on ``op`` ('' when it is)."""
    if not op.supports_autograd:
        return "op does not support autograd"
    if dtype not in op.supported_backward_dtypes(torch.get_default_device().type):
        return f"no {dtype} backward on CPU"
    if transform in ("jvp", "linearize", "jacfwd", "hessian") and not op.supports_forward_ad:
        return "op does not support forward AD"
    if transform == "hessian" and not op.supports_fwgrad_bwgrad:
        return "op does not support forward-over-reverse AD"
    return ""


def _cases_for(op, transform: str, dtype: torch.dtype
               ) -> tuple[list[Case], list[list[torch.Tensor]]]:
    if transform in ("grad", "jvp", "linearize"):
        found = cases(op, MAX_SAMPLES, dtype=dtype)
    else:
        found = cases(op, JAC_SAMPLES, scan=JAC_SCAN, small=True, dtype=dtype)
    usable, expected = [], []
    for case in found:
        if case.random and transform in ("jacfwd", "hessian"):
            raise _Random
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected.append(reference(transform, case))
        except Exception:
            continue  # torch.autograd cannot do this sample either
        usable.append(case)
    return usable, expected


class _Random(Exception):
    pass


def run_transform(op, transform: str, impls: dict[str, Any], timeout: float | None = None,
                  not_run: dict[str, str] | None = None, dtype: torch.dtype = torch.float64,
                  ) -> dict[str, Outcome]:
    """Check each of ``impls`` (name -> torch.func-like module) on ``op`` under ``transform``.

    The reference is computed once and shared. Each implementation stops at its first
    failing sample; with ``timeout`` (seconds, main thread only) a slower one fails.
    ``not_run`` (name -> reason) names implementations that fail without being run
    (they would crash the process).
    """
    why = unsupported(op, transform, dtype)
    if why:
        return {name: Outcome("skip", why) for name in impls}
    not_run = not_run or {}
    if set(impls) <= set(not_run):
        return {name: Outcome("fail", f"not run: {not_run[name]}") for name in impls}
    try:
        with _time_limit(timeout):
            usable, expected = _cases_for(op, transform, dtype)
    except _Timeout:
        why = f"the reference took over {timeout}s"
    except _Nondeterministic:
        why = "nondeterministic: same seed gives different outputs"
    except _Random:
        why = f"random op: {transform} runs vmap with randomness='error'"
    except Exception as e:
        why = f"sample_inputs raised {type(e).__name__}: {_first_line(e)}"
    else:
        why = "" if usable else "no usable samples (too big, no float outputs, or reference fails)"
    if why:
        return {name: Outcome("skip", why) for name in impls}
    return {name: Outcome("fail", f"not run: {not_run[name]}") if name in not_run
            else _check(transform, impl, usable, expected, timeout)
            for name, impl in impls.items()}


def _check(transform: str, impl: Any, usable: list[Case], expected: list, timeout) -> Outcome:
    outcome = Outcome("pass")
    try:
        with _time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for case, want in zip(usable, expected):
                where = f"sample {case.index}"
                try:
                    got = apply(transform, impl, case)
                except _Timeout:
                    raise
                except Exception as e:
                    return Outcome("fail", f"{where}: {type(e).__name__}: {_first_line(e)}",
                                   cases=outcome.cases)
                problem = compare(got, want)
                if problem:
                    return Outcome("fail", f"{where}: {problem}", cases=outcome.cases)
                outcome.cases += 1
    except _Timeout:
        return Outcome("fail", f"timeout after {timeout}s", cases=outcome.cases)
    return outcome


def run_op(op, transform: str, impl: Any, timeout: float | None = None,
           dtype: torch.dtype = torch.float64) -> Outcome:
    """:func:`run_transform` for one implementation."""
    return run_transform(op, transform, {"impl": impl}, timeout, dtype=dtype)["impl"]
