"""`rsiflow`: run, serve, status, report.

    rsiflow run --config configs/default.yaml --rounds 2      # local, no Prefect server needed
    rsiflow serve --config configs/default.yaml               # deployments for `prefect deployment run`
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
    _prefect_env()
    files, cfg = _load(args)
    from configs.schema import ConfigError
    from flows.round import improvement_round
    from tasks.common import open_store
    from tasks.setup import ensure_run

    target = cfg.run.rounds if args.rounds is None else args.rounds
    try:
        ensure_run(cfg)
    except ConfigError as e:
        sys.exit(f"rsiflow: {' '.join(files)}: {e}")
    while True:
        with open_store(cfg) as store:
            done = store.last_completed_round(cfg.run.name)
        if done >= target:
            break
        improvement_round(files, args.overrides)
        _print_report(cfg)
    print(f"run {cfg.run.name!r}: {max(done, 0)} round(s) completed; store {cfg.run.store}")


def cmd_serve(args) -> None:
    _prefect_env()
    files, cfg = _load(args)
    from prefect import serve

    from flows.round import improvement_round
    from flows.self_improve import self_improve

    name = args.name or cfg.prefect.deployment
    params = {"config": [os.path.abspath(f) for f in files], "overrides": args.overrides}
    cron = args.cron or cfg.prefect.cron
    serve(
        improvement_round.to_deployment(name=name, parameters=params, cron=cron,
                                        description=f"Next round of run {cfg.run.name!r}"),
        self_improve.to_deployment(name=name, parameters=params,
                                   description=f"Rounds of run {cfg.run.name!r} up to run.rounds"),
    )


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
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("serve", help="Serve the improvement-round and self-improve deployments (blocks).")
    _config_args(p)
    p.add_argument("--name", help="Deployment name (default: prefect.deployment, 'default')")
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
