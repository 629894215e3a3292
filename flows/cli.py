"""`rsiflow`: run, serve, status, report, check-env.

    rsiflow run --config configs/default.yaml --rounds 2      # local, no Prefect server needed
    rsiflow serve --config configs/default.yaml               # improvement-round/<run>, self-improve/<run>
    rsiflow status --config configs/default.yaml
    rsiflow report --config configs/default.yaml
    rsiflow check-env mypkg.envs:MyEnv --tasks 20             # the env conformance check (rsiflow.envs.conformance)

A user's mistake (a bad config value, a store that can't be opened, a busy run) ends in one line on stderr
naming the cause, where it came from and what to do; `--debug` shows the traceback instead. Ctrl-C and SIGTERM
end `run` and `serve` within seconds, in one line; the temporary Prefect server `run` starts dies with it
whatever ends it (even `kill -9`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from rsiflow.models.backend import interrupt_calls_in_flight


def _prefect_env() -> None:
    # The first ephemeral run otherwise prints a telemetry "database is locked" traceback.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's temporary server must answer within 20 s by default; on a loaded 2-core machine it
    # sometimes takes longer ("Timed out while attempting to connect to ephemeral Prefect API server").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread and handled like Ctrl-C: Prefect marks the flow run crashed; the step in
    progress keeps nothing (a step writes in one transaction at its end, rolled back if it was writing)."""


