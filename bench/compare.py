"""Compare configs ("arms") over seeds and rounds in one run: one table, one plot.

    python -m bench.compare --config configs/default.yaml [--config overlay.yaml] \\
        --arm exit --arm "srd:distill.methods=[exit,srd],train.epochs=2" \\
        --seeds 0,1,2 --rounds 3 [--set key=val ...] --out bench/results/<name>
    python -m bench.compare --out bench/results/<name> --report-only
    python -m bench.compare --out bench/results/<name> --report-only --merge bench/results/<part-2> \
        --arm exit --arm srd --seeds 0,1,2

A comparison can be split over processes or machines (one out folder each, e.g. one per arm) and
merged: `--merge OUT_DIR` copies that folder's runs into this folder's store first.

An arm is `NAME[:KEY=VAL,KEY=VAL...]`: the overrides that make it differ from the common config.
Commas inside brackets, braces or quotes belong to the value (`distill.methods=[exit,srd]` is one
override); `;` also separates overrides. `--set` overrides apply to every arm (the arm's own win).

Each (arm, seed) is one run named `<arm>-s<seed>`, executed one at a time as a subprocess
`rsiflow run --config ... --set ...` with run.seed=<seed>, run.rounds=<rounds>,
run.store=<out>/compare.duckdb and run.run_dir=<out>/runs/{name} (one store for all: DuckDB
allows one writer, so runs go one after another, and each subprocess frees its memory). Logs go
to <out>/logs/<run>.log. The runs report to one temporary Prefect API server started here (unless
PREFECT_API_URL is set), which stops with this process. Running the same command again skips runs the
store already has with all their rounds (and their final test split, where the config asks for one) and
resumes unfinished ones (`rsiflow run` continues a run by name; one with all its rounds plays only its
missing split).

A finished run is also written to <out>/records/<run>.json: its per-round figures and final test, all the
report reads, in a few kilobytes. The store and the checkpoints stay out of version control; the records are
committed, so a comparison longer than one machine session continues on a fresh checkout: a run with a record
of all its rounds is skipped, and the report reads it from the record when the store lacks it. A run cut off
before its end continues there too with --pack: each time one of its rounds completes, its rows up to that round
are written to <out>/packs/<run>.duckdb.gz (~0.3 MB a household round); commit the packs, and the same command on
the fresh checkout merges them into its store first and resumes after the packed rounds (the round that was in
progress starts again). A finished run's pack is removed (its record replaces it). Packs carry rows, not
checkpoints: a run whose champion is a trained candidate is not packed (copy its runs/ folder instead).

Then the store is read (read-only) and written as
- <out>/learning.md (also at the top of table.md): per arm and round the serving model's held-out
  success per seed, greedy and sampled, the mean over seeds, the gate's decisions with their p-values
  and detectable gain, the learning diagnostics; then each run's final test split.
- <out>/table.md, <out>/table.csv: per arm and round (round 0 = the base model): the serving
  champion's held-out success per seed (k/n), over seeds (with a Wilson interval only with
  --heldout-per-seed), and the mean over seeds; the candidate's held-out success where one was trained; gate decisions;
  training-rollout success and generated tokens per success; the round's wall time; and every
  scalar in the round's `metrics` JSON (rounds table), averaged over seeds (multi-line or long text,
  such as X-Tree's rendered outline, is left to the run's report).
- <out>/runs.csv: the same per (arm, seed, round), unaggregated.
- <out>/success.png: held-out success per round, one line per arm (mean over seeds) with the
  pooled interval as a band.

Held-out tasks come from gate.seed, which is the same for every seed unless --heldout-per-seed:
then the arms are compared on the same tasks (paired), and no interval is pooled over seeds (the
seeds' repeats of a task are not independent evidence: report per seed). With --heldout-per-seed
each seed plays its own held-out sample and its own final test split (gate.seed + seed,
gate.test_seed + seed), so an interval over seeds is honest.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class Arm:
    name: str
    overrides: list[str] = field(default_factory=list)


def split_overrides(text: str) -> list[str]:
    """Split `a=1,b=[x,y];c='p,q'` on top-level commas and semicolons (not inside [] {} () or quotes)."""
    parts, buf, depth, quote = [], [], 0, None
    for ch in text:
        if quote:
            buf.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            buf.append(ch)
        elif ch in "[{(":
            depth += 1
            buf.append(ch)
        elif ch in "]})":
            depth -= 1
            buf.append(ch)
        elif ch in ",;" and depth <= 0:
            parts.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    if quote or depth:
        raise ValueError(f"unbalanced brackets or quotes in arm overrides {text!r}")
    parts.append("".join(buf))
    parts = [p.strip() for p in parts if p.strip()]
    for p in parts:
        if "=" not in p:
            raise ValueError(f"arm override {p!r} in {text!r}: expected KEY.PATH=VALUE")
    return parts


def parse_arm(text: str) -> Arm:
    name, _, rest = text.partition(":")
    name = name.strip()
    if not NAME_RE.match(name):
        raise ValueError(f"arm name {name!r}: use letters, digits, '_', '.' or '-'")
    return Arm(name, split_overrides(rest) if rest.strip() else [])


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-s{seed}"


# ---- running -----------------------------------------------------------------------------

def _completed_rounds(store_path: Path, run_id: str) -> int:
    """The last round of `run_id` completed in the store, or in its record (-1: none)."""
    done = -1
    if store_path.exists():
        from rsiflow.stores.store import Store

        with Store(store_path, read_only=True) as store:
            done = store.last_completed_round(run_id)
    record = read_record(store_path.parent, run_id)
    return max(done, record["rounds_completed"] if record else -1)


def _final_test_missing(store_path: Path, run_id: str) -> bool:
    """Whether neither the store nor the run's record holds the run's final test split (a run stopped after its
    last round, while it played the split)."""
    record = read_record(store_path.parent, run_id)
    if record and record.get("final_test") is not None:
        return False
    if not store_path.exists():
        return True
    from rsiflow.stores.store import Store
    from rsiflow.tasks.final_test import stored_final_test

    with Store(store_path, read_only=True) as store:
        return stored_final_test(store, run_id) is None


def _finished(store_path: Path, run_id: str, rounds: int | None) -> bool:
    """Whether the run has completed `rounds` rounds and its final test split is stored (a run configured without
    one counts as unfinished: packing it again is harmless)."""
    return rounds is not None and _completed_rounds(store_path, run_id) >= rounds \
        and not _final_test_missing(store_path, run_id)


def _wants_final_test(args, arm: Arm, seed: int, out: Path) -> bool:
    """Whether the run's config asks for a final test split (gate.test_tasks)."""
    from rsiflow.configs.loader import load_config

    return load_config(args.config, run_overrides(args, arm, seed, out)).gate.test_tasks > 0


