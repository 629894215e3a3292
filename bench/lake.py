"""N runs writing one DuckLake at once against the same runs one after another: wall time, and every row checked.

    .venv-lake/bin/python -m bench.lake --writers 2 4 --rounds 3 --out /tmp/lake-bench
    .venv-lake/bin/python -m bench.lake --tiny-rounds 2 --out /tmp/lake-bench-tiny     # real tiny rounds, N = 2

Starts a private PostgreSQL cluster (a Unix socket in a temporary folder; `PostgresCluster`) as the lake's catalog,
with the Parquet files in --out/<case>/data. Two workloads:

- the store-write workload (default): each writer process is one run that writes `--rounds` rounds through the
  same Store calls a round makes (create the run, register the base model, start each round, then one
  `Store.step` transaction per pipeline step writing that step's rows: tasks, trajectories and turns for
  generate, evaluations, examples, a candidate model and its train inputs, a gate decision, the deploy step,
  finish the round), holding the run's lease around its rounds and renewing it between steps, as `rsiflow run`
  does. The rows are synthetic and deterministic in (run, round), `--rows` trajectories per generate step, so the
  lake's rows can be checked one by one against what each writer was asked to write, with no model in the
  measurement. For each N: the N runs at once on one lake, then the same N runs one after another on a fresh lake;
  the ratio is the speedup of writing at once. Every case then checks that each run's rows are exactly the
  expected rows (no row lost, duplicated or changed) and that each lease ended released.
- `--tiny-rounds R`: two different tiny runs (configs/tiny.yaml, seeds 0 and 1, SRD's template notes so that
  train, gate and deploy do real work) with `rsiflow run --rounds R` as two processes at once on one lake, then
  the same two runs one after another on embedded DuckDB files; every row of each run on the lake is compared with
  the same run's rows in its file (`run_rows`: ids kept, timestamps and durations left out, run folders replaced).

Prints a table and writes --out/lake.json. Exit status 1 if a row differs or a writer failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAKE_PYTHON = REPO / ".venv-lake" / "bin" / "python"
# Config keys that say where a run's store is: left out of `runs.config` when runs on a file and a lake are compared.
STORE_KEYS = ("store", "lake_data_path")


# ---- a private PostgreSQL cluster ------------------------------------------------------------------------

def postgres_bindir() -> Path | None:
    """The folder of PostgreSQL's server binaries (initdb, pg_ctl, postgres), or None when not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


def lake_missing() -> str | None:
    """Why a lake can't be tested here (no PostgreSQL, no .venv-lake), or None."""
    if postgres_bindir() is None:
        return "PostgreSQL's server binaries (initdb, pg_ctl) are not installed (Debian: apt-get install -y postgresql)"
    if not LAKE_PYTHON.exists():
        return ".venv-lake is missing: run bin/setup-lake (DuckDB 1.4.4 with the ducklake and postgres extensions)"
    return None


class PostgresCluster:
    """A throw-away PostgreSQL cluster listening only on a Unix socket in a temporary folder (no TCP port), with
    trust authentication for the role `rsiflow`. As root (PostgreSQL refuses to run as root) the server runs as
    the `postgres` system user, which then owns the folder."""

    def __init__(self, port: int = 5433):
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError(lake_missing())
        self.bin = bindir
        self.port = port
        # short path: a Unix socket path is limited to ~107 bytes
        self.dir = Path(tempfile.mkdtemp(prefix="rsiflow-pg-"))
        self.data = self.dir / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")

    @classmethod
    def existing(cls, folder: Path, port: int = 5433) -> PostgresCluster:
        """A cluster started elsewhere (its socket folder): createdb works, start/stop are not called."""
        cluster = cls.__new__(cls)
        cluster.bin, cluster.port, cluster.dir = postgres_bindir(), port, Path(folder)
        cluster.data, cluster.as_user = cluster.dir / "data", []
        return cluster

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self.as_user, *cmd], check=True, capture_output=True, text=True, cwd=self.dir)

    def start(self) -> PostgresCluster:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "rsiflow", "-E", "UTF8",
                  "--no-sync")
        # fsync off: a test cluster; max_connections: each DuckDB process keeps a few catalog connections
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-t", "120",
                  "-o", f"-k {self.dir} -p {self.port} -c listen_addresses='' -F -c max_connections=200", "start")
        return self

    def createdb(self, name: str) -> str:
        """Create a database; return the lake spec for `run.store` whose catalog it is."""
        self._run(str(self.bin / "createdb"), "-h", str(self.dir), "-p", str(self.port), "-U", "rsiflow", name)
        return f"ducklake:postgres:dbname={name} host={self.dir} port={self.port} user=rsiflow"

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    cluster = PostgresCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


