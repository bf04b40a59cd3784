"""Real workloads, each run with torchlevels and with torch.func on the same inputs and seeds.

Per-sample gradients (MLP, CNN, batch norm in eval mode, dropout), model ensembling,
Hessian-vector products, second-order MAML and molecular forces.
"""

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from vmap_reference import seeded

import torchlevels as tl


def assert_tree_close(actual, expected, **kwargs):
    flat_a, spec_a = tree_flatten(actual)
    flat_e, spec_e = tree_flatten(expected)
    assert spec_a == spec_e, f"structure differs:\n{spec_a}\nvs torch.func's\n{spec_e}"
    for a, e in zip(flat_a, flat_e):
        assert type(a) is torch.Tensor, type(a)
        torch.testing.assert_close(a, e, **kwargs)


def detached_params(model: nn.Module) -> dict:
    return {k: v.detach() for k, v in model.named_parameters()}


def per_sample_grads(lib, model, params, buffers, xs, ys, randomness="error"):
    """The torch.func tutorial's recipe: vmap(grad(loss), in_dims=(None, 0, 0))."""

    def loss(p, x, y):
        out = lib.functional_call(model, (p, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0), randomness=randomness)(
        params, xs, ys)


def loop_per_sample_grads(model, xs, ys):
    """torch.autograd, one example at a time: an independent reference."""
    grads = []
    for x, y in zip(xs, ys):
        model.zero_grad()
        F.cross_entropy(model(x.unsqueeze(0)), y.unsqueeze(0)).backward()
        grads.append({k: v.grad.clone() for k, v in model.named_parameters()})
    return {k: torch.stack([g[k] for g in grads]) for k in grads[0]}


# -- per-sample gradients -------------------------------------------------------------

def make_mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 5))


def make_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(6 * 2 * 2, 3),
    )


def test_per_sample_grads_mlp():
    model = make_mlp()
    params = detached_params(model)
    xs, ys = torch.randn(8, 10), torch.randint(0, 5, (8,))
    ours = per_sample_grads(tl, model, params, {}, xs, ys)
    assert_tree_close(ours, per_sample_grads(tf, model, params, {}, xs, ys))
    assert_tree_close(ours, loop_per_sample_grads(model, xs, ys))
    assert ours["0.weight"].shape == (8, 32, 10)


def test_per_sample_grads_cnn():
    model = make_cnn()
    params = detached_params(model)
    xs, ys = torch.randn(6, 1, 10, 10), torch.randint(0, 3, (6,))
    ours = per_sample_grads(tl, model, params, {}, xs, ys)
    assert_tree_close(ours, per_sample_grads(tf, model, params, {}, xs, ys))
    assert ours["0.weight"].shape == (6, 4, 1, 3, 3)


def test_per_sample_grads_and_loss_with_grad_and_value():
    model = make_mlp()
    params = detached_params(model)
    xs, ys = torch.randn(5, 10), torch.randint(0, 5, (5,))

    def run(lib):
        def loss(p, x, y):
            return F.cross_entropy(lib.functional_call(model, p, (x[None],)), y[None])

        return lib.vmap(lib.grad_and_value(loss), in_dims=(None, 0, 0))(params, xs, ys)

    assert_tree_close(run(tl), run(tf))


def test_per_sample_grads_batch_norm_eval():
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 5))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.normal_()
    model.eval()
    params = detached_params(model)
    buffers = dict(model.named_buffers())
    before = {k: v.clone() for k, v in buffers.items()}
    xs, ys = torch.randn(7, 10), torch.randint(0, 5, (7,))
    ours = per_sample_grads(tl, model, params, buffers, xs, ys)
    assert_tree_close(ours, per_sample_grads(tf, model, params, buffers, xs, ys))
    assert_tree_close(ours, loop_per_sample_grads(model, xs, ys))
    assert_tree_close(dict(model.named_buffers()), before)  # eval mode: stats untouched


def test_per_sample_grads_cnn_batch_norm_eval():
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 6 * 6, 2))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    params, buffers = detached_params(model), dict(model.named_buffers())
    xs, ys = torch.randn(4, 1, 8, 8), torch.randint(0, 2, (4,))
    assert_tree_close(per_sample_grads(tl, model, params, buffers, xs, ys),
                      per_sample_grads(tf, model, params, buffers, xs, ys))


# -- dropout under vmap(grad) ---------------------------------------------------------

def dropout_model():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    model.train()
    return model


