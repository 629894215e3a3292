"""distill: turn the round's stored experience into training signal.

exit: successful trajectories become SFT examples. srd: hindsight notes from the round's
rollouts, and teacher/student foresight pairs for the privileged-teacher distillation term
(tasks/srd.py). Everything the step writes (examples, notes, foresight pairs) is one transaction.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config
from methods.exit import exit_examples
from tasks.common import model_path, open_store, prefix_messages, trajectories_with_turns, utcnow


@task(name="distill", cache_policy=NONE)
def distill_examples(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    prefix = prefix_messages(cfg)
    counts: dict = {}
    rows, notes, foresight = [], [], []
    with open_store(cfg) as store:
        trajs = trajectories_with_turns(store, run_id, round, "generate", prefix)
        if "srd" in cfg.distill.methods:
            from tasks.srd import load_inputs

            champion = store.champion(run_id)
            champion_path = model_path(store, champion)
            srd_inputs = load_inputs(store, run_id, round)
    if "exit" in cfg.distill.methods:
        exs = exit_examples(trajs, cfg.distill.exit.min_reward, cfg.distill.exit.dedupe)
        counts["exit"] = len(exs)
        rows += [{"example_id": e.example_id, "method": e.method, "source_traj_id": e.source_traj_id,
                  "messages": e.messages, "weight": e.weight, "meta": e.meta} for e in exs]
    if "srd" in cfg.distill.methods:
        from tasks.srd import srd_rows

        srd = srd_rows(cfg, round, srd_inputs, trajs, champion, champion_path)
        notes, foresight = srd["notes"], srd["foresight"]
        rows += srd["examples"]
        counts["srd"] = len(srd["examples"])
        counts["srd_metrics"] = srd["metrics"]
    with open_store(cfg) as store, store.step(run_id, round, "distill", started) as tx:
        tx.insert("examples", rows)
        tx.insert("notes", notes)
        tx.insert("foresight", foresight)
    get_run_logger().info("round %d distill: %s", round, counts)
    return counts
