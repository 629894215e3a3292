"""One full round of the flows on the tiny config, and the lineage it leaves in the store."""

import json
import re

import duckdb

from rsiflow.configs.loader import load_config
from rsiflow.flows.round import improvement_round
from rsiflow.tasks.common import STEPS
from tests.conftest import TINY, tiny_overrides


def test_one_full_round_on_tiny(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path)
    result = improvement_round([TINY], overrides)
    assert result["round"] == 1 and set(result["results"]) == set(STEPS)
    cfg = load_config([TINY], overrides)
    n_gen = cfg.generate.tasks_per_round * cfg.generate.group_size
    n_eval = cfg.gate.heldout_tasks

    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()
    assert q("SELECT step FROM steps WHERE round = 1 AND status = 'completed' ORDER BY step") == sorted(
        (s,) for s in STEPS)
    assert q("SELECT status, champion_after IS NOT NULL FROM rounds WHERE round = 1") == [("completed", True)]
    # generate: G rollouts per task, all by the base model
    assert q("SELECT count(*) FROM trajectories WHERE step = 'generate'") == [(n_gen,)]
    assert q("SELECT DISTINCT model_id FROM trajectories WHERE step = 'generate'") == [("tiny/base",)]
    assert q("SELECT count(*) FROM turns t JOIN trajectories j USING (traj_id)") == q(
        "SELECT sum(n_turns) FROM trajectories")
    # every trajectory's model is in the registry; the base's held-out evaluation per task type plus '*'
    assert q("SELECT count(*) FROM trajectories t LEFT JOIN models m USING (model_id)"
             " WHERE m.model_id IS NULL") == [(0,)]
    assert q("SELECT count(*) FROM evaluations WHERE split = 'heldout' AND task_type = '*'"
             " AND model_id = 'tiny/base'") == [(1,)]
    (n_examples,), = q("SELECT count(*) FROM examples")
    (decision, evidence), = q("SELECT decision, evidence FROM gate_decisions WHERE round = 1")
    ev = json.loads(evidence)
    assert len(ev["task_ids"]) == n_eval
    if n_examples == 0:   # the tiny random model solved nothing: no candidate, a recorded skip
        assert decision == "skip" and "no training examples" in ev["reason"]
        assert q("SELECT count(*) FROM models") == [(1,)]
        assert q("SELECT count(*) FROM trajectories WHERE step = 'gate'") == [(n_eval,)]
    else:
        assert decision == "promote" and ev["rule"] == "always"
        assert q("SELECT parent_id, role FROM models WHERE model_id = 'tiny/r1/candidate'") == [
            ("tiny/base", "champion")]
    con.close()
    report = tmp_path / "runs" / "tiny" / "report"
    assert "| 1 |" in (report / "report.md").read_text()
    assert (report / "heldout.png").read_bytes()[:4] == b"\x89PNG"


def test_trained_candidate_is_gated_promoted_and_serves(tmp_path, prefect_api):
    """Generate and evaluate for real, distill = the scripted expert's solved episodes (what a
    method would write), then the round resumes: real SFT, gate, registry, redeploy."""
    from prefect import flow

    from rsiflow.stores.store import Store
    from rsiflow.tasks.evaluate import evaluate_rollouts
    from rsiflow.tasks.generate import generate_rollouts
    from rsiflow.tasks.setup import ensure_run
    from tests.models.test_trainer_sft import expert_conversation

    overrides = tiny_overrides(tmp_path, "gate.rule=always", "train.epochs=2")
    cfg = load_config([TINY], overrides)
    ensure_run(cfg)
    with Store(cfg.run.store) as s:
        s.start_round("tiny", 1, s.champion("tiny"))

    @flow
    def first_steps():
        generate_rollouts(cfg, 1)
        evaluate_rollouts(cfg, 1)

    first_steps()
    examples = []
    for seed in range(4):
        msgs, train_from = expert_conversation(seed)
        examples.append({"example_id": f"expert-{seed}", "method": "exit", "source_traj_id": None, "messages": msgs,
                         "weight": 1.0, "meta": {"train_from": train_from}})
    with Store(cfg.run.store) as s, s.step("tiny", 1, "distill") as tx:
        tx.insert("examples", examples)

    result = improvement_round([TINY], overrides)
    assert result["round"] == 1 and result["skipped"] == ["distill", "evaluate", "generate"]
    con = duckdb.connect(cfg.run.store, read_only=True)
    def q(sql):
        return con.execute(sql).fetchall()
    (metrics,), = q("SELECT train_metrics FROM models WHERE model_id = 'tiny/r1/candidate'")
    metrics = json.loads(metrics)
    assert metrics["examples"] == 4 and metrics["steps"] > 0 and metrics["trained_tokens"] > 0
    assert q("SELECT example_id FROM train_inputs ORDER BY 1") == [(f"expert-{s}",) for s in range(4)]
    assert q("SELECT decision, new_champion_id FROM gate_decisions") == [("promote", "tiny/r1/candidate")]
    assert q("SELECT count(DISTINCT model_id) FROM trajectories WHERE step = 'gate'") == [(2,)]
    assert q("SELECT champion_after FROM rounds WHERE round = 1") == [("tiny/r1/candidate",)]
    con.close()


def test_second_round_reuses_champion_results_and_continues(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path, "gate.rule=always")
    improvement_round([TINY], overrides)
    second = improvement_round([TINY], overrides)
    assert second["round"] == 2
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    (champion_after_1,), = con.execute("SELECT new_champion_id FROM gate_decisions WHERE round = 1").fetchall()
    (champion_id, evidence), = con.execute(
        "SELECT champion_id, evidence FROM gate_decisions WHERE round = 2").fetchall()
    # round 2's champion is round 1's outcome, already evaluated on the same held-out tasks
    assert champion_id == champion_after_1
    assert json.loads(evidence)["champion_results_reused"] is True
    assert con.execute("SELECT DISTINCT model_id FROM trajectories"
                       " WHERE round = 2 AND step = 'generate'").fetchall() == [(champion_after_1,)]
    con.close()


def test_cli_status_and_report_read_the_store(tmp_path, prefect_api, capsys):
    from rsiflow.flows.cli import main

    overrides = tiny_overrides(tmp_path)
    improvement_round([TINY], overrides)
    sets = [a for o in overrides for a in ("--set", o)]
    main(["status", "--config", TINY, *sets])
    out = capsys.readouterr().out
    with duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True) as con:
        (champion,), = con.execute("SELECT new_champion_id FROM gate_decisions WHERE round = 1").fetchall()
    assert f"champion: {champion}" in out and "completed rounds: 1" in out
    assert "round 1  completed" in out
    for step in STEPS:  # each step of the round on its own line, with its state
        assert re.search(rf"^  {step} +completed ", out, re.M), out
    main(["report", "--config", TINY, *sets])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "- base:" in out and "heldout.png" in out