def test_dropout_error_mode_raises_like_torch_func():
    model = dropout_model()
    params = detached_params(model)
    xs, ys = torch.randn(4, 32), torch.randint(0, 4, (4,))
    with pytest.raises(RuntimeError, match="randomness") as theirs:
        per_sample_grads(tf, model, params, {}, xs, ys)
    with pytest.raises(type(theirs.value), match="randomness"):
        per_sample_grads(tl, model, params, {}, xs, ys)


def test_dropout_randomness_same_matches_torch_func_with_a_seed():
    model = dropout_model()
    params = detached_params(model)
    xs, ys = torch.randn(6, 32), torch.randint(0, 4, (6,))
    torch.manual_seed(123)
    ours = per_sample_grads(tl, model, params, {}, xs, ys, randomness="same")
    torch.manual_seed(123)
    theirs = per_sample_grads(tf, model, params, {}, xs, ys, randomness="same")
    assert_tree_close(ours, theirs)


def test_dropout_randomness_same_uses_one_mask_for_the_batch():
    w = torch.randn(256)
    xs = torch.randn(8, 256)
    torch.manual_seed(0)
    g = tl.vmap(tl.grad(lambda w, x: (F.dropout(x, 0.5) * w).sum()), in_dims=(None, 0),
                randomness="same")(w, xs)
    kept = g != 0
    assert g.shape == (8, 256)
    assert (kept == kept[0]).all()
    torch.testing.assert_close(g[kept], 2 * xs[kept])


def test_dropout_randomness_different_statistics():
    w = torch.randn(512)
    xs = torch.randn(16, 512)

    def run(lib):
        f = lambda w, x: (F.dropout(x, 0.25) * w).sum()
        return lib.vmap(lib.grad(f), in_dims=(None, 0), randomness="different")(w, xs)

    torch.manual_seed(0)
    ours = run(tl)
    torch.manual_seed(0)
    theirs = run(tf)
    assert ours.shape == theirs.shape == (16, 512)
    kept = ours != 0
    torch.testing.assert_close(ours[kept], xs[kept] / 0.75)  # scaled by 1 / (1 - p)
    rate = kept.float().mean(1)
    assert ((rate > 0.65) & (rate < 0.85)).all()  # about 75% kept in every example
    assert not (kept == kept[0]).all(1).all()  # the examples' masks differ
    torch.testing.assert_close(rate.mean(), (theirs != 0).float().mean(), atol=0.03, rtol=0)


def test_dropout_module_randomness_different_per_sample_grads():
    model = dropout_model()
    params = detached_params(model)
    xs, ys = torch.randn(16, 32), torch.randint(0, 4, (16,))
    torch.manual_seed(1)
    ours = per_sample_grads(tl, model, params, {}, xs, ys, randomness="different")
    torch.manual_seed(1)
    theirs = per_sample_grads(tf, model, params, {}, xs, ys, randomness="different")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    # a dropped hidden unit has a zero column in the last layer's per-sample gradient
    dropped = (ours["3.weight"] == 0).all(1).float().mean()
    dropped_f = (theirs["3.weight"] == 0).all(1).float().mean()
    assert 0.3 < dropped < 0.85 and abs(dropped - dropped_f) < 0.2


# -- model ensembling -----------------------------------------------------------------

def test_ensemble_of_mlps_with_stack_module_state():
    models = [make_mlp() for _ in range(4)]
    params, buffers = tl.stack_module_state(models)
    params_f, buffers_f = tf.stack_module_state(models)
    assert_tree_close(params, params_f)
    base = make_mlp().to("meta")
    xs = torch.randn(6, 10)
    minibatches = torch.randn(4, 6, 10)

    def run(lib, x, x_dim):
        call = lambda p, b, x: lib.functional_call(base, (p, b), (x,))
        return lib.vmap(call, in_dims=(0, 0, x_dim))(params, buffers, x)

    same = run(tl, xs, None)
    assert_tree_close(same, run(tf, xs, None))
    assert_tree_close(same, torch.stack([m(xs) for m in models]).detach())
    assert_tree_close(run(tl, minibatches, 0), run(tf, minibatches, 0))


def ensemble_step(lib, base: nn.Module):
    """Gradients and losses of a stacked ensemble of ``base`` models, one minibatch each."""
    def loss(p, b, x, y):
        return F.cross_entropy(lib.functional_call(base, (p, b), (x,)), y)

    return lib.vmap(lib.grad_and_value(loss))


