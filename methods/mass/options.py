"""`distill.mass`: MASS's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rsiflow.configs.section import Section


class MassOptions(Section):
    """MASS: the model searches a multi-agent workflow, judges its own outputs pairwise, ranks them (Bradley-
    Terry) and is fine-tuned to answer alone as the workflow did (docs/methods.md, MASS)."""

    judge: Literal["self", "oracle"] = Field(
        "self", description="Who judges pairs of outputs in the workflow search and the teacher tournament. self: "
        "the champion itself, both orders (MASS). oracle: the env's verifier (solved beats unsolved), a named option "
        "that tests the pipeline where a small model's judgement is near chance; an error on an env without a "
        "verifier. The per-round win rate against the base is judged by the model either way.")
    proposer: Literal["model", "mutation"] = Field(
        "model", description="Who proposes workflow versions v1..vN. model: the champion, from the history of "
        "verdicts, rationales and diffs (a reply that is not a valid spec is replaced by a mutation, recorded as "
        "'mutation-after-invalid-proposal'). mutation: the structured operator (add / remove / reorder a hop, change "
        "a contract), for models too small to propose edits; recorded as such.")
    teacher: Literal["workflow", "single_agent"] = Field(
        "workflow", description="Who plays the teacher episodes. workflow: the retained workflow (MASS; no "
        "examples when no version beat the reference). single_agent: the bare task, no search: the control "
        "student, ranked and selected the same way (compare the two as arms of bench.compare with the same "
        "max_train_tokens).")
    versions: int = Field(4, ge=1, le=64, description="Workflow versions v0..v(N) searched per round (v0: the "
        "previous round's retained workflow, else a planner -> solver seed; the paper: 12).")
    search_tasks: int = Field(4, ge=1, le=1000, description="Tasks of the round (its first ones) every version and "
        "the reference play in the search (greedy).")
    teacher_tasks: int | None = Field(None, ge=1, le=100_000, description="Tasks of the round with teacher "
        "episodes; null = all of the round's tasks.")
    episodes_per_task: int = Field(6, ge=2, le=256, description="K: teacher episodes per task with the retained "
        "workflow (the paper: 18).")
    opponents: int = Field(2, ge=1, le=255, description="m: others each teacher episode is judged against in the "
        "ring tournament (the paper: 6); below episodes_per_task, even when episodes_per_task is odd.")
    train_top: int = Field(1, ge=1, description="Best-ranked teacher episodes per task that become training "
        "examples.")
    val_next: int = Field(1, ge=0, description="The next-ranked episodes per task that become validation examples "
        "(the trainer keeps the checkpoint with the lowest validation loss); 0 = none.")
    max_train_tokens: int | None = Field(None, ge=1, description="Budget of answer tokens in the training examples: "
        "examples are taken rank by rank (every task's first, then second, ...) until it is spent; null = no budget. "
        "Give the workflow and single_agent arms the same budget to train on as many tokens.")
    margin: float = Field(0.0, ge=0.0, lt=0.5, description="A version beats another when its mean combined judge "
        "score against it exceeds 0.5 + margin (ties count 1/2).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the teacher episodes (the search "
        "is greedy).")
    hop_max_tokens: int = Field(48, ge=4, le=8192, description="Most tokens of a helper hop's output (the solver's "
        "answer gets backend.max_new_tokens).")
    judge_max_tokens: int = Field(32, ge=1, le=8192, description="Most tokens of a judge's reply (verdict and "
        "rationale); greedy.")
    proposal_max_tokens: int = Field(192, ge=16, le=8192, description="Most tokens of the model's proposed spec.")
    assess_tasks: int = Field(24, ge=0, le=100_000, description="Held-out tasks (the gate's first ones) on which the "
        "gate step compares the trained candidate with the base, greedy, judged by the candidate (and by the "
        "verifier where the env has one); 0 = no comparison.")

    @model_validator(mode="after")
    def _ring_fits(self) -> MassOptions:
        if self.opponents >= self.episodes_per_task:
            raise ValueError(f"distill.mass.opponents ({self.opponents}) must be below distill.mass.episodes_per_task "
                             f"({self.episodes_per_task}): each episode is judged against that many others")
        if self.opponents % 2 and self.episodes_per_task % 2:
            raise ValueError(f"distill.mass.opponents ({self.opponents}) is odd: distill.mass.episodes_per_task "
                             f"({self.episodes_per_task}) must then be even (the ring's opposite pairs)")
        if self.train_top + self.val_next > self.episodes_per_task:
            raise ValueError(f"distill.mass.train_top + val_next ({self.train_top + self.val_next}) exceeds "
                             f"distill.mass.episodes_per_task ({self.episodes_per_task})")
        return self
