"""The gate's paired rules and sequential looks on hand-made outcomes; p-values are exact binomial tails
computed by hand in the comments."""

import pytest

from rsiflow.stats.gating import GateResult, Rule, look_sizes, sequential_decision, sign_test_pvalue
from rsiflow.stats.success import compare


def paired(wins: int, losses: int, both: int, neither: int) -> tuple[list[bool], list[bool]]:
    """(candidate, champion) outcomes with the given counts of each kind of pair."""
    pairs = [(True, False)] * wins + [(False, True)] * losses + [(True, True)] * both + [(False, False)] * neither
    return [c for c, _ in pairs], [h for _, h in pairs]


def test_sign_test_pvalues_are_exact_binomial_tails():
    assert sign_test_pvalue(0, 0) == 1.0                      # no discordant pair: no evidence
    assert sign_test_pvalue(5, 0) == 1 / 32                   # P(X>=5), X~Bin(5,1/2) = 1/32 = 0.03125
    assert sign_test_pvalue(4, 0) == 1 / 16                   # 1/16 = 0.0625
    assert sign_test_pvalue(6, 1) == 8 / 128                  # (C(7,6)+C(7,7))/2^7 = 8/128 = 0.0625
    assert sign_test_pvalue(7, 1) == 9 / 256                  # (C(8,7)+C(8,8))/2^8 = 9/256 = 0.03515625
    assert sign_test_pvalue(10, 2) == 79 / 4096               # (66+12+1)/4096 = 0.019287...
    assert sign_test_pvalue(0, 3) == 1.0                      # P(X>=0) = 1
    assert sign_test_pvalue(2, 2) == 11 / 16                  # (C(4,2)+C(4,3)+C(4,4))/16 = (6+4+1)/16


def test_paired_test_rejects_0_of_24_over_3_of_24_that_no_worse_promotes():
    cand, champ = paired(wins=0, losses=3, both=0, neither=21)   # 0/24 vs 3/24
    rule = Rule("paired_test")
    assert sequential_decision(lambda n: (cand[:n], champ[:n]), [24], rule).decision == "reject"
    # no_worse: Wilson upper bound of 0/24 is 0.138 >= 3/24 = 0.125, so it promotes the worse model
    no_worse = sequential_decision(lambda n: (cand[:n], champ[:n]), [24], Rule("no_worse"))
    assert no_worse.decision == "promote"


def test_paired_test_promotes_only_at_its_level():
    cand, champ = paired(wins=5, losses=0, both=3, neither=16)   # p = 1/32 = 0.03125
    assert sequential_decision(lambda n: (cand, champ), [24], Rule("paired_test", alpha=0.05)).decision == "promote"
    assert sequential_decision(lambda n: (cand, champ), [24], Rule("paired_test", alpha=0.03)).decision == "reject"
    cand, champ = paired(wins=6, losses=1, both=3, neither=14)   # p = 0.0625 > 0.05
    result = sequential_decision(lambda n: (cand, champ), [24], Rule("paired_test"))
    assert result.decision == "reject" and result.looks[0]["p_value"] == pytest.approx(0.0625)


def test_paired_margin_counts_wins_minus_losses():
    cand, champ = paired(wins=3, losses=1, both=2, neither=18)
    assert sequential_decision(lambda n: (cand, champ), [24], Rule("paired_margin", margin=2)).decision == "promote"
    assert sequential_decision(lambda n: (cand, champ), [24], Rule("paired_margin", margin=3)).decision == "reject"


def test_look_sizes():
    assert look_sizes(24, None) == [24]
    assert look_sizes(24, 24) == [24]
    assert look_sizes(24, 72) == [24, 48, 72]
    assert look_sizes(24, 60) == [24, 48, 60]
    assert look_sizes(24, 30) == [24, 30]


def test_growth_splits_alpha_over_the_looks_and_plays_only_what_a_look_needs():
    # first 24 tasks: 5 wins 0 losses, p = 1/32 = 0.03125 > 0.05/2: ahead, not significant: grow;
    # next 24 add 2 wins: 7 wins 0 losses, p = 1/128 = 0.0078 <= 0.025: promote at the second look
    c1, h1 = paired(wins=5, losses=0, both=3, neither=16)
    c2, h2 = paired(wins=2, losses=0, both=2, neither=20)
    cand, champ = c1 + c2, h1 + h2
    asked = []

    def outcomes(n):
        asked.append(n)
        return cand[:n], champ[:n]

    result = sequential_decision(outcomes, [24, 48], Rule("paired_test", alpha=0.05))
    assert asked == [24, 48] and result.decision == "promote" and result.evidence.n == 48
    assert [look["verdict"] for look in result.looks] == ["grow", "promote"]
    assert result.looks[0]["level"] == 0.025 and result.looks[1]["p_value"] == 1 / 128
    ev = result.to_dict()
    assert ev["wins"] == 7 and ev["p_value"] == 1 / 128 and ev["level"] == 0.025 and len(ev["looks"]) == 2


