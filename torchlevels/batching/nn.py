"""Own rules for neural-network ops: convolution, pooling, norms, losses."""

from __future__ import annotations