def _stop(signum, frame) -> None:
    """Ctrl-C (SIGINT) or SIGTERM: first end the generate calls in flight (a step's thread may be waiting on one,
    and Prefect waits for that thread: a vLLM turn took up to a minute here), then unwind the main thread."""
    interrupt_calls_in_flight()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signal.Signals(signum).name)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int, libc) -> None:
    """In a child between fork and exec: ask the kernel for SIGTERM when the parent dies, even by SIGKILL (Linux
    prctl PR_SET_PDEATHSIG); exit at once if it died already."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def start_temporary_prefect_server() -> str:
    """Start the temporary Prefect API server that flows use when no PREFECT_API_URL is set, so that it dies with
    this process and Ctrl-C reaches this process only; the API URL flows use (PREFECT_API_URL's when it is set).

    Prefect starts it on first use as a plain child: Ctrl-C at a terminal signals the whole process group, so
    it died first and the flow run then retried reporting to it for minutes; and a `kill -9` of this process left
    it running. Here it is started from the main thread, in its own session (the terminal's Ctrl-C doesn't reach
    it; this process stops it at exit, as Prefect does) and with a parent-death signal (the kernel sends it
    SIGTERM when this process dies, however). Prefect finds it as its default temporary server and uses it."""
    from prefect.server.api import server as prefect_server
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return PREFECT_API_URL.value()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    parent = os.getpid()

    class _ChildProcesses:
        """Stands in for the `subprocess` module inside Prefect's server module while it starts the server."""

        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def Popen(*args, **kwargs):  # noqa: N802 (subprocess's name)
            preexec = (lambda: _die_with_parent(parent, libc)) if libc is not None else None
            return subprocess.Popen(*args, start_new_session=True, preexec_fn=preexec, **kwargs)

    class _TemporaryServer(prefect_server.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            real = prefect_server.subprocess
            prefect_server.subprocess = _ChildProcesses()
            try:
                return super()._run_uvicorn_command()
            finally:
                prefect_server.subprocess = real

    server = prefect_server.SubprocessASGIServer()   # the default instance Prefect would use, if it exists
    if not server.running:
        prefect_server.SubprocessASGIServer._instances.pop(None, None)
        server = _TemporaryServer()
        server.start()
    return server.api_url


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", action="append", metavar="FILE",
                   help="YAML config; repeat to overlay (later files win). Default: configs/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one key, e.g. --set train.learning_rate=1e-5 (repeatable)")


def _load(args):
    from rsiflow.configs.loader import load_config

    files = args.config or ["configs/default.yaml"]
    return files, load_config(files, args.overrides)


def _open_run(cfg, read_only: bool = True):
    """The store (read-only unless asked: a process that writes it too must open it the same way, DuckDB refuses
    a read-only and a read-write connection to one file in one process) for a command that reads a run; it never
    creates one. ConfigError if the run is not in it."""
    from rsiflow.configs.schema import ConfigError
    from rsiflow.stores.lake import is_lake
    from rsiflow.stores.store import Store, StoreError

    if not read_only and not is_lake(cfg.run.store) and not Path(cfg.run.store).expanduser().is_file():
        raise StoreError(f"store {cfg.run.store} does not exist")
    try:
        store = Store(cfg.run.store, read_only=read_only)
    except StoreError as e:
        raise StoreError(f"{e} (run.store from {cfg.source_of('run.store')})") from None
    if store.get_run(cfg.run.name) is None:
        runs = [r["run_id"] for r in store.list_runs()]
        store.close()
        raise ConfigError(f"no run {cfg.run.name!r} in {store.path} (runs there: {', '.join(runs) or 'none'}); "
                          f"run.name from {cfg.source_of('run.name')}")
    return store


def _print_report(cfg, read_only: bool = True) -> None:
    from rsiflow.methods import method_classes
    from rsiflow.tasks.report import write_report

    with _open_run(cfg, read_only) as store:
        md_path, png, md = write_report(store, cfg.run.name, cfg.run_dir / "report", methods=method_classes(cfg))
    print(md)
    print(f"report: {md_path}\nplot:   {png}", flush=True)


def cmd_run(args) -> None:
    """Rounds until the run has --rounds completed ones, holding the run's lease throughout (flows/lease.py).
    Every input is checked (tasks/setup.py: ensure_run) before anything is written or started."""
    from rsiflow.configs.schema import ConfigError

    if args.rounds is not None and args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds}: must be at least 1 (the total number of rounds the run should "
                          "have; rounds it has completed count, so a finished run exits at once)")
    _prefect_env()
    files, cfg = _load(args)
    from rsiflow.flows.lease import run_lease
    from rsiflow.flows.round import round_flow
    from rsiflow.stores.lake import redact
    from rsiflow.stores.store import StoreError
    from rsiflow.tasks.common import open_store
    from rsiflow.tasks.setup import ensure_run

    target = cfg.run.rounds if args.rounds is None else args.rounds
    try:
        ensure_run(cfg)
    except StoreError as e:
        raise StoreError(f"{e} (run.store from {cfg.source_of('run.store')})") from None
    with run_lease(cfg, args.wait):
        while True:
            with open_store(cfg) as store:
                done = store.last_completed_round(cfg.run.name)
            if done >= target:
                break
            start_temporary_prefect_server()   # once (it returns at once when running), when a round is to run
            round_flow(cfg, max(done, 0) + 1)(files, args.overrides)
            _print_report(cfg, read_only=False)
        if cfg.gate.test_tasks:
            _final_test(cfg, again=False)
    print(f"run {cfg.run.name!r}: {max(done, 0)} round(s) completed; store {redact(cfg.run.store)}")


def _final_test(cfg, again: bool) -> None:
    """Print the run's final test split figures (tasks/final_test.py), playing them unless the store has them for
    the current champion after its last round (or `again`)."""
    from rsiflow.tasks.common import open_store
    from rsiflow.tasks.final_test import describe, final_test, stored_final_test

    with open_store(cfg) as store:
        found = stored_final_test(store, cfg.run.name)
        current = (found is not None and found["champion_id"] == store.champion(cfg.run.name)
                   and found["round"] == max(store.last_completed_round(cfg.run.name), 0))
    result = found if current and not again else final_test(cfg)
    print("\n".join(describe(result)), flush=True)


def cmd_test(args) -> None:
    """Play the final test split (gate.test_tasks tasks no gate reads) with the run's base and champion."""
    from rsiflow.configs.schema import ConfigError
    from rsiflow.flows.lease import run_lease

    _prefect_env()
    files, cfg = _load(args)
    if not cfg.gate.test_tasks:
        raise ConfigError("gate.test_tasks is 0: set it (e.g. --set gate.test_tasks=200) to play a final test split")
    _open_run(cfg).close()   # the run must exist
    with run_lease(cfg, args.wait):
        _final_test(cfg, again=args.again)


