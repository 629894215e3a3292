"""Steps on Prefect work pools: `prefect.pools` (step -> work pool) runs those steps of a round each as its own
flow run of the `rsiflow-step` flow, on a worker of the step's pool, while the round flow waits for it.

    round flow (holds the run's lease)          worker of pool 'training' (prefect worker start ...)
      generate, evaluate ... in process   ──▶   flow run `<run>-round-<n>-train` of rsiflow-step/<run>-train:
      train: run_deployment, wait          ◀──   load the config, run the train task, write rows to the store

Mechanism: `prefect.deployments.run_deployment` of a per-step deployment on a work pool, served by
`prefect worker start --pool NAME --type process` (Prefect 3.9's documented way to run a flow on given
infrastructure). Not Prefect's task workers (`task.delay()` + `prefect task serve`): a task worker serves every
run of the tasks it was started with, from any caller, and has no work pool, so there is no place to say
"train runs on the GPU machines", no job template (process, Docker, Kubernetes) and no per-pool concurrency or
pause; a pool is exactly that, and its step flow runs show as subflows of the round in the UI.

The step flow and `deploy_steps` are in flows/pooled_step.py (it imports flows/round.py, which imports this).

What a step run gets and gives:
- parameters: the step, the round and the round's validated config as JSON (a file run.store, run.run_dir,
  run.model_cache and run.lake_data_path made absolute), so a worker runs exactly what the round checked, with
  no config file needed.
- it runs the step's own task (flows/round.py `step_task`: the config's retries and timeout, progress
  artifacts), which opens what it needs itself: the store, the champion's checkpoint from the registry (no
  backend or model stays in memory between steps; each step run is a fresh process).
- its summary (the task's return value) is written as JSON under the run's folder (`<run_dir>/step-results/`,
  a shared path by requirement), read and removed by the round; its failure becomes the round's one-line
  `StepFailed` ("... step train failed: ValueError: ..."), a ConfigError stays a ConfigError.
- while it runs, the round keeps heartbeating the run's lease; a lost lease cancels the step run. A step run
  that no worker starts within `prefect.pool_start_timeout_s` is cancelled and fails the round, naming the pool.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from prefect import get_run_logger

from rsiflow.configs.schema import Config, ConfigError
from rsiflow.flows.errors import StepFailed

REPO = Path(__file__).resolve().parents[1]
STEP_FLOW = "rsiflow-step"
POLL_S = 1.0   # how often the round looks at its step's flow run (run_deployment's own default is 5 s)


def deployment_name(cfg: Config, step: str) -> str:
    """`rsiflow-step/<run>-<step>`: one deployment per run and step (two runs may put a step on other pools)."""
    return f"{STEP_FLOW}/{cfg.run.name}-{step}"


def config_payload(cfg: Config) -> dict:
    """The config as JSON for a step run: only the keys set (a default stays a default), with the shared paths
    made absolute against the round's working directory (a worker runs in its own)."""
    from rsiflow.stores.lake import store_location

    data = cfg.model_dump(mode="json", exclude_unset=True)
    run = data.setdefault("run", {})
    run["store"] = str(store_location(cfg.run.store))   # a DuckLake spec stays as written
    for key in ("run_dir", "model_cache", "lake_data_path"):
        value = getattr(cfg.run, key, None)
        if value and "://" not in value:
            run[key] = os.path.abspath(Path(value).expanduser())
    return data


def config_from_payload(data: dict) -> Config:
    """The Config a step run was given (ConfigError if it is not valid here, e.g. another rsiflow version)."""
    from pydantic import ValidationError

    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"the config passed to this step run is not valid here: {e}") from None


def results_dir(cfg: Config) -> Path:
    return cfg.run_dir / "step-results"


def _failure(state) -> str:
    """A failed step run's error as the in-process StepFailed gives it: '<Type>: <first line>'."""
    text = (state.message or "").strip().removeprefix("Flow run encountered an exception:").strip()
    first = text.splitlines()[0] if text else "(no message)"
    if state.is_crashed():
        return f"its flow run crashed: {first}"
    if state.is_cancelled():
        return f"its flow run was cancelled: {first}"
    return first


def _cancel(client, flow_run_id, why: str) -> None:
    """Best effort: ask Prefect to stop a step run the round no longer waits for."""
    from prefect.states import Cancelled, Cancelling

    try:
        current = client.read_flow_run(flow_run_id).state
        if current is None or current.is_final():
            return
        state = Cancelling(message=why) if current.is_running() else Cancelled(message=why)
        client.set_flow_run_state(flow_run_id, state, force=True)
    except Exception as err:  # the round fails anyway; say that the step run may go on
        get_run_logger().warning("could not cancel step flow run %s (%s): %s", flow_run_id, why, err)


