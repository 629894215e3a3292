"""ExIt (expert iteration / rejection-sampling SFT): successful trajectories become SFT examples.

Each example is the whole conversation of a successful episode (system, observations, the
model's own actions); the trainer puts the loss on the assistant (action) tokens only.
With `dedupe`, a task's trajectories with the same action sequence yield one example.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    example_id: str
    method: str
    source_traj_id: str
    messages: list[dict]
    weight: float
    meta: dict


def exit_examples(trajectories: list[dict], min_reward: float = 1.0, dedupe: bool = True) -> list[Example]:
    """trajectories: dicts with traj_id, task_id, success, reward, status, messages (the conversation)
    and train_from (messages before it are the prompt prefix, e.g. few-shot turns: never trained)."""
    seen: set[tuple] = set()
    out = []
    for t in sorted(trajectories, key=lambda t: t["traj_id"]):
        if t["status"] != "success" or not t["success"] or (t["reward"] or 0.0) < min_reward:
            continue
        train_from = t.get("train_from", 0)
        actions = tuple(m["content"] for m in t["messages"][train_from:] if m["role"] == "assistant")
        if not actions:
            continue
        key = (t["task_id"], actions)
        if dedupe and key in seen:
            continue
        seen.add(key)
        out.append(Example(
            example_id=f"{t['traj_id']}/exit", method="exit", source_traj_id=t["traj_id"],
            messages=t["messages"], weight=1.0,
            meta={"n_actions": len(actions), "reward": t["reward"], "train_from": train_from},
        ))
    return out
