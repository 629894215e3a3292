"""The store as a DuckLake (stores/lake.py): config checks and the clear error without the extensions (fast), and
on a private PostgreSQL cluster (slow): the Store API on a lake, many processes racing for one run's lease, and two
different tiny runs of two rounds each at once on one lake, every row compared with the same runs on DuckDB files.

The lake needs DuckDB 1.4.4 with the ducklake and postgres extensions, which live in .venv-lake (bin/setup-lake),
not in the .venv pytest runs in: the lake side of each slow test runs as a .venv-lake subprocess.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.lake import LAKE_PYTHON, PostgresCluster, lake_missing
from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.stores.lake import extension_dir, lake_migration_sql, now_defaults
from rsiflow.stores.migrations import MIGRATIONS, migration_sql
from rsiflow.stores.store import Store, StoreError

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
SPEC = "ducklake:postgres:dbname=rsiflow host=/tmp/pg port=5433"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# ---- fast ------------------------------------------------------------------------------------------------

def test_config_names_a_lake_with_its_data_folder(tmp_path):
    cfg = load_config([TINY], [f"run.store={SPEC}", f"run.lake_data_path={tmp_path}"])
    assert (cfg.run.store, cfg.run.lake_data_path) == (SPEC, str(tmp_path))
    with pytest.raises(ConfigError, match=r"lake_data_path: a DuckLake run.store needs the folder"):
        load_config([TINY], [f"run.store={SPEC}"])
    with pytest.raises(ConfigError, match=r"store 'ducklake:sqlite:x.db': a DuckLake store is 'ducklake:postgres:"):
        load_config([TINY], ["run.store=ducklake:sqlite:x.db", f"run.lake_data_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"lake_data_path: set only with a DuckLake run.store"):
        load_config([TINY], [f"run.lake_data_path={tmp_path}"])


def test_messages_hide_the_catalog_password():
    from rsiflow.stores.lake import redact

    assert redact(f"{SPEC} user=rsiflow password=s3cret") == f"{SPEC} user=rsiflow password=***"
    assert redact("ducklake:postgres:password = 'a b\\'c' dbname=x") == "ducklake:postgres:password = *** dbname=x"
    assert redact("ducklake:postgres:postgresql://rsiflow:s3cret@db:5432/x") == \
        "ducklake:postgres:postgresql://rsiflow:***@db:5432/x"
    assert redact(SPEC) == SPEC and redact("runs/rsiflow.duckdb") == "runs/rsiflow.duckdb"


@pytest.mark.skipif(extension_dir() is not None, reason="this interpreter's DuckDB has the lake extensions")
def test_a_lake_without_the_extensions_says_what_to_run():
    """In .venv (DuckDB 2.0, no ducklake extension) opening a lake names the key and the fix, before any
    connection is tried (no PostgreSQL needed)."""
    with pytest.raises(StoreError, match=r"run.store names a DuckLake .*no ducklake/postgres extension.*"
                                         r"run bin/setup-lake and use .venv-lake/bin/rsiflow"):
        Store(SPEC, lake_data_path="/tmp/nowhere")


def test_lake_migrations_drop_what_ducklake_lacks_and_keep_every_column():
    """No PRIMARY KEY/UNIQUE/CHECK, index or now() default reaches the lake; every column of the embedded schema
    does, with its type; the now() defaults are the ones the store fills itself."""
    import duckdb

    con = duckdb.connect()
    for version, _, sql in MIGRATIONS:
        lake_sql = migration_sql(version, sql, lake=True)
        for banned in (r"PRIMARY\s+KEY", r"\bUNIQUE\b", r"\bCHECK\b", r"\bINDEX\b", r"NOW\(\)"):
            assert not re.search(banned, lake_sql.upper()), (version, banned)
        con.execute(lake_sql)
    embedded = duckdb.connect()
    for _, _, sql in MIGRATIONS:
        embedded.execute(sql)
    columns = ("SELECT table_name, column_name, data_type FROM information_schema.columns"
               " WHERE table_name <> 'lake_locks' ORDER BY ALL")
    assert con.sql(columns).fetchall() == embedded.sql(columns).fetchall()
    assert con.sql("SELECT name FROM lake_locks").fetchall() == [("leases",)]   # its counter only serialises
    assert now_defaults([sql for _, _, sql in MIGRATIONS]) == {"models": {"created_at"},
                                                               "gate_decisions": {"decided_at"}}
    assert "CHECK" not in lake_migration_sql("CREATE TABLE t (a VARCHAR CHECK (a IN ('x', 'y')), b INT);")


# ---- slow: a private PostgreSQL cluster and .venv-lake ---------------------------------------------------------

needs_lake = pytest.mark.skipif(lake_missing() is not None, reason=f"no lake here: {lake_missing()}")


@pytest.fixture(scope="module")
def cluster():
    pg = PostgresCluster().start()
    try:
        yield pg
    finally:
        pg.stop()


def lake_python(code: str, *args: str, timeout: float = 600) -> str:
    """Run `code` under .venv-lake's interpreter (sys.argv[1:] = args); the last line it printed. Fails the test
    on an error."""
    done = subprocess.run([str(LAKE_PYTHON), "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


STORE_API = r"""
import json, sys
from rsiflow.stores.store import Store, StoreError
spec, data, out = sys.argv[1:4]
s = Store(spec, lake_data_path=data)
assert s.lake and len(s.step_tables) > 15
s.create_run("r1", "r1", {"a": 1}, "base")
s.create_run("r1", "r1", {"a": 1}, "base")                      # again: a no-op
try:
    s.create_run("r1", "r1", {"a": 2}, "base"); raise SystemExit("a changed config was accepted")
