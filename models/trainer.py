"""The one trainer: a candidate trained from its parent with TRL's `SFTTrainer` on training rows of
every kind a method emits (models/encoding.py): weighted SFT rows and privileged-teacher
distillation rows, in the same batches and one loss:

    L = L_SFT + λ · Σ_e w_e · mean_t(IS_t · D_t) / Σ_e w_e

L_SFT is `losses.weighted_token_ce` (used whatever the weights, all 1 or not); D_t is
`losses.topk_divergence` between the teacher (the policy itself, current weights or an EMA copy,
with privileged text in its prompt) and the student (the same policy without it), both scoring the
student's own completion tokens; IS_t is `losses.importance_weights`. The student forward pass is
shared by both terms; the teacher's is a no-grad pass on the teacher encoding.

Gradient accumulation: the SFT term is normalised by the labelled tokens of the whole accumulated
step (the Trainer's `num_items_in_batch`), the distillation term is divided by the number of
micro-batches, so neither grows with `grad_accum` (`loss_is_scaled_for_ga`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from models.encoding import KINDS, encode_rows
from models.loading import load_model_and_tokenizer, save_checkpoint
from models.losses import importance_weights, topk_divergence, weighted_token_ce

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
                   sampled_logprobs=slp, kind=torch.tensor([int(e.get("kind", 0)) for e in examples]))
        return out


_ROW_COLUMNS = ("weight", "teacher_input_ids", "student_pos", "teacher_pos", "sampled_logprobs", "kind")
_BATCH_EXTRAS = ("weights", "teacher_input_ids", "teacher_attention_mask", "student_pos", "teacher_pos",
                 "sampled_logprobs", "kind")


class EmaTeacherCallback(TrainerCallback):
    """θ̄ ← (1 - rate)·θ̄ + rate·θ after each optimizer step."""

    def __init__(self, teacher: torch.nn.Module, rate: float):
        self.teacher, self.rate = teacher, rate

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p_t, p in zip(self.teacher.parameters(), model.parameters()):
                p_t.mul_(1.0 - self.rate).add_(p.detach().to(p_t.dtype), alpha=self.rate)


class RoundTrainer(SFTTrainer):
    """SFTTrainer whose loss is the module docstring's L, on batches that mix SFT and distillation rows."""

    loss_is_scaled_for_ga = True  # compute_loss scales both terms for gradient accumulation itself

    def __init__(self, *args, distill: DistillLoss | None = None, **kwargs):
        self.distill = distill or DistillLoss()
        self.distill_log: list[dict[str, float]] = []
        super().__init__(*args, **kwargs)
        self.ema_teacher = None
        has_distill = DISTILL in set(self.train_dataset["kind"]) if self.train_dataset is not None else False
        if has_distill and self.distill.ema_rate > 0:
            self.ema_teacher = copy.deepcopy(self.model).requires_grad_(False).eval()
            self.add_callback(EmaTeacherCallback(self.ema_teacher, self.distill.ema_rate))

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = [*self._signature_columns,
                                   *(c for c in _ROW_COLUMNS if c not in self._signature_columns)]

    def _micro_batches(self) -> int:
        """Micro-batches per optimizer step (the Trainer sets the current count inside its loop)."""
        return int(getattr(self, "current_gradient_accumulation_steps", None) or self.args.gradient_accumulation_steps)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        extra = {k: inputs.pop(k) for k in _BATCH_EXTRAS if k in inputs}
        n = inputs["input_ids"].shape[0]
        weights = extra.get("weights", torch.ones(n))
        kind = extra.get("kind", torch.zeros(n, dtype=torch.long))
        micro = self._micro_batches()
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False)
        logits = outputs.logits
        labels = inputs["labels"]
        loss = logits.new_zeros(())
        sft_loss = None
        if bool((labels[:, 1:] != -100).any()):
            # With num_items_in_batch the sum is already normalised over the whole accumulated step.
            sft_loss = weighted_token_ce(logits, labels, weights, num_items_in_batch)
            loss = loss + (sft_loss if num_items_in_batch is not None else sft_loss / micro)
        rows = (kind == DISTILL).nonzero().flatten()
        if len(rows):
            distill_loss, stats = self._distill_term(model, logits, inputs["input_ids"], weights, rows, extra)
            loss = loss + self.distill.loss_weight * distill_loss / micro
            self.distill_log.append({"distill_loss": float(distill_loss.detach()),
                                     "sft_loss": float(sft_loss.detach()) if sft_loss is not None else math.nan,
                                     **stats})
        return (loss, outputs) if return_outputs else loss

    def _distill_term(self, model, logits, input_ids, weights, rows, extra) -> tuple[torch.Tensor, dict]:
        """Σ_e w_e · mean_t(IS_t · D_t) / Σ_e w_e over the batch's distillation rows."""
        d = self.distill
        teacher = self.ema_teacher if self.ema_teacher is not None else model
        with torch.no_grad():
            t_logits = teacher(input_ids=extra["teacher_input_ids"][rows],
                               attention_mask=extra["teacher_attention_mask"][rows], use_cache=False).logits
        per_example, w_sum, tokens, is_sum = [], 0.0, 0.0, 0.0
        for j, r in enumerate(rows.tolist()):
            keep = extra["student_pos"][r] >= 0
            sp, tp = extra["student_pos"][r][keep], extra["teacher_pos"][r][keep]
            s_logits = logits[r, sp - 1]
            div = topk_divergence(t_logits[j, tp - 1], s_logits, d.top_k, d.divergence, d.beta)
            logp_now = torch.log_softmax(s_logits.float(), -1).gather(-1, input_ids[r, sp][:, None]).squeeze(-1)
            isw = importance_weights(logp_now, extra["sampled_logprobs"][r][keep].to(logp_now.device), d.is_clip)
            per_example.append(weights[r].to(div.dtype) * (isw * div).mean())
            w_sum += float(weights[r])
            tokens += float(len(sp))
            is_sum += float(isw.mean())
        term = torch.stack(per_example).sum() / max(w_sum, 1e-8)
        return term, {"distill_rows": float(len(rows)), "distill_tokens": tokens, "is_weight_mean": is_sum / len(rows)}


