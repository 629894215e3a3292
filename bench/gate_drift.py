"""How often each gate rule promotes a model that is not better, its power, and where a chain of
rounds leaves the champion: simulated paired outcomes, decided by the gate's own functions.

    python -m bench.gate_drift [--rounds 10] [--trials 2000] [--seed 0] [--rho 0.5]
                               [--heldout 24] [--max-heldout 72] [--spread 0.05]

Outcome model (same tasks, same seeds for both models, as in the gate): held-out task i has a
difficulty z_i ~ N(0, 1) shared by every model; a model whose true success rate is p solves it iff
sqrt(rho)·z_i + sqrt(1 - rho)·e_i < Φ⁻¹(p), with its own e_i ~ N(0, 1) drawn once per (model, task)
(greedy evaluation: a model's result on a task is fixed). Over tasks a model solves exactly a share
p; rho is the latent correlation of two models' outcomes on one task.

Table 1, one decision: champion rate p, candidate rate p + shift; fresh tasks every trial; the share
of trials each rule promotes (shift <= 0: false promotions; shift > 0: power).
Table 2, a chain of --rounds rounds: the held-out tasks are fixed for the whole chain (as in a run:
`gate.seed`), the champion's results on them are kept (reused, as the store does), and every round's
candidate is a noisy copy of the current champion, true rate clip(p + N(mean shift, spread), 0, 1).
It prints the mean true rate of the champion after the last round, the share of chains that end
below the start, and the mean number of promotions.

Every decision goes through `methods.gating.sequential_decision` with a `Rule`, the functions
tasks/gate.py calls; the paired_test variant with growth asks for more tasks only when a look needs
them, and its "tasks" column is the mean number of held-out tasks each model played.
"""

from __future__ import annotations

import argparse
import math
from statistics import NormalDist

import numpy as np

from methods.gating import Rule, look_sizes, sequential_decision

Variants = list[tuple[str, Rule, list[int]]]   # (label, rule, look sizes)

DECISION_CASES = [(p, shift) for p in (0.1, 0.3, 0.5) for shift in (0.0, -0.05, -0.1, 0.1, 0.2)]
CHAIN_CASES = [(p, shift) for p in (0.1, 0.3, 0.5) for shift in (0.0, -0.05)]


def variants(heldout: int, max_heldout: int) -> Variants:
    """(label, rule, look sizes) of every rule the gate offers, at its config defaults."""
    return [
        ("always", Rule("always"), [heldout]),
        ("no_worse", Rule("no_worse"), [heldout]),
        ("better", Rule("better"), [heldout]),
        ("paired_margin k=2", Rule("paired_margin", margin=2), [heldout]),
        ("paired_test a=0.05", Rule("paired_test", alpha=0.05), [heldout]),
        (f"paired_test a=0.05 grow to {max_heldout}", Rule("paired_test", alpha=0.05),
         look_sizes(heldout, max_heldout)),
    ]


def solves(p: float, difficulty: np.ndarray, noise: np.ndarray, rho: float) -> np.ndarray:
    """Which tasks a model of true rate p solves (see the module docstring)."""
    if p <= 0.0:
        return np.zeros(len(difficulty), dtype=bool)
    if p >= 1.0:
        return np.ones(len(difficulty), dtype=bool)
    return math.sqrt(rho) * difficulty + math.sqrt(1 - rho) * noise < NormalDist().inv_cdf(p)


def decide(rule: Rule, sizes: list[int], candidate: list[bool], champion: list[bool]) -> tuple[bool, int]:
    """The gate's decision on these outcomes: (promoted, held-out tasks played)."""
    result = sequential_decision(lambda n: (candidate[:n], champion[:n]), sizes, rule)
    return result.decision == "promote", result.evidence.n