# ---- records: a finished run's figures, outside the store ------------------------------------

RECORD_VERSION = 1


def record_path(out: Path, run_id: str) -> Path:
    return out / "records" / f"{run_id}.json"


def read_record(out: Path, run_id: str) -> dict | None:
    """The run's record, or None. A record of another version is an error: rebuild it from its store."""
    path = record_path(out, run_id)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if record.get("version") != RECORD_VERSION:
        raise ValueError(f"{path}: record version {record.get('version')!r}, this code reads {RECORD_VERSION}; "
                         "rewrite it with `python -m bench.compare --out ... --report-only` from the run's store")
    return record


def write_record(out: Path, run_id: str) -> Path:
    """Write `run_id`'s figures from the comparison store to <out>/records/<run_id>.json."""
    from rsiflow.stores.store import Store
    from rsiflow.tasks.final_test import stored_final_test

    with Store(out / "compare.duckdb", read_only=True) as store:
        record = {"version": RECORD_VERSION, "run_id": run_id,
                  "rounds_completed": store.last_completed_round(run_id),
                  "rows": run_rows(store, run_id), "final_test": stored_final_test(store, run_id)}
    path = record_path(out, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path


# ---- packs: an unfinished run's completed rounds, carried to another checkout ----------------------

def run_tables(con, catalog: str) -> dict[str, set[str]]:
    """The tables of the attached database `catalog` on the DuckDB connection `con` that hold rows per run (a
    `run_id` column), each with its column names."""
    columns: dict[str, set[str]] = {}
    for table, column in con.execute("SELECT table_name, column_name FROM information_schema.columns"
                                     " WHERE table_catalog = ? AND table_schema = 'main'", [catalog]).fetchall():
        columns.setdefault(table, set()).add(column)
    return {t: cols for t, cols in columns.items() if "run_id" in cols}


def pack_path(out: Path, run_id: str) -> Path:
    return out / "packs" / f"{run_id}.duckdb.gz"


def write_pack(out: Path, run_id: str, wait_s: float = 30.0) -> Path | None:
    """Write `run_id`'s completed rounds from <out>/compare.duckdb to <out>/packs/<run_id>.duckdb.gz: every row
    of the run in a round up to its last completed one (round 0 is its start), none of a round in progress (its
    checkpoints stay behind on this machine) and no lease. A store of its own, gzipped (a round of 128 household
    episodes packed to ~0.3 MB), so a run longer than one machine session continues on a fresh checkout: the next
    `bench.compare` there merges the pack into its store and resumes after the packed rounds. None when the run
    has no completed round. A run whose champion is a trained checkpoint cannot be packed (the pack carries rows,
    not weights): ValueError, naming the checkpoint."""
    import duckdb

    from rsiflow.stores.store import Store

    source = out / "compare.duckdb"
    with Store(source, read_only=True, wait_s=wait_s) as store:
        done = store.last_completed_round(run_id)
        if done < 0:
            return None
        champion = store.rows("SELECT m.model_id, m.role, m.path FROM rounds r JOIN models m"
                              " ON m.model_id = r.champion_after WHERE r.run_id = ? AND r.round = ?", [run_id, done])
    if champion and champion[0]["role"] != "base":
        raise ValueError(f"{run_id}: the champion after round {done} is the trained checkpoint "
                         f"{champion[0]['path']}; a pack carries the store's rows, not weights: copy the run's "
                         f"folder {out / 'runs' / run_id} along instead")
    path = pack_path(out, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_db = path.with_name(f".{run_id}.pack.duckdb")
    tmp_db.unlink(missing_ok=True)
    with Store(tmp_db):  # the schema of this code
        pass
    con = duckdb.connect(str(tmp_db))
    try:
        con.execute(f"ATTACH '{source}' AS src (READ_ONLY)")
        con.begin()
        for table, cols in sorted(run_tables(con, "src").items()):
            if table == "leases":
                continue
            cut = " AND round <= ?" if "round" in cols else ""
            con.execute(f'INSERT INTO main."{table}" BY NAME SELECT * FROM src."{table}" WHERE run_id = ?{cut}',
                        [run_id, done] if cut else [run_id])
        con.commit()
        con.execute("DETACH src")
        con.execute("CHECKPOINT")
    finally:
        con.close()
    tmp_gz = path.with_name(f".{run_id}.pack.gz")
    with open(tmp_db, "rb") as src_f, gzip.open(tmp_gz, "wb", compresslevel=6) as dst_f:
        shutil.copyfileobj(src_f, dst_f)
    tmp_db.unlink()
    Path(f"{tmp_db}.wal").unlink(missing_ok=True)
    tmp_gz.replace(path)
    return path


def _unpacked(pack: Path, into: Path) -> Path:
    """The DuckDB file of a gzipped pack, written to `into` (a folder)."""
    dest = into / pack.name.removesuffix(".gz")
    with gzip.open(pack, "rb") as src_f, open(dest, "wb") as dst_f:
        shutil.copyfileobj(src_f, dst_f)
    return dest


def merge_packs(out: Path, run_ids: list[str]) -> list[str]:
    """Merge into <out>/compare.duckdb each of these runs' pack that holds more completed rounds than the store
    (a fresh checkout of a comparison that ran elsewhere); returns the runs merged."""
    packs = [pack_path(out, r) for r in run_ids if pack_path(out, r).exists()]
    if not packs:
        return []
    with tempfile.TemporaryDirectory(prefix="rsiflow-pack-") as tmp:
        return merge_runs(out, [_unpacked(p, Path(tmp)) for p in packs])


def run_overrides(args, arm: Arm, seed: int, out: Path) -> list[str]:
    own = [f"run.name={run_name(arm.name, seed)}", f"run.seed={seed}", f"run.rounds={args.rounds}",
           f"run.store={out / 'compare.duckdb'}", f"run.run_dir={out / 'runs'}/{{name}}"]
    if args.heldout_per_seed:
        from rsiflow.configs.loader import load_config

        base = load_config(args.config, list(args.set) + arm.overrides)
        own += [f"gate.seed={base.gate.seed + seed}", f"gate.test_seed={base.gate.test_seed + seed}"]
    return list(args.set) + arm.overrides + own


def run_all(args, arms: list[Arm], seeds: list[int], out: Path) -> list[str]:
    """Run every (arm, seed) not yet complete, one at a time; return the names that failed."""
    store = out / "compare.duckdb"
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    failed = []
    # seed-major: every arm of seed 0 first, so a comparison cut short stays balanced across arms
    todo = [(a, s) for s in seeds for a in arms]
    merged = merge_packs(out, [run_name(a.name, s) for a, s in todo])
    if merged:
        print(f"bench.compare: merged the packs of {merged} (their completed rounds, from another checkout)",
              flush=True)
    for i, (arm, seed) in enumerate(todo, 1):
        name = run_name(arm.name, seed)
        done = _completed_rounds(store, name)
        if done >= args.rounds:
            if not (_wants_final_test(args, arm, seed, out) and _final_test_missing(store, name)):
                print(f"[{i}/{len(todo)}] {name}: {done} round(s) already in the store, skipped", flush=True)
                continue
            # `rsiflow run` on a run with all its rounds plays only what is missing: the final test split
            print(f"[{i}/{len(todo)}] {name}: {done} round(s) done, its final test split is not: playing it",
                  flush=True)
        if not env.get("PREFECT_API_URL"):
            # One temporary Prefect API server for every run of the comparison, dying with this process (each
            # `rsiflow run` would start its own: ~20 s a run on 2 cores).
            from rsiflow.flows.cli import start_temporary_prefect_server

            env["PREFECT_API_URL"] = start_temporary_prefect_server()
        cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run"]
        for c in args.config:
            cmd += ["--config", c]
        for o in run_overrides(args, arm, seed, out):
            cmd += ["--set", o]
        log = logs / f"{name}.log"
        print(f"[{i}/{len(todo)}] {name}: running (log {log}) ...", flush=True)
        t0 = time.perf_counter()
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = _wait(proc, out, name, done) if args.pack else proc.wait()
            except BaseException:
                # Interrupted (Ctrl-C, SIGTERM): take the run down with us (the Prefect server started here
                # stops with this process); the run resumes from its last completed step next time.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        dt = time.perf_counter() - t0
        if rc != 0:
            failed.append(name)
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            print(f"    {name}: FAILED (exit {rc}) after {dt:.0f} s; last lines of {log}:\n{tail}", flush=True)
        else:
            print(f"    {name}: done in {dt:.0f} s; record {write_record(out, name)}", flush=True)
            pack_path(out, name).unlink(missing_ok=True)   # the record holds what the report needs
    return failed


PACK_POLL_S = 60.0


def _wait(proc: subprocess.Popen, out: Path, run_id: str, packed: int) -> int:
    """Wait for the run's process, writing its pack each time another round completes (--pack)."""
    while True:
        try:
            return proc.wait(timeout=PACK_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            done = _completed_rounds(out / "compare.duckdb", run_id)
            if done > packed:
                write_pack(out, run_id, wait_s=5.0)
                packed = done
                print(f"    {run_id}: packed {done} completed round(s) to {pack_path(out, run_id)}", flush=True)
        except Exception as err:  # the store busy, or a champion that cannot be packed: the run goes on
            print(f"    {run_id}: no pack this time: {type(err).__name__}: {err}", flush=True)


def merge_runs(out: Path, sources: list[Path]) -> list[str]:
    """Copy into <out>/compare.duckdb the runs of other comparison folders (a comparison split over
    processes or machines, each with its own store). A run is copied when the destination lacks it
    or has fewer completed rounds of it (its old rows are replaced). Returns the runs copied."""
    import duckdb

    from rsiflow.stores.store import Store

    dest = out / "compare.duckdb"
    with Store(dest):  # creates the file and applies the migrations
        pass
    con = duckdb.connect(str(dest))
    copied = []

    def done(db: str, run_id: str) -> int:
        """The last completed round of `run_id` in the attached database `db` (-1: none)."""
        return con.execute(f"SELECT coalesce(max(round), -1) FROM {db}.rounds"
                           " WHERE run_id = ? AND status = 'completed'", [run_id]).fetchall()[0][0]

    try:
        tables = sorted(run_tables(con, con.execute("SELECT current_database()").fetchall()[0][0]))
        for i, src in enumerate(sources):
            path = Path(src) / "compare.duckdb" if Path(src).is_dir() else Path(src)
            if not path.is_file():
                raise FileNotFoundError(f"--merge {src}: no comparison store at {path}")
            alias = f"src{i}"
            con.execute(f"ATTACH '{path}' AS {alias} (READ_ONLY)")
            # A store written by older code lacks the tables of later migrations: its runs have no rows there.
            has = run_tables(con, alias)
            for (run_id,) in con.execute(f"SELECT run_id FROM {alias}.runs ORDER BY run_id").fetchall():
                exists = con.execute("SELECT count(*) FROM main.runs WHERE run_id = ?", [run_id]).fetchall()[0][0]
                if exists and done("main", run_id) >= done(alias, run_id):
                    continue
                con.begin()
                for t in tables:
                    con.execute(f'DELETE FROM main."{t}" WHERE run_id = ?', [run_id])
                    if t in has:
                        con.execute(f'INSERT INTO main."{t}" BY NAME SELECT * FROM {alias}."{t}" WHERE run_id = ?',
                                    [run_id])
                con.commit()
                copied.append(run_id)
            con.execute(f"DETACH {alias}")
    finally:
        con.close()
    return copied


# ---- reading the store -------------------------------------------------------------------

_SHOWN = {"round", "champion_before", "champion_after", "champion_heldout", "candidate_heldout", "decision",
          "train_success", "step_seconds", "champion_sampled", "candidate_sampled", "heldout_by_type", "paired",
          "diagnostics", "logprob_change", "replay"}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, str) and ("\n" in v or len(v) > 80):
            continue  # prose (a rendered tree, a workflow) belongs in the run's report, not in a table cell
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v
    return out


def run_rows(store, run_id: str) -> list[dict]:
    """Per round of one run (round 0 = the base): what the table aggregates."""
    from rsiflow.tasks.report import heldout_series, round_rows

    rows = round_rows(store, run_id)
    if not rows:
        return []
    serving = heldout_series(rows)
    serving_sampled = heldout_series(rows, "sampled")
    rounds = {r["round"]: r for r in store.rows(
        "SELECT round, status, epoch(finished_at - started_at) AS wall_s, CAST(metrics AS VARCHAR) AS metrics"
        " FROM rounds WHERE run_id = ?", [run_id])}
    gen = {r["round"]: r for r in store.rows(
        "SELECT round, count(*) AS episodes, count(*) FILTER (WHERE success) AS successes,"
        " coalesce(sum(gen_tokens), 0) AS gen_tokens FROM trajectories"
        " WHERE run_id = ? AND step = 'generate' GROUP BY round", [run_id])}
    out = [{"round": 0, "serving": serving[0][1], "serving_sampled": serving_sampled[0][1], "candidate": None,
            "decision": None}]
    for r, (_, served), (_, served_sampled) in zip(rows, serving[1:], serving_sampled[1:]):
        meta = rounds.get(r["round"], {})
        metrics = json.loads(meta["metrics"]) if meta.get("metrics") else r
        g = gen.get(r["round"], {})
        out.append({
            "round": r["round"], "serving": served, "candidate": r["candidate_heldout"], "decision": r["decision"],
            "serving_sampled": served_sampled, "candidate_sampled": r.get("candidate_sampled"),
            "champion_sampled": r.get("champion_sampled"), "p_value": r.get("p_value"), "metric": r.get("metric"),
            "detectable_gain": r.get("detectable_gain"), "learning": learning_figures(r),
            "train_episodes": g.get("episodes", 0), "train_successes": g.get("successes", 0),
            "gen_tokens": int(g.get("gen_tokens", 0)),
            "wall_s": (_round(float(meta["wall_s"]))
                       if meta.get("wall_s") is not None and meta.get("status") == "completed" else None),
            "steps_s": _round(sum(r["step_seconds"].values())),
            "step_seconds": r["step_seconds"],
            "extras": {k: v for k, v in _flatten({k: v for k, v in metrics.items() if k not in _SHOWN}).items()},
        })
    return out


def learning_figures(r: dict) -> dict:
    """A round's learning diagnostics in flat form (tasks/diagnostics.py, the trainer's logprob change)."""
    d, lp = r.get("diagnostics") or {}, r.get("logprob_change") or {}
    tt, kl, ch = d.get("train_tasks") or {}, d.get("kl") or {}, d.get("heldout_changed") or {}
    return {"own_candidate": tt.get("candidate_sampled"), "own_champion": tt.get("champion_sampled"),
            "own_p": tt.get("sampled_p_value"), "own_greedy_candidate": tt.get("candidate_greedy"),
            "own_greedy_champion": tt.get("champion_greedy"),
            "dlogp_pos": (lp.get("positive") or {}).get("delta"), "dlogp_neg": (lp.get("negative") or {}).get("delta"),
            "kl": kl.get("mean"), "changed": ch.get("share"), "lr": r.get("learning_rate")}


def collect(out: Path, arms: list[str], seeds: list[int]) -> tuple[dict, dict]:
    """Per (arm, seed): the run's rows and its final test (tasks/final_test.py, or None), from the store, or
    from the run's record where that has more completed rounds (a run finished on another checkout)."""
    from rsiflow.stores.store import Store
    from rsiflow.tasks.final_test import stored_final_test

    data, tests = {}, {}
    store_path = out / "compare.duckdb"
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(Store(store_path, read_only=True)) if store_path.exists() else None
        for arm in arms:
            for seed in seeds:
                name = run_name(arm, seed)
                record = read_record(out, name)
                if store is not None and (record is None
                                          or store.last_completed_round(name) >= record["rounds_completed"]):
                    data[(arm, seed)] = run_rows(store, name)
                    tests[(arm, seed)] = stored_final_test(store, name)
                elif record is not None:
                    data[(arm, seed)], tests[(arm, seed)] = record["rows"], record["final_test"]
                else:
                    data[(arm, seed)], tests[(arm, seed)] = [], None
    return data, tests


# ---- aggregating and writing --------------------------------------------------------------

def _pool(hs: list[dict | None], confidence: float = 0.95) -> dict | None:
    from rsiflow.stats.success import wilson_interval

    hs = [h for h in hs if h]
    if not hs:
        return None
    k, n = sum(int(h["successes"]) for h in hs), sum(int(h["n"]) for h in hs)
    lo, hi = wilson_interval(k, n, confidence)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci_low": lo, "ci_high": hi,
            "mean": sum(h["success_rate"] for h in hs) / len(hs), "seeds": len(hs)}


def _round(x, nd=2):
    return None if x is None else round(x, nd)


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool) and x is not None
          and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def aggregate(data: dict, arms: list[str], seeds: list[int]) -> tuple[list[dict], list[str]]:
    """One dict per (arm, round) with pooled/mean figures; and the extra metric keys, in first-seen order."""
    extra_keys: list[str] = []
    for rows in data.values():
        for r in rows:
            for k in r.get("extras", {}):
                if k not in extra_keys:
                    extra_keys.append(k)
    table = []
    for arm in arms:
        n_rounds = max((len(data[(arm, s)]) for s in seeds), default=0)
        for i in range(n_rounds):
            per = [(s, data[(arm, s)][i]) for s in seeds if i < len(data[(arm, s)])]
            rows = [r for _, r in per]
            rnd = rows[0]["round"]
            serving = _pool([r["serving"] for r in rows])
            cand = _pool([r["candidate"] for r in rows])
            decisions = [r["decision"] for r in rows if r["decision"]]
            agg = {
                "arm": arm, "round": rnd, "seeds": len(rows),
                "serving_per_seed": {
                    s: f"{int(r['serving']['successes'])}/{int(r['serving']['n'])}" if r["serving"] else None
                    for s, r in per},
                "serving": serving, "candidate": cand,
                "decisions": {d: decisions.count(d) for d in dict.fromkeys(decisions)},
                "train_episodes": sum(r.get("train_episodes", 0) for r in rows),
                "train_successes": sum(r.get("train_successes", 0) for r in rows),
                "gen_tokens": sum(r.get("gen_tokens", 0) for r in rows),
                "wall_s": _round(_mean([r.get("wall_s") for r in rows])),
                "steps_s": _round(_mean([r.get("steps_s") for r in rows])),
                "extras": {},
            }
            for k in extra_keys:
                vals = [r.get("extras", {}).get(k) for r in rows]
                m = _mean(vals)
                if m is None:
                    strs = sorted({str(v) for v in vals if v is not None})
                    m = "/".join(strs) if strs else None
                agg["extras"][k] = m
            table.append(agg)
    return table, extra_keys


