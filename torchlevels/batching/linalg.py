"""Own rules for linear algebra, mostly the family of ops that already take leading batch dims."""

from __future__ import annotations
