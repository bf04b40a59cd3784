"""docs/writing-batching-rules.md: its code runs, and its rules match torch.func and a loop."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from vmap_reference import loop_reference

import torchlevels
from torchlevels.batching import shortcuts, views

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-batching-rules.md"


def run_python_blocks(path: Path) -> dict:
    """Execute the doc's ```python blocks in order in one namespace; return it."""
    text = path.read_text()
    namespace: dict = {"__name__": "writing_batching_rules"}
    for block in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        # blank lines in front keep traceback line numbers those of the doc
        source = "\n" * text.count("\n", 0, block.start(1)) + block.group(1)
        exec(compile(source, str(path), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def doc():
    # once per process: a custom op cannot be defined twice
    yield run_python_blocks(DOC)
    # the doc re-registers aten.unsqueeze, which switches vmap's shortcuts off; give the
    # other tests the library's own rule and the shortcuts back
    torchlevels.register_batching_rule(torch.ops.aten.unsqueeze.default)(views.unsqueeze)
    shortcuts.switch_on()


def check(f, *args, in_dims):
    """torchlevels.vmap == torch.func.vmap == a loop, with no slow-loop warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the slow loop's warning fails the test
        ours = torchlevels.vmap(f, in_dims)(*args)
    torch.testing.assert_close(ours, torch.func.vmap(f, in_dims)(*args))
    torch.testing.assert_close(ours, loop_reference(f, args, in_dims))


def test_no_rule_took_the_slow_loop(doc):
    assert len(doc["caught"]) == 1 and "using a slow loop" in str(doc["caught"][0].message)
    torch.testing.assert_close(doc["slow"], torch.nn.functional.softplus(doc["x"]) * 2.0)


def test_unsqueeze(doc):
    doc["test_unsqueeze"]()


@pytest.mark.parametrize("in_dims", [(0, None), (1, None)])
def test_scaled_softplus(doc, in_dims):
    check(doc["scaled_softplus"], torch.randn(4, 5), 1.5, in_dims=in_dims)


def test_scaled_softplus_nested(doc):
    f = lambda x: doc["scaled_softplus"](x, 0.5)
    x = torch.randn(3, 4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = torchlevels.vmap(torchlevels.vmap(f, in_dims=1))(x)
    torch.testing.assert_close(ours, torch.func.vmap(torch.func.vmap(f, in_dims=1))(x))
    torch.testing.assert_close(ours, f(x).transpose(1, 2))


def batched(shape, dim):
    """A random tensor of ``shape`` with a batch dim of 5 at ``dim`` (None: no batch dim)."""
    return torch.randn(shape) if dim is None else torch.randn(5, *shape).movedim(0, dim)


@pytest.mark.parametrize("in_dims", [(0, 0), (1, 0), (0, 1), (0, None), (2, None), (None, 0)])
def test_matvec(doc, in_dims):
    a, v = batched((4, 3), in_dims[0]), batched((3,), in_dims[1])
    check(doc["matvec"], a, v, in_dims=in_dims)


USERS_RULES = """
import torch, torch.nn.functional as F, torchlevels
from torchlevels.batching.dims import to_front
from torchlevels.batching.registry import register_family
aten, calls = torch.ops.aten, []

def logged(name):
    def rule(func, args, dims, kwargs):
        calls.append(name)
        return func(to_front(args[0], dims[0]), *args[1:], **kwargs), 0
    return rule

def packet_sum(func, args, dims, kwargs):
    calls.append("sum")
    x = to_front(args[0], dims[0])
    return (x.flatten(1).sum(1) if func is aten.sum.default else
            func(x, [d % (x.dim() - 1) + 1 for d in args[1]], *args[2:], **kwargs)), 0

torchlevels.register_batching_rule(aten.sum)(packet_sum)  # the library has sum.default's
torchlevels.register_batching_rule(aten.linear.default)(logged("linear"))  # composite ops
torchlevels.register_batching_rule(aten.layer_norm.default)(logged("layer_norm"))
register_family("mine", lambda op: op is aten.sin.default, logged("sin"))  # before pointwise
x, w = torch.randn(4, 5, 3), torch.randn(2, 3)
for f in (lambda t: t.sum(), lambda t: F.linear(t, w), lambda t: F.layer_norm(t, (3,)),
          torch.sin):
    torch.testing.assert_close(torchlevels.vmap(f)(x), torch.stack([f(t) for t in x]))
print(calls)
"""


def test_users_rules_win_over_the_librarys_as_documented():
    # a packet's rule over the library's rules for its overloads, a composite op's rule
    # before PyTorch decomposes it, a user's family before the library's (in a process of
    # its own: the registrations stay for the process)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", USERS_RULES], capture_output=True, text=True,
                         timeout=300, cwd=DOC.parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['sum', 'linear', 'layer_norm', 'sin']"
