"""Every benchmark builds, and each implementation it times computes what torch.func
computes (the check ``make bench`` runs before timing), so a change cannot break
``make bench`` unnoticed. The inductor group compiles for half a minute: ``make bench``
alone checks it. The TPC-H group is built at scale 0.01 (60,000 line items) rather than
1, whose data takes most of a minute to make and load."""

import warnings

import pytest

from benchmarks import groups
from benchmarks.groups import GROUPS
from benchmarks.run import check


@pytest.mark.parametrize("key", [key for key in GROUPS if key != "inductor"])
def test_every_benchmark_builds_and_agrees_with_torch_func(key, monkeypatch):
    monkeypatch.setattr(groups, "TPCH_SCALE", 0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.func's fallback and compile warnings
        benchmarks = GROUPS[key].build()
    assert benchmarks
    for benchmark in benchmarks:
        check(benchmark)
