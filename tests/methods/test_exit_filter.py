"""ExIt's data filters (distill.exit): invalid actions kept as context but untrained, successes of mixed groups
only, a cap per task type, and the counts of what each dropped."""

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.methods.base import TURN_WEIGHTS, DistillContext, Method
from rsiflow.methods.exit.algorithm import exit_examples, select_examples
from rsiflow.methods.exit.method import ExIt
from tests.conftest import TINY, tiny_overrides

PREFIX = [{"role": "system", "content": "s"}]


def _traj(tid, task, success, actions, valid=None, group=None, kind="t", status=None):
    """A trajectory as trajectories_with_turns gives it: the prefix, then (observation, action) per turn, with the
    turns' valid flags (all valid unless given)."""
    valid = valid or [True] * len(actions)
    msgs = list(PREFIX)
    for a in actions:
        msgs += [{"role": "user", "content": "obs"}, {"role": "assistant", "content": a}]
    return {"traj_id": tid, "task_id": task, "group_id": group or f"g-{task}", "task_type": kind,
            "success": success, "reward": 1.0 if success else 0.0,
            "status": status or ("success" if success else "failure"), "messages": msgs, "train_from": len(PREFIX),
            "turns": [{"turn_idx": i, "action_text": a, "valid": v} for i, (a, v) in enumerate(zip(actions, valid))]}


def test_an_invalid_turn_of_a_success_is_context_not_trained():
    trajs = [_traj("t1", "A", True, ["think", "answer 5"], valid=[False, True]),
             _traj("t2", "B", True, ["oops", "nope"], valid=[False, False]),     # no valid action: no example
             _traj("t3", "C", True, ["answer 2"])]
    sel = select_examples(trajs)
    assert [e.source_traj_id for e in sel.examples] == ["t1", "t3"]
    t1 = sel.examples[0]
    assert t1.messages == trajs[0]["messages"]                    # the whole conversation stays
    assert t1.meta["untrained"] == [2]                             # message 2: the "think" reply
    assert t1.messages[2]["content"] == "think"
    assert "untrained" not in sel.examples[1].meta
    assert sel.counts["untrained_invalid_turns"] == 1 and sel.counts["dropped_no_valid_turn"] == 1
    assert sel.counts["kept"] == 2 and sel.counts["successes"] == 3
    # off: every action trained, as before (and exit_examples keeps the old behaviour)
    off = select_examples(trajs, valid_turns_only=False)
    assert len(off.examples) == 3 and all("untrained" not in e.meta for e in off.examples)
    assert [e.source_traj_id for e in exit_examples(trajs)] == ["t1", "t2", "t3"]


def test_mixed_groups_keeps_successes_of_groups_with_a_failure():
    trajs = [_traj("a1", "A", True, ["x"]), _traj("a2", "A", True, ["y"]),        # A: all pass
             _traj("b1", "B", True, ["x"]), _traj("b2", "B", False, ["z"]),       # B: mixed
             _traj("c1", "C", False, ["z"]),                                       # C: all fail
             _traj("d1", "D", True, ["x"]), _traj("d2", "D", True, ["x"], status="error")]  # an error is a failure
    every = select_examples(trajs, groups="all")
    assert [e.source_traj_id for e in every.examples] == ["a1", "a2", "b1", "d1"]
    mixed = select_examples(trajs, groups="mixed")
    assert [e.source_traj_id for e in mixed.examples] == ["b1", "d1"]
    assert mixed.counts["dropped_all_pass_groups"] == 2 and mixed.counts["kept"] == 2
    assert every.counts["dropped_all_pass_groups"] == 0


def test_type_cap_keeps_the_first_by_traj_id_and_counts_duplicates_apart():
    trajs = [_traj("t4", "D", True, ["d"], kind="heat"),
             _traj("t1", "A", True, ["a"], kind="heat"),
             _traj("t2", "A", True, ["a"], kind="heat"),        # a duplicate of t1: not counted against the cap
             _traj("t3", "B", True, ["b"], kind="heat"),
             _traj("t5", "E", True, ["e"], kind="cool")]
    sel = select_examples(trajs, max_per_type=2)
    assert [e.source_traj_id for e in sel.examples] == ["t1", "t3", "t5"]
    assert sel.counts == {"successes": 5, "kept": 3, "dropped_all_pass_groups": 0, "dropped_no_valid_turn": 0,
                          "dropped_duplicates": 1, "dropped_type_cap": 1, "untrained_invalid_turns": 0}
    assert len(select_examples(trajs).examples) == 4


def _ctx(tmp_path, trajs, *sets):
    cfg = load_config([TINY], tiny_overrides(tmp_path, "distill.methods=[exit]", *sets))
    return cfg, DistillContext(cfg=cfg, round=1, champion="c", champion_path="", trajectories=trajs, prefix=PREFIX)


def test_exit_distill_counts_each_filter_and_the_rows_leave_invalid_turns_untrained(tmp_path):
    trajs = [_traj("a1", "A", True, ["think", "go"], valid=[False, True]), _traj("a2", "A", False, ["no"]),
             _traj("b1", "B", True, ["go"]), _traj("b2", "B", True, ["go"])]     # B: all pass
    cfg, ctx = _ctx(tmp_path, trajs, "distill.exit.groups=mixed")
    method = ExIt(cfg)
    out = method.distill(ctx, None)
    assert [e["source_traj_id"] for e in out.examples] == ["a1"]
    assert out.metrics == {"examples": 1, "successes": 3, "kept": 1, "dropped_all_pass_groups": 2,
                           "dropped_no_valid_turn": 0, "dropped_duplicates": 0, "dropped_type_cap": 0,
                           "untrained_invalid_turns": 1}
    (row,) = method.training_rows(None, "run", 1, out.examples)
    assert row["untrained"] == [2] and row["train_from"] == 1
    assert ExIt.replayable and not Method.replayable


def test_xtree_token_weight_spans_keep_untrained_turns_untrained(tmp_path):
    # turns: 0 invalid, 1 valid, 2 valid; weights make runs [0,1) and [1,3)
    trajs = [_traj("a1", "A", True, ["think", "go", "take"], valid=[False, True, True])]
    cfg, ctx = _ctx(tmp_path, trajs, "distill.xtree.token_weights=true", "distill.exit.dedupe=false")
    ctx.state[TURN_WEIGHTS] = {"a1": [2.0, 0.5, 0.5]}   # as X-Tree's distill provides them
    out = ExIt(cfg).distill(ctx, None)
    # the span of turn 0 only trains the invalid action: left out; the span of turns 1-2 keeps the meta
    assert [e["meta"]["turns"] for e in out.examples] == [[1, 3]]
    (span,) = out.examples
    assert span["meta"]["untrained"] == [2] and span["meta"]["train_from"] == 1 + 2 * 1
    assert out.metrics["examples"] == 1 and out.metrics["untrained_invalid_turns"] == 1
    # one run of weights: the row itself, reweighted, still with its untrained turn
    ctx.state[TURN_WEIGHTS] = {"a1": [1.0, 1.0, 1.0]}
    (whole,) = ExIt(cfg).distill(ctx, None).examples
    assert whole["meta"]["untrained"] == [2] and whole["meta"]["train_from"] == 1


def test_turns_that_do_not_match_the_messages_are_an_error():
    t = _traj("a1", "A", True, ["x", "y"])
    t["turns"] = t["turns"][:1]
    with pytest.raises(ValueError, match="2 own assistant messages but 1 turns"):
        select_examples([t])
