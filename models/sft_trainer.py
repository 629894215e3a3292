"""The SFT and distillation trainer: without policy-gradient rows, models/trainer.py trains with TRL's
`SFTTrainer` (`RoundTrainer`) on weighted SFT rows and privileged-teacher distillation rows
(models/encoding.py), in the same batches and one loss:

    L = L_SFT + λ · Σ_e w_e · mean_t(IS_t · D_t) / Σ_e w_e     (or / the row count: DistillLoss.normalise)

L_SFT is `losses.weighted_token_ce` (used whatever the weights, all 1 or not); D_t is
`losses.topk_divergence` between the teacher (the policy itself, current weights or an EMA copy,
with privileged text in its prompt) and the student (the same policy without it), both scoring the
student's own completion tokens; IS_t is `losses.importance_weights`. The student forward pass is
shared by both terms; the teacher's is a no-grad pass on the teacher encoding.

Gradient accumulation: the SFT term is normalised by the labelled tokens of the whole accumulated
step (the Trainer's `num_items_in_batch`), the distillation term is divided by the number of
micro-batches, so neither grows with `grad_accum` (`loss_is_scaled_for_ga`).

`RowLoss` computes this loss on any batch of such rows: `RoundTrainer` trains on it, and the GRPO trainer
(models/grpo_trainer.py) adds it for the rows that ride along with policy-gradient rows. Several methods' terms
(SRD's, RSIPO's, ...) are each their own `DistillLoss`, summed, each normalised over its own rows.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast
from trl import SFTTrainer

from rsiflow.models.callbacks import EmaTeacherCallback
from rsiflow.models.collate import BATCH_EXTRAS, ROW_COLUMNS
from rsiflow.models.encoding import KINDS
from rsiflow.models.losses import importance_weights, topk_divergence, weighted_token_ce
from rsiflow.models.shared_prefix import shared_prefix_logits

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
        extra = {k: inputs.pop(k) for k in BATCH_EXTRAS if k in inputs}
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
                                   *(c for c in ROW_COLUMNS if c not in self._signature_columns)]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = self._rows_loss(model, inputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


# Under DDP (accelerate launch) a process runs as many forward passes as its rows need (teacher passes of
# distillation rows, the aux rows of a GRPO micro-batch), not as many as the others: DDP's per-forward buffer
# broadcast (a collective) would then wait forever. The causal LMs' buffers (rotary tables) are constants, so
# they are not broadcast; the gradients are still all-reduced once per backward.
DDP_BROADCAST_BUFFERS = False
