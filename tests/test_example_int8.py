"""The user-defined level of docs/writing-a-transform.md: int8 weights under vmap and grad."""

import doctest
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F

import torchlevels as tl

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "int8_weights.py"
spec = importlib.util.spec_from_file_location("int8_weights", EXAMPLE)
int8_weights = sys.modules["int8_weights"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(int8_weights)


def mlp_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, params, torch.randn(8, 12), torch.randint(0, 4, (8,))


def per_sample_grads(lib, model, params, x, y):
    def loss(p, x, y):
        return F.cross_entropy(lib.functional_call(model, p, (x[None],)), y[None])

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, x, y)


def test_per_sample_grads_with_int8_weights_equal_torch_func_on_the_dequantized_weights():
    model, params, x, y = mlp_and_data()
    with int8_weights.int8_weights() as Q:
        qparams = {k: Q(v) if v.dim() == 2 else v for k, v in params.items()}
        ours = per_sample_grads(tl, model, qparams, x, y)
        dequantized = {k: Q.unwrap(v) for k, v in qparams.items()}
    assert qparams["0.weight"]._inner.dtype == torch.int8
    expected = per_sample_grads(tf, model, dequantized, x, y)
    assert ours.keys() == expected.keys()
    for k in ours:
        assert type(ours[k]) is torch.Tensor
        torch.testing.assert_close(ours[k], expected[k])
    # quantization changed the weights a little, not a lot
    err = (dequantized["0.weight"] - params["0.weight"]).abs().max()
    assert 0 < err <= params["0.weight"].abs().max() / 127


def test_int8_level_composes_with_tools_and_compile():
    model, params, x, y = mlp_and_data()
    with int8_weights.int8_weights() as Q:
        qparams = {k: Q(v) if v.dim() == 2 else v for k, v in params.items()}
        counted = tl.count_flops(lambda x: tl.functional_call(model, qparams, (x,)))
        out = counted(x)
        dequantized = {k: Q.unwrap(v) for k, v in qparams.items()}
    torch.testing.assert_close(out, tf.functional_call(model, dequantized, (x,)))
    assert counted.by_op == {"aten.addmm": 2 * 8 * (12 * 16 + 16 * 4)}


def test_escaped_quantized_weight_is_an_error():
    with int8_weights.int8_weights() as Q:
        qw = Q(torch.randn(3, 3))
    with pytest.raises(tl.EscapedTensorError, match="int8 weights"):
        qw @ torch.randn(3)


@pytest.mark.cpu_only("the doctest prints CPU tensors")
def test_docstring():
    result = doctest.testmod(int8_weights)
    assert result.failed == 0 and result.attempted > 0


def test_the_forwarding_level_example_of_the_doc_runs():
    doc = (EXAMPLE.parent.parent / "docs" / "writing-a-transform.md").read_text()
    block = doc.split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(block, "writing-a-transform.md", "exec"), namespace)
    assert namespace["L"]._level.seen == ["aten.exp.default", "aten.mul.Tensor"]
