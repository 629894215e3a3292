"""The `improvement-round` flow: one round of generate → evaluate → distill → train → gate → deploy.

It runs the next round of the run named in the config, or finishes the round a crash left
open: steps the store records as completed are skipped, the others run (a step run again
replaces its rows). The round holds the run's lease in the store (flows/lease.py) from before it
picks its round number until its last step, so two starters never run rounds of one run at once.
Its flow run is named `<run>-round-<n>` and tagged (`rsiflow`, `run:<name>`, `env:<env>`, `method:<m>`):
callers that hold the lease know n and name the run at creation (`round_flow`); a run a deployment
created is renamed once the round holds the lease. After the gate the flow run is tagged with the decision
and the serving model (`gate:<decision>`, `champion:<id>`) and its final state's message says both.

A flow run runs one round. The store notes which flow run ran which round (`round_flow_runs`), so a flow
run started again (the UI's Retry, `prefect flow-run retry`) resumes its own round when that round did not
complete, and refuses, in one line that says how to run the next, when it did. A flow run that fails
before it holds the round is renamed to say why: `<run>-busy` (another round of the run holds the lease),
`<run>-config-error`.

`prefect.step_timeout_s` bounds each attempt of a step: when it passes, the calls in flight end as on
Ctrl-C, and so do the calls the attempt starts afterwards (models/backend.py: `hold_interrupt`; the trainer stops
at its next optimizer step), the step fails with StepTimedOut, and the store records the attempt as failed with
that reason.
Composition only: the work is in tasks/.
"""

from __future__ import annotations

import concurrent.futures
import functools
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from prefect import Task, flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.futures import PrefectConcurrentFuture
from prefect.states import Completed, Failed
from prefect.utilities.annotations import quote

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import Config, ConfigError
from rsiflow.flows.errors import StepFailed
from rsiflow.flows.lease import LeaseLostError, RunBusyError, run_lease
from rsiflow.flows.pooled import check_pools, run_on_pool
from rsiflow.models.backend import hold_interrupt
from rsiflow.tasks.common import STEPS, open_store, utcnow
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


class RoundAlreadyRan(RuntimeError):
    """This flow run ran a round that completed: a flow run runs one round, so it does not run another."""


class StepTimedOut(RuntimeError):
    """A step's attempt ran past `prefect.step_timeout_s` and was stopped."""