def test_ensemble_training_step_grads():
    models = [make_mlp() for _ in range(4)]
    params, buffers = tf.stack_module_state(models)
    base = make_mlp().to("meta")
    xs, ys = torch.randn(4, 6, 10), torch.randint(0, 5, (4, 6))
    assert_tree_close(ensemble_step(tl, base)(params, buffers, xs, ys),
                      ensemble_step(tf, base)(params, buffers, xs, ys))


# -- Hessian-vector products ----------------------------------------------------------

def smooth_loss(x):
    return (x.sin() * x.roll(1)).sum() + (x ** 4).sum() / 4 + x.exp().sum()


def banded_loss(x):
    """Couples neighbours through slices (views) of the input."""
    return (x[:-1] * x[1:]).exp().sum() + (x[1:] - x[:-1]).pow(2).sum()


LOSSES = {"smooth": smooth_loss, "banded": banded_loss}

HVP = {
    "forward-over-reverse": lambda lib, f, x, v: lib.jvp(lib.grad(f), (x,), (v,))[1],
    "reverse-over-reverse": lambda lib, f, x, v: lib.vjp(lib.grad(f), x)[1](v)[0],
    "reverse-over-forward": lambda lib, f, x, v: lib.grad(
        lambda y: lib.jvp(f, (y,), (v,))[1])(x),
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", list(HVP))
def test_hessian_vector_product(mode, loss):
    f = LOSSES[loss]
    x, v = torch.randn(8), torch.randn(8)
    ours = HVP[mode](tl, f, x, v)
    assert_tree_close(ours, HVP[mode](tf, f, x, v))
    torch.testing.assert_close(ours, tf.hessian(f)(x) @ v)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", list(HVP))
def test_hessian_vector_products_for_a_batch_of_vectors(mode, loss):
    x, vs = torch.randn(8), torch.randn(5, 8)
    run = lambda lib: lib.vmap(lambda v: HVP[mode](lib, LOSSES[loss], x, v))(vs)
    assert_tree_close(run(tl), run(tf))


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", list(HVP))
def test_per_example_hessian_vector_products(mode, loss):
    xs, vs = torch.randn(5, 8), torch.randn(5, 8)
    run = lambda lib: lib.vmap(lambda x, v: HVP[mode](lib, LOSSES[loss], x, v))(xs, vs)
    assert_tree_close(run(tl), run(tf))


def test_hvp_of_an_mlp_loss_over_parameters():
    model = make_mlp()
    params = detached_params(model)
    xs, ys = torch.randn(8, 10), torch.randint(0, 5, (8,))
    vs = {k: torch.randn_like(v) for k, v in params.items()}

    def run(lib):
        loss = lambda p: F.cross_entropy(lib.functional_call(model, p, (xs,)), ys)
        return lib.jvp(lib.grad(loss), (params,), (vs,))

    assert_tree_close(run(tl), run(tf))


# -- second-order MAML ----------------------------------------------------------------

def maml_meta_grad(lib, net, params, tasks, inner_lr=0.1, steps=2, first_order=False):
    """Outer gradient of the query loss after ``steps`` inner SGD steps, over a batch of tasks."""

    def loss(p, x, y):
        return F.mse_loss(lib.functional_call(net, p, (x,)), y)

    def task_loss(p, xs, ys, xq, yq):
        for _ in range(steps):
            g = lib.grad(loss)(p, xs, ys)
            if first_order:
                g = {k: v.detach() for k, v in g.items()}
            p = {k: p[k] - inner_lr * g[k] for k in p}
        return loss(p, xq, yq)

    def meta_loss(p):
        return lib.vmap(task_loss, in_dims=(None, 0, 0, 0, 0))(p, *tasks).mean()

    return lib.grad_and_value(meta_loss)(params)


def maml_setup():
    net = nn.Sequential(nn.Linear(1, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                        nn.Linear(24, 1))
    params = detached_params(net)
    amp, phase = torch.rand(3, 1, 1) * 4 + 1, torch.rand(3, 1, 1) * 3
    xs, xq = torch.rand(3, 10, 1) * 10 - 5, torch.rand(3, 10, 1) * 10 - 5
    tasks = (xs, amp * torch.sin(xs + phase), xq, amp * torch.sin(xq + phase))
    return net, params, tasks


def test_maml_second_order_meta_gradient():
    net, params, tasks = maml_setup()
    ours = maml_meta_grad(tl, net, params, tasks)
    theirs = maml_meta_grad(tf, net, params, tasks)
    assert_tree_close(ours, theirs)
    first_order = maml_meta_grad(tf, net, params, tasks, first_order=True)
    assert any(not torch.allclose(a, b) for a, b in zip(tree_flatten(ours[0])[0],
                                                         tree_flatten(first_order[0])[0]))


def test_maml_meta_gradient_matches_torch_autograd_loop():
    net, params, tasks = maml_setup()
    grads, _ = maml_meta_grad(tl, net, params, tasks, steps=1)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    total = 0
    for xs, ys, xq, yq in zip(*tasks):
        inner = F.mse_loss(torch.func.functional_call(net, leaves, (xs,)), ys)
        g = torch.autograd.grad(inner, list(leaves.values()), create_graph=True)
        fast = {k: v - 0.1 * gk for (k, v), gk in zip(leaves.items(), g)}
        total = total + F.mse_loss(torch.func.functional_call(net, fast, (xq,)), yq)
    expected = torch.autograd.grad(total / 3, list(leaves.values()))
    assert_tree_close(grads, dict(zip(leaves, expected)))


def test_maml_first_order_matches_torch_func():
    net, params, tasks = maml_setup()
    assert_tree_close(maml_meta_grad(tl, net, params, tasks, first_order=True),
                      maml_meta_grad(tf, net, params, tasks, first_order=True))


# -- molecular forces -----------------------------------------------------------------

def lennard_jones_energy(pos, sigma=1.0, epsilon=1.0):
    """Total pairwise 12-6 energy of one configuration (atoms, 3)."""
    n = pos.shape[0]
    diff = pos[:, None, :] - pos[None, :, :]
    r2 = (diff ** 2).sum(-1) + torch.eye(n)  # the diagonal is masked out below
    s6 = (sigma ** 2 / r2) ** 3
    pair = 4 * epsilon * (s6 ** 2 - s6)
    return torch.triu(pair, diagonal=1).sum()


def lennard_jones_pairs(pos):
    i, j = torch.triu_indices(pos.shape[0], pos.shape[0], 1)
    r = (pos[i] - pos[j]).norm(dim=-1)
    return (4 * ((1 / r) ** 12 - (1 / r) ** 6)).sum()


def configurations(batch=4, atoms=6):
    lattice = torch.stack(torch.meshgrid(torch.arange(2.0), torch.arange(3.0), torch.arange(1.0),
                                         indexing="ij"), -1).reshape(-1, 3)[:atoms] * 1.2
    return lattice + 0.1 * torch.randn(batch, atoms, 3)


@pytest.mark.parametrize("energy", [lennard_jones_energy, lennard_jones_pairs])
def test_forces_by_vmap_jacrev(energy):
    pos = configurations()
    ours = -tl.vmap(tl.jacrev(energy))(pos)
    assert_tree_close(ours, -tf.vmap(tf.jacrev(energy))(pos))
    assert ours.shape == pos.shape
    torch.testing.assert_close(ours.sum(1), torch.zeros(4, 3), atol=1e-4, rtol=0)  # Newton III


@pytest.mark.parametrize("energy", [lennard_jones_energy, lennard_jones_pairs])
def test_forces_and_energies_by_vmap_grad_and_value(energy):
    pos = configurations()
    assert_tree_close(tl.vmap(tl.grad_and_value(energy))(pos),
                      tf.vmap(tf.grad_and_value(energy))(pos))


def test_force_constants_by_vmap_hessian():
    pos = configurations(batch=2, atoms=4)
    ours = tl.vmap(tl.hessian(lennard_jones_energy))(pos)
    assert_tree_close(ours, tf.vmap(tf.hessian(lennard_jones_energy))(pos))
    assert ours.shape == (2, 4, 3, 4, 3)


def test_per_atom_force_jacobian_by_jacfwd_of_forces():
    pos = configurations(batch=2, atoms=4)
    force = lambda lib: lambda p: -lib.grad(lennard_jones_pairs)(p)
    assert_tree_close(tl.vmap(tl.jacfwd(force(tl)))(pos), tf.vmap(tf.jacfwd(force(tf)))(pos))


@pytest.mark.parametrize("order", ["grad of per-sample grads", "jacrev over the inputs",
                                   "per-sample hessians"])
def test_second_order_through_per_sample_conv_gradients(order):
    """Per-sample conv weight gradients skip copying the shared weight (the kernel reads
    only its shape): derivatives of those gradients must not see the difference."""
    w = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    xs = torch.randn(5, 2, 7, 7, dtype=torch.float64)
    loss = lambda w, x: (F.conv2d(x.unsqueeze(0), w).tanh() ** 2).sum()
    per_sample = lambda lib: lib.vmap(lib.grad(loss), in_dims=(None, 0))
    run = {
        "grad of per-sample grads": lambda lib: lib.grad(
            lambda w: (per_sample(lib)(w, xs) ** 2).sum())(w),
        "jacrev over the inputs": lambda lib: lib.jacrev(lambda x: per_sample(lib)(w, x))(xs),
        "per-sample hessians": lambda lib: lib.vmap(lib.hessian(loss), in_dims=(None, 0))(w, xs),
    }[order]
    assert_tree_close(run(tl), run(tf))


# -- recurrent layers and float32 kernels -----------------------------------------------

@pytest.mark.parametrize("layer", ["GRU", "LSTM", "RNN", "GRUCell", "LSTMCell"])
@pytest.mark.parametrize("transform", ["grad", "jacrev", "jacfwd", "hessian"])
def test_derivatives_of_a_recurrent_layer_with_respect_to_its_input(layer, transform):
    # the decomposed GRU adds the input's gates into the hidden state's in place, and those
    # are made from captured tensors only (the zero state, the weights)
    torch.manual_seed(0)
    module = getattr(torch.nn, layer)(4, 3)
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = torch.randn(5, 4)

    def loss(xi):
        out = tf.functional_call(module, params, (xi,))
        out = out[0] if isinstance(out, tuple) else out
        return (out ** 2).sum()

    forward_ad = transform in ("jacfwd", "hessian")
    if forward_ad and (layer == "LSTM" or x.is_cuda and layer in ("GRU", "GRUCell", "LSTMCell")):
        # torch.func raises: PyTorch has no forward AD for oneDNN's LSTM layer kernel, or
        # CUDA's fused cells, which levels do not take. torch.autograd's functional API is
        # the reference
        reference = {"jacfwd": torch.autograd.functional.jacobian,
                     "hessian": torch.autograd.functional.hessian}[transform]
        expected = reference(loss, x)
    else:
        expected = getattr(tf, transform)(loss)(x)
    torch.testing.assert_close(getattr(tl, transform)(loss)(x), expected)


RECURRENT = ["GRU", "LSTM", "RNN", "GRUCell", "LSTMCell", "RNNCell"]


@pytest.fixture(autouse=True)
def _no_cudnn_for_recurrent_references(request):
    """On CUDA, the references (torch.func, autograd's double backward) cannot go through
    cuDNN's RNN kernel, which torchlevels never takes under a level: they run without."""
    names = ("recurrent", "gru", "lstm", "rnn")
    with torch.backends.cudnn.flags(enabled=not any(n in request.node.name.lower()
                                                    for n in names)):
        yield


def _recurrent(layer):
    """The layer and its output (the output sequence, or the cell's new hidden state)."""
    torch.manual_seed(0)
    module = getattr(torch.nn, layer)(4, 3).double()

    def out(x):
        y = module(x)
        return y[0] if isinstance(y, tuple) else y

    return module, out


def _loss_of(out):
    return lambda x: (out(x) ** 2).sum()


@pytest.mark.parametrize("layer", RECURRENT)
@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)", "vmap(jacfwd)", "vmap(jacrev)"])
def test_recurrent_layers_per_example_match_a_loop(layer, transform):
    # the cells start from an unbatched zero state that the decomposed op writes batched
    # gates into in place: they run out of place under levels. torch.func fails on several
    # of these (a broadcast shape error), so the reference is a loop with torch.autograd
    _, out = _recurrent(layer)
    xs = torch.randn(3, 5, 4, dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian
    ours, per_example = {
        "vmap": (tl.vmap(_loss_of(out)), _loss_of(out)),
        "vmap(grad)": (tl.vmap(tl.grad(_loss_of(out))),
                       lambda x: jacobian(_loss_of(out), x)),
        "vmap(jacfwd)": (tl.vmap(tl.jacfwd(out)), lambda x: jacobian(out, x)),
        "vmap(jacrev)": (tl.vmap(tl.jacrev(out)), lambda x: jacobian(out, x)),
    }[transform]
    torch.testing.assert_close(ours(xs), torch.stack([per_example(x) for x in xs]))


@pytest.mark.parametrize("layer", RECURRENT)
@pytest.mark.parametrize("transform", ["jacrev", "hessian"])
def test_a_recurrent_layer_whose_weights_require_grad(layer, transform):
    # weights that require grad (a module's default) make the transforms record their
    # backward for autograd outside, through the layer's own backward formulas
    _, out = _recurrent(layer)
    x = torch.randn(5, 4, dtype=torch.float64)
    if transform == "jacrev":
        ours, theirs = tl.jacrev(out)(x), tf.jacrev(out)(x)
    else:  # torch.func's hessian (forward over reverse) raises for the LSTM
        ours, theirs = tl.hessian(_loss_of(out))(x), tf.jacrev(tf.jacrev(_loss_of(out)))(x)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("layer", RECURRENT)
def test_autograd_outside_through_per_example_input_gradients_of_a_recurrent_layer(layer):
    # the layer's weights require grad: they enter the grad level as constants that keep
    # their history, so a penalty on the input gradients trains them
    module, out = _recurrent(layer)
    xs = torch.randn(3, 5, 4, dtype=torch.float64)
    penalty = lambda g: (g ** 2).sum()
    (penalty(tl.vmap(tl.grad(_loss_of(out)))(xs))).backward()
    ours = [p.grad for p in module.parameters()]
    module.zero_grad()
    rows = [torch.autograd.grad(_loss_of(out)(x), x, create_graph=True)[0]
            for x in xs.clone().requires_grad_().unbind(0)]
    penalty(torch.stack(rows)).backward()
    torch.testing.assert_close(ours, [p.grad for p in module.parameters()])


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian"])
def test_gelu_in_float32(transform):
    # float32 gelu_backward on the CPU (oneDNN) rejects a broadcast argument, which the
    # batched cotangents of jacrev give it
    x = torch.randn(6)
    f = lambda a: (torch.nn.functional.gelu(a) ** 2).sum()
    torch.testing.assert_close(getattr(tl, transform)(f)(x), getattr(tf, transform)(f)(x))


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap(grad)"])
def test_an_eval_mode_transformer_layer_differentiates_with_respect_to_its_input(transform):
    # in eval mode it takes a fused inference kernel without derivatives when no argument
    # requires grad, and a level's tensors never do: levels turn that fast path off (jvp
    # is left out: PyTorch's CPU attention has no forward AD, torch.func raises too)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    params = {k: v.detach() for k, v in layer.named_parameters()}
    x = torch.randn(2, 5, 8)

    def run(lib):
        f = lambda xi: lib.functional_call(layer, params, (xi.unsqueeze(0),)).square().mean()
        if transform == "vmap(grad)":
            return lib.vmap(lib.grad(f))(x)
        return getattr(lib, transform)(f)(x[0])

    assert_tree_close(run(tl), run(tf))
    assert torch.backends.mha.get_fastpath_enabled()  # PyTorch's switch is back on


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_linear_cross_entropy_gradients(reduction):
    # its chunked path (options=) is told which gradients to compute from requires_grad,
    # which a grad level's tensors did not report: it returned zero gradients. torch.func
    # refuses the path, so the reference is torch.func on the unchunked one (same math)
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 6), torch.randn(5, 6), torch.randn(5)
    t = torch.randint(0, 5, (8,))
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=3)

    def f(xi, wi, bi, opts):
        return F.linear_cross_entropy(xi, wi, t, linear_bias=bi, reduction=reduction,
                                      options=opts).sum()

    assert_tree_close(tl.grad(f, argnums=(0, 1, 2))(x, w, b, options),
                      tf.grad(f, argnums=(0, 1, 2))(x, w, b, None))
    per_example = lambda lib, opts: lib.vmap(lib.grad(
        lambda xi, ti: F.linear_cross_entropy(xi, w, ti, options=opts)))(x, t)
    assert_tree_close(per_example(tl, options), per_example(tf, None))


