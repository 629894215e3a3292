"""Lineage of a small hand-made round: which model produced which trajectory, which examples
trained the candidate, and what the gate decided; via the store's helpers and plain SQL."""

import pytest

RUN = "run1"


def fake_round(store, decision="promote", round_no=0):
    champion = store.champion(RUN)
    candidate = f"cand-{round_no}"
    store.start_round(RUN, round_no, champion)
    with store.step(RUN, round_no, "generate") as tx:
        tx.insert("tasks", [{"task_id": "k1", "env": "household", "split": "train", "task_type": "heat", "seed": 1}])
        tx.insert("trajectories", [
            {"traj_id": f"{round_no}-t1", "task_id": "k1", "model_id": champion, "purpose": "train",
             "status": "success", "success": True, "reward": 1.0, "n_turns": 1},
            {"traj_id": f"{round_no}-t2", "task_id": "k1", "model_id": champion, "purpose": "train",
             "status": "failure", "success": False, "reward": 0.0, "n_turns": 1},
        ])
    with store.step(RUN, round_no, "distill") as tx:
        tx.insert("examples", [{"example_id": f"{round_no}-e1", "method": "exit", "source_traj_id": f"{round_no}-t1",
                                "messages": [{"role": "user", "content": "go"}], "weight": 1.0}])
    with store.step(RUN, round_no, "train") as tx:
        tx.insert("models", [{"model_id": candidate, "parent_id": champion, "path": f"ckpt/{candidate}",
                              "role": "candidate", "train_metrics": {"loss": 0.5}}])
        tx.insert("train_inputs", [{"model_id": candidate, "example_id": f"{round_no}-e1"}])
    with store.step(RUN, round_no, "gate") as tx:
        tx.insert("evaluations", [{"eval_id": f"{round_no}-v", "model_id": candidate, "split": "heldout",
                                   "env": "household", "task_type": "*", "n": 10, "successes": 6,
                                   "success_rate": 0.6}])
        new_champion = candidate if decision == "promote" else champion
        tx.insert("gate_decisions", [{"candidate_id": candidate, "champion_id": champion, "decision": decision,
                                      "rule": "not_worse", "evidence": {"delta": 0.1},
                                      "new_champion_id": new_champion}])
        tx.execute("UPDATE models SET role = ? WHERE model_id = ?",
                   ["champion" if decision == "promote" else "rejected", candidate])
    store.finish_round(RUN, round_no, new_champion, {"success_rate": 0.6})


@pytest.fixture
def run_store(store):
    store.create_run(RUN, "demo", {"lr": 1e-5}, "hf:smollm2")
    with store.step(RUN, 0, "register_base") as tx:
        tx.insert("models", [{"model_id": "base", "path": "hf:smollm2", "role": "base"}])
    return store


def test_runs_and_rounds(run_store):
    store = run_store
    store.create_run(RUN, "demo", {"lr": 1e-5}, "hf:smollm2")  # same config: no-op
    with pytest.raises(ValueError, match=RUN):
        store.create_run(RUN, "demo", {"lr": 2e-5}, "hf:smollm2")
    assert [r["run_id"] for r in store.list_runs()] == [RUN]
    assert store.get_run("missing") is None
    assert store.last_completed_round(RUN) == -1
    assert store.round_status(RUN, 0) is None

    fake_round(store)
    assert store.round_status(RUN, 0) == "completed"
    assert store.last_completed_round(RUN) == 0
    assert store.completed_steps(RUN, 0) == {"register_base", "generate", "distill", "train", "gate"}
    metrics, after = store.con.sql("SELECT metrics->>'$.success_rate', champion_after FROM rounds").fetchall()[0]
    assert (metrics, after) == ("0.6", "cand-0")


def test_champion_follows_promotions_not_rejections(run_store):
    store = run_store
    assert store.champion(RUN) == "base"
    fake_round(store, "promote", round_no=0)
    assert store.champion(RUN) == "cand-0"
    fake_round(store, "reject", round_no=1)
    assert store.champion(RUN) == "cand-0"
    assert store.champion("unknown-run") is None


def test_lineage_helpers_and_plain_sql(run_store):
    store = run_store
    fake_round(store)

    lineage = store.trajectory_lineage(RUN)
    assert [(r["traj_id"], r["model_id"], r["model_path"], r["model_role"]) for r in lineage] == [
        ("0-t1", "base", "hf:smollm2", "base"), ("0-t2", "base", "hf:smollm2", "base")]

    trained = store.training_examples_of("cand-0")
    assert [(r["example_id"], r["source_traj_id"], r["source_model_id"]) for r in trained] == [("0-e1", "0-t1", "base")]
    assert trained[0]["messages"] == [{"role": "user", "content": "go"}]

    history = store.promotion_history(RUN)
    assert [(h["candidate_id"], h["champion_id"], h["decision"], h["evidence"]) for h in history] == [
        ("cand-0", "base", "promote", {"delta": 0.1})]

    # The same questions as a user would ask them in SQL: which model generated the
    # trajectories that trained the new champion, and how did that champion score?
    rows = store.con.sql("""
        SELECT g.new_champion_id, m.parent_id, t.model_id AS generated_by, ev.success_rate
        FROM gate_decisions g
        JOIN models m ON m.model_id = g.new_champion_id
        JOIN train_inputs i ON i.model_id = m.model_id
        JOIN examples e ON e.example_id = i.example_id
        JOIN trajectories t ON t.traj_id = e.source_traj_id
        JOIN evaluations ev ON ev.model_id = m.model_id AND ev.task_type = '*'
        WHERE g.run_id = ? AND g.decision = 'promote'
    """, params=[RUN]).fetchall()
    assert rows == [("cand-0", "base", "base", 0.6)]
    role = store.con.sql("SELECT role FROM models WHERE model_id = 'cand-0'").fetchall()[0][0]
    assert role == "champion"
