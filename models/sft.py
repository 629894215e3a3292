"""Weighted SFT of a candidate with TRL's `SFTTrainer`; loss on the assistant (action) tokens only.

SmolLM2's chat template has no `{% generation %}` markers, so TRL's `assistant_only_loss` can't
find assistant spans: we tokenize conversations ourselves and mask labels. Each assistant span
is the tokens between the rendered prefix with a generation prompt and the rendered prefix that
includes the message: the action text plus the end-of-turn token, exactly what the backend
sampled (and the stop that ended it). Examples carry a `weight`; `WeightedSFTTrainer` scales each
example's token losses by it (all-ones weights fall through to TRL's own loss).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from models.loading import load_model_and_tokenizer, save_checkpoint


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer, messages: list[dict], train_from: int = 0) -> dict[str, list[int]]:
    """input_ids of the whole conversation; labels = input_ids on the spans of assistant messages at
    index >= `train_from` (earlier ones, e.g. few-shot demonstrations, are prompt), -100 elsewhere."""
    full = _render(tokenizer, messages, generation_prompt=False)
    labels = [-100] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        prompt = _render(tokenizer, messages[:i], generation_prompt=True)
        start, end = len(prompt), len(_render(tokenizer, messages[: i + 1], generation_prompt=False))
        if full[:start] != prompt or end > len(full):
            raise ValueError(f"chat template is not prefix-stable at message {i}: can't locate the assistant span")
        labels[start:end] = full[start:end]
    return {"input_ids": full, "labels": labels}


def sft_rows(tokenizer, examples: list[dict], max_length: int) -> tuple[list[dict], int]:
    """examples: dicts with example_id, messages, weight and optionally train_from.
    Returns (tokenized rows, n_dropped_too_long)."""
    rows, dropped = [], 0
    for ex in examples:
        tok = tokenize_conversation(tokenizer, ex["messages"], int(ex.get("train_from") or 0))
        if len(tok["input_ids"]) > max_length:
            dropped += 1
            continue
        rows.append({**tok, "weight": float(ex.get("weight", 1.0)), "example_id": ex.get("example_id")})
    return rows, dropped


def build_sft_dataset(tokenizer, examples: list[dict], max_length: int):
    """examples: dicts with example_id, messages, weight and optionally train_from.
    Returns (datasets.Dataset, n_dropped_too_long)."""
    from datasets import Dataset

    rows, dropped = sft_rows(tokenizer, examples, max_length)
    return Dataset.from_list(rows), dropped


class _WeightCollator(DataCollatorForLanguageModeling):
    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().torch_call(examples)
        out["weights"] = torch.tensor([float(e.get("weight", 1.0)) for e in examples])
        return out


class WeightedSFTTrainer(SFTTrainer):
    """SFTTrainer whose loss scales each example's token losses by its `weight` column."""

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "weight" not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, "weight"]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        weights = inputs.pop("weights", None)
        if weights is None or bool(torch.all(weights == 1.0)):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs["labels"]
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"), use_cache=False)
        logits = outputs.logits[:, :-1].float()
        targets = labels[:, 1:]
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="none"
        ).view(targets.shape)
        mask = (targets != -100).float()
        weighted = (token_loss * mask * weights.to(token_loss.dtype)[:, None]).sum()
        denom = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1)
        loss = weighted / torch.as_tensor(denom, dtype=weighted.dtype).clamp(min=1)
        return (loss, outputs) if return_outputs else loss


class _ProgressCallback(TrainerCallback):
    def __init__(self, on_step):
        self.on_step = on_step

    def on_step_end(self, args, state, control, **kwargs):
        self.on_step(state.global_step, state.max_steps)


def train_sft(
    model_path: str | Path,
    examples: list[dict],
    out_dir: str | Path,
    cfg,  # configs.schema.TrainConfig
    seed: int = 0,
    dtype: str = "float32",
    on_step=None,
    distill_examples: list[dict] | None = None,
    distill=None,  # models.distill.DistillLoss
) -> tuple[dict[str, Any], list]:
    """Train a candidate from `model_path` on `examples` (weighted SFT) and, with `distill_examples`,
    the privileged-teacher distillation term (models/distill.py) in the same loss; save a full
    checkpoint to `out_dir`.

    Returns (metrics, ids of the examples trained on): examples used/dropped, trained tokens,
    steps, first/last/mean train loss, and for distillation the examples used, misaligned or too
    long (dropped), distilled tokens and the distillation loss (first/last/mean over steps).
    With no usable examples the candidate is a copy of the parent.
    """
    from datasets import Dataset

    model, tokenizer = load_model_and_tokenizer(model_path, dtype=dtype)
    rows, dropped = sft_rows(tokenizer, examples, cfg.max_length)
    metrics: dict[str, Any] = {"examples": len(rows), "dropped_too_long": dropped, "steps": 0,
                               "trained_tokens": int(sum(sum(lab != -100 for lab in r["labels"]) for r in rows)),
                               "train_loss": None}
    distill_rows: list[dict] = []
    if distill_examples:
        from models.distill import DistillLoss, build_distill_rows

        distill = distill or DistillLoss()
        distill_rows, counts = build_distill_rows(tokenizer, distill_examples, cfg.max_length)
        metrics.update(distill_examples=len(distill_rows), distill_misaligned=counts["misaligned"],
                       distill_too_long=counts["too_long"], distill_sampled_match=counts["sampled_match"],
                       distill_tokens=int(sum(len(r["student_pos"]) for r in distill_rows)))
        for r in rows:  # one schema for the mixed dataset
            r.update(teacher_input_ids=[], student_pos=[], teacher_pos=[], sampled_logprobs=[], kind=0)
    all_rows = rows + distill_rows
    if not all_rows:
        save_checkpoint(model, tokenizer, out_dir)
        return metrics, []
    dataset = Dataset.from_list(all_rows)
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
    common = dict(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                  peft_config=peft_config, callbacks=[_ProgressCallback(on_step)] if on_step else None)
    if distill_rows:
        from models.distill import DistillCollator, PrivilegedDistillTrainer

        trainer = PrivilegedDistillTrainer(**common, data_collator=DistillCollator(pad_token_id=tokenizer.pad_token_id),
                                           distill=distill)
    else:
        trainer = WeightedSFTTrainer(**common, data_collator=_WeightCollator(pad_token_id=tokenizer.pad_token_id))
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trained = trainer.model
    if cfg.lora.enabled:
        trained = trained.merge_and_unload()
    trained.eval()
    save_checkpoint(trained, tokenizer, out_dir)
    metrics.update(steps=int(result.global_step), train_loss=float(result.training_loss),
                   first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None)
    if distill_rows:
        dl = [h["distill_loss"] for h in trainer.distill_log]
        metrics.update(distill_loss_first=dl[0] if dl else None, distill_loss_last=dl[-1] if dl else None,
                       distill_loss_mean=sum(dl) / len(dl) if dl else None,
                       is_weight_mean=(sum(h["is_weight_mean"] for h in trainer.distill_log) / len(dl)) if dl else None,
                       distill_loss_weight=distill.loss_weight, ema_teacher=distill.ema_rate > 0)
    if metrics["train_loss"] is not None and not math.isfinite(metrics["train_loss"]):
        raise RuntimeError(f"training diverged: loss {metrics['train_loss']}")
    return metrics, used_ids