except ValueError:
    pass
with s.step("r1", 0, "init") as tx:
    tx.insert("models", [{"model_id": "m0", "path": "/x", "role": "base"}])
s.start_round("r1", 1, "m0")
with s.step("r1", 1, "generate") as tx:
    tx.insert("trajectories", [{"traj_id": "t1", "model_id": "m0", "success": True, "reward": 1.0,
                                "hindsight": {"k": [1]}}])
    tx.insert("turns", [{"traj_id": "t1", "turn_idx": 0, "token_ids": [1, 2], "logprobs": [0.5, -1.0]}])
with s.step("r1", 1, "generate") as tx:                          # a rerun replaces the step's rows
    tx.insert("trajectories", [{"traj_id": "t1", "model_id": "m0", "success": False, "reward": 0.0}])
with s.step("r1", 1, "distill") as tx:
    tx.insert("examples", [{"example_id": "e1", "method": "exit", "weight": 1.0, "source_traj_id": "t1",
                            "messages": [{"role": "user", "content": "hi"}]}])
    tx.metrics({"exit": {"n": 1}})
try:
    with s.step("r1", 1, "train") as tx:
        tx.insert("models", [{"model_id": "m1", "parent_id": "m0", "path": "/y", "role": "candidate"}])
        raise ValueError("boom")
except ValueError:
    pass
with s.step("r1", 1, "train") as tx:
    tx.insert("models", [{"model_id": "m1", "parent_id": "m0", "path": "/y", "role": "candidate"}])
    tx.insert("train_inputs", [{"model_id": "m1", "example_id": "e1"}])
with s.step("r1", 1, "gate") as tx:
    tx.insert("gate_decisions", [{"candidate_id": "m1", "champion_id": "m0", "decision": "promote",
                                  "new_champion_id": "m1"}])
    tx.set_model_role("m1", "champion")
s.start_round("r1", 1, "m0")                                      # a resume keeps one row
with s.step("r1", 1, "deploy") as tx:                            # as tasks/deploy.py: the round ends in the step
    tx.insert("deleted_checkpoints", [])
    s.finish_round("r1", 1, "m1", {"x": 1})
