"""The GRPO trainer (rows of kind "pg"), used by models/trainer.py when a method emits them.

TRL's `GRPOTrainer` generates its completions inside the training loop; here the completions are the
round's stored episodes, so `StoredRolloutGRPOTrainer` replaces the generation step by the stored rows and
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

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from trl import GRPOConfig, GRPOTrainer

from rsiflow.models.collate import RowCollator, collate_pg
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.mismatch import Correction, correction_weight, mismatch_stats
from rsiflow.models.sft_trainer import DDP_BROADCAST_BUFFERS, RowLoss
from rsiflow.models.shared_prefix import completion_logps


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
