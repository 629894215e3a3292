"""The gate's promotion rules on paired outcomes, and the sequential procedure that grows the sample.

Candidate and champion play the same held-out tasks with the same seeds, so task i gives a pair
(candidate solved?, champion solved?). Only the discordant pairs say which model is better: a
*win* (the candidate solved it, the champion did not) or a *loss* (the reverse).

Rules (config `gate.rule`):

- `paired_test`: one-sided exact sign-flip (permutation) test on the per-task differences
  d_i = candidate successes - champion successes: p = P(sum_i s_i |d_i| >= sum_i d_i) over independent
  random signs s_i = +-1, computed exactly (`sign_flip_pvalue`); promote only if p <= the look's level.
  With one greedy play per task (`gate.metric: greedy`) d_i is -1, 0 or 1 and this is the exact sign
  test on the discordant pairs (McNemar's exact test): p = P(Bin(wins + losses, 1/2) >= wins). With k
  sampled plays per task and model (`gate.metric: sampled`), played with independent seeds, d_i is the
  difference of two counts out of k: if the candidate is no better on any task, each d_i is symmetric
  about 0 (or leans negative), so a no-better candidate is promoted with probability at most `alpha`,
  whatever the tasks' difficulty.
- `paired_margin`: promote only if wins - losses >= `margin`. Simple to read, no stated error rate.
- `no_worse`, `better`, `always`: the Wilson-interval rules on unpaired rates (`stats.success`).

Sequential growth (`paired_test` only): the looks are fixed before any play, at n0, 2·n0, ...
and the maximum (`look_sizes`); every look tests at alpha / (number of looks) (Bonferroni), so
the chance that a no-better candidate is promoted at any look is at most alpha, with no model of
the discordance rate. A look that does not promote grows the sample only while the candidate is
ahead (wins > losses); a candidate not ahead is rejected there. Stopping without promoting can
only lower the chance of promoting, so this futility stop keeps the bound.

The gate step (tasks/gate.py) and the drift simulation (bench/gate_drift.py) both call
`sequential_decision`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rsiflow.stats.success import GateEvidence, compare, should_promote

RULES = ("paired_test", "paired_margin", "no_worse", "better", "always")


def sign_test_pvalue(wins: int, losses: int) -> float:
    """One-sided exact sign test: P(X >= wins) for X ~ Bin(wins + losses, 1/2); 1.0 with no discordant pair."""
    d = wins + losses
    return sum(math.comb(d, k) for k in range(wins, d + 1)) / 2**d


def sign_flip_pvalue(diffs: list[int] | tuple[int, ...]) -> float:
    """One-sided exact sign-flip test of integer per-task differences: P(S >= sum(diffs)) where S = sum_i s_i |d_i|
    with independent fair signs s_i; 1.0 when every difference is 0. The distribution of S is built exactly by
    counting sign patterns per attainable sum (integers, so no rounding: n tasks x k plays stay small)."""
    magnitudes = [abs(int(d)) for d in diffs if d]
    if not magnitudes:
        return 1.0
    total = sum(magnitudes)
    counts = [0] * (2 * total + 1)      # counts[v + total]: sign patterns of the magnitudes seen so far summing to v
    counts[total] = 1
    reach = 0
    for a in magnitudes:
        new = [0] * len(counts)
        for v in range(-reach, reach + 1):
            c = counts[v + total]
            if c:
                new[v + a + total] += c
                new[v - a + total] += c
        counts, reach = new, reach + a
    observed = sum(int(d) for d in diffs)
    return sum(counts[observed + total:]) / 2 ** len(magnitudes)


def look_sizes(first: int, most: int | None) -> list[int]:
    """Held-out sample sizes of the looks: first, 2·first, ... below `most`, then `most`; [first] when
    `most` is None or not above `first` (no growth)."""
    if most is None or most <= first:
        return [first]
    return list(range(first, most, first)) + [most]


@dataclass(frozen=True)
class Rule:
    """A promotion rule and its parameters (config `gate.rule`, `gate.alpha`, `gate.margin`, `gate.confidence`)."""

    name: str
    alpha: float = 0.05       # paired_test: overall one-sided level, split evenly over the looks
    margin: int = 2           # paired_margin: wins - losses needed
    confidence: float = 0.95  # no_worse / better: Wilson interval confidence

    def __post_init__(self):
        if self.name not in RULES:
            raise ValueError(f"unknown gate rule {self.name!r}: expected one of {', '.join(RULES)}")


def judge(ev: GateEvidence, rule: Rule, looks: int = 1, last: bool = True) -> tuple[str, dict]:
    """The verdict of one look, 'promote', 'reject' or 'grow' (paired_test only, not at the last
    look, when the candidate is ahead but not significantly), with the look's test figures."""
    if rule.name == "paired_test":
        p = sign_flip_pvalue(ev.diffs) if ev.samples > 1 else sign_test_pvalue(ev.wins, ev.losses)
        level = rule.alpha / looks
        if p <= level:
            verdict = "promote"
        elif last or sum(ev.diffs) <= 0:
            verdict = "reject"
        else:
            verdict = "grow"
        return verdict, {"p_value": p, "level": level}
    if rule.name == "paired_margin":
        return ("promote" if ev.wins - ev.losses >= rule.margin else "reject"), {"margin": rule.margin}
    return ("promote" if should_promote(ev) else "reject"), {}


