"""distill: each enabled method turns the round's stored experience into training signal.

The methods (methods/, named by `distill.methods`) read what they need while the store is
open, then work with it closed (a method may generate with the champion); everything they
contribute (examples, their own tables, their per-round figures) is written in one transaction.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config
from rsiflow.envs.rollout import prompt_setup
from rsiflow.methods import DistillContext, enabled_methods
from rsiflow.tasks.common import open_store, play, trajectories_with_turns, utcnow


@task(name="distill", cache_policy=NONE)
def distill_examples(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    prefix, tools = prompt_setup(cfg)
    methods = enabled_methods(cfg)
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        ctx = DistillContext(cfg=cfg, round=round_no, champion=champion, champion_path=store.model_path(champion),
                             trajectories=trajectories_with_turns(store, run_id, round_no, "generate", prefix, tools),
                             prefix=prefix, tools=tools, play=play)
        inputs = {m.name: m.read(store, ctx) for m in methods}
    contributions = {m.name: m.distill(ctx, inputs[m.name]) for m in methods}
    with open_store(cfg) as store, store.step(run_id, round_no, "distill", started) as tx:
        for m in methods:
            c = contributions[m.name]
            unknown = set(c.tables) - set(m.tables)
            if unknown:
                raise ValueError(f"method {m.name!r} wrote tables it does not declare in `tables`: {sorted(unknown)}")
            tx.insert("examples", [{**e, "method": e.get("method", m.name)} for e in c.examples])
            for table, rows in c.tables.items():
                tx.insert(table, rows)
        tx.metrics({name: c.metrics for name, c in contributions.items()})
    counts = {name: len(c.examples) for name, c in contributions.items()}
    get_run_logger().info("round %d distill: %d training examples from %d trajectories (%s)", round_no,
                          sum(counts.values()), len(ctx.trajectories),
                          ", ".join(f"{name} {n}" for name, n in counts.items()))
    return {"examples": counts, "metrics": {name: c.metrics for name, c in contributions.items()}}
