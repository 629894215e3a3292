"""The `improvement-round` flow: one round of generate → evaluate → distill → train → gate → deploy.

It runs the next round of the run named in the config, or finishes the round a crash left
open: steps the store records as completed are skipped, the others run (a step run again
replaces its rows). The round holds the run's lease in the store (flows/lease.py) from before it
picks its round number until its last step, so two starters never run rounds of one run at once.
Its flow run is named `<run>-round-<n>` and tagged (`rsiflow`, `run:<name>`, `env:<env>`, `method:<m>`):
callers that hold the lease know n and name the run at creation (`round_flow`); a run a deployment
created is renamed once the round holds the lease. Composition only: the work is in tasks/.
"""

from __future__ import annotations

import concurrent.futures

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.futures import PrefectConcurrentFuture
from prefect.utilities.annotations import quote

from rsiflow.configs.schema import Config, ConfigError, load_config
from rsiflow.flows.errors import StepFailed
from rsiflow.flows.lease import LeaseLostError, run_lease
from rsiflow.flows.pooled import check_pools, run_on_pool
from rsiflow.tasks.common import STEPS, open_store
from rsiflow.tasks.deploy import redeploy
from rsiflow.tasks.distill import distill_examples
from rsiflow.tasks.evaluate import evaluate_rollouts
from rsiflow.tasks.gate import gate_candidate
from rsiflow.tasks.generate import generate_rollouts
from rsiflow.tasks.setup import ensure_run
from rsiflow.tasks.train import train_round

STEP_TASKS = {
    "generate": generate_rollouts,
    "evaluate": evaluate_rollouts,
    "distill": distill_examples,
    "train": train_round,
    "gate": gate_candidate,
    "deploy": redeploy,
}
assert tuple(STEP_TASKS) == STEPS


def run_tags(cfg: Config) -> list[str]:
    """The tags of the run's flow runs and deployments: rsiflow, run:<name>, env:<env>, method:<m> per method."""
    return ["rsiflow", f"run:{cfg.run.name}", f"env:{cfg.env.name}", *(f"method:{m}" for m in cfg.distill.methods)]


def label_flow_run(cfg: Config, name: str) -> tuple[str | None, str | None]:
    """Rename the current flow run to `name` and add `run_tags(cfg)` to its tags (a deployment's stay);
    returns (flow run id, name), or (None, None) outside a flow run."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None, None
    tags = sorted(set(ctx.flow_run.tags) | set(run_tags(cfg)))
    with get_client(sync_client=True) as client:
        client.update_flow_run(ctx.flow_run.id, name=name, tags=tags)
    return str(ctx.flow_run.id), name


def run_round(cfg: Config, lease_wait_s: float = 0.0) -> dict:
    """Run (or finish) the next round of `cfg`'s run under the run's lease; returns {round, steps run,
    results}. A second starter waits up to `lease_wait_s` seconds for the run, then raises RunBusyError.
    Steps named in `prefect.pools` run as flow runs on their work pools (flows/pooled.py), the others here."""
    check_pools(cfg)
    ensure_run(cfg)
    run_id = cfg.run.name
    with run_lease(cfg, lease_wait_s) as lease:
        with open_store(cfg) as store:
            round = max(store.last_completed_round(run_id), 0) + 1  # rounds count from 1; 0 registers the base
            done = store.completed_steps(run_id, round)
            champion = store.champion(run_id)
            if store.round_status(run_id, round) is None:
                store.start_round(run_id, round, champion)
        lease.set_flow_run(*label_flow_run(cfg, f"{run_id}-round-{round}"))
        logger = get_run_logger()
        logger.info("round %d of run %r starting: champion %s", round, run_id, champion)
        if done:
            logger.info("resuming round %d of run %r: %s already completed", round, run_id, sorted(done))
        results, previous = {}, None
        for step in STEPS:
            if step in done:
                continue
            lease.check()
            if step in cfg.prefect.pools:   # its own flow run on a worker of its pool; this flow waits for it
                results[step], previous = run_on_pool(cfg, step, round, lease, run_tags(cfg)), None
                continue
            # The UI's task graph shows the step order: each step waits for the previous one. Prefect would also
            # draw an edge from any object in a task's inputs that an earlier task returned (matched by id, e.g.
            # an interned string), so cfg is quoted (neither searched nor copied) and the previous step is passed
            # as a finished future (a state would be searched, result included).
            state = step_task(cfg, step)(quote(cfg), round, wait_for=[finished(previous)] if previous else None,
                                         return_state=True)
            try:
                results[step] = state.result()
            except (ConfigError, LeaseLostError):
                raise
            except Exception as e:  # the step's own traceback is in its task run's log already
                raise StepFailed(f"round {round} of run {run_id!r}: step {step} failed: {type(e).__name__}: "
                                 f"{_first_line(e)}") from e
            previous = state
    return {"round": round, "skipped": sorted(done), "results": results}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def finished(state: State) -> PrefectConcurrentFuture:
    """A finished task run's state as a future, for `wait_for`."""
    done = concurrent.futures.Future()
    done.set_result(state)
    return PrefectConcurrentFuture(state.state_details.task_run_id, done)


def _retry(task, task_run, state) -> bool:
    """Retry a failed step unless a config error failed it (it would fail the same way again)."""
    return not isinstance(state.result(raise_on_failure=False), ConfigError)


def step_task(cfg: Config, step: str):
    """The step's task with the config's retries (every step replaces its rows when run again) and timeout."""
    return STEP_TASKS[step].with_options(retries=cfg.prefect.retries, retry_delay_seconds=10,
                                         retry_condition_fn=_retry, timeout_seconds=cfg.prefect.step_timeout_s)


# List defaults (never mutated) are what Prefect shows in the deployment's run form.
@flow(name="improvement-round")
def improvement_round(config: list[str] = ["configs/default.yaml"], overrides: list[str] = [],  # noqa: B006
                      lease_wait_s: float = 0.0) -> dict:
    """Run the next round of the run that `config` (YAML files, overlays last) names; if another round of
    that run is running, wait up to `lease_wait_s` seconds for it, then fail naming its holder."""
    return run_round(load_config(config, overrides), lease_wait_s)


def round_flow(cfg: Config, round: int):
    """`improvement_round` with its flow run named `<run>-round-<round>` from the start (for callers that hold
    the run's lease, so `round` is the round it will run)."""
    return improvement_round.with_options(flow_run_name=f"{cfg.run.name}-round-{round}")
