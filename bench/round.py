"""Where a round's wall time goes: generation, env, training, diagnostics, store, Prefect, the rest.

    python -m bench.round [--config configs/default.yaml ...] [--set key=val ...] [--rounds 1] [--cprofile FILE]

Runs the `improvement-round` flow in this process on a fresh run (a temporary store and run
folder unless --store / --run-dir) and attributes every second of its wall time to one category,
by wrapping functions from outside (no pipeline code changes):

    generate    HFBackend.generate (tokenize, prefill, decode, detokenize)
    model load  HFBackend construction and weight loads (redeploy included), resolving the base checkpoint
    env         the env class's methods (reset, step, admissible actions, hindsight, sampling tasks, ...)
    train       models.trainer.train_candidate (TRL SFTTrainer: dataset, steps, saving the checkpoint)
    diagnostics the gate's KL diagnostic scoring held-out episodes under both models (tasks.diagnostics:
                model loads and forward passes; its replay of training tasks plays through generate)
    store       Store methods, its step transactions (enter/exit), and SQL through `store.con`
    report      the per-round table and PNG plot the deploy step writes (tasks.report)
    prefect     everything outside the flow and task bodies (the flow/task engines, state and
                API calls, the ephemeral API server's answers), plus run loggers and artifacts
    other       the rest of the task bodies: rollout bookkeeping, action projection, progress bars, ...

Time goes to the innermost category (a store query inside the report counts as store). The
figure against the budget is a ratio measured in this run: orchestration (prefect + store) /
the round's wall time, budget <= 5%. Prefect's ephemeral API server starts on the first flow
of a process; it is started (and timed) before the round, with a trivial flow, and reported
apart, since `rsiflow run` pays it once per process, not per round.

    python -m bench.round --config configs/tiny.yaml --pooled [--pools 'train=training,...'] [--worker-query-s 2]

Pooled mode (flows/pooled.py): the same round twice in one bench run against one local Prefect server
(started here): first in one process (attributed as above), then on a fresh store with every step on a
process work pool (default: train on 'training', the rest on 'inference'), one `prefect worker start` per
pool started (and stopped) here. For both it prints the share of the round's wall time spent outside the
steps' bodies (wall minus the steps' own durations from the store's `steps` rows): Prefect, the lease, and,
pooled, a flow run per step (the worker's poll, a new process, its imports, the engine); then per pooled
step where its time went (waiting for a worker, process start to step start, the body, the end), the ratios
pooled / one process, and whether the two stores hold the same rows (bench.chaos's comparison).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a loaded machine starts it slowly

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = ("generate", "model load", "env", "train", "diagnostics", "store", "report", "prefect", "other")


class Attribution:
    """A stack of categories; elapsed time is charged to the top one (exclusive time)."""

    def __init__(self, base: str = "prefect"):
        self.stack = [(base, "(outside the flow and task bodies)")]
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.detail: dict[tuple[str, str], float] = defaultdict(float)   # (category, function): seconds
        self.last = time.perf_counter()

    def _charge(self) -> None:
        now = time.perf_counter()
        cat, label = self.stack[-1]
        self.seconds[cat] += now - self.last
        self.detail[(cat, label)] += now - self.last
        self.last = now

    def push(self, cat: str, label: str = "") -> None:
        self._charge()
        self.stack.append((cat, label))
        self.calls[cat] += 1

    def pop(self) -> None:
        self._charge()
        self.stack.pop()

    def reset(self) -> None:
        self._charge()
        self.seconds.clear()
        self.calls.clear()
        self.detail.clear()

    def snapshot(self) -> dict[str, float]:
        self._charge()
        return dict(self.seconds)

    @contextmanager
    def charge(self, cat: str, label: str = ""):
        self.push(cat, label)
        try:
            yield
        finally:
            self.pop()


PROF = Attribution()


def timed(fn, cat: str):
    label = getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        PROF.push(cat, label)
        try:
            return fn(*args, **kwargs)
        finally:
            PROF.pop()
    wrapper.__bench_wrapped__ = True
    return wrapper


def patch(owner, name: str, cat: str) -> None:
    fn = getattr(owner, name)
    if getattr(fn, "__bench_wrapped__", False):
        return
    setattr(owner, name, timed(fn, cat))


class TimedProxy:
    """Wraps a DuckDB connection or relation: every call counts as store time; results that are
    connections or relations (lazy) are wrapped too."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name):
        import duckdb

        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with PROF.charge("store", f"duckdb .{name}"):
                out = attr(*args, **kwargs)
            if isinstance(out, (duckdb.DuckDBPyConnection, duckdb.DuckDBPyRelation)):
                return TimedProxy(out)
            return out
        return call

    def __iter__(self):
        with PROF.charge("store"):
            return iter(self._target.fetchall())


