"""Programs from torch.func's tutorials and API docs, run with torchlevels and torch.func on
the same inputs and seeds (test_workloads.py has per-sample gradients, ensembles, HVPs,
MAML, forces, recurrent and transformer layers, gradient penalties, distributions).

Neural tangent kernels (Jacobian contraction and NTK-vector products), the Jacobians and
Hessians tutorial (argnums, chunk_size, has_aux, batched Jacobians and Hessians,
linearize), functional_call's variants (parameters and buffers, tied weights, strict,
parametrizations, non-leaf parameters), ensembles on a meta-device base with randomness
and training-mode batch norm, replace_all_batch_norm_modules_, functionalize inside a
transform, grad with keyword arguments and pytree inputs (namedtuples, dataclasses,
custom nodes), no_grad around and inside transforms, autocast, and scientific workloads
(a physics-informed loss, a CNF divergence, a linearized network, a GP likelihood).
"""

import collections
import copy
import dataclasses

import pytest
import torch
import torch.func as tf
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from test_workloads import assert_tree_close, detached_params

import torchlevels as tl


def raises_like_torch_func(run, match):
    """``run(lib)`` raises the same kind of error for both, with ``match`` in ours."""
    with pytest.raises(Exception) as theirs:
        run(tf)
    with pytest.raises(type(theirs.value), match=match):
        run(tl)


# -- neural tangent kernels -------------------------------------------------------------

def ntk_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


NTK_EINSUM = {"full": "Naf,Mbf->NMab", "trace": "Naf,Maf->NM", "diagonal": "Naf,Maf->NMa"}


def ntk_by_jacobians(lib, net, params, x1, x2, mode):
    """The NTK tutorial's first method: per-example Jacobians in the parameters, contracted."""
    def f(p, x):
        return lib.functional_call(net, p, (x.unsqueeze(0),)).squeeze(0)

    def jacobians(x):
        return [j.flatten(2) for j in lib.vmap(lib.jacrev(f), (None, 0))(params, x).values()]

    blocks = [torch.einsum(NTK_EINSUM[mode], a, b)
              for a, b in zip(jacobians(x1), jacobians(x2))]
    return torch.stack(blocks).sum(0)


def ntk_by_products(lib, net, params, x1, x2):
    """Its second method: NTK-vector products, a vjp then a jvp, vmapped over a basis."""
    def f(p, x):
        return lib.functional_call(net, p, (x.unsqueeze(0),)).squeeze(0)

    def kernel(a, b):
        def column(vec):
            _, vjp_fn = lib.vjp(lambda p: f(p, b), params)
            return lib.jvp(lambda p: f(p, a), (params,), vjp_fn(vec))[1]

        return lib.vmap(column)(torch.eye(3)).T

    return lib.vmap(lib.vmap(kernel, (None, 0)), (0, None))(x1, x2)


@pytest.mark.parametrize("mode", list(NTK_EINSUM))
def test_empirical_ntk_by_jacobian_contraction(mode):
    net = ntk_net()
    params = detached_params(net)
    x1, x2 = torch.randn(5, 1, 8, 8), torch.randn(4, 1, 8, 8)
    ours = ntk_by_jacobians(tl, net, params, x1, x2, mode)
    assert_tree_close(ours, ntk_by_jacobians(tf, net, params, x1, x2, mode))
    assert ours.shape == {"full": (5, 4, 3, 3), "trace": (5, 4), "diagonal": (5, 4, 3)}[mode]


def test_empirical_ntk_by_ntk_vector_products_agrees_with_the_jacobians():
    net = ntk_net()
    params = detached_params(net)
    x1, x2 = torch.randn(3, 1, 8, 8), torch.randn(2, 1, 8, 8)
    ours = ntk_by_products(tl, net, params, x1, x2)
    assert_tree_close(ours, ntk_by_products(tf, net, params, x1, x2))
    torch.testing.assert_close(ours, ntk_by_jacobians(tf, net, params, x1, x2, "full"))


def test_ntk_of_a_model_with_eval_mode_batch_norm_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).eval()
    with torch.no_grad():
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
    params, buffers = detached_params(net), dict(net.named_buffers())
    x1, x2 = torch.randn(3, 4), torch.randn(5, 4)

    def run(lib):
        f = lambda p, x: lib.functional_call(net, (p, buffers), (x.unsqueeze(0),)).squeeze(0)
        j1, j2 = (lib.vmap(lib.jacrev(f, chunk_size=1), (None, 0))(params, x) for x in (x1, x2))
        return sum(torch.einsum("Naf,Mbf->NMab", j1[k].flatten(2), j2[k].flatten(2)) for k in j1)

    assert_tree_close(run(tl), run(tf))


# -- the Jacobians and Hessians tutorial ---------------------------------------------------

D_IN, D_OUT = 16, 8


def predict(weight, bias, x):
    return F.linear(x, weight, bias).tanh()


