"""The `improvement-round` flow: one round of generate → evaluate → distill → train → gate → deploy.

It runs the next round of the run named in the config, or finishes the round a crash left
open: steps the store records as completed are skipped, the others run (a step run again
replaces its rows). Composition only: the work is in tasks/.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from configs.schema import Config, load_config
from tasks.common import STEPS, open_store
from tasks.deploy import redeploy
from tasks.distill import distill_examples
from tasks.evaluate import evaluate_rollouts
from tasks.gate import gate_candidate
from tasks.generate import generate_rollouts
from tasks.setup import ensure_run
from tasks.train import train_candidate

STEP_TASKS = {
    "generate": generate_rollouts,
    "evaluate": evaluate_rollouts,
    "distill": distill_examples,
    "train": train_candidate,
    "gate": gate_candidate,
    "deploy": redeploy,
}
assert tuple(STEP_TASKS) == STEPS


def run_round(cfg: Config) -> dict:
    """Run (or finish) the next round of `cfg`'s run; returns {round, steps run, results}."""
    ensure_run(cfg)
    run_id = cfg.run.name
    with open_store(cfg) as store:
        round = max(store.last_completed_round(run_id), 0) + 1  # rounds count from 1; 0 registers the base
        done = store.completed_steps(run_id, round)
        if store.round_status(run_id, round) is None:
            store.start_round(run_id, round, store.champion(run_id))
    logger = get_run_logger()
    if done:
        logger.info("resuming round %d of run %r: %s already completed", round, run_id, sorted(done))
    results = {}
    for step in STEPS:
        if step in done:
            continue
        results[step] = STEP_TASKS[step](cfg, round)
    return {"round": round, "skipped": sorted(done), "results": results}


# List defaults (never mutated) are what Prefect shows in the deployment's run form.
@flow(name="improvement-round")
def improvement_round(config: list[str] = ["configs/default.yaml"], overrides: list[str] = []) -> dict:  # noqa: B006
    """Run the next round of the run that `config` (YAML files, overlays last) names."""
    return run_round(load_config(config, overrides))