def serve_deployments(files: list[str], overrides: list[str], cfg, cron: str | None, **extra) -> list:
    """The run's deployments (`rsiflow serve` serves them, `rsiflow deploy` puts them on a work pool):
    `improvement-round/<run name>` (on `cron`; none = on demand, and an existing schedule is cleared) and
    `self-improve/<run name>`, each with the config's absolute paths as parameters, the run's tags (`run_tags`:
    run, env, methods), a description that names the run's config, and a concurrency limit of 1 that queues
    (ENQUEUE) a flow run triggered while another of the same deployment runs. `extra`: more arguments of
    `Flow.to_deployment` (a work pool's)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from rsiflow.flows.round import improvement_round, run_tags
    from rsiflow.flows.self_improve import self_improve

    name = cfg.run.name
    config = " + ".join(os.path.relpath(f) for f in files) + (f" with {', '.join(overrides)}" if overrides else "")
    what = f"run {name!r} ({cfg.env.name}, {'+'.join(cfg.distill.methods)}; config {config})"
    common = dict(name=name, parameters={"config": [os.path.abspath(f) for f in files], "overrides": overrides},
                  tags=run_tags(cfg), concurrency_limit=ConcurrencyLimitConfig(
                      limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE), **extra)
    return [
        improvement_round.to_deployment(cron=cron, description=f"The next round of {what}", **common),
        self_improve.to_deployment(description=f"Rounds of {what} up to run.rounds", **common),
    ]


def existing_deployments(deployments: list) -> dict[str, object]:
    """The deployments of the same names already on the Prefect server, by full name."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for d in deployments:
            full_name = f"{d.flow_name}/{d.name}"
            try:
                found[full_name] = client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                continue
    return found


def check_take_over(deployments: list, pool: str | None, take_over: bool, command: str) -> list[str]:
    """Refuse (ConfigError) to move a deployment between `rsiflow serve` (no work pool) and a work pool (`pool`),
    or between two pools, unless `take_over`: two processes would pick up its flow runs, and stopping serve
    would pause the other's schedule. With `take_over` the old deployment is deleted (its flow runs stay), so
    the new one is registered from scratch; returns a line per deletion."""
    from prefect.client.orchestration import get_client

    from rsiflow.configs.schema import ConfigError

    deleted = []
    for full_name, old in existing_deployments(deployments).items():
        if old.work_pool_name == pool:
            continue
        now = f"on work pool {old.work_pool_name!r}" if old.work_pool_name else "served by `rsiflow serve`"
        then = f"work pool {pool!r}" if pool else "this serve process"
        if not take_over:
            raise ConfigError(f"deployment {full_name!r} is {now}; `rsiflow {command}` would hand it to {then}. "
                              "Stop what runs it now (the other serve process, or that pool's worker), then run the "
                              "same command with --take-over")
        with get_client(sync_client=True) as client:
            client.delete_deployment(old.id)
        deleted.append(f"took over deployment {full_name!r} ({now} until now; its flow runs stay)")
    return deleted


def _schedules(schedules) -> str:
    """A deployment's schedules in one phrase: "cron '0 */6 * * *' (inactive)", or 'none'."""
    described = sorted((f"cron {s.schedule.cron!r}" if hasattr(s.schedule, "cron") else repr(s.schedule))
                       + ("" if s.active else " (inactive)") for s in schedules or [])
    return ", ".join(described) or "none"


def _with_abs_configs(parameters: dict) -> dict:
    """Parameters with relative config paths made absolute (prefect.yaml's are relative to the repository)."""
    if isinstance(parameters.get("config"), list):
        return {**parameters, "config": [os.path.abspath(f) for f in parameters["config"]]}
    return parameters


