"""Own rules for the matmul family: mm, bmm, addmm, matmul, linear, dot, mv."""

from __future__ import annotations
