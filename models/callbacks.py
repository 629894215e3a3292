"""The trainers' callbacks: the EMA teacher's update after each optimizer step, the best validation epoch kept
and restored (MASS's validation rows), progress reports, the stop on an interrupt, and where TensorBoard writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from rsiflow.models import threads
from rsiflow.models.backend import Interrupted, interrupted_since, interrupts
from rsiflow.models.collate import pad
from rsiflow.models.losses import weighted_token_ce


class EmaTeacherCallback(TrainerCallback):
    """θ̄ ← (1 - rate)·θ̄ + rate·θ after each optimizer step."""

    def __init__(self, teacher: torch.nn.Module, rate: float):
        self.teacher, self.rate = teacher, rate

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p_t, p in zip(self.teacher.parameters(), model.parameters()):
                p_t.mul_(1.0 - self.rate).add_(p.detach().to(p_t.dtype), alpha=self.rate)


def log_to(trainer, log_dir: str | Path | None) -> None:
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
            ids = pad([r["input_ids"] for r in batch], self.pad_id).to(device)
            labels = pad([r["labels"] for r in batch], -100).to(device)
            mask = pad([[1] * len(r["input_ids"]) for r in batch], 0).to(device)
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


class ProgressCallback(TrainerCallback):
    def __init__(self, on_step):
        self.on_step = on_step

    def on_step_end(self, args, state, control, **kwargs):
        self.on_step(state.global_step, state.max_steps)


class ThreadShareCallback(TrainerCallback):
    """Before each optimizer step: this process's share of the cores (models/threads.py), which changes when
    another rsiflow process starts or stops computing."""

    def on_step_begin(self, args, state, control, **kwargs):
        threads.refresh()


class InterruptCallback(TrainerCallback):
    """End training with `Interrupted` at the next optimizer step once rsiflow was told to stop after training
    began (Ctrl-C, SIGTERM, a step timeout: models/backend.py's `interrupt_calls_in_flight`)."""

    def __init__(self):
        self.start = interrupts()

    def on_step_end(self, args, state, control, **kwargs):
        if interrupted_since(self.start):
            raise Interrupted(f"training stopped at step {state.global_step} of {state.max_steps}: rsiflow was told "
                              "to stop (Ctrl-C, SIGTERM or a step timeout)")
