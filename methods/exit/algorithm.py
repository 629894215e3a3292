"""ExIt (expert iteration / rejection-sampling SFT): successful trajectories become SFT examples.

Each example is the whole conversation of a successful episode (system, observations, the
model's own actions); the trainer puts the loss on the assistant (action) tokens only.
With `dedupe`, a task's trajectories with the same action sequence yield one example.

`select_examples` adds the data filters of distill.exit and counts what each dropped: actions the env did
not accept (turn `valid` false) stay as context but are not trained (their message indices in
`meta["untrained"]`), `groups="mixed"` keeps successes of groups that also have a failure only, and
`max_per_type` caps the examples of one task type.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    example_id: str
    method: str
    source_traj_id: str
    messages: list[dict]
    weight: float
    meta: dict


@dataclass
class Selection:
    """What `select_examples` kept, and what each filter dropped (`counts`: successes, kept, dropped_all_pass_groups,
    dropped_no_valid_turn, dropped_duplicates, dropped_type_cap, untrained_invalid_turns)."""

    examples: list[Example]
    counts: dict[str, int] = field(default_factory=dict)


def is_success(t: dict, min_reward: float = 1.0) -> bool:
    """Whether a trajectory is verified experience ExIt trains on: finished, successful, reward >= min_reward."""
    return t["status"] == "success" and bool(t["success"]) and (t["reward"] or 0.0) >= min_reward


def invalid_action_indices(t: dict, train_from: int) -> list[int]:
    """Message indices of the trajectory's own assistant messages whose action the env did not accept (their turn's
    `valid` is False; None or a missing flag counts as valid). Own assistant messages (index >= train_from) pair with
    the stored turns in order; a trajectory without `turns` has none marked."""
    turns = t.get("turns")
    if not turns:
        return []
    turns = sorted(turns, key=lambda u: u.get("turn_idx", 0))
    own = [i for i, m in enumerate(t["messages"]) if i >= train_from and m["role"] == "assistant"]
    if len(own) != len(turns):
        raise ValueError(f"trajectory {t['traj_id']!r}: {len(own)} own assistant messages but {len(turns)} turns: "
                         "can't tell which action each turn's valid flag belongs to")
    return [i for i, u in zip(own, turns) if u.get("valid") is False]


def select_examples(trajectories: list[dict], min_reward: float = 1.0, dedupe: bool = True,
                    valid_turns_only: bool = True, groups: str = "all",
                    max_per_type: int | None = None) -> Selection:
    """ExIt's examples of the round's trajectories (dicts with traj_id, task_id, success, reward, status, messages,
    train_from; optionally group_id, task_type and `turns` with their `valid` flags), through the filters in this
    order, taken by traj_id:

    - a success (`is_success`) with at least one own action (counted in `successes`);
    - groups="mixed": its group (same group_id; the task_id where there is none) has a failure, else it is
      counted in `dropped_all_pass_groups`;
    - valid_turns_only: its invalid actions go to meta.untrained (counted in `untrained_invalid_turns` for the
      kept examples); none valid left: `dropped_no_valid_turn`;
    - dedupe: its (task, action sequence) is new, else `dropped_duplicates`;
    - max_per_type: fewer than that many of its task_type kept so far, else `dropped_type_cap`."""
    if groups not in ("all", "mixed"):
        raise ValueError(f"groups must be 'all' or 'mixed', not {groups!r}")
    ordered = sorted(trajectories, key=lambda t: t["traj_id"])

    def group(t: dict) -> str:
        return t.get("group_id") or t["task_id"]

    with_failure = {group(t) for t in ordered if not is_success(t, min_reward)}
    counts = dict.fromkeys(("successes", "kept", "dropped_all_pass_groups", "dropped_no_valid_turn",
                            "dropped_duplicates", "dropped_type_cap", "untrained_invalid_turns"), 0)
    seen: set[tuple] = set()
    per_type: dict = {}
    out = []
    for t in ordered:
        if not is_success(t, min_reward):
            continue
        train_from = t.get("train_from", 0)
        actions = tuple(m["content"] for m in t["messages"][train_from:] if m["role"] == "assistant")
        if not actions:
            continue
        counts["successes"] += 1
        if groups == "mixed" and group(t) not in with_failure:
            counts["dropped_all_pass_groups"] += 1
            continue
        untrained = invalid_action_indices(t, train_from) if valid_turns_only else []
        if len(untrained) == len(actions):
            counts["dropped_no_valid_turn"] += 1
            continue
        key = (t["task_id"], actions)
        if dedupe and key in seen:
            counts["dropped_duplicates"] += 1
            continue
        seen.add(key)
        kind = t.get("task_type")
        if max_per_type is not None and per_type.get(kind, 0) >= max_per_type:
            counts["dropped_type_cap"] += 1
            continue
        per_type[kind] = per_type.get(kind, 0) + 1
        counts["untrained_invalid_turns"] += len(untrained)
        out.append(Example(
            example_id=f"{t['traj_id']}/exit", method="exit", source_traj_id=t["traj_id"],
            messages=t["messages"], weight=1.0,
            meta={"n_actions": len(actions), "reward": t["reward"], "train_from": train_from,
                  **({"untrained": untrained} if untrained else {})},
        ))
    counts["kept"] = len(out)
    return Selection(out, counts)


def exit_examples(trajectories: list[dict], min_reward: float = 1.0, dedupe: bool = True) -> list[Example]:
    """trajectories: dicts with traj_id, task_id, success, reward, status, messages (the conversation)
    and train_from (messages before it are the prompt prefix, e.g. few-shot turns: never trained). Every action of
    a success is trained (no data filter: `select_examples` has them)."""
    return select_examples(trajectories, min_reward, dedupe, valid_turns_only=False).examples


def weight_runs(weights: list[float]) -> list[tuple[int, int, float]]:
    """(start, end, weight) of the maximal runs of equal weight, in order."""
    runs: list[tuple[int, int, float]] = []
    for i, w in enumerate(weights):
        if runs and runs[-1][2] == w:
            runs[-1] = (runs[-1][0], i + 1, w)
        else:
            runs.append((i, i + 1, w))
    return runs