def jacobian_inputs():
    torch.manual_seed(0)
    return torch.randn(D_OUT, D_IN), torch.randn(D_OUT), torch.randn(D_IN)


JACOBIANS = {
    "jacrev x": lambda lib, w, b, x: lib.jacrev(predict, argnums=2)(w, b, x),
    "jacfwd x": lambda lib, w, b, x: lib.jacfwd(predict, argnums=2)(w, b, x),
    "jacrev (w, b)": lambda lib, w, b, x: lib.jacrev(predict, argnums=(0, 1))(w, b, x),
    "jacfwd (w, b, x)": lambda lib, w, b, x: lib.jacfwd(predict, argnums=(0, 1, 2))(w, b, x),
    "jacrev argnums=-1": lambda lib, w, b, x: lib.jacrev(predict, argnums=-1)(w, b, x),
    "jacrev chunk_size=3": lambda lib, w, b, x: lib.jacrev(predict, 2, chunk_size=3)(w, b, x),
    "jacrev chunk_size=1 (w, x)": lambda lib, w, b, x: lib.jacrev(
        predict, (0, 2), chunk_size=1)(w, b, x),
    "jacrev preallocated": lambda lib, w, b, x: lib.jacrev(
        predict, 2, chunk_size=3, _preallocate_and_copy=True)(w, b, x),
    "jacrev has_aux": lambda lib, w, b, x: lib.jacrev(
        lambda w, b, x: (predict(w, b, x), predict(w, b, x).sum()), 2, has_aux=True)(w, b, x),
    "jacfwd has_aux": lambda lib, w, b, x: lib.jacfwd(
        lambda w, b, x: (predict(w, b, x), {"s": x.sum()}), 2, has_aux=True)(w, b, x),
    "jacfwd(jacrev)": lambda lib, w, b, x: lib.jacfwd(lib.jacrev(predict, 2), 2)(w, b, x),
    "jacrev(jacrev)": lambda lib, w, b, x: lib.jacrev(lib.jacrev(predict, 2), 2)(w, b, x),
    "hessian x": lambda lib, w, b, x: lib.hessian(predict, argnums=2)(w, b, x),
    "hessian (w, b)": lambda lib, w, b, x: lib.hessian(
        lambda w, b, x: predict(w, b, x).sum(), argnums=(0, 1))(w, b, x),
    "jacrev dict in": lambda lib, w, b, x: lib.jacrev(
        lambda p: predict(p["w"], p["b"], x))({"w": w, "b": b}),
    "jacfwd dict in": lambda lib, w, b, x: lib.jacfwd(
        lambda p: predict(p["w"], p["b"], x))({"w": w, "b": b}),
    "jacrev tree out": lambda lib, w, b, x: lib.jacrev(
        lambda x: {"y": predict(w, b, x), "n": (x.norm(),)})(x),
    "jacfwd tree out": lambda lib, w, b, x: lib.jacfwd(
        lambda x: {"y": predict(w, b, x), "n": (x.norm(),)})(x),
    "jacrev 0-d in": lambda lib, w, b, x: lib.jacrev(lambda s: predict(w * s, b, x))(b[0]),
    "jacfwd 0-d in": lambda lib, w, b, x: lib.jacfwd(lambda s: predict(w * s, b, x))(b[0]),
}


@pytest.mark.parametrize("name", list(JACOBIANS))
def test_jacobians_tutorial(name):
    w, b, x = jacobian_inputs()
    assert_tree_close(JACOBIANS[name](tl, w, b, x), JACOBIANS[name](tf, w, b, x))


def test_jacobian_rows_match_vjps_of_basis_vectors():
    w, b, x = jacobian_inputs()
    _, vjp_fn = tl.vjp(lambda x: predict(w, b, x), x)
    rows = torch.stack([vjp_fn(e)[0] for e in torch.eye(D_OUT)])
    torch.testing.assert_close(tl.jacrev(predict, argnums=2)(w, b, x), rows)


BATCHED = {
    "vmap(jacrev)": lambda lib, w, b, xs: lib.vmap(lib.jacrev(predict, argnums=2),
                                                   in_dims=(None, None, 0))(w, b, xs),
    "vmap(jacfwd)": lambda lib, w, b, xs: lib.vmap(lib.jacfwd(predict, argnums=2),
                                                   in_dims=(None, None, 0))(w, b, xs),
    "jacrev of the sum": lambda lib, w, b, xs: lib.jacrev(
        lambda x: predict(w, b, x).sum(0))(xs).movedim(1, 0),
    "vmap(hessian)": lambda lib, w, b, xs: lib.vmap(lib.hessian(predict, argnums=2),
                                                    in_dims=(None, None, 0))(w, b, xs[:3]),
}


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_jacobians_and_hessians(name):
    w, b, _ = jacobian_inputs()
    xs = torch.randn(6, D_IN)
    ours = BATCHED[name](tl, w, b, xs)
    assert_tree_close(ours, BATCHED[name](tf, w, b, xs))
    if name != "vmap(hessian)":
        torch.testing.assert_close(ours, BATCHED["vmap(jacrev)"](tf, w, b, xs))


