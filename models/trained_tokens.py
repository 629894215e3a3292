"""The learning diagnostic of a training run: the mean change of logprob of the trained tokens between the
weights before and after training, split by the sign of the weight or advantage that trained them (a positive
row's tokens should rise, a negative one's fall).
"""

from __future__ import annotations

import torch

from rsiflow.models.collate import pad
from rsiflow.models.shared_prefix import shared_prefix_logits


def _sign_group(x: float) -> str:
    return "positive" if x > 0 else "negative" if x < 0 else "zero"


def trained_sequences(sft: list[dict], pg: list[dict]) -> tuple[list[str], list[tuple[list[int], list[int]]]]:
    """The rows the loss trains, for `trained_token_logprobs`: per row its sign group ("positive" / "negative" /
    "zero": an SFT row's weight, a pg row's advantage) and (token ids, positions of its trained tokens): an SFT row's
    labelled tokens (label != -100, after the first token: the loss is on labels[1:]), a pg row's completion tokens
    with action mask 1. Distillation rows are not included (their target is the teacher's distribution, not the
    tokens)."""
    groups, seqs = [], []
    for r in sft:
        groups.append(_sign_group(float(r.get("weight", 1.0))))
        seqs.append((list(r["input_ids"]), [i for i, lab in enumerate(r["labels"]) if lab != -100 and i > 0]))
    for r in pg:
        p = len(r["prompt_ids"])
        groups.append(_sign_group(float(r["advantage"])))
        seqs.append((list(r["prompt_ids"]) + list(r["completion_ids"]),
                     [p + j for j, m in enumerate(r["action_mask"]) if m]))
    return groups, seqs


@torch.no_grad()
def trained_token_logprobs(model, seqs: list[tuple[list[int], list[int]]], pad_id: int,
                           batch_size: int) -> list[tuple[float, int]]:
    """Per sequence (token ids, positions): Σ_p log p(ids[p] | ids[:p]) over the positions and their count, under
    `model`'s current weights: the plain log_softmax of its logits (temperature 1, no top-p), no grad, eval mode,
    in batches of `batch_size` (right-padded); the model's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    try:
        for i in range(0, len(seqs), max(batch_size, 1)):
            batch = seqs[i:i + batch_size]
            ids = pad([s[0] for s in batch], pad_id).to(device)
            mask = pad([[1] * len(s[0]) for s in batch], 0).to(device)
            first = min((p for _, positions in batch for p in positions), default=ids.size(1))
            with torch.no_grad():
                logits, offset = shared_prefix_logits(model, ids, mask, first)   # columns offset.. (the prefix once)
            for b, (_, positions) in enumerate(batch):
                if not positions:
                    out.append((0.0, 0))
                    continue
                pos = torch.tensor(positions, device=logits.device)
                logp = torch.log_softmax(logits[b, pos - 1 - offset].float(), -1).gather(-1, ids[b, pos][:, None].to(
                    logits.device))
                out.append((float(logp.sum()), len(positions)))
    finally:
        model.train(was_training)
    return out


def logprob_change(groups: list[str], before: list[tuple[float, int]],
                   after: list[tuple[float, int]]) -> dict[str, dict[str, float]]:
    """A learning diagnostic: how the trained tokens' log-probability moved, by the sign of what trained them. Per
    group (positive / negative / zero; only groups with trained tokens) its rows, tokens and the token-mean logprob
    of those tokens before (the parent's weights) and after training (the weights saved), and delta = after -
    before. SFT on positive weights and positive advantages should raise it, negative advantages lower it."""
    out: dict[str, dict[str, float]] = {}
    for name in ("positive", "negative", "zero"):
        idx = [i for i, g in enumerate(groups) if g == name and before[i][1]]
        tokens = sum(before[i][1] for i in idx)
        if not tokens:
            continue
        b, a = sum(before[i][0] for i in idx) / tokens, sum(after[i][0] for i in idx) / tokens
        out[name] = {"rows": len(idx), "tokens": tokens, "before": b, "after": a, "delta": a - b}
    return out