def test_growth_stops_when_the_candidate_is_not_ahead_and_the_last_look_decides():
    cand, champ = paired(wins=1, losses=2, both=1, neither=20)   # behind: reject, no more plays
    asked = []
    result = sequential_decision(lambda n: (asked.append(n), (cand[:n], champ[:n]))[1], [24, 48, 72],
                                 Rule("paired_test"))
    assert asked == [24] and result.decision == "reject"
    # ahead 3-0 at 24 (p = 1/8), then 4-1 at 48: p = (C(5,4)+C(5,5))/32 = 6/32 = 0.1875 at the last look
    c1, h1 = paired(wins=3, losses=0, both=0, neither=21)
    c2, h2 = paired(wins=1, losses=1, both=0, neither=22)
    result = sequential_decision(lambda n: ((c1 + c2)[:n], (h1 + h2)[:n]), [24, 48], Rule("paired_test"))
    assert [look["verdict"] for look in result.looks] == ["grow", "reject"]
    assert result.looks[1]["p_value"] == 6 / 32


def test_bad_rules_are_errors():
    with pytest.raises(ValueError, match="unknown gate rule"):
        Rule("sometimes")
    cand, champ = paired(wins=1, losses=0, both=0, neither=1)
    with pytest.raises(ValueError, match="needs rule paired_test"):
        sequential_decision(lambda n: (cand, champ), [2, 4], Rule("no_worse"))
    assert isinstance(sequential_decision(lambda n: (cand, champ), [2], Rule("always")), GateResult)
    assert compare(cand, champ, "paired_test").wins == 1


def test_sign_flip_is_the_sign_test_on_greedy_outcomes_and_exact_on_counts():
    from rsiflow.stats.gating import sign_flip_pvalue

    for wins, losses in [(5, 0), (6, 1), (10, 2), (0, 3), (2, 2), (0, 0)]:
        assert sign_flip_pvalue([1] * wins + [-1] * losses + [0] * 4) == sign_test_pvalue(wins, losses)
    # |d| = 2, 1, 1, observed sum 2: of the 8 sign patterns the sums are 4, 2, 2, 0, 0, -2, -2, -4: P(S >= 2) = 3/8
    assert sign_flip_pvalue([2, 1, -1]) == 3 / 8
    assert sign_flip_pvalue([3]) == 1 / 2 and sign_flip_pvalue([-3]) == 1.0


def test_sign_flip_bound_holds_for_equal_models_with_sampled_plays():
    """Candidate and champion with the same per-task success probabilities, k = 4 independent plays each: the
    share of 2000 simulated gates that promote at alpha = 0.05 is at most alpha (plus 3 binomial SDs of noise)."""
    import random

    from rsiflow.stats.gating import sign_flip_pvalue

    rng, k, n, trials = random.Random(0), 4, 30, 2000
    promoted = 0
    for _ in range(trials):
        ps = [rng.random() for _ in range(n)]
        diffs = [sum(rng.random() < p for _ in range(k)) - sum(rng.random() < p for _ in range(k)) for p in ps]
        promoted += sign_flip_pvalue(diffs) <= 0.05
    assert promoted / trials <= 0.05 + 3 * (0.05 * 0.95 / trials) ** 0.5


def test_detectable_gain_and_tasks_for_gain_are_inverse():
    from rsiflow.stats.success import design_sd, detectable_gain, tasks_for_gain

    sd = design_sd(0.3, 4)                         # sqrt(2 * 0.3 * 0.7 / 4) = 0.324
    assert abs(sd - (2 * 0.3 * 0.7 / 4) ** 0.5) < 1e-12
    gain = detectable_gain(sd, 100, alpha=0.05)    # (1.645 + 0.842) * 0.324 / 10 = 0.0806
    assert abs(gain - 0.0806) < 1e-3
    assert tasks_for_gain(gain, sd) == 100
    assert detectable_gain(sd, 400) == gain / 2


def test_compare_with_sampled_counts():
    from rsiflow.stats.success import compare

    ev = compare([3, 4, 0, 2], [1, 4, 1, 2], "paired_test", samples=4)
    assert ev.candidate_rate == 9 / 16 and ev.champion_rate == 8 / 16
    assert ev.diffs == (2, 0, -1, 0) and ev.wins == 1 and ev.losses == 1
    assert ev.paired_diff == (0.5 + 0 - 0.25 + 0) / 4
    with pytest.raises(ValueError, match="lie in"):
        compare([5], [1], "paired_test", samples=4)