# ---- rows of a run ------------------------------------------------------------------------------------------

def run_rows(store, run_id: str, folder: str | Path) -> dict[str, list[tuple[str, str]]]:
    """Every table's rows of one run as (key, row) JSON texts, as bench.chaos compares them: time-dependent
    columns left out, the run's folder replaced by <dir>; bookkeeping tables left out. `store` is an open Store
    (a file or a lake)."""
    from bench.chaos import KEYS, TIME_DEPENDENT, _normalise
    from rsiflow.stores.migrations import BOOKKEEPING_TABLES

    columns: dict[str, list[str]] = {}
    for r in store.rows("SELECT table_name, column_name FROM information_schema.columns"
                        " WHERE table_catalog = current_database() AND table_schema = 'main'"
                        " ORDER BY table_name, ordinal_position"):
        if r["table_name"] not in BOOKKEEPING_TABLES and not TIME_DEPENDENT.search(r["column_name"]):
            columns.setdefault(r["table_name"], []).append(r["column_name"])
    out = {}
    for table, cols in columns.items():
        if "run_id" not in cols:
            raise ValueError(f"table {table!r} has no run_id column: can't tell its rows by run")
        rows = store.rows(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in cols)} FROM "{table}"'
                          " WHERE run_id = ?", [run_id])
        if table == "runs":   # the config as run: where it was stored (a file, a lake) differs by design
            for row in rows:
                config = json.loads(row["config"])
                for key in STORE_KEYS:
                    config.get("run", {}).pop(key, None)
                row["config"] = json.dumps(config)
        key = [c for c in KEYS.get(table, cols) if c in cols]
        out[table] = sorted((json.dumps([_normalise(row[c], str(folder)) for c in key], default=str),
                             json.dumps([_normalise(row[c], str(folder)) for c in cols], sort_keys=True, default=str))
                            for row in rows)
    return out


def compare_runs(expected: dict[str, list], got: dict[str, list]) -> dict[str, int]:
    """Rows lost, duplicated and changed over every table (bench.chaos's comparison), plus tables missing."""
    from bench.chaos import compare

    total = {"reference": 0, "chaos": 0, "lost": 0, "duplicate": 0, "changed": 0}
    for table in expected.keys() | got.keys():
        for k, v in compare(expected.get(table, []), got.get(table, [])).items():
            total[k] += v
    return {"rows": total["reference"], "rows_got": total["chaos"], "lost": total["lost"],
            "duplicate": total["duplicate"], "changed": total["changed"]}


# ---- the store-write workload -------------------------------------------------------------------------------

def _rows(run_id: str, round_no: int, n: int) -> dict[str, list[dict]]:
    """The synthetic, deterministic rows one round of `run_id` writes, by step and table."""
    base = f"{run_id}/base" if round_no == 1 else f"{run_id}/r{round_no - 1}/candidate"
    cand = f"{run_id}/r{round_no}/candidate"
    tasks = [{"task_id": f"{run_id}/r{round_no}/task{i}", "env": "household", "split": "train", "task_type": "pick",
              "seed": round_no * 1000 + i, "spec": {"i": i}} for i in range(n)]
    trajs = [{"traj_id": f"{run_id}/r{round_no}/t{i}", "task_id": t["task_id"], "model_id": base,
              "group_id": f"g{i // 2}", "sample_idx": i % 2, "purpose": "train", "status": "success" if i % 3 else
              "failure", "success": bool(i % 3), "reward": float(i % 3 > 0), "n_turns": 3,
              "hindsight": {"facts": [f"fact {i}"]}} for i, t in enumerate(tasks)]
    turns = [{"traj_id": t["traj_id"], "turn_idx": j, "observation": f"obs {t['traj_id']} {j}" * 4,
              "action_text": f"go to shelf {j}", "action_symbol": "go<r>", "token_ids": list(range(j, j + 8)),
              "logprobs": [-0.5] * 8, "temp_logprobs": [-0.25] * 8, "reward": 0.0, "done": j == 2, "valid": True}
             for t in trajs for j in range(3)]
    examples = [{"example_id": f"{run_id}/r{round_no}/e{i}", "method": "exit", "source_traj_id": t["traj_id"],
                 "messages": [{"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": "ok"}],
                 "weight": 1.0} for i, t in enumerate(trajs) if t["success"]]
    return {
        "generate": {"tasks": tasks, "trajectories": trajs, "turns": turns},
        "evaluate": {"evaluations": [{"eval_id": f"{run_id}/r{round_no}/train", "model_id": base, "split": "train",
                                      "env": "household", "task_type": "*", "n": n, "successes": sum(
                                          t["success"] for t in trajs)}]},
        "distill": {"examples": examples},
        "train": {"models": [{"model_id": cand, "parent_id": base, "path": f"/ckpt/{cand}", "role": "candidate",
                              "train_metrics": {"loss": 1.0 / round_no}}],
                  "train_inputs": [{"model_id": cand, "example_id": e["example_id"]} for e in examples]},
        "gate": {"gate_decisions": [{"candidate_id": cand, "champion_id": base, "decision": "promote",
                                     "rule": "always", "new_champion_id": cand}]},
        "deploy": {},
    }