LINEARIZE = {
    "twice": lambda lib, f, x: (lambda out, fn: (out, fn(torch.ones_like(x)),
                                                 fn(torch.linspace(-1, 1, x.numel()))))(
        *lib.linearize(f, x)),
    "vmap(jvp_fn)": lambda lib, f, x: lib.vmap(lib.linearize(f, x)[1])(torch.eye(x.numel())),
}


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")  # torch.func's too
@pytest.mark.parametrize("use", list(LINEARIZE))
def test_linearize(use):
    w, b, x = jacobian_inputs()
    f = lambda x: predict(w, b, x)
    ours = LINEARIZE[use](tl, f, x)
    assert_tree_close(ours, LINEARIZE[use](tf, f, x))
    if use == "vmap(jvp_fn)":
        torch.testing.assert_close(ours, tf.jacfwd(f)(x).T)


@pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")
def test_linearize_a_model_in_its_parameters():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 10), nn.GELU(), nn.Linear(10, 2))
    p0 = detached_params(net)
    dp = {k: 0.1 * torch.randn_like(v) for k, v in p0.items()}
    x = torch.randn(7, 4)

    def run(lib):
        out, jvp_fn = lib.linearize(lambda p: lib.functional_call(net, p, (x,)), p0)
        return out, jvp_fn(dp)

    assert_tree_close(run(tl), run(tf))


# -- functional_call's variants --------------------------------------------------------------

class NetWithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return self.fc2(self.bn(self.fc1(x)).relu()) * self.scale


def net_with_buffers():
    torch.manual_seed(0)
    net = NetWithBuffers().eval()
    with torch.no_grad():
        net.bn.running_mean.normal_()
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


FUNCTIONAL_CALLS = {
    "a tuple of dicts": lambda lib, net, p, b, x: lib.grad(
        lambda p: lib.functional_call(net, (p, b), (x,)).sum())(p),
    "one dict of both": lambda lib, net, p, b, x: lib.grad(
        lambda p: lib.functional_call(net, {**p, **b}, (x,)).sum())(p),
    "kwargs": lambda lib, net, p, b, x: lib.grad(
        lambda p: lib.functional_call(net, p, (), {"x": x}).sum())(p),
    "a bare tensor argument": lambda lib, net, p, b, x: lib.grad(
        lambda p: lib.functional_call(net, p, x).sum())(p),
    "some of the parameters": lambda lib, net, p, b, x: lib.grad(
        lambda w: lib.functional_call(net, {"fc1.weight": w}, (x,)).sum())(p["fc1.weight"]),
    "in a buffer": lambda lib, net, p, b, x: lib.grad(
        lambda s: lib.functional_call(net, {"scale": s}, (x,)).sum())(torch.tensor(3.0)),
    "vmap over a buffer": lambda lib, net, p, b, x: lib.vmap(
        lambda s: lib.functional_call(net, {"scale": s}, (x,)))(torch.arange(3.0)),
    "vmap over running stats": lambda lib, net, p, b, x: lib.vmap(
        lambda m: lib.functional_call(net, {"bn.running_mean": m}, (x,)))(torch.randn(3, 6)),
    "strict, all given": lambda lib, net, p, b, x: lib.grad(
        lambda p: lib.functional_call(net, (p, b), (x,), strict=True).sum())(p),
}


@pytest.mark.parametrize("name", list(FUNCTIONAL_CALLS))
def test_functional_call_variants(name):
    net = net_with_buffers()
    p, b, x = detached_params(net), dict(net.named_buffers()), torch.randn(5, 4)
    seed = torch.random.get_rng_state()
    ours = FUNCTIONAL_CALLS[name](tl, net, p, b, x)
    torch.random.set_rng_state(seed)
    assert_tree_close(ours, FUNCTIONAL_CALLS[name](tf, net, p, b, x))


STRICT_ERRORS = {
    "missing": (lambda p: {k: v for k, v in p.items() if k != "fc1.bias"}, "Missing key"),
    "unexpected": (lambda p: {**p, "extra": torch.ones(1)}, "Unexpected key"),
}


@pytest.mark.parametrize("case", list(STRICT_ERRORS))
def test_functional_call_strict_errors_inside_grad(case):
    net = net_with_buffers()
    b, x = dict(net.named_buffers()), torch.randn(5, 4)
    edit, match = STRICT_ERRORS[case]
    raises_like_torch_func(lambda lib: lib.grad(lambda p: lib.functional_call(
        net, (edit(p), b), (x,), strict=True).sum())(detached_params(net)), match)


def test_functional_call_refuses_a_key_in_two_dicts():
    net = net_with_buffers()
    p = detached_params(net)
    raises_like_torch_func(lambda lib: lib.vmap(lambda x: lib.functional_call(
        net, (p, p), (x,)))(torch.randn(3, 4)), "multiple dictionaries")


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, i):
        return self.out(self.emb(i).tanh())


