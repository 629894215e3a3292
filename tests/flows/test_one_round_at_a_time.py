"""Operations under Prefect: two starters of one run never run a round twice; `self-improve` runs its rounds
under its own lease (no deadlock) and names and tags its flow runs; deployments are named after the run,
and serving says what it replaces of a deployment `prefect deploy` registered."""

import os
import re
import subprocess
import sys

import duckdb
import pytest

from rsiflow.configs.loader import load_config
from tests.conftest import REPO, TINY, prefect_home, tiny_overrides

RSIFLOW = [sys.executable, "-m", "rsiflow.flows.cli"]
DEFAULT = str(REPO / "configs" / "default.yaml")


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.slow
def test_two_rsiflow_runs_at_once_run_the_round_once(tmp_path):
    """Both start together; one holds the run and does round 1, the other waits for it, finds the run has its
    rounds and exits without running anything."""
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    cmd = RSIFLOW + ["run", "--config", TINY, "--wait", "900", *_sets(tiny_overrides(tmp_path))]
    logs = [tmp_path / f"run{i}.log" for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for log in logs]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n----\n".join(o[-3000:] for o in out)
    started = [o.count("round 1 of run 'tiny' starting: champion tiny/base") for o in out]
    assert sorted(started) == [0, 1], started          # one process ran the round, once
    waiter = out[started.index(0)]
    assert re.search(r"waiting up to 900 s for the round running under (flow run 'tiny-round-1'|a process) "
                     r"on host \S+ \(pid \d+\)", waiter), waiter[-3000:]
    assert "run 'tiny': 1 round(s) completed" in waiter

    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    def q(sql):
        return con.execute(sql).fetchall()
    assert q("SELECT round, status FROM rounds ORDER BY round") == [(1, "completed")]
    assert q("SELECT count(*), count(DISTINCT step) FROM steps WHERE round = 1 AND status = 'completed'") == [(6, 6)]
    assert q("SELECT count(*) FROM steps WHERE round = 1 AND status <> 'completed'") == [(0,)]
    assert q("SELECT count(*) FROM gate_decisions") == [(1,)]
    assert q("SELECT count(*) - count(DISTINCT traj_id) FROM trajectories") == [(0,)]
    assert q("SELECT count(*) - count(DISTINCT (traj_id, turn_idx)) FROM turns") == [(0,)]
    assert q("SELECT count(*) - count(DISTINCT example_id) FROM examples") == [(0,)]
    assert q("SELECT count(*) - count(DISTINCT model_id) FROM models") == [(0,)]
    assert q("SELECT count(*) FROM leases") == [(0,)]          # given back
    con.close()


def test_self_improve_holds_the_lease_names_and_tags_its_flow_runs(tmp_path, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, LogFilter, LogFilterFlowRunId

    from rsiflow.flows.round import run_tags
    from rsiflow.flows.self_improve import self_improve
    from rsiflow.stores import Store

    overrides = tiny_overrides(tmp_path, "run.name=lease-si")
    cfg = load_config([TINY], overrides)
    state = self_improve([TINY], overrides, rounds=1, return_state=True)
    assert state.is_completed(), state.message
    assert [r["round"] for r in state.result()] == [1]
    with Store(cfg.run.store) as s:
        assert s.last_completed_round("lease-si") == 1 and s.lease("lease-si") is None

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["run:lease-si"])))
        by_name = {r.name: r for r in runs}
        assert set(by_name) == {"lease-si-self-improve", "lease-si-round-1"}
        assert by_name["lease-si-self-improve"].id == state.state_details.flow_run_id
        for r in runs:
            assert set(run_tags(cfg)) <= set(r.tags) and r.state.is_completed()
        assert {"rsiflow", "run:lease-si", "env:household"} <= set(run_tags(cfg))
        assert all(f"method:{m}" in run_tags(cfg) for m in cfg.distill.methods)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[by_name["lease-si-round-1"].id])))
    assert "round 1 of run 'lease-si' starting: champion lease-si/base" in [log.message for log in logs]


def test_serve_names_deployments_after_the_run_and_says_what_it_replaces(tmp_path, prefect_api, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    from rsiflow.flows.cli import deployment_changes, serve_deployments

    monkeypatch.chdir(REPO)
    tiny = serve_deployments([TINY], [], load_config([TINY]), None)
    assert [f"{d.flow_name}/{d.name}" for d in tiny] == ["improvement-round/tiny", "self-improve/tiny"]
    for d in tiny:
        d.apply()
    with get_client(sync_client=True) as client:
        with pytest.raises(ObjectNotFound):          # serving tiny registers nothing of the default run
            client.read_deployment_by_name("improvement-round/default")
        got = client.read_deployment_by_name("improvement-round/tiny")
        assert got.parameters == {"config": [TINY], "overrides": []} and got.schedules == []
        assert got.global_concurrency_limit.limit == 1
        assert got.concurrency_options.collision_strategy.value == "ENQUEUE"
        assert {"rsiflow", "run:tiny"} <= set(got.tags)
        client.create_work_pool(WorkPoolCreate(name="rsiflow-process", type="process"))

    # prefect.yaml registers the default run's deployments for the process work pool
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    with get_client(sync_client=True) as client:
        got = client.read_deployment_by_name("improvement-round/default")
    assert got.work_pool_name == "rsiflow-process" and got.parameters["config"] == ["configs/default.yaml"]
    assert [(s.schedule.cron, s.active) for s in got.schedules] == [("0 */6 * * *", False)]
    assert got.global_concurrency_limit.limit == 1

    # serving the default config would take those over: it says what it replaces (the same config, given as an
    # absolute path, is not a change)
    served = serve_deployments([DEFAULT], [], load_config([DEFAULT]), "* * * * *")
    assert [f"{d.flow_name}/{d.name}" for d in served] == ["improvement-round/default", "self-improve/default"]
    changes = deployment_changes(served)
    assert len(changes) == 3, changes
    assert changes[0] == ("deployment 'improvement-round/default' exists; serving replaces its schedules "
                          "cron '0 */6 * * *' (inactive) -> cron '* * * * *'")
    assert changes[1].startswith("deployment 'improvement-round/default' keeps work pool 'rsiflow-process'")
    assert changes[2].startswith("deployment 'self-improve/default' keeps work pool 'rsiflow-process'")
    for d in served:
        d.apply()
    # serving again: only the work pool it keeps is worth a word
    assert [c.split(" keeps ")[0] for c in deployment_changes(served)] == [
        "deployment 'improvement-round/default'", "deployment 'self-improve/default'"]
    other = serve_deployments([DEFAULT], ["train.epochs=1"], load_config([DEFAULT], ["train.epochs=1"]), None)
    changes = deployment_changes(other)
    assert "parameters" in changes[0] and "schedules cron '* * * * *' -> none" in changes[0]

    # and `prefect deploy` puts prefect.yaml's schedule back rather than keeping serve's cron
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    with get_client(sync_client=True) as client:
        got = client.read_deployment_by_name("improvement-round/default")
    assert [(s.schedule.cron, s.active) for s in got.schedules] == [("0 */6 * * *", False)]