def update_flow_run(name: str | None = None, tags: list[str] = ()) -> tuple[str | None, str | None]:
    """Rename the current flow run to `name` (None: keep it) and add `tags` to its tags; returns (flow run id,
    name), or (None, None) outside a flow run. The run context's copy is updated too, so events emitted from
    now on (the gate's) name the flow run by its new name."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None, None
    run = ctx.flow_run
    new_tags = sorted(set(run.tags) | set(tags))
    with get_client(sync_client=True) as client:
        client.update_flow_run(run.id, name=name or run.name, tags=new_tags)
    run.name, run.tags = name or run.name, new_tags
    return str(run.id), run.name


def label_flow_run(cfg: Config, name: str) -> tuple[str | None, str | None]:
    """Rename the current flow run to `name` and add `run_tags(cfg)` to its tags (a deployment's stay);
    returns (flow run id, name), or (None, None) outside a flow run."""
    return update_flow_run(name, run_tags(cfg))


def _current_flow_run():
    ctx = FlowRunContext.get()
    return ctx.flow_run if ctx is not None else None


def _take_round(store, run_id: str, flow_run) -> int:
    """The round this flow run runs: the run's next one. A flow run that already ran a round runs it again only
    while it is unfinished (resume); one that completed raises RoundAlreadyRan."""
    round_no = max(store.last_completed_round(run_id), 0) + 1  # rounds count from 1; 0 registers the base
    ran = store.flow_run_round(run_id, str(flow_run.id)) if flow_run is not None else None
    if ran is not None and store.round_status(run_id, ran) == "completed":
        raise RoundAlreadyRan(
            f"flow run {flow_run.name!r} ran round {ran} of run {run_id!r}, which completed: a flow run runs one "
            f"round, so this retry runs nothing. Run round {round_no} as a new flow run: `prefect deployment run "
            f"'improvement-round/{run_id}'` (or Run in the UI), or `rsiflow run --config ...`")
    return round_no


def outcome(cfg: Config, round_no: int) -> tuple[str | None, str | None]:
    """The round's gate decision and the model that serves after it, from the store (None, None before its gate)."""
    with open_store(cfg) as store:
        decided = [d for d in store.promotion_history(cfg.run.name) if d["round"] == round_no]
    return (decided[-1]["decision"], decided[-1]["new_champion_id"]) if decided else (None, None)


def outcome_tags(decision: str | None, serving: str | None) -> list[str]:
    """The flow run's tags for a round's outcome: `gate:<decision>`, `champion:<serving model>`."""
    return ([f"gate:{decision}"] if decision else []) + ([f"champion:{serving}"] if serving else [])


def run_round(cfg: Config, lease_wait_s: float = 0.0) -> dict:
    """Run (or finish) the next round of `cfg`'s run under the run's lease; returns {round, steps run,
    results}. A second starter waits up to `lease_wait_s` seconds for the run, then raises RunBusyError.
    Steps named in `prefect.pools` run as flow runs on their work pools (flows/pooled.py), the others here."""
    check_pools(cfg)
    ensure_run(cfg)
    run_id = cfg.run.name
    flow_run = _current_flow_run()
    with run_lease(cfg, lease_wait_s) as lease:
        with open_store(cfg) as store:
            round_no = _take_round(store, run_id, flow_run)
            done = store.completed_steps(run_id, round_no)
            champion = store.champion(run_id)
            if store.round_status(run_id, round_no) is None:
                store.start_round(run_id, round_no, champion)
            if flow_run is not None:
                store.record_flow_run(run_id, round_no, str(flow_run.id), f"{run_id}-round-{round_no}",
                                      str(flow_run.deployment_id) if flow_run.deployment_id else None)
        lease.set_flow_run(*label_flow_run(cfg, f"{run_id}-round-{round_no}"))
        logger = get_run_logger()
        logger.info("round %d of run %r starting: champion %s", round_no, run_id, champion)
        if done:
            logger.info("resuming round %d of run %r: %s already completed", round_no, run_id, sorted(done))
        results, previous = {}, None
        for step in STEPS:
            if step in done:
                continue
            lease.check()
            if step in cfg.prefect.pools:   # its own flow run on a worker of its pool; this flow waits for it
                results[step], previous = run_on_pool(cfg, step, round_no, lease, run_tags(cfg)), None
                continue
            # The UI's task graph shows the step order: each step waits for the previous one. Prefect would also
            # draw an edge from any object in a task's inputs that an earlier task returned (matched by id, e.g.
            # an interned string), so cfg is quoted (neither searched nor copied) and the previous step is passed
            # as a finished future (a state would be searched, result included).
            started = utcnow()
            state = step_task(cfg, step)(quote(cfg), round_no, wait_for=[finished(previous)] if previous else None,
                                         return_state=True)
            try:
                results[step] = state.result()
            except (ConfigError, LeaseLostError):
                raise
            except Exception as e:  # the step's own traceback is in its task run's log already
                why = f"{type(e).__name__}: {_first_line(e)}"
                with open_store(cfg) as store:   # a step stopped before its transaction did not record itself
                    store.step_failed(run_id, round_no, step, started, why)
                raise StepFailed(f"round {round_no} of run {run_id!r}: step {step} failed: {why}") from e
            previous = state
            if step == "gate":
                update_flow_run(tags=outcome_tags(*outcome(cfg, round_no)))
        decision, serving = outcome(cfg, round_no)
        update_flow_run(tags=outcome_tags(decision, serving))
    return {"round": round_no, "skipped": sorted(done), "results": results, "decision": decision, "serving": serving}


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


@contextmanager
def step_deadline(seconds: float | None, step: str) -> Iterator[None]:
    """Bound the block to `seconds` (None: no bound): when they pass, every call in flight in this process ends as
    on Ctrl-C (generate calls raise, the trainer stops at its next step), and so does every call the block starts
    afterwards until it ends (`hold_interrupt`: the deadline may pass between two calls, while a model loads). The
    error that ends the block becomes StepTimedOut. A block that finishes in spite of it stands."""
    if not seconds:
        yield
        return
    releases: list[Callable[[], None]] = []
    timer = threading.Timer(seconds, lambda: releases.append(hold_interrupt()))
    timer.daemon = True
    timer.start()
    try:
        try:
            yield
        finally:
            timer.cancel()
            timer.join()   # an expiry in progress has finished: `releases` is final
    except BaseException as e:
        if releases:
            raise StepTimedOut(f"step {step} ran past prefect.step_timeout_s = {seconds:g} s and was stopped "
                               f"({type(e).__name__}: {_first_line(e)})") from e
        raise
    finally:
        for release in releases:
            release()


def step_task(cfg: Config, step: str) -> Task:
    """The step's task with the config's retries (every step replaces its rows when run again), each attempt
    bounded by `prefect.step_timeout_s` (`step_deadline`)."""
    base = STEP_TASKS[step]
    timeout = cfg.prefect.step_timeout_s

    @functools.wraps(base.fn)
    def bounded(*args, **kwargs):
        with step_deadline(timeout, step):
            return base.fn(*args, **kwargs)

    return Task(bounded, name=base.name, cache_policy=base.cache_policy, retries=cfg.prefect.retries,
                retry_delay_seconds=10, retry_condition_fn=_retry)


def _run_name_of(config: list[str], overrides: list[str]) -> str:
    """The run name a config would give, best effort (for naming a flow run whose config does not load)."""
    name = None
    for text in overrides:
        if text.split("=", 1)[0].strip() == "run.name" and "=" in text:
            name = text.split("=", 1)[1].strip()
    for f in reversed(config if name is None else []):
        try:
            name = ((yaml.safe_load(Path(f).read_text()) or {}).get("run") or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if name:
            break
    name = name or (Path(config[-1]).stem if config else "rsiflow")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", str(name))


# List defaults (never mutated) are what Prefect shows in the deployment's run form.
@flow(name="improvement-round")
def improvement_round(config: list[str] = ["configs/default.yaml"], overrides: list[str] = [],  # noqa: B006
                      lease_wait_s: float = 0.0) -> dict:
    """Run the next round of the run that `config` (YAML files, overlays last) names; if another round of
    that run is running, wait up to `lease_wait_s` seconds for it, then fail naming its holder."""
    flow_run = _current_flow_run()
    deployed = flow_run is not None and flow_run.deployment_id is not None
    try:
        cfg = load_config(config, overrides, origin="the deployment's `overrides` parameter" if deployed else "--set")
    except ConfigError as e:
        update_flow_run(f"{_run_name_of(config, overrides)}-config-error")
        if deployed:   # one line in the flow run's state, not a traceback in the log and again in the worker's
            return Failed(message=f"ConfigError: {e}")
        raise
    try:
        result = run_round(cfg, lease_wait_s)
    except RunBusyError:
        update_flow_run(f"{cfg.run.name}-busy")
        raise
    except RoundAlreadyRan as e:
        get_run_logger().warning("%s", e)
        return Completed(message=f"retry refused: {e}")
    if result["serving"] is None:
        return result
    decision = f"{result['decision']}, " if result["decision"] else ""
    return Completed(message=f"round {result['round']}: {decision}{result['serving']} serves", data=result)


def round_flow(cfg: Config, round_no: int):
    """`improvement_round` with its flow run named `<run>-round-<round>` from the start (for callers that hold
    the run's lease, so `round` is the round it will run)."""
    return improvement_round.with_options(flow_run_name=f"{cfg.run.name}-round-{round_no}")
