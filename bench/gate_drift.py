"""How often each gate rule promotes a model that is not better, its power, and where a chain of
rounds leaves the champion: simulated paired outcomes, decided by the gate's own functions.

    python -m bench.gate_drift [--rounds 10] [--trials 2000] [--seed 0] [--rho 0.5]
                               [--heldout 24] [--max-heldout 72] [--spread 0.05] [--samples 4] [--power]

Outcome model (same tasks, same seeds for both models, as in the gate): held-out task i has a
difficulty z_i ~ N(0, 1) shared by every model; a model whose true success rate is p solves it iff
sqrt(rho)·z_i + sqrt(1 - rho)·e_i < Φ⁻¹(p), with its own e_i ~ N(0, 1) drawn once per (model, task)
(greedy evaluation: a model's result on a task is fixed). Over tasks a model solves exactly a share
p; rho is the latent correlation of two models' outcomes on one task.

Sampled evaluation (`gate.metric: sampled`, k = --samples plays per task and model): the same
difficulties; a model of rate p succeeds on task i with probability
q_i = Φ((Φ⁻¹(p) - sqrt(rho)·z_i) / sqrt(1 - rho)) (so E[q_i] = p; the greedy outcome above is one
Bernoulli(q_i) draw), and its k plays of task i are independent Bernoulli(q_i) draws, fresh for every
decision; the outcome of a task is its count of successes in [0, k], decided by the sign-flip test.
The sampled draws come from a generator of their own (seeded from --seed), so adding them leaves
every greedy figure as it was.

Table 1, one decision: champion rate p, candidate rate p + shift; fresh tasks every trial; the share
of trials each rule promotes (shift <= 0: false promotions; shift > 0: power). The sampled variant
sees the same tasks (difficulties) as the greedy ones in a trial, and plays k times as many episodes.
Table 2, a chain of --rounds rounds: the held-out tasks are fixed for the whole chain (as in a run:
`gate.seed`), the champion's results on them are kept (reused, as the store does), and every round's
candidate is a noisy copy of the current champion, true rate clip(p + N(mean shift, spread), 0, 1).
It prints the mean true rate of the champion after the last round, the share of chains that end
below the start, and the mean number of promotions (greedy rules only).
Table 3 (--power), the paired test's power by held-out size: for n tasks, champion rate p and
candidate rate p + gain, the share of single decisions (fresh tasks each) that promote, greedy and
sampled, next to the normal approximation's 80%-power gain `detectable_gain(design_sd(p, k), n)`
(k = 1 greedy). design_sd assumes independent tasks (rho = 0); shared difficulty makes the real
spread of the paired differences smaller, so with rho > 0 the simulated power at that gain is above
80%. Gains 0 and -0.05 are false promotions: at most alpha, up to simulation noise.

Every decision goes through `stats.gating.sequential_decision` with a `Rule`, the functions
tasks/gate.py calls; the paired_test variant with growth asks for more tasks only when a look needs
them, and its "tasks" column is the mean number of held-out tasks each model played.
"""

from __future__ import annotations

import argparse
import math
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from rsiflow.stats.gating import Rule, look_sizes, sequential_decision
from rsiflow.stats.success import design_sd, detectable_gain


class Variant(NamedTuple):
    label: str
    rule: Rule
    sizes: list[int]     # look sizes
    samples: int = 1     # plays per task and model: 1 greedy, k sampled


Variants = list[Variant]

DECISION_CASES = [(p, shift) for p in (0.1, 0.3, 0.5) for shift in (0.0, -0.05, -0.1, 0.1, 0.2)]
CHAIN_CASES = [(p, shift) for p in (0.1, 0.3, 0.5) for shift in (0.0, -0.05)]
POWER_SIZES = (24, 50, 100, 200)
POWER_RATES = (0.25, 0.5)
POWER_GAINS = (0.05, 0.10, 0.15)
FALSE_GAINS = (0.0, -0.05)
ALPHA = 0.05