def instrument(env_name: str) -> None:
    """Wrap the functions each category is made of (idempotent)."""
    import prefect.tasks

    import rsiflow.models.hf_backend as hb
    import rsiflow.models.loading as loading
    import rsiflow.models.trainer as trainer
    import rsiflow.tasks.deploy as deploy
    import rsiflow.tasks.diagnostics as diagnostics
    import rsiflow.tasks.report as report
    from rsiflow.envs import make_env
    from rsiflow.flows.round import STEP_TASKS, improvement_round
    from rsiflow.stores.steps import StepWriter
    from rsiflow.stores.store import Store

    patch(hb.HFBackend, "generate", "generate")
    patch(hb.HFBackend, "__init__", "model load")
    patch(hb.HFBackend, "_load", "model load")
    # tasks/setup.py imports it from loading when a run starts, so the one patch covers both callers
    patch(loading, "resolve_base_model", "model load")
    patch(trainer, "train_candidate", "train")
    patch(diagnostics, "_action_logprobs", "diagnostics")

    env_cls = type(make_env(env_name))
    for name in ("__init__", "reset", "step", "admissible_actions", "hindsight", "canonicalize", "sample_tasks",
                 "instructions", "close", "demonstration"):
        if hasattr(env_cls, name):
            patch(env_cls, name, "env")

    for name, fn in list(vars(Store).items()):
        if callable(fn) and name not in ("step", "__enter__") and (not name.startswith("_") or name in (
                "__init__", "__exit__", "_insert")):
            patch(Store, name, "store")
    for name in ("insert", "execute", "set_model_role"):
        patch(StepWriter, name, "store")
    if not getattr(Store.step, "__bench_wrapped__", False):
        Store.step = _timed_step(Store.step)
    Store.con = property(lambda self: TimedProxy(self._con))

    for name in ("write_report", "round_rows"):
        patch(deploy, name, "report")
        patch(report, name, "report")
    # Prefect's artifacts (tables, markdown, progress) and loggers, wherever a step module imported them
    for mod in {t.fn.__module__ for t in STEP_TASKS.values()} | {"rsiflow.flows.round", "rsiflow.tasks.common"}:
        m = sys.modules[mod]
        for name in dir(m):
            if name == "get_run_logger" or (name.endswith("_artifact") and name.startswith(("create_", "update_"))):
                patch(m, name, "prefect")
    patch(prefect.tasks.Task, "__call__", "prefect")
    for t in STEP_TASKS.values():
        if not getattr(t.fn, "__bench_wrapped__", False):
            t.fn = timed(t.fn, "other")
    if not getattr(improvement_round.fn, "__bench_wrapped__", False):
        improvement_round.fn = timed(improvement_round.fn, "other")


def _timed_step(orig):
    @contextmanager
    def step(self, *args, **kwargs):
        cm = orig(self, *args, **kwargs)
        with PROF.charge("store", "Store.step (begin, delete the key's rows)"):
            tx = cm.__enter__()
        try:
            yield tx
        except BaseException:
            with PROF.charge("store"):
                suppressed = cm.__exit__(*sys.exc_info())
            if not suppressed:
                raise
        else:
            with PROF.charge("store", "Store.step (mark completed, commit)"):
                cm.__exit__(None, None, None)
    step.__bench_wrapped__ = True
    return step


