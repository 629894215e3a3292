"""The same config run twice gives the same figures: two `rsiflow run`s of one config (two tiny ExIt and two tiny
GRPO rounds on the coin env, whose groups come out mixed, each run in its own folder) leave the same rows in every
table, by key (time-dependent columns and each folder's own path aside), and the same checkpoint bytes. Without
this, no comparison of two configs means anything."""

import os
import subprocess
import sys

import pytest

from bench.identity import diff
from rsiflow.models import threads
from tests.conftest import REPO, TINY

pytestmark = pytest.mark.slow


def _run(folder, model_cache, *extra):
    folder.mkdir()
    cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run", "--config", TINY, "--set", "run.store=runs/same.duckdb",
           "--set", "run.run_dir=runs/{name}", "--set", f"run.model_cache={model_cache}", "--set", "run.rounds=2",
           *[a for kv in extra for a in ("--set", kv)]]
    env = {**os.environ, "PREFECT_HOME": str(folder / "prefect"), "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("method", ["exit", "grpo"])
def test_the_same_config_run_twice_leaves_the_same_rows_and_checkpoints(tmp_path, model_cache, method):
    # run.threads as auto would give a run alone on this machine's cores, fixed: the same figures to the last bit
    # need the same thread count (models/threads.py), whatever else computes while the test runs
    extra = [f"distill.methods=[{method}]", f"run.threads={threads.machine_cores()}",
             "env.name=tests.flows.test_grpo_round:CoinEnv", "env.kwargs={}", "env.max_turns=1",
             "env.show_admissible=false", "env.project_actions=false"]
    _run(tmp_path / "a", model_cache, *extra)
    _run(tmp_path / "b", model_cache, *extra)
    result = diff(tmp_path / "a", tmp_path / "b", ["runs/same.duckdb"])
    assert result["rows"] > 100 and result["checkpoints_compared"] >= 1
    assert not result["tables"] and not result["checkpoints"], result