def test_chunked_linear_cross_entropy_of_a_weight_only_an_outer_grad_tracks():
    """A tensor of the inner grad level that depends on the outer level's input but not on
    the inner one's says requires_grad=False, as in torch.func: the inner level still tells
    the op to compute that gradient, which the outer level needs (it was silently zero)."""
    torch.manual_seed(0)
    x, w, t = torch.randn(5, 3), torch.randn(4, 3), torch.randint(0, 4, (5,))
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=2)

    def loss_seen_inside(w):
        def inner(s):
            z = torch.zeros_like(s) + w  # the inner level's, tracked only by the outer one
            assert not z.requires_grad
            return s * 2, F.linear_cross_entropy(x, z, t, options=options)
        return tl.grad(inner, has_aux=True)(torch.tensor(1.0))[1]

    assert_tree_close(tl.grad(loss_seen_inside)(w),
                      tf.grad(lambda w: F.cross_entropy(x @ w.T, t))(w))


# -- gradient penalties: autograd through per-example input gradients into the weights ----


def _critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.LeakyReLU(0.2), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 8), nn.Tanh(), nn.Linear(8, 1)).double()


PENALTIES = {
    # WGAN-GP: each example's input gradient should have norm 1
    "wgan-gp": lambda lib, critic, xs: ((lib.vmap(lib.grad(
        lambda x: critic(x.unsqueeze(0)).squeeze()))(xs).flatten(1).norm(dim=1) - 1) ** 2).mean(),
    # curvature along a direction: a Hessian-vector product of the critic per example
    "hvp": lambda lib, critic, xs: (lib.vmap(lambda x: lib.jvp(lib.grad(
        lambda z: critic(z.unsqueeze(0)).squeeze()), (x,), (torch.ones_like(x),))[1])(xs)
    ** 2).sum(),
}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_gradient_penalty_trains_the_critic_as_torch_func(penalty):
    critic = _critic()
    xs = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    grads = []
    for lib in (tl, tf):
        critic.zero_grad()
        PENALTIES[penalty](lib, critic, xs).backward()
        grads.append([p.grad for p in critic.parameters()])
    assert grads[1][0] is not None
    for ours, theirs in zip(*grads):
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(ours, theirs)