@pytest.mark.parametrize("tie_weights", [True, False])
def test_functional_call_tied_weights(tie_weights):
    torch.manual_seed(0)
    lm = TiedLM()
    w, ws, idx = lm.emb.weight.detach(), torch.randn(3, 7, 4), torch.tensor([1, 2, 5])

    def run(lib):
        call = lambda w: lib.functional_call(lm, {"emb.weight": w}, (idx,),
                                             tie_weights=tie_weights)
        return lib.grad(lambda w: call(w).logsumexp(-1).sum())(w), lib.vmap(call)(ws)

    assert_tree_close(run(tl), run(tf))


def test_functional_call_two_values_for_tied_weights_raise():
    torch.manual_seed(0)
    lm = TiedLM()
    w = lm.emb.weight.detach()
    raises_like_torch_func(lambda lib: lib.grad(lambda w: lib.functional_call(
        lm, {"emb.weight": w, "out.weight": w + 1}, (torch.tensor([1]),)).sum())(w), "tied")


def test_grad_of_non_leaf_parameters_keeps_their_history():
    """Parameters computed from leaves that require grad: the per-parameter gradients are
    differentiable in those leaves, as in torch.func."""
    net = net_with_buffers()
    b, x = dict(net.named_buffers()), torch.randn(5, 4)

    def run(lib):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
        doubled = {k: 2 * v for k, v in leaves.items()}
        g = lib.grad(lambda p: lib.functional_call(net, (p, b), (x,)).pow(2).sum())(doubled)
        penalty = sum(v.pow(2).sum() for v in g.values())
        second = torch.autograd.grad(penalty, list(leaves.values()))
        return {k: v.detach() for k, v in g.items()}, second

    assert_tree_close(run(tl), run(tf))


def test_grad_of_a_models_own_parameters_as_in_the_docs():
    """functional_call's docs pass dict(model.named_parameters()), not detached: the
    gradients then carry history to the parameters."""
    torch.manual_seed(0)
    model, x, t = nn.Linear(5, 3), torch.randn(4, 5), torch.randn(4, 3)

    def run(lib):
        params = dict(model.named_parameters())
        loss = lambda p, x, t: F.mse_loss(lib.functional_call(model, p, x), t)
        g = lib.grad(loss)(params, x, t)
        assert all(v.requires_grad for v in g.values())
        second = torch.autograd.grad(sum(v.pow(2).sum() for v in g.values()), list(params.values()))
        return {k: v.detach() for k, v in g.items()}, second

    assert_tree_close(run(tl), run(tf))


PARAMETRIZATIONS = {
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
    "orthogonal": lambda m: nn.utils.parametrizations.orthogonal(m),
    "spectral_norm (eval)": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "symmetric": lambda m: nn.utils.parametrize.register_parametrization(m, "weight", Symmetric()),
}


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_per_sample_grads_of_a_parametrized_layer(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    PARAMETRIZATIONS[kind](model[0])
    model.eval()
    params, buffers = detached_params(model), dict(model.named_buffers())
    xs, ys = torch.randn(4, 5), torch.randint(0, 3, (4,))

    def run(lib):
        loss = lambda p, x, y: F.cross_entropy(lib.functional_call(model, (p, buffers), (x[None],)),
                                               y[None])
        return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)

    assert_tree_close(run(tl), run(tf))


# -- ensembles: a meta-device base model, randomness, batch norm in training -----------------

def ensemble(make, n=3):
    torch.manual_seed(0)
    models = [make() for _ in range(n)]
    return models, copy.deepcopy(models[0]).to("meta")


def stacked(models):
    params, buffers = tf.stack_module_state(models)
    return {k: v.detach() for k, v in params.items()}, {k: v.clone() for k, v in buffers.items()}


def call_ensemble(lib, base, params, buffers, x, x_dim, randomness="error"):
    call = lambda p, b, x: lib.functional_call(base, (p, b), (x,))
    return lib.vmap(call, in_dims=(0, 0, x_dim), randomness=randomness)(params, buffers, x)


@pytest.mark.parametrize("randomness", ["same", "different"])
@pytest.mark.parametrize("x_dim", [None, 0])
def test_an_ensemble_with_dropout_under_each_randomness(x_dim, randomness):
    models, base = ensemble(lambda: nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5),
                                                  nn.Linear(16, 2)))
    params, buffers = stacked(models)
    x = torch.randn(5, 4) if x_dim is None else torch.randn(3, 5, 4)
    torch.manual_seed(5)
    ours = call_ensemble(tl, base, params, buffers, x, x_dim, randomness)
    torch.manual_seed(5)
    assert_tree_close(ours, call_ensemble(tf, base, params, buffers, x, x_dim, randomness))


def test_an_ensemble_with_dropout_in_error_mode_raises_as_torch_func():
    models, base = ensemble(lambda: nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5)))
    params, buffers = stacked(models)
    raises_like_torch_func(lambda lib: call_ensemble(lib, base, params, buffers,
                                                     torch.randn(5, 4), None), "randomness")


