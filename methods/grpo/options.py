"""`distill.grpo`: GRPO's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rsiflow.configs.section import Section


class GrpoOptions(Section):
    """GRPO: policy gradient on the round's groups (TRL's GRPO loss)."""

    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="Group-relative advantage: grpo (r - mean) / (std + eps); dr_grpo r - mean (no std "
        "scaling).")
    eps: float = Field(1e-4, gt=0.0, description="eps of the grpo advantage's std.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        "dapo", description="TRL's GRPO loss normalisation over tokens: grpo (mean per sequence, then over "
        "sequences), dapo (token mean over the optimizer step), dr_grpo (sum / constant train.max_length), bnpo "
        "(token mean per micro-batch).")
    epsilon: float = Field(0.2, gt=0.0, description="PPO clip range ε of the ratio π/π_old (low side; high side "
        "too unless epsilon_high).")
    epsilon_high: float | None = Field(None, gt=0.0, description="Clip-higher ε_high (DAPO: 0.28); null = "
        "epsilon.")
    beta: float = Field(0.0, ge=0.0, description="KL(π ‖ π_ref) weight; the reference is `reference`.")
    reference: Literal["champion", "base"] = Field(
        "champion", description="π_ref of the KL(π ‖ π_ref) term weighted by beta (only used when beta > 0): "
        "champion = the round's champion, which sampled the rollouts (π_old); base = the run's base model, so the KL "
        "keeps the policy near the base across rounds.")
    passes: int = Field(1, ge=1, description="Optimisation passes over the round's rows (minibatches of "
        "train.batch_size × train.grad_accum trajectories per optimizer step); ratios against the sampler's policy.")
    correction: Literal["none", "tis", "cis", "mask"] = Field(
        "tis", description="Rollout/trainer mismatch correction per sampled token, k = π_train / π_sample: tis "
        "min(k, tis_cap); cis min(k, 1 + cis_lambda·max(1 - π_train, cis_kappa)); mask drops tokens with k "
        "outside [1/tis_cap, tis_cap]; none.")
    tis_cap: float = Field(2.0, gt=1.0, description="C of tis (and the band of mask).")
    cis_lambda: float = Field(2.3, gt=0.0, description="λ of cis (arXiv 2609.32444).")
    cis_kappa: float = Field(5e-3, gt=0.0, description="κ of cis.")
    skip_zero_advantage: bool = Field(
        True, description="Don't compute rows whose advantage is 0 (uniform groups) when beta = 0: their policy "
        "gradient is exactly 0. They are stored and counted either way.")
