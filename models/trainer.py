"""Training a candidate: `train_candidate` trains from the champion on the rows of every kind a method emits
(models/encoding.py) and saves it. Without policy-gradient rows it trains with models/sft_trainer.py's
`RoundTrainer` (weighted SFT plus every method's distillation term); with them, with models/grpo_trainer.py's
`StoredRolloutGRPOTrainer` (TRL's GRPO loss on the stored rollouts, the other rows riding along). Batches are built
by models/collate.py, the callbacks are models/callbacks.py's, and the learning diagnostic (how the trained
tokens' logprobs moved) is models/trained_tokens.py's. Under `accelerate launch` (models/launch.py) every process
runs this function; rank 0 alone saves the candidate.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from trl import SFTConfig

from rsiflow.models import threads
from rsiflow.models.callbacks import (
    BestValidationCallback,
    InterruptCallback,
    ProgressCallback,
    ThreadShareCallback,
    log_to,
)
from rsiflow.models.collate import RowCollator, encode_pg_rows
from rsiflow.models.encoding import encode_rows
from rsiflow.models.grpo_trainer import PolicyLoss, StoredRolloutGRPOTrainer, grpo_args
from rsiflow.models.loading import load_model_and_tokenizer, save_checkpoint
from rsiflow.models.sft_trainer import DDP_BROADCAST_BUFFERS, DISTILL, DistillLoss, RoundTrainer
from rsiflow.models.trained_tokens import logprob_change, trained_sequences, trained_token_logprobs


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
    callbacks = [InterruptCallback(), ThreadShareCallback()] + ([ProgressCallback(on_step)] if on_step else [])
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
    log_to(trainer, log_dir)
    # the learning diagnostic (logprob_change): one process only; under accelerate launch it is skipped
    diagnose = trainer.accelerator.num_processes == 1
    if diagnose:
        groups, seqs = trained_sequences(sft, pg)
        before = trained_token_logprobs(trainer.model, seqs, tokenizer.pad_token_id, cfg.batch_size)
    with threads.computing():  # this process's share of the cores, re-counted every step (models/threads.py)
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