def write_run(spec: str, data_path: str, run_id: str, rounds: int, n: int) -> dict:
    """One writer: `rounds` rounds of `run_id` through the Store, the lease held around them (stores only)."""
    import socket

    from rsiflow.stores.store import Store

    host, pid = socket.gethostname(), os.getpid()
    holder = f"{host}:{pid}:bench"
    t0 = time.perf_counter()
    opens = 0

    def store() -> Store:
        nonlocal opens
        opens += 1
        return Store(spec, lake_data_path=data_path)

    with store() as s:
        s.create_run(run_id, run_id, {"bench": "lake", "run": run_id}, "base")
        with s.step(run_id, 0, "init") as tx:
            tx.insert("models", [{"model_id": f"{run_id}/base", "path": "/ckpt/base", "role": "base"}])
        lease, _ = s.acquire_lease(run_id, holder, 120, host, pid)
        if lease["holder"] != holder:
            raise RuntimeError(f"{run_id}: lease held by {lease['holder']}")
    for r in range(1, rounds + 1):
        rows = _rows(run_id, r, n)
        with store() as s:
            s.start_round(run_id, r, s.champion(run_id))
        for step, tables in rows.items():
            with store() as s, s.step(run_id, r, step) as tx:
                for table, table_rows in tables.items():
                    tx.insert(table, table_rows)
                if step == "gate":
                    tx.set_model_role(f"{run_id}/r{r}/candidate", "champion")
            with store() as s:
                if not s.heartbeat_lease(run_id, holder, 120):
                    raise RuntimeError(f"{run_id}: lease lost")
        with store() as s:
            s.finish_round(run_id, r, s.champion(run_id), {"round": r})
    with store() as s:
        s.release_lease(run_id, holder)
    return {"run": run_id, "wall_s": round(time.perf_counter() - t0, 2), "store_opens": opens}


def expected_rows(run_id: str, rounds: int, n: int) -> dict:
    """What `write_run` must leave: the same calls on a fresh embedded DuckDB file (the default backend), read
    back with `run_rows`."""
    from rsiflow.stores.store import Store

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "expected.duckdb"
        write_run(str(path), None, run_id, rounds, n)
        with Store(path, read_only=True) as s:
            return run_rows(s, run_id, "")


def _writer_main(argv: list[str]) -> int:
    """Subprocess entry: `python -m bench.lake --writer SPEC DATA RUN ROUNDS N` prints write_run's JSON."""
    spec, data, run_id, rounds, n = argv
    print(json.dumps(write_run(spec, data, run_id, int(rounds), int(n))), flush=True)
    return 0


# Every child process started, so that an interrupted bench stops them (`_stop_children`).
_CHILDREN: list[subprocess.Popen] = []


