"""`rsiflow status` shows each round's steps with state and duration, and the error of a failed step; a step
left 'running' by a process that died (nobody holds the run's lease) shows as interrupted."""

from datetime import UTC, datetime, timedelta

import pytest

from rsiflow.flows.cli import main
from rsiflow.stores import Store
from tests.conftest import TINY, tiny_overrides


def test_status_lists_steps_with_state_duration_and_error(tmp_path, capsys):
    path = tmp_path / "store.duckdb"
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    now = datetime.now(UTC).replace(tzinfo=None)   # the store's timestamps are naive UTC
    with Store(path) as s:
        s.create_run("tiny", "tiny", {}, "tiny:0")
        with s.step("tiny", 0, "init", started_at=t0) as tx:
            tx.insert("models", [{"model_id": "tiny/base", "path": "/m", "role": "base"}])
        s.start_round("tiny", 1, "tiny/base")
        with s.step("tiny", 1, "generate", started_at=now - timedelta(seconds=42)):
            pass
        with pytest.raises(RuntimeError), s.step("tiny", 1, "evaluate"):
            raise RuntimeError("judge backend unreachable\nsecond line of the error")
        # what a process killed inside a step leaves (a step's rows and status commit together at its end)
        s.con.execute("INSERT INTO steps (run_id, round, step, status, started_at) VALUES "
                      "('tiny', 1, 'distill', 'running', ?)", [datetime.now(UTC).replace(tzinfo=None)])
    status = ["status", "--config", TINY, *[a for o in tiny_overrides(tmp_path) for a in ("--set", o)]]
    main(status)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run 'tiny'  store {path}"
    assert out[1].startswith("champion: tiny/base   completed rounds: 0   lease: free (no round running)")
    assert out[2] == "round 0  setup"
    assert out[3].split()[:2] == ["init", "completed"]
    assert out[4].startswith("round 1  interrupted") and out[4].endswith("champion tiny/base")
    generate, evaluate, distill = out[5].split(), out[6].split(), out[7].split()
    assert generate[:2] == ["generate", "completed"] and 41.0 <= float(generate[2]) < 120 and generate[3] == "s"
    assert evaluate[:2] == ["evaluate", "failed"]
    assert out[6].endswith("RuntimeError: judge backend unreachable")   # the first line of the error
    assert distill[:2] == ["distill", "interrupted"]
    assert out[8:] == ["  train     pending", "  gate      pending", "  deploy    pending",
                       "  resume: `rsiflow run` resumes here"]
    assert not capsys.readouterr().err


def test_status_of_an_interrupted_deployment_round(tmp_path, capsys):
    """A round a deployment's flow run ran and nobody runs any more: its wall time ends at its last recorded
    step (not now), and status says to retry that flow run."""
    path = tmp_path / "store.duckdb"
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    with Store(path) as s:
        s.create_run("tiny", "tiny", {}, "tiny:0")
        s.start_round("tiny", 1, "tiny/base")
        s.con.execute("UPDATE rounds SET started_at = ? WHERE round = 1", [t0])
        s.record_flow_run("tiny", 1, "f-1", "tiny-round-1", deployment_id="d-1")
        with s.step("tiny", 1, "generate", started_at=t0):
            pass
        s.con.execute("UPDATE steps SET finished_at = ? WHERE step = 'generate'", [t0 + timedelta(minutes=12)])
    main(["status", "--config", TINY, *[a for o in tiny_overrides(tmp_path) for a in ("--set", o)]])
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "round 1  interrupted  12.0 min  champion tiny/base"
    assert out[4].split()[:2] == ["evaluate", "interrupted"]
    assert "retry flow run 'tiny-round-1' (UI: Retry, or `prefect flow-run retry tiny-round-1`)" in out[4]


def test_status_of_a_round_in_progress(tmp_path, capsys):
    """Steps write their rows and status in one transaction at their end: while one runs, status shows the step
    after the last recorded one as running under the lease's holder, or interrupted when nobody holds the run."""
    path = tmp_path / "store.duckdb"
    with Store(path) as s:
        s.create_run("tiny", "tiny", {}, "tiny:0")
        s.start_round("tiny", 1, "tiny/base")
        with s.step("tiny", 1, "generate"):
            pass
    status = ["status", "--config", TINY, *[a for o in tiny_overrides(tmp_path) for a in ("--set", o)]]
    main(status)
    out = capsys.readouterr().out.splitlines()
    assert out[4].split()[:2] == ["evaluate", "interrupted"] and out[4].endswith("`rsiflow run` resumes here)")
    assert [line.split() for line in out[5:]] == [[step, "pending"] for step in ("distill", "train", "gate",
                                                                                  "deploy")]
    with Store(path) as s:
        s.acquire_lease("tiny", "holder-1", 60, "host-a", 123, flow_run_name="tiny-round-1")
    main(status)
    out = capsys.readouterr().out.splitlines()
    assert "lease: flow run 'tiny-round-1' on host host-a (pid 123)" in out[1]
    assert out[4].split()[:3] == ["evaluate", "running", "for"]