def bn_model():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=0.3), nn.ReLU(),
                         nn.Linear(6, 2))


@pytest.mark.parametrize("x_dim", [None, 0])
def test_an_ensemble_of_training_mode_batch_norm_models_updates_each_ones_stats(x_dim):
    models, base = ensemble(bn_model)
    x = torch.randn(5, 4) if x_dim is None else torch.randn(3, 5, 4)
    results = []
    for lib in (tl, tf):
        params, buffers = stacked(models)
        results.append((call_ensemble(lib, base, params, buffers, x, x_dim), buffers))
    assert_tree_close(*results)
    # a loop over copies of the models, each a training step's forward pass
    copies = [copy.deepcopy(m) for m in models]
    outs = [m(x if x_dim is None else x[i]) for i, m in enumerate(copies)]
    stats = {k: torch.stack([dict(m.named_buffers())[k] for m in copies]) for k in results[0][1]}
    assert_tree_close(results[0], (torch.stack(outs).detach(), stats))


def test_ensemble_gradients_through_training_mode_batch_norm():
    models, base = ensemble(bn_model)
    xs = torch.randn(3, 5, 4)

    def run(lib):
        params, buffers = stacked(models)
        loss = lambda p, b, x: lib.functional_call(base, (p, b), (x,)).pow(2).sum()
        return lib.vmap(lib.grad(loss))(params, buffers, xs), buffers

    assert_tree_close(run(tl), run(tf))


def test_an_ensemble_trains_by_autograd_outside_vmap():
    """stack_module_state's parameters are leaves that require grad: backward() through
    the vmapped ensemble fills their .grad."""
    models, base = ensemble(lambda: nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2)))
    x = torch.randn(3, 5)

    def run(lib):
        params, buffers = lib.stack_module_state(models)
        out = call_ensemble(lib, base, params, buffers, x, None)
        out.pow(2).sum().backward()
        return out.detach(), {k: v.grad for k, v in params.items()}

    assert_tree_close(run(tl), run(tf))


@pytest.mark.parametrize("transform", ["vmap", "vmap(grad)"])
def test_replace_all_batch_norm_modules_then_vmap_in_training_mode(transform):
    xs, ys = torch.randn(4, 2, 1, 6, 6), torch.randint(0, 2, (4, 2))

    def run(lib):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                              nn.Linear(3 * 4 * 4, 2)).train()
        lib.replace_all_batch_norm_modules_(model)
        if transform == "vmap":
            return lib.vmap(model)(xs)
        loss = lambda p, x, y: F.cross_entropy(lib.functional_call(model, p, (x,)), y)
        return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(detached_params(model), xs, ys)

    assert_tree_close(run(tl), run(tf))


def test_vmap_of_training_mode_batch_norm_with_unbatched_stats_raises_as_torch_func():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    raises_like_torch_func(lambda lib: lib.vmap(model)(torch.randn(2, 5, 3)), "running_mean")


def test_per_example_batch_norm_statistics_as_batched_buffers():
    torch.manual_seed(9)
    model = bn_model().train()
    params, xs = detached_params(model), torch.randn(3, 5, 4)

    def run(lib):
        buffers = {k: v.expand(3, *v.shape).clone() for k, v in model.named_buffers()}
        out = lib.vmap(lambda b, x: lib.functional_call(model, (params, b), (x,)))(buffers, xs)
        return out, buffers

    assert_tree_close(run(tl), run(tf))


# -- functionalize inside the transforms ------------------------------------------------------

def mutating(x):
    y = x.clone()
    y.add_(1)
    y[0].mul_(2)
    y.view(-1).sin_()
    return (y * x).sum()


FUNCTIONALIZED = {
    "grad": lambda lib, x: lib.grad(lib.functionalize(mutating))(x[0]),
    "vmap(grad)": lambda lib, x: lib.vmap(lib.grad(lib.functionalize(mutating)))(x),
    "jacrev": lambda lib, x: lib.jacrev(lib.functionalize(
        lambda a: a.clone().mul_(a).sin()))(x[0]),
    "jacfwd": lambda lib, x: lib.jacfwd(lib.functionalize(
        lambda a: a.clone().mul_(a).sin()))(x[0]),
    "vmap, views removed": lambda lib, x: lib.vmap(lib.functionalize(
        mutating, remove="mutations_and_views"))(x),
    "vmap, input written": lambda lib, x: (lambda xs: (lib.vmap(lib.functionalize(
        lambda a: a.mul_(2).sum()))(xs), xs))(x.clone()),
}


@pytest.mark.filterwarnings("ignore:.*select_copy")  # removing views: torch.func loops too
@pytest.mark.parametrize("name", list(FUNCTIONALIZED))
def test_functionalize_inside_transforms(name):
    x = torch.randn(5, 3, 4)
    assert_tree_close(FUNCTIONALIZED[name](tl, x), FUNCTIONALIZED[name](tf, x))


