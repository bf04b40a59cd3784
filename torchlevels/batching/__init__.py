"""Batching rules: the registry and one module per op family (importing registers them)."""

from torchlevels.batching import (  # noqa: F401
    composite,
    data_dependent,
    forward_ad,
    indexing,
    linalg,
    matmul,
    nn,
    pointwise,
    random,
    reductions,
    views,
)
from torchlevels.batching.registry import builtins_loaded

builtins_loaded()
