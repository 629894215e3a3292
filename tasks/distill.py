"""distill: turn the round's stored experience into training examples (ExIt for now)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config
from methods.exit import exit_examples
from tasks.common import open_store, prefix_messages, trajectories_with_turns, utcnow


@task(name="distill", cache_policy=NONE)
def distill_examples(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    prefix = prefix_messages(cfg)
    counts = {}
    with open_store(cfg) as store:
        trajs = trajectories_with_turns(store, run_id, round, "generate", prefix)
        rows = []
        if "exit" in cfg.distill.methods:
            exs = exit_examples(trajs, cfg.distill.exit.min_reward, cfg.distill.exit.dedupe)
            counts["exit"] = len(exs)
            rows += [{"example_id": e.example_id, "method": e.method, "source_traj_id": e.source_traj_id,
                      "messages": e.messages, "weight": e.weight, "meta": e.meta} for e in exs]
        with store.step(run_id, round, "distill", started) as tx:
            tx.insert("examples", rows)
    get_run_logger().info("round %d distill: %s examples", round, counts)
    return counts
