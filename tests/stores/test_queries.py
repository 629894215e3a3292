"""The named reads the pipeline steps use instead of SQL of their own, on a small hand-made round."""

import pytest

RUN = "run1"


def _round(store):
    store.create_run(RUN, RUN, {}, "base")
    with store.step(RUN, 0, "init") as tx:
        tx.insert("models", [{"model_id": "base", "path": "ckpt/base", "role": "base"}])
    store.start_round(RUN, 1, "base")
    with store.step(RUN, 1, "generate") as tx:
        tx.insert("tasks", [{"task_id": "k1", "env": "household", "split": "train", "task_type": "heat", "seed": 7,
                             "spec": '{"a": 1}'}])
        tx.insert("trajectories", [
            {"traj_id": "t1", "task_id": "k1", "model_id": "base", "group_id": "g", "purpose": "train",
             "status": "success", "success": True, "reward": 1.0, "n_turns": 2, "gen_tokens": 5},
            {"traj_id": "t2", "task_id": "k1", "model_id": "base", "group_id": "g", "purpose": "train",
             "status": "failure", "success": False, "reward": 0.0, "n_turns": 1, "gen_tokens": 3}])
        tx.insert("turns", [
            {"traj_id": "t1", "turn_idx": 1, "observation": "o2", "action_text": "b", "valid": True, "feedback": "ok"},
            {"traj_id": "t1", "turn_idx": 0, "observation": "o1", "action_text": "a", "raw_text": "A.", "valid": True,
             "feedback": "ok"},
            {"traj_id": "t2", "turn_idx": 0, "observation": "o1", "action_text": "x", "valid": False,
             "feedback": "inadmissible"}])
    with store.step(RUN, 1, "distill") as tx:
        tx.insert("examples", [{"example_id": "e1", "method": "exit", "source_traj_id": "t1",
                                "messages": [{"role": "user", "content": "go"}], "weight": 1.0}])
        tx.insert("foresight", [{"foresight_id": "f1", "group_id": "g", "task_id": "k1", "channel": "pitfall",
                                 "student_messages": [{"role": "user", "content": "s"}],
                                 "teacher_messages": [{"role": "user", "content": "t"}], "train_from": 1,
                                 "completion_ids": [4, 5], "sampling_logprobs": [-0.5, -0.25]}])
        tx.metrics({"exit": {"examples": 1}})
    with store.step(RUN, 1, "train") as tx:
        tx.insert("models", [{"model_id": "cand", "parent_id": "base", "path": "ckpt/cand", "role": "candidate",
                              "train_metrics": {"train_loss": 0.5}}])
    with store.step(RUN, 1, "gate") as tx:
        tx.insert("trajectories", [{"traj_id": "v1", "task_id": "h1", "model_id": "cand", "purpose": "eval",
                                    "success": True, "gen_tokens": 4}])
        tx.insert("evaluations", [{"eval_id": "v", "model_id": "cand", "split": "heldout", "env": "household",
                                   "task_type": "*", "n": 10, "successes": 6, "success_rate": 0.6, "ci_low": 0.3,
                                   "ci_high": 0.8}])
        tx.set_model_role("cand", "champion")
        with pytest.raises(LookupError, match="'ghost'"):
            tx.set_model_role("ghost", "champion")


def test_named_reads_of_a_round(store):
    _round(store)
    assert store.model_path("cand") == "ckpt/cand" and store.has_model("cand") and not store.has_model("ghost")
    with pytest.raises(LookupError, match="'ghost' is not in the store's registry"):
        store.model_path("ghost")
    assert store.rows("SELECT role FROM models WHERE model_id = 'cand'") == [{"role": "champion"}]
    assert store.train_metrics("cand") == {"train_loss": 0.5} and store.train_metrics(None) == {}
    tasks = store.step_tasks(RUN, 1, "generate")
    assert [(t["task_id"], t["task_type"], t["seed"]) for t in tasks] == [("k1", "heat", 7)]
    trajs = store.step_trajectories(RUN, 1, "generate")
    assert [(t["traj_id"], t["task_type"], t["success"]) for t in trajs] == [
        ("t1", "heat", True), ("t2", "heat", False)]
    assert [(t["traj_id"], t["turn_idx"], t["raw_text"]) for t in store.step_turns(RUN, 1, "generate")] == [
        ("t1", 0, "A."), ("t1", 1, None), ("t2", 0, None)]
    assert [r["traj_id"] for r in store.eval_trajectories(RUN, "cand")] == ["v1"]
    pair = store.foresight_pairs(RUN, 1)["f1"]
    assert pair["student_messages"] == [{"role": "user", "content": "s"}] and pair["completion_ids"] == [4, 5]
    assert store.latest_heldout(RUN, "cand")["success_rate"] == 0.6 and store.latest_heldout(RUN, "base") is None
    assert store.projected_share(RUN, 1) == pytest.approx(1 / 3) and store.count_examples(RUN, 1) == 1
    assert set(store.step_seconds(RUN, 1)) == {"generate", "distill", "train", "gate"}
    assert store.step_metrics(RUN, 1, "distill") == {"exit": {"examples": 1}}
    assert store.step_metrics(RUN, 1, "train") is None
    assert [(s["round"], s["step"], s["status"]) for s in store.step_history(RUN)][:2] == [
        (0, "init", "completed"), (1, "generate", "completed")]


def test_step_metrics_are_replaced_on_a_rerun_and_cleared_on_failure(store):
    with store.step(RUN, 1, "distill") as tx:
        tx.metrics({"a": 1})
    with store.step(RUN, 1, "distill") as tx:
        tx.metrics({"a": 2})
    assert store.step_metrics(RUN, 1, "distill") == {"a": 2}
    with pytest.raises(RuntimeError), store.step(RUN, 1, "distill") as tx:
        tx.metrics({"a": 3})
        raise RuntimeError("boom")
    assert store.step_metrics(RUN, 1, "distill") is None  # the failed attempt is the step's last state
