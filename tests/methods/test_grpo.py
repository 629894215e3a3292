"""GRPO's advantages and mismatch weights against hand-computed values."""

import math

import pytest

from rsiflow.methods.grpo.algorithm import group_advantages, trajectory_advantages
from rsiflow.models.mismatch import Correction, correction_weight, mismatch_stats


def test_grpo_advantages_by_hand():
    # rewards [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3) = 0.57735 -> ±0.5 / (0.57735 + 1e-4) = ±0.86588
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    assert adv == pytest.approx([0.86588, -0.86588, -0.86588, 0.86588], abs=1e-5)
    # rewards [1, 0, 0, 0]: mean 0.25, std 0.5 -> 0.75 / 0.5001 = 1.49970, -0.25 / 0.5001 = -0.49990
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.49970, -0.49990, -0.49990, -0.49990], abs=1e-5)
    assert sum(group_advantages([0.3, 0.9, 0.1])) == pytest.approx(0.0, abs=1e-12)


def test_dr_grpo_advantages_are_only_centred():
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "dr_grpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_uniform_groups_get_zero_advantage():
    assert group_advantages([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0], "dr_grpo") == [0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
    with pytest.raises(ValueError, match="unknown advantage 'ppo'"):
        group_advantages([1.0], "ppo")


def test_trajectory_advantages_group_by_group():
    trajs = [{"traj_id": "a", "group_id": "g1", "reward": 1.0}, {"traj_id": "b", "group_id": "g1", "reward": None},
             {"traj_id": "c", "group_id": "g2", "reward": 0.0}, {"traj_id": "d", "group_id": "g2", "reward": 0.0}]
    adv = trajectory_advantages(trajs, "dr_grpo")
    assert adv == {"a": 0.5, "b": -0.5, "c": 0.0, "d": 0.0}


def test_tis_weights_by_hand():
    tis = Correction("tis", cap=2.0)
    # k = exp(-1.0 - -1.5) = exp(0.5) = 1.6487 (kept); k = exp(1.0) = 2.718 -> capped at 2
    assert correction_weight(-1.0, -1.5, tis) == (pytest.approx(1.64872, abs=1e-5), False)
    assert correction_weight(-0.5, -1.5, tis) == (2.0, True)
    assert correction_weight(-2.0, -1.0, tis) == (pytest.approx(math.exp(-1.0)), False)
    assert correction_weight(-1.0, math.nan, tis) == (1.0, False)     # unknown sampling logprob
    assert correction_weight(-0.5, -1.5, Correction("none")) == (1.0, False)


def test_cis_weights_by_hand():
    cis = Correction("cis")
    # π_train = exp(-0.1) = 0.904837; cap = 1 + 2.3 * (1 - 0.904837) = 1.218874; k = exp(0.4) = 1.49182 -> capped
    w, capped = correction_weight(-0.1, -0.5, cis)
    assert capped and w == pytest.approx(1.218874, abs=1e-6)
    # π_train = exp(-2) = 0.135335: cap = 1 + 2.3 * 0.864665 = 2.988730; k = exp(1) = 2.71828 -> kept
    assert correction_weight(-2.0, -3.0, cis) == (pytest.approx(math.e), False)
    # π_train ≈ 1: the cap is 1 + 2.3 * κ = 1.0115
    w, capped = correction_weight(-1e-9, -0.5, cis)
    assert capped and w == pytest.approx(1.0115, abs=1e-6)


def test_mask_drops_tokens_outside_the_band():
    m = Correction("mask", cap=2.0)
    assert correction_weight(-1.0, -1.5, m) == (1.0, False)
    assert correction_weight(-0.5, -1.5, m) == (0.0, True)     # k = e > 2
    assert correction_weight(-2.5, -1.5, m) == (0.0, True)     # k = 1/e < 1/2
    with pytest.raises(ValueError, match="unknown correction 'clip'"):
        Correction("clip")


def test_mismatch_stats_over_known_tokens():
    train, sample = [-1.0, -2.0, -0.5], [-1.5, math.nan, -0.5]
    s = mismatch_stats(train, sample, weights=[1.5, 1.0, 1.0], capped=[True, False, False])
    assert s["tokens"] == 2 and s["mean_abs_delta"] == pytest.approx(0.25)
    assert s["kl_sampler_trainer"] == pytest.approx(-0.25) and s["capped_share"] == 0.5 and s["weight_mean"] == 1.25
    assert mismatch_stats([-1.0], [math.nan])["mean_abs_delta"] is None
