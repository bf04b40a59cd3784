"""Check a vmap implementation against a per-example loop on PyTorch's OpInfo samples.

For each OpInfo we take its first float32 CPU samples and turn every tensor argument
into a batch of ``BATCH`` different examples: floating tensors get small, different
noise per example; integer and bool tensors (often indices) are repeated unchanged.
Each sample is run under several ``in_dims`` patterns (everything batched at dim 0,
everything batched at the last dim, each tensor batched alone with the others
unbatched), and the vmapped result must match a Python loop that calls the op on each
example and stacks the outputs. Keyword arguments are never batched, as in vmap.

The same harness measures ``torch.func.vmap`` and ``torchlevels.vmap``: pass either as
``vmap_impl``. Random ops run with ``randomness="different"`` and are checked for
shape and dtype only.
"""

from __future__ import annotations

import itertools
import re
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

BATCH = 3
MAX_SAMPLES = 6
NOISE = 0.01
RTOL = 1e-4
ATOL = 1e-4
SLOW_LOOP = re.compile(r"no batching rule for (\S+?);")


@dataclass
class Outcome:
    """The result of checking one OpInfo: status is 'pass', 'fail' or 'skip'."""

    status: str
    detail: str = ""
    slow_loop: set[str] = field(default_factory=set)  # aten ops that fell to the slow loop
    cases: int = 0  # (sample, in_dims) cases that ran


class Variant:
    """An OpInfo called as its ``method`` (``x.add(y)``) or ``inplace`` variant
    (``x.add_(y)``, on a copy of ``x``), with the OpInfo's samples and name."""

    def __init__(self, op, kind: str) -> None:
        self.op, self.kind = op, kind
        self.call = op.method_variant if kind == "method" else op.inplace_variant

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "inplace":
            x = x.clone()
        return self.call(x, *args, **kwargs)


def op_id(op) -> str:
    """``name`` or ``name.variant``: unique over op_db."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def check_op(op, vmap_impl: Callable) -> tuple[str, str]:
    """``(status, detail)`` of :func:`run_op`."""
    outcome = run_op(op, vmap_impl)
    return outcome.status, outcome.detail


def run_op(op, vmap_impl: Callable, timeout: float | None = None) -> Outcome:
    """Check ``vmap_impl`` on ``op``'s samples against the per-example loop.

    Stops at the first failing case. With ``timeout`` (seconds, main thread only), an op
    that runs longer fails with "timeout".
    """
    with _time_limit(timeout):
        try:
            return _run_op(op, vmap_impl)
        except _Timeout:
            return Outcome("fail", f"timeout after {timeout}s")


# -- samples -------------------------------------------------------------------------


@dataclass
class Sample:
    """One OpInfo sample as batched examples: ``examples[b]`` are the positional args."""

    args: tuple  # the sample's positional args (input first)
    kwargs: dict
    leaves: list  # tensor leaves of ``args`` (None for non-tensor leaves)
    examples: list[list]  # per example, the flat leaves of its args
    spec: Any


def samples(op, dtype: torch.dtype = torch.float32) -> Iterator[Sample]:
    """The op's first ``dtype`` CPU samples, each with ``BATCH`` examples per tensor."""
    torch.manual_seed(0)
    raw = op.sample_inputs(torch.get_default_device(), dtype, requires_grad=False)
    for s in itertools.islice(raw, MAX_SAMPLES):
        args = (s.input, *s.args)
        flat, spec = tree_flatten(args)
        if not any(isinstance(a, torch.Tensor) for a in flat):
            continue
        per_leaf = [_examples_of(a) for a in flat]
        examples = [[leaf[b] for leaf in per_leaf] for b in range(BATCH)]
        yield Sample(args, dict(s.kwargs), flat, examples, spec)


