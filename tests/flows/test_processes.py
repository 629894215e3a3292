"""Process-level behaviour: a run killed with SIGKILL mid-round resumes from its last completed
step with no duplicated or lost rows; deployments from a config on a work pool with a worker, then taken over by
`rsiflow serve`, against a real local Prefect server."""

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
from tests.conftest import REPO, TINY, prefect_home, tiny_overrides

RSIFLOW = [sys.executable, "-m", "rsiflow.flows.cli"]


def _env(tmp_path: Path, **extra) -> dict:
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO), **extra}
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


def _wait_for_deployment(env: dict, name: str, proc: subprocess.Popen, log: Path, served: bool = False) -> None:
    """Until the deployment exists (`served`: and has no work pool, i.e. a serve process registered it)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.time() + 90
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        while True:
            try:
                if not served or client.read_deployment_by_name(name).work_pool_name is None:
                    return
            except ObjectNotFound:
                pass
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)


def _trigger(env: dict, name: str, *logs: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", name, "--watch", "--watch-timeout",
                          "240"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:] + "".join(
        log.read_text()[-3000:] for log in logs if log.exists())


@pytest.mark.slow
def test_deploy_from_config_worker_round_then_serve_takes_over(tmp_path):
    """`rsiflow deploy` registers the run's deployments on a work pool from the config alone (tags, description,
    concurrency, working folder); `rsiflow serve` refuses to take them without --take-over; a worker started in
    the background (SIGINT ignored, as a script's `&` leaves it) runs a round and stops on SIGTERM; then serve
    takes the deployment over and runs the next round."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = _env(tmp_path, PREFECT_API_URL=api)
    sets = _sets(tiny_overrides(tmp_path))
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

        deploy = subprocess.run(RSIFLOW + ["deploy", "--config", TINY, *sets], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=120)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        assert "created work pool 'rsiflow-process'" in deploy.stdout and "rsiflow worker --pool" in deploy.stdout
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            d = client.read_deployment_by_name("improvement-round/tiny")
            assert d.work_pool_name == "rsiflow-process" and d.job_variables == {"working_dir": str(REPO)}
            assert set(d.tags) == {"rsiflow", "run:tiny", "env:household", "method:exit"}
            assert "run 'tiny'" in d.description and "configs/tiny.yaml" in d.description
            assert d.global_concurrency_limit.limit == 1 and d.concurrency_options.collision_strategy == "ENQUEUE"
            assert d.parameters["config"] == [TINY]
            assert client.read_deployment_by_name("self-improve/tiny").work_pool_name == "rsiflow-process"

        refused = subprocess.run(RSIFLOW + ["serve", "--config", TINY, *sets], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "on work pool 'rsiflow-process'" in refused.stderr
        assert "--take-over" in refused.stderr and "Traceback" not in refused.stderr

        worker_log = tmp_path / "worker.log"
        worker = subprocess.Popen(RSIFLOW + ["worker", "--pool", "rsiflow-process"], cwd=tmp_path, env=env,
                                  stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        procs.append(worker)
        _trigger(env, "improvement-round/tiny", worker_log)
        with Store(tmp_path / "store.duckdb", read_only=True) as s:
            assert s.round_status("tiny", 1) == "completed"
            (ran,) = s.round_flow_runs("tiny", 1)
            assert ran["flow_run_name"] == "tiny-round-1" and ran["deployment_id"] == str(d.id)
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)   # a worker that ignored it would be killed in `finally` and fail here

        serve_log = tmp_path / "serve.log"
        serve = subprocess.Popen(RSIFLOW + ["serve", "--config", TINY, *sets, "--take-over"], cwd=REPO, env=env,
                                 stdout=open(serve_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(serve)
        _wait_for_deployment(env, "improvement-round/tiny", serve, serve_log, served=True)
        _trigger(env, "improvement-round/tiny", serve_log)
        with Store(tmp_path / "store.duckdb", read_only=True) as s:
            assert s.round_status("tiny", 2) == "completed"
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
