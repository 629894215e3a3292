"""bench.packed end to end on the tiny model: it plays with and without packed Linear layers, greedy and sampled,
and says how many episodes generated the same tokens."""

import re
import subprocess
import sys

import pytest

from rsiflow.models.packed_linear import available
from tests.conftest import REPO


@pytest.mark.skipif(available() is not None, reason=f"no packed Linear layers here: {available()}")
def test_bench_packed_prints_both_plays_and_their_agreement():
    out = subprocess.run([sys.executable, "-m", "bench.packed", "--model", "tiny:0", "--episodes", "3",
                          "--max-turns", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for temperature in ("0", "1"):
        assert re.search(rf"T={temperature} pytorch: backend.generate [0-9.]+ s", out.stdout), out.stdout
        assert re.search(rf"T={temperature} packed : backend.generate [0-9.]+ s", out.stdout), out.stdout
        same = re.search(rf"T={temperature} packed / pytorch: .* same generations (\d+)/3", out.stdout)
        assert same and int(same.group(1)) == 3, out.stdout