def _f(x, fmt=".3f", none="-"):
    if x is None:
        return none
    if isinstance(x, float):
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else format(x, fmt)
    return str(x)


def _tps(row) -> float | None:
    return row["gen_tokens"] / row["train_successes"] if row["train_successes"] else None


def _pooled_text(p: dict | None, interval: bool = True) -> str:
    if not p:
        return "-"
    text = f"{p['k']}/{p['n']} = {p['rate']:.3f}"
    return text + f" [{p['ci_low']:.3f}, {p['ci_high']:.3f}]" if interval else text


def markdown(table: list[dict], extra_keys: list[str], title: str, note: str, distinct_tasks: bool = True) -> str:
    """The per-round table. A pooled interval over seeds is shown only when every seed played its own held-out
    tasks (`distinct_tasks`); otherwise the seeds' repeats of one task are not independent evidence and the pooled
    cell gives the count only."""
    pooled = "held-out pooled [95% CI]" if distinct_tasks else "held-out over seeds (same tasks: no interval)"
    head = ["arm", "round", "held-out per seed", pooled, "mean", "candidate " + pooled.removeprefix("held-out "),
            "gate", "train success", "tokens/success", "wall s", *extra_keys]
    lines = [f"# {title}", "", note, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        per = " ".join(v or "-" for v in r["serving_per_seed"].values())
        dec = ", ".join(f"{d}×{c}" for d, c in r["decisions"].items()) or "-"
        ts = (f"{r['train_successes']}/{r['train_episodes']}" if r["train_episodes"] else "-")
        tps = _tps(r)
        cells = [r["arm"], str(r["round"]), per, _pooled_text(r["serving"], distinct_tasks),
                 _f(r["serving"]["mean"]) if r["serving"] else "-", _pooled_text(r["candidate"], distinct_tasks),
                 dec, ts,
                 f"{tps:.0f}" if tps is not None else ("∞" if r["train_episodes"] else "-"),
                 _f(r["wall_s"], ".0f"), *[_f(r["extras"].get(k)) for k in extra_keys]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(table: list[dict], extra_keys: list[str], path: Path) -> None:
    cols = ["arm", "round", "seeds", "heldout_per_seed", "heldout_k", "heldout_n", "heldout_rate", "heldout_ci_low",
            "heldout_ci_high", "heldout_mean", "candidate_k", "candidate_n", "candidate_rate", "candidate_ci_low",
            "candidate_ci_high", "decisions", "train_episodes", "train_successes", "gen_tokens",
            "tokens_per_success", "wall_s_mean", "steps_s_mean", *extra_keys]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in table:
            s, c = r["serving"] or {}, r["candidate"] or {}
            w.writerow([r["arm"], r["round"], r["seeds"],
                        ";".join(f"s{k}:{v}" for k, v in r["serving_per_seed"].items() if v),
                        s.get("k"), s.get("n"), s.get("rate"), s.get("ci_low"), s.get("ci_high"), s.get("mean"),
                        c.get("k"), c.get("n"), c.get("rate"), c.get("ci_low"), c.get("ci_high"),
                        ";".join(f"{d}:{n}" for d, n in r["decisions"].items()),
                        r["train_episodes"], r["train_successes"], r["gen_tokens"], _tps(r),
                        r["wall_s"], r["steps_s"], *[r["extras"].get(k) for k in extra_keys]])


def write_runs_csv(data: dict, extra_keys: list[str], path: Path) -> None:
    cols = ["arm", "seed", "round", "heldout_k", "heldout_n", "candidate_k", "candidate_n", "decision",
            "train_episodes", "train_successes", "gen_tokens", "wall_s", "steps_s", "step_seconds", *extra_keys]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for (arm, seed), rows in data.items():
            for r in rows:
                s, c = r["serving"] or {}, r["candidate"] or {}
                w.writerow([arm, seed, r["round"], s.get("successes"), s.get("n"), c.get("successes"), c.get("n"),
                            r["decision"], r.get("train_episodes"), r.get("train_successes"), r.get("gen_tokens"),
                            r.get("wall_s"), r.get("steps_s"),
                            json.dumps(r.get("step_seconds")) if r["round"] else None,
                            *[r.get("extras", {}).get(k) for k in extra_keys]])


def plot(table: list[dict], arms: list[str], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
    for i, arm in enumerate(arms):
        rows = [r for r in table if r["arm"] == arm and r["serving"]]
        if not rows:
            continue
        xs = [r["round"] + (i - (len(arms) - 1) / 2) * 0.03 for r in rows]  # a small dodge: bands overlap
        ys = [r["serving"]["mean"] for r in rows]
        line, = ax.plot(xs, ys, marker="o", label=f"{arm} (n={rows[0]['seeds']} seeds)")
        ax.fill_between(xs, [r["serving"]["ci_low"] for r in rows], [r["serving"]["ci_high"] for r in rows],
                        color=line.get_color(), alpha=0.15, linewidth=0)
    rounds = sorted({r["round"] for r in table})
    ax.set_xticks(rounds, ["base" if r == 0 else str(r) for r in rounds])
    ax.set_xlabel("round")
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success of the serving model")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _se(h: dict) -> float:
    """Standard error of a rate from its 95% interval."""
    return (h["ci_high"] - h["ci_low"]) / (2 * 1.96)


def _rates(hs: list[dict | None]) -> str:
    return " ".join(f"{h['success_rate']:.3f}" if h else "-" for h in hs)


def learning_markdown(data: dict, tests: dict, arms: list[str], seeds: list[int], distinct_tasks: bool) -> str:
    """The learning tables: per arm and round the serving model's held-out success per seed (greedy k/n, sampled
    rate), the mean over seeds and, only when every seed played its own held-out tasks (--heldout-per-seed), an
    interval over seeds; the gate's decisions with their p-values and detectable gain; the learning diagnostics
    (means over seeds); then the final test split per seed."""
    lines = ["## Held-out success per round and learning diagnostics", "",
             "serving: the model that serves after the round (round 0 = base). greedy: k/n per seed. sampled: the "
             "mean success of the sampled plays per seed (gate.samples per task), then the mean over seeds"
             + (" with a 95% interval from the per-seed standard errors (each seed played its own held-out tasks)"
                if distinct_tasks else " (no pooled interval: the seeds played the same held-out tasks)")
             + ". gate: decisions (p-values of the paired test). own tasks: the candidate vs the champion on the "
             "round's first training tasks (sampled). Δ logp: change of the trained tokens' mean logprob for positive "
             "/ negative advantage or weight. KL: KL(candidate ‖ champion) per action token on held-out prompts. "
             "changed: share of held-out greedy answers the candidate changed. Diagnostics are means over seeds.", "",
             "| arm | round | greedy per seed | sampled per seed | sampled mean"
             + (" [95% CI]" if distinct_tasks else "")
             + " | gate (p) | detectable gain | own tasks cand / champ | Δ logp + / - | KL | changed | lr | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        n_rounds = max((len(data[(arm, s)]) for s in seeds), default=0)
        for i in range(n_rounds):
            rows = [data[(arm, s)][i] if i < len(data[(arm, s)]) else None for s in seeds]
            present = [r for r in rows if r]
            greedy = " ".join(f"{int(r['serving']['successes'])}/{int(r['serving']['n'])}" if r and r["serving"]
                              else "-" for r in rows)
            sampled = [r.get("serving_sampled") if r else None for r in rows]
            got = [h for h in sampled if h]
            mean = sum(h["success_rate"] for h in got) / len(got) if got else None
            cell = _f(mean)
            if distinct_tasks and got:
                half = 1.96 * math.sqrt(sum(_se(h) ** 2 for h in got)) / len(got)
                cell += f" [{mean - half:.3f}, {mean + half:.3f}]"
            gate = ", ".join(f"{r['decision']}" + (f" ({r['p_value']:.2g})" if r.get("p_value") is not None else "")
                             for r in present if r.get("decision")) or "-"
            lf = [r.get("learning") or {} for r in present]

            def m(key, lf=lf):
                return _mean([x.get(key) for x in lf])
            own = f"{_f(m('own_candidate'))} / {_f(m('own_champion'))}" if m("own_candidate") is not None else "-"
            dlp = f"{_f(m('dlogp_pos'), '+.3f')} / {_f(m('dlogp_neg'), '+.3f')}"
            lr = _mean([x.get("lr") for x in lf])
            cells = [arm, str(present[0]["round"]) if present else str(i), greedy, _rates(sampled), cell, gate,
                     _f(_mean([r.get("detectable_gain") for r in present])), own, dlp, _f(m("kl"), ".4f"),
                     _f(m("changed")), f"{lr:.0e}" if lr else "-", _f(_mean([r.get("wall_s") for r in present]), ".0f")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Final test split (never read by a promotion decision)", "",
              "| arm | seed | promotions | base greedy | champion greedy | base sampled | champion sampled | "
              "champion − base, sampled [95% CI] | p (one-sided) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        for seed in seeds:
            t = tests.get((arm, seed))
            promotions = sum(r.get("decision") == "promote" for r in data[(arm, seed)])
            if not t:
                lines.append(f"| {arm} | {seed} | {promotions} | - | - | - | - | - | - |")
                continue
            mods = t["models"]

            def fig(tag, metric, mods=mods):
                f = (mods.get(tag) or {}).get(metric)
                return f"{f['successes']}/{f['plays']} = {f['rate']:.3f}" if f else "-"
            champ = "champion" if "champion" in mods else "base"
            pv = (t.get("champion_vs_base") or {}).get("sampled") or (t.get("champion_vs_base") or {}).get("greedy")
            diff = (f"{pv['paired_diff']:+.3f} [{pv['paired_diff_ci'][0]:+.3f}, {pv['paired_diff_ci'][1]:+.3f}]"
                    if pv else "0 (the base is the champion)")
            lines.append(f"| {arm} | {seed} | {promotions} | {fig('base', 'greedy')} | {fig(champ, 'greedy')} | "
                         f"{fig('base', 'sampled')} | {fig(champ, 'sampled')} | {diff} | "
                         f"{_f(pv['p_value'], '.3g') if pv else '-'} |")
    return "\n".join(lines) + "\n"


def report(out: Path, arms: list[str], seeds: list[int]) -> str:
    store = out / "compare.duckdb"
    if not store.exists() and not (out / "records").is_dir():
        sys.exit(f"bench.compare: no store at {store} and no records in {out / 'records'}")
    if store.exists():  # keep the records current with the store (a run finished here, or merged in)
        from rsiflow.stores.store import Store

        with Store(store, read_only=True) as st:
            stale = [run_name(a, s) for a in arms for s in seeds
                     if st.last_completed_round(run_name(a, s)) > ((read_record(out, run_name(a, s)) or {})
                                                                    .get("rounds_completed", -1))]
        for name in stale:
            write_record(out, name)
    data, tests = collect(out, arms, seeds)
    table, extra_keys = aggregate(data, arms, seeds)
    title = f"bench.compare: {', '.join(arms)} × seeds {','.join(map(str, seeds))}"
    note = ("held-out: the serving model (round 0 = base; then the champion after each round's gate), greedy; "
            "per seed k/n, over seeds (a 95% Wilson interval only when each seed played its own held-out tasks), "
            "mean over seeds. candidate: the round's "
            "trained candidate. train success / tokens per success: the round's training rollouts (generated tokens "
            "/ successes, pooled). wall s: the round's wall time (rounds table), mean over seeds. Further columns: "
            "the round's metrics JSON, mean over seeds.")
    manifest = _manifest(out) or {}
    distinct = bool(manifest.get("heldout_per_seed"))
    md = markdown(table, extra_keys, title, note, distinct)
    learning = learning_markdown(data, tests, arms, seeds, distinct)
    (out / "learning.md").write_text(learning)
    md = learning + "\n" + md
    (out / "table.md").write_text(md)
    write_csv(table, extra_keys, out / "table.csv")
    write_runs_csv(data, extra_keys, out / "runs.csv")
    plot(table, arms, out / "success.png", title)
    return md


def _manifest(out: Path) -> dict | None:
    p = out / "compare.json"
    return json.loads(p.read_text()) if p.exists() else None


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the current run too, not only this process
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--config", action="append", metavar="FILE", help="YAML config; repeat to overlay")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME[:K=V,K=V]",
                    help="an arm: a name and its overrides (repeatable)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per run (default: run.rounds of the config)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every arm")
    ap.add_argument("--out", required=True, help="output folder (store, logs, table, plot)")
    ap.add_argument("--heldout-per-seed", action="store_true",
                    help="gate.seed + seed: each seed plays its own held-out sample (see the notes)")
    ap.add_argument("--report-only", action="store_true", help="rebuild table and plot from the store; run nothing")
    ap.add_argument("--merge", action="append", default=[], metavar="OUT_DIR",
                    help="first copy the runs of another comparison folder's store into this one (repeatable)")
    ap.add_argument("--pack", action="store_true",
                    help="keep <out>/packs/<run>.duckdb.gz, each unfinished run's completed rounds, up to date as "
                         "rounds complete (with --report-only: write them now); commit them, and a fresh "
                         "checkout's next run of the same command merges them and resumes there (see the notes)")
    args = ap.parse_args(argv)
    os.chdir(REPO)  # config paths and `runs/...` defaults resolve against the repository, as for rsiflow
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        arms = [parse_arm(a) for a in args.arm]
    except ValueError as e:
        sys.exit(f"bench.compare: {e}")
    if len({a.name for a in arms}) != len(arms):
        sys.exit("bench.compare: arm names must be distinct")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    manifest = _manifest(out)
    if args.merge:
        print(f"bench.compare: merged runs {merge_runs(out, [Path(m) for m in args.merge])}")

    if args.report_only:
        if not arms:
            if manifest is None:
                sys.exit(f"bench.compare: no --arm given and no {out / 'compare.json'} to read them from")
            arm_names, seeds = [a["name"] for a in manifest["arms"]], manifest["seeds"]
        else:
            arm_names = [a.name for a in arms]
        if args.pack:
            # unfinished runs only (rounds or the final test split missing); a finished run's record replaces its pack
            rounds = args.rounds if args.rounds is not None else (manifest or {}).get("rounds")
            store = out / "compare.duckdb"
            for name in (run_name(a, s) for s in seeds for a in arm_names):
                if _finished(store, name, rounds):
                    pack_path(out, name).unlink(missing_ok=True)
                elif (path := write_pack(out, name)) is not None:
                    print(f"bench.compare: packed {name} to {path}")
        print(report(out, arm_names, seeds))
        return

    if not arms:
        sys.exit("bench.compare: give at least one --arm NAME[:overrides]")
    args.config = [str(Path(c).resolve()) for c in (args.config or ["configs/default.yaml"])]
    from rsiflow.configs.loader import load_config
    from rsiflow.configs.schema import ConfigError

    try:
        for arm in arms:  # fail before any run on a bad key, naming the arm
            cfg = load_config(args.config, list(args.set) + arm.overrides)
    except ConfigError as e:
        sys.exit(f"bench.compare: arm {arm.name!r}: {e}")
    if args.rounds is None:
        args.rounds = cfg.run.rounds
    (out / "compare.json").write_text(json.dumps({
        "config": args.config, "set": args.set, "arms": [a.__dict__ for a in arms], "seeds": seeds,
        "rounds": args.rounds, "heldout_per_seed": args.heldout_per_seed}, indent=1))
    t0 = time.perf_counter()
    failed = run_all(args, arms, seeds, out)
    md = report(out, [a.name for a in arms], seeds)
    print(md)
    print(f"table: {out / 'table.md'}  {out / 'table.csv'}  {out / 'runs.csv'}\nplot:  {out / 'success.png'}")
    print(f"bench.compare: {len(arms)} arm(s) × {len(seeds)} seed(s) × {args.rounds} round(s) in "
          f"{time.perf_counter() - t0:.0f} s")
    if failed:
        sys.exit(f"bench.compare: {len(failed)} run(s) failed: {', '.join(failed)} (see {out / 'logs'})")


if __name__ == "__main__":
    main()
