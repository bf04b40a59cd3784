"""compile and trace on the real workloads of test_workloads.py and
test_workloads_tutorials.py, against eager torch.func (or eager torchlevels where torch.func
raises) on the same inputs and seeds.

Each workload is compiled and called on new inputs of one signature (a trace, then
replays), then on other shapes and dtypes, and traced once and its graph replayed on the
inputs of its signature: per-sample gradients (MLP, CNN, batch norm in eval and, with
replace_all_batch_norm_modules_, in training mode), dropout under randomness "same" and
"different", ensembles (stack_module_state, dropout, training-mode batch norm), NTKs,
Hessian-vector products, MAML, forces, recurrent and transformer layers, linearize and
jvp. Then: running statistics written in place on every replay, autograd outside a
replay (inputs and captured parameters that require grad, a training loop), compile at
different depths, a frozen layer unfrozen, memory over many replays, and inductor.
Random compositions of small op chains are fuzzed in test_properties.py and
test_trace.py; this file runs whole programs.
"""

import copy
import gc

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
from test_workloads import (
    HVP,
    LOSSES,
    _loss_of,
    _recurrent,
    assert_tree_close,
    configurations,
    detached_params,
    dropout_model,
    ensemble_step,
    lennard_jones_energy,
    lennard_jones_pairs,
    make_cnn,
    make_mlp,
    maml_meta_grad,
    maml_setup,
    per_sample_grads,
)
from test_workloads_tutorials import (
    LINEARIZE,
    bn_model,
    call_ensemble,
    ensemble,
    jacobian_inputs,
    ntk_by_jacobians,
    ntk_by_products,
    ntk_net,
    predict,
    stacked,
)
from torch.utils._pytree import tree_flatten, tree_map

import torchlevels as tl


def cloned(tree):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def signature(tree) -> list:
    return [(t.shape, t.dtype) for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def assert_replays(make, calls, seed=None, backend=None):
    """``compile(make(tl))`` called twice on each argument tuple of ``calls``, and the graph
    of ``trace(make(tl))`` on the first replayed on each of the same signature, equal to
    ``make(tf)`` on clones of the arguments (written in place alike), drawing from ``seed``."""
    def seeded(run, args):
        if seed is not None:
            torch.manual_seed(seed)
        return run(args)

    def flat_replay(a):
        return list(gm(*(t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))))

    compiled = tl.compile(make(tl), backend=backend)
    gm = tl.trace(make(tl))(*cloned(calls[0]))
    for args in calls:
        theirs = cloned(args)
        expected = seeded(lambda a: make(tf)(*a), theirs)
        for _ in range(2):  # a trace (or a replay of an earlier one), then a replay
            ours = cloned(args)
            assert_tree_close(seeded(lambda a: compiled(*a), ours), expected)
            assert_tree_close(ours, theirs)  # in-place writes to the arguments
        if signature(args) == signature(calls[0]):
            ours = cloned(args)
            assert_tree_close(seeded(flat_replay, ours), tree_flatten(expected)[0])
            assert_tree_close(ours, theirs)
    return compiled


def _double(tree):
    return tree_map(lambda t: t.double() if t.is_floating_point() else t, tree)


# -- the workloads: name -> (make(lib) -> f, calls() -> argument tuples, seed) ----------------

def _per_sample(model, buffers=None, randomness="error"):
    return lambda lib: lambda p, x, y: per_sample_grads(lib, model, p, buffers or {}, x, y,
                                                        randomness)


def _mlp():
    torch.manual_seed(0)
    model = make_mlp()
    p = detached_params(model)
    batch = lambda n: (p, torch.randn(n, 10), torch.randint(0, 5, (n,)))
    return _per_sample(model), lambda: [batch(6), batch(6), batch(3)], None


def _cnn():
    torch.manual_seed(0)
    model = make_cnn()
    p = detached_params(model)
    batch = lambda n, s: (p, torch.randn(n, 1, s, s), torch.randint(0, 3, (n,)))
    return _per_sample(model), lambda: [batch(4, 10), batch(4, 10), batch(2, 12)], None


