"""RSIPO in two real rounds on the tiny model (GRPO + RSIPO, through Prefect): every RSIPO row traced by SQL from the
skill to its replay trajectories, its gain and trust weight, the training examples they made and the candidate those
trained; the second round re-tests library skills; the gate plays the candidate with and without the library's best
skill; the report shows the rounds and the library.

The env is the parity env of tests/tasks/test_rsipo_method.py (a reply of the task type's parity wins, about half of
random replies), so groups are mixed, gains are real numbers and some skills earn trust."""

import json

import duckdb
import pytest

from tests.conftest import TINY, tiny_overrides


@pytest.mark.slow
def test_two_rsipo_rounds_traced_from_skill_to_candidate(tmp_path, prefect_api):
    from rsiflow.flows.round import improvement_round

    overrides = tiny_overrides(tmp_path, "env.name=tests.tasks.test_rsipo_method:ParityEnv", "env.kwargs={}",
                               "env.max_turns=1", "env.show_admissible=false", "env.project_actions=false",
                               "generate.tasks_per_round=6", "generate.group_size=4", "distill.methods=[grpo,rsipo]",
                               "distill.rsipo.replays=3", "distill.rsipo.assess_tasks=6")
    for expected in (1, 2):
        assert improvement_round([TINY], overrides)["round"] == expected
    check_two_rounds(tmp_path / "store.duckdb", tmp_path / "runs" / "tiny" / "report" / "report.md")


def check_two_rounds(store_path, report_path):
    """What the two rounds must have stored (a function, so a stored run can be checked again without rerunning)."""
    con = duckdb.connect(str(store_path), read_only=True)

    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()

    chains = 0
    for rnd in (1, 2):
        # skill -> replay trajectories -> gain -> weight -> training example -> candidate, in one query
        traced = q("""
            SELECT s.skill_id, t.test_id, count(DISTINCT r.traj_id) AS replays, t.gain, t.weight, e.example_id,
                   i.model_id, m.round
            FROM rsipo_tests t
            JOIN (SELECT skill_id, round FROM rsipo_skills) s ON s.skill_id = t.skill_id
            JOIN trajectories r ON list_contains(t.replay_traj_ids, r.traj_id) AND r.purpose = 'replay'
                 AND r.task_id = t.task_id AND r.round = t.round
            JOIN examples e ON e.method = 'rsipo' AND json_extract_string(e.meta, '$.test_id') = t.test_id
                 AND json_extract_string(e.meta, '$.kind') = 'distill'
            JOIN train_inputs i ON i.example_id = e.example_id
            JOIN models m ON m.model_id = i.model_id
            WHERE t.round = ? GROUP BY ALL ORDER BY e.example_id""", rnd)
        # every selected test (the task's trusted skill, w > 0) made examples that trained the round's candidate
        selected = q("SELECT test_id, weight FROM rsipo_tests WHERE round = ? AND selected", rnd)
        assert {row[1] for row in traced} == {tid for tid, _ in selected}
        assert all(replays == 3 and w > 0 and model == f"tiny/r{rnd}/candidate" and mround == rnd
                   for _, _, replays, _, w, _, model, mround in traced)
        (distilled,), = q("SELECT count(*) FROM examples WHERE round = ? AND method = 'rsipo'"
                          " AND json_extract_string(meta, '$.kind') = 'distill'", rnd)
        assert distilled == len(traced)
        if traced:
            (tm,), = q("SELECT train_metrics FROM models WHERE model_id = ?", f"tiny/r{rnd}/candidate")
            assert json.loads(tm)["distill_examples"] == len(traced)
        chains += len(traced)
        # no trust, no distillation: a round whose skills all have w = 0 has no distillation example
        assert all(w > 0 for _, w in selected)
        (untrusted,), = q("SELECT count(*) FROM rsipo_tests WHERE round = ? AND weight = 0 AND selected", rnd)
        assert untrusted == 0
        # every RSIPO example of the round, distillation or skill evolution, points at a test of a stored skill
        orphans = q("SELECT e.example_id FROM examples e LEFT JOIN rsipo_tests t"
                    " ON t.test_id = json_extract_string(e.meta, '$.test_id')"
                    " LEFT JOIN rsipo_skills s ON s.skill_id = t.skill_id"
                    " WHERE e.method = 'rsipo' AND e.round = ? AND (t.test_id IS NULL OR t.skill_id IS NULL)", rnd)
        assert orphans == []
        # every replay trajectory of the distill step belongs to exactly one test of the round, on that test's task
        (unowned,), = q("SELECT count(*) FROM trajectories r WHERE r.purpose = 'replay' AND r.round = ?"
                        " AND r.step = 'distill' AND (SELECT count(*) FROM rsipo_tests t"
                        "  WHERE list_contains(t.replay_traj_ids, r.traj_id) AND t.task_id = r.task_id) <> 1", rnd)
        assert unowned == 0
        # skill evolution: the tested new skills' writing tokens trained in GRPO's policy-gradient loss
        (tm,), = q("SELECT train_metrics FROM models WHERE model_id = ?", f"tiny/r{rnd}/candidate")
        tm = json.loads(tm)
        (grpo_rows,), = q("SELECT count(*) FROM examples WHERE round = ? AND method = 'grpo'"
                          " AND json_extract(meta, '$.advantage')::DOUBLE <> 0", rnd)
        (evo_rows,), = q("SELECT count(*) FROM examples WHERE round = ? AND method = 'rsipo'"
                         " AND json_extract_string(meta, '$.kind') = 'evolution'"
                         " AND json_extract(meta, '$.advantage')::DOUBLE <> 0", rnd)
        assert evo_rows > 0 and tm["pg_rows"] == grpo_rows + evo_rows
    assert chains > 0, "some skill should have earned trust in one of the two rounds on this seed"
    # round 2 re-tested library skills and the library records their tests over both rounds
    assert q("SELECT count(*) FROM rsipo_tests WHERE round = 2 AND origin = 'library' AND skill_round = 1")[0][0] > 0
    assert q("SELECT max(n_tests) FROM rsipo_library WHERE round = 2")[0][0] >= 2
    (metrics,), = q("SELECT metrics FROM rounds WHERE round = 2")
    rsipo = json.loads(metrics)["rsipo"]
    assert rsipo["tests_library"] > 0 and rsipo["library_size"] >= 0 and rsipo["distill_loss"] is not None
    # inference with a skill: the gate played the candidate both ways on held-out tasks with a trusted library skill
    for rnd in (1, 2):
        (metrics,), = q("SELECT metrics FROM rounds WHERE round = ?", rnd)
        m = json.loads(metrics)["rsipo"]
        stored = q("SELECT t.model_id, t.purpose, u.observation FROM trajectories t JOIN turns u"
                   " ON u.traj_id = t.traj_id AND u.turn_idx = 0 WHERE t.round = ? AND t.step = 'gate'"
                   " AND t.purpose = 'replay'", rnd)
        assert len(stored) == m["assess_tasks"] and all(model == f"tiny/r{rnd}/candidate" and "Skill (" in obs
                                                         for model, _, obs in stored)
        if m["assess_tasks"]:
            assert 0 <= m["assess_bare"] <= m["assess_tasks"] and 0 <= m["assess_with_skill"] <= m["assess_tasks"]
            assert m["assess_better"] in ("skill", "bare", "tie") and m["assess_skills"]
    assert any(json.loads(r)["rsipo"]["assess_tasks"] for (r,) in q("SELECT metrics FROM rounds"))
    con.close()
    report = report_path.read_text()
    assert "RSIPO per round" in report and "Skill library after round 2" in report
    assert "Inference with a skill" in report