def deployment_changes(deployments: list) -> list[str]:
    """What registering `deployments` changes in deployments of the same names already on the Prefect server:
    a line per deployment whose parameters or schedules it replaces, and one per deployment that keeps a work
    pool from `prefect deploy` (serving does not remove it)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    lines = []
    with get_client(sync_client=True) as client:
        for d in deployments:
            full_name = f"{d.flow_name}/{d.name}"
            try:
                old = client.read_deployment_by_name(full_name)
            except ObjectNotFound:
                continue
            changes = []
            if _with_abs_configs(old.parameters) != _with_abs_configs(d.parameters):
                changes.append(f"parameters {old.parameters} -> {d.parameters}")
            before, after = _schedules(old.schedules), _schedules(d.schedules)
            if before != after:
                changes.append(f"schedules {before} -> {after}")
            if changes:
                lines.append(f"deployment '{full_name}' exists; serving replaces its " + "; ".join(changes))
            if old.work_pool_name:
                lines.append(f"deployment '{full_name}' keeps work pool {old.work_pool_name!r} (from prefect "
                             "deploy): that pool's worker and this serve process may both pick up its runs, and "
                             "stopping serve pauses it")
    return lines


def cmd_serve(args) -> None:
    """Register the run's deployments (saying what they replace of existing ones) and run their flow runs
    until stopped; stopping pauses their schedules."""
    _prefect_env()
    files, cfg = _load(args)
    from prefect import serve

    start_temporary_prefect_server()
    deployments = serve_deployments(files, args.overrides, cfg, args.cron or cfg.prefect.cron)
    for line in check_take_over(deployments, None, args.take_over, "serve") + deployment_changes(deployments):
        print(f"rsiflow serve: {line}", file=sys.stderr, flush=True)
    stopped = (f"rsiflow serve: stopped; deployments improvement-round/{cfg.run.name} and "
               f"self-improve/{cfg.run.name} stay registered")
    try:
        serve(*deployments)   # returns after Ctrl-C; Prefect's runner ends SIGTERM with a graceful stop or exit 0
    except SystemExit as e:
        if not e.code:
            print(stopped, file=sys.stderr, flush=True)
        raise
    print(stopped, file=sys.stderr, flush=True)


def _require_server(command: str) -> str:
    from prefect.settings import PREFECT_API_URL

    from rsiflow.configs.schema import ConfigError

    if not PREFECT_API_URL.value():
        raise ConfigError(f"rsiflow {command} registers deployments on a Prefect server: start one (prefect server "
                          "start) and set PREFECT_API_URL, e.g. http://127.0.0.1:4200/api")
    return PREFECT_API_URL.value()


def cmd_deploy(args) -> None:
    """Register the run's two deployments on a work pool (created, of type process, if missing), from the config:
    name, tags, description, schedule (prefect.cron or --cron), concurrency 1; the worker runs them in this
    folder. Then print the commands that start a worker and trigger a round."""
    _prefect_env()
    files, cfg = _load(args)
    api = _require_server("deploy")
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(args.pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=args.pool, type="process"))
            print(f"rsiflow deploy: created work pool {args.pool!r} (process)")
    deployments = serve_deployments(files, args.overrides, cfg, args.cron or cfg.prefect.cron,
                                    work_pool_name=args.pool, job_variables={"working_dir": os.getcwd()},
                                    entrypoint_type=EntrypointType.MODULE_PATH)
    for line in check_take_over(deployments, args.pool, args.take_over, "deploy") + deployment_changes(deployments):
        print(f"rsiflow deploy: {line}")
    for d in deployments:
        d.apply()
        print(f"rsiflow deploy: registered {d.flow_name}/{d.name} on work pool {args.pool!r} "
              f"(tags {', '.join(d.tags)}; schedules: {_schedules(d.schedules)})")
    print(f"start a worker (it runs the flow runs in {os.getcwd()}; stop it with Ctrl-C or kill):\n"
          f"  PREFECT_API_URL={api} rsiflow worker --pool {args.pool}\n"
          f"then trigger a round:\n  PREFECT_API_URL={api} prefect deployment run 'improvement-round/{cfg.run.name}'",
          flush=True)


def cmd_worker(args) -> None:
    """`prefect worker start --pool P --type process` in this process, with Python's SIGINT handler put back: a
    shell without job control starts background jobs with SIGINT ignored, and Prefect's worker turns SIGTERM into
    SIGINT, so such a worker would stop only with SIGKILL; this one stops on SIGTERM and Ctrl-C."""
    _prefect_env()
    from prefect.cli import app

    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["prefect", "worker", "start", "--pool", args.pool, "--type", "process", *args.prefect_args]
    app()


def cmd_pools(args) -> None:
    """`rsiflow pools deploy`: create the config's work pools (prefect.pools) that don't exist and register the
    run's step deployments on them (flows/pooled.py); then print the worker commands."""
    _prefect_env()
    files, cfg = _load(args)
    from prefect.settings import PREFECT_API_URL

    from rsiflow.configs.schema import ConfigError
    from rsiflow.flows.pooled_step import deploy_steps

    if not PREFECT_API_URL.value():
        raise ConfigError("rsiflow pools deploy registers work pools and deployments on a Prefect server: start one "
                          "(prefect server start) and set PREFECT_API_URL, e.g. http://127.0.0.1:4200/api")
    for line in deploy_steps(cfg, args.type):
        print(f"rsiflow pools: {line}")
    print("start a worker per pool (on machines that see the repository, run.store and run.run_dir):")
    for pool in sorted(set(cfg.prefect.pools.values())):
        print(f"  PREFECT_API_URL={PREFECT_API_URL.value()} prefect worker start --pool {pool} --type {args.type}")
    print("then run rounds as usual (rsiflow run, or the improvement-round deployment) with PREFECT_API_URL set",
          flush=True)


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


