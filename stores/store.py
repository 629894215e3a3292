"""The rsiflow store: one DuckDB file per project holding every artifact with its lineage.

Usage is short-lived: a pipeline step opens the store, writes its rows in one transaction,
and closes it, so that `rsiflow status` (or a person with the duckdb CLI) can read between
steps. DuckDB lets one process write a file at a time; a second opener waits up to `wait_s`
and then gets a `StoreLockedError` that names the file and the holder.

Writes of a step go through `Store.step`:

    with Store(path) as store, store.step(run_id, round, "generate") as tx:
        tx.insert("trajectories", trajectories)   # list of dicts or a pyarrow.Table
        tx.insert("turns", turns_table)

Entering the block deletes every row the same (run_id, round, step) wrote before, so a
rerun replaces rows instead of duplicating them; leaving it commits (or rolls back and marks
the step failed). A process killed mid-step leaves the file as of the last commit.

`run.store` may instead name a DuckLake (`ducklake:postgres:...`, stores/lake.py) that many processes write at
once: the same API and schema (less the constraints and indexes DuckLake lacks), each step still one
transaction, run again from its log when its commit loses a write conflict to another process.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from rsiflow.stores import lake as lakes
from rsiflow.stores.common import (
    NOT_STEP_DATA,
    NOW_DEFAULTS,
    STEP_KEY,
    Rows,
    StoreError,
    StoreLockedError,
    backoff,
    is_conflict,
    is_lock_error,
    json_text,
    rollback_quietly,
    utc_timestamp,
)
from rsiflow.stores.migrations import MIGRATIONS, applied_versions, apply_method_migrations, apply_migrations
from rsiflow.stores.queries import StoreReads
from rsiflow.stores.registry import RunRegistry
from rsiflow.stores.steps import StepTransactions, StepWriter


class Store(StepTransactions, RunRegistry, StoreReads):
    """One project's DuckDB file, or a DuckLake (stores/lake.py): opening it (locks, schema migrations) and typed
    inserts here; step transactions (stores/steps.py), runs, rounds and leases (stores/registry.py) and the reads
    (stores/queries.py) are the parts it is built from."""

    def __init__(self, path: str | Path, read_only: bool = False, wait_s: float = 30.0,
                 lake_data_path: str | Path | None = None):
        """Open (creating the file and its parent folders unless `read_only`) and, unless `read_only`, apply
        pending migrations.

        If another process holds the file's lock, retry for up to `wait_s` seconds, then raise
        `StoreLockedError`. A file that can't be opened as an rsiflow store (missing when read-only, under a
        file, not creatable, not a DuckDB database, another program's database, a schema newer than this
        code's) raises `StoreError` before anything is written.

        `path` may name a DuckLake instead (`ducklake:postgres:<connection string>`, stores/lake.py); its
        Parquet files go to `lake_data_path` when the lake is created. Many processes may open a lake at once.
        """
        self.read_only = read_only
        self.lake = lakes.is_lake(path)
        if self.lake:
            self._open_lake(str(path), lake_data_path)
            return
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise StoreError(f"store {self.path} is a folder; set run.store to a file path, e.g. "
                             f"{self.path / 'rsiflow.duckdb'}")
        if read_only and not self.path.is_file():
            raise StoreError(f"store {self.path} does not exist: nothing has run with this run.store yet "
                             f"(`rsiflow run` creates it)")
        if not read_only:
            self._make_parent()
        self._con = self._connect(wait_s)
        try:
            self._check_schema()
            if not read_only:
                apply_migrations(self._con)
        except BaseException:
            self._con.close()
            raise
        self._schemas: dict[str, tuple[pa.Schema, set[str]]] = {}
        self.step_tables = self._find_step_tables()

    def apply_method_migrations(self, method: str, migrations) -> list[int]:
        """Create or upgrade a method's own tables (`Method.migrations`, numbered per method); the versions applied.
        Its step-keyed tables are cleared on a step rerun like the core's."""
        applied = apply_method_migrations(self._con, method, migrations, lake=self.lake)
        if applied:
            self._schemas = {}
            self.step_tables = self._find_step_tables()
        return applied

    def _open_lake(self, spec: str, data_path: str | Path | None) -> None:
        """Attach the lake (stores/lake.py), check its schema and apply pending migrations (the lake flavour of
        each: no constraints or indexes)."""
        self.path = lakes.redact(spec)   # what messages show
        self.conflicts_retried = 0       # transactions of this Store run again after losing a write conflict
        self._lake_writer: StepWriter | None = None   # the step whose transaction is open, if any
        for attempt in (0, 1):
            con = None
            try:
                con = self._con = lakes.connect(spec, data_path, self.read_only)
                self._check_schema()
                break
            except lakes.LakeUnavailable as err:
                raise StoreError(str(err)) from None
            except BaseException as err:
                if con is not None:
                    con.close()
                if not isinstance(err, duckdb.Error):
                    raise
                said = str(err).splitlines()[0]
                if self.read_only and "creating a new DuckLake is explicitly disabled" in said:
                    raise StoreError(f"store {self.path} has no rsiflow schema: nothing has run with this run.store "
                                     f"yet (`rsiflow run` creates it)") from None
                if attempt:
                    raise StoreError(f"store {self.path} can't be attached (DuckDB: {said}); check that its catalog "
                                     f"database answers and that run.lake_data_path is set when the lake is new"
                                     ) from None
                lakes.forget(spec, self.read_only)   # attach afresh once: the catalog server may have restarted
        try:
            if self.read_only and not applied_versions(self._con):
                raise StoreError(f"store {self.path} has no rsiflow schema: nothing has run with this run.store yet "
                                 f"(`rsiflow run` creates it)")
            if not self.read_only:
                apply_migrations(self._con, lake=True)
        except BaseException:
            self._con.close()
            raise
        self._schemas = {}
        self.step_tables = self._find_step_tables()

    def _lake_tx(self, work, lock: bool = False):
        """Run `work()` in a transaction of its own and commit, running it again from the start while the commit
        loses a write conflict to a concurrent transaction (lake only). `lock` first updates the lake's lock row,
        so that this transaction conflicts with every other one that does (lease writes, run creation).

        Inside a step's transaction (e.g. the deploy step finishing its round) the work joins that transaction
        instead, and its log: a replay of the step runs it again."""
        con = self._con
        if self._lake_writer is not None:
            def joined():
                if lock:
                    con.execute(lakes.LEASE_LOCK_SQL)
                return work()
            self._lake_writer.replay.append(("call", joined, None))
            return joined()
        for attempt in range(lakes.CONFLICT_RETRIES):
            con.begin()
            try:
                if lock:
                    con.execute(lakes.LEASE_LOCK_SQL)
                result = work()
                con.commit()
                return result
            except BaseException as err:
                rollback_quietly(con)
                if not is_conflict(err) or attempt == lakes.CONFLICT_RETRIES - 1:
                    raise
            self.conflicts_retried += 1
            backoff(attempt)
        raise AssertionError("unreachable")

    def _make_parent(self) -> None:
        parent = self.path.parent
        blocker = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise StoreError(f"store {self.path}: {blocker} is a file, not a folder; set run.store to a path in a "
                             f"folder")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StoreError(f"store {self.path}: can't create its folder ({err.strerror}); set run.store to a "
                             f"path in a writable folder") from None

    def _check_schema(self) -> None:
        """Refuse a store written by newer code (its migrations are unknown here) and another program's
        DuckDB database (tables but no schema_migrations)."""
        newest = max(v for v, _, _ in MIGRATIONS)
        versions = applied_versions(self._con)
        if versions and max(versions) > newest:
            raise StoreError(f"store {self.path} has schema version {max(versions)}, newer than this code's "
                             f"({newest}): it was written by a newer rsiflow; upgrade rsiflow to use it")
        if not versions:
            # schema_migrations alone: a store being created (on a lake, by another process right now)
            tables = [t for (t,) in self._con.sql("SELECT table_name FROM information_schema.tables"
                                                   " WHERE table_catalog = current_database()"
                                                   " AND table_name <> 'schema_migrations'"
                                                   " ORDER BY table_name").fetchall()]
            if tables:
                raise StoreError(f"store {self.path} is a DuckDB database but not an rsiflow store (tables "
                                 f"{', '.join(tables[:5])}{', ...' if len(tables) > 5 else ''}; no schema_migrations); "
                                 f"set run.store to another path")

    def _connect(self, wait_s: float) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + wait_s
        delay = 0.05
        while True:
            try:
                return duckdb.connect(str(self.path), read_only=self.read_only)
            except duckdb.Error as err:
                if not is_lock_error(err):
                    raise self._open_error(err) from None
                if time.monotonic() >= deadline:
                    raise self._locked_error(err, wait_s) from err
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def _open_error(self, err: duckdb.Error) -> StoreError:
        said = str(err).splitlines()[0]
        if self.path.is_file() and "not a valid DuckDB database" in said:
            return StoreError(f"store {self.path} is not a DuckDB database (the file exists but DuckDB can't read "
                              f"it); set run.store to another path or move that file away")
        return StoreError(f"store {self.path} can't be opened{'' if self.read_only else ' or created'} "
                          f"(DuckDB: {said}); set run.store to a file in a writable folder")

    def _locked_error(self, err: duckdb.Error, wait_s: float) -> StoreLockedError:
        pid = re.search(r"PID (\d+)", str(err))
        holder = f"process {pid.group(1)}" if pid else "another process"
        return StoreLockedError(
            f"store {self.path} is locked by {holder} (waited {wait_s:g} s). DuckDB allows one "
            f"process to open a file for writing: wait for that process to finish (pipeline "
            f"steps hold the store only while they write), stop it, or open with a longer "
            f"wait_s. DuckDB said: {str(err).splitlines()[0]}"
        )

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection, for plain SQL."""
        return self._con

    def close(self) -> None:
        """Close the connection (DuckDB checkpoints the WAL into the file on close; a lake is detached)."""
        self._con.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- inserts --------------------------------------------------------------------------

    def _find_step_tables(self) -> set[str]:
        """Tables with run_id, round and step columns, whose rows belong to one pipeline step."""
        rows = self._con.sql(
            "SELECT table_name FROM information_schema.columns"
            " WHERE table_catalog = current_database() AND table_schema = 'main'"
            " AND column_name IN ('run_id', 'round', 'step')"
            " GROUP BY table_name HAVING count(*) = 3"
        ).fetchall()
        return {t for (t,) in rows} - NOT_STEP_DATA

    def _schema(self, table: str) -> tuple[pa.Schema, set[str]]:
        """The Arrow schema DuckDB gives `table` (JSON columns appear as strings) and the
        names of its JSON columns."""
        if table not in self._schemas:
            json_cols = self._con.sql(
                "SELECT column_name, data_type = 'JSON' FROM information_schema.columns"
                " WHERE table_catalog = current_database() AND table_schema = 'main' AND table_name = ?",
                params=[table],
            ).fetchall()
            if not json_cols:
                raise ValueError(f"unknown table {table!r}")
            schema = self._con.sql(f'SELECT * FROM "{table}" LIMIT 0').to_arrow_table().schema
            self._schemas[table] = (schema, {name for name, is_json in json_cols if is_json})
        return self._schemas[table]

    def _to_arrow(self, table: str, rows: Rows) -> pa.Table:
        """Check column names against `table` and build an Arrow table of the given columns."""
        schema, json_cols = self._schema(table)
        if isinstance(rows, pa.Table):
            columns = rows.column_names
        else:
            columns = list(dict.fromkeys(k for r in rows for k in r))  # union, in first-seen order
        unknown = [c for c in columns if schema.get_field_index(c) < 0]
        if unknown:
            raise ValueError(f"table {table!r} has no column {unknown[0]!r}")
        if isinstance(rows, pa.Table):
            return rows
        json_cols = json_cols & set(columns)
        if json_cols:
            rows = [{k: (json_text(v) if k in json_cols else v) for k, v in r.items()} for r in rows]
        return pa.Table.from_pylist(rows, schema=pa.schema([schema.field(c) for c in columns]))

    def _with_step_key(self, table: str, data: pa.Table, key: tuple[str, int, str]) -> pa.Table:
        """Fill absent key columns with `key`; check present ones equal it."""
        schema, _ = self._schema(table)
        for name, value in zip(STEP_KEY, key):
            if name in data.column_names:
                col = data.column(name)
                if col.null_count or not pc.all(pc.equal(col, pa.scalar(value, col.type))).as_py():
                    raise ValueError(
                        f"rows for {table!r} must have {name} = {value!r} (the step's key); "
                        f"leave the column out to have it filled in"
                    )
            else:
                field = schema.field(name)
                data = data.append_column(field, pa.repeat(pa.scalar(value, field.type), data.num_rows))
        return data

    def _insert(self, table: str, rows: Rows, step_key: tuple[str, int, str] | None,
                replay: list | None = None) -> int:
        """Bulk insert through Arrow; columns left out get their default (NULL unless declared). On a lake the
        insert is also appended to `replay` (a step's log, run again if its commit loses a write conflict)."""
        if not isinstance(rows, pa.Table) and not rows:
            return 0
        data = self._to_arrow(table, rows)
        if step_key is not None:
            data = self._with_step_key(table, data, step_key)
        if data.num_rows == 0:
            return 0
        if self.lake:
            data = self._with_now_defaults(table, data)
            if replay is not None:
                replay.append(("insert", table, data))
        self._insert_arrow(table, data)
        return data.num_rows

    def _with_now_defaults(self, table: str, data: pa.Table) -> pa.Table:
        """Fill the columns the embedded schema defaults to now() (lake tables take literal defaults only)."""
        schema, _ = self._schema(table)
        now = utc_timestamp()
        for name in sorted(NOW_DEFAULTS.get(table, set()) - set(data.column_names)):
            field = schema.field(name)
            data = data.append_column(field, pa.repeat(pa.scalar(now, field.type), data.num_rows))
        return data

    def _insert_arrow(self, table: str, data: pa.Table) -> None:
        view = "__rsiflow_insert"
        self._con.register(view, data)
        # No try/finally: after a failed INSERT the transaction is aborted and unregister()
        # would fail too, hiding the real error. The next insert or close() drops the view.
        self._con.execute(f'INSERT INTO "{table}" BY NAME SELECT * FROM {view}')
        self._con.unregister(view)