def test_grad_of_a_training_mode_batch_norm_is_a_training_step():
    # torch.func refuses (the kernel updates the running statistics in place); torchlevels
    # gives plain autograd's gradients and updates the statistics as a training step does
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3)
    x = torch.randn(4, 3)
    ours_buffers = {k: v.clone() for k, v in bn.named_buffers()}
    params = {k: v.detach() for k, v in bn.named_parameters()}
    ours = tl.grad(lambda p: tl.functional_call(bn, (p, ours_buffers), (x,)).pow(2).sum())(params)
    ref_buffers = {k: v.clone() for k, v in bn.named_buffers()}
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    out = tf.functional_call(bn, (leaves, ref_buffers), (x,)).pow(2).sum()
    expected = torch.autograd.grad(out, list(leaves.values()))
    torch.testing.assert_close(ours, dict(zip(leaves, expected)))
    torch.testing.assert_close(ours_buffers, ref_buffers)
    assert int(ours_buffers["num_batches_tracked"]) == 1


# -- attention: per-example gradients through the CPU flash-attention kernel ---------------


@pytest.mark.parametrize("variant", ["plain", "causal", "mask", "shared key and value"])
def test_per_example_gradients_of_attention_match_torch_func(variant):
    # 4-d inputs take the CPU flash kernel, whose backward reads the forward's log-sum-exp:
    # torch._decomp's decomposition of the forward returns the attention weights there
    gen = seeded(0)
    q, k, v = (torch.randn(3, 1, 2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(1, 2, 5, 5, generator=gen, dtype=torch.float64)
    kwargs = {"causal": {"is_causal": True}, "mask": {"attn_mask": mask}}.get(variant, {})
    in_dims = (0, None, None) if variant == "shared key and value" else (0, 0, 0)
    args = (q, k[0], v[0]) if variant == "shared key and value" else (q, k, v)

    def loss(q, k, v):
        return (F.scaled_dot_product_attention(q, k, v, **kwargs) ** 2).sum()

    ours = tl.vmap(tl.grad(loss, argnums=(0, 1, 2)), in_dims=in_dims)(*args)
    theirs = tf.vmap(tf.grad(loss, argnums=(0, 1, 2)), in_dims=in_dims)(*args)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("training", [True, False])
def test_per_sample_gradients_of_a_transformer_layer_match_torch_func(training):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).double()
    layer.train(training)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    xs = torch.randn(3, 5, 4, dtype=torch.float64)

    def per_sample(lib):
        loss = lambda p, x: (lib.functional_call(layer, p, (x[None],)) ** 2).sum()
        return lib.vmap(lib.grad(loss), in_dims=(None, 0))(params, xs)

    assert_tree_close(per_sample(tl), per_sample(tf))


# layers whose Hessian in their parameters PyTorch gives by double backward; each found
# or guards a silently wrong second derivative through a backward batched by jacrev's
# vmap (layer_norm read its saved statistics as constants; prelu's ran as prims, whose
# autograd kernel turned grad mode off, giving zeros)
HESSIAN_LAYERS = {
    "linear": (lambda: nn.Linear(3, 2), (4, 3)),
    "conv1d": (lambda: nn.Conv1d(2, 2, 2), (2, 2, 4)),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(2, 1, 2), (2, 2, 3)),
    "layer_norm": (lambda: nn.LayerNorm(3), (2, 3)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (2, 4, 2)),
    "batch_norm_train": (lambda: nn.BatchNorm1d(3, track_running_stats=False), (4, 3)),
    "instance_norm": (lambda: nn.InstanceNorm1d(2, affine=True), (2, 2, 3)),
    "rms_norm": (lambda: nn.RMSNorm(3), (2, 3)),
    "prelu": (lambda: nn.PReLU(2), (3, 2)),
    "gru": (lambda: nn.GRU(2, 2, batch_first=True), (1, 2, 2)),
}


