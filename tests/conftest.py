"""Shared pytest setup for the tests/ suite."""

import pytest
from vmap_reference import fresh_start


@pytest.fixture(autouse=True)
def _fresh_start():
    """Before each test: re-arm the once-per-op slow-loop warning and seed torch with 0."""
    fresh_start(0)
