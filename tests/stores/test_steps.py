"""Step transactions: reruns replace rows, failures roll back, other steps are untouched."""

import pyarrow as pa
import pytest


def trajectories(n, run="r", round_no=0):
    return [{"traj_id": f"t{i}", "task_id": f"task{i % 2}", "model_id": "base", "purpose": "train",
             "status": "success", "success": True, "reward": 1.0, "hindsight": {"apple": "fridge"}}
            for i in range(n)]


def count(store, table, step=None):
    sql = f"SELECT count(*) FROM {table}" + (" WHERE step = ?" if step else "")
    return store.con.sql(sql, params=[step] if step else None).fetchall()[0][0]


def test_rerun_replaces_rows_never_duplicates(store):
    for _ in range(2):
        with store.step("r", 0, "generate") as tx:
            tx.insert("trajectories", trajectories(3))
            tx.insert("turns", [{"traj_id": "t0", "turn_idx": 0, "token_ids": [1, 2], "logprobs": [-0.5, -0.1]}])
    assert count(store, "trajectories") == 3
    assert count(store, "turns") == 1

    with store.step("r", 0, "generate") as tx:
        tx.insert("trajectories", trajectories(2))
    assert sorted(store.con.sql("SELECT traj_id FROM trajectories").fetchall()) == [("t0",), ("t1",)]
    assert count(store, "turns") == 0
    assert store.completed_steps("r", 0) == {"generate"}


def test_failed_step_rolls_back_and_is_marked_failed(store):
    with store.step("r", 0, "generate") as tx:
        tx.insert("trajectories", trajectories(2))
    with store.step("r", 0, "distill") as tx:
        tx.insert("examples", [{"example_id": "e0", "messages": [], "weight": 1.0}])

    with pytest.raises(RuntimeError, match="boom"):
        with store.step("r", 0, "distill") as tx:
            tx.insert("examples", [{"example_id": "e1", "messages": [], "weight": 1.0}])
            raise RuntimeError("boom")

    # the rerun's delete and insert are both rolled back: the earlier commit's row stays
    assert store.con.sql("SELECT example_id FROM examples").fetchall() == [("e0",)]
    assert count(store, "trajectories", "generate") == 2
    status, error = store.con.sql(
        "SELECT status, error FROM steps WHERE step = 'distill'").fetchall()[0]
    assert status == "failed" and error == "RuntimeError: boom"
    assert store.completed_steps("r", 0) == {"generate"}

    with pytest.raises(ValueError):
        with store.step("r", 0, "evaluate") as tx:
            tx.insert("evaluations", [{"eval_id": "v", "model_id": "m"}])
            tx.insert("evaluations", [{"eval_id": "v", "nope": 1}])
    assert count(store, "evaluations") == 0


def test_other_keys_are_untouched(store):
    for run, round_no in [("r", 0), ("r", 1), ("other", 0)]:
        with store.step(run, round_no, "generate") as tx:
            tx.insert("trajectories", trajectories(2))
    with store.step("r", 0, "generate") as tx:
        tx.insert("trajectories", trajectories(1))
    got = store.con.sql("SELECT run_id, round, count(*) FROM trajectories GROUP BY ALL ORDER BY ALL").fetchall()
    assert got == [("other", 0, 2), ("r", 0, 1), ("r", 1, 2)]


def test_rerun_replaces_models_created_by_the_step(store):
    for path in ["ckpt/a", "ckpt/b"]:
        with store.step("r", 0, "train") as tx:
            tx.insert("models", [{"model_id": "r-cand-0", "parent_id": "base", "path": path, "role": "candidate"}])
    assert store.con.sql("SELECT model_id, path FROM models").fetchall() == [("r-cand-0", "ckpt/b")]


def test_unknown_column_names_table_and_column(store):
    with pytest.raises(ValueError, match=r"'trajectories'.*'colour'"):
        with store.step("r", 0, "generate") as tx:
            tx.insert("trajectories", [{"traj_id": "t", "colour": "red"}])
    with pytest.raises(ValueError, match=r"'turns'.*'colour'"):
        with store.step("r", 0, "generate") as tx:
            tx.insert("turns", pa.table({"traj_id": ["t"], "colour": ["red"]}))


def test_step_key_columns_are_filled_or_checked(store):
    with store.step("r", 2, "generate") as tx:
        tx.insert("turns", pa.table({"traj_id": ["t"], "turn_idx": [0], "round": [2]}))
        with pytest.raises(ValueError, match="round"):
            tx.insert("turns", [{"traj_id": "t", "round": 3}])
    assert store.con.sql("SELECT run_id, round, step FROM turns").fetchall() == [("r", 2, "generate")]


def test_json_and_missing_columns(store):
    with store.step("r", 0, "generate") as tx:
        tx.insert("tasks", [{"task_id": "a", "spec": {"goal": "heat", "objs": [1, 2]}},
                            {"task_id": "b", "seed": 7}])
        tx.execute("UPDATE tasks SET split = 'train' WHERE task_id = ?", ["a"])
    rows = store.con.sql("SELECT task_id, split, seed, spec->>'$.goal' FROM tasks ORDER BY task_id").fetchall()
    assert rows == [("a", "train", None, "heat"), ("b", None, 7, None)]


def test_constraint_error_is_reported_not_masked(store):
    with pytest.raises(Exception, match="(?i)duplicate key"):
        with store.step("r", 0, "train") as tx:
            tx.insert("models", [{"model_id": "m"}, {"model_id": "m"}])
    error = store.con.sql("SELECT error FROM steps WHERE step = 'train'").fetchall()[0][0]
    assert "duplicate key" in error.lower()
    with pytest.raises(Exception, match="role"):
        with store.step("r", 0, "train") as tx:
            tx.insert("models", [{"model_id": "m", "role": "king"}])