def _batch_norm_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 5))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    p, b = detached_params(model), dict(model.named_buffers())
    make = lambda lib: lambda p, b, x, y: per_sample_grads(lib, model, p, b, x, y)
    batch = lambda n: (p, b, torch.randn(n, 10), torch.randint(0, 5, (n,)))
    return make, lambda: [batch(5), batch(5)], None


def _batch_norm_replaced():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 2)).train()
    tl.replace_all_batch_norm_modules_(model)
    p = detached_params(model)

    def make(lib):
        loss = lambda p, x, y: F.cross_entropy(lib.functional_call(model, p, (x,)), y)
        return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))

    batch = lambda n: (p, torch.randn(n, 2, 1, 6, 6), torch.randint(0, 2, (n, 2)))
    return make, lambda: [batch(3), batch(3)], None


def _dropout(randomness):
    def workload():
        torch.manual_seed(0)
        model = dropout_model()
        p = detached_params(model)
        batch = lambda n: (p, torch.randn(n, 32), torch.randint(0, 4, (n,)))
        return _per_sample(model, randomness=randomness), lambda: [batch(4), batch(4)], 3
    return workload


def _ensemble_dropout(randomness, x_dim):
    def workload():
        models, base = ensemble(lambda: nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5),
                                                      nn.Linear(16, 2)))
        p, b = stacked(models)
        make = lambda lib: lambda p, b, x: call_ensemble(lib, base, p, b, x, x_dim, randomness)
        x = lambda: torch.randn(5, 4) if x_dim is None else torch.randn(3, 5, 4)
        return make, lambda: [(p, b, x()), (p, b, x())], 5
    return workload


def _ensemble_batch_norm_train():
    models, base = ensemble(bn_model)
    p, b = stacked(models)  # the running statistics are written in place, per model

    def make(lib):
        loss = lambda p, b, x: lib.functional_call(base, (p, b), (x,)).pow(2).sum()
        return lib.vmap(lib.grad(loss))

    return make, lambda: [(p, b, torch.randn(3, 5, 4)), (p, b, torch.randn(3, 5, 4))], None


def _ensemble_step():
    torch.manual_seed(0)
    p, b = tf.stack_module_state([make_mlp() for _ in range(3)])
    base = make_mlp().to("meta")
    batch = lambda n: (p, b, torch.randn(3, n, 10), torch.randint(0, 5, (3, n)))
    return lambda lib: ensemble_step(lib, base), lambda: [batch(4), batch(4), batch(2)], None


def _ntk(by):
    def workload():
        net = ntk_net()
        p = detached_params(net)
        if by == "jacobians":
            make = lambda lib: lambda p, a, b: ntk_by_jacobians(lib, net, p, a, b, "full")
        else:
            make = lambda lib: lambda p, a, b: ntk_by_products(lib, net, p, a, b)
        pair = lambda: (p, torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8))
        return make, lambda: [pair(), pair()], None
    return workload


def _hvp(mode, loss, per_example):
    def workload():
        hvp = lambda lib, x, v: HVP[mode](lib, LOSSES[loss], x, v)
        if per_example:
            make = lambda lib: lib.vmap(lambda x, v: hvp(lib, x, v))
            shapes = [(4, 8), (4, 8)]
        else:
            make = lambda lib: lambda x, v: hvp(lib, x, v)
            shapes = [(8,), (8,), (5,)]
        return make, lambda: [(torch.randn(s), torch.randn(s)) for s in shapes], None
    return workload


def _maml():
    net, p, tasks = maml_setup()
    make = lambda lib: lambda p, tasks: maml_meta_grad(lib, net, p, tasks)
    return make, lambda: [(p, tasks), (p, tuple(t * 0.5 for t in tasks))], None


def _forces(energy):
    def workload():
        calls = lambda: [(configurations(),), (configurations(),), (configurations(3, 5),),
                         (_double(configurations(2, 4)),)]
        return lambda lib: lib.vmap(lib.jacrev(energy)), calls, None
    return workload


def _recurrent_layer(layer):
    def workload():  # torch.func's vmap fails on these cells: jacrev per example instead
        _, out = _recurrent(layer)
        make = lambda lib: lambda x: lib.jacrev(_loss_of(out))(x)
        calls = lambda: [(torch.randn(5, 4, dtype=torch.float64),) for _ in range(2)]
        return make, calls, None
    return workload


