"""SRD in a real round on the tiny config: notes and foresight pairs stored with lineage, a
candidate trained from them although every rollout failed, and the round's SRD figures reported."""

import json

import duckdb

from rsiflow.flows.round import improvement_round
from tests.conftest import TINY, tiny_overrides


def test_srd_round_learns_from_all_fail_groups_with_lineage(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path, "distill.methods=[exit,srd]", "distill.srd.note_writer=template",
                               "distill.srd.action_channel=true", "distill.srd.action_trajectories=1")
    result = improvement_round([TINY], overrides)
    assert result["round"] == 1
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()
    (groups, failed_groups), = q("SELECT count(DISTINCT group_id), count(DISTINCT group_id) FILTER (WHERE NOT success)"
                                 " FROM trajectories WHERE step = 'generate'")
    assert failed_groups > 0  # the tiny random model fails: SRD's regime
    # notes: from failed trajectories only, by the named template writer, all usable
    assert q("SELECT DISTINCT writer, channel, usable FROM notes") == [("template", "pitfall", True)]
    assert q("SELECT count(*) FROM notes n JOIN trajectories t USING (traj_id) WHERE t.success") == [(0,)]
    # one foresight pair per group with notes, one action pair per such group; each example points at its pair
    assert q("SELECT channel, count(*) FROM foresight GROUP BY 1 ORDER BY 1") == [("action", failed_groups),
                                                                                  ("pitfall", failed_groups)]
    rows = q("SELECT e.example_id, e.method, f.foresight_id, f.note_ids, f.completion_ids, f.sampling_logprobs"
             " FROM examples e JOIN foresight f ON f.foresight_id = json_extract_string(e.meta, '$.foresight_id')"
             " WHERE e.method = 'srd'")
    assert len(rows) == 2 * failed_groups
    for _, _, fid, note_ids, ids, lps in rows:
        assert note_ids and all(q("SELECT count(*) FROM notes WHERE note_id = ?", n) == [(1,)] for n in note_ids)
        if "action" not in fid:
            assert ids and len(ids) == len(lps)  # the student's own sampled tokens and their logprobs
    # privileged text: in the teacher's messages, never in the student's
    for student, teacher in q("SELECT student_messages, teacher_messages FROM foresight"):
        assert "privileged, do not reveal" in teacher and "privileged, do not reveal" not in student
    # a candidate was trained on them (all-fail groups still give signal) and its metrics are recorded
    (metrics,), = q("SELECT train_metrics FROM models WHERE model_id = 'tiny/r1/candidate'")
    m = json.loads(metrics)
    assert m["distill_examples"] == 2 * failed_groups and m["distill_misaligned"] == 0
    assert m["distill_loss_mean"] > 0 and m["steps"] > 0
    assert q("SELECT count(*) FROM train_inputs i JOIN examples e USING (example_id) WHERE e.method = 'srd'") == \
        [(2 * failed_groups,)]
    (rm,), = q("SELECT metrics FROM rounds WHERE round = 1")
    srd = json.loads(rm)["srd"]
    assert srd["groups_with_signal"] == failed_groups and srd["writer"] == "template"
    assert srd["action_pairs"] == failed_groups
    con.close()
    report = (tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert "SRD per round" in report and "| template |" in report


def test_policy_writer_notes_are_kept_and_counted_even_when_unusable(tmp_path, prefect_api):
    overrides = tiny_overrides(tmp_path, "distill.methods=[srd]", "distill.srd.note_max_tokens=8")
    improvement_round([TINY], overrides)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    rows = con.execute("SELECT writer, model_id, raw_text, n_tokens, usable FROM notes").fetchall()
    assert rows and all(w == "policy" and m == "tiny/base" and 0 < n <= 8 for w, m, _, n, _ in rows)
    usable = sum(u for *_, u in rows)
    n_pairs = con.execute("SELECT count(*) FROM foresight").fetchall()[0][0]
    assert (n_pairs > 0) == (usable > 0)  # random text has no 'Error:' block: no teacher is built from it
    con.close()
