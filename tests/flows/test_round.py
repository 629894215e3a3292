"""One full round of the flows on the tiny config, and the lineage it leaves in the store."""

import json

import duckdb

from configs.schema import load_config
from flows.round import improvement_round
from tasks.common import STEPS
from tests.conftest import TINY, tiny_overrides


def test_one_full_round_on_tiny(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path)
    result = improvement_round([TINY], overrides)
    assert result["round"] == 1 and set(result["results"]) == set(STEPS)
    cfg = load_config([TINY], overrides)
    n_gen = cfg.generate.tasks_per_round * cfg.generate.group_size
    n_eval = cfg.gate.heldout_tasks

    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    q = lambda sql, *p: con.execute(sql, list(p)).fetchall()
    assert q("SELECT step FROM steps WHERE round = 1 AND status = 'completed' ORDER BY step") == sorted((s,) for s in STEPS)
    assert q("SELECT status, champion_after IS NOT NULL FROM rounds WHERE round = 1") == [("completed", True)]
    # generate: G rollouts per task, all by the base model; gate: candidate and base on the held-out tasks
    assert q("SELECT count(*) FROM trajectories WHERE step = 'generate'") == [(n_gen,)]
    assert q("SELECT count(*), count(DISTINCT model_id) FROM trajectories WHERE step = 'gate'") == [(2 * n_eval, 2)]
    assert q("SELECT DISTINCT model_id FROM trajectories WHERE step = 'generate'") == [("tiny/base",)]
    assert q("SELECT count(*) FROM turns t JOIN trajectories j USING (traj_id)") == q("SELECT sum(n_turns) FROM trajectories")
    # the candidate is registered with its parent; the decision and evidence are recorded
    assert q("SELECT parent_id, role FROM models WHERE model_id = 'tiny/r1/candidate'") == [("tiny/base", "champion")]
    (decision, evidence), = q("SELECT decision, evidence FROM gate_decisions WHERE round = 1")
    ev = json.loads(evidence)
    assert decision == "promote" and ev["rule"] == "always" and ev["n"] == n_eval and len(ev["task_ids"]) == n_eval
    # every trajectory's model is in the registry; evaluations per task type plus '*'
    assert q("SELECT count(*) FROM trajectories t LEFT JOIN models m USING (model_id) WHERE m.model_id IS NULL") == [(0,)]
    assert q("SELECT count(*) FROM evaluations WHERE split = 'heldout' AND task_type = '*'") == [(2,)]
    con.close()
    report = tmp_path / "runs" / "tiny" / "report"
    assert "| 1 |" in (report / "report.md").read_text()
    assert (report / "heldout.png").read_bytes()[:4] == b"\x89PNG"


def test_second_round_reuses_champion_results_and_continues(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path, "gate.rule=always")
    improvement_round([TINY], overrides)
    second = improvement_round([TINY], overrides)
    assert second["round"] == 2
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    (evidence,), = con.execute("SELECT evidence FROM gate_decisions WHERE round = 2").fetchall()
    # round 2's champion is round 1's candidate, already evaluated on the same held-out tasks
    assert json.loads(evidence)["champion_results_reused"] is True
    assert con.execute("SELECT champion_id FROM gate_decisions WHERE round = 2").fetchall() == [("tiny/r1/candidate",)]
    assert con.execute("SELECT DISTINCT model_id FROM trajectories WHERE round = 2 AND step = 'generate'").fetchall() == [
        ("tiny/r1/candidate",)]
    con.close()


def test_cli_status_and_report_read_the_store(tmp_path, prefect_api, capsys):
    from flows.cli import main

    overrides = tiny_overrides(tmp_path)
    improvement_round([TINY], overrides)
    sets = [a for o in overrides for a in ("--set", o)]
    main(["status", "--config", TINY, *sets])
    out = capsys.readouterr().out
    assert "champion: tiny/r1/candidate" in out and "completed rounds: 1" in out
    for step in STEPS:
        assert f"round  1  {step}" in out
    main(["report", "--config", TINY, *sets])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "- base:" in out and "heldout.png" in out
