"""bench.round: exclusive-time attribution, and a tiny round attributed end to end."""

import os
import re
import subprocess
import sys
import time

import pytest

from bench.round import Attribution
from tests.conftest import REPO, TINY, prefect_home


def test_attribution_charges_the_innermost_category():
    t0 = time.perf_counter()
    a = Attribution(base="prefect")
    time.sleep(0.02)
    a.push("other")
    time.sleep(0.02)
    a.push("store", "Store.__init__")
    time.sleep(0.05)
    a.pop()
    a.pop()
    secs = a.snapshot()
    elapsed = time.perf_counter() - t0
    # sleeps overshoot on a loaded machine: check lower bounds and that nothing is lost or counted twice
    assert secs["store"] >= 0.049 and secs["other"] >= 0.019 and secs["prefect"] >= 0.019
    assert sum(secs.values()) == pytest.approx(elapsed, abs=0.005)
    assert a.calls == {"other": 1, "store": 1}
    assert a.detail[("store", "Store.__init__")] == secs["store"]


def test_instrument_finds_every_function_it_times():
    """Every function `instrument` wraps still exists under the name it patches (a renamed or moved one fails here,
    in a few seconds, instead of in the slow tier's tiny round). A subprocess: the patches are process-wide."""
    code = ("from bench.round import instrument\n"
            "import rsiflow.models.loading as loading, rsiflow.models.hf_backend as hb\n"
            "import rsiflow.tasks.diagnostics as diagnostics\n"
            "instrument('household')\n"
            "assert loading.resolve_base_model.__bench_wrapped__ and hb.HFBackend.generate.__bench_wrapped__\n"
            "assert diagnostics._action_logprobs.__bench_wrapped__\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow
def test_bench_round_on_tiny(tmp_path):
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("PREFECT_API_URL", None)
    res = subprocess.run([sys.executable, "-m", "bench.round", "--config", TINY, "--store", str(tmp_path / "s.duckdb"),
                          "--run-dir", str(tmp_path / "runs")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert not list((tmp_path / "tmp").glob("rsiflow-bench-round-*"))   # its temporary folder is removed
    out = res.stdout
    wall, attributed = map(float, re.search(r"wall ([\d.]+) s \(attributed ([\d.]+) s\)", out).groups())
    assert attributed == pytest.approx(wall, rel=0.02)
    cats = {m.group(1).strip(): float(m.group(2)) for m in
            re.finditer(r"^  (generate|model load|env|train|store|report|prefect|other)\s+([\d.]+)", out, re.M)}
    assert len(cats) == 8 and sum(cats.values()) == pytest.approx(wall, rel=0.02)
    assert cats["generate"] > 0 and cats["store"] > 0 and cats["env"] > 0 and cats["prefect"] > 0
    share = re.search(r"orchestration \(prefect \+ store\) / round wall = [\d.]+ / [\d.]+ s = ([\d.]+)", out)
    share = float(share.group(1))
    assert share == pytest.approx((cats["prefect"] + cats["store"]) / wall, abs=0.01)
