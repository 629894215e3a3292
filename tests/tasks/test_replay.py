"""The replay buffer (train.replay): the store's read of earlier rounds' examples with their tasks, and the
selection (dedupe over the whole buffer, the per-task cap newest round first, the rounds window, never a GRPO
example). The slow test trains a round from the base on a buffer only (train.init base, an empty round)."""

import json

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.methods import enabled_methods
from rsiflow.stores.store import Store
from rsiflow.tasks.train import replay_buffer, select_replay
from tests.conftest import TINY, tiny_overrides

RUN = "tiny"
# (round, task, action): ExIt examples of rounds 1-3 and of the current round 4
EXIT = [(1, "A", "a1"), (1, "B", "b"), (1, "C", "c1"),
        (2, "A", "a1"), (2, "A", "a2"), (2, "B", "b"),
        (3, "A", "a3"), (3, "A", "a4"), (3, "B", "c2"), (3, "C", "c2"),
        (4, "A", "a5"), (4, "B", "b")]
GRPO = [(1, "A", "a1"), (2, "C", "g"), (3, "A", "a9")]


def _msgs(action):
    return [{"role": "system", "content": "s"}, {"role": "user", "content": "obs"},
            {"role": "assistant", "content": action}]


def _fill(store):
    for r in range(1, 5):
        trajs, examples = [], []
        for method, rows in (("exit", EXIT), ("grpo", GRPO)):
            for rr, task, action in rows:
                if rr != r:
                    continue
                tid = f"r{r}-{task}-{action}-{method}"
                trajs.append({"traj_id": tid, "task_id": task, "model_id": "m", "purpose": "train",
                              "status": "success", "success": True, "reward": 1.0, "n_turns": 1})
                meta = {"train_from": 1, **({"advantage": 0.5} if method == "grpo" else {})}
                examples.append({"example_id": f"r{r}-{task}-{action}/{method}", "method": method,
                                 "source_traj_id": tid, "messages": _msgs(action), "weight": 1.0, "meta": meta})
        with store.step(RUN, r, "generate") as tx:
            tx.insert("trajectories", trajs)
        with store.step(RUN, r, "distill") as tx:
            tx.insert("examples", examples)


@pytest.fixture
def filled(tmp_path):
    with Store(tmp_path / "store.duckdb") as store:
        _fill(store)
        yield store


def _current(store):
    return [{**e, "meta": json.loads(e["meta"])} for e in store.examples_dataset(RUN, 4)]


def _cfg(tmp_path, *sets):
    return load_config([TINY], tiny_overrides(tmp_path, "distill.methods=[exit,grpo]", *sets))


def _ids(kept):
    return [e["example_id"] for e in kept]


def test_examples_before_reads_earlier_rounds_newest_first_with_their_tasks(filled):
    rows = filled.examples_before(RUN, 4, "exit")
    assert [(r["round"], r["task_id"], r["messages"][-1]["content"]) for r in rows] == [
        (3, "A", "a3"), (3, "A", "a4"), (3, "B", "c2"), (3, "C", "c2"),
        (2, "A", "a1"), (2, "A", "a2"), (2, "B", "b"), (1, "A", "a1"), (1, "B", "b"), (1, "C", "c1")]
    assert rows[0]["meta"] == {"train_from": 1} and rows[0]["method"] == "exit" and rows[0]["weight"] == 1.0
    assert rows[0]["messages"] == _msgs("a3") and rows[0]["source_traj_id"] == "r3-A-a3-exit"
    assert [r["round"] for r in filled.examples_before(RUN, 4, "exit", first_round=3)] == [3] * 4
    assert [r["round"] for r in filled.examples_before(RUN, 2, "exit")] == [1] * 3       # never this round or later
    assert [r["example_id"] for r in filled.examples_before(RUN, 4, "grpo")] == ["r3-A-a9/grpo", "r2-C-g/grpo",
                                                                                "r1-A-a1/grpo"]
    assert filled.example_task_ids(RUN, 4) == {"r4-A-a5/exit": "A", "r4-B-b/exit": "B"}


def test_dedupe_and_the_per_task_cap_newest_first_over_every_earlier_round(filled, tmp_path):
    cfg = _cfg(tmp_path, "train.replay.rounds=null", "train.replay.per_task=3")
    replayed, counts = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    # A: a5 this round + a3, a4 (round 3) = 3, the cap; B: b this round (both older b's are duplicates) + c2
    # (another task's actions: not a duplicate); C: c2 (round 3), c1 (round 1)
    assert _ids(replayed["exit"]) == ["r3-A-a3/exit", "r3-A-a4/exit", "r3-B-c2/exit", "r3-C-c2/exit",
                                      "r1-C-c1/exit"]
    assert counts == {"selected": 5, "dropped_duplicates": 2, "dropped_cap": 3}
    # per_task 1: this round's A and B fill their tasks; only C's newest example joins
    cfg = _cfg(tmp_path, "train.replay.rounds=null", "train.replay.per_task=1")
    replayed, counts = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    assert _ids(replayed["exit"]) == ["r3-C-c2/exit"]
    assert counts["dropped_cap"] == 7 and counts["dropped_duplicates"] == 2


