"""ExIt (expert iteration, rejection-sampling SFT): the round's successful trajectories become SFT rows, through
distill.exit's data filters (algorithm.py `select_examples`; its distill metrics count what each dropped)."""

from __future__ import annotations

from rsiflow.methods.base import TURN_WEIGHTS, Contribution, DistillContext, Key, Method
from rsiflow.methods.exit.algorithm import select_examples, weight_runs
from rsiflow.methods.exit.options import ExitOptions


def _trains_something(row: dict) -> bool:
    """Whether an SFT example row labels at least one assistant message (from meta.train_from on, not untrained)."""
    skip = set(row["meta"].get("untrained") or ())
    return any(m["role"] == "assistant" and i not in skip
               for i, m in enumerate(row["messages"]) if i >= row["meta"].get("train_from", 0))


def split_by_turn_weights(row: dict, weights: list[float]) -> list[dict]:
    """An SFT example row (messages = prompt prefix + user/assistant turns, meta.train_from = where the turns
    start) as one row per run of equal turn weight: turns [s, e) keep the conversation up to turn e, are
    labelled from turn s on, and weigh w. One run: the row itself, reweighted. The same per-token loss as one
    row with per-action weights (a causal LM's action tokens see only the turns before them)."""
    start = row["meta"]["train_from"]
    runs = weight_runs(weights)
    if len(runs) == 1:
        return [{**row, "weight": row["weight"] * runs[0][2], "meta": {**row["meta"], "xtree_weight": runs[0][2]}}]
    return [{**row, "example_id": f"{row['example_id']}/t{s}-{e}", "messages": row["messages"][:start + 2 * e],
             "weight": row["weight"] * w,
             "meta": {**row["meta"], "train_from": start + 2 * s, "turns": [s, e], "xtree_weight": w}}
            for s, e, w in runs]


class ExIt(Method):
    name = "exit"
    Options = ExitOptions
    replayable = True   # verified successes: their SFT rows stay valid in later rounds (train.replay)

    def consumes(self) -> set[Key]:
        return {TURN_WEIGHTS}

    def distill(self, ctx: DistillContext, inputs) -> Contribution:
        c = self.cfg.distill.exit
        sel = select_examples(ctx.trajectories, c.min_reward, c.dedupe, valid_turns_only=c.valid_turns_only,
                              groups=c.groups, max_per_type=c.max_per_type)
        rows = [{"example_id": e.example_id, "method": e.method, "source_traj_id": e.source_traj_id,
                 "messages": e.messages, "weight": e.weight,
                 "meta": {**e.meta, **({"tools": ctx.tools} if ctx.tools else {})}} for e in sel.examples]
        weights = ctx.get(TURN_WEIGHTS)   # per-action weights a method of the round provided (X-Tree's token_weights)
        if weights is not None:
            # a span keeps the example's meta.untrained (absolute message indices: the span's messages are a prefix
            # of the example's); a span whose turns are all untrained trains nothing and is left out
            rows = [s for r in rows for s in split_by_turn_weights(r, weights[r["source_traj_id"]])
                    if _trains_something(s)]
        return Contribution(examples=rows, metrics={"examples": len(rows), **sel.counts})