def variants(heldout: int, max_heldout: int) -> Variants:
    """(label, rule, look sizes) of every greedy rule the gate offers, at its config defaults."""
    return [
        Variant("always", Rule("always"), [heldout]),
        Variant("no_worse", Rule("no_worse"), [heldout]),
        Variant("better", Rule("better"), [heldout]),
        Variant("paired_margin k=2", Rule("paired_margin", margin=2), [heldout]),
        Variant("paired_test a=0.05", Rule("paired_test", alpha=ALPHA), [heldout]),
        Variant(f"paired_test a=0.05 grow to {max_heldout}", Rule("paired_test", alpha=ALPHA),
                look_sizes(heldout, max_heldout)),
    ]


def sampled_variants(heldout: int, samples: int) -> Variants:
    """The paired test on k sampled plays per task (`gate.metric: sampled`) at the same held-out size."""
    return [Variant(f"paired_test a=0.05 sampled k={samples}", Rule("paired_test", alpha=ALPHA), [heldout],
                    samples)]


def solves(p: float, difficulty: np.ndarray, noise: np.ndarray, rho: float) -> np.ndarray:
    """Which tasks a model of true rate p solves (see the module docstring)."""
    if p <= 0.0:
        return np.zeros(len(difficulty), dtype=bool)
    if p >= 1.0:
        return np.ones(len(difficulty), dtype=bool)
    return math.sqrt(rho) * difficulty + math.sqrt(1 - rho) * noise < NormalDist().inv_cdf(p)


def task_rates(p: float, difficulty: np.ndarray, rho: float) -> np.ndarray:
    """Per-task success probability q_i of a model of true rate p (see the module docstring): the chance that
    its greedy outcome solves task i given the task's difficulty; E[q_i] = p over tasks."""
    if p <= 0.0:
        return np.zeros(len(difficulty))
    if p >= 1.0:
        return np.ones(len(difficulty))
    threshold = NormalDist().inv_cdf(p)
    if rho >= 1.0:
        return (difficulty < threshold).astype(float)
    x = (threshold - math.sqrt(rho) * difficulty) / math.sqrt(1 - rho)
    return np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])


def sampled_successes(p: float, difficulty: np.ndarray, samples: int, rho: float,
                      rng: np.random.Generator) -> list[int]:
    """Per task, how many of a model's `samples` independent plays succeed (Binomial(k, q_i))."""
    return rng.binomial(samples, task_rates(p, difficulty, rho)).tolist()


def decide(rule: Rule, sizes: list[int], candidate: list, champion: list, samples: int = 1) -> tuple[bool, int]:
    """The gate's decision on these outcomes: (promoted, held-out tasks played)."""
    result = sequential_decision(lambda n: (candidate[:n], champion[:n]), sizes, rule, samples=samples)
    return result.decision == "promote", result.evidence.n


def decision_rates(p: float, shift: float, rules: Variants, trials: int, rho: float,
                   rng: np.random.Generator, sample_rng: np.random.Generator | None = None
                   ) -> dict[str, tuple[float, float]]:
    """label -> (share of trials promoted, mean tasks played) for one candidate-vs-champion decision.
    Every rule sees the same simulated tasks in a trial: greedy rules the same outcomes (drawn from `rng`),
    sampled rules with the same k the same counts (drawn from `sample_rng`; by default a child of `rng`,
    which leaves `rng`'s draws as they are)."""
    n_max = max(v.sizes[-1] for v in rules)
    ks = sorted({v.samples for v in rules if v.samples > 1})
    if ks and sample_rng is None:
        sample_rng = rng.spawn(1)[0]
    p_cand = min(1.0, max(0.0, p + shift))
    promoted = {v.label: 0 for v in rules}
    played = {v.label: 0 for v in rules}
    for _ in range(trials):
        difficulty = rng.standard_normal(n_max)
        champion = solves(p, difficulty, rng.standard_normal(n_max), rho).tolist()
        candidate = solves(p_cand, difficulty, rng.standard_normal(n_max), rho).tolist()
        outcomes = {1: (candidate, champion)}
        for k in ks:
            champion_k = sampled_successes(p, difficulty, k, rho, sample_rng)
            outcomes[k] = (sampled_successes(p_cand, difficulty, k, rho, sample_rng), champion_k)
        for label, rule, sizes, k in rules:
            up, n = decide(rule, sizes, *outcomes[k], samples=k)
            promoted[label] += up
            played[label] += n
    return {v.label: (promoted[v.label] / trials, played[v.label] / trials) for v in rules}


