"""GRPO's data, as plain Python: group-relative advantages.

Advantages (per trajectory, from its group's rewards; a group is G rollouts of one task and seed):
- "grpo":    A_i = (r_i − mean(r)) / (std(r) + eps), std the sample standard deviation (as TRL's
             `scale_rewards="group"`);
- "dr_grpo": A_i = r_i − mean(r) (Dr. GRPO: no std scaling, so easy and hard groups weigh alike).
A uniform group (all rewards equal: all-fail or all-pass) gets A = 0 for every rollout: it is kept
and counted, and contributes no policy gradient.

The rollout/trainer mismatch correction the trainer applies is models/mismatch.py.
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean, stdev

ADVANTAGES = ("grpo", "dr_grpo")


def group_advantages(rewards: list[float], kind: str = "grpo", eps: float = 1e-4) -> list[float]:
    """The advantages of one group's rollouts, in order (see the module docstring)."""
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage {kind!r}; expected one of {ADVANTAGES}")
    if not rewards:
        return []
    m = mean(rewards)
    centred = [r - m for r in rewards]
    if kind == "dr_grpo":
        return centred
    sd = stdev(rewards) if len(rewards) > 1 else 0.0
    return [c / (sd + eps) for c in centred]


def trajectory_advantages(trajectories: list[dict], kind: str = "grpo", eps: float = 1e-4,
                          bonus: dict[str, float] | None = None) -> dict[str, float]:
    """{traj_id: advantage} for trajectories with traj_id, group_id and reward (None counts as 0). With `bonus`
    ({traj_id: b}, e.g. X-Tree's online bonus), the advantage is taken over the shaped reward r + b."""
    bonus = bonus or {}
    groups: dict[str, list[dict]] = defaultdict(list)
    for t in trajectories:
        groups[t["group_id"]].append(t)
    out = {}
    for members in groups.values():
        advs = group_advantages([float(t["reward"] or 0.0) + bonus.get(t["traj_id"], 0.0) for t in members], kind,
                                eps)
        out.update({t["traj_id"]: a for t, a in zip(members, advs)})
    return out
