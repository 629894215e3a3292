"""The same config run twice gives the same figures: two `rsiflow run`s of one config (two tiny ExIt and two tiny
GRPO rounds on the coin env, whose groups come out mixed, each run in its own folder, both at once) leave the same
rows in every table, by key (time-dependent columns and each folder's own path aside), and the same checkpoint
bytes. Without this, no comparison of two configs means anything."""

import os
import subprocess
import sys

import pytest

from bench.identity import diff
from tests.conftest import REPO, TINY, prefect_home

pytestmark = pytest.mark.slow


def _start(folder, model_cache, *extra) -> subprocess.Popen:
    folder.mkdir()
    cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run", "--config", TINY, "--set", "run.store=runs/same.duckdb",
           "--set", "run.run_dir=runs/{name}", "--set", f"run.model_cache={model_cache}", "--set", "run.rounds=2",
           *[a for kv in extra for a in ("--set", kv)]]
    env = {**os.environ, "PREFECT_HOME": prefect_home(folder / "prefect"), "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with open(folder / "out.log", "w") as log:
        return subprocess.Popen(cmd, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("method", ["exit", "grpo"])
def test_the_same_config_run_twice_leaves_the_same_rows_and_checkpoints(tmp_path, model_cache, method):
    # The two runs at once, one thread each, fixed: the same figures to the last bit need the same thread count
    # (models/threads.py), which `auto` would make depend on what else computes while the test runs.
    extra = [f"distill.methods=[{method}]", "run.threads=1",
             "env.name=tests.flows.test_grpo_round:CoinEnv", "env.kwargs={}", "env.max_turns=1",
             "env.show_admissible=false", "env.project_actions=false"]
    runs = {name: _start(tmp_path / name, model_cache, *extra) for name in ("a", "b")}
    try:
        for name, proc in runs.items():
            assert proc.wait(timeout=900) == 0, (tmp_path / name / "out.log").read_text()[-6000:]
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = diff(tmp_path / "a", tmp_path / "b", ["runs/same.duckdb"])
    assert result["rows"] > 100 and result["checkpoints_compared"] >= 1
    assert not result["tables"] and not result["checkpoints"], result