ds = s.examples_dataset("r1", 1)
paths = s.export_parquet("r1", 1, out)
result = {
    "steps": s.rows("SELECT round, step, status, error FROM steps ORDER BY round, step"),
    "rounds": s.rows("SELECT round, status, champion_after FROM rounds"),
    "trajectories": s.rows("SELECT traj_id, success FROM trajectories"),
    "models": s.rows("SELECT model_id, role, created_at IS NOT NULL AS stamped FROM models ORDER BY model_id"),
    "champion": s.champion("r1"), "last": s.last_completed_round("r1"),
    "lineage": [r["model_role"] for r in s.trajectory_lineage("r1")],
    "trained_on": [r["example_id"] for r in s.training_examples_of("m1")],
    "promotions": [r["decision"] for r in s.promotion_history("r1")],
    "metrics": s.step_metrics("r1", 1, "distill"),
    "dataset": ds.to_list(), "parquet": sorted(p.name for p in paths.values()),
    "decided_at": s.rows("SELECT decided_at IS NOT NULL AS stamped FROM gate_decisions")[0]["stamped"],
}
s.close()
with Store(spec, read_only=True) as r:
    result["read_only_runs"] = [x["run_id"] for x in r.list_runs()]
try:
    Store(spec.replace("dbname=api", "dbname=empty"), read_only=True); raise SystemExit("an empty lake opened")
except StoreError as e:
    result["empty"] = str(e)
print(json.dumps(result, default=str))
"""


@pytest.mark.slow
@needs_lake
def test_store_api_on_a_lake(cluster, tmp_path):
    spec = cluster.createdb("api")
    cluster.createdb("empty")
    got = json.loads(lake_python(STORE_API, spec, str(tmp_path / "data"), str(tmp_path / "export")))
    assert got["steps"] == [
        {"round": 0, "step": "init", "status": "completed", "error": None},
        {"round": 1, "step": "deploy", "status": "completed", "error": None},
        {"round": 1, "step": "distill", "status": "completed", "error": None},
        {"round": 1, "step": "gate", "status": "completed", "error": None},
        {"round": 1, "step": "generate", "status": "completed", "error": None},
        {"round": 1, "step": "train", "status": "completed", "error": None},
    ]
    assert got["rounds"] == [{"round": 1, "status": "completed", "champion_after": "m1"}]
    assert got["trajectories"] == [{"traj_id": "t1", "success": False}]
    assert got["models"] == [{"model_id": "m0", "role": "base", "stamped": True},
                             {"model_id": "m1", "role": "champion", "stamped": True}]
    assert (got["champion"], got["last"], got["lineage"]) == ("m1", 1, ["base"])
    assert (got["trained_on"], got["promotions"], got["decided_at"]) == (["e1"], ["promote"], True)
    assert got["metrics"] == {"exit": {"n": 1}}
    assert got["dataset"] == [{"example_id": "e1", "method": "exit", "weight": 1.0, "source_traj_id": "t1",
                               "meta": None, "messages": [{"role": "user", "content": "hi"}]}]
    assert got["parquet"] == ["examples.parquet", "trajectories.parquet", "turns.parquet"]
    assert got["read_only_runs"] == ["r1"]
    assert "has no rsiflow schema: nothing has run with this run.store yet" in got["empty"]
    assert list((tmp_path / "data").rglob("*.parquet")), "the lake wrote no Parquet files under lake_data_path"


OPEN = r"""
import sys, time
from pathlib import Path
import rsiflow.stores.lake as lake
spec, data, go, ready = sys.argv[1:5]
lake.connect(spec, data, False).close()   # attached (extensions loaded) before the start signal
Path(ready).touch()                       # tells the test this process waits for it
while not Path(go).exists():
    time.sleep(0.01)
