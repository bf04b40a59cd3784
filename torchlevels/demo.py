"""A short tour of torchlevels: run with `make demo`."""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
from torch.func import vmap as func_vmap

import torchlevels
from torchlevels import EscapedTensorError, count_flops, functional_call, grad, hessian, vmap
from torchlevels.dim import dims, softmax


def _ms(fn, *args, reps: int = 30) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def main() -> None:
    torch.manual_seed(0)
    print("1. vmap is a drop-in for torch.func.vmap")
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    ours, theirs = vmap(torch.dot)(x, y), func_vmap(torch.dot)(x, y)
    print(f"   vmap(torch.dot)(x, y) = {ours}")
    print(f"   equal to torch.func: {torch.allclose(ours, theirs)}")

    print("2. an MLP over a batch of single examples (weights unbatched)")
    w1, w2 = torch.randn(784, 256) / 28, torch.randn(256, 10) / 16
    mlp = lambda v: F.relu(v @ w1) @ w2
    batch = torch.randn(64, 784)
    same = torch.allclose(vmap(mlp)(batch), func_vmap(mlp)(batch), atol=1e-5)
    print(f"   same as torch.func: {same}; {_ms(vmap(mlp), batch):.2f} ms vs "
          f"{_ms(func_vmap(mlp), batch):.2f} ms for torch.func")

    print("3. levels are classes: the imperative API of the levels-as-classes note")
    xs, ys = torch.randn(10, 2), torch.randn(15, 2)
    with vmap() as B0, vmap() as B1:
        z = B0(xs) + B1(ys)
        print(f"   B1 subclasses B0: {issubclass(B1, B0)}; "
              f"B0.unwrap(B1.unwrap(x + y)).shape = {tuple(B0.unwrap(B1.unwrap(z)).shape)}")

    print("4. a tensor that escapes its vmap is caught, not silently mis-batched")
    box = []
    vmap(lambda v: box.append(v) or v)(torch.randn(10, 2))
    try:
        vmap(lambda v: box[0] + v)(torch.randn(20, 10, 2))
    except EscapedTensorError as e:
        print(f"   EscapedTensorError: {str(e)[:90]}...")

    print("5. randomness: 'different' draws per example, 'same' shares one draw")
    noise = lambda v: v + torch.randn(3)
    print(f"   different: rows equal? "
          f"{torch.equal(*vmap(noise, randomness='different')(torch.zeros(2, 3)))}")
    print(f"   same:      rows equal? "
          f"{torch.equal(*vmap(noise, randomness='same')(torch.zeros(2, 3)))}")

    print("6. autodiff levels compose with vmap and with each other")
    nested = grad(lambda a: a * grad(lambda b: a * b)(torch.tensor(1.0)))(torch.tensor(3.0))
    print(f"   grad(lambda x: x * grad(lambda y: x * y)(1.0))(3.0) = {nested.item()}")
    model = torch.nn.Linear(5, 2)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return F.mse_loss(functional_call(model, p, (xi,)), yi)

    xs, ys = torch.randn(8, 5), torch.randn(8, 2)
    ours = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    theirs = func_vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    print(f"   per-sample gradients, weight {tuple(ours['weight'].shape)}: equal to torch.func: "
          f"{all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)}")
    h = hessian(lambda v: (v ** 3).sum())(torch.tensor([1.0, 2.0]))
    print(f"   hessian((x ** 3).sum()) at [1, 2] = {h.tolist()}")

    print("7. an op without a rule still works, through a slow loop that warns once")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = lambda v: torch.histogram(v, bins=4, range=(0.0, 12.0)).hist
        out = vmap(hist)(torch.arange(12.).view(3, 4))
    print(f"   result {out.tolist()}; warning: {caught[0].message if caught else None}")

    print("8. tools are levels: where they sit decides what they see")
    w = torch.randn(16, 8)
    step = lambda w, x: (x @ w).tanh().sum()
    xs = torch.randn(32, 4, 16)
    outside = count_flops(vmap(grad(step), in_dims=(None, 0)))
    outside(w, xs)
    inside = count_flops(grad(step))
    vmap(inside, in_dims=(None, 0))(w, xs)
    print(f"   count_flops(vmap(grad(f))): {outside.total:,} FLOPs (batched, fwd + bwd); "
          f"vmap(count_flops(grad(f))): {inside.total:,} (one example)")

    print("9. compile: trace once through every level, replay the plain aten graph")
    chain = lambda v: (v.sin() * 2 + v.cos()).tanh().exp().sum()
    compiled = torchlevels.compile(vmap(grad(chain)))
    v = torch.randn(8, 16)
    same = torch.allclose(compiled(v), func_vmap(torch.func.grad(chain))(v))
    print(f"   same as torch.func: {same}; {_ms(compiled, v):.3f} ms replayed vs "
          f"{_ms(vmap(grad(chain)), v):.3f} ms eager vs "
          f"{_ms(func_vmap(torch.func.grad(chain)), v):.3f} ms torch.func")

    print("10. first-class dims: a product summed over a dim runs as one matmul")
    A, Bm = torch.randn(256, 256), torch.randn(256, 256)

    def mm(A, B):
        i, j, k = dims(3)
        return (A[i, k] * B[k, j]).sum(k).order(i, j)

    same = torch.allclose(mm(A, Bm), A @ Bm, atol=1e-4)
    print(f"   (A[i, k] * B[k, j]).sum(k) equals A @ B: {same}; "
          f"{_ms(mm, A, Bm):.3f} ms vs {_ms(torch.matmul, A, Bm):.3f} ms for A @ B")
    K, Q = torch.randn(2, 16, 10), torch.randn(2, 16, 12)
    batch, channel, key, query = dims(4)
    scores = softmax((K[batch, channel, key] * Q[batch, channel, query]).sum(channel), dim=key)
    ones = torch.allclose(scores.sum(key).order(batch, query), torch.ones(2, 12))
    print(f"   attention scores have dims {scores.dims}; they sum to 1 over key: {ones}")
    i, j = dims(sizes=[4, 4])
    triu = torch.equal(torch.where(i <= j, 1, 0).order(i, j), torch.ones(4, 4).triu().long())
    print(f"   a dim is the tensor of its indices: where(i <= j, 1, 0) is triu: {triu}")
    b = dims(1)
    w = torch.randn(3)
    loss = lambda w, e: (e * w).sum().tanh()
    per_example = grad(loss)(w, x[b]).order(b)
    same = torch.allclose(per_example, func_vmap(torch.func.grad(loss), (None, 0))(w, x))
    print(f"   grad(loss)(w, x[b]) is per-example, like vmap over b: {same}")

    _relational_demo()