class _ProgressCallback(TrainerCallback):
    def __init__(self, on_step):
        self.on_step = on_step

    def on_step_end(self, args, state, control, **kwargs):
        self.on_step(state.global_step, state.max_steps)


def train_candidate(
    model_path: str | Path,
    rows: list[dict],
    out_dir: str | Path,
    cfg,  # configs.schema.TrainConfig
    seed: int = 0,
    dtype: str = "float32",
    on_step=None,
    distill: DistillLoss | None = None,
    trust_remote_code: bool = False,
) -> tuple[dict[str, Any], list]:
    """Train a candidate from `model_path` on training rows (models/encoding.py: kind "sft" or
    "distill") and save a full checkpoint (LoRA merged) to `out_dir`.

    Returns (metrics, ids of the rows trained on). Metrics: SFT rows used (`examples`) and dropped
    (`dropped_too_long`), trained tokens, steps, first/last/mean train loss; with distillation rows,
    those used, misaligned or too long (dropped), distilled tokens, the distillation loss
    (first/last/mean over steps), the mean IS weight, λ and whether the teacher was an EMA copy.
    With no usable rows the candidate is a copy of the parent.
    """
    from datasets import Dataset

    model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
    encoded, counts = encode_rows(tokenizer, rows, cfg.max_length)
    sft = [r for r in encoded if r["kind"] != DISTILL]
    dis = [r for r in encoded if r["kind"] == DISTILL]
    distill = distill or DistillLoss()
    metrics: dict[str, Any] = {"examples": len(sft), "dropped_too_long": counts["sft_too_long"], "steps": 0,
                               "trained_tokens": int(sum(sum(lab != -100 for lab in r["labels"]) for r in sft)),
                               "train_loss": None}
    if any(r.get("kind") == "distill" for r in rows):
        metrics.update(distill_examples=len(dis), distill_misaligned=counts["misaligned"],
                       distill_too_long=counts["distill_too_long"], distill_sampled_match=counts["sampled_match"],
                       distill_tokens=int(sum(len(r["student_pos"]) for r in dis)))
    if not encoded:
        save_checkpoint(model, tokenizer, out_dir)
        return metrics, []
    dataset = Dataset.from_list(encoded)
    used_ids = list(dataset["example_id"])
    use_cpu = not torch.cuda.is_available()
    args = SFTConfig(
        output_dir=str(Path(out_dir).parent / (Path(out_dir).name + ".trainer")),
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        max_length=None,  # rows were length-checked above; TRL must not truncate one side of a pair
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of total steps
        lr_scheduler_type=cfg.lr_scheduler,
        seed=seed,
        use_cpu=use_cpu,
        bf16=(dtype == "bfloat16") and not use_cpu,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig

        peft_config = PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                     target_modules="all-linear", task_type="CAUSAL_LM")
    model.train()
    trainer = RoundTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                           peft_config=peft_config, callbacks=[_ProgressCallback(on_step)] if on_step else None,
                           data_collator=RowCollator(pad_token_id=tokenizer.pad_token_id), distill=distill)
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trained = trainer.model
    if cfg.lora.enabled:
        trained = trained.merge_and_unload()
    trained.eval()
    save_checkpoint(trained, tokenizer, out_dir)
    metrics.update(steps=int(result.global_step), train_loss=float(result.training_loss),
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None)
    if dis:
        dl = [h["distill_loss"] for h in trainer.distill_log]
        metrics.update(distill_loss_first=dl[0] if dl else None, distill_loss_last=dl[-1] if dl else None,
                       distill_loss_mean=sum(dl) / len(dl) if dl else None,
                       is_weight_mean=(sum(h["is_weight_mean"] for h in trainer.distill_log) / len(dl)) if dl else None,
                       distill_loss_weight=distill.loss_weight, ema_teacher=distill.ema_rate > 0)
    if not math.isfinite(metrics["train_loss"]):
        raise RuntimeError(f"training diverged: loss {metrics['train_loss']}")
    return metrics, used_ids
