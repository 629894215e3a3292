"""kill -9 at random points of a round, resume each time, and compare with an uninterrupted run of the same seed.

    python -m bench.chaos --kills 10 --seed 0 --out /tmp/chaos

1. A reference: `rsiflow run` of the config (default configs/tiny.yaml with SRD's template notes, so the round
   trains, gates and deploys a candidate, and without the hf backend's KV reuse: see DEFAULT_SETS),
   uninterrupted; its log gives how long each phase took: startup (until the round's flow starts) and each step.
2. The same run in another folder, started again and again, each start killed with SIGKILL to its process group at
   a random point (seeded): a phase (startup and each of the six steps once, the other kills' phases drawn
   uniformly), then a moment drawn uniformly within the reference's duration of that phase, counted from when the
   phase began in this start (read from its log: the round's first line, each step's "Finished in state Completed";
   a phase that ends sooner than the moment is killed at its end). The steps of the kill points come in pipeline
   order (so the round advances), with the startup kills at random places among them (a start killed while it
   resumes); a kill aimed at a step already completed goes to the next step to run, or to startup once all six are.
   After each kill, every process the start had made (its temporary Prefect server runs in a session of its own and
   must die by its parent-death signal) must be gone within 20 s. Then a last start runs to the end.
3. Every table of both stores is compared by each row's key (`KEYS`: its ids): a key of the reference missing
   from the chaos store is a lost row, a key more often in the chaos store than in the reference a duplicate
   (or an extra row), and a key in both whose row differs a changed row. Columns that are time-dependent by
   design are left out: timestamps (`*_at`), durations (`wall_s`, `mine_s`, `notes_s`,
   `foresight_s`, `*seconds`, TRL's `train_runtime` / `*_per_second`), and the leases, round_flow_runs and
   schema_migrations tables (bookkeeping of who held the store when, and which flow runs ran a round);
   paths are compared with each run's folder replaced by `<dir>`. The checkpoints' safetensors files are
   compared by hash.

Prints a table of the kills (delay, steps completed when killed, processes left) and the comparison, and
writes them as JSON to --out/chaos.json. Exit status 1 if a row was lost or duplicated or a process was left;
changed rows and checkpoints are reported (a resumed step must reproduce its rows only if its computation is
deterministic across processes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import duckdb

from rsiflow.stores.migrations import BOOKKEEPING_TABLES
from rsiflow.stores.store import Store

REPO = Path(__file__).resolve().parents[1]
STEPS = ("generate", "evaluate", "distill", "train", "gate", "deploy")
TIME_DEPENDENT = re.compile(r"(_at|[a-z]{2,}_s|seconds|runtime|per_second)$")   # not xtree's p_s
ROUND_START = "of run '{run}' starting: champion"
STEP_DONE = re.compile(r"Task run '([a-z]+)-[0-9a-f]+' - Finished in state Completed")
# SRD's template notes: the round has training examples, so train, gate and deploy do real work. kv_reuse off:
# with it on, the hf backend keeps KV caches across calls in one process, so a step run in a fresh process
# (a resume) takes another floating-point path than in the process that ran the steps before it, and sampling
# from the tiny model's near-flat distributions then picks other tokens (measured: README, "kill -9").
DEFAULT_SETS = ["distill.methods=[exit,srd]", "distill.srd.note_writer=template", "backend.hf.kv_reuse=false"]


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (a zombie has exited; only its parent may reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid: int) -> set[int]:
    """The process's children, their children, ... (from /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except FileNotFoundError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def group_members(pgid: int) -> set[int]:
    """Live processes in process group `pgid`."""
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.add(int(stat.parent.name))
    return members


