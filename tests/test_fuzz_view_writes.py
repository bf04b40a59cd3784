"""The differential fuzzer of writes through views (scripts/fuzz_view_writes.py) on a few
hundred cases: vmap against a loop, autodiff transforms against torch.func."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "fuzz_view_writes.py"


def test_a_few_hundred_fuzzed_writes_through_views_match():
    done = subprocess.run([sys.executable, str(SCRIPT), "--cases", "300", "--start", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "'both ok'" in done.stdout  # cases ran, not only refusals
