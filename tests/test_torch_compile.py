"""torchlevels under ``torch.compile``: its transforms run eagerly inside a compiled
function, and compiled functions run inside its transforms, with torch.func's results.

Most tests use dynamo's "eager" backend (dynamo's graph capture, no code generation) to
stay fast; the subprocess test runs inductor in a fresh interpreter, where inductor
first builds its pattern tables (drawing with ``torch.randperm``) inside a live level.
"""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.func as tf

import torchlevels as tl

pytestmark = pytest.mark.cpu_only("compiles for the CPU; the GPU path is dynamo's own")


def f(x, w):
    c = torch.arange(3.0).cos()  # plain ops, which dynamo compiles into a graph of their own
    return ((x * c) @ w).sin().sum()


X, W = torch.randn(4, 3), torch.randn(3, 2)

# name -> (the composition made with a library, its arguments)
COMPOSITIONS = {
    "vmap(grad)": (lambda lib: lib.vmap(lib.grad(f, argnums=1), in_dims=(0, None)), (X, W)),
    "jacrev": (lambda lib: lib.jacrev(f, argnums=(0, 1)), (X, W)),
    "hessian": (lambda lib: lib.hessian(f), (X[0], W)),
    "vmap(jacfwd)": (lambda lib: lib.vmap(lib.jacfwd(f), in_dims=(0, None)), (X, W)),
    "jvp": (lambda lib: lambda x, w: lib.jvp(lambda x: f(x, w), (x,), (torch.ones_like(x),)),
            (X, W)),
    "vjp": (lambda lib: lambda x, w: lib.vjp(lambda w: f(x, w), w)[1](torch.tensor(1.0)),
            (X, W)),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_compiled_transform(name):
    make, args = COMPOSITIONS[name]
    compiled = torch.compile(make(tl), backend="eager")
    expected = make(tf)(*args)
    for _ in range(3):
        torch.testing.assert_close(compiled(*args), expected)


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_transform_inside_compiled_function(name, caplog):
    """Plain ops around the transform compile; the transform is a graph break. Called
    again with the same shapes, nothing recompiles (each call makes new level classes)."""
    make, args = COMPOSITIONS[name]

    def step(lib, x, w):
        out = make(lib)(x.cos(), w * 2)
        return torch.utils._pytree.tree_map(lambda t: t * 3, out)

    compiled = torch.compile(lambda x, w: step(tl, x, w), backend="eager")
    expected = step(tf, *args)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        for _ in range(10):
            torch.testing.assert_close(compiled(*args), expected)
    assert not [r for r in caplog.records if "recompile" in r.getMessage()]


def test_compiled_function_inside_transforms():
    compiled = torch.compile(f, backend="eager")
    expected = tf.vmap(tf.grad(f, argnums=1), in_dims=(0, None))(X, W)
    for _ in range(10):  # new level classes every call: dynamo gives up on f, quietly
        actual = tl.vmap(tl.grad(compiled, argnums=1), in_dims=(0, None))(X, W)
        torch.testing.assert_close(actual, expected)


def _draws(x):
    return x * torch.randn(3)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_compiled_random_op_inside_vmap_draws_as_the_plain_function(randomness):
    """Inside a transform a compiled function runs as the plain function, so it draws per
    vmap's randomness (compiled code would draw once for all examples)."""
    compiled = torch.compile(_draws, backend="eager")
    torch.manual_seed(0)
    out = tl.vmap(compiled, randomness=randomness)(X)
    torch.manual_seed(0)
    torch.testing.assert_close(out, tf.vmap(compiled, randomness=randomness)(X))
    torch.manual_seed(0)
    torch.testing.assert_close(out, tl.vmap(_draws, randomness=randomness)(X))


def test_compiled_random_op_inside_vmap_of_randomness_error_raises_vmaps_error():
    with pytest.raises(RuntimeError, match="called random operation while in randomness "
                       "error mode"):
        tl.vmap(torch.compile(_draws, backend="eager"))(X)


def _sin(x):
    return x.sin()


@pytest.mark.parametrize("transform", ["vmap", "grad", "vmap(grad)", "jacrev", "jvp"])
def test_fullgraph_compiled_function_inside_transforms(transform):
    """Dynamo cannot trace a level's tensors, and with fullgraph=True a graph break
    raises: inside a transform the compiled function runs eagerly, with torch.func's
    results (torch.func runs it too, but for jvp, where dynamo fails)."""
    make = {
        "vmap": lambda lib, g: lib.vmap(g),
        "grad": lambda lib, g: lib.grad(lambda x: g(x).sum()),
        "vmap(grad)": lambda lib, g: lib.vmap(lib.grad(lambda x: g(x).sum())),
        "jacrev": lambda lib, g: lib.jacrev(g),
        "jvp": lambda lib, g: lambda x: lib.jvp(g, (x,), (torch.ones_like(x),)),
    }[transform]
    compiled = torch.compile(_sin, backend="eager", fullgraph=True)
    for _ in range(3):
        torch.testing.assert_close(make(tl, compiled)(X), make(tf, _sin)(X))
    if transform != "jvp":
        torch.testing.assert_close(make(tl, compiled)(X), make(tf, compiled)(X))


def test_compiled_functions_compile_again_after_a_transform():
    """The eager stance is held only while a transform runs."""
    compiling = []

    def g(x):
        compiling.append(torch.compiler.is_compiling())
        return x.sin()

    compiled = torch.compile(g, backend="eager", fullgraph=True)
    tl.vmap(compiled)(X)
    compiled(X)
    assert compiling == [False, True]


_FRESH = """
import torch, torch.func as tf
{first}
def f(x, w):
    c = torch.arange(3.0).cos()
    return ((x * c) @ w).sin().sum()
x, w = torch.randn(4, 3), torch.randn(3, 2)
expected = tf.vmap(tf.grad(f, argnums=1), in_dims=(0, None))(x, w)
inside = tl.vmap(tl.grad(torch.compile(f), argnums=1), in_dims=(0, None))(x, w)
outside = torch.compile(tl.vmap(tl.grad(f, argnums=1), in_dims=(0, None)))(x, w)
torch.testing.assert_close(inside, expected)
torch.testing.assert_close(outside, expected)
print("ok")
"""


@pytest.mark.parametrize("first", ["import torchlevels as tl",
                                   "import torch._dynamo\nimport torchlevels as tl"])
def test_inductor_in_a_fresh_process(first, tmp_path):
    """Whether dynamo is imported before torchlevels or after (by torch.compile)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH.format(first=first))],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_relational_kernels_still_compile_whole(monkeypatch):
    """The skip rule leaves the relational queries' fused kernels to dynamo: one graph."""
    from torch._dynamo.utils import counters

    from torchlevels.dim import dims
    from torchlevels.relational import Table, _fuse, where

    monkeypatch.setattr(_fuse, "FUSE_MIN_ROWS", 0)
    _fuse._compiled.cache_clear()
    counters.clear()
    t = Table({"x": torch.rand(500, dtype=torch.float64), "d": torch.randint(0, 100, (500,))})
    R = dims(1)
    r = t[R]
    R2, kept = where((r["d"] < 50) & (r["x"] > 0.25), r)
    total = (kept["x"] * 2.0).sum(R2).item()
    x, d = t["x"].values, t["d"].values
    assert total == pytest.approx((x[(d < 50) & (x > 0.25)] * 2.0).sum().item(), rel=1e-12)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


class _Ensemble(torch.nn.Module):
    def forward(self, x, w):
        return tl.vmap(lambda v: (v @ w).sin())(x) * 2


def test_export_refuses_a_transform_and_exports_its_trace():
    module = _Ensemble()
    with pytest.raises(RuntimeError, match="torch.export cannot trace torchlevels' vmap.*"
                       "torchlevels.trace"):
        torch.export.export(module, (X, W), strict=False)
    graph = tl.trace(module)(X, W)
    exported = torch.export.export(graph, (X, W)).module()
    expected = tf.vmap(lambda v: (v @ W).sin())(X) * 2
    torch.testing.assert_close(exported(X, W)[0], expected)
