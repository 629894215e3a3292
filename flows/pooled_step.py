"""The `rsiflow-step` flow that a worker of a work pool runs for one step of a round (flows/pooled.py says how and
why), and `deploy_steps`, which creates the pools and registers the step deployments (`rsiflow pools deploy`)."""

from __future__ import annotations

import json
import os

from prefect import flow, get_run_logger

from rsiflow.configs.schema import Config, ConfigError
from rsiflow.flows.pooled import REPO, STEP_FLOW, config_from_payload, deployment_name, results_dir
from rsiflow.flows.round import STEP_TASKS, run_tags, step_task
from rsiflow.models import threads


@flow(name=STEP_FLOW)
def pooled_step(step: str, round_no: int, config: dict) -> dict:
    """Run one step of a round (the step's task, with the config's retries and timeout) in this worker process;
    the round flow that started this run holds the run's lease and waits for it."""
    from prefect.runtime import flow_run
    from prefect.utilities.annotations import quote

    if step not in STEP_TASKS:
        raise ConfigError(f"unknown step {step!r} (steps: {', '.join(STEP_TASKS)})")
    cfg = config_from_payload(config)
    threads.apply_spin_count(cfg.run.omp_spin_count)   # before the step loads torch
    get_run_logger().info("round %d of run %r: step %s on this worker (pid %d, store %s)", round_no, cfg.run.name, step,
                          os.getpid(), cfg.run.store)
    result = step_task(cfg, step)(quote(cfg), round_no)
    out = results_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{flow_run.id}.json"
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(out / f"{flow_run.id}.json")
    return result


def deploy_steps(cfg: Config, pool_type: str = "process") -> list[str]:
    """Create the config's work pools that don't exist yet (of `pool_type`; an existing pool of any type is
    kept) and register deployment `rsiflow-step/<run>-<step>` of each pooled step on its pool. Process pools
    run the step in this repository's folder (job variable working_dir). Returns what was done, one line each."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    if not cfg.prefect.pools:
        raise ConfigError(f"prefect.pools is empty (from {cfg.source_of('prefect.pools')}): every step runs in the "
                          "round's process, nothing to deploy; set e.g. --set 'prefect.pools={train: training}'")
    lines, types = [], {}
    with get_client(sync_client=True) as client:
        for pool in sorted(set(cfg.prefect.pools.values())):
            try:
                types[pool] = client.read_work_pool(pool).type
                lines.append(f"work pool {pool!r} exists (type {types[pool]})")
            except ObjectNotFound:
                template = ProcessWorker.get_default_base_job_template() if pool_type == "process" else None
                client.create_work_pool(WorkPoolCreate(name=pool, type=pool_type, base_job_template=template or {}))
                types[pool] = pool_type
                lines.append(f"work pool {pool!r} created (type {pool_type})")
    source = pooled_step.from_source(source=str(REPO), entrypoint="flows/pooled_step.py:pooled_step")
    for step, pool in cfg.prefect.pools.items():
        d = source.to_deployment(
            name=deployment_name(cfg, step).split("/", 1)[1], work_pool_name=pool,
            tags=[*run_tags(cfg), f"step:{step}"],
            job_variables={"working_dir": str(REPO)} if types[pool] == "process" else None,
            description=f"Step {step} of a round of run {cfg.run.name!r}, started by the round flow (flows/pooled.py)")
        d.apply()
        lines.append(f"deployment {deployment_name(cfg, step)!r} on work pool {pool!r}")
    return lines
