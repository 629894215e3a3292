"""What the store's parts share (stores/store.py and the parts it is built from: steps.py, registry.py,
queries.py): its errors, the row type, the step key and small helpers (JSON text, timestamps, DuckDB error
kinds, the backoff of a retried lake transaction)."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from typing import Any

import duckdb
import pyarrow as pa

from rsiflow.stores import lake as lakes
from rsiflow.stores.migrations import MIGRATIONS

# On a lake, columns the embedded schema fills with now() (DuckLake takes only literal defaults).
NOW_DEFAULTS = lakes.now_defaults([sql for _, _, sql in MIGRATIONS])

Rows = list[dict[str, Any]] | pa.Table

STEP_KEY = ("run_id", "round", "step")

# Tables keyed by (run_id, round, step) that Store.step must not clear: `steps` is the
# step's own status row.
NOT_STEP_DATA = {"steps"}


class StoreError(RuntimeError):
    """The store can't be opened as asked (missing, not a DuckDB file, not a folder, a newer schema, locked);
    the message says which file, why, and what to do, in one line."""


class StoreLockedError(StoreError):
    """Another process holds the DuckDB file's write lock."""


def utc_timestamp() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def json_text(value: Any) -> str | None:
    """Serialise a Python value for a JSON column; a str is taken as JSON text already."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


def is_lock_error(err: duckdb.Error) -> bool:
    return isinstance(err, duckdb.IOException) and "lock" in str(err).lower()


def rollback_quietly(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back after a failed statement or commit (a failed commit may have ended the transaction already)."""
    try:
        con.rollback()
    except duckdb.TransactionException:
        pass


def is_conflict(err: BaseException) -> bool:
    """A lake transaction that lost a write conflict to a concurrent one (safe to run again from the start)."""
    return isinstance(err, duckdb.TransactionException) and "conflict" in str(err).lower()


def backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 1.5 ** attempt, 1.0))


def as_dicts(rel: duckdb.DuckDBPyRelation) -> list[dict]:
    """A relation's rows as dicts (DuckDB 2.0 has `to_dicts`; 1.4, the lake's DuckDB, has not)."""
    if hasattr(rel, "to_dicts"):
        return rel.to_dicts()
    names = rel.columns
    return [dict(zip(names, row)) for row in rel.fetchall()]


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


