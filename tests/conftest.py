"""Shared pytest setup for the tests/ suite.

``TORCHLEVELS_TEST_DEVICE=cuda`` runs the whole suite with that device as torch's default
(``torch.set_default_device``), so every tensor a test makes without naming a device is
made there: the way to run the suite on a GPU machine. TF32 is then turned off, so
results are compared in full float32 precision as on the CPU. A test marked
``@pytest.mark.cpu_only("why")`` is skipped on any other device.
"""

import os

import pytest
import torch
from torch.testing._internal import common_utils
from torch.testing._internal.opinfo import core as opinfo_core
from vmap_reference import fresh_start

# pytest-xdist runs a worker per core: each worker's torch would run a pool of a thread per
# core too, and the workers' OpenMP threads, spinning while they wait, took the cores from
# each other (the suite ran 15-45% slower)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _no_test_case() -> None:
    """None: what torch.testing's ``extract_test_fn`` finds here, where no test is a
    unittest.TestCase. It looks with ``inspect.stack()``, which reads the source of every
    frame: three quarters of the OpInfo sweeps' time went on it, at each sample iterator
    an OpInfo made."""
    return None


common_utils.extract_test_fn = opinfo_core.extract_test_fn = _no_test_case

_DEVICE = os.environ.get("TORCHLEVELS_TEST_DEVICE")
if _DEVICE:
    torch.set_default_device(_DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cpu_only(why): the test's expectations hold on the CPU only; skipped "
        "when TORCHLEVELS_TEST_DEVICE names another device")


def pytest_collection_modifyitems(config, items):
    if torch.get_default_device().type == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker:
            item.add_marker(pytest.mark.skip(reason=f"CPU only: {marker.args[0]}"))


@pytest.fixture(autouse=True)
def _fresh_start():
    """Before each test: re-arm the once-per-op slow-loop warning and seed torch with 0."""
    fresh_start(0)
