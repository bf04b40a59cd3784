"""Every module of PyTorch's module database under the transforms people apply to modules,
against a loop over examples with plain autograd.

For each ``ModuleInfo`` in ``torch.testing._internal.common_modules.module_db`` and each of
its first samples, in eval and in training mode, in float64 on the CPU:

- ``vmap``: the module over a batch of perturbed copies of its tensor inputs;
- ``vmap(grad)`` and ``grad(vmap)``: per-example gradients in the parameters, and their sum;
- ``ensemble``: vmap over stacked perturbed copies of the parameters (stack_module_state's
  layout), the inputs shared;
- ``jacrev`` and ``jacfwd``: the Jacobian in the first floating-point input.

The references are a Python loop with ``torch.stack`` and ``torch.autograd``. Each test
checks that exactly the expected failures fail: :data:`EXPECTED_FAILURES` says why each one
does; one that starts to pass fails the test too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten
from vmap_reference import seeded

import torchlevels as tl

B = 3
MAX_SAMPLES = 8  # LinearCrossEntropyLoss alone has about a thousand
MAX_JACOBIAN = 10_000  # entries

# Both modes unless a mode is named. torch.func fails each of these too, unless noted.
EXPECTED_FAILURES: dict[tuple[str, str, str | None], str] = {
    ("nn.GaussianNLLLoss", "vmap", None):
        "the module checks `torch.any(var < 0)` in Python: data-dependent control flow",
    ("nn.BatchNorm1d", "vmap", "train"):
        "refused by design: training updates running stats that are not batched with "
        "batched statistics (torch.func refuses too)",
    ("nn.BatchNorm2d", "vmap", "train"): "as BatchNorm1d",
    ("nn.BatchNorm3d", "vmap", "train"): "as BatchNorm1d",
    ("nn.BatchNorm1d", "vmap(grad)", "train"): "as vmap",
    ("nn.BatchNorm2d", "vmap(grad)", "train"): "as vmap",
    ("nn.BatchNorm3d", "vmap(grad)", "train"): "as vmap",
    ("nn.BatchNorm1d", "grad(vmap)", "train"): "as vmap",
    ("nn.BatchNorm2d", "grad(vmap)", "train"): "as vmap",
    ("nn.BatchNorm3d", "grad(vmap)", "train"): "as vmap",
    ("nn.InstanceNorm1d", "vmap", "train"):
        "with track_running_stats, as BatchNorm1d: the per-example statistics would be "
        "written into unbatched running stats",
    ("nn.InstanceNorm2d", "vmap", "train"): "as InstanceNorm1d",
    ("nn.InstanceNorm3d", "vmap", "train"): "as InstanceNorm1d",
    ("nn.MultiLabelMarginLoss", "jacfwd", None):
        "PyTorch has no forward-AD formula for multilabel_margin_loss_forward, and "
        "torch._decomp's decomposition of it miscounts targets after a -1: PyTorch's error",
    ("nn.CTCLoss", "jacfwd", None):
        "PyTorch has no forward-AD formula for _ctc_loss, and no decomposition of it",
    ("nn.KLDivLoss", "jacfwd", None):
        "NaN where backward is finite: PyTorch's forward-AD formula computes log(target) "
        "for targets <= 0; torch.func's jacfwd gives the same NaNs (finite entries agree)",
    ("nn.LPPool1d", "jacfwd", None):
        "NaN where backward is finite: PyTorch's forward-AD formula of pow at a negative "
        "base; torch.func's jacfwd gives the same NaNs (finite entries agree)",
    ("nn.LPPool2d", "jacfwd", None): "as LPPool1d",
}


def _samples(info, training: bool) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        samples = info.module_inputs_func(info, device=torch.get_default_device(),
                                          dtype=torch.float64,
                                          requires_grad=False, training=training)
    return [s for s in samples if s.forward_input is not None][:MAX_SAMPLES]


def _outputs(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _mismatch(got, want) -> str | None:
    got, want = _outputs(got), _outputs(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return f"shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if g.dtype.is_floating_point:
            if not torch.allclose(g, w, atol=1e-6, rtol=1e-5, equal_nan=True):
                return f"max difference {(g - w).abs().nan_to_num().max().item():.3g}"
        elif not torch.equal(g, w):
            return "integer values differ"
    return None


class _Case:
    """One sample: the module and a function of (parameters, tensor inputs)."""

    def __init__(self, info, sample, training: bool) -> None:
        gen = seeded(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.module = info.module_cls(*sample.constructor_input.args,
                                          **sample.constructor_input.kwargs)
            self.module = self.module.to(torch.float64).train(training)
            self.args, self.kwargs = sample.forward_input.args, sample.forward_input.kwargs
            self.module(*self.args, **self.kwargs)  # lazy modules take their shapes here
        self.params = {n: p.detach() for n, p in self.module.named_parameters()}
        self.buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}
        self.positions = [i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        self.inputs = [self.args[i] for i in self.positions]
        self.batch = [torch.stack([self.perturb(t, gen) for _ in range(B)])
                      for t in self.inputs]
        weights = [torch.randn(o.shape, dtype=o.dtype, generator=gen)
                   for o in _outputs(self(self.params, *self.inputs))]
        self.weights = [w if w.is_floating_point() else None for w in weights]

    @staticmethod
    def perturb(t: torch.Tensor, gen) -> torch.Tensor:
        if not t.is_floating_point():
            return t.clone()
        return t + 0.01 * torch.randn(t.shape, dtype=t.dtype, generator=gen)

    def __call__(self, params, *inputs):
        args = list(self.args)
        for i, x in zip(self.positions, inputs):
            args[i] = x
        # fresh buffers each call: a training step's running-stat update stays in the call
        buffers = {n: b.clone() for n, b in self.buffers.items()}
        return torch.func.functional_call(self.module, (params, buffers), tuple(args),
                                          self.kwargs)

    def loss(self, params, *inputs):
        outs = _outputs(self(params, *inputs))
        return sum((o * w).sum() for o, w in zip(outs, self.weights) if w is not None)

    def per_example(self, f):
        return [f(*[b[i] for b in self.batch]) for i in range(B)]

    def autograd_params(self, *inputs):
        params = {n: p.clone().requires_grad_() for n, p in self.params.items()}
        grads = torch.autograd.grad(self.loss(params, *inputs), list(params.values()),
                                    allow_unused=True)
        return {n: torch.zeros_like(p) if g is None else g
                for (n, p), g in zip(self.params.items(), grads)}


def _stack(outs: list):
    return torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *outs)


def _checks(case: _Case) -> dict:
    """check name -> (what torchlevels computes, the reference), both as thunks."""
    in_dims = (None,) + (0,) * len(case.batch)
    checks = {
        "vmap": (lambda: tl.vmap(lambda *x: case(case.params, *x))(*case.batch),
                 lambda: _stack(case.per_example(lambda *x: case(case.params, *x)))),
    }
    if case.params:
        checks["vmap(grad)"] = (
            lambda: tl.vmap(tl.grad(case.loss), in_dims=in_dims)(case.params, *case.batch),
            lambda: _stack(case.per_example(case.autograd_params)))
        checks["grad(vmap)"] = (
            lambda: tl.grad(lambda p, *x: tl.vmap(case.loss, in_dims=in_dims)(p, *x).sum())(
                case.params, *case.batch),
            lambda: {n: g.sum(0) for n, g in
                     _stack(case.per_example(case.autograd_params)).items()})
        gen = seeded(1)
        members = [{n: case.perturb(p, gen) for n, p in case.params.items()}
                   for _ in range(B)]
        stacked = {n: torch.stack([m[n] for m in members]) for n in case.params}
        checks["ensemble"] = (
            lambda: tl.vmap(lambda p: case(p, *case.inputs))(stacked),
            lambda: _stack([case(m, *case.inputs) for m in members]))
    floats = [k for k, t in enumerate(case.inputs) if t.is_floating_point()]
    if floats:
        k = floats[0]
        x0 = case.inputs[k]

        def f(x):
            inputs = list(case.inputs)
            inputs[k] = x
            return torch.cat([o.flatten() for o in _outputs(case(case.params, *inputs))
                              if o.is_floating_point()])

        if x0.numel() * f(x0).numel() <= MAX_JACOBIAN:
            want = lambda: torch.autograd.functional.jacobian(f, x0)  # noqa: E731
            checks["jacrev"] = (lambda: tl.jacrev(f)(x0), want)
            checks["jacfwd"] = (lambda: tl.jacfwd(f)(x0), want)
    return checks


def _failures(info, training: bool) -> dict[str, list[str]]:
    failures: dict[str, list[str]] = {}
    for k, sample in enumerate(_samples(info, training)):
        try:
            case = _Case(info, sample, training)
        except Exception:  # noqa: BLE001 - a sample the module itself rejects
            continue
        if not case.inputs:
            continue
        for check, (ours, reference) in _checks(case).items():
            try:
                want = reference()
            except Exception:  # noqa: BLE001 - plain PyTorch cannot do it either
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    problem = _mismatch(ours(), want)
            except Exception as e:  # noqa: BLE001
                problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if problem:
                failures.setdefault(check, []).append(f"sample {k} ({sample.desc}): {problem}")
    return failures


RANDOM = {"nn.FractionalMaxPool2d", "nn.FractionalMaxPool3d"}  # a loop draws other numbers
# inputs out of [0, 1] (the transforms' perturbed copies) are a device-side assert on CUDA
DEVICE_ASSERT = {"nn.BCELoss"} if torch.get_default_device().type == "cuda" else set()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("info", [i for i in module_db if i.name not in RANDOM | DEVICE_ASSERT],
                         ids=lambda i: i.name)
def test_module_under_transforms_matches_a_loop(info, mode):
    failures = _failures(info, mode == "train")
    expected = {check for (name, check, m) in EXPECTED_FAILURES
                if name == info.name and m in (None, mode)}
    unexpected = {c: f for c, f in failures.items() if c not in expected}
    assert not unexpected, unexpected
    assert set(failures) == expected, f"expected to fail but passed: {expected - set(failures)}"