class Run:
    """One run folder: its store, run_dir, Prefect home and the `rsiflow run` command."""

    def __init__(self, folder: Path, config: list[str], sets: list[str]):
        self.folder = folder
        self.store = folder / "store.duckdb"
        folder.mkdir(parents=True, exist_ok=True)
        overrides = [*sets, f"run.store={self.store}", f"run.run_dir={folder}/runs/{{name}}"]
        self.cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run", *[a for c in config for a in ("--config", c)],
                    *[a for o in overrides for a in ("--set", o)]]
        self.env = {**os.environ, "PREFECT_HOME": str(folder / "prefect"), "PYTHONPATH": str(REPO),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        self.env.pop("PREFECT_API_URL", None)
        self.starts = 0

    def start(self) -> subprocess.Popen:
        self.starts += 1
        log = open(self.log, "w")
        return subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    @property
    def log(self) -> Path:
        return self.folder / f"start-{self.starts}.log"

    def progress(self, run_id: str) -> tuple[bool, set[str]]:
        """From this start's log: whether the round's flow has begun, and the steps it completed."""
        text = self.log.read_text()
        return ROUND_START.format(run=run_id) in text, set(STEP_DONE.findall(text)) & set(STEPS)

    def completed_steps(self, run_id: str) -> list[str]:
        """Round 1's completed steps, in pipeline order ([] before the store has its schema)."""
        if not self.store.exists():
            return []
        with Store(self.store, read_only=True) as store:
            try:
                done = store.completed_steps(run_id, 1)
            except duckdb.CatalogException:   # killed before the first migration committed
                return []
        return [s for s in STEPS if s in done]

    def step_seconds(self, run_id: str) -> dict[str, float]:
        with Store(self.store, read_only=True) as store:
            return store.step_seconds(run_id, 1)


# each table's row identity (tables without a primary key: a duplicate is possible, and what this counts)
KEYS = {"runs": ("run_id",), "rounds": ("run_id", "round"), "steps": ("run_id", "round", "step"),
        "models": ("model_id",), "tasks": ("run_id", "round", "step", "task_id"),
        "trajectories": ("run_id", "traj_id"), "turns": ("run_id", "traj_id", "turn_idx"),
        "examples": ("run_id", "example_id"), "train_inputs": ("model_id", "example_id"),
        "evaluations": ("run_id", "eval_id"), "gate_decisions": ("run_id", "round", "step"),
        "notes": ("run_id", "note_id"), "foresight": ("run_id", "foresight_id"), "xtree_trees": ("tree_id",),
        "xtree_nodes": ("tree_id", "node_idx"), "xtree_occurrences": ("tree_id", "node_idx", "traj_id", "turn_start"),
        "xtree_bonus": ("tree_id", "traj_id"), "deleted_checkpoints": ("model_id",)}


def _normalise(value, folder: str):
    """A cell with time-dependent JSON keys dropped, the run's folder replaced by <dir>, 4.0 written as 4. A
    redeploy record's `action` is dropped too: what the deploying process did depends on which process ran the
    step (one holding the model switches its weights, a fresh one, resumed or on a pool, loads nothing), not on
    the run; its kind and path stay."""
    if isinstance(value, dict):
        if isinstance(value.get("redeploy"), dict):
            value = {**value, "redeploy": {k: v for k, v in value["redeploy"].items() if k != "action"}}
        return {k: _normalise(v, folder) for k, v in sorted(value.items()) if not TIME_DEPENDENT.search(k)}
    if isinstance(value, list):
        return [_normalise(v, folder) for v in value]
    if isinstance(value, str):
        if value[:1] in "{[":
            try:
                return _normalise(json.loads(value), folder)
            except ValueError:
                pass
        return value.replace(folder, "<dir>")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def table_rows(store: Path, folder: Path) -> dict[str, list[tuple[str, str]]]:
    """Every table's rows as (key, row) JSON texts (time-dependent columns left out, cells normalised)."""
    out = {}
    with Store(store, read_only=True) as s:
        columns: dict[str, list[str]] = {}
        for r in s.rows("SELECT table_name, column_name FROM information_schema.columns"
                        " WHERE table_schema = 'main' ORDER BY table_name, ordinal_position"):
            if r["table_name"] not in BOOKKEEPING_TABLES and not TIME_DEPENDENT.search(r["column_name"]):
                columns.setdefault(r["table_name"], []).append(r["column_name"])
        for table, cols in columns.items():
            rows = s.rows(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in cols)} FROM "{table}"')
            key = [c for c in KEYS.get(table, cols) if c in cols]
            out[table] = [(json.dumps([_normalise(row[c], str(folder)) for c in key], default=str),
                           json.dumps([_normalise(row[c], str(folder)) for c in cols], sort_keys=True, default=str))
                          for row in rows]
    return out