def status_lines(store, run_id: str) -> list[str]:
    """`rsiflow status`: the run's champion and lease, then each round (status, champions, wall time) with its
    steps: state, duration and, for a failed step, its error. A step recorded as running while nobody holds the
    run's lease was interrupted (its process died); the line says what resumes it: the next `rsiflow run`, or for
    a round a deployment's flow run ran, a retry of that flow run (or a new run of the deployment)."""
    from rsiflow.flows.lease import describe
    from rsiflow.tasks.common import STEPS

    now = datetime.now(UTC).replace(tzinfo=None)
    lease = store.lease(run_id)

    done = max(0, store.last_completed_round(run_id))
    lines = [f"champion: {store.champion(run_id)}   completed rounds: {done}   "
             f"lease: {describe(lease) if lease else 'free (no round running)'}"]
    steps: dict[int, list[dict]] = {}
    for s in store.step_history(run_id):
        steps.setdefault(s["round"], []).append(s)
    rounds = {r["round"]: r for r in store.round_history(run_id)}
    for n in sorted(set(steps) | set(rounds)):
        r = rounds.get(n)
        recorded_end = max((s["finished_at"] or s["started_at"] for s in steps.get(n, [])
                            if s["finished_at"] or s["started_at"]), default=None)
        stopped = r is not None and r["status"] == "running" and lease is None
        if r is None:
            lines.append(f"round {n}  setup")
        else:
            # a round nobody runs any more ran until its last recorded step, not until now
            end = r["finished_at"] or ((recorded_end or r["started_at"]) if stopped else now)
            wall = (end - r["started_at"]).total_seconds() if r["started_at"] else None
            took = f"  {_seconds(wall)}" if wall is not None else ""
            after = f" -> {r['champion_after']}" if r["champion_after"] else ""
            state = "interrupted" if stopped else r["status"]
            lines.append(f"round {n}  {state}{took}  champion {r['champion_before']}{after}")
        last_end = r["started_at"] if r else None
        for s in steps.get(n, []):
            state = s["status"]
            if state == "running" and lease is None:
                state = "interrupted"
            end = s["finished_at"] or now
            last_end = max(last_end or end, end)
            took = _seconds((end - s["started_at"]).total_seconds()) if s["started_at"] else ""
            if state == "running":
                took = f"for {took}"
            err = f"  {s['error'].splitlines()[0]}" if s["error"] and state == "failed" else ""
            lines.append(f"  {s['step']:<9} {state:<11} {took:>10}{err}")
        if r is not None and r["status"] == "running":
            # a step records itself when it ends (one transaction): the ones after are running or pending
            recorded = {s["step"] for s in steps.get(n, [])}
            first = not any(s["status"] == "failed" for s in steps.get(n, []))
            for step in [s for s in STEPS if s not in recorded]:
                if first:
                    since = f"for {_seconds((now - last_end).total_seconds())}" if last_end and lease else ""
                    lines.append(f"  {step:<9} {'running' if lease else 'interrupted':<11} {since:>10}"
                                 + ("" if lease else f"  (no holder: {_resumes(store, run_id, n)})"))
                    first = False
                else:
                    lines.append(f"  {step:<9} pending")
        if stopped and any(s["status"] == "failed" for s in steps.get(n, [])):   # no step line said it
            lines.append(f"  resume: {_resumes(store, run_id, n)}")
    return lines


