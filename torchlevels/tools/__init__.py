"""Tools as levels: flop counting, op logging, tracing and compiled replay."""

from torchlevels.tools.flops import count_flops
from torchlevels.tools.forwarding import ForwardingLevel
from torchlevels.tools.oplog import log_ops
from torchlevels.tools.trace import DataDependentError, compile, trace

__all__ = [
    "DataDependentError", "ForwardingLevel", "compile", "count_flops", "log_ops", "trace",
]