# -- keyword arguments and pytrees -------------------------------------------------------------

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class State:
    w: torch.Tensor
    b: torch.Tensor


pytree.register_dataclass(State)


class Custom:
    def __init__(self, a, b):
        self.a, self.b = a, b


pytree.register_pytree_node(Custom, lambda c: ([c.a, c.b], None), lambda v, _: Custom(*v))

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
XS = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))

PYTREE_PROGRAMS = {
    "grad with kwargs": lambda lib: lib.grad(
        lambda x, *, w, b=0.0: (x * w + b).pow(2).sum())(X, w=X.cos(), b=torch.tensor(1.0)),
    "vmap(grad) with kwargs": lambda lib: lib.vmap(lib.grad(
        lambda x, *, w: (x * w).pow(2).sum()))(XS, w=X),
    "grad of a namedtuple": lambda lib: lib.grad(lambda p: (p.a.sin() * p.b).sum())(
        Pair(X, X.cos())),
    "grad of nested dicts and lists": lambda lib: lib.grad(
        lambda p: (p["a"][0] * p["a"][1] + p["b"]["c"]).sum())(
        {"a": [X, X.exp()], "b": {"c": X.tanh()}}),
    "grad of a dataclass": lambda lib: lib.grad(lambda s: (s.w.sin() * s.b).sum())(
        State(X, X.cos())),
    "vmap of a dataclass": lambda lib: lib.vmap(lambda s: s.w @ s.b.T)(State(XS, XS)),
    "jacrev of a dataclass": lambda lib: lib.jacrev(lambda s: s.w * s.b)(State(X[0], X[1])),
    "jacfwd of a dataclass": lambda lib: lib.jacfwd(lambda s: s.w * s.b)(State(X[0], X[1])),
    "dataclass aux": lambda lib: lib.grad_and_value(
        lambda s: ((s.w * s.b).sum(), State(s.w.detach(), s.b * 2)), has_aux=True)(
        State(X[0], X[1])),
    "grad of a custom node": lambda lib: (lambda g: (g.a, g.b))(
        lib.grad(lambda c: (c.a * c.b.exp()).sum())(Custom(X, X * 2))),
    "vmap out_dims tree": lambda lib: lib.vmap(
        lambda x: {"a": x, "b": (x.sum(), x * 2)}, out_dims={"a": 1, "b": (0, 1)})(XS),
    "vjp of dicts": lambda lib: (lambda r: r[1]({"o": torch.ones(3, 4), "s": torch.tensor(2.0)}))(
        lib.vjp(lambda d: {"o": d["a"] * d["b"], "s": d["a"].sum()}, {"a": X, "b": X.sin()})),
    "jvp of dicts": lambda lib: lib.jvp(lambda d: {"o": d["a"] * d["b"]},
                                        ({"a": X, "b": X.sin()},),
                                        ({"a": torch.ones_like(X), "b": X},)),
}


@pytest.mark.parametrize("name", list(PYTREE_PROGRAMS))
def test_keyword_arguments_and_pytrees(name):
    assert_tree_close(PYTREE_PROGRAMS[name](tl), PYTREE_PROGRAMS[name](tf))


def test_in_dims_must_match_a_dataclass_structure_as_in_torch_func():
    raises_like_torch_func(lambda lib: lib.vmap(lambda s, y: s.w * y, in_dims=(State(0, None), 0))(
        State(XS, X), XS), "in_dims is not compatible")


# -- grad mode around and inside the transforms ------------------------------------------------

def _under(context, transform):
    def run(lib):
        with context():
            return transform(lib)
    return run


GRAD_MODES = {
    "no_grad inside grad": lambda lib: lib.grad(lambda x: _constant_square(x))(X),
    "grad under no_grad": _under(torch.no_grad, lambda lib: lib.grad(lambda x: (x ** 3).sum())(X)),
    "grad under inference_mode": _under(torch.inference_mode,
                                        lambda lib: lib.grad(lambda x: (x ** 3).sum())(X)),
    "vjp under no_grad": _under(torch.no_grad, lambda lib: (lambda r: (r[0], r[1](X)))(
        lib.vjp(torch.sin, X))),
    "jacrev under no_grad": _under(torch.no_grad, lambda lib: lib.jacrev(torch.sin)(X[0])),
    "hessian under no_grad": _under(torch.no_grad,
                                    lambda lib: lib.hessian(lambda x: x.sin().sum())(X[0])),
    "jvp under no_grad": _under(torch.no_grad,
                                lambda lib: lib.jvp(torch.sin, (X,), (torch.ones_like(X),))),
}


def _constant_square(x):
    with torch.no_grad():
        c = x ** 2
    return (x - c).sum()


@pytest.mark.parametrize("name", list(GRAD_MODES))
def test_grad_mode_around_and_inside_the_transforms(name):
    assert_tree_close(GRAD_MODES[name](tl), GRAD_MODES[name](tf))


