"""Gate statistics, group statistics and ExIt on small inputs with known answers."""

import pytest

from rsiflow.methods.exit.algorithm import exit_examples
from rsiflow.stats.groups import group_counts, group_stats
from rsiflow.stats.success import compare, should_promote, wilson_interval


def test_wilson_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and hi == pytest.approx(0.1611, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_promotion_rules():
    champ = [True] * 5 + [False] * 15           # 0.25
    same = list(champ)
    much_worse = [False] * 20                    # Wilson upper 0.161 < 0.25
    much_better = [True] * 16 + [False] * 4      # lower bound 0.584 > 0.25
    assert should_promote(compare(same, champ, "no_worse"))
    assert not should_promote(compare(much_worse, champ, "no_worse"))
    assert not should_promote(compare(same, champ, "better"))
    assert should_promote(compare(much_better, champ, "better"))
    assert should_promote(compare(much_worse, champ, "always"))
    ev = compare(much_better, champ, "better")
    assert ev.wins == 11 and ev.losses == 0 and ev.paired_diff == pytest.approx(11 / 20)
    with pytest.raises(ValueError):
        compare([True], [True, False], "no_worse")


def test_group_kinds_are_counted_not_dropped():
    rows = [
        {"group_id": "a", "reward": 0.0, "success": False}, {"group_id": "a", "reward": 0.0, "success": False},
        {"group_id": "b", "reward": 1.0, "success": True}, {"group_id": "b", "reward": 1.0, "success": True},
        {"group_id": "c", "reward": 1.0, "success": True}, {"group_id": "c", "reward": 0.0, "success": False},
    ]
    stats = group_stats(rows)
    assert [s.kind for s in stats] == ["all_fail", "all_pass", "mixed"]
    assert stats[2].mean_reward == 0.5 and stats[2].std_reward == 0.5
    assert group_counts(stats) == {"groups": 3, "all_fail": 1, "all_pass": 1, "mixed": 1}


def _traj(tid, task, success, actions, status=None):
    msgs = [{"role": "system", "content": "s"}]
    for a in actions:
        msgs += [{"role": "user", "content": "obs"}, {"role": "assistant", "content": a}]
    return {"traj_id": tid, "task_id": task, "success": success, "reward": 1.0 if success else 0.0,
            "status": status or ("success" if success else "failure"), "messages": msgs}


def test_exit_keeps_successes_and_dedupes_action_sequences():
    trajs = [
        _traj("t1", "A", True, ["go to x", "take y"]),
        _traj("t2", "A", True, ["go to x", "take y"]),      # same actions, same task: a duplicate
        _traj("t3", "B", True, ["go to x", "take y"]),      # same actions, other task: kept
        _traj("t4", "A", False, ["look"]),
        _traj("t5", "A", True, ["look"], status="error"),   # errored episodes never train
    ]
    ex = exit_examples(trajs)
    assert [e.source_traj_id for e in ex] == ["t1", "t3"]
    assert all(e.method == "exit" and e.weight == 1.0 for e in ex)
    assert len(exit_examples(trajs, dedupe=False)) == 3
