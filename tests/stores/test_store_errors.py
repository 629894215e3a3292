"""Opening a store that can't be one fails with a one-line StoreError before anything is written: missing when
read-only (not created), a folder, under a file, not creatable, not a DuckDB file, another program's database, a
schema newer than the code's."""

import duckdb
import pytest

from rsiflow.stores import Store
from rsiflow.stores.migrations import MIGRATIONS
from rsiflow.stores.store import StoreError, StoreLockedError

NEWEST = max(v for v, _, _ in MIGRATIONS)


def refused(path, read_only=False) -> str:
    with pytest.raises(StoreError) as info:
        Store(path, read_only=read_only, wait_s=0)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_read_only_open_of_a_missing_store_creates_nothing(tmp_path):
    path = tmp_path / "sub" / "store.duckdb"
    assert refused(path, read_only=True) == (f"store {path} does not exist: nothing has run with this run.store "
                                             "yet (`rsiflow run` creates it)")
    assert not (tmp_path / "sub").exists()


def test_paths_that_cannot_hold_a_store(tmp_path):
    (tmp_path / "a_file").write_text("x")
    assert "a_file is a file, not a folder" in refused(tmp_path / "a_file" / "deeper" / "s.duckdb")
    assert refused(tmp_path).startswith(f"store {tmp_path} is a folder")
    assert refused("/proc/s.duckdb").startswith("store /proc/s.duckdb can't be opened or created (DuckDB: ")


def test_a_file_that_is_not_duckdb_is_left_alone(tmp_path):
    path = tmp_path / "notes.duckdb"
    for content in ("hello", ""):
        path.write_text(content)
        for read_only in (False, True):
            assert refused(path, read_only).startswith(f"store {path} is not a DuckDB database")
        assert path.read_text() == content


def test_another_programs_duckdb_database_is_not_migrated(tmp_path):
    path = tmp_path / "analytics.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE sales (x INTEGER)")
    con.close()
    assert "is a DuckDB database but not an rsiflow store (tables sales; no schema_migrations)" in refused(path)
    con = duckdb.connect(str(path), read_only=True)
    assert [t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()] == ["sales"]
    con.close()


def test_a_newer_schema_is_refused_naming_both_versions(tmp_path):
    path = tmp_path / "store.duckdb"
    with Store(path) as s:
        s.con.execute("INSERT INTO schema_migrations VALUES (99, 'from the future', now())")
    for read_only in (False, True):
        assert refused(path, read_only) == (f"store {path} has schema version 99, newer than this code's "
                                            f"({NEWEST}): it was written by a newer rsiflow; upgrade rsiflow to use it")


def test_locked_error_is_one_line_and_a_store_error(tmp_path):
    assert issubclass(StoreLockedError, StoreError)
    err = Store.__new__(Store)
    err.path = tmp_path / "s.duckdb"
    message = str(err._locked_error(duckdb.IOException('IO Error: Could not set lock on file "x": Conflicting '
                                                       'lock is held in python (PID 42)\nsecond line'), 30))
    assert "\n" not in message and "locked by process 42 (waited 30 s)" in message
