"""The decompositions vmap batches ops with give the ops' own results.

vmap batches an op without a rule through its ``torch._decomp`` decomposition. Every
output counts, not only the one a user sees: a backward kernel may read an auxiliary
output of the forward (flash attention's log-sum-exp, for which the decomposition
returned the attention weights, and per-example gradients came out wrong). This runs
the OpInfo samples (forward and backward) once, records the first arguments of every op
vmap would decompose, and compares each decomposition with the op's kernel.
"""

import warnings

import torch
import torch.nn.functional as F
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from torchlevels.batching.registry import How, resolve

# outputs whose values are undefined or random by design
UNCHECKED_VALUES = {torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                    torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_like.default}


class _FirstCalls(TorchDispatchMode):
    """Records the first arguments of each op that vmap batches by decomposition."""

    def __init__(self, calls: dict) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.calls and resolve(func).how is How.DECOMPOSITION:
            self.calls[func] = tree_map(
                lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                (args, kwargs))
        return func(*args, **kwargs)


def _attention(mask):
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v)


def _transformer_layer(training):
    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 4, requires_grad=True)
    return layer.train(training)(x), (x, *layer.parameters())


# fused kernels that the first OpInfo samples miss (4-d attention takes the CPU flash kernel)
WORKLOADS = [lambda: _attention(None), lambda: _attention(torch.randn(1, 2, 5, 5)),
             lambda: _transformer_layer(True), lambda: _transformer_layer(False)]


def _decomposed_calls() -> dict:
    calls: dict = {}
    warnings.simplefilter("ignore")
    for workload in WORKLOADS:
        with _FirstCalls(calls):
            out, leaves = workload()
            torch.autograd.grad(out.sum(), leaves)
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            for sample in list(op.sample_inputs("cpu", torch.float32, requires_grad=True))[:2]:
                with _FirstCalls(calls):
                    out = op(sample.input, *sample.args, **sample.kwargs)
                    leaves = [t for t in tree_flatten((sample.input, sample.args))[0]
                              if isinstance(t, torch.Tensor) and t.requires_grad]
                    tracked = [o for o in tree_flatten(out)[0]
                               if isinstance(o, torch.Tensor) and o.requires_grad]
                    if tracked and leaves:
                        torch.autograd.grad(sum(o.sum() for o in tracked), leaves,
                                            allow_unused=True)
        except Exception:  # a sample the op itself rejects: nothing to record
            continue
    return calls


def _mismatch(func, args, kwargs) -> str | None:
    torch.manual_seed(0)
    try:
        expected = func(*args, **kwargs)
    except Exception:
        return None
    torch.manual_seed(0)
    actual = resolve(func).fn(*args, **kwargs)
    expected, actual = tree_flatten(expected)[0], tree_flatten(actual)[0]
    if len(expected) != len(actual):
        return f"{len(actual)} outputs, the kernel has {len(expected)}"
    for i, (e, a) in enumerate(zip(expected, actual)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or e.shape != a.shape or e.dtype != a.dtype:
            return f"output {i}: {getattr(a, 'shape', a)} {getattr(a, 'dtype', '')}, " \
                   f"the kernel's is {e.shape} {e.dtype}"
        if func in UNCHECKED_VALUES or not (e.is_floating_point() or e.is_complex()):
            continue
        if not torch.allclose(e, a, rtol=1e-3, atol=1e-4, equal_nan=True):
            return f"output {i}: different values"
    return None


def test_every_decomposition_vmap_uses_gives_the_kernels_outputs():
    calls = _decomposed_calls()
    assert len(calls) > 30  # the sweep did reach the decomposed ops
    mismatches = {str(func): m for func, (args, kwargs) in calls.items()
                  if (m := _mismatch(func, args, kwargs)) is not None}
    assert not mismatches, mismatches
