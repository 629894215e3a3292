"""Where a round's wall time goes: generation, env, training, store, Prefect, the rest.

    python -m bench.round [--config configs/default.yaml ...] [--set key=val ...] [--rounds 1] [--cprofile FILE]

Runs the `improvement-round` flow in this process on a fresh run (a temporary store and run
folder unless --store / --run-dir) and attributes every second of its wall time to one category,
by wrapping functions from outside (no pipeline code changes):

    generate    HFBackend.generate (tokenize, prefill, decode, detokenize)
    model load  HFBackend construction and weight loads (redeploy included), resolving the base checkpoint
    env         the env class's methods (reset, step, admissible actions, hindsight, sampling tasks, ...)
    train       models.trainer.train_candidate (TRL SFTTrainer: dataset, steps, saving the checkpoint)
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
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a loaded machine starts it slowly

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = ("generate", "model load", "env", "train", "store", "report", "prefect", "other")


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

    import models.hf_backend as hb
    import models.loading as loading
    import models.trainer as trainer
    import tasks.deploy as deploy
    import tasks.report as report
    from envs import make_env
    from flows.round import STEP_TASKS, improvement_round
    from stores.store import StepWriter, Store

    patch(hb.HFBackend, "generate", "generate")
    patch(hb.HFBackend, "__init__", "model load")
    patch(hb.HFBackend, "_load", "model load")
    patch(loading, "resolve_base_model", "model load")
    import tasks.setup
    patch(tasks.setup, "resolve_base_model", "model load")
    patch(trainer, "train_candidate", "train")

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
    for mod in {t.fn.__module__ for t in STEP_TASKS.values()} | {"flows.round", "tasks.common"}:
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
    args = ap.parse_args(argv)
    os.chdir(REPO)
    files = [str(Path(f).resolve()) for f in (args.config or ["configs/default.yaml"])]
    tmp = Path(tempfile.mkdtemp(prefix="rsiflow-bench-round-"))
    overrides = [*args.set, "run.name=bench-round", f"run.store={args.store or tmp / 'store.duckdb'}",
                 f"run.run_dir={args.run_dir or tmp / 'runs'}/{{name}}"]

    t_import = time.perf_counter()
    from prefect import flow

    from configs.schema import load_config
    from flows.round import improvement_round

    cfg = load_config(files, overrides)
    instrument(cfg.env.name)
    import_s = time.perf_counter() - t_import

    @flow(name="bench-warmup")
    def warmup() -> int:
        return 1

    t0 = time.perf_counter()
    warmup()
    startup_s = time.perf_counter() - t0
    print(f"config {' '.join(files)} {' '.join(args.set)}\nstore {cfg.run.store}\n"
          f"imports {import_s:.1f} s; Prefect ephemeral API start + first (empty) flow {startup_s:.1f} s "
          f"(once per process)", flush=True)

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


def print_round(rnd: int, wall: float, secs: dict, calls: dict, startup_s: float, cfg) -> None:
    from stores.store import Store

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