def _transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.2, batch_first=True).double()
    p = detached_params(layer)

    def make(lib):
        loss = lambda p, x: (lib.functional_call(layer, p, (x[None],)) ** 2).sum()
        return lib.vmap(lib.grad(loss), in_dims=(None, 0), randomness="different")

    batch = lambda n, s: (p, torch.randn(n, s, 4, dtype=torch.float64))
    return make, lambda: [batch(3, 5), batch(3, 5), batch(2, 6)], 4


def _linearize(use):
    def workload():
        w, b, _ = jacobian_inputs()
        make = lambda lib: lambda x: LINEARIZE[use](lib, lambda x: predict(w, b, x), x)
        return make, lambda: [(torch.randn(16),), (torch.randn(16),)], None
    return workload


def _jvp_of_a_model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 10), nn.GELU(), nn.Linear(10, 2))
    p = detached_params(net)
    tangent = lambda: {k: torch.randn_like(v) for k, v in p.items()}

    def make(lib):
        return lambda p, t, x: lib.jvp(lambda q: lib.functional_call(net, q, (x,)), (p,), (t,))

    calls = lambda: [(p, tangent(), torch.randn(7, 4)), (p, tangent(), torch.randn(7, 4)),
                     (p, tangent(), torch.randn(2, 4))]
    return make, calls, None


WORKLOADS = {
    "per-sample grads, MLP": _mlp,
    "per-sample grads, CNN": _cnn,
    "per-sample grads, batch norm in eval mode": _batch_norm_eval,
    "per-sample grads, replace_all_batch_norm_modules_": _batch_norm_replaced,
    "dropout, randomness same": _dropout("same"),
    "dropout, randomness different": _dropout("different"),
    "ensemble with dropout, same": _ensemble_dropout("same", None),
    "ensemble with dropout, different, batched x": _ensemble_dropout("different", 0),
    "ensemble of training-mode batch norm": _ensemble_batch_norm_train,
    "ensemble training step": _ensemble_step,
    "NTK by Jacobians": _ntk("jacobians"),
    "NTK by products": _ntk("products"),
    **{f"HVP {mode}": _hvp(mode, "banded", False) for mode in HVP},
    "per-example HVP": _hvp("reverse-over-forward", "smooth", True),
    "MAML second order": _maml,
    "forces by vmap(jacrev), dense": _forces(lennard_jones_energy),
    "forces by vmap(jacrev), pairs": _forces(lennard_jones_pairs),
    **{f"jacrev of {layer}": _recurrent_layer(layer) for layer in ["GRU", "LSTM"]},
    "transformer layer with dropout": _transformer,
    "linearize, vmap(jvp_fn)": _linearize("vmap(jvp_fn)"),
    "jvp of a model in its parameters": _jvp_of_a_model,
}


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")  # torch.func's linearize
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_compile_and_trace_replay_the_workload_as_torch_func(name):
    make, calls, seed = WORKLOADS[name]()
    assert_replays(make, calls(), seed)


# -- state written in place: running statistics ------------------------------------------------

def test_running_statistics_update_in_place_on_every_replay():
    """Training-mode batch norm writes its running statistics on every call, eagerly and
    replayed: the module's own buffers (captured, under grad: torch.func refuses, eager
    torchlevels is the reference) and stacked ones (arguments)."""
    torch.manual_seed(0)
    bns = [nn.BatchNorm1d(3, momentum=0.3) for _ in range(2)]
    bns[1].load_state_dict(bns[0].state_dict())
    params = detached_params(bns[0])

    def step(lib, bn):
        return lib.grad(lambda p, x: lib.functional_call(bn, p, (x,)).pow(2).sum())

    models, base = ensemble(bn_model)
    (p, ours), (_, theirs) = stacked(models), stacked(models)
    compiled, compiled_ensemble = tl.compile(step(tl, bns[0])), tl.compile(
        lambda p, b, x: call_ensemble(tl, base, p, b, x, 0))
    for i in range(4):  # a trace, then replays
        x, xs = torch.randn(4, 3) * (i + 1), torch.randn(3, 5, 4) + i
        assert_tree_close(compiled(params, x), step(tl, bns[1])(params, x))
        assert_tree_close(dict(bns[0].named_buffers()), dict(bns[1].named_buffers()))
        assert_tree_close(compiled_ensemble(p, ours, xs), call_ensemble(tf, base, p, theirs, xs, 0))
        assert_tree_close(ours, theirs)
    assert int(bns[0].num_batches_tracked) == 4