@pytest.mark.parametrize("composition", ["hessian", "jacfwd(jacrev)", "jacrev(jacfwd)"])
@pytest.mark.parametrize("layer", list(HESSIAN_LAYERS))
def test_hessian_of_a_layer_in_its_parameters_matches_autograd(layer, composition):
    make, shape = HESSIAN_LAYERS[layer]
    torch.manual_seed(0)
    module = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    params = {k: v.detach() for k, v in module.named_parameters()}
    flat = torch.cat([p.flatten() for p in params.values()])

    def loss(v):
        split = torch.split(v, [p.numel() for p in params.values()])
        named = {k: s.view(p.shape) for (k, p), s in zip(params.items(), split)}
        out = torch.func.functional_call(module, named, (x,))
        out = out[0] if isinstance(out, tuple) else out
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        return (out * weights).sin().sum()

    if composition == "hessian":
        h = tl.hessian(loss)
    else:
        outer, inner = composition.rstrip(")").split("(")
        h = getattr(tl, outer)(getattr(tl, inner)(loss))
    torch.testing.assert_close(h(flat), torch.autograd.functional.hessian(loss, flat))


# -- probability distributions: log-likelihood gradients per example ------------------------

D = torch.distributions
_DIST_X = torch.randn(4, 5, generator=seeded(7))
CHECKED = {"validate_args": True}  # another test may have turned PyTorch's default off
LOG_LIKELIHOODS = {  # name -> (loss of (parameter, one example), parameter, examples)
    "Normal": (lambda mu, x: D.Normal(mu, torch.ones_like(mu), **CHECKED).log_prob(x).sum(),
               torch.randn(5), _DIST_X),
    "MultivariateNormal": (
        lambda mu, x: D.MultivariateNormal(mu, torch.eye(5), **CHECKED).log_prob(x),
        torch.randn(5), _DIST_X),
    "Categorical": (lambda logits, y: D.Categorical(logits=logits, **CHECKED).log_prob(y),
                    torch.randn(5), torch.tensor([0, 3, 4, 1])),
    "Beta": (lambda a, x: D.Beta(a.exp(), torch.ones(5), **CHECKED).log_prob(x).sum(),
             torch.randn(5), _DIST_X.sigmoid()),
    "Dirichlet": (lambda a, x: D.Dirichlet(a.exp(), **CHECKED).log_prob(x),
                  torch.randn(5), _DIST_X.softmax(-1)),
}


@pytest.mark.parametrize("name", LOG_LIKELIHOODS)
def test_per_example_gradients_of_distribution_log_likelihoods(name):
    """torch.distributions validates its arguments with torch._is_all_true and reads the
    answer into Python: under vmap the answer is one bool for the batch, as in torch.func
    (before, it raised as data-dependent control flow)."""
    loss, param, examples = LOG_LIKELIHOODS[name]
    assert_tree_close(tl.vmap(tl.grad(loss), in_dims=(None, 0))(param, examples),
                      tf.vmap(tf.grad(loss), in_dims=(None, 0))(param, examples))


def test_an_invalid_distribution_argument_in_one_example_raises_as_in_torch_func():
    scales = _DIST_X.abs().clone()
    scales[2, 1] = -1.0
    for lib in (tl, tf):
        with pytest.raises(ValueError, match="scale .* to satisfy the constraint GreaterThan"):
            lib.vmap(lambda s: D.Normal(torch.zeros(5), s, **CHECKED).entropy())(scales)
