"""Privileged-teacher self-distillation (METHODS.md §0), as a small subclass of TRL's SFTTrainer.

The teacher is the policy itself (the current weights, or an EMA copy of them) with privileged
text in its prompt: SRD's hindsight notes, later RSIPO's skills or X-Tree's rendered tree. The
student is the same policy without it. Both score the *student's own completion tokens*:

    D_t = D( p_teacher(· | teacher prompt, z_<t) ‖ p_student(· | student prompt, z_<t) )

over the teacher's top-k tokens plus one bucket for the remaining mass (SRD's code: k = 100),
with D a generalized JSD (β = teacher weight of the mixture; 0.5 is the symmetric JSD), forward
KL(T‖S) or reverse KL(S‖T). An optional per-token importance weight min(exp(logp_now -
logp_sampled), clip), detached, corrects for the policy having moved since z was sampled.
The loss added to the batch's SFT loss is λ · Σ_examples w_e · mean_t(IS_t · D_t) / Σ w_e.

A distillation example is (student messages, teacher messages, train_from): the assistant
messages at index >= train_from are the completion; everything else must be the same prompt
except the privileged text in a user turn. `encode_pair` tokenizes both conversations through
the chat template and refuses a pair whose completion tokens do not line up.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from models.sft import WeightedSFTTrainer, _WeightCollator, tokenize_conversation


@dataclass(frozen=True)
class DistillLoss:
    """How the privileged-teacher term is computed (SRD's defaults)."""

    loss_weight: float = 0.01      # λ
    divergence: str = "jsd"        # jsd | forward_kl | reverse_kl
    beta: float = 0.5              # teacher weight of the JSD mixture
    top_k: int = 100               # teacher's top-k tokens + one tail bucket
    is_clip: float | None = 2.0    # per-token IS weight cap; None = no IS weight
    ema_rate: float = 0.05         # EMA teacher rate; 0 = the current weights are the teacher


class MisalignedCompletion(ValueError):
    """The completion's tokens differ between the teacher's and the student's encodings."""


# ---- the divergence ----------------------------------------------------------------------------

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


# ---- encoding ----------------------------------------------------------------------------------

def encode_pair(tokenizer, student: list[dict], teacher: list[dict], train_from: int,
                completion_ids: list[int] | None = None, sampling_logprobs: list[float] | None = None) -> dict[str, Any]:
    """Token ids of both conversations and the positions of the completion tokens in each.

    Raises MisalignedCompletion when the completion tokens (assistant messages at index >=
    train_from) differ between the two encodings, or there are none. With `completion_ids` (the
    tokens the student sampled), their `sampling_logprobs` are attached where the encoding
    reproduces them exactly (NaN elsewhere: no IS weight there)."""
    s = tokenize_conversation(tokenizer, student, train_from)
    t = tokenize_conversation(tokenizer, teacher, train_from)
    s_pos = [i for i, lab in enumerate(s["labels"]) if lab != -100]
    t_pos = [i for i, lab in enumerate(t["labels"]) if lab != -100]
    s_tok = [s["input_ids"][i] for i in s_pos]
    t_tok = [t["input_ids"][i] for i in t_pos]
    if not s_tok:
        raise MisalignedCompletion("no completion tokens to score (no assistant message at or after train_from)")
    if s_tok != t_tok:
        first = next((i for i, (a, b) in enumerate(zip(s_tok, t_tok)) if a != b), min(len(s_tok), len(t_tok)))
        raise MisalignedCompletion(
            f"completion tokens differ between the teacher's and the student's encodings at completion token {first} "
            f"(student {len(s_tok)} tokens, teacher {len(t_tok)}): the privileged text must stay in a user turn")
    logps = [math.nan] * len(s_tok)
    sampled_match = False
    if completion_ids and sampling_logprobs and len(sampling_logprobs) == len(completion_ids):
        n = len(completion_ids)
        if s_tok[:n] == list(completion_ids):
            logps[:n] = [float(x) for x in sampling_logprobs]
            sampled_match = True
    return {"input_ids": s["input_ids"], "labels": [-100] * len(s["input_ids"]),
            "teacher_input_ids": t["input_ids"], "student_pos": s_pos, "teacher_pos": t_pos,
            "sampled_logprobs": logps, "sampled_match": sampled_match}


def build_distill_rows(tokenizer, examples: list[dict], max_length: int) -> tuple[list[dict], dict[str, int]]:
    """examples: dicts with example_id, student, teacher, train_from, weight and optionally
    completion_ids / sampling_logprobs. Returns (rows, counts of dropped: misaligned, too_long)."""
    rows, counts = [], {"misaligned": 0, "too_long": 0, "sampled_match": 0}
    for ex in examples:
        try:
            enc = encode_pair(tokenizer, ex["student"], ex["teacher"], int(ex["train_from"]),
                              ex.get("completion_ids"), ex.get("sampling_logprobs"))
        except MisalignedCompletion:
            counts["misaligned"] += 1
            continue
        if max(len(enc["input_ids"]), len(enc["teacher_input_ids"])) > max_length:
            counts["too_long"] += 1
            continue
        counts["sampled_match"] += int(enc.pop("sampled_match"))
        rows.append({**enc, "weight": float(ex.get("weight", 1.0)), "example_id": ex["example_id"], "kind": 1})
    return rows, counts


# ---- the trainer -------------------------------------------------------------------------------

_DISTILL_COLUMNS = ("teacher_input_ids", "student_pos", "teacher_pos", "sampled_logprobs", "kind")


class DistillCollator(_WeightCollator):
    """Pads SFT and distillation rows together. SFT rows have empty teacher columns and kind 0."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call(examples)
        pad = self.pad_token_id
        n = len(examples)
        t_len = max([len(e.get("teacher_input_ids") or []) for e in examples] + [1])
        p_len = max([len(e.get("student_pos") or []) for e in examples] + [1])
        t_ids = torch.full((n, t_len), pad, dtype=torch.long)
        t_mask = torch.zeros((n, t_len), dtype=torch.long)
        s_pos = torch.full((n, p_len), -1, dtype=torch.long)
        t_pos = torch.full((n, p_len), -1, dtype=torch.long)
        slp = torch.full((n, p_len), math.nan)
        for i, e in enumerate(examples):
            ids = e.get("teacher_input_ids") or []
            t_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            t_mask[i, :len(ids)] = 1
            sp, tp = e.get("student_pos") or [], e.get("teacher_pos") or []
            s_pos[i, :len(sp)] = torch.tensor(sp, dtype=torch.long)
            t_pos[i, :len(tp)] = torch.tensor(tp, dtype=torch.long)
            lp = e.get("sampled_logprobs") or []
            slp[i, :len(lp)] = torch.tensor([math.nan if x is None else x for x in lp], dtype=torch.float)
        out.update(teacher_input_ids=t_ids, teacher_attention_mask=t_mask, student_pos=s_pos, teacher_pos=t_pos,
                   sampled_logprobs=slp, kind=torch.tensor([int(e.get("kind", 0)) for e in examples]))
        return out


class EmaTeacherCallback(TrainerCallback):
    """θ̄ ← (1 - rate)·θ̄ + rate·θ after each optimizer step."""

    def __init__(self, teacher: torch.nn.Module, rate: float):
        self.teacher, self.rate = teacher, rate

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p_t, p in zip(self.teacher.parameters(), model.parameters()):
                p_t.mul_(1.0 - self.rate).add_(p.detach().to(p_t.dtype), alpha=self.rate)


class PrivilegedDistillTrainer(WeightedSFTTrainer):
    """Weighted SFT plus λ · privileged-teacher distillation, in one loss, on mixed batches.

    Dataset rows are SFT rows (input_ids, labels, weight; kind 0) or distillation rows from
    `build_distill_rows` (kind 1). The student forward pass is shared; the teacher's is a
    no-grad pass of the same weights (or of the EMA copy) on the teacher's encoding.
    """

    def __init__(self, *args, distill: DistillLoss, **kwargs):
        self.distill = distill
        self.distill_log: list[dict[str, float]] = []
        super().__init__(*args, **kwargs)
        self.ema_teacher = None
        if distill.ema_rate > 0:
            self.ema_teacher = copy.deepcopy(self.model).requires_grad_(False).eval()
            self.add_callback(EmaTeacherCallback(self.ema_teacher, distill.ema_rate))

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns, *(c for c in _DISTILL_COLUMNS if c not in self._signature_columns)]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        extra = {k: inputs.pop(k) for k in ("teacher_input_ids", "teacher_attention_mask", "student_pos",
                                             "teacher_pos", "sampled_logprobs", "kind") if k in inputs}
        kind = extra.get("kind")
        if kind is None or not bool((kind == 1).any()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        weights = inputs.pop("weights", torch.ones(kind.shape[0]))
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False)
        logits = outputs.logits
        loss = logits.new_zeros(())
        sft_loss = None
        targets = labels[:, 1:]
        mask = (targets != -100).float()
        if mask.sum() > 0:
            token_loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                reduction="none").view(targets.shape)
            denom = num_items_in_batch if num_items_in_batch else mask.sum()
            sft_loss = (token_loss * mask * weights.to(token_loss.dtype)[:, None]).sum() / torch.as_tensor(
                denom, dtype=token_loss.dtype).clamp(min=1)
            loss = loss + sft_loss

        rows = (kind == 1).nonzero().flatten()
        teacher = self.ema_teacher if self.ema_teacher is not None else model
        with torch.no_grad():
            t_ids = extra["teacher_input_ids"][rows]
            t_logits = teacher(input_ids=t_ids, attention_mask=extra["teacher_attention_mask"][rows], use_cache=False).logits
        per_example, w_sum, stats = [], 0.0, {"tokens": 0.0, "is_mean": 0.0}
        d = self.distill
        for j, r in enumerate(rows.tolist()):
            sp = extra["student_pos"][r]
            tp = extra["teacher_pos"][r]
            keep = sp >= 0
            sp, tp = sp[keep], tp[keep]
            s_logits = logits[r, sp - 1]
            div = topk_divergence(t_logits[j, tp - 1], s_logits, d.top_k, d.divergence, d.beta)
            tokens = inputs["input_ids"][r, sp]
            logp_now = torch.log_softmax(s_logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
            isw = importance_weights(logp_now, extra["sampled_logprobs"][r][keep].to(logp_now.device), d.is_clip)
            per_example.append(weights[r].to(div.dtype) * (isw * div).mean())
            w_sum += float(weights[r])
            stats["tokens"] += float(len(sp))
            stats["is_mean"] += float(isw.mean())
        distill_loss = torch.stack(per_example).sum() / max(w_sum, 1e-8)
        loss = loss + d.loss_weight * distill_loss
        self.distill_log.append({"distill_loss": float(distill_loss.detach()),
                                 "sft_loss": float(sft_loss.detach()) if sft_loss is not None else math.nan,
                                 "distill_rows": float(len(rows)), "distill_tokens": stats["tokens"],
                                 "is_weight_mean": stats["is_mean"] / max(len(rows), 1)})
        return (loss, outputs) if return_outputs else loss