# -- autograd outside a replay ---------------------------------------------------------------------

def test_a_training_loop_through_a_compiled_loss_trains_as_eager():
    """The model called directly (its parameters captured, requiring grad), with batch
    norm and dropout in training mode, a backward pass and an optimizer step per call."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Tanh(),
                            nn.Linear(8, 2))]
    models.append(copy.deepcopy(models[0]))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    losses = [lambda x, y, m=m: F.mse_loss(m(x), y) for m in models]
    losses[0] = tl.compile(losses[0])
    for i in range(4):
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        for loss, optimizer in zip(losses, optimizers):
            torch.manual_seed(i)
            loss(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert_tree_close(models[0].state_dict(), models[1].state_dict())


def _penalty_grads(lib, model, compiled):
    """Per-sample gradients of the model's own parameters (they require grad), their
    squared norm differentiated by autograd outside, three times."""
    xs, ys = torch.randn(5, 10), torch.randint(0, 5, (5,))
    f = lambda p, x, y: per_sample_grads(lib, model, p, {}, x, y)
    f = tl.compile(f) if compiled else f
    out = []
    for _ in range(3):
        model.zero_grad()
        g = f(dict(model.named_parameters()), xs, ys)
        sum(v.pow(2).sum() for v in g.values()).backward()
        out.append(([p.grad.clone() for p in model.parameters()],
                    {k: v.detach() for k, v in g.items()}))
    return out


def test_autograd_outside_per_sample_gradients_and_forces_as_eager():
    torch.manual_seed(0)
    model = make_mlp()
    torch.manual_seed(1)
    ours = _penalty_grads(tl, model, compiled=True)
    torch.manual_seed(1)
    assert_tree_close(ours, _penalty_grads(tf, model, compiled=False))

    def force_matching(lib, compiled, pos0):  # forces in positions that require grad
        forces = lib.vmap(lib.jacrev(lennard_jones_pairs))
        forces = tl.compile(forces) if compiled else forces
        out = []
        for scale in (1.0, 1.01):
            pos = (pos0 * scale).requires_grad_()
            f = forces(pos)
            out.append((f.detach(), torch.autograd.grad(f.pow(2).sum(), pos)[0]))
        return out

    pos = configurations()
    assert_tree_close(force_matching(tl, True, pos), force_matching(tf, False, pos))


def test_autograd_outside_a_recurrent_layer_whose_weights_require_grad():
    module, out = _recurrent("LSTM")
    f, compiled = tl.vmap(tl.grad(_loss_of(out))), tl.compile(tl.vmap(tl.grad(_loss_of(out))))
    xs = torch.randn(3, 5, 4, dtype=torch.float64)
    for i in range(2):
        grads = []
        for run in (compiled, f):
            module.zero_grad()
            run(xs + i).pow(2).sum().backward()
            grads.append([p.grad for p in module.parameters()])
        assert_tree_close(*grads)


# -- compile at different depths -------------------------------------------------------------

def test_compile_at_each_depth_of_a_composition():
    torch.manual_seed(0)
    model = make_mlp()
    params = detached_params(model)
    loss = lambda lib: lambda p, x, y: F.cross_entropy(
        lib.functional_call(model, p, (x[None],)), y[None])
    xs, ys = torch.randn(4, 10), torch.randint(0, 5, (4,))
    expected = tf.vmap(tf.grad(loss(tf)), in_dims=(None, 0, 0))(params, xs, ys)
    per_example = tl.compile(tl.grad(loss(tl)))  # grad inside compile, a Python loop outside
    inner = tl.compile(tl.vmap(tl.grad(loss(tl)), in_dims=(None, 0, 0)))
    variants = {
        "compile(vmap(grad))": inner,
        "vmap(grad) inside a compiled function": tl.compile(
            lambda p, x, y: tl.vmap(tl.grad(loss(tl)), in_dims=(None, 0, 0))(p, x, y)),
        "compile(grad), a loop of examples": lambda p, x, y: tree_map(
            lambda *g: torch.stack(g), *[per_example(p, xi, yi) for xi, yi in zip(x, y)]),
        "compile of a compiled function": tl.compile(lambda p, x, y: inner(p, x, y)),
    }
    for f in variants.values():
        for _ in range(2):
            assert_tree_close(f(params, xs, ys), expected)
    with pytest.raises(ValueError, match="rather than vmap.trace.f.."):  # documented
        tl.vmap(tl.compile(tl.grad(loss(tl))), in_dims=(None, 0, 0))(params, xs, ys)


def test_a_frozen_layer_unfrozen_traces_again():
    """Fine-tuning: a loss compiled while the layers are frozen, then unfrozen. The trace of
    frozen layers switched no grad mode for autograd: a replay recorded the target
    computed under no_grad, and its gradients were wrong."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    head = nn.Linear(8, 2)

    def loss(x):
        with torch.no_grad():
            target = head(x).tanh()  # a constant for autograd
        return F.mse_loss(head(layer(x)), target)

    compiled, x = tl.compile(loss), torch.randn(2, 5, 8)
    for trainable in (False, True, False, True):
        layer.requires_grad_(trainable)
        head.requires_grad_(trainable)
        got = compiled(x)
        torch.testing.assert_close(got, loss(x))
        assert got.requires_grad is trainable
        if trainable:
            params = [*layer.parameters(), *head.parameters()]
            assert_tree_close(torch.autograd.grad(got, params),
                              torch.autograd.grad(loss(x), params))
    assert sum(map(len, compiled.cache.values())) == 2