def test_per_sample_grads_under_autocast_match_a_loop():
    """Under CPU autocast in bfloat16: the loop with torch.autograd is the reference (torch.func's
    batched matmuls round differently, within bfloat16's precision)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    params, xs, ys = detached_params(model), torch.randn(4, 5), torch.randint(0, 3, (4,))

    def per_sample(lib):
        loss = lambda p, x, y: F.cross_entropy(lib.functional_call(model, p, (x[None],)), y[None])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)

    rows = []
    for x, y in zip(xs, ys):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[None]), y[None])
        loss.backward()
        rows.append({k: v.grad.clone() for k, v in model.named_parameters()})
    ours = per_sample(tl)
    assert_tree_close(ours, {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    assert_tree_close(ours, per_sample(tf), atol=1e-2, rtol=0.05)


# -- scientific workloads -----------------------------------------------------------------------

@pytest.mark.parametrize("second", ["hessian", "jacfwd(jacrev)", "jacrev(jacrev)"])
def test_physics_informed_loss_through_a_laplacian(second):
    """A Poisson residual: the Laplacian of an MLP in its input per collocation point, the
    mean squared residual differentiated in the parameters (third order in all)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 1)).double()
    params, pts = detached_params(net), torch.rand(6, 2, dtype=torch.float64)

    def run(lib):
        u = lambda p, x: lib.functional_call(net, p, (x,)).squeeze(-1)
        hess = {"hessian": lambda: lib.hessian(u, argnums=1),
                "jacfwd(jacrev)": lambda: lib.jacfwd(lib.jacrev(u, argnums=1), argnums=1),
                "jacrev(jacrev)": lambda: lib.jacrev(lib.jacrev(u, argnums=1), argnums=1)}[second]
        laplacian = lambda p, x: hess()(p, x).diagonal().sum()
        residual = lambda p: lib.vmap(laplacian, (None, 0))(p, pts) + pts.sin().prod(-1)
        return lib.grad_and_value(lambda p: residual(p).pow(2).mean())(params)

    assert_tree_close(run(tl), run(tf))


@pytest.mark.parametrize("divergence", ["jacrev trace", "jacfwd trace", "hutchinson"])
def test_continuous_normalizing_flow_divergence_gradients(divergence):
    torch.manual_seed(0)
    dynamics = nn.Sequential(nn.Linear(3, 12), nn.Softplus(), nn.Linear(12, 3)).double()
    params = detached_params(dynamics)
    zs, eps = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)

    def run(lib):
        f = lambda p, z: lib.functional_call(dynamics, p, (z,))

        def div(p, z, e):
            if divergence == "hutchinson":
                return (lib.vjp(lambda z: f(p, z), z)[1](e)[0] * e).sum()
            jac = lib.jacrev if divergence == "jacrev trace" else lib.jacfwd
            return jac(f, argnums=1)(p, z).trace()

        return lib.grad(lambda p: lib.vmap(div, (None, 0, 0))(p, zs, eps).mean())(params)

    assert_tree_close(run(tl), run(tf))


def test_training_a_linearized_network():
    """The NTK regime: f(p0) + J(p0)(p - p0) by jvp, its loss differentiated in p."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 10), nn.GELU(), nn.Linear(10, 2))
    p0 = detached_params(net)
    p1 = {k: v + 0.1 * torch.randn_like(v) for k, v in p0.items()}
    x, y = torch.randn(7, 4), torch.randn(7, 2)

    def run(lib):
        def f_lin(p):
            out, tangent = lib.jvp(lambda q: lib.functional_call(net, q, (x,)), (p0,),
                                   ({k: p[k] - p0[k] for k in p},))
            return out + tangent

        return lib.grad_and_value(lambda p: F.mse_loss(f_lin(p), y))(p1)

    assert_tree_close(run(tl), run(tf))


def test_generalized_gauss_newton_from_per_example_jacobians():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    params, xs = detached_params(net), torch.randn(7, 4)

    def run(lib):
        f = lambda p, x: lib.functional_call(net, p, (x[None],))[0]
        jac = lib.vmap(lib.jacrev(f), (None, 0))(params, xs)
        flat = torch.cat([j.flatten(2) for j in jac.values()], -1)
        return torch.einsum("nop,noq->pq", flat, flat)

    assert_tree_close(run(tl), run(tf))


def neg_log_marginal_likelihood(h, X, y):
    """A Gaussian process's, with a squared-exponential kernel."""
    k = h["log_sf"].exp() ** 2 * torch.exp(-0.5 * torch.cdist(X, X) ** 2 / h["log_ls"].exp() ** 2)
    k = k + (h["log_sn"].exp() ** 2 + 1e-6) * torch.eye(X.shape[0], dtype=X.dtype)
    chol = torch.linalg.cholesky(k)
    alpha = torch.cholesky_solve(y[:, None], chol)
    return 0.5 * (y[:, None] * alpha).sum() + chol.diagonal().log().sum()