def _examples_of(a: Any) -> list:
    if not isinstance(a, torch.Tensor):
        return [a] * BATCH
    if a.is_floating_point() or a.is_complex():
        noise = torch.randn(a.shape, dtype=a.dtype)
        return [a.clone() + NOISE * b * noise for b in range(BATCH)]
    return [a] * BATCH  # integer/bool tensors are often indices: keep them valid


def in_dims_patterns(sample: Sample) -> Iterator[tuple[str, list]]:
    """``(name, dims)`` pairs; ``dims`` is parallel to ``sample.leaves``."""
    tensors = [i for i, a in enumerate(sample.leaves) if isinstance(a, torch.Tensor)]
    for name, dim in (("all at 0", 0), ("all at -1", -1)):
        dims = [None] * len(sample.leaves)
        for i in tensors:
            dims[i] = dim
        yield name, dims
    if len(tensors) > 1:
        for i in tensors:
            dims = [None] * len(sample.leaves)
            dims[i] = 0
            yield f"only tensor #{tensors.index(i)} at 0", dims


def batched_args(sample: Sample, dims: list) -> tuple[tuple, tuple]:
    """The vmap inputs and ``in_dims`` for one pattern."""
    leaves = []
    for i, d in enumerate(dims):
        if d is None:
            leaves.append(sample.examples[0][i])
        else:
            leaves.append(torch.stack([ex[i] for ex in sample.examples], dim=d))
    args = tree_unflatten(leaves, sample.spec)
    # in_dims per top-level arg: None for args without tensors, else the arg's structure.
    in_dims = []
    for arg in args:
        flat, spec = tree_flatten(arg)
        n = len(flat)
        arg_dims, dims = dims[:n], dims[n:]
        if all(d is None for d in arg_dims):
            in_dims.append(None)
        else:
            in_dims.append(tree_unflatten(arg_dims, spec))
    return args, tuple(in_dims)


def example_args(sample: Sample, dims: list, b: int) -> tuple:
    """The args of example ``b``: batched leaves take example ``b``, others example 0."""
    leaves = [sample.examples[b if d is not None else 0][i] for i, d in enumerate(dims)]
    return tree_unflatten(leaves, sample.spec)


# -- checking ------------------------------------------------------------------------


class _NonTensorOutput(Exception):
    pass


