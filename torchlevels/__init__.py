"""torchlevels: composable function transforms where every level is a fresh Tensor subclass."""

# torch.func's own: plain utilities, and functionalize, which runs inside levels
# (rearrange is functorch.einops' own; torch.func re-exports it from 2.13 on, and the GPU
# machines' torch is 2.11)
from functorch.einops import rearrange
from torch.func import functionalize, replace_all_batch_norm_modules_

# wrap autograd.grad, torch.cond, RNN ops, F.l1_loss (whose own drops weight= for
# subclasses) and Tensor.data's setter (whose own would crash on a level's tensor)
from torchlevels import autograd_grad, cond, data_assignment, l1_loss_weight, lifting  # noqa: F401
from torchlevels._level import (
    EscapedTensorError,
    Level,
    LevelTensor,
    UnrelatedLevelsError,
    autograd_on,
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
    debug_unwrap,
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
    "autograd_on",
    "compile",
    "count_flops",
    "debug_unwrap",
    "enter_level",
    "functional_call",
    "functionalize",
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
    "rearrange",
    "register_batching_rule",
    "replace_all_batch_norm_modules_",
    "stack_module_state",
    "trace",
    "vjp",
    "vmap",
]
