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
    # -- torchlevels only (torch.func passes) --------------------------------------------
    **_each(
        "rule: reductions.dim_rule checks '[]' in str(schema type), but torch prints "
        "'Optional[List[int]]' / 'List[int]', so dim=() takes the int-dim path and passes "
        "an int to a list argument (vmap(lambda a: torch.all(a, dim=()))(randn(3)))",
        "all", "any", "count_nonzero",
    ),
    "_softmax_backward_data": (
        "rule: dim_rule does not materialize the unbatched `output` when only `grad` is "
        "batched; the kernel needs equal shapes"
    ),
    **_each(
        "rule: linalg_cross via dim_rule does not pad an unbatched operand to the batched "
        "rank (vmap(torch.linalg.cross, in_dims=(0, None))(randn(3,4,3), randn(4,3)))",
        "cross", "linalg.cross",
    ),
    "renorm": (
        "rule: renorm is batched by dim_rule, but renorm takes the norm over every dim "
        "except `dim`, so the batch dim is folded into each norm: wrong numbers"
    ),
    "slice": (
        "rule: views.slice_ unpacks (x, d, *rest), but __torch_dispatch__ drops trailing "
        "defaulted args (dim=0): aten.slice.Tensor(x) reaches the rule as (x,)"
    ),
    **_each(
        "rule: views.unfold on a 0-dim logical tensor maps dim 0 to physical dim 1, out of "
        "range (vmap(lambda a: a.unfold(0, 1, 1))(randn(3)))",
        "unfold", "unfold_copy",
    ),
    **_each(
        "core: the lazy conj bit is lost. aten._conj falls to the slow loop, and kernels "
        "inside __torch_dispatch__ ignore the bit, so vmap(torch.conj)(x) returns x "
        "unconjugated; these fft decompositions use _conj: wrong numbers",
        "fft.hfft2", "fft.hfftn", "fft.ifft", "fft.ihfft", "fft.ihfft2", "fft.ihfftn",
    ),
    "diagonal_scatter": (
        "decomposition: torch._refs.diagonal_scatter uses as_strided/copy_to on the batched "
        "tensor; the slow loop applies storage strides per example: wrong numbers. Needs its "
        "own rule (as torch.func has)"
    ),
    **_each(
        "decomposition: torch._refs allocates an unbatched output with empty() and copy_'s a "
        "batched result into it (vmap(torch.complex)(randn(3,5), randn(3,5)))",
        "complex", "polar",
    ),
    "bucketize": (
        "decomposition: torch._refs.bucketize runs a binary search that calls .item() on a "
        "batched 0-dim input; needs a rule (searchsorted-based, as torch.func)"
    ),
    "argwhere": (
        "core: aten.nonzero refuses any batched input (data-dependent shape); torch.func's "
        "fallback loop succeeds whenever all examples give the same number of nonzeros"
    ),
    "nn.functional.multi_head_attention_forward": (
        "core: dropout of an unbatched tensor under randomness='different' decomposes to "
        "in-place bernoulli_ on an unbatched tensor, which is refused; torch.func batches "
        "dropout out of place (vmap(lambda x, y: F.dropout(y, .5) + x, (0, None), "
        "randomness='different'))"
    ),
    "nn.functional.group_norm": (
        "rule: nn.native_group_norm passes the physical tensor batched at the last dim; the "
        "kernel requires contiguous input"
    ),
    "nn.functional.pdist": (
        "no rule: aten._pdist_forward falls to the slow loop, whose per-example slices of a "
        "tensor batched at the last dim are not contiguous; the kernel requires contiguous"
    ),
    "nn.functional.embedding_bag": (
        "decomposition: aten.embedding_bag's CompositeImplicit kernel gives wrong numbers "
        "when the 1-D indices are batched at a non-zero dim (in_dims=-1)"
    ),
    "chalf": (
        "core: memory_format=torch.channels_last on a batched 4-d logical tensor is applied "
        "to the 5-d physical tensor ('required rank 4 tensor'); torch.func passes this one"
    ),
    # -- torch.func fails these too --------------------------------------------------------
    **_each(
        "both: memory_format=torch.channels_last is applied to the 5-d physical tensor",
        "bfloat16", "bool", "byte", "cdouble", "cfloat", "char", "double", "float", "half",
        "int", "long", "short", "to",
    ),
    **_each(
        "both: as_strided addresses storage, so strides that are right per example are "
        "wrong on the batched storage",
        "as_strided", "as_strided.partial_views", "as_strided_copy", "as_strided_scatter",
    ),
    **_each(
        "both: training-mode batch norm would update unbatched running stats in place with "
        "batched statistics",
        "_batch_norm_with_update", "_native_batch_norm_legit", "native_batch_norm",
        "nn.functional.batch_norm", "nn.functional.instance_norm",
    ),
    "native_group_norm": "both: the kernel requires contiguous input (batched at the last dim)",
    "nn.functional.scaled_dot_product_attention": (
        "both: dropout on attention weights computed from unbatched q, k is in-place random "
        "on an unbatched tensor under randomness='different'"
    ),
    **_each(
        "both: data-dependent Python value (.item()) read from a batched tensor",
        "narrow", "nn.functional.gaussian_nll_loss",
    ),
    "index_put": "both: a batched boolean mask gives a data-dependent shape",
    "masked_select": "both: a batched mask gives a data-dependent shape",
    "resize_": "both: resize_ changes the shape of a batched tensor in place",
    "tensor_split": (
        "both: batched tensor_indices_or_sections are data-dependent split points (here: "
        "'data is not allocated yet')"
    ),
    "view_as_complex": "both: needs stride 1 in the last dim; batched at the last dim it is not",
}

# Popular ops that pass test_vmap_matches_loop but reach the slow per-example loop.
SLOW_LOOP_XFAILS: dict[str, str] = {
    "nn.functional.embedding": (
        "no rule: aten.embedding_renorm_ (the max_norm samples) uses the slow loop"
    ),
    "linspace.tensor_overload": (
        "no rule: aten.copy.default (the functional copy) uses the slow loop; the pointwise "
        "family covers copy_ only"
    ),
    "unique": (
        "no rule: aten._unique2 has a data-dependent output shape; the slow loop works only "
        "when every example gives the same shape (torch.func refuses it)"
    ),
}
