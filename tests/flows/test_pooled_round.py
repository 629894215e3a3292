"""Steps on Prefect work pools (flows/pooled.py, `prefect.pools`): the config's validation (fast), and a tiny round
whose six steps run as flow runs on two process work pools served by two real `prefect worker start` processes
against a real Prefect server (slow), checked from the store, the Prefect API and the workers' logs, and against
the same round run in one process."""

import json
import os
import shutil
from uuid import UUID

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from tests.conftest import TINY, tiny_overrides

# SRD's template notes give the tiny round training examples (so train, gate and deploy do real work); no KV reuse
# across calls, so a step in a fresh process samples exactly what it samples in a long-lived one (bench/chaos.py);
# one thread, fixed: on `auto` a step's thread count depends on what else computes (another test under pytest-xdist),
# and decoding logprobs differ in the last bits between thread counts (models/threads.py).
SETS = ["distill.methods=[exit,srd]", "distill.srd.note_writer=template", "backend.hf.kv_reuse=false",
        "prefect.retries=0", "run.threads=1"]
POOLS = {"generate": "inference", "evaluate": "inference", "distill": "inference", "train": "training",
         "gate": "inference", "deploy": "inference"}
POOLS_SET = "prefect.pools={" + ", ".join(f"{k}: {v}" for k, v in POOLS.items()) + "}"