def run_on_pool(cfg: Config, step: str, round_no: int, lease, tags: list[str]) -> dict:
    """Run `step` of `round` as a flow run of its deployment on its work pool, tagged `tags` + step and pool, and
    wait for it (the round's lease heartbeats meanwhile). Returns the step's summary with the flow run and pool;
    raises StepFailed (or ConfigError, LeaseLostError) as the in-process step would."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    pool, name = cfg.prefect.pools[step], f"{cfg.run.name}-round-{round_no}-{step}"
    logger = get_run_logger()
    fr = run_deployment(deployment_name(cfg, step), parameters={"step": step, "round_no": round_no,
                                                                "config": config_payload(cfg)},
                        flow_run_name=name, tags=[*tags, f"step:{step}", f"pool:{pool}"], timeout=0)
    logger.info("round %d step %s: flow run %r on work pool %r", round_no, step, name, pool)
    created = time.monotonic()
    with get_client(sync_client=True) as client:
        try:
            while True:
                state = client.read_flow_run(fr.id).state
                if state is not None and state.is_final():
                    break
                if lease.lost:
                    _cancel(client, fr.id, "the round lost the run's lease")
                    lease.check()
                waiting = state is None or state.is_scheduled() or state.is_pending()
                if waiting and time.monotonic() - created > cfg.prefect.pool_start_timeout_s:
                    _cancel(client, fr.id, "no worker started it in time")
                    raise StepFailed(
                        f"round {round_no} of run {cfg.run.name!r}: step {step} failed: no worker of work pool "
                        f"{pool!r} "
                        f"started its flow run {name!r} within {cfg.prefect.pool_start_timeout_s:g} s "
                        f"(prefect.pool_start_timeout_s); start one: prefect worker start --pool {pool} --type process")
                time.sleep(POLL_S)
        except BaseException as err:   # Ctrl-C, SIGTERM, a lost lease: don't leave the step running unwatched
            if not isinstance(err, StepFailed):
                _cancel(client, fr.id, f"the round stopped: {type(err).__name__}")
            raise
    if not state.is_completed():
        why = _failure(state)
        if why.startswith("ConfigError: "):
            raise ConfigError(why.removeprefix("ConfigError: "))
        raise StepFailed(f"round {round_no} of run {cfg.run.name!r}: step {step} failed: {why} "
                         f"(flow run {name!r} on work pool {pool!r})")
    path = results_dir(cfg) / f"{fr.id}.json"
    try:
        result = json.loads(path.read_text())
        path.unlink()
    except OSError as err:
        raise StepFailed(f"round {round_no} of run {cfg.run.name!r}: step {step} completed on work pool {pool!r} "
                         "but its "
                         f"summary {path} is not readable here ({err}): run.run_dir must be a folder every worker "
                         "and the round share") from None
    return {**result, "flow_run": name, "flow_run_id": str(fr.id), "pool": pool}


def check_pools(cfg: Config) -> None:
    """Before a pooled round writes anything: a Prefect server that workers can reach, and every pooled step's
    deployment registered on the configured pool. ConfigError naming what to do otherwise."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not cfg.prefect.pools:
        return
    where = cfg.source_of("prefect.pools")
    if not PREFECT_API_URL.value():
        raise ConfigError(f"prefect.pools (from {where}) runs steps on work pools, which needs a Prefect server the "
                          "workers reach: start one (prefect server start) and set PREFECT_API_URL "
                          "(e.g. http://127.0.0.1:4200/api) for this process and the workers")
    deploy = "rsiflow pools deploy --config ... (the same config), from the repository"
    with get_client(sync_client=True) as client:
        for step, pool in cfg.prefect.pools.items():
            name = deployment_name(cfg, step)
            try:
                d = client.read_deployment_by_name(name)
            except ObjectNotFound:
                raise ConfigError(f"prefect.pools (from {where}) puts step {step} on work pool {pool!r}, but "
                                  f"deployment {name!r} is not registered on {PREFECT_API_URL.value()}: "
                                  f"{deploy}") from None
            if d.work_pool_name != pool:
                raise ConfigError(f"prefect.pools (from {where}) puts step {step} on work pool {pool!r}, but "
                                  f"deployment {name!r} is on work pool {d.work_pool_name!r}: {deploy}")
