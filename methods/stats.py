"""Success statistics for the gate: Wilson intervals, the paired comparison, the interval-based rules.

The paired rules (paired_test, paired_margin) and the sequential procedure are in methods/gating.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True)
class GateEvidence:
    n: int
    candidate_successes: int
    champion_successes: int
    candidate_rate: float
    champion_rate: float
    candidate_ci: tuple[float, float]
    champion_ci: tuple[float, float]
    paired_diff: float            # mean over tasks of (candidate success - champion success)
    paired_diff_ci: tuple[float, float]  # normal-approximation interval of that mean
    wins: int                     # tasks the candidate solved and the champion did not
    losses: int                   # tasks the champion solved and the candidate did not
    rule: str
    confidence: float

    def to_dict(self) -> dict:
        return asdict(self)


def compare(candidate: list[bool], champion: list[bool], rule: str, confidence: float = 0.95) -> GateEvidence:
    """Paired comparison on the same tasks (index i = the same task and seed for both)."""
    if len(candidate) != len(champion) or not candidate:
        raise ValueError(f"need equal, non-empty paired results, got {len(candidate)} and {len(champion)}")
    n = len(candidate)
    cs, hs = sum(candidate), sum(champion)
    diffs = [int(a) - int(b) for a, b in zip(candidate, champion)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(1, n - 1)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    half = z * math.sqrt(var / n)
    return GateEvidence(
        n=n, candidate_successes=cs, champion_successes=hs, candidate_rate=cs / n, champion_rate=hs / n,
        candidate_ci=wilson_interval(cs, n, confidence), champion_ci=wilson_interval(hs, n, confidence),
        paired_diff=mean, paired_diff_ci=(mean - half, mean + half),
        wins=sum(d > 0 for d in diffs), losses=sum(d < 0 for d in diffs), rule=rule, confidence=confidence,
    )


def should_promote(ev: GateEvidence) -> bool:
    """The interval-based promotion rules (config `gate.rule`), applied to the evidence.

    no_worse: promote unless the candidate is worse beyond its interval
              (its Wilson upper bound lies below the champion's success rate);
    better:   promote only if the candidate's Wilson lower bound lies above the champion's rate;
    always:   promote.
    """
    if ev.rule == "always":
        return True
    if ev.rule == "no_worse":
        return ev.candidate_ci[1] >= ev.champion_rate
    if ev.rule == "better":
        return ev.candidate_ci[0] > ev.champion_rate
    raise ValueError(f"unknown gate rule {ev.rule!r}: expected no_worse, better or always")
