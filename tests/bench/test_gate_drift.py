"""bench.gate_drift at tiny sizes: both tables print, no_worse promotes a clearly worse candidate far
more often than the default paired_test, and the growing paired_test keeps its level."""

import numpy as np

from bench.gate_drift import decision_rates, main, variants


def test_prints_both_tables_with_every_rule(capsys):
    main(["--rounds", "2", "--trials", "10", "--seed", "0", "--max-heldout", "48"])
    out = capsys.readouterr().out
    assert "One decision" in out and "A chain of 2 rounds" in out
    for label in ("always", "no_worse", "better", "paired_margin k=2", "paired_test a=0.05",
                  "paired_test a=0.05 grow to 48"):
        assert f" {label} |" in out


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