def _popen(*args, **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(*args, **kwargs)
    _CHILDREN.append(proc)
    return proc


def _stop_children() -> None:
    for proc in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawn(spec: str, data: str, run_id: str, rounds: int, n: int, log: Path) -> subprocess.Popen:
    return _popen([sys.executable, "-m", "bench.lake", "--writer", spec, data, run_id, str(rounds), str(n)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def _collect(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a writer exited with {p.returncode}: see its log")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def store_case(cluster: PostgresCluster, n_writers: int, rounds: int, n: int, out: Path) -> dict:
    """N writers at once on one lake, then the same N one after another on a fresh lake; rows checked."""
    from rsiflow.stores.store import Store

    runs = [f"w{i}" for i in range(n_writers)]
    expected = {r: expected_rows(r, rounds, n) for r in runs}
    result: dict = {"writers": n_writers, "rounds": rounds, "trajectories_per_round": n}
    for mode in ("concurrent", "sequential"):
        spec = cluster.createdb(f"bench_{mode}_{n_writers}")
        data = out / f"{mode}-{n_writers}" / "data"
        logs = out / f"{mode}-{n_writers}"
        logs.mkdir(parents=True, exist_ok=True)
        # the lake's schema first (one process), so both modes time the writes, not N migrations racing
        Store(spec, lake_data_path=data).close()
        t0 = time.perf_counter()
        if mode == "concurrent":
            writers = _collect([_spawn(spec, str(data), r, rounds, n, logs / f"{r}.log") for r in runs])
        else:
            writers = [w for r in runs for w in _collect([_spawn(spec, str(data), r, rounds, n, logs / f"{r}.log")])]
        wall = time.perf_counter() - t0
        checks = {}
        with Store(spec, read_only=True) as s:
            for r in runs:
                checks[r] = compare_runs(expected[r], run_rows(s, r, ""))
                checks[r]["lease_left"] = s.lease(r) is not None
        bad = sum(c["lost"] + c["duplicate"] + c["changed"] + c["lease_left"] for c in checks.values())
        result[mode] = {"wall_s": round(wall, 1), "writers": writers, "checks": checks, "bad_rows": bad,
                        "rows": sum(c["rows_got"] for c in checks.values())}
    result["speedup"] = round(result["sequential"]["wall_s"] / result["concurrent"]["wall_s"], 2)
    return result


# ---- tiny rounds ---------------------------------------------------------------------------------------------

# Two different runs: another seed, and SRD's template notes so that train, gate and deploy do real work.
TINY_RUNS = {"lake-a": ["run.seed=0"], "lake-b": ["run.seed=1", "generate.tasks_per_round=6"]}
# run.threads fixed: two runs at once on `auto` take one thread each, one run alone both cores, and decoding
# attention's sums differ in the last bits between thread counts (models/threads.py); rows must match bit for bit
TINY_SETS = ["distill.methods=[exit,srd]", "distill.srd.note_writer=template", "run.threads=1"]


def tiny_command(python: str, run: str, store: str, folder: Path, rounds: int, extra: list[str],
                 data_path: str | None = None) -> list[str]:
    sets = [*TINY_SETS, *extra, f"run.name={run}", f"run.store={store}", f"run.run_dir={folder}/runs/{{name}}"]
    if data_path:
        sets.append(f"run.lake_data_path={data_path}")
    return [python, "-m", "rsiflow.flows.cli", "run", "--config", str(REPO / "configs" / "tiny.yaml"), "--rounds",
            str(rounds), *[a for s in sets for a in ("--set", s)]]


def tiny_env(prefect_home: Path) -> dict:
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PREFECT_API_URL", None)
    return env


def run_tiny(cluster: PostgresCluster, rounds: int, out: Path, python: str = sys.executable,
             all_at_once: bool = False) -> dict:
    """The two tiny runs at once on one lake, then one after another on embedded files; rows compared. With
    `all_at_once` the file runs start beside the lake runs (four processes, one thread each: the rows are the same,
    the walls are no longer a comparison; the test suite uses it to save the sequential file runs' time)."""
    from rsiflow.stores.store import Store

    spec = cluster.createdb("tiny_lake")
    lake_dir = out / "lake"

    def start(run: str, extra: list[str], folder: Path, store: str, data_path: str | None) -> subprocess.Popen:
        folder.mkdir(parents=True, exist_ok=True)
        return _popen(tiny_command(python, run, store, folder, rounds, extra, data_path), cwd=REPO,
                      env=tiny_env(folder / "prefect"), stdout=open(folder / "log", "w"), stderr=subprocess.STDOUT)

    def start_file(run: str, extra: list[str]) -> subprocess.Popen:
        folder = out / "file" / run
        return start(run, extra, folder, str(folder / "store.duckdb"), None)

    t0 = time.perf_counter()
    procs = {run: start(run, extra, lake_dir / run, spec, str(lake_dir / "data")) for run, extra in TINY_RUNS.items()}
    files = {run: start_file(run, extra) for run, extra in TINY_RUNS.items()} if all_at_once else {}
    codes = {run: p.wait() for run, p in procs.items()}
    lake_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    file_codes = {run: (files.get(run) or start_file(run, extra)).wait() for run, extra in TINY_RUNS.items()}
    file_wall = time.perf_counter() - t0
    result: dict = {"rounds": rounds, "all_at_once": all_at_once, "lake_concurrent_wall_s": round(lake_wall, 1),
                    "files_sequential_wall_s": round(file_wall, 1), "exit_codes": {"lake": codes, "file": file_codes},
                    "checks": {}}
    if any(codes.values()) or any(file_codes.values()):
        return result
    with Store(spec, read_only=True) as lake:
        for run in TINY_RUNS:
            with Store(out / "file" / run / "store.duckdb", read_only=True) as f:
                expected = run_rows(f, run, out / "file" / run)
            got = run_rows(lake, run, lake_dir / run)
            check = compare_runs(expected, got)
            check["rounds_completed"] = lake.last_completed_round(run)
            check["lease_left"] = lake.lease(run) is not None
            check["tables"] = {t: len(rows) for t, rows in got.items() if rows}
            result["checks"][run] = check
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--writer"]:
        return _writer_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writers", type=int, nargs="+", default=[2, 4], help="N: runs writing the lake at once")
    p.add_argument("--rounds", type=int, default=3, help="rounds each writer writes (store-write workload)")
    p.add_argument("--rows", type=int, default=32, help="trajectories per generate step (3 turns each)")
    p.add_argument("--tiny-rounds", type=int, default=0, help="instead: two tiny runs of this many rounds each")
    p.add_argument("--all-at-once", action="store_true", help="with --tiny-rounds: start the file runs beside the "
                   "lake runs (same rows, no wall-time comparison; the test suite's setting)")
    p.add_argument("--catalog", type=Path, help="use the running cluster whose socket folder this is (port 5433; "
                   "e.g. a test's) instead of starting one")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="rsiflow-lake-bench-")))
    args = p.parse_args(argv)
    missing = lake_missing()
    if missing:
        print(f"bench.lake: {missing}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a timeout) unwinds like Ctrl-C, so the PostgreSQL cluster is stopped and its folder removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict = {"python": sys.executable, "cases": []}
    try:
        with postgres_cluster() if args.catalog is None else nullcontext(PostgresCluster.existing(args.catalog)) \
                as cluster:
            if args.tiny_rounds:
                results["tiny"] = run_tiny(cluster, args.tiny_rounds, args.out, all_at_once=args.all_at_once)
            else:
                for n in args.writers:
                    results["cases"].append(store_case(cluster, n, args.rounds, args.rows, args.out))
    finally:
        _stop_children()
    (args.out / "lake.json").write_text(json.dumps(results, indent=1))
    bad = 0
    if "tiny" in results:
        t = results["tiny"]
        files = ("on DuckDB files beside them" if t["all_at_once"]
                 else f"one after another on DuckDB files {t['files_sequential_wall_s']} s")
        print(f"tiny runs, {t['rounds']} rounds each: 2 at once on one lake {t['lake_concurrent_wall_s']} s; "
              f"{files}; exit codes {t['exit_codes']}")
        for run, c in t["checks"].items():
            print(f"  {run}: {c['rows']} rows expected, {c['rows_got']} in the lake: lost {c['lost']}, duplicated "
                  f"{c['duplicate']}, changed {c['changed']}; rounds {c['rounds_completed']}; "
                  f"lease left {c['lease_left']}")
            bad += c["lost"] + c["duplicate"] + c["changed"] + c["lease_left"]
        bad += sum(map(bool, [*t["exit_codes"]["lake"].values(), *t["exit_codes"]["file"].values()]))
        bad += not t["checks"]
    else:
        print("| N writers | rounds each | rows written | at once (s) | one after another (s) | speedup | rows wrong |")
        print("|---|---|---|---|---|---|---|")
        for c in results["cases"]:
            wrong = c["concurrent"]["bad_rows"] + c["sequential"]["bad_rows"]
            print(f"| {c['writers']} | {c['rounds']} | {c['concurrent']['rows']} | {c['concurrent']['wall_s']} | "
                  f"{c['sequential']['wall_s']} | {c['speedup']}x | {wrong} |")
            bad += wrong
    print(f"details: {args.out / 'lake.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