def decision_rates(p: float, shift: float, rules: Variants, trials: int, rho: float,
                   rng: np.random.Generator) -> dict[str, tuple[float, float]]:
    """label -> (share of trials promoted, mean tasks played) for one candidate-vs-champion decision.
    Every rule sees the same simulated outcomes in a trial."""
    n_max = max(s[-1] for _, _, s in rules)
    promoted = {label: 0 for label, _, _ in rules}
    played = {label: 0 for label, _, _ in rules}
    for _ in range(trials):
        difficulty = rng.standard_normal(n_max)
        champion = solves(p, difficulty, rng.standard_normal(n_max), rho).tolist()
        candidate = solves(min(1.0, max(0.0, p + shift)), difficulty, rng.standard_normal(n_max), rho).tolist()
        for label, rule, sizes in rules:
            up, n = decide(rule, sizes, candidate, champion)
            promoted[label] += up
            played[label] += n
    return {label: (promoted[label] / trials, played[label] / trials) for label, _, _ in rules}


def chain_outcomes(p0: float, mean_shift: float, spread: float, rules: Variants, rounds: int, trials: int,
                   rho: float, rng: np.random.Generator) -> dict[str, tuple[float, float, float]]:
    """label -> (mean true rate of the champion after `rounds` rounds, share of chains ending below p0,
    mean promotions per chain). In a trial every rule's chain sees the same tasks and the same draws
    (candidate k's rate shift and its per-task noise); the rules' champions differ."""
    n_max = max(s[-1] for _, _, s in rules)
    final = {label: [] for label, _, _ in rules}
    promotions = {label: 0 for label, _, _ in rules}
    for _ in range(trials):
        difficulty = rng.standard_normal(n_max)
        base = solves(p0, difficulty, rng.standard_normal(n_max), rho).tolist()
        state = {label: (p0, base) for label, _, _ in rules}     # champion's true rate and its stored results
        for _ in range(rounds):
            shift, noise = rng.normal(mean_shift, spread), rng.standard_normal(n_max)
            for label, rule, sizes in rules:
                p, champion = state[label]
                p_cand = min(1.0, max(0.0, p + shift))
                candidate = solves(p_cand, difficulty, noise, rho).tolist()
                up, _ = decide(rule, sizes, candidate, champion)
                if up:
                    state[label] = (p_cand, candidate)
                    promotions[label] += 1
        for label, _, _ in rules:
            final[label].append(state[label][0])
    return {label: (float(np.mean(final[label])), float(np.mean(np.array(final[label]) < p0 - 1e-12)),
                    promotions[label] / trials) for label, _, _ in rules}


def decision_table(rules: Variants, trials: int, rho: float, rng: np.random.Generator) -> str:
    grow = rules[-1][0]
    head = ["champion p", "candidate p", "measures"] + [label for label, _, _ in rules] + [f"tasks ({grow})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p, shift in DECISION_CASES:
        rates = decision_rates(p, shift, rules, trials, rho, rng)
        what = "false promotion" if shift <= 0 else "power"
        cells = [f"{p:.2f}", f"{max(0.0, p + shift):.2f} ({shift:+.2f})", what]
        cells += [f"{rates[label][0]:.3f}" for label, _, _ in rules] + [f"{rates[grow][1]:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chain_table(rules: Variants, rounds: int, trials: int, spread: float, rho: float, rng: np.random.Generator) -> str:
    head = ["start p", "candidate shift"] + [label for label, _, _ in rules]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p0, mean_shift in CHAIN_CASES:
        out = chain_outcomes(p0, mean_shift, spread, rules, rounds, trials, rho, rng)
        cells = [f"{p0:.2f}", f"N({mean_shift:+.2f}, {spread:.2f})"]
        cells += [f"{m:.3f} ({below:.0%} below, {ups:.1f} up)" for m, below, ups in
                  (out[label] for label, _, _ in rules)]
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
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rules = variants(args.heldout, args.max_heldout)
    print(f"gate drift: {args.trials} trials per case, {args.heldout} held-out tasks, rho={args.rho}, "
          f"seed={args.seed}\n")
    print("One decision: share of candidates promoted\n")
    print(decision_table(rules, args.trials, args.rho, rng))
    print(f"\nA chain of {args.rounds} rounds: the champion's true rate after the last round "
          f"(share of chains ending below the start, mean promotions)\n")
    print(chain_table(rules, args.rounds, args.trials, args.spread, args.rho, rng))


if __name__ == "__main__":
    main()
