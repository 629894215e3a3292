"""Success statistics for the gate: Wilson intervals, the paired comparison, the interval-based rules.

The paired rules (paired_test, paired_margin) and the sequential procedure are in stats/gating.py.
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


def mean_interval(rates: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """Normal interval of the mean of per-task rates (each task's share of its k plays that succeeded), clipped
    to [0, 1]: the k plays of one task are not independent, so the task is the unit, not the play. Where every task
    has the same rate the spread says nothing: the Wilson interval of that rate over the n tasks."""
    n = len(rates)
    if n == 0:
        return 0.0, 1.0
    mean = sum(rates) / n
    var = sum((r - mean) ** 2 for r in rates) / max(1, n - 1)
    if var == 0:   # every task alike (e.g. all unsolved): the normal interval collapses; Wilson over the tasks
        return wilson_interval(round(mean * n), n, confidence)
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(var / n)
    return max(0.0, mean - half), min(1.0, mean + half)


def detectable_gain(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true gain in success rate a one-sided paired test at level `alpha` detects with probability
    `power` on `n` tasks, when the per-task paired differences (candidate rate - champion rate) have standard
    deviation `sd` (normal approximation: (z_(1-alpha) + z_power) * sd / sqrt(n))."""
    if n < 1:
        return math.inf
    z = NormalDist().inv_cdf
    return (z(1 - alpha) + z(power)) * sd / math.sqrt(n)


def tasks_for_gain(gain: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Held-out tasks the paired test needs to detect `gain` with probability `power` (inverse of
    `detectable_gain`)."""
    z = NormalDist().inv_cdf
    return max(1, math.ceil(((z(1 - alpha) + z(power)) * sd / gain) ** 2))


def design_sd(rate: float, samples: int) -> float:
    """The standard deviation of a task's paired difference when candidate and champion solve it independently at
    the same `rate` with `samples` plays each (2 p (1 - p) / k): a design value for `detectable_gain` before any
    paired data exists. Tasks of unequal difficulty make the real figure smaller (they cancel in the pair)."""
    return math.sqrt(2 * rate * (1 - rate) / samples)


@dataclass(frozen=True)
class GateEvidence:
    n: int                        # tasks
    candidate_successes: int      # plays that succeeded, over all tasks (n * samples plays)
    champion_successes: int
    candidate_rate: float
    champion_rate: float
    candidate_ci: tuple[float, float]   # Wilson with one play per task, else the per-task mean's interval
    champion_ci: tuple[float, float]
    paired_diff: float            # mean over tasks of (candidate rate - champion rate)
    paired_diff_ci: tuple[float, float]  # normal-approximation interval of that mean
    wins: int                     # tasks the candidate did better on (greedy: solved, the champion did not)
    losses: int                   # tasks the champion did better on
    rule: str
    confidence: float
    samples: int = 1              # plays per task and model: 1 greedy, k sampled
    diffs: tuple[int, ...] = ()   # per task: candidate successes - champion successes
    paired_sd: float = 0.0        # standard deviation of the per-task rate differences

    def to_dict(self) -> dict:
        return asdict(self)


def compare(candidate: list, champion: list, rule: str, confidence: float = 0.95,
            samples: int = 1) -> GateEvidence:
    """Paired comparison on the same tasks (index i = the same task for both): per task a success (bool, greedy)
    or the number of its `samples` plays that succeeded."""
    if len(candidate) != len(champion) or not candidate:
        raise ValueError(f"need equal, non-empty paired results, got {len(candidate)} and {len(champion)}")
    if samples < 1 or any(not 0 <= int(x) <= samples for x in [*candidate, *champion]):
        raise ValueError(f"per-task successes must lie in [0, samples={samples}]")
    n, k = len(candidate), samples
    cs, hs = sum(int(x) for x in candidate), sum(int(x) for x in champion)
    diffs = [int(a) - int(b) for a, b in zip(candidate, champion)]
    rates = [d / k for d in diffs]
    mean = sum(rates) / n
    var = sum((d - mean) ** 2 for d in rates) / max(1, n - 1)
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    half = z * math.sqrt(var / n)
    if k == 1:
        c_ci, h_ci = wilson_interval(cs, n, confidence), wilson_interval(hs, n, confidence)
    else:
        c_ci = mean_interval([int(x) / k for x in candidate], confidence)
        h_ci = mean_interval([int(x) / k for x in champion], confidence)
    return GateEvidence(
        n=n, candidate_successes=cs, champion_successes=hs, candidate_rate=cs / (n * k), champion_rate=hs / (n * k),
        candidate_ci=c_ci, champion_ci=h_ci, paired_diff=mean, paired_diff_ci=(mean - half, mean + half),
        wins=sum(d > 0 for d in diffs), losses=sum(d < 0 for d in diffs), rule=rule, confidence=confidence,
        samples=k, diffs=tuple(diffs), paired_sd=math.sqrt(var),
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
