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

import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from rsiflow.stores import lake as lakes
from rsiflow.stores.migrations import MIGRATIONS, applied_versions, apply_method_migrations, apply_migrations

# On a lake, columns the embedded schema fills with now() (DuckLake takes only literal defaults).
_NOW_DEFAULTS = lakes.now_defaults([sql for _, _, sql in MIGRATIONS])

Rows = list[dict[str, Any]] | pa.Table

STEP_KEY = ("run_id", "round", "step")

# Tables keyed by (run_id, round, step) that Store.step must not clear: `steps` is the
# step's own status row.
_NOT_STEP_DATA = {"steps"}


class StoreError(RuntimeError):
    """The store can't be opened as asked (missing, not a DuckDB file, not a folder, a newer schema, locked);
    the message says which file, why, and what to do, in one line."""


class StoreLockedError(StoreError):
    """Another process holds the DuckDB file's write lock."""


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _json_text(value: Any) -> str | None:
    """Serialise a Python value for a JSON column; a str is taken as JSON text already."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def _is_lock_error(err: duckdb.Error) -> bool:
    return isinstance(err, duckdb.IOException) and "lock" in str(err).lower()


def _rollback_quietly(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back after a failed statement or commit (a failed commit may have ended the transaction already)."""
    try:
        con.rollback()
    except duckdb.TransactionException:
        pass


def _is_conflict(err: BaseException) -> bool:
    """A lake transaction that lost a write conflict to a concurrent one (safe to run again from the start)."""
    return isinstance(err, duckdb.TransactionException) and "conflict" in str(err).lower()


def _backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 1.5 ** attempt, 1.0))


def _dicts(rel: duckdb.DuckDBPyRelation) -> list[dict]:
    """A relation's rows as dicts (DuckDB 2.0 has `to_dicts`; 1.4, the lake's DuckDB, has not)."""
    if hasattr(rel, "to_dicts"):
        return rel.to_dicts()
    names = rel.columns
    return [dict(zip(names, row)) for row in rel.fetchall()]


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StepWriter:
    """Writes of one pipeline step, inside the transaction opened by `Store.step`."""

    def __init__(self, store: "Store", run_id: str, round_no: int, step: str):
        self.store = store
        self.run_id = run_id
        self.round = round_no
        self.step = step
        self.step_metrics: dict | None = None
        # On a lake: the writes so far, run again in order if the commit loses a write conflict.
        self.replay: list[tuple[str, Any, Any]] = []

    def insert(self, table: str, rows: Rows) -> int:
        """Insert rows into `table`; return how many.

        In tables keyed by (run_id, round, step) the key columns are filled with this step's
        key when absent; present, they must equal it (otherwise a rerun could not replace them).
        """
        key = (self.run_id, self.round, self.step)
        return self.store._insert(table, rows, key if table in self.store.step_tables else None, self.replay)

    def execute(self, sql: str, params: list | dict | None = None) -> list[tuple]:
        """Run one SQL statement (e.g. `UPDATE models SET role = ...`) inside the step's
        transaction and return its rows (for an UPDATE or DELETE: `[(rows_changed,)]`).

        The result is fetched at once because DuckDB 2.0 refuses further work on a connection
        that holds an unfinished result.
        """
        if self.store.lake:
            self.replay.append(("execute", sql, params))
        return self.store.con.execute(sql, params).fetchall()

    def set_model_role(self, model_id: str, role: str) -> None:
        """Change a registered model's role (candidate → champion or rejected); LookupError if it is unknown."""
        changed = self.execute("UPDATE models SET role = ? WHERE model_id = ?", [role, model_id])[0][0]
        if not changed:
            raise LookupError(f"model {model_id!r} is not in the store's registry")

    def metrics(self, metrics: dict) -> None:
        """Record what this step reports about itself (stored in `steps.metrics` when the step commits)."""
        self.step_metrics = metrics