from rsiflow.stores.store import Store
Store(spec, lake_data_path=data).close()
print("ok")
"""


@pytest.mark.slow
@needs_lake
def test_processes_creating_one_new_lake_at_once_apply_each_migration_once(cluster, tmp_path):
    """Four processes open a new lake at the same instant: those that lose a migration's race (a commit conflict,
    or a CREATE that finds the winner's table) start over and find it applied. All open it; each version is
    recorded once."""
    spec = cluster.createdb("fresh")
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{i}" for i in range(4)]
    procs = [subprocess.Popen([str(LAKE_PYTHON), "-c", OPEN, spec, str(tmp_path / "data"), str(go), str(r)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for r in ready]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready):   # every process attached: release them at one instant
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a process did not get ready"
        time.sleep(0.05)
    go.touch()
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0 and stdout.strip().endswith("ok"), stderr[-3000:]
    versions = json.loads(lake_python(
        "import json, sys; from rsiflow.stores.store import Store; s = Store(sys.argv[1], read_only=True)\n"
        "print(json.dumps([v for (v,) in s.con.sql('SELECT version FROM schema_migrations ORDER BY 1').fetchall()]))",
        spec))
    assert versions == sorted(v for v, _, _ in MIGRATIONS)


RACE = r"""
import json, os, socket, sys, time
from pathlib import Path
from rsiflow.stores.store import Store
spec, go, me = sys.argv[1:4]
s = Store(spec)
while not Path(go).exists():
    time.sleep(0.01)
lease, replaced = s.acquire_lease("race", me, 300, "host-" + me, os.getpid())
print(json.dumps({"me": me, "holder": lease["holder"]}))
"""


def released_at_once(script: str, spec: str, go, names: list[str], settle_s: float) -> list[dict]:
    """Start one .venv-lake process per name running `script` (argv: lake spec, go file, name), give them
    `settle_s` seconds to attach the lake and wait for the go file, create it, and return each one's last stdout
    line as JSON (each must exit 0)."""
    procs = [subprocess.Popen([str(LAKE_PYTHON), "-c", script, spec, str(go), name], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV) for name in names]
    time.sleep(settle_s)
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.slow
@needs_lake
def test_one_lease_holder_among_processes_racing(cluster, tmp_path):
    """Processes (each its own 'host', so none can take over another as dead) race for a free lease: exactly
    one holds it and every one of them reads that holder. Appends alone never conflict on a lake; the lock row
    makes them."""
    spec = cluster.createdb("race")
    lake_python("import sys; from rsiflow.stores.store import Store; "
                "Store(sys.argv[1], lake_data_path=sys.argv[2]).close()",
                spec, str(tmp_path / "data"))
    for attempt in range(2):
        out = released_at_once(RACE, spec, tmp_path / f"go-{attempt}", [f"p{attempt}-{i}" for i in range(4)], 25)
        holders = {o["holder"] for o in out}
        assert len(holders) == 1, out
        assert sum(o["holder"] == o["me"] for o in out) == 1, out
        lake_python("import sys; from rsiflow.stores.store import Store; s = Store(sys.argv[1]);"
                    " s.release_lease('race', sys.argv[2]); assert s.lease('race') is None", spec, holders.pop())


RERUN = r"""
import json, sys, time
from pathlib import Path
from rsiflow.stores.store import Store
spec, go, me = sys.argv[1:4]
s = Store(spec)
while not Path(go).exists():
    time.sleep(0.01)
with s.step("r", 1, "generate") as tx:
    tx.insert("trajectories", [{"traj_id": f"{me}-{i}", "reward": float(i)} for i in range(3)])
    time.sleep(2)   # both transactions are open at once
    tx.insert("turns", [{"traj_id": f"{me}-0", "turn_idx": 0, "action_text": me}])
