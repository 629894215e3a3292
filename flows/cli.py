"""`rsiflow`: run, serve, status, report.

    rsiflow run --config configs/default.yaml --rounds 2      # local, no Prefect server needed
    rsiflow serve --config configs/default.yaml               # improvement-round/<run>, self-improve/<run>
    rsiflow status --config configs/default.yaml
    rsiflow report --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import os
import sys


def _prefect_env() -> None:
    # The first ephemeral run otherwise prints a telemetry "database is locked" traceback.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's temporary server must answer within 20 s by default; on a loaded 2-core machine it
    # sometimes takes longer ("Timed out while attempting to connect to ephemeral Prefect API server").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", action="append", metavar="FILE",
                   help="YAML config; repeat to overlay (later files win). Default: configs/default.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one key, e.g. --set train.learning_rate=1e-5 (repeatable)")


def _load(args):
    from configs.schema import ConfigError, load_config

    files = args.config or ["configs/default.yaml"]
    try:
        return files, load_config(files, args.overrides)
    except ConfigError as e:
        sys.exit(f"rsiflow: {e}")


def _print_report(cfg) -> None:
    from tasks.common import open_store
    from tasks.report import write_report

    with open_store(cfg) as store:
        md_path, png, md = write_report(store, cfg.run.name, cfg.run_dir / "report")
    print(md)
    print(f"report: {md_path}\nplot:   {png}", flush=True)


def cmd_run(args) -> None:
    """Rounds until the run has --rounds completed ones, holding the run's lease throughout (flows/lease.py)."""
    _prefect_env()
    files, cfg = _load(args)
    from configs.schema import ConfigError
    from flows.lease import RunBusyError, run_lease
    from flows.round import round_flow
    from tasks.common import open_store
    from tasks.setup import ensure_run

    target = cfg.run.rounds if args.rounds is None else args.rounds
    try:
        ensure_run(cfg)
    except ConfigError as e:
        sys.exit(f"rsiflow: {' '.join(files)}: {e}")
    try:
        with run_lease(cfg, args.wait):
            while True:
                with open_store(cfg) as store:
                    done = store.last_completed_round(cfg.run.name)
                if done >= target:
                    break
                round_flow(cfg, max(done, 0) + 1)(files, args.overrides)
                _print_report(cfg)
    except RunBusyError as e:
        sys.exit(f"rsiflow: {e}")
    print(f"run {cfg.run.name!r}: {max(done, 0)} round(s) completed; store {cfg.run.store}")


def serve_deployments(files: list[str], overrides: list[str], cfg, cron: str | None) -> list:
    """The deployments `rsiflow serve` registers: `improvement-round/<run name>` (on `cron`; none = on demand,
    and an existing schedule is cleared) and `self-improve/<run name>`, each with the config's absolute paths
    as parameters, rsiflow's tags, and a concurrency limit of 1 that queues (ENQUEUE) a flow run triggered
    while another of the same deployment runs."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    from flows.round import improvement_round, run_tags
    from flows.self_improve import self_improve

    name = cfg.run.name
    common = dict(name=name, parameters={"config": [os.path.abspath(f) for f in files], "overrides": overrides},
                  tags=run_tags(cfg), concurrency_limit=ConcurrencyLimitConfig(
                      limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE))
    return [
        improvement_round.to_deployment(cron=cron, description=f"Next round of run {name!r}", **common),
        self_improve.to_deployment(description=f"Rounds of run {name!r} up to run.rounds", **common),
    ]


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

    deployments = serve_deployments(files, args.overrides, cfg, args.cron or cfg.prefect.cron)
    for line in deployment_changes(deployments):
        print(f"rsiflow serve: {line}", file=sys.stderr, flush=True)
    serve(*deployments)


def cmd_status(args) -> None:
    files, cfg = _load(args)
    from tasks.common import open_store

    with open_store(cfg, read_only=True) as store:
        run = store.get_run(cfg.run.name)
        if run is None:
            sys.exit(f"rsiflow: no run {cfg.run.name!r} in {cfg.run.store}")
        print(f"run {cfg.run.name!r}  store {cfg.run.store}")
        done = max(0, store.last_completed_round(cfg.run.name))
        print(f"champion: {store.champion(cfg.run.name)}   completed rounds: {done}")
        for r in store.step_history(cfg.run.name):
            err = f"  {r['error'].splitlines()[0]}" if r["error"] else ""
            print(f"  round {r['round']:>2}  {r['step']:<9} {r['status']:<10} {r['finished_at'] or ''}{err}")


def cmd_report(args) -> None:
    files, cfg = _load(args)
    _print_report(cfg)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rsiflow", description="Recursive self-improvement rounds for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="Run rounds locally (Prefect ephemeral API) until the run has --rounds rounds.")
    _config_args(p)
    p.add_argument("--rounds", type=int, help="Total rounds the run should have (default: run.rounds)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="If a round of the run is running elsewhere, wait this long for it (default 0: exit at once)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("serve", help="Serve the improvement-round/<run> and self-improve/<run> deployments (blocks).")
    _config_args(p)
    p.add_argument("--cron", help="Cron schedule for the round deployment (default: prefect.cron)")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("status", help="Rounds, steps and the champion of a run.")
    _config_args(p)
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("report", help="Write and print the run's per-round table and plot.")
    _config_args(p)
    p.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
