"""Process-level behaviour: a run killed with SIGKILL mid-round resumes from its last completed
step with no duplicated or lost rows; a deployment run through a real local Prefect server."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from rsiflow.stores.store import Store, StoreLockedError
from tests.conftest import REPO, TINY, tiny_overrides

RSIFLOW = [sys.executable, "-m", "rsiflow.flows.cli"]


def _env(tmp_path: Path, **extra) -> dict:
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(REPO), **extra}
    env.pop("PREFECT_API_URL", None)
    return {**env, **extra}


def _completed_steps(db: Path) -> set[str]:
    if not db.exists():
        return set()
    try:
        with Store(db, read_only=True, wait_s=0.2) as s:
            return s.completed_steps("tiny", 1)
    except StoreLockedError:
        return set()


def _sets(args):
    return [a for o in args for a in ("--set", o)]


@pytest.mark.slow
def test_kill_9_mid_round_then_resume(tmp_path):
    db = tmp_path / "store.duckdb"
    cmd = RSIFLOW + ["run", "--config", TINY, *_sets(tiny_overrides(tmp_path))]
    log = open(tmp_path / "first.log", "w")
    # its own process group, so the kill also takes the ephemeral Prefect server it started
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 240
    while "evaluate" not in _completed_steps(db):
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline, "the run never completed its evaluate step"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with Store(db, read_only=True) as s:
        killed_at = s.completed_steps("tiny", 1)
        assert "deploy" not in killed_at, "killed too late to test a resume"
        before = s.con.execute("SELECT traj_id, step FROM trajectories ORDER BY traj_id").fetchall()
        gen_finished = s.con.execute("SELECT finished_at FROM steps WHERE round = 1 AND step = 'generate'").fetchall()

    out = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    con = duckdb.connect(str(db), read_only=True)
    def q(sql):
        return con.execute(sql).fetchall()
    # finished, each step completed once, the steps done before the kill were not run again
    assert q("SELECT status FROM rounds WHERE round = 1") == [("completed",)]
    assert q("SELECT count(*), count(DISTINCT step) FROM steps WHERE round = 1 AND status = 'completed'") == [(6, 6)]
    assert q("SELECT finished_at FROM steps WHERE round = 1 AND step = 'generate'") == gen_finished
    kept = q("SELECT traj_id, step FROM trajectories WHERE step IN ('generate') ORDER BY traj_id")
    assert kept == [r for r in before if r[1] == "generate"]
    # no duplicated and no lost rows
    assert q("SELECT count(*) - count(DISTINCT traj_id) FROM trajectories") == [(0,)]
    assert q("SELECT count(*) - count(DISTINCT (traj_id, turn_idx)) FROM turns") == [(0,)]
    assert q("SELECT count(*) FROM turns") == q("SELECT sum(n_turns) FROM trajectories")
    assert q("SELECT count(*) - count(DISTINCT example_id) FROM examples") == [(0,)]
    assert q("SELECT count(*) FROM gate_decisions") == [(1,)]
    assert q("SELECT count(*) - count(DISTINCT model_id) FROM models") == [(0,)]
    con.close()
    assert f"resuming round 1 of run 'tiny': {sorted(killed_at)} already completed" in out.stdout + out.stderr
    print(f"killed after {sorted(killed_at)}; resumed and finished")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_deployment_run_through_local_prefect_server(tmp_path):
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(tmp_path, PREFECT_API_URL=api)
    procs = []
    try:
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], cwd=tmp_path, env=env,
                                  stdout=open(tmp_path / "server.log", "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(server)
        import urllib.request

        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        serve = subprocess.Popen(RSIFLOW + ["serve", "--config", TINY, *_sets(tiny_overrides(tmp_path))], cwd=REPO,
                                 env=env, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
        procs.append(serve)
        deadline = time.time() + 90
        while True:
            found = subprocess.run([sys.executable, "-m", "prefect", "deployment", "inspect",
                                    "improvement-round/tiny"],
                                   env=env, capture_output=True, text=True, timeout=60)
            if found.returncode == 0:
                break
            assert serve.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "improvement-round/tiny",
                              "--watch", "--watch-timeout", "240"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout[-3000:] + run.stderr[-2000:]
                                     + (tmp_path / "serve.log").read_text()[-3000:])
        with Store(tmp_path / "store.duckdb", read_only=True) as s:
            assert s.round_status("tiny", 1) == "completed"
            assert s.champion("tiny") is not None
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
