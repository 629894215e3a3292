"""ExIt (expert iteration, rejection-sampling SFT): the round's successful trajectories become SFT rows."""

from __future__ import annotations

from methods.exit import exit_examples
from tasks.methods.base import Contribution, DistillContext, Method


class ExIt(Method):
    name = "exit"

    def distill(self, ctx: DistillContext, inputs) -> Contribution:
        c = self.cfg.distill.exit
        exs = exit_examples(ctx.trajectories, c.min_reward, c.dedupe)
        rows = [{"example_id": e.example_id, "method": e.method, "source_traj_id": e.source_traj_id,
                 "messages": e.messages, "weight": e.weight,
                 "meta": {**e.meta, **({"tools": ctx.tools} if ctx.tools else {})}} for e in exs]
        return Contribution(examples=rows, metrics={"examples": len(rows)})