def test_pools_default_to_one_process_and_name_a_bad_step(tmp_path):
    assert load_config([TINY], []).prefect.pools == {}
    cfg = load_config([TINY], ["prefect.pools={train: training, gate: inference}"])
    assert cfg.prefect.pools == {"train": "training", "gate": "inference"}
    with pytest.raises(ConfigError, match=r"--set prefect.pools=\{trian: training\}: prefect.pools: unknown step "
                                          r"'trian' \(steps: generate, evaluate, distill, train, gate, deploy\)"):
        load_config([TINY], ["prefect.pools={trian: training}"])
    with pytest.raises(ConfigError, match="prefect.pools: step 'train': empty work pool name"):
        load_config([TINY], ["prefect.pools={train: ' '}"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefect:\n  pools: {deploy: inference, redeploy: inference}\n")
    with pytest.raises(ConfigError, match=f"{bad}: prefect.pools: unknown step 'redeploy'"):
        load_config([TINY, str(bad)], [])
    with pytest.raises(ConfigError, match="prefect.pool_start_timeout_s"):
        load_config([TINY], ["prefect.pool_start_timeout_s=0"])


def test_the_schema_knows_the_pipeline_steps():
    from rsiflow.tasks.common import STEPS

    for step in STEPS:
        load_config([TINY], [f"prefect.pools={{{step}: p}}"])


def test_a_step_run_gets_the_validated_config_with_shared_paths_absolute(tmp_path, monkeypatch):
    from rsiflow.flows.pooled import config_from_payload, config_payload, deployment_name

    monkeypatch.chdir(tmp_path)
    cfg = load_config([TINY], ["run.store=rel/store.duckdb", "run.run_dir=rel/{name}", POOLS_SET])
    payload = config_payload(cfg)
    assert payload["run"]["store"] == str(tmp_path / "rel" / "store.duckdb")
    assert payload["run"]["run_dir"] == str(tmp_path / "rel" / "{name}")
    assert os.path.isabs(payload["run"]["model_cache"])
    back = config_from_payload(payload)
    assert back.run_dir == tmp_path / "rel" / "tiny"
    same = {**cfg.model_dump(), "run": back.run.model_dump()}
    assert back.model_dump() == same   # nothing else changed on the way
    assert deployment_name(cfg, "train") == "rsiflow-step/tiny-train"
    with pytest.raises(ConfigError, match="not valid here"):
        config_from_payload({**payload, "nonsense": 1})


def test_pooled_round_needs_a_server_the_workers_reach(tmp_path, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from rsiflow.flows.pooled import check_pools

    # No API address anywhere: not in the environment, and not in Prefect's settings context either (the session's
    # `prefect_api` harness sets one there when a slow test ran earlier in the same pytest process).
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert not PREFECT_API_URL.value()
        check_pools(load_config([TINY], tiny_overrides(tmp_path)))   # no pools: nothing to check
        with pytest.raises(ConfigError, match=r"prefect.pools \(from --set prefect.pools=.*\) runs steps on work "
                                              r"pools, which needs a Prefect server"):
            check_pools(load_config([TINY], tiny_overrides(tmp_path, "prefect.pools={train: training}")))


def _q(store, sql, *params):
    import duckdb

    con = duckdb.connect(str(store), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_a_round_with_its_steps_on_two_process_pools(tmp_path, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from bench.chaos import compare, table_rows
    from bench.round import process_workers
    from rsiflow.flows.errors import StepFailed
    from rsiflow.flows.pooled import check_pools
    from rsiflow.flows.pooled_step import deploy_steps
    from rsiflow.flows.round import improvement_round
    from rsiflow.tasks.common import STEPS
    from rsiflow.tasks.setup import config_differences

    pooled, ref = tmp_path / "pooled", tmp_path / "ref"
    overrides = tiny_overrides(pooled, *SETS, POOLS_SET)
    cfg = load_config([TINY], overrides)
    with pytest.raises(ConfigError, match="deployment 'rsiflow-step/tiny-generate' is not registered"):
        check_pools(cfg)
    lines = deploy_steps(cfg)
    assert "work pool 'inference' created (type process)" in lines and len(lines) == 2 + len(STEPS)
    check_pools(cfg)
    assert deploy_steps(cfg)[:2] == ["work pool 'inference' exists (type process)",
                                     "work pool 'training' exists (type process)"]   # again: idempotent

    # workers poll every 2 s (Prefect's default 10 s would add up to 8 s more per step)
    with process_workers({"inference", "training"}, PREFECT_API_URL.value(), tmp_path, query_s=2) as workers:
        result = improvement_round([TINY], overrides)
        # The same round in one process (no pools) leaves the same rows
        one = improvement_round([TINY], tiny_overrides(ref, *SETS))
        assert one["round"] == 1 and "flow_run" not in one["results"]["train"]
        a, b = table_rows(ref / "store.duckdb", ref), table_rows(pooled / "store.duckdb", pooled)
        diff = {t: compare(a.get(t, []), b.get(t, [])) for t in sorted((set(a) | set(b)) - {"runs"})}
        assert sum(d["reference"] for d in diff.values()) > 100
        assert {t: d for t, d in diff.items() if d["lost"] or d["duplicate"] or d["changed"]} == {}, diff
        # the runs table holds each run's config: they differ in prefect.pools only, an operational key
        (stored,), = _q(pooled / "store.duckdb", "SELECT config FROM runs")
        assert config_differences(json.loads(stored), load_config([TINY], tiny_overrides(ref, *SETS))) == []
        # A step that fails on its worker fails the round in one line, as it would in one process: round 2's
        # generate finds no checkpoint of the champion it should serve.
        (champion_path,), = _q(pooled / "store.duckdb",
                               "SELECT path FROM models WHERE role = 'champion' AND run_id = 'tiny'")
        shutil.rmtree(champion_path)
        with pytest.raises(StepFailed) as failed:
            improvement_round([TINY], overrides)
    assert all(p.left == set() for p in workers.values()), {k: p.left for k, p in workers.items()}
    message = str(failed.value)
    assert message.startswith("round 2 of run 'tiny': step generate failed: ") and "\n" not in message
    assert message.endswith("(flow run 'tiny-round-2-generate' on work pool 'inference')"), message

    # Every step ran as its own flow run of its deployment, on its pool, as a subflow of the round
    assert result["round"] == 1 and set(result["results"]) == set(STEPS)
    with get_client(sync_client=True) as client:
        for step in STEPS:
            res = result["results"][step]
            fr = client.read_flow_run(UUID(res["flow_run_id"]))
            assert (fr.name, fr.work_pool_name, res["pool"]) == (f"tiny-round-1-{step}", POOLS[step], POOLS[step])
            assert fr.state.is_completed() and fr.parent_task_run_id is not None
            assert client.read_deployment(fr.deployment_id).name == f"tiny-{step}"
            assert {"run:tiny", f"step:{step}", f"pool:{POOLS[step]}"} <= set(fr.tags)
    logs = {pool: (tmp_path / f"worker-{pool}.log").read_text() for pool in ("inference", "training")}
    for step in STEPS:
        line = f"round 1 of run 'tiny': step {step} on this worker"
        other = "training" if POOLS[step] == "inference" else "inference"
        assert (line in logs[POOLS[step]], line in logs[other]) == (True, False), step
    assert not list((pooled / "runs" / "tiny" / "step-results").glob("*.json"))   # summaries read and removed

    # The store: every step completed, the candidate trained, gated and promoted
    store = pooled / "store.duckdb"
    assert _q(store, "SELECT step FROM steps WHERE round = 1 AND status = 'completed' ORDER BY step") == sorted(
        (s,) for s in STEPS)
    assert _q(store, "SELECT status FROM rounds WHERE round = 1") == [("completed",)]
    assert _q(store, "SELECT role FROM models WHERE model_id = 'tiny/r1/candidate'") == [("champion",)]
    assert _q(store, "SELECT decision FROM gate_decisions WHERE round = 1") == [("promote",)]
    # round 2 stays open at its first step (generate failed before its transaction: nothing of it written)
    assert _q(store, "SELECT status FROM rounds WHERE round = 2") == [("running",)]
    assert _q(store, "SELECT count(*) FROM steps WHERE round = 2 AND status = 'completed'") == [(0,)]
