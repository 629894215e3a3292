"""`distill.srd`: SRD's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rsiflow.configs.section import Section


class SrdOptions(Section):
    """SRD: Self-Retrospection Distillation (docs/methods.md, SRD)."""

    note_writer: Literal["policy", "template"] = Field(
        "policy",
        description="Who writes the hindsight notes. policy: the champion itself (SRD). template: notes assembled from "
        "the env's hindsight() facts and feedback, for models too small to write usable notes; a named backend, "
        "logged and recorded with every note, never a silent fallback.",
    )
    pitfall: bool = Field(True, description="Write pitfall notes (Error / Rule / Example) from failed trajectories.")
    knowledge: bool = Field(False, description="Also write knowledge notes (Knowledge / Rule + Details) from "
        "successful trajectories.")
    notes_per_group: int = Field(2, ge=1, description="Most failed (or successful) trajectories per group that get a "
        "note.")
    note_max_tokens: int = Field(96, ge=8, le=8192, description="Most tokens of one note written by the policy.")
    note_temperature: float = Field(0.7, ge=0.0, description="Sampling temperature of the policy's notes.")
    foresight_samples: int = Field(1, ge=1, description="Foresight samples z the student draws per group with notes.")
    foresight_max_tokens: int = Field(64, ge=8, le=8192, description="Most tokens of one foresight sample z.")
    foresight_temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the student's foresight.")
    action_channel: bool = Field(
        False,
        description="(ours) Also distill the teacher's hindsight into the episode's own action tokens: the teacher "
        "sees the group's notes in the episode's task message, the student does not; scored on the student's actions.",
    )
    action_trajectories: int = Field(2, ge=1, description="Most trajectories per group scored by the action channel.")
    loss_weight: float = Field(0.01, ge=0.0, description="λ, the weight of the SRD loss: L = L_base + λ · D (the "
        "paper: 0.01).")
    divergence: Literal["jsd", "forward_kl", "reverse_kl"] = Field(
        "jsd", description="D(teacher ‖ student) per token: generalized JSD (with beta), forward KL(T‖S) or "
        "reverse KL(S‖T).")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="Generalized JSD mixture weight of the teacher (0.5 = "
        "symmetric JSD).")
    top_k: int = Field(100, ge=1, description="Divergence over the teacher's top-k tokens plus one bucket for the "
        "rest of the mass.")
    is_clip: float | None = Field(2.0, gt=0.0, description="Per-token importance weight min(exp(logp_now - "
        "logp_sampled), clip), detached; null = off.")
    ema_rate: float = Field(0.05, ge=0.0, le=1.0, description="EMA teacher: θ̄ ← (1 - rate) θ̄ + rate θ after each "
        "step; 0 = the teacher is the current weights.")