def test_without_dedupe_or_cap_every_earlier_example_joins(filled, tmp_path):
    cfg = _cfg(tmp_path, "train.replay.rounds=null", "train.replay.per_task=null", "train.replay.dedupe=false")
    replayed, counts = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    assert len(replayed["exit"]) == 10 and counts == {"selected": 10, "dropped_duplicates": 0, "dropped_cap": 0}
    # dedupe on, no cap: round 2's a1 is kept and round 1's (older, the same actions of task A) dropped
    cfg = _cfg(tmp_path, "train.replay.rounds=null", "train.replay.per_task=null")
    replayed, counts = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    ids = _ids(replayed["exit"])
    assert "r2-A-a1/exit" in ids and "r1-A-a1/exit" not in ids and "r2-B-b/exit" not in ids
    assert counts["dropped_duplicates"] == 3 and len(ids) == 7


def test_the_rounds_window_and_off(filled, tmp_path):
    cfg = _cfg(tmp_path, "train.replay.rounds=1", "train.replay.per_task=null")
    replayed, _ = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    assert {e["round"] for e in replayed["exit"]} == {3} and len(replayed["exit"]) == 4
    cfg = _cfg(tmp_path, "train.replay.rounds=2", "train.replay.per_task=null")
    replayed, _ = replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled))
    assert {e["round"] for e in replayed["exit"]} == {2, 3}
    cfg = _cfg(tmp_path)                                   # the default: off
    assert cfg.train.replay.rounds == 0
    assert replay_buffer(filled, cfg, enabled_methods(cfg), 4, _current(filled)) == (
        {}, {"selected": 0, "dropped_duplicates": 0, "dropped_cap": 0})


def test_grpo_examples_are_never_replayed(filled, tmp_path):
    cfg = _cfg(tmp_path, "train.replay.rounds=null", "train.replay.per_task=null", "train.replay.dedupe=false")
    methods = enabled_methods(cfg)
    assert [m.name for m in methods] == ["exit", "grpo"] and [m.replayable for m in methods] == [True, False]
    replayed, _ = replay_buffer(filled, cfg, methods, 4, _current(filled))
    assert set(replayed) == {"exit"}
    assert not any(e["method"] == "grpo" for es in replayed.values() for e in es)


def test_select_replay_keeps_this_rounds_examples_and_counts_against_them():
    def ex(i, task, action, round_no=1):
        return {"example_id": i, "source_traj_id": i, "task_id": task, "round": round_no, "meta": {"train_from": 1},
                "messages": _msgs(action)}
    current = [ex("c1", "A", "x"), ex("c2", "A", "x")]          # this round's duplicates are not replay's to drop
    kept, counts = select_replay(current, [ex("e1", "A", "x"), ex("e2", "A", "y"), ex("e3", "B", "y")], 3, True)
    assert _ids(kept) == ["e2", "e3"] and counts == {"dropped_duplicates": 1, "dropped_cap": 0}
    kept, counts = select_replay(current, [ex("e2", "A", "y"), ex("e3", "B", "y")], 2, True)
    assert _ids(kept) == ["e3"] and counts == {"dropped_duplicates": 0, "dropped_cap": 1}


@pytest.mark.slow
def test_a_round_without_examples_trains_from_the_base_on_the_buffer(tmp_path, prefect_api):
    """Round 1 trains on 4 expert examples; round 2's distill writes none of its own (ExIt finds no success in
    the tiny random model's rollouts, or any it finds join): its candidate is trained from the base (train.init
    base) on the buffer, with the replayed examples in its lineage, and retention keeps the base."""
    from prefect import flow

    from rsiflow.flows.round import improvement_round
    from rsiflow.models.card import read_model_card
    from rsiflow.tasks.evaluate import evaluate_rollouts
    from rsiflow.tasks.generate import generate_rollouts
    from rsiflow.tasks.setup import ensure_run
    from tests.models.test_trainer_sft import expert_conversation

    overrides = tiny_overrides(tmp_path, "gate.rule=always", "train.init=base", "train.replay.rounds=null",
                               "distill.exit.min_reward=2.0")   # ExIt keeps no rollout: round 2 has no examples
    cfg = load_config([TINY], overrides)
    ensure_run(cfg)
    with Store(cfg.run.store) as s:
        s.start_round(RUN, 1, s.champion(RUN))

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
    with Store(cfg.run.store) as s, s.step(RUN, 1, "distill") as tx:
        tx.insert("examples", examples)
    assert improvement_round([TINY], overrides)["round"] == 1
    second = improvement_round([TINY], overrides)
    assert second["round"] == 2
    with Store(cfg.run.store, read_only=True) as s:
        assert s.count_examples(RUN, 2) == 0
        (m,) = s.rows("SELECT parent_id, train_metrics FROM models WHERE model_id = 'tiny/r2/candidate'",
                      json_cols=("train_metrics",))
        assert m["parent_id"] == "tiny/base" and s.champion(RUN) == "tiny/r2/candidate"
        tm = m["train_metrics"]
        assert tm["replay"] == {"examples": 4, "rounds": [1], "selected": 4, "dropped_duplicates": 0,
                                "dropped_cap": 0, "buffer_examples": 4}
        assert tm["learning_rate"] == 1e-3 and tm["init"] == "base" and tm["steps"] > 0
        assert [r["example_id"] for r in s.training_examples_of("tiny/r2/candidate")] == [
            f"expert-{i}" for i in range(4)]
        assert s.expired_checkpoints(RUN, 0) == []
        base_path = s.model_path("tiny/base")
    card = read_model_card(cfg.run_dir / "models" / "round-2-candidate")
    assert card["parent_id"] == "tiny/base" and card["parent_path"] == base_path and card["init"] == "base"
    assert card["champion"] == "tiny/r1/candidate" and card["training"]["learning_rate"] == 1e-3