def _resumes(store, run_id: str, round_no: int) -> str:
    """What resumes an unfinished round: a retry of the deployment's flow run that ran it, or `rsiflow run`."""
    runs = store.round_flow_runs(run_id, round_no)
    deployed = [f for f in runs if f["deployment_id"]]
    if deployed:
        name = deployed[-1]["flow_run_name"]
        return (f"a deployment's flow run ran it: retry flow run {name!r} (UI: Retry, or `prefect flow-run retry "
                f"{name}`) or run the deployment again; `rsiflow run` also resumes here")
    return "`rsiflow run` resumes here"


def cmd_status(args) -> None:
    files, cfg = _load(args)
    with _open_run(cfg) as store:
        print(f"run {cfg.run.name!r}  store {store.path}")   # a lake's password hidden
        print("\n".join(status_lines(store, cfg.run.name)))


def cmd_report(args) -> None:
    files, cfg = _load(args)
    _print_report(cfg)


def cmd_check_env(args) -> None:
    from rsiflow.envs import conformance

    status = conformance.run(args, args.parser)
    if status:
        sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="Show the traceback of an error instead of its one-line message")
    parser = argparse.ArgumentParser(prog="rsiflow", description="Recursive self-improvement rounds for LLM agents.",
                                     parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="Run rounds locally (Prefect ephemeral API) until the run has --rounds rounds.",
                       parents=[debug])
    _config_args(p)
    p.add_argument("--rounds", type=int, help="Total rounds the run should have, at least 1 (default: run.rounds); "
                   "a run that has them already exits at once")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="If a round of the run is running elsewhere, wait this long for it (default 0: exit at once)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("serve", help="Serve the improvement-round/<run> and self-improve/<run> deployments (blocks).",
                       parents=[debug])
    _config_args(p)
    p.add_argument("--cron", help="Cron schedule for the round deployment (default: prefect.cron)")
    p.add_argument("--take-over", action="store_true",
                   help="Serve deployments of the run that are on a work pool (`rsiflow deploy`) here instead")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("deploy", help="Register the improvement-round/<run> and self-improve/<run> deployments on a "
                       "work pool from the config (a Prefect server at PREFECT_API_URL; then `rsiflow worker`).",
                       parents=[debug])
    _config_args(p)
    p.add_argument("--pool", default="rsiflow-process", help="Work pool (created, type process, if missing; default "
                   "rsiflow-process)")
    p.add_argument("--cron", help="Cron schedule for the round deployment (default: prefect.cron)")
    p.add_argument("--take-over", action="store_true",
                   help="Move deployments of the run that `rsiflow serve` serves (or another pool has) to this pool")
    p.set_defaults(func=cmd_deploy)
    p = sub.add_parser("worker", help="Start a Prefect process worker for a pool, stoppable by SIGTERM even in the "
                       "background (the same as prefect worker start --pool P --type process).", parents=[debug])
    p.add_argument("--pool", default="rsiflow-process", help="Work pool (default rsiflow-process)")
    p.add_argument("prefect_args", nargs=argparse.REMAINDER, help="More options of prefect worker start")
    p.set_defaults(func=cmd_worker)
    p = sub.add_parser("status", help="Rounds, steps and the champion of a run (reads the store; never creates one).",
                       parents=[debug])
    _config_args(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("report", help="Write and print the run's per-round table and plot (never creates a store).",
                       parents=[debug])
    _config_args(p)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("test", help="Play the final test split (gate.test_tasks held-out tasks no promotion decision "
                       "reads) with the run's base and champion; print and store the figures.", parents=[debug])
    _config_args(p)
    p.add_argument("--again", action="store_true", help="Play it again even if the store has it for this champion")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="If a round of the run is running elsewhere, wait this long for it (default 0: exit at once)")
    p.set_defaults(func=cmd_test)
    p = sub.add_parser("pools", help="Steps on Prefect work pools (prefect.pools): `deploy` creates the pools and "
                       "registers the step deployments on the server at PREFECT_API_URL.", parents=[debug])
    p.add_argument("action", choices=["deploy"],
                   help="deploy: create the missing pools, register rsiflow-step/<run>-<step> on them")
    _config_args(p)
    p.add_argument("--type", default="process", help="Type of the work pools it creates (default process; an "
                   "existing pool keeps its type)")
    p.set_defaults(func=cmd_pools)
    from rsiflow.envs import conformance  # its options (light: the standard library and rsiflow.envs.base)

    p = sub.add_parser("check-env", help="Check that an env honours the Env interface (a built-in name, "
                       "'package.module:Class' or a config's env.name); the same as python -m "
                       "rsiflow.envs.conformance.", description=conformance.DESCRIPTION, parents=[debug])
    conformance.add_arguments(p)
    p.set_defaults(func=cmd_check_env, parser=p)
    args = parser.parse_args(argv)
    from rsiflow.configs.schema import ConfigError
    from rsiflow.flows.errors import StepFailed
    from rsiflow.flows.lease import RunBusyError
    from rsiflow.stores.store import StoreError

    # SIGINT only where Python's Ctrl-C handler is in place: a command started in the background by a shell without
    # job control (`rsiflow run &` in a script) inherits SIGINT ignored, and stays deaf to the terminal's Ctrl-C.
    stops = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = {sig: signal.signal(sig, _stop) for sig in stops}
    try:
        args.func(args)
    except KeyboardInterrupt as e:   # Ctrl-C, or SIGTERM (Terminated)
        if getattr(args, "debug", False):
            raise
        how = f"{e}" if isinstance(e, Terminated) else "Ctrl-C"
        then = {"run": "; run the same command again to resume (completed steps are kept)",
                "serve": "; its deployments stay registered"}
        print(f"rsiflow {args.command}: stopped by {how}{then.get(args.command, '')}", file=sys.stderr, flush=True)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except (ConfigError, StoreError, RunBusyError) as e:
        if getattr(args, "debug", False):
            raise
        sys.exit(f"rsiflow: {e}")
    except StepFailed as e:
        if getattr(args, "debug", False):
            raise
        sys.exit(f"rsiflow {args.command}: {e}; the steps before it are kept and the same command resumes from "
                 "it (its traceback is in the log above; rsiflow --debug re-raises)")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def entry() -> None:
    """The `rsiflow` command (and `python -m rsiflow.flows.cli`): `main`, then an exit that skips the garbage
    collector's passes over the whole heap while the interpreter shuts down. With torch, transformers, TRL and Prefect
    loaded the interpreter's exit took 2.2-2.4 s a process on 2-core EPYC, 0.3-0.4 s after `gc.freeze()`. Refcounting
    still frees the modules; atexit handlers (the logging flush, the thread policy's mark) run as before. `main` itself
    stays free of it, since tests call it in their own process."""
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    entry()
