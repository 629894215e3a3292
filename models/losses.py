"""The training losses, each defined once; both trainers (models/sft_trainer.py, models/grpo_trainer.py) use these.

- `weighted_token_ce`: per-example weighted cross-entropy over labelled tokens (SFT, ExIt).
- `topk_divergence`: D(teacher ‖ student) over the teacher's top-k tokens plus one bucket for the
  remaining mass (SRD's code: k = 100): generalized JSD with β (0.5 = symmetric), forward KL(T‖S)
  or reverse KL(S‖T). The teacher side carries no gradient.
- `importance_weights`: min(exp(logp_now − logp_sampled), clip), detached: how far the policy has
  moved since the scored tokens were sampled.
"""

from __future__ import annotations

import math

import torch


def weighted_token_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """Σ_rows w_row · Σ_t CE(logits[t-1], labels[t]) / num_items over positions whose label is not -100.

    logits (B, T, V), labels (B, T), weights (B,). `num_items` is the number of labelled tokens the
    sum is normalised by (over all micro-batches of an accumulated step, as the HF Trainer counts it);
    None: this batch's labelled tokens. With all weights 1 this is the plain token-mean cross-entropy.
    """
    targets = labels[:, 1:]
    mask = (targets != -100).to(torch.float32)
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
        reduction="none").view(targets.shape)
    total = (token_loss * mask * weights.to(token_loss.dtype)[:, None]).sum()
    denom = mask.sum() if num_items is None else num_items
    return total / torch.as_tensor(denom, dtype=total.dtype, device=total.device).clamp(min=1)


def _with_tail(logp_topk: torch.Tensor) -> torch.Tensor:
    """Append log(1 - Σ p_topk): the top-k support plus one bucket holding the remaining mass."""
    mass = torch.logsumexp(logp_topk, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp_topk, torch.log(-torch.expm1(mass))], dim=-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last dim, from log-probabilities."""
    return (logp.exp() * (logp - logq)).sum(-1)


def topk_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, top_k: int = 100,
                    divergence: str = "jsd", beta: float = 0.5) -> torch.Tensor:
    """Per-position D(teacher ‖ student) over the teacher's top-k tokens plus a tail bucket.

    teacher_logits, student_logits: (..., V). Returns (...). The teacher side carries no gradient.
    jsd: β·KL(T‖M) + (1-β)·KL(S‖M) with M = β·T + (1-β)·S; forward_kl: KL(T‖S); reverse_kl: KL(S‖T).
    """
    t_logp = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    s_logp = torch.log_softmax(student_logits.float(), dim=-1)
    k = min(top_k, t_logp.size(-1))
    t_top, idx = torch.topk(t_logp, k, dim=-1)
    s_top = torch.gather(s_logp, -1, idx)
    if k < t_logp.size(-1):
        t_top, s_top = _with_tail(t_top), _with_tail(s_top)
    if divergence == "forward_kl":
        return _kl(t_top, s_top)
    if divergence == "reverse_kl":
        return _kl(s_top, t_top)
    if divergence != "jsd":
        raise ValueError(f"unknown divergence {divergence!r}: jsd, forward_kl or reverse_kl")
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
    m = torch.logsumexp(torch.stack([t_top + math.log(beta), s_top + math.log(1 - beta)]), dim=0)
    return beta * _kl(t_top, m) + (1 - beta) * _kl(s_top, m)


def importance_weights(logp_now: torch.Tensor, logp_sampled: torch.Tensor, clip: float | None) -> torch.Tensor:
    """min(exp(logp_now - logp_sampled), clip), detached; 1 where the sampling logprob is unknown (NaN)."""
    if clip is None:
        return torch.ones_like(logp_now)
    known = ~torch.isnan(logp_sampled)
    ratio = torch.exp((logp_now.detach() - torch.nan_to_num(logp_sampled)).clamp(-20, 20)).clamp(max=clip)
    return torch.where(known, ratio, torch.ones_like(ratio))