class Store:
    """One project's DuckDB file, or a DuckLake (stores/lake.py): schema migrations, step transactions,
    run/round bookkeeping, dataset export and lineage queries."""

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
                _rollback_quietly(con)
                if not _is_conflict(err) or attempt == lakes.CONFLICT_RETRIES - 1:
                    raise
            self.conflicts_retried += 1
            _backoff(attempt)
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
                if not _is_lock_error(err):
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

    def __enter__(self) -> "Store":
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
        return {t for (t,) in rows} - _NOT_STEP_DATA

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
            rows = [{k: (_json_text(v) if k in json_cols else v) for k, v in r.items()} for r in rows]
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
        now = _utcnow()
        for name in sorted(_NOW_DEFAULTS.get(table, set()) - set(data.column_names)):
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

    # ---- step transactions ----------------------------------------------------------------

    @contextmanager
    def step(self, run_id: str, round_no: int, step: str, started_at: datetime | None = None) -> Iterator[StepWriter]:
        """One transaction for a pipeline step's writes, keyed by (run_id, round, step).

        `started_at` is when the step's work began (steps compute first and write at the end, so
        the step's duration is finished_at - started_at); default: now.

        On enter: BEGIN, mark the step running, delete every row the key wrote before (in all
        step-keyed tables, including `models` rows created by the step). On normal exit: mark
        it completed and COMMIT. On an exception: ROLLBACK, record the step as failed with the
        error text in a new transaction, and re-raise.
        """
        if self.lake:
            yield from self._lake_step(run_id, round_no, step, started_at or _utcnow())
            return
        con = self._con
        started = started_at or _utcnow()
        con.begin()
        try:
            con.execute(
                "INSERT OR REPLACE INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                " VALUES (?, ?, ?, 'running', ?, NULL, NULL, NULL)",
                [run_id, round_no, step, started],
            )
            for table in sorted(self.step_tables):
                con.execute(
                    f'DELETE FROM "{table}" WHERE run_id = ? AND round = ? AND step = ?',
                    [run_id, round_no, step],
                )
            writer = StepWriter(self, run_id, round_no, step)
            yield writer
            con.execute(
                "UPDATE steps SET status = 'completed', finished_at = ?, metrics = ?"
                " WHERE run_id = ? AND round = ? AND step = ?",
                [_utcnow(), _json_text(writer.step_metrics), run_id, round_no, step],
            )
            con.commit()
        except BaseException as err:
            con.rollback()
            con.execute(
                "INSERT OR REPLACE INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)",
                [run_id, round_no, step, started, _utcnow(), f"{type(err).__name__}: {err}"],
            )
            raise

    def _lake_step(self, run_id: str, round_no: int, step: str, started: datetime) -> Iterator[StepWriter]:
        """`step` on a lake. No key to replace the status row by, so the transaction deletes the key's rows (its
        old status row with them) and inserts the completed status row at the end. If the commit loses a write
        conflict (a concurrent transaction deleted from a Parquet file this one deletes from), the transaction
        is run again from the start: the deletes, then the step's logged writes in order (each is keyed by
        the step or by ids it owns, so running them again gives the same rows). Round 0 (the run's creation, before
        any lease exists) also takes the lake's lock row, so two processes creating one run write it once."""
        con = self._con
        key = [run_id, round_no, step]

        def clear() -> None:
            if round_no == 0:
                con.execute(lakes.LEASE_LOCK_SQL)
            for table in sorted(self.step_tables | {"steps"}):
                con.execute(f'DELETE FROM "{table}" WHERE run_id = ? AND round = ? AND step = ?', key)

        def finish(writer: StepWriter) -> None:
            con.execute("INSERT INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                        " VALUES (?, ?, ?, 'completed', ?, ?, NULL, ?)",
                        [*key, started, _utcnow(), _json_text(writer.step_metrics)])
            con.commit()

        writer = StepWriter(self, run_id, round_no, step)
        con.begin()
        try:
            clear()
            self._lake_writer = writer
            yield writer
        except BaseException as err:   # the step's own error: nothing of it is committed
            self._lake_writer = None
            _rollback_quietly(con)
            self._lake_tx(lambda e=err: self._lake_step_failed(key, started, e))
            raise
        self._lake_writer = None
        try:
            finish(writer)
        except BaseException as err:   # the commit: replayed only when it lost a write conflict
            _rollback_quietly(con)
            if not _is_conflict(err):
                self._lake_tx(lambda e=err: self._lake_step_failed(key, started, e))
                raise
            self._lake_replay(writer, clear, finish, started)

    def _lake_replay(self, writer: StepWriter, clear, finish, started: datetime) -> None:
        """Run a lake step's transaction again (clear, its logged writes, finish) until it commits."""
        con = self._con
        for attempt in range(lakes.CONFLICT_RETRIES):
            self.conflicts_retried += 1
            _backoff(attempt)
            con.begin()
            try:
                clear()
                for kind, what, arg in writer.replay:
                    if kind == "insert":
                        self._insert_arrow(what, arg)
                    elif kind == "call":   # a Store write made inside the step (e.g. finish_round)
                        what()
                    else:
                        con.execute(what, arg).fetchall()
                finish(writer)
                return
            except BaseException as err:
                _rollback_quietly(con)
                if not _is_conflict(err) or attempt == lakes.CONFLICT_RETRIES - 1:
                    key = [writer.run_id, writer.round, writer.step]
                    self._lake_tx(lambda k=key, e=err: self._lake_step_failed(k, started, e))
                    raise

    def _lake_step_failed(self, key: list, started: datetime, err: BaseException) -> None:
        self._con.execute("DELETE FROM steps WHERE run_id = ? AND round = ? AND step = ?", key)
        self._con.execute("INSERT INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                          " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)",
                          [*key, started, _utcnow(), f"{type(err).__name__}: {err}"])

    # ---- runs and rounds ------------------------------------------------------------------

    def create_run(self, run_id: str, name: str, config: dict, base_model: str) -> None:
        """Record a run. Creating it again with the same config is a no-op; with a different
        config it is a ValueError (start a new run id instead)."""
        existing = self.get_run(run_id)
        if existing is not None:
            if existing["config"] != json.loads(json.dumps(config)):
                raise ValueError(
                    f"run {run_id!r} already exists with a different config; "
                    f"use a new run id for a new config"
                )
            return
        if self.lake:   # no key on a lake: the lock row makes a concurrent creation of the same run conflict
            def create() -> None:
                if self.get_run(run_id) is None:
                    self._con.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
                                      [run_id, name, json.dumps(config), base_model, _utcnow()])
            self._lake_tx(create, lock=True)
            self.create_run(run_id, name, config, base_model)   # the config check, had another process won
            return
        self._con.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
            [run_id, name, json.dumps(config), base_model, _utcnow()],
        )

    def get_run(self, run_id: str) -> dict | None:
        """The run's row with its config parsed, or None."""
        rows = self.rows("SELECT * FROM runs WHERE run_id = ?", [run_id], json_cols=("config",))
        return rows[0] if rows else None

    def list_runs(self) -> list[dict]:
        """All runs, oldest first, configs parsed."""
        return self.rows("SELECT * FROM runs ORDER BY created_at, run_id", json_cols=("config",))

    def start_round(self, run_id: str, round_no: int, champion_before: str | None) -> None:
        """Mark a round running. Starting it again (resume) keeps its original started_at."""
        if self.lake:   # no key for ON CONFLICT on a lake: update the row, or insert it
            def start() -> None:
                changed = self._con.execute(
                    "UPDATE rounds SET status = 'running', champion_before = ?, finished_at = NULL"
                    " WHERE run_id = ? AND round = ?", [champion_before, run_id, round_no]).fetchall()[0][0]
                if not changed:
                    self._con.execute("INSERT INTO rounds (run_id, round, status, champion_before, started_at)"
                                      " VALUES (?, ?, 'running', ?, ?)", [run_id, round_no, champion_before, _utcnow()])
            self._lake_tx(start)
            return
        self._con.execute(
            "INSERT INTO rounds (run_id, round, status, champion_before, started_at)"
            " VALUES (?, ?, 'running', ?, ?)"
            " ON CONFLICT (run_id, round) DO UPDATE SET status = 'running',"
            " champion_before = excluded.champion_before, finished_at = NULL",
            [run_id, round_no, champion_before, _utcnow()],
        )

    def finish_round(self, run_id: str, round_no: int, champion_after: str | None, metrics: dict) -> None:
        """Mark a started round completed with its resulting champion and metrics."""
        def finish() -> int:
            return self._con.execute(
                "UPDATE rounds SET status = 'completed', champion_after = ?, finished_at = ?, metrics = ?"
                " WHERE run_id = ? AND round = ?",
                [champion_after, _utcnow(), json.dumps(metrics), run_id, round_no],
            ).fetchall()[0][0]
        updated = self._lake_tx(finish) if self.lake else finish()
        if not updated:
            raise ValueError(f"round {round_no} of run {run_id!r} was never started")

    def record_flow_run(self, run_id: str, round_no: int, flow_run_id: str, flow_run_name: str | None,
                        deployment_id: str | None = None) -> None:
        """Note that the Prefect flow run `flow_run_id` runs `round` of the run (once per flow run and round)."""
        def write() -> None:
            if not self._con.execute("SELECT 1 FROM round_flow_runs WHERE run_id = ? AND round = ? AND flow_run_id = ?",
                                     [run_id, round_no, flow_run_id]).fetchall():
                self._con.execute("INSERT INTO round_flow_runs VALUES (?, ?, ?, ?, ?, ?)",
                                  [run_id, round_no, flow_run_id, flow_run_name, deployment_id, _utcnow()])
        if self.lake:
            self._lake_tx(write)
        else:
            write()

    def flow_run_round(self, run_id: str, flow_run_id: str) -> int | None:
        """The round of the run that the flow run ran before (its latest), or None."""
        rows = self._con.execute("SELECT max(round) FROM round_flow_runs WHERE run_id = ? AND flow_run_id = ?",
                                 [run_id, flow_run_id]).fetchall()
        return rows[0][0]

    def round_flow_runs(self, run_id: str, round_no: int) -> list[dict]:
        """The flow runs that ran or resumed the round, first first."""
        return self.rows("SELECT flow_run_id, flow_run_name, deployment_id, started_at FROM round_flow_runs"
                         " WHERE run_id = ? AND round = ? ORDER BY started_at", [run_id, round_no])

    def step_failed(self, run_id: str, round_no: int, step: str, started_at: datetime, error: str) -> None:
        """Record the step's attempt as failed with `error`, for a failure outside its transaction (a step stopped
        by its timeout before it wrote anything). An attempt that recorded its own end keeps that record."""
        key = [run_id, round_no, step]

        def write() -> None:
            if self._con.execute("SELECT 1 FROM steps WHERE run_id = ? AND round = ? AND step = ?"
                                 " AND status IN ('failed', 'completed') AND started_at >= ?",
                                 [*key, started_at]).fetchall():
                return   # the attempt recorded its own end
            self._con.execute("DELETE FROM steps WHERE run_id = ? AND round = ? AND step = ?", key)
            self._con.execute("INSERT INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                              " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)", [*key, started_at, _utcnow(), error])
        if self.lake:
            self._lake_tx(write)
        else:
            write()

    def round_status(self, run_id: str, round_no: int) -> str | None:
        """'running' or 'completed', or None if the round was never started."""
        rows = self._con.sql(
            "SELECT status FROM rounds WHERE run_id = ? AND round = ?", params=[run_id, round_no]
        ).fetchall()
        return rows[0][0] if rows else None

    def completed_steps(self, run_id: str, round_no: int) -> set[str]:
        """Names of the round's steps whose last attempt committed."""
        rows = self._con.sql(
            "SELECT step FROM steps WHERE run_id = ? AND round = ? AND status = 'completed'",
            params=[run_id, round_no],
        ).fetchall()
        return {s for (s,) in rows}

    def last_completed_round(self, run_id: str) -> int:
        """The highest completed round of the run, or -1."""
        return self._con.sql(
            "SELECT coalesce(max(round), -1) FROM rounds WHERE run_id = ? AND status = 'completed'",
            params=[run_id],
        ).fetchall()[0][0]

    def champion(self, run_id: str) -> str | None:
        """The run's current champion: the newest gate decision's new_champion_id, else the
        run's base model (its `models` row with role 'base'), else None."""
        rows = self._con.sql(
            "SELECT new_champion_id FROM gate_decisions"
            " WHERE run_id = ? AND new_champion_id IS NOT NULL"
            " ORDER BY round DESC, decided_at DESC LIMIT 1",
            params=[run_id],
        ).fetchall()
        if not rows:
            rows = self._con.sql(
                "SELECT model_id FROM models WHERE run_id = ? AND role = 'base'"
                " ORDER BY created_at LIMIT 1",
                params=[run_id],
            ).fetchall()
        return rows[0][0] if rows else None

    # ---- run leases: one round of a run at a time --------------------------------------------

    def lease(self, run_id: str) -> dict | None:
        """The run's lease row (holder, host, pid, flow_run_id, flow_run_name, acquired_at, heartbeat_at,
        expires_at), or None when nobody holds the run."""
        rows = self.rows("SELECT * FROM leases WHERE run_id = ?", [run_id])
        return rows[0] if rows else None

    def acquire_lease(self, run_id: str, holder: str, ttl_s: float, host: str, pid: int,
                      flow_run_id: str | None = None, flow_run_name: str | None = None) -> tuple[dict, dict | None]:
        """Try to take the run's lease for `holder` (the process `pid` on `host`) for `ttl_s` seconds, in one
        transaction. Returns (the lease row as this transaction left it, the row that was replaced or None).

        The lease is taken when nobody holds it, when `holder` holds it already (renewed, acquired_at kept),
        when it expired (its holder stopped heartbeating: crashed, or cut off), or at once when its holder is
        another process on this host that no longer exists. Otherwise the row is left alone: the caller holds
        the lease only if the returned row's holder is `holder`. Two connections of one process racing for a
        free lease: DuckDB aborts the later writer, which tries again and then sees the winner's row.

        On a lake, processes anywhere race for it: the transaction first updates the lake's lock row, so of two
        concurrent ones the later commit fails (a write conflict) and it tries again, seeing the winner's row.
        """
        con = self._con
        for attempt in range(lakes.CONFLICT_RETRIES if self.lake else 50):
            now = _utcnow()
            con.begin()
            try:
                if self.lake:
                    con.execute(lakes.LEASE_LOCK_SQL)
                row = self.lease(run_id)
                ours = row is not None and row["holder"] == holder
                free = (row is None or ours or row["expires_at"] <= now
                        or (row["host"] == host and row["pid"] != pid and not _pid_alive(row["pid"])))
                if free:
                    if self.lake:   # no key on a lake: replace the row by hand
                        con.execute("DELETE FROM leases WHERE run_id = ?", [run_id])
                    con.execute(
                        f"INSERT {'' if self.lake else 'OR REPLACE '}INTO leases (run_id, holder, host, pid,"
                        " flow_run_id, flow_run_name, acquired_at, heartbeat_at, expires_at)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [run_id, holder, host, pid, flow_run_id, flow_run_name,
                         row["acquired_at"] if ours else now, now, now + timedelta(seconds=ttl_s)],
                    )
                # the row as this transaction leaves it: a re-read after the commit could see the holder's
                # release in between (None), or a later taker
                now_row = self.lease(run_id) if free else row
                con.commit()
            except (duckdb.TransactionException, duckdb.ConstraintException):
                # another connection of this process (a lake: another process) wrote the row first; read it once
                # it has committed
                _rollback_quietly(con)
                if self.lake:
                    self.conflicts_retried += 1
                    _backoff(attempt)
                else:
                    time.sleep(0.01 * (attempt + 1))
                continue
            except BaseException:
                _rollback_quietly(con)
                raise
            return now_row, (row if free and row is not None and not ours else None)
        raise RuntimeError(f"could not read or take the lease of run {run_id!r}: {attempt + 1} write conflicts in a"
                           " row")

    def heartbeat_lease(self, run_id: str, holder: str, ttl_s: float, flow_run_id: str | None = None,
                        flow_run_name: str | None = None) -> bool:
        """Renew `holder`'s lease for `ttl_s` seconds from now (and record the flow run now executing under it,
        when given); False when `holder` no longer holds the run (it was taken over)."""
        now = _utcnow()
        return bool(self._lease_write(
            "UPDATE leases SET heartbeat_at = ?, expires_at = ?, flow_run_id = coalesce(?, flow_run_id),"
            " flow_run_name = coalesce(?, flow_run_name) WHERE run_id = ? AND holder = ?",
            [now, now + timedelta(seconds=ttl_s), flow_run_id, flow_run_name, run_id, holder]))

    def release_lease(self, run_id: str, holder: str) -> bool:
        """Give the run's lease back; False when `holder` did not hold it (any more)."""
        return bool(self._lease_write("DELETE FROM leases WHERE run_id = ? AND holder = ?", [run_id, holder]))

    def _lease_write(self, sql: str, params: list) -> int:
        """One statement on a lease row, retried while another connection of this process writes the same row
        (DuckDB refuses the later writer: "Conflict on update"); returns the rows changed. On a lake, in a
        transaction that takes the lake's lock row (stores/lake.py), run again while it loses a conflict."""
        if self.lake:
            return self._lake_tx(lambda: self._con.execute(sql, params).fetchall()[0][0], lock=True)
        for attempt in range(50):
            try:
                return self._con.execute(sql, params).fetchall()[0][0]
            except duckdb.TransactionException:
                time.sleep(0.01 * (attempt + 1))
        raise RuntimeError(f"{sql.split()[0]} on a lease row: 50 write conflicts in a row")

    # ---- export ---------------------------------------------------------------------------

    def examples_dataset(self, run_id: str, round_no: int, method: str | None = None):
        """The round's training examples as a `datasets.Dataset` (built from Arrow, no copy
        through Python objects): example_id, method, weight, source_traj_id, meta (JSON text), and
        messages as a list of {"role", "content"} dicts (other message keys are dropped)."""
        import datasets  # imports pandas: keep it off the store's import path

        sql = (
            "SELECT example_id, method, weight, source_traj_id, CAST(meta AS VARCHAR) AS meta,"
            " json_transform(messages, '[{\"role\": \"VARCHAR\", \"content\": \"VARCHAR\"}]') AS messages"
            " FROM examples WHERE run_id = ? AND round = ?"
        )
        params: list = [run_id, round_no]
        if method is not None:
            sql += " AND method = ?"
            params.append(method)
        table = self._con.sql(sql + " ORDER BY method, example_id", params=params).to_arrow_table()
        return datasets.Dataset(table)

    def export_parquet(self, run_id: str, round_no: int, folder: str | Path) -> dict[str, Path]:
        """Write the round's trajectories, turns and examples to `folder/<table>.parquet`;
        return the paths by table name."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for table in ("trajectories", "turns", "examples"):
            path = folder / f"{table}.parquet"
            self._con.sql(
                f"SELECT * FROM {table} WHERE run_id = ? AND round = ?", params=[run_id, round_no]
            ).write_parquet(str(path))
            paths[table] = path
        return paths

    # ---- what the pipeline steps read -----------------------------------------------------------

    def model_path(self, model_id: str) -> str:
        """The checkpoint path of a registered model; LookupError if it is not registered."""
        rows = self._con.execute("SELECT path FROM models WHERE model_id = ?", [model_id]).fetchall()
        if not rows:
            raise LookupError(f"model {model_id!r} is not in the store's registry")
        return rows[0][0]

    def has_model(self, model_id: str) -> bool:
        """Whether `model_id` is registered (e.g. the round's candidate was trained)."""
        return bool(self._con.execute("SELECT count(*) FROM models WHERE model_id = ?", [model_id]).fetchall()[0][0])

    def train_metrics(self, model_id: str | None) -> dict:
        """The training metrics recorded with a model ({} for none, or an untrained model)."""
        if model_id is None:
            return {}
        rows = self.rows("SELECT train_metrics FROM models WHERE model_id = ?", [model_id],
                         json_cols=("train_metrics",))
        return (rows[0]["train_metrics"] or {}) if rows else {}

    def step_tasks(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """The tasks a step played: task_id, env, split, task_type, seed, spec (JSON text)."""
        return self.rows("SELECT task_id, env, split, task_type, seed, spec FROM tasks"
                         " WHERE run_id = ? AND round = ? AND step = ? ORDER BY task_id", [run_id, round_no, step])

    def step_trajectories(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """Every column of a step's trajectories, by traj_id, joined with their task's task_type."""
        return self.rows("SELECT t.*, k.task_type FROM trajectories t LEFT JOIN tasks k"
                         " ON k.task_id = t.task_id AND k.run_id = t.run_id AND k.round = t.round AND k.step = t.step"
                         " WHERE t.run_id = ? AND t.round = ? AND t.step = ? ORDER BY t.traj_id",
                         [run_id, round_no, step])

    def step_turns(self, run_id: str, round_no: int, step: str) -> list[dict]:
        """A step's turns in order (traj_id, turn_idx): observation as shown, executed action, the raw
        generated text when projection changed it, validity, the env's feedback, the sampled token ids and
        their logprobs (as sampled, and after temperature only)."""
        return self.rows("SELECT traj_id, turn_idx, observation, action_text, raw_text, valid, feedback, token_ids,"
                         " logprobs, temp_logprobs FROM turns"
                         " WHERE run_id = ? AND round = ? AND step = ? ORDER BY traj_id, turn_idx",
                         [run_id, round_no, step])

    def trajectory_actions(self, traj_ids: list[str]) -> dict[str, list[str]]:
        """The executed action texts of these trajectories, in turn order (traj_id -> actions)."""
        if not traj_ids:
            return {}
        rows = self.rows("SELECT traj_id, action_text FROM turns WHERE list_contains(?, traj_id)"
                         " ORDER BY traj_id, turn_idx", [list(traj_ids)])
        out: dict[str, list[str]] = {}
        for r in rows:
            out.setdefault(r["traj_id"], []).append(r["action_text"])
        return out

    def eval_trajectories(self, run_id: str, model_id: str) -> list[dict]:
        """A model's held-out (purpose 'eval') trajectories of the run, newest round first."""
        return self.rows("SELECT traj_id, task_id, success, gen_tokens, round FROM trajectories"
                         " WHERE run_id = ? AND model_id = ? AND purpose = 'eval' ORDER BY round DESC, traj_id",
                         [run_id, model_id])

    def foresight_pairs(self, run_id: str, round_no: int) -> dict[str, dict]:
        """The round's privileged-teacher pairs by foresight_id: student and teacher messages (parsed),
        train_from, the student's sampled completion ids and their sampling logprobs."""
        rows = self.rows("SELECT foresight_id, student_messages, teacher_messages, train_from, completion_ids,"
                         " sampling_logprobs FROM foresight WHERE run_id = ? AND round = ? AND step = 'distill'",
                         [run_id, round_no], json_cols=("student_messages", "teacher_messages"))
        return {r["foresight_id"]: r for r in rows}

    def base_model(self, run_id: str) -> str | None:
        """The run's base model (its `models` row with role 'base'), or None."""
        rows = self.rows("SELECT model_id FROM models WHERE run_id = ? AND role = 'base' ORDER BY created_at LIMIT 1",
                         [run_id])
        return rows[0]["model_id"] if rows else None

    def latest_heldout(self, run_id: str, model_id: str | None, split: str = "heldout") -> dict | None:
        """A model's newest evaluation of `split` ('heldout': greedy; 'heldout:sampled': the sampled plays; 'test',
        'test:sampled': the final test split) over all task types: success_rate, ci_low, ci_high, n, successes,
        tokens_per_success; None if it has none."""
        if model_id is None:
            return None
        rows = self.rows("SELECT success_rate, ci_low, ci_high, n, successes, tokens_per_success FROM evaluations"
                         " WHERE run_id = ? AND model_id = ? AND split = ? AND task_type = '*'"
                         " ORDER BY round DESC LIMIT 1", [run_id, model_id, split])
        return rows[0] if rows else None

    def projected_share(self, run_id: str, round_no: int) -> float | None:
        """Share of the round's generated actions that projection replaced (None without turns)."""
        return self._con.execute("SELECT avg(CASE WHEN raw_text IS NULL THEN 0 ELSE 1 END) FROM turns"
                                 " WHERE run_id = ? AND round = ? AND step = 'generate'",
                                 [run_id, round_no]).fetchall()[0][0]

    def count_examples(self, run_id: str, round_no: int) -> int:
        """Training examples the round's distill step wrote (all methods)."""
        return self._con.execute("SELECT count(*) FROM examples WHERE run_id = ? AND round = ?",
                                 [run_id, round_no]).fetchall()[0][0]

    def step_seconds(self, run_id: str, round_no: int) -> dict[str, float]:
        """Wall seconds of each completed step of the round."""
        rows = self._con.execute("SELECT step, epoch(finished_at - started_at) FROM steps"
                                 " WHERE run_id = ? AND round = ? AND status = 'completed'",
                                 [run_id, round_no]).fetchall()
        return {step: float(s) for step, s in rows}

    def step_metrics(self, run_id: str, round_no: int, step: str) -> dict | None:
        """What a completed step recorded about itself (`StepWriter.metrics`), or None."""
        rows = self.rows("SELECT metrics FROM steps"
                         " WHERE run_id = ? AND round = ? AND step = ? AND status = 'completed'",
                         [run_id, round_no, step], json_cols=("metrics",))
        return rows[0]["metrics"] if rows else None

    def completed_step_metrics(self, step: str) -> list[dict]:
        """run_id, round and metrics of every completed step named `step`, over all runs of the store."""
        return self.rows("SELECT run_id, round, metrics FROM steps WHERE step = ? AND status = 'completed'"
                         " ORDER BY run_id, round", [step], json_cols=("metrics",))

    def step_history(self, run_id: str) -> list[dict]:
        """Every step attempt's last state: round, step, status, started/finished, error."""
        return self.rows("SELECT round, step, status, started_at, finished_at, error FROM steps"
                         " WHERE run_id = ? ORDER BY round, started_at", [run_id])

    def round_history(self, run_id: str) -> list[dict]:
        """The run's rounds in order: round, status, champion_before, champion_after, started_at, finished_at."""
        return self.rows("SELECT round, status, champion_before, champion_after, started_at, finished_at FROM rounds"
                         " WHERE run_id = ? ORDER BY round", [run_id])

    # ---- retention ------------------------------------------------------------------------

    def expired_checkpoints(self, run_id: str, keep_candidates: int) -> list[dict]:
        """Rejected candidates of the run older than its last `keep_candidates` trained candidates whose
        deletion is not recorded yet: model_id, round, path. Base and champions (the lineage) are never listed."""
        return self.rows(
            "WITH c AS (SELECT model_id, round, path, role, row_number() OVER (ORDER BY round DESC) AS newest"
            " FROM models WHERE run_id = ? AND role IN ('candidate', 'champion', 'rejected') AND parent_id IS NOT NULL)"
            " SELECT model_id, round, path FROM c WHERE role = 'rejected' AND newest > ?"
            " AND model_id NOT IN (SELECT model_id FROM deleted_checkpoints) ORDER BY round",
            [run_id, keep_candidates])

    def deleted_checkpoints(self, run_id: str) -> list[dict]:
        """The run's checkpoints deleted by retention: model_id, round, path, bytes, reason, deleted_at."""
        return self.rows("SELECT model_id, round, path, bytes, reason, deleted_at FROM deleted_checkpoints"
                         " WHERE run_id = ? ORDER BY round, model_id", [run_id])

    # ---- lineage --------------------------------------------------------------------------

    def trajectory_lineage(self, run_id: str) -> list[dict]:
        """Each trajectory of the run with the model that produced it and that model's path
        and role. The plain SQL:

            SELECT t.traj_id, t.round, t.step, t.task_id, t.purpose, t.success, t.reward,
                   t.model_id, m.path AS model_path, m.role AS model_role
            FROM trajectories t LEFT JOIN models m USING (model_id)
            WHERE t.run_id = ?
        """
        return self.rows(
            "SELECT t.traj_id, t.round, t.step, t.task_id, t.purpose, t.success, t.reward,"
            " t.model_id, m.path AS model_path, m.role AS model_role"
            " FROM trajectories t LEFT JOIN models m USING (model_id)"
            " WHERE t.run_id = ? ORDER BY t.round, t.step, t.traj_id",
            [run_id],
        )

    def training_examples_of(self, model_id: str) -> list[dict]:
        """The examples that trained `model_id`, with the trajectory each was distilled from.
        The plain SQL:

            SELECT e.*, t.model_id AS source_model_id, t.success AS source_success
            FROM train_inputs i
            JOIN examples e USING (example_id, run_id)
            LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id
            WHERE i.model_id = ?
        """
        return self.rows(
            "SELECT e.example_id, e.method, e.weight, e.messages, e.source_traj_id,"
            " e.round, e.step, t.model_id AS source_model_id, t.success AS source_success"
            " FROM train_inputs i"
            " JOIN examples e ON e.example_id = i.example_id AND e.run_id = i.run_id"
            " LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
            " WHERE i.model_id = ? ORDER BY e.example_id",
            [model_id],
            json_cols=("messages",),
        )

    def promotion_history(self, run_id: str) -> list[dict]:
        """Each gate decision of the run in order: candidate, champion, decision, rule, evidence
        and the champion after it. The plain SQL:

            SELECT round, candidate_id, champion_id, decision, rule, evidence, new_champion_id
            FROM gate_decisions WHERE run_id = ? ORDER BY round, decided_at
        """
        return self.rows(
            "SELECT round, step, candidate_id, champion_id, decision, rule, evidence, new_champion_id"
            " FROM gate_decisions WHERE run_id = ? ORDER BY round, decided_at",
            [run_id],
            json_cols=("evidence",),
        )

    def rows(self, sql: str, params: list | None = None, json_cols: tuple[str, ...] = ()) -> list[dict]:
        """Run a query and return its rows as dicts, parsing the named JSON columns. For benches and ad-hoc
        analysis; pipeline steps call the named methods above (steps hold no SQL)."""
        rows = _dicts(self._con.sql(sql, params=params))
        for row in rows:
            for col in json_cols:
                if row[col] is not None:
                    row[col] = json.loads(row[col])
        return rows

    # ---- replay buffer (train step) -----------------------------------------------------------

    def examples_before(self, run_id: str, round_no: int, method: str, first_round: int | None = None) -> list[dict]:
        """A method's examples of the run's rounds before `round` (from `first_round` on; None = every earlier
        round), newest round first (then by example_id): example_id, round, method, weight, source_traj_id, meta
        (parsed), messages (role/content dicts, as `examples_dataset` gives them) and the source trajectory's
        task_id (None when the trajectory is not in the store)."""
        sql = ("SELECT e.example_id, e.round, e.method, e.weight, e.source_traj_id, CAST(e.meta AS VARCHAR) AS meta,"
               " CAST(e.messages AS VARCHAR) AS messages, t.task_id"
               " FROM examples e LEFT JOIN trajectories t ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
               " WHERE e.run_id = ? AND e.method = ? AND e.round < ?")
        params: list = [run_id, method, round_no]
        if first_round is not None:
            sql += " AND e.round >= ?"
            params.append(first_round)
        rows = self.rows(sql + " ORDER BY e.round DESC, e.example_id", params, json_cols=("meta", "messages"))
        for r in rows:
            r["messages"] = [{"role": m.get("role"), "content": m.get("content")} for m in r["messages"] or []]
        return rows

    def example_task_ids(self, run_id: str, round_no: int) -> dict[str, str | None]:
        """The task of each example of the round (example_id -> its source trajectory's task_id, None when the
        trajectory is not in the store)."""
        rows = self.rows("SELECT e.example_id, t.task_id FROM examples e LEFT JOIN trajectories t"
                         " ON t.traj_id = e.source_traj_id AND t.run_id = e.run_id"
                         " WHERE e.run_id = ? AND e.round = ?", [run_id, round_no])
        return {r["example_id"]: r["task_id"] for r in rows}