@pytest.mark.parametrize("transform", ["vmap(grad)", "vmap(hessian)", "grad(vmap)"])
def test_gaussian_process_hyperparameter_derivatives_per_dataset(transform):
    g = torch.Generator().manual_seed(0)
    Xs, ys = torch.randn(3, 6, 2, generator=g, dtype=torch.float64), torch.randn(
        3, 6, generator=g, dtype=torch.float64)
    hyp = {k: torch.tensor(v, dtype=torch.float64)
           for k, v in {"log_ls": 0.1, "log_sf": -0.2, "log_sn": -1.0}.items()}
    nlml = neg_log_marginal_likelihood
    run = {
        "vmap(grad)": lambda lib: lib.vmap(lib.grad(nlml), (None, 0, 0))(hyp, Xs, ys),
        "vmap(hessian)": lambda lib: lib.vmap(lib.hessian(nlml), (None, 0, 0))(hyp, Xs, ys),
        "grad(vmap)": lambda lib: lib.grad(lambda h: lib.vmap(nlml, (None, 0, 0))(
            h, Xs, ys).sum())(hyp),
    }[transform]
    assert_tree_close(run(tl), run(tf))


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.bag = nn.Embedding(20, 4), nn.EmbeddingBag(20, 4, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, i):
        return self.fc(torch.cat([self.emb(i).mean(1), self.bag(i)], -1))


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_dp_sgd_step_with_clipped_per_sample_embedding_gradients():
    torch.manual_seed(0)
    model = BagOfWords()
    params = detached_params(model)
    ids, labels = torch.randint(0, 20, (6, 5)), torch.randint(0, 3, (6,))

    def run(lib):
        loss = lambda p, i, y: F.cross_entropy(lib.functional_call(model, p, (i[None],)), y[None])
        g = lib.vmap(lib.grad(loss), in_dims=(None, 0, 0))(params, ids, labels)
        norms = torch.stack([v.flatten(1).norm(dim=1) for v in g.values()]).norm(dim=0)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        return {k: torch.einsum("n,n...->...", factor, v) for k, v in g.items()}

    assert_tree_close(run(tl), run(tf))


# -- torch.func's UX limitations: the same kind of error ------------------------------------------

def _add_into(a, b):
    a.add_(b)
    return a


UX_ERRORS = {
    "in-place into an unbatched tensor": (lambda lib: lib.vmap(_add_into, in_dims=(None, 0))(
        torch.zeros(4), X), "add_"),
    ".item()": (lambda lib: lib.vmap(lambda a: a.sum().item())(X), "item"),
    "data-dependent if": (lambda lib: lib.vmap(lambda a: a if a.sum() > 0 else -a)(X),
                          "data-dependent"),
    "backward() inside grad": (lambda lib: lib.grad(lambda a: _backward(a))(X), "backward"),
    "random op in error mode": (lambda lib: lib.vmap(lambda a: a + torch.rand(4))(X), "randomness"),
    "same randomness of a batched op": (lambda lib: lib.vmap(
        torch.bernoulli, randomness="same")(X.sigmoid()), "batched tensor input"),
    "different in-place randomness, unbatched": (lambda lib: lib.vmap(
        lambda a: torch.zeros(4).uniform_() + a, randomness="different")(X), "unbatched"),
    "a batched tensor used after vmap": (lambda lib: _escaped(lib) + 1, "escaped"),
    "non-scalar grad output": (lambda lib: lib.grad(lambda a: a * 2)(X), "scalar"),
    "vjp_fn cotangent shape": (lambda lib: lib.vjp(torch.sin, X)[1](torch.ones(4)), "shape"),
    "jvp tangent shape": (lambda lib: lib.jvp(torch.sin, (X,), (torch.ones(3, 5),)), "shape"),
    "integer input to jacrev": (lambda lib: lib.jacrev(lambda a: a * 2)(torch.arange(3)),
                                "floating"),
}


def _escaped(lib):
    saved = []
    lib.vmap(lambda a: saved.append(a * 2) or a.sin())(X)
    return saved[0]


def _backward(a):
    out = (a ** 2).sum()
    out.backward()
    return out


@pytest.mark.parametrize("name", list(UX_ERRORS))
def test_ux_limitations_raise_the_same_kind_of_error(name):
    run, match = UX_ERRORS[name]
    raises_like_torch_func(run, match)


def test_jvp_keeps_a_tangent_of_another_floating_dtype_as_forward_ad_does():
    """make_dual keeps a float64 tangent on a float32 primal laid out alike (and casts one
    laid out otherwise): the tangents out are then float64, as torch.func gives them."""
    x, t = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    for f in (lambda a: a, torch.sin, lambda a: a.clone().mul_(a)):
        ours = tl.jvp(f, (x,), (t,))
        assert_tree_close(ours, tf.jvp(f, (x,), (t,)))
        assert ours[1].dtype == torch.float64
    strided = t.T.contiguous().T
    assert_tree_close(tl.jvp(torch.sin, (x,), (strided,)), tf.jvp(torch.sin, (x,), (strided,)))