# -- memory and inductor -----------------------------------------------------------------------

def test_replays_keep_memory_flat():
    """Many replays, with random ops and autograd outside, leave no Python objects behind
    (no level classes, graphs or tensors kept per call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
    head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    input_grads = tl.vmap(tl.grad(lambda xi: head(xi).sum()))
    compiled = tl.compile(lambda x: model(x).pow(2).mean() + input_grads(x).pow(2).sum())
    x = torch.randn(6, 4)

    def calls(n):
        for _ in range(n):
            compiled(x).backward()

    calls(20)  # PyTorch's own caches fill on the first calls
    gc.collect()
    before = len(gc.get_objects())
    calls(150)  # a leak of one object per call would show
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert sum(map(len, compiled.cache.values())) == 1


def test_inductor_replays_random_ops_running_statistics_and_autograd_outside_as_eager():
    """backend="inductor" on three workloads: per-example dropout (fresh numbers on every
    call, eager's for a seed), batch norm's statistics written in place, and a penalty on
    per-example input gradients trained by autograd outside."""
    pytest.importorskip("torch._inductor")
    w = torch.randn(16)
    dropout = lambda lib: lib.vmap(lib.grad(lambda w, x: (F.dropout(x, 0.5) * w).sin().sum()),
                                   in_dims=(None, 0), randomness="different")
    assert_replays(dropout, [(w, torch.randn(4, 16))] * 3, seed=0, backend="inductor")
    compiled = tl.compile(dropout(tl), backend="inductor")
    assert not torch.equal(compiled(w, torch.ones(4, 16)), compiled(w, torch.ones(4, 16)))

    models, base = ensemble(bn_model)
    p, b = stacked(models)  # the same buffers, written on every call
    ensemble_forward = lambda lib: lambda p, b, x: call_ensemble(lib, base, p, b, x, 0)
    assert_replays(ensemble_forward, [(p, b, torch.randn(3, 5, 4))] * 2, backend="inductor")

    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1, bias=False))]
    nets.append(copy.deepcopy(nets[0]))
    penalty = [lambda x, m=m: tl.vmap(tl.grad(lambda xi: m(xi).sum()))(x).pow(2).sum()
               for m in nets]
    penalty[0] = tl.compile(penalty[0], backend="inductor")
    for i in range(2):
        for net, f in zip(nets, penalty):
            net.zero_grad()
            f(torch.randn(6, 4, generator=torch.Generator().manual_seed(i))).backward()
        assert_tree_close([q.grad for q in nets[0].parameters()],
                          [q.grad for q in nets[1].parameters()])
