"""ExIt (expert iteration, rejection-sampling SFT): the round's successful trajectories become SFT rows."""

from __future__ import annotations

from configs.schema import ConfigError
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
        if self.cfg.distill.xtree.token_weights:  # per-action weights, written on the trajectories by X-Tree's distill
            from tasks.methods.xtree import split_by_turn_weights

            weights = {t["traj_id"]: t["xtree_turn_weights"] for t in ctx.trajectories if "xtree_turn_weights" in t}
            if rows and not weights:
                raise ConfigError("distill.xtree.token_weights is on but no X-Tree weights reached ExIt: list xtree "
                                  f"before exit in distill.methods (now {self.cfg.distill.methods})")
            rows = [s for r in rows for s in split_by_turn_weights(r, weights[r["source_traj_id"]])]
        return Contribution(examples=rows, metrics={"examples": len(rows)})
