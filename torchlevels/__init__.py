"""torchlevels: composable function transforms where every level is a fresh Tensor subclass."""

from torchlevels._level import (
    EscapedTensorError,
    Level,
    LevelTensor,
    UnrelatedLevelsError,
    enter_level,
)
from torchlevels.autodiff import grad_level, jvp_level
from torchlevels.batching.registry import register as register_batching_rule
from torchlevels.custom_function import VmapInfo
from torchlevels.tools import (
    DataDependentError,
    ForwardingLevel,
    compile,
    count_flops,
    log_ops,
    trace,
)
from torchlevels.transforms import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    stack_module_state,
    vjp,
)
from torchlevels.vmap import vmap

__all__ = [
    "DataDependentError",
    "EscapedTensorError",
    "ForwardingLevel",
    "Level",
    "LevelTensor",
    "UnrelatedLevelsError",
    "VmapInfo",
    "compile",
    "count_flops",
    "enter_level",
    "functional_call",
    "grad",
    "grad_and_value",
    "grad_level",
    "hessian",
    "jacfwd",
    "jacrev",
    "jvp",
    "jvp_level",
    "linearize",
    "log_ops",
    "register_batching_rule",
    "stack_module_state",
    "trace",
    "vjp",
    "vmap",
]