def _call(op, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = tree_flatten(op(*args, **kwargs))[0]
    if not out or not all(isinstance(o, torch.Tensor) for o in out):
        raise _NonTensorOutput(f"returns {[type(o).__name__ for o in out]}")
    return out


def reference(op, sample: Sample, dims: list) -> list[torch.Tensor]:
    """Loop over the examples and stack each output along dim 0."""
    per_example = [_call(op, example_args(sample, dims, b), sample.kwargs) for b in range(BATCH)]
    return [torch.stack(outs) for outs in zip(*per_example)]


class _RandomOpSpy(TorchDispatchMode):
    """Notes whether any aten op that draws random numbers runs."""

    def __init__(self) -> None:
        super().__init__()
        self.random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.random = self.random or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def is_random(op, sample: Sample) -> bool | None:
    """True for random ops, None when the output is not even reproducible under a seed.

    Many OpInfos of random ops reseed on every call (``wrapper_set_seed``), so look at
    the aten ops that run rather than at the outputs.
    """
    args = example_args(sample, [None] * len(sample.leaves), 0)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        with _RandomOpSpy() as spy:
            runs.append(_call(op, args, sample.kwargs))
    if not _same(runs[0], runs[1]):
        return None
    return spy.random


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    try:
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    except (AssertionError, ValueError):
        return False
    return True


def _run_op(op, vmap_impl: Callable) -> Outcome:
    if torch.float32 not in op.supported_dtypes(torch.get_default_device().type):
        return Outcome("skip", "no float32 support on CPU")
    if "empty" in op.name:
        return Outcome("skip", "nondeterministic: returns uninitialized memory")
    try:
        usable = []
        for sample in samples(op):
            all_batched = [0 if isinstance(a, torch.Tensor) else None for a in sample.leaves]
            try:
                reference(op, sample, all_batched)
            except Exception:  # the loop reference itself fails on these examples
                continue
            usable.append(sample)
    except Exception as e:
        return Outcome("skip", f"sample_inputs raised {type(e).__name__}: {_first_line(e)}")
    if not usable:
        return Outcome("skip", "no usable samples (no tensor args, or the reference errors)")
    try:
        random = [is_random(op, sample) for sample in usable]
    except Exception as e:
        return Outcome("skip", f"the op fails when run twice: {type(e).__name__}")
    if None in random:
        return Outcome("skip", "nondeterministic: same seed gives different outputs")
    randomness = "different" if any(random) else "error"

    outcome = Outcome("pass", "random: shape/dtype checked only" if any(random) else "")
    for n, sample in enumerate(usable):
        for pattern, dims in in_dims_patterns(sample):
            where = f"sample {n}, {pattern}"
            try:
                expected = reference(op, sample, dims)
            except Exception:
                continue  # unbatched args are example 0: still fine, but be safe
            args, in_dims = batched_args(sample, dims)
            kwargs = sample.kwargs
            fn = lambda *a, kwargs=kwargs: op(*a, **kwargs)
            if getattr(op, "kind", None) == "inplace" and dims[0] is None and isinstance(
                    sample.leaves[0], torch.Tensor):
                problem = _refused(vmap_impl(fn, in_dims=in_dims, randomness=randomness), args)
                if problem:
                    return Outcome("fail", f"{where}: {problem}")
                outcome.cases += 1
                continue
            _forget_warned()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    actual = tree_flatten(
                        vmap_impl(fn, in_dims=in_dims, randomness=randomness)(*args)
                    )[0]
                except _Timeout:
                    raise
                except Exception as e:
                    outcome.status = "fail"
                    outcome.detail = f"{where}: {type(e).__name__}: {_first_line(e)}"
                    return outcome
                finally:
                    for w in caught:
                        found = SLOW_LOOP.search(str(w.message))
                        if found:
                            outcome.slow_loop.add(found.group(1))
            outcome.cases += 1
            problem = compare(actual, expected, shape_only=random[n])
            if problem:
                outcome.status = "fail"
                outcome.detail = f"{where}: {problem}"
                return outcome
    return outcome


def _refused(vmapped: Callable, args: tuple) -> str:
    """An empty string when ``vmapped``, which writes batched values in place into an
    unbatched input, raises vmap's error for that, else what it did instead."""
    try:
        vmapped(*args)
    except _Timeout:
        raise
    except Exception as e:
        return "" if "out-of-place" in str(e) else f"{type(e).__name__}: {_first_line(e)}"
    return "wrote batched values into an unbatched input without an error"


def compare(actual: list, expected: list, shape_only: bool = False) -> str:
    """An empty string when they match, else what differs (one line)."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not isinstance(a, torch.Tensor):
            return f"output {i} is {type(a).__name__}, not a Tensor"
        if shape_only:
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"output {i}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}"
            continue
        try:
            torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as err:
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            return f"output {i}: " + "; ".join(lines[:3])
    return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _forget_warned() -> None:
    """torchlevels warns once per op about the slow loop; make it warn again."""
    try:
        from torchlevels.batching.registry import reset_loop_warnings
    except ImportError:  # the harness also measures torch.func.vmap on its own
        return
    reset_loop_warnings()


class _Timeout(BaseException):
    pass


class _time_limit:
    """Raise ``_Timeout`` in the main thread after ``seconds`` (no-op elsewhere or if None)."""

    def __init__(self, seconds: float | None) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.seconds = seconds if main and hasattr(signal, "setitimer") else None

    def __enter__(self) -> None:
        if self.seconds:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        if self.seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)

    @staticmethod
    def _fire(signum: int, frame: object) -> None:
        raise _Timeout
