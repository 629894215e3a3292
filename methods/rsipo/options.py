"""`distill.rsipo`: RSIPO's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rsiflow.configs.section import Section


class RsipoOptions(Section):
    """RSIPO: skills written by the policy, checked by replay, trusted by empirical Bayes, kept in a library
    (docs/methods.md, RSIPO)."""

    skill_writer: Literal["policy", "template"] = Field(
        "policy",
        description="Who writes each task's skill. policy: the champion summarises the group's best rollout into a "
        "short general procedure (RSIPO). template: the canonical actions of a successful rollout of the group (else "
        "of the env's expert solution) rendered as steps, for models too small to write usable skills; a named "
        "writer, logged and recorded with every skill, never a silent fallback.")
    replays: int = Field(4, ge=2, le=1024, description="M: rollouts of the same task from the same seed with the skill "
        "in the task message, per skill tested (at least 2: the gain's noise variance needs a sample variance). "
        "Replays cost M/G times the round's rollouts per skill tested.")
    skill_max_tokens: int = Field(96, ge=8, le=8192, description="Most tokens of a skill written by the policy "
        "(sampled at backend.temperature / top_p, so its tokens can be trained by the skill-evolution term).")
    skill_max_chars: int = Field(600, ge=40, description="A skill is cut to this many characters (at a line end).")
    library_candidates: int = Field(1, ge=0, description="Skills of the task's type retrieved from the library per "
        "task (lexical match with the task text) and re-tested by replay beside the new skill; 0 = no re-tests.")
    retire_after: int = Field(2, ge=1, description="A library skill is retired once this many of its latest tests in "
        "a row have a shrunk gain <= 0 (2: its first test and one re-test).")
    trust_scale: float = Field(0.5, gt=0.0, description="c of the trust weight w = clip(shrunk gain / c, 0, 1) "
        "(ours: a skill that raises the task's reward by c or more is fully trusted).")
    loss_weight: float = Field(0.01, ge=0.0, description="λ of the trust-weighted distillation: L = L_GRPO + λ · "
        "Σ_rows w · mean_t D / rows (the trainer SRD uses; its divergence settings are distill.srd's; the rows' sum "
        "is divided by their count, not by their weights, so low trust means a smaller term).")
    distill_trajectories: int | None = Field(None, ge=1, description="Most student rollouts per task scored with the "
        "task's selected skill in the teacher's prompt; null = all of the group's.")
    evolution: bool = Field(True, description="Skill evolution: the policy's skill-writing tokens trained as "
        "policy-gradient rows of the GRPO loss with the type-centred gain as advantage (policy writer only).")
    assess_tasks: int = Field(0, ge=0, description="Inference with a skill: the gate step also plays the trained "
        "candidate on its first assess_tasks held-out tasks both ways, bare and with the library's best active skill "
        "of the task's type in the task message (greedy, gate.seed), and records both successes and which way did "
        "better (rounds.metrics.rsipo.assess_*); the promotion decision stays on the bare prompt. 0 = off.")
