"""`distill.exit`: ExIt's options (validated by the config when it loads; `Method.Options`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rsiflow.configs.section import Section


class ExitOptions(Section):
    """ExIt: SFT on successful trajectories."""

    min_reward: float = Field(1.0, description="Trajectories with at least this reward (and success) become SFT "
        "examples.")
    dedupe: bool = Field(True, description="Keep one example per distinct action sequence of a task.")
    valid_turns_only: bool = Field(True, description="In a successful trajectory, an action the env did not accept "
        "(its turn's valid flag false, e.g. a first reply without an answer before a corrected one) stays in the "
        "conversation as context but is not trained on (its message index goes to the example's meta.untrained); a "
        "trajectory with no valid action of its own left gives no example. false = train on every action of a "
        "success.")
    groups: Literal["all", "mixed"] = Field("all", description="Which groups (a task's rollouts of the round, one "
        "group_id) give examples. all: every success. mixed: only successes of groups that also have a failure "
        "(tasks at the edge of the model's ability; an all-pass group teaches what the model already does).")
    max_per_type: int | None = Field(None, ge=1, description="Most examples per task type per round (balances the "
        "types; the first ones by traj_id are kept, after the other filters). null = no cap.")