def chain_outcomes(p0: float, mean_shift: float, spread: float, rules: Variants, rounds: int, trials: int,
                   rho: float, rng: np.random.Generator) -> dict[str, tuple[float, float, float]]:
    """label -> (mean true rate of the champion after `rounds` rounds, share of chains ending below p0,
    mean promotions per chain). In a trial every rule's chain sees the same tasks and the same draws
    (candidate k's rate shift and its per-task noise); the rules' champions differ. Greedy rules only."""
    if any(v.samples != 1 for v in rules):
        raise ValueError("the chain simulation reuses the champion's greedy results: greedy rules only")
    n_max = max(v.sizes[-1] for v in rules)
    final = {v.label: [] for v in rules}
    promotions = {v.label: 0 for v in rules}
    for _ in range(trials):
        difficulty = rng.standard_normal(n_max)
        base = solves(p0, difficulty, rng.standard_normal(n_max), rho).tolist()
        state = {v.label: (p0, base) for v in rules}     # champion's true rate and its stored results
        for _ in range(rounds):
            shift, noise = rng.normal(mean_shift, spread), rng.standard_normal(n_max)
            for label, rule, sizes, _ in rules:
                p, champion = state[label]
                p_cand = min(1.0, max(0.0, p + shift))
                candidate = solves(p_cand, difficulty, noise, rho).tolist()
                up, _ = decide(rule, sizes, candidate, champion)
                if up:
                    state[label] = (p_cand, candidate)
                    promotions[label] += 1
        for v in rules:
            final[v.label].append(state[v.label][0])
    return {v.label: (float(np.mean(final[v.label])), float(np.mean(np.array(final[v.label]) < p0 - 1e-12)),
                      promotions[v.label] / trials) for v in rules}


