"""Own rules for indexing ops: index, index_put, gather, scatter, index_select, embedding."""

from __future__ import annotations
