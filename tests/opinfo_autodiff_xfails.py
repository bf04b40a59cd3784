"""Known failures of torchlevels' autodiff transforms in tests/test_opinfo_autodiff.py.

``XFAILS[transform]`` maps OpInfo ids (``name`` or ``name.variant``) to the cause. Each
reason starts with its kind: "core:" (torchlevels fails where torch.func passes on the
same harness) or "both:" (torch.func fails the same case too). ``CRASHES`` lists cases
that kill the process (a segfault in a kernel reached through a batching rule): they are
not run at all, by the test or by scripts/opinfo_autodiff_sweep.py.
"""

from __future__ import annotations


def _each(reason: str, *ops: str) -> dict[str, str]:
    return dict.fromkeys(ops, reason)


CRASHES: dict[str, dict[str, str]] = {}

_LINEARIZE_RANDOM = ('nn.functional.dropout', 'nn.functional.dropout2d',
                     'nn.functional.alpha_dropout', 'nn.functional.feature_alpha_dropout.with_train')

# Generated from scripts/opinfo_autodiff_sweep.py --json on the current core; one
# block per cause (delete a block when its cause is fixed).
XFAILS: dict[str, dict[str, str]] = {
    'grad': {
        **_each('both: torch.func fails too: RuntimeError: Sparse CSR tensors do not have strides',
            'sparse.mm.reduce', 'sparse.sampled_addmm'),
    },
    'jvp': {},
    'jacrev': {
        **_each('both: torch.func fails too: result 3: Tensor-likes are not close!; Mismatched elements: 18 / 36 (50.0%); Greatest abso',
            'native_group_norm'),
        **_each('both: torch.func fails too: RuntimeError: In order to use an autograd.Function with functorch transforms (vmap, grad, ',
            'nn.functional.linear_cross_entropy.chunked_none'),
    },
    'jacfwd': {},
    'linearize': _each(
        "both: torch.func fails too: random op: linearize draws the op's random numbers again "
        "when it traces the jvp, so jvp_fn's tangent is of another draw than the reference's",
        *_LINEARIZE_RANDOM, 'nn.functional.multi_head_attention_forward', 'nn.functional.rrelu'),
    'hessian': {
        **_each("core: order-dependent: the sample is not symmetric, and PyTorch's cholesky/eigh "
                "derivative formulas assume it is, so the second derivative depends on the AD "
                "order; torchlevels.hessian is jacrev(jacrev) and gives torch.func.jacrev(jacrev)'s "
                "numbers (tests/test_transforms_api.py), the reference is forward-over-reverse",
            'linalg.cholesky', 'linalg.cholesky_ex', 'linalg.eigh'),
        **_each("core: order-dependent: at a point that is not twice differentiable (a norm "
                "at zero, logaddexp of -inf) PyTorch's formulas give NaN in reverse-over-reverse "
                "and numbers in forward-over-reverse; torchlevels.hessian gives "
                "torch.func.jacrev(jacrev)'s NaNs (tests/test_transforms_api.py)",
            'linalg.norm.subgradients_at_zero', 'masked.logaddexp'),
        **_each('both: torch.func fails too: RuntimeError: Trying to set a forward gradient that has a different size than that of the ',
            'triangular_solve'),
    },
}

# tests/test_opinfo_autodiff_variants.py: method variants (``.method``) and in-place
# variants (``.inplace``), found with the same sweep run on them.
VARIANT_XFAILS: dict[str, dict[str, str]] = {
    **{t: _each("both: PyTorch's acosh_ has no forward-mode derivative (torch.func and "
                "torch.autograd.forward_ad raise too)", "acosh.inplace")
       for t in ("jacfwd", "hessian")},
}
VARIANT_XFAILS["hessian"]["triangular_solve.method"] = XFAILS["hessian"]["triangular_solve"]
VARIANT_XFAILS["linearize"] = {f"{name}.inplace": XFAILS["linearize"][name]
                               for name in _LINEARIZE_RANDOM}