def decision_table(rules: Variants, trials: int, rho: float, rng: np.random.Generator,
                   sample_rng: np.random.Generator | None = None) -> str:
    grow = [v.label for v in rules if len(v.sizes) > 1][-1]
    head = ["champion p", "candidate p", "measures"] + [v.label for v in rules] + [f"tasks ({grow})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, shift in DECISION_CASES:
        rates = decision_rates(p, shift, rules, trials, rho, rng, sample_rng)
        what = "false promotion" if shift <= 0 else "power"
        cells = [f"{p:.2f}", f"{max(0.0, p + shift):.2f} ({shift:+.2f})", what]
        cells += [f"{rates[v.label][0]:.3f}" for v in rules] + [f"{rates[grow][1]:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chain_table(rules: Variants, rounds: int, trials: int, spread: float, rho: float, rng: np.random.Generator) -> str:
    head = ["start p", "candidate shift"] + [v.label for v in rules]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p0, mean_shift in CHAIN_CASES:
        out = chain_outcomes(p0, mean_shift, spread, rules, rounds, trials, rho, rng)
        cells = [f"{p0:.2f}", f"N({mean_shift:+.2f}, {spread:.2f})"]
        cells += [f"{m:.3f} ({below:.0%} below, {ups:.1f} up)" for m, below, ups in
                  (out[v.label] for v in rules)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def power_cases(sizes=POWER_SIZES, rates=POWER_RATES, gains=POWER_GAINS,
                false_gains=FALSE_GAINS) -> list[tuple[int, float, float]]:
    """(held-out n, champion p, gain) of every row of the power table: the gains, then the false promotions."""
    return [(n, p, g) for n in sizes for p in rates for g in (*gains, *false_gains)]


def power_table(trials: int, rho: float, samples: int, rng: np.random.Generator, sample_rng: np.random.Generator,
                cases: list[tuple[int, float, float]] | None = None) -> str:
    """Table 3: per (n, p, gain) the share of single decisions the greedy and the sampled paired test promote
    (the same fresh tasks for both in a trial), and the normal approximation's 80%-power gain for each."""
    greedy_label, sampled_label = "paired_test a=0.05 greedy", f"paired_test a=0.05 sampled k={samples}"
    head = ["held-out n", "champion p", "candidate p", "measures", greedy_label, sampled_label,
            f"80%-power gain, normal approx. (greedy / k={samples})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n, p, gain in cases if cases is not None else power_cases():
        rules = [Variant(greedy_label, Rule("paired_test", alpha=ALPHA), [n]),
                 Variant(sampled_label, Rule("paired_test", alpha=ALPHA), [n], samples)]
        rates = decision_rates(p, gain, rules, trials, rho, rng, sample_rng)
        what = "false promotion" if gain <= 0 else "power"
        approx = (detectable_gain(design_sd(p, 1), n, ALPHA), detectable_gain(design_sd(p, samples), n, ALPHA))
        cells = [str(n), f"{p:.2f}", f"{min(1.0, max(0.0, p + gain)):.2f} ({gain:+.2f})", what,
                 f"{rates[greedy_label][0]:.3f}", f"{rates[sampled_label][0]:.3f}",
                 f"{approx[0]:.3f} / {approx[1]:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds in each simulated chain")
    ap.add_argument("--trials", type=int, default=2000, help="simulated decisions per case (and chains per case)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulation")
    ap.add_argument("--rho", type=float, default=0.5, help="latent correlation of the two models on one task")
    ap.add_argument("--heldout", type=int, default=24, help="held-out tasks (gate.heldout_tasks)")
    ap.add_argument("--max-heldout", type=int, default=72, help="largest sample of the growing variant "
                    "(gate.max_heldout_tasks)")
    ap.add_argument("--spread", type=float, default=0.05, help="sd of a chain candidate's true-rate shift")
    ap.add_argument("--samples", type=int, default=4, help="sampled plays per task and model of the sampled "
                    "variant (gate.metric: sampled)")
    ap.add_argument("--power", action="store_true", help="also print the power table by held-out size (Table 3)")
    args = ap.parse_args(argv)
    if args.samples < 2:
        ap.error("--samples must be at least 2 (one play per task is the greedy metric)")
    rng = np.random.default_rng(args.seed)   # every greedy draw of Tables 1 and 2, as before the sampled variant
    # generators of their own, from the same seed: sampled draws of Table 1, then Table 3's greedy and sampled
    sampled_rng, power_rng, power_sampled_rng = (np.random.default_rng(s)
                                                 for s in np.random.SeedSequence(args.seed).spawn(3))
    rules = variants(args.heldout, args.max_heldout)
    print(f"gate drift: {args.trials} trials per case, {args.heldout} held-out tasks, rho={args.rho}, "
          f"seed={args.seed}, sampled k={args.samples}\n")
    print("One decision: share of candidates promoted\n")
    print(decision_table(rules + sampled_variants(args.heldout, args.samples), args.trials, args.rho, rng,
                         sampled_rng))
    print(f"\nA chain of {args.rounds} rounds: the champion's true rate after the last round "
          f"(share of chains ending below the start, mean promotions)\n")
    print(chain_table(rules, args.rounds, args.trials, args.spread, args.rho, rng))
    if args.power:
        print(f"\nPower by held-out size: share of single decisions promoted (fresh tasks each), greedy vs "
              f"sampled k={args.samples}, and the gain the normal approximation detects with 80% power\n")
        print(power_table(args.trials, args.rho, args.samples, power_rng, power_sampled_rng))


if __name__ == "__main__":
    main()
