"""Training a candidate, in one module: `train_candidate` trains from the champion on the rows of every
kind a method emits. Without policy-gradient rows the trainer is TRL's `SFTTrainer` (`RoundTrainer`):
weighted SFT rows and privileged-teacher distillation rows (models/encoding.py), in the same batches
and one loss:

    L = L_SFT + λ · Σ_e w_e · mean_t(IS_t · D_t) / Σ_e w_e     (or / the row count: DistillLoss.normalise)

L_SFT is `losses.weighted_token_ce` (used whatever the weights, all 1 or not); D_t is
`losses.topk_divergence` between the teacher (the policy itself, current weights or an EMA copy,
with privileged text in its prompt) and the student (the same policy without it), both scoring the
student's own completion tokens; IS_t is `losses.importance_weights`. The student forward pass is
shared by both terms; the teacher's is a no-grad pass on the teacher encoding.

Gradient accumulation: the SFT term is normalised by the labelled tokens of the whole accumulated
step (the Trainer's `num_items_in_batch`), the distillation term is divided by the number of
micro-batches, so neither grows with `grad_accum` (`loss_is_scaled_for_ga`).

GRPO (rows of kind "pg").

TRL's `GRPOTrainer` generates its completions inside the training loop; here the completions are the
round's stored episodes, so the subclass below replaces the generation step by the stored rows and
keeps the loss: `compute_loss` calls `GRPOTrainer._compute_loss` (its `loss_type`s, ε-clipping with
the optional clip-higher ε_high, the β-KL to the reference model) on batches built from them.

A multi-turn episode is one sequence: the prompt is everything before the model's first own action
(system, few-shot turns, the first observation); the completion is the rest, with TRL's `tool_mask`
= 1 on the model's own action tokens (and their end-of-turn marker) and 0 on every observation token,
so only action tokens get the loss and the trajectory's advantage.

- The old policy π_old of the PPO ratio is the champion that sampled the rollouts: its per-token
  logprobs are computed once before training (no grad), as TRL does when generation and optimisation
  steps are misaligned. `passes` optimisation passes run over the round's rows (epochs; minibatches of
  `batch_size × grad_accum` trajectories per optimizer step), each ratio taken against π_old and clipped.
  The β-KL reference is the same champion (TRL's reference model is the initial policy), so its logprobs
  are π_old's; or, with PolicyLoss.reference "base", the run's base model (train_candidate's
  `reference_path`), scored once before training by the same call (`prepare_reference`).
- Rollout/trainer mismatch (models/mismatch.py): k = π_old / π_sample per sampled token, with π_sample the
  sampler's logprob after temperature only; the correction weight w (TIS, CIS or mask) multiplies the
  token's policy loss, as TRL's vLLM importance-sampling correction does, by entering the advantage as a
  per-token (B, T) advantage A·w (TRL's loss is linear in a non-negative per-token factor there).
- SFT and distillation rows of other methods in the same round ride along: each micro-batch also holds
  a share of them, and their loss (`RowLoss`, the same as above) is added: L = L_GRPO + L_SFT + λ·D.
  Every row is then seen `passes` times.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from rsiflow.models.backend import Interrupted, interrupted_since, interrupts
from rsiflow.models.encoding import KINDS, encode_rows, tokenize_conversation
from rsiflow.models.loading import load_model_and_tokenizer, save_checkpoint
from rsiflow.models.losses import importance_weights, topk_divergence, weighted_token_ce
from rsiflow.models.mismatch import Correction, correction_weight, mismatch_stats
from rsiflow.models.shared_prefix import completion_logps, shared_prefix_logits

DISTILL = KINDS.index("distill")


@dataclass(frozen=True)
class DistillLoss:
    """How the privileged-teacher term is computed (SRD's defaults)."""

    loss_weight: float = 0.01      # λ
    divergence: str = "jsd"        # jsd | forward_kl | reverse_kl
    beta: float = 0.5              # teacher weight of the JSD mixture
    top_k: int = 100               # teacher's top-k tokens + one tail bucket
    is_clip: float | None = 2.0    # per-token IS weight cap; None = no IS weight
    ema_rate: float = 0.05         # EMA teacher rate; 0 = the current weights are the teacher
    normalise: str = "weights"     # the rows' weighted sum divided by Σ w ("weights") or by the row count ("rows":
                                   # RSIPO's trust weights then scale the term, docs/methods.md, RSIPO)

    def __post_init__(self):
        if self.normalise not in ("weights", "rows"):
            raise ValueError(f"DistillLoss.normalise must be 'weights' or 'rows', not {self.normalise!r}")


class RowCollator(DataCollatorForLanguageModeling):
    """Pads rows of every kind together: input_ids/labels by TRL's collator; the row weights; and the
    teacher's ids, the completion positions in both encodings and the sampled logprobs (empty for SFT rows)."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call(examples)
        out["weights"] = torch.tensor([float(e.get("weight", 1.0)) for e in examples])
        pad, n = self.pad_token_id, len(examples)
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
                   sampled_logprobs=slp, kind=torch.tensor([int(e.get("kind", 0)) for e in examples]),
                   term=torch.tensor([int(e.get("term", 0)) for e in examples]))
        return out


_ROW_COLUMNS = ("weight", "teacher_input_ids", "student_pos", "teacher_pos", "sampled_logprobs", "kind", "term")
_BATCH_EXTRAS = ("weights", "teacher_input_ids", "teacher_attention_mask", "student_pos", "teacher_pos",
                 "sampled_logprobs", "kind", "term")


class EmaTeacherCallback(TrainerCallback):
    """θ̄ ← (1 - rate)·θ̄ + rate·θ after each optimizer step."""

    def __init__(self, teacher: torch.nn.Module, rate: float):
        self.teacher, self.rate = teacher, rate

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p_t, p in zip(self.teacher.parameters(), model.parameters()):
                p_t.mul_(1.0 - self.rate).add_(p.detach().to(p_t.dtype), alpha=self.rate)


class RowLoss:
    """The loss of SFT and distillation rows (the module docstring's L), shared by every trainer here: the SFT
    trainer below uses it alone; StoredRolloutGRPOTrainer adds it to TRL's GRPO loss."""

    terms: list[DistillLoss]
    ema_teacher: torch.nn.Module | None
    distill_log: list[dict[str, float]]

    def _init_row_loss(self, distill: DistillLoss | list[DistillLoss] | None, has_distill_rows: bool,
                       shared_prefix: bool = False) -> None:
        """Call after the Trainer's __init__: the loss settings (one DistillLoss per distillation term; a row's
        `term` is its index), whether a batch's shared prefix is encoded once (models/shared_prefix.py) and, for
        distillation with ema_rate > 0, the EMA teacher (one copy: every term must have the same ema_rate). The
        prefix is shared in one process only: it takes two forwards per backward, and a DistributedDataParallel
        model expects one (its reducer is armed by each forward through the wrapper, which the cached second call
        cannot use)."""
        self.shared_prefix = shared_prefix and self.accelerator.num_processes == 1
        self.terms = list(distill) if isinstance(distill, list | tuple) else [distill or DistillLoss()]
        if len({d.ema_rate for d in self.terms}) > 1:
            raise ValueError(f"distillation terms with different ema_rate ({[d.ema_rate for d in self.terms]}): "
                             "they share one EMA teacher")
        self.distill = self.terms[0]   # its ema_rate is every term's
        self.distill_log = []
        self.ema_teacher = None
        if has_distill_rows and self.distill.ema_rate > 0:
            self.ema_teacher = copy.deepcopy(self.model).requires_grad_(False).eval()
            self.add_callback(EmaTeacherCallback(self.ema_teacher, self.distill.ema_rate))

    def _micro_batches(self) -> int:
        """Micro-batches per optimizer step (the Trainer sets the current count inside its loop)."""
        return int(getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps)

    def _step_key(self) -> dict:
        """{"step": optimizer steps done} under several processes (how `_merge_rank_logs` pairs the processes'
        entries); nothing in one process."""
        return {"step": self.state.global_step} if self.accelerator.num_processes > 1 else {}

    def _token_sum_scale(self) -> int:
        """Under several processes the Trainer gathers `num_items_in_batch` over all of them
        (`average_tokens_across_devices`) and DDP averages the gradients: a loss normalised by the global token count
        is multiplied by the process count (as transformers' own compute_loss does), so the step's gradient and the
        logged loss are those of one process holding the whole global batch. 1 in one process."""
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            return self.accelerator.num_processes
        return 1

    def _rows_loss(self, model, inputs: dict, num_items_in_batch=None):
        """(loss scaled for gradient accumulation, model outputs) of a RowCollator batch."""
        extra = {k: inputs.pop(k) for k in _BATCH_EXTRAS if k in inputs}
        n = inputs["input_ids"].shape[0]
        weights = extra.get("weights", torch.ones(n))
        kind = extra.get("kind", torch.zeros(n, dtype=torch.long))
        term = extra.get("term", torch.zeros(n, dtype=torch.long))
        micro = self._micro_batches()
        labels = inputs["labels"]
        rows = (kind == DISTILL).nonzero().flatten()
        term_rows = [((kind == DISTILL) & (term == t)).nonzero().flatten() for t in range(len(self.terms))]
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        # logits[:, j] belong to column offset + j (models/shared_prefix.py; offset 0: the plain forward)
        if getattr(self, "shared_prefix", False):
            scored = [int(c) for c in (labels != -100).any(0).nonzero().flatten()[:1]]
            scored += [int(extra["student_pos"][r][extra["student_pos"][r] >= 0].min()) for r in rows]
            logits, offset = shared_prefix_logits(model, ids, mask, min(scored, default=ids.size(1)))
        else:
            logits, offset = model(input_ids=ids, attention_mask=mask, use_cache=False).logits, 0
        outputs = CausalLMOutputWithPast(logits=logits)
        loss = logits.new_zeros(())
        sft_loss = None
        # this micro-batch's labelled tokens and distillation denominator, summed over the processes (see
        # _across_processes; both are this batch's own in one process), and the process count W that undoes DDP's
        # gradient average
        sft_tokens, denoms = self._across_processes(labels, weights, term_rows)
        world = self.accelerator.num_processes
        if bool((labels[:, 1:] != -100).any()):
            # With num_items_in_batch the sum is already normalised over the whole accumulated step.
            if num_items_in_batch is not None:
                sft_loss = weighted_token_ce(logits, labels[:, offset:], weights,
                                             num_items_in_batch) * self._token_sum_scale()
                loss = loss + sft_loss
            else:
                sft_loss = weighted_token_ce(logits, labels[:, offset:], weights, sft_tokens) * world
                loss = loss + sft_loss / micro
        for t, (d, t_rows) in enumerate(zip(self.terms, term_rows)):
            if not len(t_rows):
                continue
            distill_loss, stats = self._distill_term(model, logits, ids, weights, t_rows, extra, denoms[t], offset, d)
            distill_loss = distill_loss * world
            loss = loss + d.loss_weight * distill_loss / micro
            self.distill_log.append({**self._step_key(), **({"term": t} if len(self.terms) > 1 else {}),
                                     "distill_loss": float(distill_loss.detach()),
                                     "sft_loss": float(sft_loss.detach()) if sft_loss is not None else math.nan,
                                     **stats})
        return loss, outputs

    def _across_processes(self, labels, weights, term_rows) -> tuple[float, list[float]]:
        """(labelled tokens, each distillation term's denominator: Σ w of its rows, or their count with normalise
        "rows") of this micro-batch, summed over all processes of an `accelerate launch` by one all-reduce, so that
        a batch's mean over the rows of every process, times W (DDP averages the gradients), is the mean one process
        holding all those rows would take. Every process calls it for every micro-batch (StoredRolloutGRPOTrainer
        also where a micro-batch has no aux rows). In one process: this batch's own figures, no communication."""
        local = torch.tensor([float((labels[:, 1:] != -100).sum())]
                             + [sum(float(weights[r]) for r in rows) if d.normalise == "weights" else float(len(rows))
                                for d, rows in zip(self.terms, term_rows)],
                             dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").cpu()
        return float(local[0]), [float(x) for x in local[1:]]

    def _distill_term(self, model, logits, input_ids, weights, rows, extra, denom: float | None,
                      offset: int, d: DistillLoss) -> tuple[torch.Tensor, dict]:
        """Σ_e w_e · mean_t(IS_t · D_t) over the batch's distillation rows of one term (settings `d`), divided by
        `denom` (over all processes' batches, see _across_processes) or else by Σ_e w_e (normalise "weights") or
        their count ("rows"). `logits[:, j]` are the student's logits at column offset + j."""
        teacher = self.ema_teacher if self.ema_teacher is not None else model
        with torch.no_grad():
            t_logits = teacher(input_ids=extra["teacher_input_ids"][rows],
                               attention_mask=extra["teacher_attention_mask"][rows], use_cache=False).logits
        per_example, w_sum, tokens, is_sum = [], 0.0, 0.0, 0.0
        for j, r in enumerate(rows.tolist()):
            keep = extra["student_pos"][r] >= 0
            sp, tp = extra["student_pos"][r][keep], extra["teacher_pos"][r][keep]
            s_logits = logits[r, sp - 1 - offset]
            div = topk_divergence(t_logits[j, tp - 1], s_logits, d.top_k, d.divergence, d.beta)
            logp_now = torch.log_softmax(s_logits.float(), -1).gather(-1, input_ids[r, sp][:, None]).squeeze(-1)
            isw = importance_weights(logp_now, extra["sampled_logprobs"][r][keep].to(logp_now.device), d.is_clip)
            per_example.append(weights[r].to(div.dtype) * (isw * div).mean())
            w_sum += float(weights[r])
            tokens += float(len(sp))
            is_sum += float(isw.mean())
        if denom is None:
            denom = w_sum if d.normalise == "weights" else len(per_example)
        term = torch.stack(per_example).sum() / max(denom, 1e-8)
        return term, {"distill_rows": float(len(rows)), "distill_tokens": tokens, "is_weight_mean": is_sum / len(rows)}


class RoundTrainer(RowLoss, SFTTrainer):
    """SFTTrainer whose loss is the module docstring's L, on batches that mix SFT and distillation rows."""

    loss_is_scaled_for_ga = True  # compute_loss scales both terms for gradient accumulation itself

    def __init__(self, *args, distill: DistillLoss | None = None, shared_prefix: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_row_loss(distill, DISTILL in set(self.train_dataset["kind"]), shared_prefix)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns,
                                   *(c for c in _ROW_COLUMNS if c not in self._signature_columns)]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = self._rows_loss(model, inputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


@dataclass(frozen=True)
class PolicyLoss:
    """GRPO's settings for the trainer (config: distill.grpo)."""

    loss_type: str = "dapo"            # TRL's: grpo (sequence mean), dapo (token mean), dr_grpo (constant), bnpo
    epsilon: float = 0.2               # clip range, low side (and high side unless epsilon_high)
    epsilon_high: float | None = None  # clip-higher (DAPO: 0.28)
    beta: float = 0.0                  # KL(π ‖ π_ref) weight
    passes: int = 1                    # optimisation passes over the round's rows
    temperature: float = 1.0           # the sampler's temperature: the trainer's logits are divided by it
    correction: Correction = field(default_factory=Correction)
    skip_zero_advantage: bool = True   # with beta = 0 a zero-advantage row has zero gradient: don't compute it
    reference: str = "champion"        # the β-KL reference: champion (π_old) or base (train_candidate's reference_path)
    reference_path: str | None = None  # the reference's checkpoint when it is not π_old (set by train_candidate)

    def __post_init__(self):
        if self.reference not in ("champion", "base"):
            raise ValueError(f"PolicyLoss.reference must be 'champion' or 'base', not {self.reference!r}")


def encode_pg_rows(tokenizer, rows: list[dict], max_length: int) -> tuple[list[dict], dict[str, int]]:
    """Tokenize "pg" rows: prompt ids (before the first own action), completion ids, the action mask over the
    completion, the advantage, and per completion token the sampler's logprob after temperature only where the
    encoding reproduces the sampled tokens (NaN elsewhere: end-of-turn markers, projected actions).

    Returns (rows, counts): `too_long` rows are dropped; `sampled_match` / `sampled_turns` count the action
    turns whose sampled tokens the encoding reproduced."""
    out, counts = [], {"too_long": 0, "no_action": 0, "sampled_match": 0, "sampled_turns": 0}
    for row in rows:
        enc = tokenize_conversation(tokenizer, row["messages"], int(row.get("train_from") or 0), row.get("tools"))
        ids, labels = enc["input_ids"], enc["labels"]
        if len(ids) > max_length:
            counts["too_long"] += 1
            continue
        labelled = [i for i, lab in enumerate(labels) if lab != -100]
        if not labelled:
            counts["no_action"] += 1
            continue
        start = labelled[0]
        sample_logps = [math.nan] * (len(ids) - start)
        spans, cur = [], []
        for i in labelled:  # contiguous labelled runs = the assistant turns, in order
            if cur and i != cur[-1] + 1:
                spans.append(cur)
                cur = []
            cur.append(i)
        spans.append(cur)
        for span, sampled in zip(spans, row.get("sampled") or []):
            tok, lps = list(sampled["token_ids"]), list(sampled["temp_logprobs"])
            counts["sampled_turns"] += 1
            if tok and len(lps) == len(tok) and [ids[i] for i in span[:len(tok)]] == tok:
                counts["sampled_match"] += 1
                for i, lp in zip(span, lps):
                    sample_logps[i - start] = float(lp)
        out.append({"example_id": row["example_id"], "prompt_ids": ids[:start], "completion_ids": ids[start:],
                    "action_mask": [int(lab != -100) for lab in labels[start:]],
                    "advantage": float(row["advantage"]), "sample_logps": sample_logps})
    return out, counts


def _pad(seqs: list[list], value, left: bool = False, dtype=torch.long) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([([value] * (width - len(s)) + list(s)) if left else (list(s) + [value] * (width - len(s)))
                         for s in seqs], dtype=dtype)


def collate_pg(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """TRL's batch layout: prompts left-padded, completions right-padded, `tool_mask` = the action mask; the
    advantage per token (A·w, w the mismatch weight) where `weights` are known, else per row."""
    batch = {
        "prompt_ids": _pad([r["prompt_ids"] for r in rows], pad_id, left=True),
        "prompt_mask": _pad([[1] * len(r["prompt_ids"]) for r in rows], 0, left=True),
        "completion_ids": _pad([r["completion_ids"] for r in rows], pad_id),
        "completion_mask": _pad([[1] * len(r["completion_ids"]) for r in rows], 0),
        "tool_mask": _pad([r["action_mask"] for r in rows], 0),
    }
    if "old_logps" in rows[0]:
        batch["old_per_token_logps"] = _pad([r["old_logps"] for r in rows], 0.0, dtype=torch.float32)
        # the reference is the initial policy π_old, unless another model's logprobs were attached (prepare_reference)
        batch["ref_per_token_logps"] = (_pad([r["ref_logps"] for r in rows], 0.0, dtype=torch.float32)
                                        if "ref_logps" in rows[0] else batch["old_per_token_logps"])
        weights = _pad([r["weights"] for r in rows], 0.0, dtype=torch.float32)
        adv = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
        batch["advantages"] = adv[:, None] * weights
    else:
        batch["advantages"] = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)
    return batch


def _rewards_are_stored(prompts, completions, **kwargs):
    """The rows' rewards were given by the env's verifier when they were played (and turned into advantages);
    TRL asks for a reward source at construction, and never calls it here (its generation step is replaced)."""
    raise RuntimeError("StoredRolloutGRPOTrainer trains on stored rollouts: their rewards are already in the store")


class StoredRolloutGRPOTrainer(RowLoss, GRPOTrainer):
    """TRL's GRPOTrainer fed the round's stored rollouts instead of sampling (module docstring, "GRPO")."""

    loss_is_scaled_for_ga = True

    def __init__(self, *args, pg_rows: list[dict], aux_rows: list[dict], policy: PolicyLoss, distill=None,
                 shared_prefix: bool = False, **kwargs):
        self.pg_rows, self.aux_rows, self.policy = pg_rows, aux_rows, policy
        self.pg_log: list[dict[str, float]] = []
        from datasets import Dataset

        # The stored rows are the dataset (get_train_dataloader batches them; TRL's sampler is not used).
        super().__init__(*args, reward_funcs=[_rewards_are_stored], train_dataset=Dataset.from_list(pg_rows), **kwargs)
        # β is applied here, not through GRPOConfig: TRL would load a second copy of the checkpoint as its
        # reference model, while the reference (the initial policy) is π_old, already computed per token.
        self.beta = policy.beta
        self._init_row_loss(distill, any(r.get("kind") == 1 for r in aux_rows), shared_prefix)
        self._aux_collator = RowCollator(pad_token_id=self.processing_class.pad_token_id)

    # ---- data: the stored rows instead of TRL's generation ----------------------------------------

    def _completion_logps(self, model, device) -> list[tuple[list[dict], list[list[float]]]]:
        """(rows, their per-completion-token logprobs) for the pg rows in chunks of the micro-batch size: TRL's own
        scoring (`_get_per_token_logps_and_entropies`: the fused LM head, logits / policy.temperature), no grad."""
        bs, pad = self.args.per_device_train_batch_size, self.processing_class.pad_token_id
        out = []
        with torch.no_grad():
            for start in range(0, len(self.pg_rows), bs):
                chunk = self.pg_rows[start:start + bs]
                b = collate_pg(chunk, pad)
                ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1).to(device)
                mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1).to(device)
                logps, _, _ = self._get_per_token_logps_and_entropies(model, ids, mask, b["completion_ids"].size(1))
                out.append((chunk, [lp[:len(r["completion_ids"])]
                                    for r, lp in zip(chunk, logps.float().cpu().tolist())]))
        return out

    def prepare_old_policy(self) -> dict[str, Any]:
        """π_old (and the reference) per completion token, and the mismatch weights; returns the round's
        mismatch statistics. Called once before training, with the champion's weights."""
        model = self.model
        train_lp, sample_lp, weights, capped = [], [], [], []
        model.eval()
        for chunk, chunk_lps in self._completion_logps(model, model.device):
            for r, lp in zip(chunk, chunk_lps):
                r["old_logps"] = lp
                r["weights"] = []
                for t, s, m in zip(r["old_logps"], r["sample_logps"], r["action_mask"]):
                    w, c = correction_weight(t, s, self.policy.correction) if m else (1.0, False)
                    r["weights"].append(w)
                    if m:
                        train_lp.append(t)
                        sample_lp.append(s)
                        weights.append(w)
                        capped.append(c)
        model.train()
        return mismatch_stats(train_lp, sample_lp, weights, capped)

    def prepare_reference(self, path: str | Path, dtype: str = "float32", trust_remote_code: bool = False) -> None:
        """The β-KL reference per completion token from another checkpoint (`path`, e.g. the run's base model) instead
        of π_old: loaded in `dtype`, given TRL's fused LM head at the trainer's temperature and scored by the same
        call as π_old (prepare_old_policy), so the KL compares like with like; freed afterwards. Each pg row gets
        `ref_logps`, which collate_pg puts into `ref_per_token_logps`."""
        from trl.trainer.utils import add_fused_lm_head

        ref, _ = load_model_and_tokenizer(path, dtype=dtype, trust_remote_code=trust_remote_code)
        own = self.model.get_output_embeddings().weight.shape[0]
        if ref.get_output_embeddings().weight.shape[0] != own:
            raise ValueError(f"the KL reference {str(path)!r} has {ref.get_output_embeddings().weight.shape[0]} output "
                             f"tokens, the policy {own}: not the same tokenizer")
        add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        device = self.accelerator.device
        ref.requires_grad_(False).eval().to(device)
        try:
            for chunk, chunk_lps in self._completion_logps(ref, device):
                for r, lp in zip(chunk, chunk_lps):
                    r["ref_logps"] = lp
        finally:
            del ref
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def get_train_dataloader(self) -> DataLoader:
        """Micro-batches of `per_device_train_batch_size` pg rows (reshuffled every pass), each carrying an equal
        share of the aux rows; `num_items_in_batch` = the action tokens of the micro-batch's optimizer step.

        Under W processes (accelerate launch) every process builds the same shuffled list of micro-batches (same
        seed) and an optimizer step takes the next ga x W of them; process r trains on those at positions r, r+W, ...
        of the step (as accelerate's BatchSamplerShard deals SFT batches), and `num_items_in_batch` counts the
        action tokens of all W processes' micro-batches of the step. The list is wrapped around to a multiple of W
        (as accelerate's even_batches does), so every process runs as many backward passes. The aux rows are dealt
        over slots (the W micro-batches at one position of a step), each slot's share split over its W processes: so W
        processes with batch size B/W see per step the pg and aux rows one process with batch size B would."""
        bs, ga = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        rng = random.Random(self.args.seed)
        pad = self.processing_class.pad_token_id

        class Passes(torch.utils.data.IterableDataset):
            def __len__(inner):
                return math.ceil(math.ceil(len(self.pg_rows) / bs) / world)

            def __iter__(inner):
                order = list(range(len(self.pg_rows)))
                rng.shuffle(order)
                micro = [order[i:i + bs] for i in range(0, len(order), bs)]
                aux = list(range(len(self.aux_rows)))
                rng.shuffle(aux)
                n = len(micro)
                micro += [micro[i % n] for i in range(-n % world)]
                # aux rows are dealt over slots (a slot: the W micro-batches the processes train on side by side;
                # one process: a micro-batch), then within a slot over its processes
                slots = len(micro) // world
                shares = [aux[i::slots] for i in range(slots)]
                for s in range(0, len(micro), ga * world):
                    step = micro[s:s + ga * world]
                    tokens = sum(sum(self.pg_rows[i]["action_mask"]) for m in step for i in m)
                    for k in range(rank, len(step), world):
                        m = step[k]
                        batch = {"pg": collate_pg([self.pg_rows[i] for i in m], pad)}
                        # TRL's dapo normaliser is num_items * ga / steps_per_generation: make it this step's tokens
                        batch["pg"]["num_items_in_batch"] = torch.tensor(
                            float(tokens) * self.args.steps_per_generation / ga)
                        share = shares[(s + k) // world][rank::world]
                        if share:
                            batch["aux"] = self._aux_collator([dict(self.aux_rows[i]) for i in share])
                        yield batch

        return DataLoader(Passes(), batch_size=None)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's per-token logprobs of the completion (every pass here: π_old, the reference, the loss), with the
        batch's shared prompt prefix encoded once (models/shared_prefix.py) when `train.shared_prefix` is on and the
        batch is text only; otherwise TRL's own."""
        if (not self.shared_prefix or compute_aux_loss or any(v is not None for v in multimodal.values())):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss,
                                                              **multimodal)
        logps, entropies = completion_logps(model, input_ids, attention_mask, logits_to_keep, self.temperature,
                                            compute_entropy)
        return logps, entropies, None

    def _prepare_inputs(self, inputs):
        return Trainer._prepare_inputs(self, inputs)  # to the device; no generation: the rows are stored

    # ---- the loss ------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pg = inputs["pg"]
        loss = self._compute_loss(model, pg)  # TRL's GRPO loss, scaled for gradient accumulation by TRL
        mode = "train" if self.model.training else "eval"
        clip = self._metrics[mode].get("clip_ratio/region_mean") or [math.nan]
        entry = {**self._step_key(), "pg_loss": float(loss.detach()) * self._micro_batches(), "clip_ratio": clip[-1],
                 "tokens": float(pg["tool_mask"].sum())}
        if self.beta != 0.0:  # TRL's token-mean KL(π ‖ π_ref) estimate of this micro-batch
            entry["kl"] = (self._metrics[mode].get("kl") or [math.nan])[-1]
        self.pg_log.append(entry)
        if "aux" in inputs:
            aux_loss, _ = self._rows_loss(model, inputs["aux"])
            loss = loss + aux_loss
        elif self.aux_rows and self.accelerator.num_processes > 1:  # the others' aux batches sum over this one too
            self._across_processes(torch.full((1, 2), -100), torch.zeros(0),
                                   [torch.zeros(0, dtype=torch.long)] * len(self.terms))
        return loss


# Under DDP (accelerate launch) a process runs as many forward passes as its rows need (teacher passes of
# distillation rows, the aux rows of a GRPO micro-batch), not as many as the others: DDP's per-forward buffer
# broadcast (a collective) would then wait forever. The causal LMs' buffers (rotary tables) are constants, so
# they are not broadcast; the gradients are still all-reduced once per backward.
DDP_BROADCAST_BUFFERS = False


def grpo_args(cfg, policy: PolicyLoss, out_dir: str, seed: int, n_rows: int, use_cpu: bool, bf16: bool,
              report: dict | None = None):
    """TRL's GRPOConfig for training on stored rows: the micro-batch is the largest divisor of the row count
    not above train.batch_size (every micro-batch full); TRL's sampling settings are unused."""
    bs = max(d for d in range(1, min(cfg.batch_size, n_rows) + 1) if n_rows % d == 0)
    return GRPOConfig(
        output_dir=out_dir, learning_rate=cfg.resolved_learning_rate(True), num_train_epochs=policy.passes,
        per_device_train_batch_size=bs, gradient_accumulation_steps=cfg.grad_accum,
        activation_checkpointing=cfg.gradient_checkpointing,
        steps_per_generation=2 * cfg.grad_accum, num_generations=2,  # TRL's checks; generation is replaced
        loss_type=policy.loss_type, epsilon=policy.epsilon, epsilon_high=policy.epsilon_high, beta=0.0,
        temperature=policy.temperature, max_completion_length=cfg.max_length, num_iterations=1,
        warmup_steps=cfg.warmup_ratio, lr_scheduler_type=cfg.lr_scheduler, seed=seed, use_cpu=use_cpu, bf16=bf16,
        fp16=False, logging_steps=1, save_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, log_completions=False, ddp_broadcast_buffers=DDP_BROADCAST_BUFFERS,
        **(report or {"report_to": []}),
    )


def _log_to(trainer, log_dir: str | Path | None) -> None:
    """TensorBoard writes into `log_dir` (transformers would write into the trainer's temporary output folder)."""
    from transformers.integrations import TensorBoardCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, TensorBoardCallback):
            if log_dir is None:
                raise ValueError("train.report_to has tensorboard but no folder for its event files was given")
            callback.logging_dir = str(log_dir)


class BestValidationCallback(TrainerCallback):
    """After every epoch: the token-mean cross-entropy of the validation rows (SFT rows never trained on) under
    the current weights; a copy of the weights with the lowest one so far is kept (on CPU) for `restore`."""

    def __init__(self, rows: list[dict], pad_id: int, batch_size: int):
        self.rows, self.pad_id, self.batch_size = rows, pad_id, batch_size
        self.losses: list[float] = []
        self.best: dict | None = None
        self.best_epoch: int | None = None

    @torch.no_grad()
    def loss(self, model) -> float:
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        device = next(model.parameters()).device
        for i in range(0, len(self.rows), self.batch_size):
            batch = self.rows[i:i + self.batch_size]
            ids = _pad([r["input_ids"] for r in batch], self.pad_id).to(device)
            labels = _pad([r["labels"] for r in batch], -100).to(device)
            mask = _pad([[1] * len(r["input_ids"]) for r in batch], 0).to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits
            n = int((labels[:, 1:] != -100).sum())
            total += float(weighted_token_ce(logits, labels, torch.ones(len(batch)))) * n
            tokens += n
        model.train(was_training)
        return total / max(tokens, 1)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        loss = self.loss(model)
        self.losses.append(loss)
        if self.best is None or loss < min(self.losses[:-1]):
            self.best = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            self.best_epoch = len(self.losses)

    def restore(self, model) -> None:
        if self.best is not None:
            model.load_state_dict(self.best)


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
            ids = _pad([s[0] for s in batch], pad_id).to(device)
            mask = _pad([[1] * len(s[0]) for s in batch], 0).to(device)
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


def _is_main_process() -> bool:
    """True in a plain process and in rank 0 of an `accelerate launch` (RANK is set by its torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


def _full_weights(trainer, model):
    """The trained model with all its weights on this process. Under DDP or DeepSpeed ZeRO-1/2 every process holds
    them already; under FSDP or ZeRO-3 (parameters sharded) the full state dict is gathered (a collective call on
    every process) and loaded into a fresh model of the same config. Not run here: only DDP was tested."""
    from accelerate.utils import DistributedType

    acc = trainer.accelerator
    sharded = acc.distributed_type == DistributedType.FSDP or (
        acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 3)
    if not sharded:
        return model
    state = acc.get_state_dict(trainer.model_wrapped)
    if not acc.is_main_process:
        return model
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(acc.unwrap_model(trainer.model_wrapped).config)
    fresh.load_state_dict(state)
    return fresh


def _merge_rank_logs(trainer) -> None:
    """Under W processes each keeps its own per-micro-batch pg/distillation log: gather them (every process) and keep
    on each one entry per optimizer step. A process logs its share of the step's loss times W (RowLoss: the batch's
    sum over all processes' rows, normalised, times W against DDP's average), so the losses of an entry are the sum of
    the processes' values / W (a process without such rows that step adds 0), per micro-batch (/ the most entries
    one process logged that step); the counts (rows, tokens) are summed; the ratios and weights (clip ratio, already
    gathered by TRL; mean IS weight) averaged. One process: the logs stay as they are, one entry per micro-batch."""
    import torch.distributed as dist

    world = trainer.accelerator.num_processes
    if world == 1 or not dist.is_initialized():
        return
    counts, scaled = {"tokens", "distill_rows", "distill_tokens"}, {"pg_loss", "distill_loss", "sft_loss"}
    for name in ("pg_log", "distill_log"):
        local = getattr(trainer, name, None)
        if local is None:
            continue
        gathered: list = [None] * world
        dist.all_gather_object(gathered, local)
        steps: dict[int, list[list[dict]]] = {}
        for rank, entries in enumerate(gathered):
            for e in entries:
                steps.setdefault(int(e.get("step", 0)), [[] for _ in range(world)])[rank].append(e)
        merged = []
        for step in sorted(steps):
            per_rank = steps[step]
            entries = [e for es in per_rank for e in es]
            micro = max(len(es) for es in per_rank)
            out = {}
            for k in (k for k in entries[0] if k != "step"):
                values = [e[k] for e in entries if not math.isnan(e[k])]
                if k in counts:
                    out[k] = sum(e[k] for e in entries)
                elif not values:
                    out[k] = math.nan
                else:
                    out[k] = sum(values) / (world * micro) if k in scaled else sum(values) / len(values)
            merged.append(out)
        setattr(trainer, name, merged)


class _ProgressCallback(TrainerCallback):
    def __init__(self, on_step):
        self.on_step = on_step

    def on_step_end(self, args, state, control, **kwargs):
        self.on_step(state.global_step, state.max_steps)


class _InterruptCallback(TrainerCallback):
    """End training with `Interrupted` at the next optimizer step once rsiflow was told to stop after training
    began (Ctrl-C, SIGTERM, a step timeout: models/backend.py's `interrupt_calls_in_flight`)."""

    def __init__(self):
        self.start = interrupts()

    def on_step_end(self, args, state, control, **kwargs):
        if interrupted_since(self.start):
            raise Interrupted(f"training stopped at step {state.global_step} of {state.max_steps}: rsiflow was told "
                              "to stop (Ctrl-C, SIGTERM or a step timeout)")


def train_candidate(
    model_path: str | Path,
    rows: list[dict],
    out_dir: str | Path,
    cfg,  # configs.schema.TrainConfig
    seed: int = 0,
    dtype: str = "float32",
    on_step=None,
    distill: DistillLoss | dict[str, DistillLoss] | None = None,
    policy: PolicyLoss | None = None,
    trust_remote_code: bool = False,
    log_dir: str | Path | None = None,
    run_name: str | None = None,
    reference_path: str | Path | None = None,
) -> tuple[dict[str, Any], list]:
    """Train a candidate from `model_path` on training rows (kind "sft", "distill" or "pg") and save a full
    checkpoint (LoRA merged) to `out_dir`. With "pg" rows the trainer is `StoredRolloutGRPOTrainer` (TRL's
    GRPO loss, `policy`), the other rows riding along; without, `RoundTrainer` (TRL's SFTTrainer).

    Returns (metrics, ids of the rows trained on). Metrics: SFT rows used (`examples`) and dropped
    (`dropped_too_long`), trained tokens, steps, first/last/mean train loss; with distillation rows,
    those used, misaligned or too long (dropped), distilled tokens, the distillation loss
    (first/last/mean over steps), the mean IS weight, λ and whether the teacher was an EMA copy; with pg
    rows, those trained and skipped (zero advantage), their action tokens, the policy loss and clip ratio
    (mean over steps), and the rollout/trainer mismatch (mean |Δ logprob|, KL(sampler ‖ trainer), the share
    of capped tokens, the mean correction weight). With no usable rows the candidate is a copy of the parent.

    Rows marked `validation: True` (SFT rows; MASS's next-ranked episodes) are never trained on: after every epoch
    their loss is measured and the checkpoint saved is the epoch's weights with the lowest one (metrics
    validation_losses, validation_loss_best, validation_best_epoch); GRPO rounds take no validation rows.

    Training metrics go to the trackers of `cfg.report_to` (TRL's report_to) under `run_name`; TensorBoard writes
    its event files into `log_dir`. The trainer's own output folder is temporary: it saves no checkpoint (the
    candidate is saved to `out_dir` once, at the end).

    `reference_path`: the run's base model checkpoint, the β-KL reference of the pg rows when `policy.reference` is
    "base" (and `policy.beta` > 0): its per-token logprobs replace π_old's in TRL's KL term. Ignored with reference
    "champion" (the KL is then to π_old, the round's champion) or beta 0; reference "base" with beta > 0 and pg rows
    but no `reference_path` is an error. Metrics: with beta > 0, `kl_mean` (TRL's token-mean KL estimate, mean over
    micro-batches) and `kl` in every pg_steps_log entry.

    `distill`: the settings of the distillation rows, or one per term by name (a method's), each row naming its
    term in `term`; each term is normalised and weighted (λ) on its own and their sum is added to the loss. With
    several terms, metrics `distill_terms` give each one's rows, mean loss and λ.

    `logprob_change` (metrics; one process only, absent under `accelerate launch`: the diagnostic is skipped there):
    the token-mean logprob of the trained tokens (SFT rows' labelled tokens, pg rows' action tokens; not distillation
    rows) under the parent's weights and under the weights saved, by the sign of the row's weight (SFT) or advantage
    (pg): {"positive": {"rows", "tokens", "before", "after", "delta"}, "negative": {...}, "zero": {...}}, only the
    groups that have rows (see `logprob_change`).
    """
    from datasets import Dataset

    policy = policy or PolicyLoss()
    terms = dict(distill) if isinstance(distill, dict) else {"distill": distill or DistillLoss()}
    names = list(terms)
    for r in rows:
        if r.get("kind") == "distill" and len(names) > 1 and r.get("term") not in terms:
            raise ValueError(f"distillation row {r.get('example_id')!r}: term {r.get('term')!r} is not one of {names}")
    rows = [{**r, "term": names.index(r["term"]) if r.get("term") in terms else 0} for r in rows]
    distill = terms[names[0]]
    if policy.reference == "base" and policy.beta > 0 and any(r.get("kind") == "pg" for r in rows):
        if reference_path is None:
            raise ValueError("policy.reference is 'base' with beta > 0 but train_candidate got no reference_path "
                             "(the run's base model checkpoint)")
        policy = dataclasses.replace(policy, reference_path=str(reference_path))
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    validation_in = [r for r in rows if r.get("validation")]
    rows = [r for r in rows if not r.get("validation")]
    if validation_in and any(r.get("kind") == "pg" for r in rows):
        raise ValueError("validation rows are supported by the SFT trainer only, not with policy-gradient rows")
    validation, _ = encode_rows(tokenizer, validation_in, cfg.max_length)
    pg_in = [r for r in rows if r.get("kind") == "pg"]
    skipped = [r for r in pg_in if policy.skip_zero_advantage and policy.beta == 0 and r["advantage"] == 0.0]
    pg, pg_counts = encode_pg_rows(tokenizer, [r for r in pg_in if r not in skipped], cfg.max_length)
    encoded, counts = encode_rows(tokenizer, [r for r in rows if r.get("kind") != "pg"], cfg.max_length)
    sft = [r for r in encoded if r["kind"] != DISTILL]
    dis = [r for r in encoded if r["kind"] == DISTILL]
    metrics: dict[str, Any] = {"examples": len(sft), "dropped_too_long": counts["sft_too_long"], "steps": 0,
                               "trained_tokens": int(sum(sum(lab != -100 for lab in r["labels"]) for r in sft)),
                               "train_loss": None}
    if any(r.get("kind") == "distill" for r in rows):
        metrics.update(distill_examples=len(dis), distill_misaligned=counts["misaligned"],
                       distill_too_long=counts["distill_too_long"], distill_sampled_match=counts["sampled_match"],
                       distill_tokens=int(sum(len(r["student_pos"]) for r in dis)))
    if pg_in:
        metrics.update(pg_rows=len(pg), pg_skipped_zero_advantage=len(skipped), pg_too_long=pg_counts["too_long"],
                       pg_tokens=int(sum(sum(r["action_mask"]) for r in pg)),
                       pg_sampled_match=pg_counts["sampled_match"], pg_sampled_turns=pg_counts["sampled_turns"])
    if not encoded and not pg:
        if _is_main_process():
            save_checkpoint(model, tokenizer, out_dir)
        return metrics, []
    use_cpu = not torch.cuda.is_available()
    bf16 = (dtype == "bfloat16") and not use_cpu
    trainer_dir = tempfile.TemporaryDirectory(prefix="rsiflow-trainer-")  # removed after training (or at exit)
    report = {"report_to": list(cfg.report_to), "run_name": run_name}
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig

        peft_config = PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                     target_modules="all-linear", task_type="CAUSAL_LM")
    model.train()
    callbacks = [_InterruptCallback()] + ([_ProgressCallback(on_step)] if on_step else [])
    best = None
    if pg:
        args = grpo_args(cfg, policy, trainer_dir.name, seed, len(pg), use_cpu, bf16, report)
        trainer = StoredRolloutGRPOTrainer(model=model, args=args, processing_class=tokenizer, peft_config=peft_config,
                                           callbacks=callbacks, pg_rows=pg, aux_rows=encoded, policy=policy,
                                           distill=list(terms.values()), shared_prefix=cfg.shared_prefix)
        mismatch = trainer.prepare_old_policy()
        if policy.beta > 0 and policy.reference_path:
            trainer.prepare_reference(policy.reference_path, dtype, trust_remote_code)
        metrics.update({f"mismatch_{k}": v for k, v in mismatch.items()}, correction=policy.correction.mode)
        used_ids = [r["example_id"] for r in pg] + [r["example_id"] for r in encoded]
    else:
        args = SFTConfig(
            output_dir=trainer_dir.name,
            learning_rate=cfg.resolved_learning_rate(False),
            num_train_epochs=cfg.epochs,
            activation_checkpointing=cfg.gradient_checkpointing,
            per_device_train_batch_size=cfg.batch_size,
            gradient_accumulation_steps=cfg.grad_accum,
            max_length=None,  # rows were length-checked above; TRL must not truncate one side of a pair
            warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of total steps
            lr_scheduler_type=cfg.lr_scheduler,
            seed=seed,
            use_cpu=use_cpu,
            bf16=bf16,
            fp16=False,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            dataset_num_proc=None,
            ddp_broadcast_buffers=DDP_BROADCAST_BUFFERS,
            **report,
        )
        dataset = Dataset.from_list(encoded)
        used_ids = list(dataset["example_id"])
        best = BestValidationCallback(validation, tokenizer.pad_token_id, cfg.batch_size) if validation else None
        trainer = RoundTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                               peft_config=peft_config, callbacks=callbacks + ([best] if best else []),
                               data_collator=RowCollator(pad_token_id=tokenizer.pad_token_id),
                               distill=list(terms.values()), shared_prefix=cfg.shared_prefix)
    _log_to(trainer, log_dir)
    # the learning diagnostic (logprob_change): one process only; under accelerate launch it is skipped
    diagnose = trainer.accelerator.num_processes == 1
    if diagnose:
        groups, seqs = trained_sequences(sft, pg)
        before = trained_token_logprobs(trainer.model, seqs, tokenizer.pad_token_id, cfg.batch_size)
    result = trainer.train()
    trainer_dir.cleanup()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trained = trainer.model
    if best is not None:
        best.restore(trained)
        metrics.update(validation_examples=len(validation), validation_losses=best.losses,
                       validation_loss_best=min(best.losses) if best.losses else None,
                       validation_best_epoch=best.best_epoch)
    trained = _full_weights(trainer, trained)
    if cfg.lora.enabled:
        trained = trained.merge_and_unload()
    trained.eval()
    if diagnose:  # the weights saved: after the LoRA merge and the best-validation restore
        after = trained_token_logprobs(trained, seqs, tokenizer.pad_token_id, cfg.batch_size)
        metrics["logprob_change"] = logprob_change(groups, before, after)
    if trainer.accelerator.is_main_process:  # under accelerate launch only rank 0 writes the candidate
        save_checkpoint(trained, tokenizer, out_dir)
    trainer.accelerator.wait_for_everyone()
    _merge_rank_logs(trainer)
    metrics.update(steps=int(result.global_step), train_loss=float(result.training_loss),
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
                   loss_curve=[round(x, 6) for x in losses])  # per optimizer step (logging_steps=1)
    if dis:
        dl = [h["distill_loss"] for h in trainer.distill_log]
        metrics.update(distill_loss_first=dl[0] if dl else None, distill_loss_last=dl[-1] if dl else None,
                       distill_loss_mean=sum(dl) / len(dl) if dl else None,
                       is_weight_mean=(sum(h["is_weight_mean"] for h in trainer.distill_log) / len(dl)) if dl else None,
                       distill_loss_weight=distill.loss_weight, ema_teacher=distill.ema_rate > 0)
        if len(names) > 1:
            per = {i: [h["distill_loss"] for h in trainer.distill_log if h.get("term") == i] for i in range(len(names))}
            metrics["distill_terms"] = {
                name: {"rows": sum(r["term"] == i for r in dis), "loss_weight": terms[name].loss_weight,
                       "loss_mean": sum(per[i]) / len(per[i]) if per[i] else None} for i, name in enumerate(names)}
    if pg:
        log = trainer.pg_log
        clips = [h["clip_ratio"] for h in log if not math.isnan(h["clip_ratio"])]
        kls = [h["kl"] for h in log if "kl" in h and not math.isnan(h["kl"])]
        if policy.beta > 0:
            metrics.update(kl_mean=sum(kls) / len(kls) if kls else None, reference=policy.reference)
        metrics.update(pg_loss_mean=sum(h["pg_loss"] for h in log) / len(log) if log else None,
                       clip_ratio_mean=sum(clips) / len(clips) if clips else None, passes=policy.passes,
                       pg_steps_log=[{k: round(v, 6) for k, v in h.items()} for h in log])
    if not math.isfinite(metrics["train_loss"]):
        raise RuntimeError(f"training diverged: loss {metrics['train_loss']}")
    return metrics, used_ids
