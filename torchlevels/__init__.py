"""torchlevels: composable function transforms where every level is a fresh Tensor subclass."""

from torchlevels._level import EscapedTensorError, LevelTensor, UnrelatedLevelsError
from torchlevels.batching.registry import register as register_batching_rule
from torchlevels.vmap import vmap

__all__ = [
    "EscapedTensorError",
    "LevelTensor",
    "UnrelatedLevelsError",
    "register_batching_rule",
    "vmap",
]
