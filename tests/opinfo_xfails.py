"""Known failures of torchlevels.vmap in tests/test_opinfo_vmap.py, each with its cause.

Keys are OpInfo ids (``name`` or ``name.variant``). Each reason starts with its kind:
"core:" (torchlevels' level machinery), "rule:" (a batching rule is wrong or partial),
"no rule:" (the slow loop or a decomposition cannot do it), "decomposition:" (a
torch._refs / CompositeImplicit decomposition is not vmap-safe), "both:" (torch.func
fails the same case too: a limit of vmap itself or of the loop reference).
"""

from __future__ import annotations


def _each(reason: str, *ops: str) -> dict[str, str]:
    return dict.fromkeys(ops, reason)


XFAILS: dict[str, str] = {
    # Every entry also fails under torch.func.vmap on the same harness.
    **_each(
        "both: training-mode batch norm would update unbatched running stats in place "
        "with batched statistics (track_running_stats=False, or eval mode, works)",
        "_batch_norm_with_update", "_native_batch_norm_legit", "native_batch_norm",
        "nn.functional.batch_norm", "nn.functional.instance_norm",
    ),
    **_each(
        "both: as_strided addresses storage, so strides that are right per example are "
        "wrong on the batched storage",
        "as_strided", "as_strided.partial_views", "as_strided_copy",
    ),
    "index_put": (
        "both: a batched boolean mask gives a data-dependent shape"
    ),
    **_each(
        "both: data-dependent Python value (.item()) read from a batched tensor",
        "narrow", "nn.functional.gaussian_nll_loss",
    ),
    "tensor_split": (
        "both: batched tensor_indices_or_sections are data-dependent split points (here: "
        "'data is not allocated yet')"
    ),
    "view_as_complex": (
        "both: needs stride 1 in the last dim; batched at the last dim it is not"
    ),
}

# Popular ops that pass test_vmap_matches_loop but reach the slow per-example loop.
SLOW_LOOP_XFAILS: dict[str, str] = {}
# tests/test_opinfo_vmap_variants.py: method variants (``.method``) fail where their
# functions do; in-place variants (``.inplace``) as below.
VARIANT_XFAILS: dict[str, str] = {
    **{f"{op}.method": XFAILS[op] for op in (
        "as_strided", "as_strided.partial_views", "index_put", "narrow", "tensor_split")},
    **{f"{op}.inplace": XFAILS[op] for op in (
        "as_strided", "as_strided.partial_views", "index_put")},
    "addbmm.inplace": (
        "both: PyTorch's addbmm_ resizes a one-element self to the product's shape; a "
        "batched self cannot grow (torchlevels raises, torch.func keeps the old shape)"),
    "resize_as_.inplace": (
        "harness: resize_as_ takes only the template's shape, the same for every example, "
        "so it may resize an unbatched input where the harness expects vmap's refusal"),
}
