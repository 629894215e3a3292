"""Group statistics: a group is G rollouts of one task from one seed.

Uniform groups (all fail / all pass) give GRPO zero advantage; they are counted, never dropped,
because methods such as SRD learn from exactly those.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean, pstdev


@dataclass(frozen=True)
class GroupStats:
    group_id: str
    n: int
    mean_reward: float
    std_reward: float
    successes: int

    @property
    def kind(self) -> str:
        if self.successes == 0:
            return "all_fail"
        if self.successes == self.n:
            return "all_pass"
        return "mixed"


def group_stats(rows: list[dict]) -> list[GroupStats]:
    """rows: dicts with group_id, reward, success (errored episodes count as failures)."""
    by_group: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r)
    out = []
    for gid in sorted(by_group):
        rs = by_group[gid]
        rewards = [float(r["reward"] or 0.0) for r in rs]
        out.append(GroupStats(gid, len(rs), mean(rewards), pstdev(rewards), sum(bool(r["success"]) for r in rs)))
    return out


def group_counts(stats: list[GroupStats]) -> dict[str, int]:
    counts = {"groups": len(stats), "all_fail": 0, "all_pass": 0, "mixed": 0}
    for s in stats:
        counts[s.kind] += 1
    return counts
