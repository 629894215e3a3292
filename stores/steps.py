"""The store's step transactions: `Store.step` (and its lake form, replayed when its commit loses a write
conflict) and the `StepWriter` a step writes its rows through."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rsiflow.stores import lake as lakes
from rsiflow.stores.common import Rows, backoff, is_conflict, json_text, rollback_quietly, utc_timestamp


class StepWriter:
    """Writes of one pipeline step, inside the transaction opened by `Store.step`."""

    def __init__(self, store: StepTransactions, run_id: str, round_no: int, step: str):
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


class StepTransactions:
    """Store's step transactions (a part of `Store`, stores/store.py)."""

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
            yield from self._lake_step(run_id, round_no, step, started_at or utc_timestamp())
            return
        con = self._con
        started = started_at or utc_timestamp()
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
                [utc_timestamp(), json_text(writer.step_metrics), run_id, round_no, step],
            )
            con.commit()
        except BaseException as err:
            con.rollback()
            con.execute(
                "INSERT OR REPLACE INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)",
                [run_id, round_no, step, started, utc_timestamp(), f"{type(err).__name__}: {err}"],
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
                        [*key, started, utc_timestamp(), json_text(writer.step_metrics)])
            con.commit()

        writer = StepWriter(self, run_id, round_no, step)
        con.begin()
        try:
            clear()
            self._lake_writer = writer
            yield writer
        except BaseException as err:   # the step's own error: nothing of it is committed
            self._lake_writer = None
            rollback_quietly(con)
            self._lake_tx(lambda e=err: self._lake_step_failed(key, started, e))
            raise
        self._lake_writer = None
        try:
            finish(writer)
        except BaseException as err:   # the commit: replayed only when it lost a write conflict
            rollback_quietly(con)
            if not is_conflict(err):
                self._lake_tx(lambda e=err: self._lake_step_failed(key, started, e))
                raise
            self._lake_replay(writer, clear, finish, started)

    def _lake_replay(self, writer: StepWriter, clear, finish, started: datetime) -> None:
        """Run a lake step's transaction again (clear, its logged writes, finish) until it commits."""
        con = self._con
        for attempt in range(lakes.CONFLICT_RETRIES):
            self.conflicts_retried += 1
            backoff(attempt)
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
                rollback_quietly(con)
                if not is_conflict(err) or attempt == lakes.CONFLICT_RETRIES - 1:
                    key = [writer.run_id, writer.round, writer.step]
                    self._lake_tx(lambda k=key, e=err: self._lake_step_failed(k, started, e))
                    raise

    def _lake_step_failed(self, key: list, started: datetime, err: BaseException) -> None:
        self._con.execute("DELETE FROM steps WHERE run_id = ? AND round = ? AND step = ?", key)
        self._con.execute("INSERT INTO steps (run_id, round, step, status, started_at, finished_at, error, metrics)"
                          " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)",
                          [*key, started, utc_timestamp(), f"{type(err).__name__}: {err}"])
