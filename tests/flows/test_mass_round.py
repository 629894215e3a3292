"""Two MASS cycles as real rounds on the tiny model (Prefect, the store, the trainer, the gate), and every artifact
traced by SQL: workflows with their parents across rounds, episodes of each workflow, verdicts naming both episodes
and the judge, rankings of the teacher episodes, the examples they became (the bare task, never a workflow prompt),
the candidate they trained, and the gate-step assessment against the base. Then one round on the explain env (no
verifier) with the model as the only judge.

The tiny model solves no real env: the MASS rounds play tests/tasks/test_mass_method.py's one-reply env whose
verifier accepts replies of even length, judged by the oracle (the named option that tests the pipeline)."""

import json

import duckdb
import pytest

from tests.conftest import TINY, tiny_overrides

PARITY = "tests.tasks.test_mass_method:ParityEnv"
COMMON = ("env.kwargs={}", "env.show_admissible=false", "env.project_actions=false", "distill.methods=[mass]",
          "generate.tasks_per_round=4", "generate.group_size=1", "gate.heldout_tasks=4",
          "distill.mass.versions=3", "distill.mass.search_tasks=4", "distill.mass.episodes_per_task=4",
          "distill.mass.opponents=2", "distill.mass.assess_tasks=4", "train.epochs=2")


@pytest.mark.slow
def test_two_mass_cycles_every_artifact_traced_by_sql(tmp_path, prefect_api):
    from rsiflow.flows.self_improve import self_improve

    overrides = tiny_overrides(tmp_path, f"env.name={PARITY}", "env.max_turns=1", "distill.mass.judge=oracle",
                               "distill.mass.proposer=mutation", "run.rounds=2", *COMMON)
    self_improve([TINY], overrides)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)

    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()

    assert q("SELECT round, status FROM rounds ORDER BY round") == [(1, "completed"), (2, "completed")]
    # workflows: per round the reference and v0..v2, each derived from the champion of its time; one retained
    for rnd in (1, 2):
        rows = q("SELECT version, proposer, parent_id, accepted, retained FROM mass_workflows WHERE round = ?"
                 " ORDER BY version", rnd)
        assert [r[0] for r in rows] == [-1, 0, 1, 2] and rows[0][1] == "reference"
        assert [r[1] for r in rows[2:]] == ["mutation", "mutation"]
        assert sum(r[4] for r in rows) == 1
    # round 2's v0 is round 1's retained workflow when that one was not the reference
    (kept1,), = q("SELECT workflow_id FROM mass_workflows WHERE round = 1 AND retained")
    (proposer2, proposal2), = q("SELECT proposer, proposal FROM mass_workflows WHERE round = 2 AND version = 0")
    assert (proposer2, proposal2) == (("previous", kept1) if not kept1.endswith("/reference") else ("seed", None))
    # every search episode belongs to a stored workflow of its round, every hop's output is stored
    assert q("SELECT count(*) FROM mass_episodes e LEFT JOIN mass_workflows w USING (run_id, round, workflow_id)"
             " WHERE e.purpose IN ('search', 'teacher') AND w.workflow_id IS NULL") == [(0,)]
    assert q("SELECT count(*) FROM mass_episodes WHERE purpose = 'search' AND json_array_length(hops) = 0") == [(0,)]
    # verdicts name two stored episodes of the same task and round; the oracle's score is the verifier's
    assert q("SELECT count(*) FROM mass_verdicts v JOIN mass_episodes x ON x.episode_id = v.x_episode_id"
             " JOIN mass_episodes y ON y.episode_id = v.y_episode_id"
             " WHERE v.purpose <> 'assess' AND x.task_id = v.task_id AND y.task_id = v.task_id"
             " AND x.success = v.verifier_x AND y.success = v.verifier_y") == \
        q("SELECT count(*) FROM mass_verdicts WHERE purpose <> 'assess'")
    assert q("SELECT count(*) FROM mass_verdicts WHERE purpose <> 'assess' AND judge = 'oracle' AND score <>"
             " CASE WHEN verifier_x = verifier_y THEN 0.5 WHEN verifier_x THEN 1 ELSE 0 END") == [(0,)]
    # lineage: candidate <- train_inputs <- examples <- teacher episodes (ranked) <- retained workflow <- model
    lineage = q("SELECT i.model_id, e.example_id, r.rank, r.split, p.workflow_id, w.retained, p.model_id, e.messages,"
                " p.final_text FROM train_inputs i JOIN examples e USING (example_id, run_id)"
                " JOIN mass_episodes p ON p.episode_id = e.source_traj_id"
                " JOIN mass_rankings r ON r.episode_id = p.episode_id"
                " JOIN mass_workflows w ON w.workflow_id = p.workflow_id WHERE e.method = 'mass'")
    collected = q("SELECT round FROM mass_workflows WHERE retained AND version >= 0")
    assert collected and lineage    # with this seed a version beats the reference (the oracle decides)
    for model_id, _, rank, split, _, retained, player, messages, final in lineage:
        assert model_id.endswith("/candidate") and split == "train" and rank >= 1 and retained
        msgs = json.loads(messages)
        assert msgs[-1] == {"role": "assistant", "content": final}
        assert "Note from the" not in json.dumps(msgs)
        assert q("SELECT count(*) FROM models WHERE model_id = ?", player) == [(1,)]
    # validation examples are stored, never trained on
    assert q("SELECT count(*) FROM examples e JOIN train_inputs i USING (example_id, run_id)"
             " WHERE json_extract_string(e.meta, '$.split') = 'validation'") == [(0,)]
    # the gate's assessment: candidate and base answers, verdicts by the candidate, figures with the round
    for (rnd, cand) in q("SELECT round, candidate_id FROM gate_decisions WHERE decision <> 'skip'"):
        (n_c, n_b), = q("SELECT count(*) FILTER (WHERE model_id = ?), count(*) FILTER (WHERE model_id = 'tiny/base')"
                        " FROM mass_episodes WHERE purpose = 'assess' AND round = ?", cand, rnd)
        assert n_c == n_b == 4
        assert q("SELECT DISTINCT judge, judge_model_id FROM mass_verdicts WHERE purpose = 'assess' AND round = ?",
                 rnd) == [("self", cand)]
        (metrics,), = q("SELECT metrics FROM rounds WHERE round = ?", rnd)
        m = json.loads(metrics)["mass"]
        assert m["assess_n"] == 4 and 0 <= m["win_vs_base"] <= 1 and "verifier_win_vs_base" in m
    con.close()
    report = (tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert "MASS per round" in report and "| 2 | workflow |" in report


@pytest.mark.slow
def test_a_mass_round_on_explain_with_the_model_as_only_judge(tmp_path, prefect_api):
    from rsiflow.flows.round import improvement_round

    overrides = tiny_overrides(tmp_path, "env.name=explain", "env.max_turns=2", "distill.mass.teacher=single_agent",
                               *COMMON)
    improvement_round([TINY], overrides)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM mass_episodes WHERE success IS NOT NULL").fetchall() == [(0,)]
        judges = con.execute("SELECT DISTINCT purpose, judge FROM mass_verdicts ORDER BY purpose").fetchall()
        assert judges == [("assess", "self"), ("teacher", "self")]
        (metrics,), = con.execute("SELECT metrics FROM rounds WHERE round = 1").fetchall()
        m = json.loads(metrics)["mass"]
        assert m["teacher"] == "single_agent" and m["judge_agreement"] is None and m["examples"] > 0
        assert "win_vs_base" in m and "verifier_win_vs_base" not in m
    finally:
        con.close()
