"""bench.gate_drift at tiny sizes: all tables print, no_worse promotes a clearly worse candidate far
more often than the default paired_test, the growing paired_test keeps its level, and the sampled
paired test (k plays per task) keeps its level and is more powerful than the greedy one."""

import math

import numpy as np
import pytest

from bench.gate_drift import (
    Variant,
    decision_rates,
    main,
    power_cases,
    power_table,
    sampled_variants,
    task_rates,
    variants,
)
from rsiflow.stats.gating import Rule


def test_prints_both_tables_with_every_rule(capsys):
    main(["--rounds", "2", "--trials", "10", "--seed", "0", "--max-heldout", "48"])
    out = capsys.readouterr().out
    assert "One decision" in out and "A chain of 2 rounds" in out
    for label in ("always", "no_worse", "better", "paired_margin k=2", "paired_test a=0.05",
                  "paired_test a=0.05 grow to 48", "paired_test a=0.05 sampled k=4"):
        assert f" {label} |" in out
    assert "Power by held-out size" not in out     # Table 3 only with --power


def test_no_worse_promotes_worse_candidates_that_paired_test_rejects():
    # champion 0.3, candidate 0.2 on 24 tasks: the candidate's Wilson upper bound (~0.4 at 5/24) stays above
    # the champion's rate in most trials, so no_worse promotes it; the sign test needs the candidate ahead
    rates = decision_rates(0.3, -0.1, variants(24, 72), trials=200, rho=0.5, rng=np.random.default_rng(0))
    assert rates["no_worse"][0] > 0.5
    assert rates["paired_test a=0.05"][0] < 0.05
    assert rates["no_worse"][0] > rates["paired_test a=0.05"][0] + 0.4


def test_growing_paired_test_keeps_its_level_on_equal_models():
    rates = decision_rates(0.3, 0.0, variants(24, 72), trials=400, rho=0.5, rng=np.random.default_rng(1))
    promoted, tasks = rates["paired_test a=0.05 grow to 72"]
    assert promoted <= 0.05 and 24 < tasks <= 72


def test_task_rates_average_to_the_true_rate():
    z = np.random.default_rng(3).standard_normal(100_000)
    for p in (0.1, 0.5, 0.8):
        q = task_rates(p, z, rho=0.5)
        assert abs(q.mean() - p) < 0.01 and q.min() >= 0.0 and q.max() <= 1.0
    assert task_rates(0.0, z[:5], 0.5).tolist() == [0.0] * 5 and task_rates(1.0, z[:5], 0.5).tolist() == [1.0] * 5


def test_adding_sampled_variants_leaves_the_greedy_figures_unchanged():
    greedy = decision_rates(0.3, 0.1, variants(24, 48), trials=60, rho=0.5, rng=np.random.default_rng(4))
    mixed = decision_rates(0.3, 0.1, variants(24, 48) + sampled_variants(24, 4), trials=60, rho=0.5,
                           rng=np.random.default_rng(4), sample_rng=np.random.default_rng(5))
    assert {label: mixed[label] for label in greedy} == greedy
    assert "paired_test a=0.05 sampled k=4" in mixed


@pytest.mark.parametrize("p", [0.3, 0.5])
def test_sampled_paired_test_keeps_its_level_on_equal_models(p):
    trials = 400
    rates = decision_rates(p, 0.0, sampled_variants(24, 4), trials=trials, rho=0.5,
                           rng=np.random.default_rng(6), sample_rng=np.random.default_rng(7))
    promoted, tasks = rates["paired_test a=0.05 sampled k=4"]
    assert tasks == 24
    assert promoted <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)


def test_sampled_paired_test_is_more_powerful_than_greedy_at_the_same_size():
    # greedy is one Bernoulli(q_i) play per task; k=4 plays average the play noise away, so at +0.15 on 100 tasks
    # the sampled test promotes (~1.0) far more often than the sign test (~0.8)
    rules = [Variant("greedy", Rule("paired_test", alpha=0.05), [100]),
             Variant("sampled", Rule("paired_test", alpha=0.05), [100], 4)]
    rates = decision_rates(0.25, 0.15, rules, trials=200, rho=0.5, rng=np.random.default_rng(8),
                           sample_rng=np.random.default_rng(9))
    assert rates["sampled"][0] > rates["greedy"][0]
    assert rates["sampled"][0] > rates["greedy"][0] + 0.08 and rates["sampled"][0] > 0.9


def test_power_table_renders_every_case(capsys):
    main(["--rounds", "1", "--trials", "3", "--seed", "0", "--power", "--samples", "3"])
    out = capsys.readouterr().out
    assert "Power by held-out size" in out
    table = out[out.index("Power by held-out size"):]
    assert "| paired_test a=0.05 greedy | paired_test a=0.05 sampled k=3 |" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(power_cases()) == 4 * 2 * 5
    for (n, p, gain), row in zip(power_cases(), rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:3] == [str(n), f"{p:.2f}", f"{p + gain:.2f} ({gain:+.2f})"]
        assert cells[3] == ("power" if gain > 0 else "false promotion")
        assert all(0.0 <= float(c) <= 1.0 for c in cells[4:6])
        greedy_gain, sampled_gain = (float(x) for x in cells[6].split(" / "))
        assert sampled_gain == pytest.approx(greedy_gain / math.sqrt(3), abs=2e-3)   # design sd scales 1/sqrt(k)


def test_power_table_at_small_cases():
    table = power_table(20, 0.5, 4, np.random.default_rng(0), np.random.default_rng(1),
                        cases=[(24, 0.5, 0.15), (24, 0.5, 0.0)])
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| 24 | 0.50 | 0.65 (+0.15) | power |")
    assert lines[3].startswith("| 24 | 0.50 | 0.50 (+0.00) | false promotion |")
    assert lines[2].endswith("| 0.359 / 0.179 |")   # detectable_gain(design_sd(0.5, k), 24) for k = 1, 4
