"""The rollout/trainer mismatch correction, as plain Python: per-token weights and their statistics.

Mismatch correction (docs/methods.md, GRPO): the sampler's per-token logprob (temperature-scaled, without
top-p truncation: what a trainer recomputes) against the trainer's, k = π_train / π_sample:
- "tis":  w = min(k, C), C = 2 (truncated importance sampling);
- "cis":  w = min(k, 1 + λ·max(1 − π_train, κ)), λ = 2.3, κ = 5e-3 (arXiv 2609.32444);
- "mask": w = 1 where 1/C ≤ k ≤ C, else 0 (the token is dropped from the loss);
- "none": w = 1.
A token whose sampling logprob is unknown (NaN: the trained token is not the one sampled, e.g. an
end-of-turn marker, or a projected action) gets w = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import mean

CORRECTIONS = ("none", "tis", "cis", "mask")


@dataclass(frozen=True)
class Correction:
    """How the sampler/trainer mismatch is corrected (module docstring)."""

    mode: str = "tis"
    cap: float = 2.0          # C of tis and mask
    cis_lambda: float = 2.3   # λ of cis
    cis_kappa: float = 5e-3   # κ of cis

    def __post_init__(self):
        if self.mode not in CORRECTIONS:
            raise ValueError(f"unknown correction {self.mode!r}; expected one of {CORRECTIONS}")


def correction_weight(logp_train: float, logp_sample: float, c: Correction) -> tuple[float, bool]:
    """(weight, capped) for one token; capped says whether the cap/mask changed the plain ratio."""
    if c.mode == "none" or math.isnan(logp_sample):
        return 1.0, False
    k = math.exp(max(min(logp_train - logp_sample, 20.0), -20.0))
    if c.mode == "tis":
        return (c.cap, True) if k > c.cap else (k, False)
    if c.mode == "cis":
        cap = 1.0 + c.cis_lambda * max(1.0 - math.exp(logp_train), c.cis_kappa)
        return (cap, True) if k > cap else (k, False)
    inside = 1.0 / c.cap <= k <= c.cap
    return (1.0, False) if inside else (0.0, True)


def mismatch_stats(logp_train: list[float], logp_sample: list[float], weights: list[float] | None = None,
                   capped: list[bool] | None = None) -> dict[str, float | int | None]:
    """Over the tokens whose sampling logprob is known: mean |Δ logprob|, the estimated KL(sampler ‖ trainer)
    (mean of logp_sample − logp_train over the sampler's own tokens), the share of tokens whose weight was
    capped or masked, and the mean weight."""
    known = [i for i, s in enumerate(logp_sample) if not math.isnan(s)]
    if not known:
        return {"tokens": 0, "mean_abs_delta": None, "kl_sampler_trainer": None, "capped_share": None,
                "weight_mean": None}
    deltas = [logp_sample[i] - logp_train[i] for i in known]
    return {"tokens": len(known), "mean_abs_delta": mean(abs(d) for d in deltas), "kl_sampler_trainer": mean(deltas),
            "capped_share": mean(bool(capped[i]) for i in known) if capped else 0.0,
            "weight_mean": mean(weights[i] for i in known) if weights else 1.0}