def _relational_demo() -> None:
    """TPC-H Q1 at scale 0.01 (data from tpchgen-cli), checked against DuckDB."""
    import importlib.util
    import pathlib

    import duckdb

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "tpch.py"
    spec = importlib.util.spec_from_file_location("tpch", path)
    tpch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tpch)
    print("11. relational queries: TPC-H Q1 (filter, group by two keys, 8 aggregates)")
    folder = tpch.generate(0.01)
    tables = tpch.load(folder)
    tpch.run("q1", tables)  # the first call pays torch's one-time set-up
    start = time.perf_counter()
    result = tpch.run("q1", tables)
    took = (time.perf_counter() - start) * 1e3
    text = result.to_pandas().to_string(index=False, float_format="{:.2f}".format)
    print("   " + text.replace("\n", "\n   "))
    con = duckdb.connect()
    con.execute(f"create view lineitem as select * from '{folder}/lineitem.parquet'")
    theirs = con.execute(tpch.SQL["q1"]).fetchall()
    ours = [tuple(r.values()) for r in result.to_arrow().to_pylist()]
    same = len(ours) == len(theirs) and all(
        a == b if isinstance(a, str | int) else abs(a - float(b)) <= 1e-9 * abs(a)
        for r, t in zip(ours, theirs) for a, b in zip(r, t))
    print(f"   every row equals DuckDB's: {same}; {took:.1f} ms on "
          f"{tables['lineitem'].num_rows:,} line items")

if __name__ == "__main__":
    main()
