"""Migrations run once, on first open, and are recorded."""

from rsiflow.stores import Store
from rsiflow.stores.migrations import MIGRATIONS


def test_migrations_apply_once_and_are_recorded(tmp_path):
    path = tmp_path / "nested" / "dir" / "rsiflow.duckdb"
    with Store(path) as store:
        first = store.con.sql("SELECT version, name, applied_at FROM schema_migrations").fetchall()
    assert [v for v, _, _ in first] == [v for v, _, _ in MIGRATIONS]
    assert first[0][0] == 1

    with Store(path) as store:  # reopening applies nothing again
        again = store.con.sql("SELECT version, name, applied_at FROM schema_migrations").fetchall()
        tables = {t for (t,) in store.con.sql("SELECT table_name FROM information_schema.tables").fetchall()}
    assert again == first
    assert {"runs", "rounds", "steps", "models", "tasks", "trajectories", "turns", "examples",
            "train_inputs", "evaluations", "gate_decisions", "notes", "foresight"} <= tables


def test_read_only_store_reads_without_migrating(tmp_path):
    path = tmp_path / "rsiflow.duckdb"
    with Store(path) as store:
        store.create_run("r", "demo", {"a": 1}, "base")
    with Store(path, read_only=True) as store:
        assert store.get_run("r")["config"] == {"a": 1}


def test_every_step_written_table_is_cleared_by_step(store):
    assert store.step_tables == {"models", "tasks", "trajectories", "turns", "examples",
                                 "train_inputs", "evaluations", "gate_decisions", "notes", "foresight",
                                 "xtree_trees", "xtree_nodes", "xtree_occurrences", "xtree_bonus",
                                 "rsipo_skills", "rsipo_tests", "rsipo_library",
                                 "mass_workflows", "mass_episodes", "mass_verdicts", "mass_rankings"}


def test_importing_stores_pulls_no_heavy_dependencies():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, stores; heavy = {'torch', 'prefect', 'datasets', 'pandas'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True)