def compare(ref: list[tuple[str, str]], chaos: list[tuple[str, str]]) -> dict[str, int]:
    """Rows lost, duplicated (or extra) and changed, by key."""
    ref_keys, chaos_keys = Counter(k for k, _ in ref), Counter(k for k, _ in chaos)
    ref_rows, chaos_rows = {}, {}
    for k, row in ref:
        ref_rows.setdefault(k, Counter())[row] += 1
    for k, row in chaos:
        chaos_rows.setdefault(k, Counter())[row] += 1
    return {"reference": len(ref), "chaos": len(chaos), "lost": sum((ref_keys - chaos_keys).values()),
            "duplicate": sum((chaos_keys - ref_keys).values()),
            "changed": sum(1 for k in ref_rows.keys() & chaos_rows.keys() if ref_rows[k] != chaos_rows[k])}


def checkpoint_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted((folder / "runs").rglob("*.safetensors")):
        out[str(f.relative_to(folder))] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", help="Config file(s) (default configs/tiny.yaml)")
    p.add_argument("--set", dest="sets", action="append", help=f"Overrides (default {DEFAULT_SETS})")
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs before the run may finish (default 10)")
    p.add_argument("--seed", type=int, default=0, help="Seed of the kill delays")
    p.add_argument("--out", default="/tmp/rsiflow-chaos", help="Folder for both runs and chaos.json")
    args = p.parse_args(argv)
    config = args.config or [str(REPO / "configs" / "tiny.yaml")]
    sets = args.sets if args.sets is not None else DEFAULT_SETS
    out = Path(args.out)
    if out.exists():
        sys.exit(f"bench.chaos: {out} exists; give a new --out")
    from rsiflow.configs.loader import load_config

    run_id = load_config(config, sets).run.name
    rng = random.Random(args.seed)

    ref = Run(out / "reference", config, sets)
    t0 = time.monotonic()
    proc = ref.start()
    phase_end: dict[str, float] = {}
    while proc.poll() is None:
        begun, done = ref.progress(run_id)
        now = time.monotonic() - t0
        if begun:
            phase_end.setdefault("startup", now)
        for step in done:
            phase_end.setdefault(step, now)
        time.sleep(0.1)
    if proc.returncode != 0:
        sys.exit(f"bench.chaos: the reference run failed: {ref.log}")
    ref_wall = time.monotonic() - t0
    ref_steps = ref.step_seconds(run_id)
    duration = {"startup": phase_end["startup"], **{s: max(ref_steps.get(s, 0.0), 0.2) for s in STEPS}}
    print(f"reference: {ref_wall:.0f} s wall; phases " + ", ".join(f"{k} {v:.1f} s" for k, v in duration.items()),
          flush=True)

    # the kill points: every phase once (with 7 kills or more), the rest drawn uniformly; steps in pipeline order,
    # startup kills placed at random among them
    every = ["startup", *STEPS][:args.kills]
    phases = sorted(every + [rng.choice(["startup", *STEPS]) for _ in range(args.kills - len(every))],
                    key=lambda p: -1 if p == "startup" else STEPS.index(p))
    steps_planned = [p for p in phases if p != "startup"]
    for _ in range(phases.count("startup")):
        steps_planned.insert(rng.randrange(len(steps_planned) + 1), "startup")
    plan = [(p, rng.uniform(0.0, duration[p])) for p in steps_planned]

    chaos = Run(out / "chaos", config, sets)
    kills = []
    for phase, offset in plan:
        done = chaos.completed_steps(run_id)
        if phase != "startup" and phase in done:   # already past it: the next step still to run, else startup
            phase = next((s for s in STEPS if s not in done), "startup")
            offset = rng.uniform(0.0, duration[phase])
        proc = chaos.start()
        t = time.monotonic()
        seen: set[int] = set()
        phase_began = t if phase == "startup" else None
        while proc.poll() is None:
            seen |= descendants(proc.pid)
            begun, in_log = chaos.progress(run_id)
            if phase_began is None:
                if begun and all(s in done or s in in_log for s in STEPS[:STEPS.index(phase)]):
                    phase_began = time.monotonic()
            elif time.monotonic() - phase_began >= offset:
                break
            elif (begun if phase == "startup" else phase in in_log):
                break   # the phase ended sooner than in the reference: kill at its end, before the round can finish
            time.sleep(0.02)
        if proc.poll() is not None:
            print(f"start {chaos.starts}: finished (exit {proc.returncode}) before its kill in {phase}", flush=True)
            if proc.returncode != 0:
                sys.exit(f"bench.chaos: a start failed: {chaos.log}")
            break
        seen |= descendants(proc.pid)
        begun, in_log = chaos.progress(run_id)
        where = "startup" if not begun else next((s for s in STEPS if s not in done and s not in in_log),
                                                   "after deploy")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while (left := {p for p in seen | group_members(proc.pid) if alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        after = chaos.completed_steps(run_id)
        kills.append({"start": chaos.starts, "aimed_at": f"{phase} + {offset:.1f} s", "killed_in": where,
                      "after_s": round(time.monotonic() - t, 1), "completed_before": done,
                      "completed_after": after, "children": len(seen), "left": sorted(left)})
        print(f"kill {len(kills):>2}: start {chaos.starts} killed {kills[-1]['after_s']:5.1f} s after it began, "
              f"aimed at {phase} + {offset:.1f} s, in {where}; completed steps {len(done)} -> {len(after)}; "
              f"{len(seen)} child process(es), left: {sorted(left) or 'none'}", flush=True)
    t = time.monotonic()
    proc = chaos.start()
    if proc.wait() != 0:
        sys.exit(f"bench.chaos: the final start failed: {chaos.log}")
    print(f"final start {chaos.starts}: completed in {time.monotonic() - t:.0f} s", flush=True)

    ref_rows, chaos_rows = table_rows(ref.store, ref.folder), table_rows(chaos.store, chaos.folder)
    tables = [{"table": t, **compare(ref_rows.get(t, []), chaos_rows.get(t, []))}
              for t in sorted(set(ref_rows) | set(chaos_rows))]
    ref_ckpt, chaos_ckpt = checkpoint_hashes(ref.folder), checkpoint_hashes(chaos.folder)
    ckpt_same = {k: ref_ckpt.get(k) == chaos_ckpt.get(k) for k in sorted(set(ref_ckpt) | set(chaos_ckpt))}
    print(f"\n{'table':<20} {'reference':>9} {'chaos':>6} {'lost':>5} {'duplicate':>9} {'changed':>7}")
    for r in tables:
        print(f"{r['table']:<20} {r['reference']:>9} {r['chaos']:>6} {r['lost']:>5} {r['duplicate']:>9} "
              f"{r['changed']:>7}")
    lost = sum(r["lost"] for r in tables)
    dups = sum(r["duplicate"] for r in tables)
    changed = sum(r["changed"] for r in tables)
    left = sum(len(k["left"]) for k in kills)
    print(f"\n{len(kills)} kills, {chaos.starts} starts; rows: {sum(r['reference'] for r in tables)} in the reference, "
          f"{lost} lost, {dups} duplicated, {changed} changed; checkpoints identical: {sum(ckpt_same.values())}/"
          f"{len(ckpt_same)}; processes left behind: {left}")
    result = {"seed": args.seed, "config": [os.path.relpath(c, REPO) for c in config], "sets": sets,
              "reference_wall_s": round(ref_wall, 1),
              "reference_phase_s": duration, "kills": kills, "starts": chaos.starts, "tables": tables,
              "checkpoints_identical": ckpt_same, "lost": lost, "duplicate": dups, "changed": changed,
              "processes_left": left}
    (out / "chaos.json").write_text(json.dumps(result, indent=2))
    return 1 if lost or dups or left else 0


if __name__ == "__main__":
    sys.exit(main())