def children_cpu_s() -> float | None:
    """CPU seconds used so far by this process's children (the ephemeral Prefect API server)."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


DEFAULT_POOLS = {"generate": "inference", "evaluate": "inference", "distill": "inference", "train": "training",
                 "gate": "inference", "deploy": "inference"}


def worker_env(api_url: str, query_s: float | None = None) -> dict:
    """Environment of a `prefect worker start` here: this server, the repository importable, no telemetry;
    `query_s` sets how often it asks for scheduled runs (Prefect's default: 10 s)."""
    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(REPO),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}
    if query_s is not None:
        env["PREFECT_WORKER_QUERY_SECONDS"] = f"{query_s:g}"
    return env


def stop_group(proc: subprocess.Popen) -> set[int]:
    """Stop a process started with start_new_session, its process group and its descendants (a Prefect worker
    and the flow runs it started, which a process worker starts in process groups of their own): SIGINT to the
    group, again after 10 s (a worker needs a second one), then SIGKILL to the group and to every descendant seen
    that is still alive. Returns the processes still alive after that (expected: none)."""
    from bench.chaos import alive, descendants, group_members

    seen: set[int] = set()

    def living() -> set[int]:
        seen.update(descendants(proc.pid))
        return {p for p in group_members(proc.pid) | seen if alive(p)}

    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
        left = living()
        if not left:
            break
        for target in ([proc.pid] if sig != signal.SIGKILL else []):
            try:
                os.killpg(target, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and living():
            proc.poll()   # reaps the worker once it exits
            time.sleep(0.2)
    proc.poll()
    time.sleep(0.5)
    return living()


@contextmanager
def process_workers(pools: set[str], api_url: str, log_dir: Path, query_s: float | None = None,
                    start_timeout: float = 180.0) -> Iterator[dict[str, subprocess.Popen]]:
    """One `prefect worker start --pool P --type process` per pool (logs in log_dir/worker-P.log), each in a
    session of its own; yields {pool: process} once every worker is online on the server, and stops them all
    (and the flow runs they started) at the end. `procs[pool].left` = processes of its group still alive after
    the stop (filled at the end)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    env = worker_env(api_url, query_s)
    procs: dict[str, subprocess.Popen] = {}
    try:
        for pool in sorted(pools):
            log = open(log_dir / f"worker-{pool}.log", "w")
            procs[pool] = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
                 "--name", f"rsiflow-{pool}-{os.getpid()}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + start_timeout
        with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            for pool, proc in procs.items():
                while not any(w.status == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the worker of pool {pool!r} did not come online: "
                                           + (log_dir / f"worker-{pool}.log").read_text()[-3000:])
                    time.sleep(0.5)
        yield procs
    finally:
        for proc in procs.values():
            proc.left = stop_group(proc)


def pooled_step_times(cfg, results: dict) -> list[dict]:
    """Per pooled step, seconds: 'pickup' from its flow run's creation to Running (the worker's poll, a new
    process, Prefect's import, the pull step, loading flows/pooled_step.py, which imports the pipeline: torch,
    transformers, TRL), 'start' from Running to the step body's start in the store (the rest of the imports, the
    config, the task engine), 'body' (the store's step duration), 'end' from the body's end to the flow run's end."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    from rsiflow.stores.store import Store

    with Store(cfg.run.store, read_only=True) as store:
        rows = {r["step"]: r for r in store.step_history(cfg.run.name) if r["round"] == 1}
    def utc(t) -> datetime.datetime:   # the store keeps naive UTC
        return datetime.datetime.fromtimestamp(t.timestamp(), datetime.UTC).replace(tzinfo=None)

    out = []
    with get_client(sync_client=True) as client:
        for step, res in results.items():
            if "flow_run_id" not in res:
                continue
            fr = client.read_flow_run(UUID(res["flow_run_id"]))
            row = rows[step]
            out.append({"step": step, "pool": fr.work_pool_name, "flow_run": fr.name, "state": fr.state.name,
                        "pickup": (utc(fr.start_time) - utc(fr.created)).total_seconds(),
                        "start": (row["started_at"] - utc(fr.start_time)).total_seconds(),
                        "body": (row["finished_at"] - row["started_at"]).total_seconds(),
                        "end": (utc(fr.end_time) - row["finished_at"]).total_seconds()})
    return out


def outside_steps(cfg, wall: float) -> tuple[float, dict[str, float]]:
    """(seconds of the round's wall time outside the steps' bodies, {step: body seconds}) from the store."""
    from rsiflow.stores.store import Store

    with Store(cfg.run.store, read_only=True) as store:
        body = {r["step"]: (r["finished_at"] - r["started_at"]).total_seconds()
                for r in store.step_history(cfg.run.name) if r["round"] == 1 and r["status"] == "completed"}
    return wall - sum(body.values()), body


def run_pooled(files: list[str], sets: list[str], tmp: Path, pools: dict[str, str], query_s: float | None,
               base_wall: float, base_cfg, base_secs: dict) -> None:
    """The pooled round (see the module docstring) on its own store, against the server already in use, and
    its figures against the one-process round `base_*` of the same config."""
    from prefect.settings import PREFECT_API_URL

    from bench.chaos import compare, table_rows
    from rsiflow.configs.loader import load_config
    from rsiflow.flows.pooled_step import deploy_steps
    from rsiflow.flows.round import improvement_round
    from rsiflow.stores.store import Store
    from rsiflow.tasks.setup import config_differences

    folder = tmp / "pooled"
    overrides = [*sets, "run.name=bench-round", f"run.store={folder / 'store.duckdb'}",
                 f"run.run_dir={folder / 'runs'}/{{name}}",
                 "prefect.pools={" + ", ".join(f"{k}: {v}" for k, v in pools.items()) + "}"]
    folder.mkdir(parents=True)
    cfg = load_config(files, overrides)
    for line in deploy_steps(cfg):
        print(f"  {line}")
    with process_workers(set(pools.values()), PREFECT_API_URL.value(), folder, query_s) as procs:
        t0 = time.perf_counter()
        out = improvement_round(files, overrides)
        wall = time.perf_counter() - t0
    left = sum(len(p.left) for p in procs.values())
    outside, body = outside_steps(cfg, wall)
    base_outside, base_body = outside_steps(base_cfg, base_wall)
    q = f"{query_s:g} s" if query_s is not None else "Prefect's default 10 s"
    print(f"\npooled round: {len(pools)} step(s) on work pools {sorted(set(pools.values()))} (process workers, poll "
          f"every {q}); wall {wall:.1f} s vs one process {base_wall:.1f} s: ratio {wall / base_wall:.2f}")
    print(f"  {'step':<9} {'pool':<10} {'pickup':>7} {'start':>7} {'body':>7} {'end':>6}   one-process body")
    times = pooled_step_times(cfg, out["results"])
    for t in times:
        print(f"  {t['step']:<9} {t['pool']:<10} {t['pickup']:>7.1f} {t['start']:>7.1f} {t['body']:>7.1f} "
              f"{t['end']:>6.1f}   {base_body.get(t['step'], float('nan')):>7.1f}")
    tot = {k: sum(t[k] for t in times) for k in ("pickup", "start", "body", "end")}
    print(f"  {'total':<9} {'':<10} {tot['pickup']:>7.1f} {tot['start']:>7.1f} {tot['body']:>7.1f} {tot['end']:>6.1f}"
          f"   {sum(base_body.values()):>7.1f}")
    print(f"  outside the steps' bodies / round wall: one process {base_outside:.1f} / {base_wall:.1f} s = "
          f"{base_outside / base_wall:.3f}; pooled {outside:.1f} / {wall:.1f} s = {outside / wall:.3f} "
          f"(ratio {outside / max(base_outside, 1e-9):.1f}x in seconds)")
    print(f"  steps' bodies: pooled {sum(body.values()):.1f} s vs one process {sum(base_body.values()):.1f} s "
          f"(ratio {sum(body.values()) / max(sum(base_body.values()), 1e-9):.2f}; a pooled step loads its models in "
          "its own process, inside its body)")
    orch = base_secs.get("prefect", 0.0) + base_secs.get("store", 0.0)
    print(f"  one process, attributed orchestration (prefect + store) / wall = {orch / base_wall:.3f}")
    # The runs table stores each run's config, which differs in prefect.pools (an operational key): compared apart
    ref, pooled = table_rows(base_cfg.run.store, tmp), table_rows(cfg.run.store, folder)
    diff = {t: compare(ref.get(t, []), pooled.get(t, [])) for t in sorted((set(ref) | set(pooled)) - {"runs"})}
    bad = {t: d for t, d in diff.items() if d["lost"] or d["duplicate"] or d["changed"]}
    with Store(cfg.run.store, read_only=True) as store:
        stored = store.get_run(cfg.run.name)["config"]
    config_diff = config_differences(stored if isinstance(stored, dict) else json.loads(stored), base_cfg)
    print(f"  rows: {sum(d['reference'] for d in diff.values())} one process, {sum(d['chaos'] for d in diff.values())}"
          f" pooled; tables that differ (by key): {bad or 'none'}; the run's config differs in identity keys: "
          f"{config_diff or 'none'}")
    print(f"  worker processes left after stopping the workers: {left}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", action="append", metavar="FILE", help="YAML config (default configs/default.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rounds", type=int, default=1, help="rounds to run and attribute (each separately)")
    ap.add_argument("--store", help="store file (default: a fresh temporary one)")
    ap.add_argument("--run-dir", help="run folder (default: a fresh temporary one)")
    ap.add_argument("--cprofile", metavar="FILE", help="also run under cProfile and write its stats here "
                    "(adds overhead to every Python call: use for where, not for how much)")
    ap.add_argument("--pooled", action="store_true", help="also run the same round with its steps on process work "
                    "pools (a local Prefect server and one worker per pool started here) and compare")
    ap.add_argument("--pools", default=",".join(f"{k}={v}" for k, v in DEFAULT_POOLS.items()), metavar="STEP=POOL,...",
                    help="pooled mode: which step runs on which pool (default: %(default)s)")
    ap.add_argument("--worker-query-s", type=float, metavar="S", help="pooled mode: the workers' poll period "
                    "(PREFECT_WORKER_QUERY_SECONDS; default Prefect's 10 s)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary store and run folder (default: removed "
                    "when the bench exits)")
    args = ap.parse_args(argv)
    if args.pooled and (args.rounds != 1 or args.store or args.run_dir):
        ap.error("--pooled compares one round on fresh temporary stores: no --rounds, --store or --run-dir")
    pools = dict(item.split("=", 1) for item in args.pools.split(",") if item)
    os.chdir(REPO)
    files = [str(Path(f).resolve()) for f in (args.config or ["configs/default.yaml"])]
    tmp = Path(tempfile.mkdtemp(prefix="rsiflow-bench-round-"))
    if args.keep:
        print(f"bench.round: the temporary store and run folder stay in {tmp}", flush=True)
    else:   # a round's temporary store, checkpoints and report: ~0.6 GB a trained candidate
        atexit.register(shutil.rmtree, tmp, True)
    overrides = [*args.set, "run.name=bench-round", f"run.store={args.store or tmp / 'store.duckdb'}",
                 f"run.run_dir={args.run_dir or tmp / 'runs'}/{{name}}"]

    t_import = time.perf_counter()
    from prefect import flow

    from rsiflow.configs.loader import load_config
    from rsiflow.flows.round import improvement_round

    cfg = load_config(files, overrides)
    instrument(cfg.env.name)
    import_s = time.perf_counter() - t_import
    server = None
    if args.pooled:   # workers need a server they reach: a local one for both rounds (the same API for both)
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_API_URL, temporary_settings

        server = SubprocessASGIServer()
        server.start()
        settings = temporary_settings(updates={PREFECT_API_URL: server.api_url})
        settings.__enter__()

    @flow(name="bench-warmup")
    def warmup() -> int:
        return 1

    t0 = time.perf_counter()
    warmup()
    startup_s = time.perf_counter() - t0
    print(f"config {' '.join(files)} {' '.join(args.set)}\nstore {cfg.run.store}\n"
          f"imports {import_s:.1f} s; Prefect {'local server' if server else 'ephemeral API'} start + first (empty) "
          f"flow {startup_s:.1f} s (once per process)", flush=True)

    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
    results = []
    for _ in range(args.rounds):
        PROF.reset()
        cpu0 = children_cpu_s()
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        out = improvement_round(files, overrides)
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - t0
        secs = PROF.snapshot()
        cpu1 = children_cpu_s()
        results.append((out["round"], wall, secs, dict(PROF.calls)))
        print_round(out["round"], wall, secs, dict(PROF.calls), startup_s, cfg)
        print("  where orchestration time goes (exclusive seconds per function):")
        for (cat, label), s in sorted(PROF.detail.items(), key=lambda kv: -kv[1]):
            if cat in ("store", "prefect") and s >= 0.005:
                print(f"    {cat:<8} {s:>7.2f} s  {label}")
        if cpu0 is not None:
            n = os.cpu_count() or 1
            print(f"  Prefect API server (child process) CPU during the round: {cpu1 - cpu0:.1f} s = "
                  f"{(cpu1 - cpu0) / wall:.1%} of one core, {(cpu1 - cpu0) / (wall * n):.1%} of this machine's {n} "
                  f"cores (runs beside the round, not in its wall time above)")
    if profiler:
        profiler.dump_stats(args.cprofile)
        print(f"cProfile stats: {args.cprofile} (python -m pstats {args.cprofile})")
    if args.pooled:
        try:
            run_pooled(files, args.set, tmp, pools, args.worker_query_s, wall, cfg, secs)
        finally:
            settings.__exit__(None, None, None)
            server.stop()


def print_round(rnd: int, wall: float, secs: dict, calls: dict, startup_s: float, cfg) -> None:
    from rsiflow.stores.store import Store

    with Store(cfg.run.store, read_only=True) as store:
        steps = store.con.execute("SELECT step, epoch(finished_at - started_at) FROM steps"
                                  " WHERE run_id = ? AND round = ? AND status = 'completed' ORDER BY started_at",
                                  [cfg.run.name, rnd]).fetchall()
        decision = store.con.execute("SELECT decision FROM gate_decisions WHERE run_id = ? AND round = ?",
                                     [cfg.run.name, rnd]).fetchall()
        gen = store.con.execute("SELECT count(*), count(*) FILTER (WHERE success) FROM trajectories"
                                " WHERE run_id = ? AND round = ? AND step = 'generate'",
                                [cfg.run.name, rnd]).fetchall()[0]
        n_ex = store.con.execute("SELECT count(*) FROM examples WHERE run_id = ? AND round = ?",
                                 [cfg.run.name, rnd]).fetchall()[0][0]
    total = sum(secs.values())
    print(f"\nround {rnd}: wall {wall:.1f} s (attributed {total:.1f} s); {gen[0]} rollouts, {gen[1]} successes, "
          f"{n_ex} examples, gate {decision[0][0] if decision else '-'}")
    print("  steps (store timings): " + ", ".join(f"{s} {d:.1f} s" for s, d in steps))
    print(f"  {'category':<11} {'seconds':>9} {'share':>7} {'calls':>7}")
    for cat in CATEGORIES:
        s = secs.get(cat, 0.0)
        n = calls.get(cat, 0) if cat not in ("prefect", "other") else "-"
        print(f"  {cat:<11} {s:>9.2f} {s / wall:>7.1%} {n:>7}")
    orch = secs.get("prefect", 0.0) + secs.get("store", 0.0)
    print(f"  orchestration (prefect + store) / round wall = {orch:.2f} / {wall:.1f} s = {orch / wall:.3f}"
          f"   (budget <= 0.05: {'met' if orch / wall <= 0.05 else 'NOT met'})")
    print(f"    prefect {secs.get('prefect', 0.0) / wall:.3f}, store {secs.get('store', 0.0) / wall:.3f}; "
          f"with the once-per-process API start counted in: ({orch:.1f} + {startup_s:.1f}) / ({wall:.1f} + "
          f"{startup_s:.1f}) = {(orch + startup_s) / (wall + startup_s):.3f}")


if __name__ == "__main__":
    main()
