"""Per-example gradients over PyTorch's OpInfo database: vmap(grad) against a loop.

For every OpInfo that supports autograd, the first float64 CPU samples: a batch of three
perturbed copies of the sample's differentiated inputs, and the gradient of a weighted
sum of the op's outputs for each example. torch.autograd in a Python loop is the
reference. The forward OpInfo sweep (test_opinfo_vmap.py) does not reach the batching
rules of backward kernels; this does (it found cdist's backward failing when an example's
own batch dims differ in rank). Two checks per sample:

- wherever ``torch.func.vmap(torch.func.grad)`` matches the loop, torchlevels does too;
- wherever torchlevels runs, it matches the loop: no silently wrong gradient.

Random ops are left out (a loop reseeded per example is no reference for one batched
draw). A second test does the same for per-example Hessian-vector products
(``vmap(jvp(grad))``, the first three samples) against torch.func's ``jvp(grad)`` of each
example: it found backward formulas whose shortcuts were taken when they must not be.
"""

from __future__ import annotations

import warnings

import torch
import torch.func as tf
from opinfo_harness import _RandomOpSpy
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_unflatten

import torchlevels as tl

BATCH = 3
SAMPLES = 12
HVP_SAMPLES = 3
MAX_NUMEL = 2000


def _weighted_sum(out) -> torch.Tensor:
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
            and o.is_floating_point()]
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum()
               for o in outs)


def _cases(forward_over_reverse: bool = False):
    """(name, function of the differentiated inputs, their batched copies) per sample."""
    for op in op_db:
        supported = op.supports_fwgrad_bwgrad if forward_over_reverse else op.supports_autograd
        if not supported or torch.float64 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float64, requires_grad=True))
        except Exception:  # an OpInfo that cannot make samples here
            continue
        for index, sample in enumerate(samples[:HVP_SAMPLES if forward_over_reverse else SAMPLES]):
            flat, spec = tree_flatten((sample.input, sample.args))
            diff = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
                    and t.requires_grad and t.is_floating_point() and t.numel() < MAX_NUMEL]
            if not diff:
                continue

            def f(*xs, flat=flat, spec=spec, diff=diff, sample=sample, op=op):
                leaves = list(flat)
                for i, x in zip(diff, xs):
                    leaves[i] = x
                inp, args = tree_unflatten(leaves, spec)
                return _weighted_sum(sample.output_process_fn_grad(op(inp, *args, **sample.kwargs)))

            gen = torch.Generator().manual_seed(index)
            batched = [torch.stack([flat[i].detach() + 0.01 * k * torch.randn(
                flat[i].shape, generator=gen, dtype=flat[i].dtype) for k in range(BATCH)])
                for i in diff]
            yield f"{op.name}.{op.variant_test_name} sample {index}", f, batched


def _loop(f, batched) -> list | None:
    rows = []
    with _RandomOpSpy() as spy:
        for k in range(BATCH):
            xs = [b[k].clone().requires_grad_() for b in batched]
            grads = torch.autograd.grad(f(*xs), xs, allow_unused=True)
            rows.append([torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)])
    if spy.random:
        return None
    return [torch.stack(column) for column in zip(*rows)]


def _matches(lib, f, batched, expected) -> bool | None:
    """Whether lib's vmap(grad) matches the loop; None when it raises."""
    try:
        got = lib.vmap(lib.grad(f, argnums=tuple(range(len(batched)))))(*batched)
    except Exception:
        return None
    return all(torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
               for g, e in zip(got, expected))


def test_per_example_gradients_of_every_opinfo_match_a_loop():
    warnings.simplefilter("ignore")
    behind, wrong, checked = [], [], 0
    for name, f, batched in _cases():
        try:
            expected = _loop(f, batched)
        except Exception:  # the op rejects its perturbed sample: nothing to compare
            continue
        if expected is None:
            continue
        checked += 1
        ours = _matches(tl, f, batched, expected)
        if ours is False:
            wrong.append(name)
        elif ours is None and _matches(tf, f, batched, expected):
            behind.append(name)
    assert checked > 500  # the sweep did run
    assert not wrong, f"wrong per-example gradients: {wrong}"
    assert not behind, f"torch.func gets these right and torchlevels raises: {behind}"


def _tangents(xs) -> tuple:
    return tuple(x.cos() for x in xs)


def _hvp(lib, f, n: int):
    """Forward over reverse: the Hessian-vector product of ``f`` along fixed tangents."""
    return lambda *xs: lib.jvp(lib.grad(f, argnums=tuple(range(n))), xs, _tangents(xs))[1]


def test_per_example_hessian_vector_products_of_every_opinfo_match_torch_func():
    """vmap(jvp(grad)) over the first samples against torch.func's jvp(grad) of each
    example: backward formulas that take a shortcut unless their pass is recorded
    (linalg.solve's LU factors) gave wrong products here."""
    warnings.simplefilter("ignore")
    behind, wrong, checked = [], [], 0
    for name, f, batched in _cases(forward_over_reverse=True):
        n = len(batched)
        try:
            with _RandomOpSpy() as spy:
                rows = [_hvp(tf, f, n)(*(b[k] for b in batched)) for k in range(BATCH)]
        except Exception:  # torch.func cannot take this example: no reference
            continue
        if spy.random:
            continue
        expected = [torch.stack(column) for column in zip(*rows)]
        checked += 1
        try:
            got = tl.vmap(_hvp(tl, f, n))(*batched)
        except Exception:
            try:
                tf.vmap(_hvp(tf, f, n))(*batched)
            except Exception:
                continue
            behind.append(name)
            continue
        if not all(torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)
                   for g, e in zip(got, expected)):
            wrong.append(name)
    assert checked > 300
    assert not wrong, f"wrong per-example Hessian-vector products: {wrong}"
    assert not behind, f"torch.func's vmap runs these and torchlevels raises: {behind}"
