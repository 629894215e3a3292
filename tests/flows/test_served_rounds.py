"""A whole round through a real `vllm serve` of SmolLM2 (the `openai` backend, CPU build): generate,
gate and deploy talk to the server; the gate's candidate and the new champion are served by reloading
the server's weights in place. Skipped with the reason where vLLM is not installed."""

import json

import duckdb
import pytest

from rsiflow.flows.round import improvement_round
from rsiflow.models import openai_backend
from rsiflow.tasks.common import STEPS

pytestmark = pytest.mark.slow

ARITHMETIC = "configs/arithmetic.yaml"


def test_a_round_through_vllm_serve(tmp_path, prefect_api, vllm_server, smollm2_path):
    overrides = [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'runs' / '{name}'}",
                 "run.name=served", "backend.kind=openai", f"backend.openai.base_url={vllm_server}",
                 "backend.openai.redeploy=vllm_reload", "backend.max_new_tokens=24",
                 "env.kwargs={levels: [level1], max_steps: 2}", "generate.tasks_per_round=4",
                 "generate.group_size=2", "gate.heldout_tasks=4", "gate.rule=always", "train.epochs=1",
                 "train.batch_size=2"]
    result = improvement_round([ARITHMETIC], overrides)
    assert result["round"] == 1 and set(result["results"]) == set(STEPS)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
    (n_success,), = q("SELECT count(*) FILTER (WHERE success) FROM trajectories WHERE step = 'generate'")
    assert n_success > 0, "SmolLM2 solves level-1 arithmetic: the server's rollouts must include successes"
    assert q("SELECT count(*) FROM turns t JOIN trajectories j USING (traj_id) WHERE j.step = 'generate' "
             "AND len(t.token_ids) > 0 AND len(t.logprobs) = len(t.token_ids)")[0][0] > 0
    (decision,), = q("SELECT decision FROM gate_decisions")[0:1]
    (metrics,), = q("SELECT metrics FROM rounds WHERE round = 1")
    redeploy = json.loads(metrics)["redeploy"]
    assert redeploy["kind"] == "openai" and redeploy["url"] == vllm_server
    assert decision == "promote"  # rule always, and a candidate was trained on the successes
    (path,), = q("SELECT path FROM models WHERE model_id = 'served/r1/candidate'")
    assert openai_backend._SERVING[vllm_server] == path  # the server serves the new champion
    con.close()