print(json.dumps({"me": me, "retried": s.conflicts_retried}))
"""


@pytest.mark.slow
@needs_lake
def test_a_step_written_twice_at_once_commits_one_whole_attempt(cluster, tmp_path):
    """Two processes rerun the same step at once: both delete the step's earlier rows (the same Parquet file), so
    the later commit loses a write conflict and is run again from its log. The lake ends with exactly one
    attempt's rows, all of them: never both, never a mix."""
    spec = cluster.createdb("rerun")
    lake_python("import sys; from rsiflow.stores.store import Store; "
                "s = Store(sys.argv[1], lake_data_path=sys.argv[2])\n"
                "with s.step('r', 1, 'generate') as tx: tx.insert('trajectories', [{'traj_id': 'old'}])",
                spec, str(tmp_path / "data"))
    out = released_at_once(RERUN, spec, tmp_path / "go", ["a", "b"], 20)
    assert sum(o["retried"] for o in out) >= 1, out
    rows = json.loads(lake_python(
        "import json, sys; from rsiflow.stores.store import Store; s = Store(sys.argv[1], read_only=True)\n"
        "print(json.dumps([s.rows('SELECT traj_id FROM trajectories ORDER BY traj_id'),"
        " s.rows('SELECT traj_id, action_text FROM turns'), s.rows('SELECT status FROM steps')]))", spec))
    trajs, turns, steps = rows
    winner = turns[0]["action_text"] if turns else None
    assert winner in ("a", "b"), rows
    assert trajs == [{"traj_id": f"{winner}-{i}"} for i in range(3)], rows
    assert turns == [{"traj_id": f"{winner}-0", "action_text": winner}] and steps == [{"status": "completed"}], rows


@pytest.mark.slow
@needs_lake
def test_two_runs_at_once_on_a_lake_match_the_same_runs_on_files(cluster, tmp_path):
    """Two different tiny runs (bench.lake.TINY_RUNS), two rounds each, as two `rsiflow run` processes at once on
    one lake, and the same runs on DuckDB files beside them. Every row of each run in the lake equals its
    row in the run's file (ids as keys; timestamps, durations and the run folder left out), both runs completed
    both rounds and gave their leases back; `rsiflow status` and `report` read the lake."""
    done = subprocess.run([str(LAKE_PYTHON), "-m", "bench.lake", "--tiny-rounds", "2", "--all-at-once",
                           "--catalog", str(cluster.dir), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    result = json.loads((tmp_path / "lake.json").read_text())["tiny"] if (tmp_path / "lake.json").exists() else {}
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], result)
    assert result["exit_codes"] == {"lake": {"lake-a": 0, "lake-b": 0}, "file": {"lake-a": 0, "lake-b": 0}}
    for run, check in result["checks"].items():
        assert (check["lost"], check["duplicate"], check["changed"]) == (0, 0, 0), (run, check)
        assert check["rows"] == check["rows_got"] > 0
        assert check["rounds_completed"] == 2 and not check["lease_left"], (run, check)
        for table in ("runs", "rounds", "steps", "models", "trajectories", "turns", "examples", "train_inputs",
                      "evaluations", "gate_decisions", "notes"):
            assert check["tables"].get(table), (run, table, check["tables"])
    spec = f"ducklake:postgres:dbname=tiny_lake host={cluster.dir} port={cluster.port} user=rsiflow"
    for command in ("status", "report"):
        shown = subprocess.run([str(LAKE_PYTHON), "-m", "rsiflow.flows.cli", command, "--config", TINY,
                                "--set", "run.name=lake-b", "--set", f"run.store={spec}",
                                "--set", f"run.lake_data_path={tmp_path / 'lake' / 'data'}",
                                "--set", f"run.run_dir={tmp_path / 'lake' / 'lake-b' / 'runs' / '{name}'}"],
                               cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
        assert shown.returncode == 0, shown.stderr[-3000:]
        expected = "completed rounds: 2" if command == "status" else "report: "
        assert expected in shown.stdout, shown.stdout[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
