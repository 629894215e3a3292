"""ExIt (expert iteration, rejection-sampling SFT): the round's successful trajectories become SFT rows, through
distill.exit's data filters (algorithm.py `select_examples`; its distill metrics count what each dropped)."""

from __future__ import annotations

from rsiflow.configs.schema import ConfigError
from rsiflow.methods.base import Contribution, DistillContext, Method
from rsiflow.methods.exit.algorithm import select_examples
from rsiflow.methods.exit.options import ExitOptions


def _trains_something(row: dict) -> bool:
    """Whether an SFT example row labels at least one assistant message (from meta.train_from on, not untrained)."""
    skip = set(row["meta"].get("untrained") or ())
    return any(m["role"] == "assistant" and i not in skip
               for i, m in enumerate(row["messages"]) if i >= row["meta"].get("train_from", 0))


class ExIt(Method):
    name = "exit"
    Options = ExitOptions
    replayable = True   # verified successes: their SFT rows stay valid in later rounds (train.replay)

    def distill(self, ctx: DistillContext, inputs) -> Contribution:
        c = self.cfg.distill.exit
        sel = select_examples(ctx.trajectories, c.min_reward, c.dedupe, valid_turns_only=c.valid_turns_only,
                              groups=c.groups, max_per_type=c.max_per_type)
        rows = [{"example_id": e.example_id, "method": e.method, "source_traj_id": e.source_traj_id,
                 "messages": e.messages, "weight": e.weight,
                 "meta": {**e.meta, **({"tools": ctx.tools} if ctx.tools else {})}} for e in sel.examples]
        if self.cfg.distill.xtree.token_weights:  # per-action weights, written on the trajectories by X-Tree's distill
            from rsiflow.methods.xtree.method import split_by_turn_weights

            weights = {t["traj_id"]: t["xtree_turn_weights"] for t in ctx.trajectories if "xtree_turn_weights" in t}
            if rows and not weights:
                raise ConfigError("distill.xtree.token_weights is on but no X-Tree weights reached ExIt: list xtree "
                                  f"before exit in distill.methods (now {self.cfg.distill.methods})")
            # a span keeps the example's meta.untrained (absolute message indices: the span's messages are a prefix
            # of the example's); a span whose turns are all untrained trains nothing and is left out
            rows = [s for r in rows for s in split_by_turn_weights(r, weights[r["source_traj_id"]])
                    if _trains_something(s)]
        return Contribution(examples=rows, metrics={"examples": len(rows), **sel.counts})