@dataclass(frozen=True)
class GateResult:
    decision: str              # promote or reject
    evidence: GateEvidence     # the paired comparison at the deciding look
    looks: list[dict]          # per look: n, successes, wins, losses, the test figures, the verdict

    def to_dict(self) -> dict:
        """Evidence for the store's gate_decisions.evidence: the deciding look's comparison, its test
        figures (p_value and level, or margin) and every look."""
        return {**self.evidence.to_dict(), **{k: v for k, v in self.looks[-1].items() if k in
                ("p_value", "level", "margin")}, "looks": self.looks}

    def describe(self) -> str:
        """One line for a log: both models' successes with intervals, the decision and why."""
        ev, last = self.evidence, self.looks[-1]
        why = [f"paired {ev.wins - ev.losses:+d}: {ev.wins} wins, {ev.losses} losses"]
        if ev.samples > 1:
            why = [f"{ev.samples} plays a task, mean paired difference {ev.paired_diff:+.3f}: {ev.wins} tasks better, "
                   f"{ev.losses} worse"]
        if "p_value" in last:
            test = "sign-flip test" if ev.samples > 1 else "sign test"
            why.append(f"{test} p={last['p_value']:.3g} vs level {last['level']:.3g}")
        if len(self.looks) > 1:
            why.append(f"{len(self.looks)} looks: n={'/'.join(str(look['n']) for look in self.looks)}")
        (clo, chi), (hlo, hhi) = ev.candidate_ci, ev.champion_ci
        plays = ev.n * ev.samples
        return (f"candidate {ev.candidate_successes}/{plays} [{clo:.2f}, {chi:.2f}] vs champion "
                f"{ev.champion_successes}/{plays} [{hlo:.2f}, {hhi:.2f}] -> {self.decision} "
                f"({ev.rule}; {'; '.join(why)})")


def sequential_decision(outcomes: Callable[[int], tuple[list, list]], sizes: list[int],
                        rule: Rule, samples: int = 1) -> GateResult:
    """Decide on the paired outcomes look by look. `outcomes(n)` returns (candidate, champion)
    successes on the first n held-out tasks (index i = the same task for both: a bool per task, or the number of
    its `samples` plays that succeeded); each look asks for the next size of `sizes`, so a caller plays only what
    a look needs. Stops at the first look that promotes or rejects; the last look never grows."""
    if len(sizes) > 1 and rule.name != "paired_test":
        raise ValueError(f"growing the held-out sample needs rule paired_test, not {rule.name!r}")
    looks = []
    for i, n in enumerate(sizes):
        candidate, champion = outcomes(n)
        ev = compare(candidate, champion, rule.name, rule.confidence, samples)
        verdict, figures = judge(ev, rule, looks=len(sizes), last=i == len(sizes) - 1)
        looks.append({"n": n, "candidate_successes": ev.candidate_successes,
                      "champion_successes": ev.champion_successes, "wins": ev.wins, "losses": ev.losses,
                      **figures, "verdict": verdict})
        if verdict != "grow":
            return GateResult(verdict, ev, looks)
    raise AssertionError("unreachable: the last look never grows")
