"""The store as a DuckLake: a catalog database (PostgreSQL) plus Parquet data files under a shared folder, so
processes on many machines write one store at once, each pipeline step still one transaction.

`run.store` names a lake with DuckDB's own attach string, `ducklake:postgres:<libpq connection string>`
(e.g. `ducklake:postgres:dbname=rsiflow host=/tmp/pg port=5433`), and `run.lake_data_path` the folder for its
Parquet files (needed when the lake is created; an existing lake's catalog records it).

Offline extensions: DuckDB fetches `ducklake` and `postgres` from its extension server at run time, which is
unreachable here. The registry's `duckdb-ext-ducklake` / `duckdb-ext-postgres` wheels carry the extension
binaries for DuckDB 1.4.4 only, laid out as `duckdb_ext/extensions/v<version>/<platform>/<name>.duckdb_extension`,
i.e. a DuckDB extension directory; `connect` points `extension_directory` at it, turns auto-install off and
LOADs them. bin/setup-lake makes the overlay venv `.venv-lake` that has them (DuckDB 1.4.4; everything else
from .venv).

What differs from the embedded file (DuckLake 0.3 as carried by those wheels, checked here):
- no PRIMARY KEY / UNIQUE / CHECK constraints, no indexes, and only literal DEFAULTs: `lake_migration_sql`
  strips them from the migrations, and the store fills the now() defaults itself (`NOW_DEFAULTS`);
  `INSERT OR REPLACE` / `ON CONFLICT` need a key, so the store writes delete-then-insert in one transaction.
- concurrency is optimistic: two transactions that append (even to one table) both commit (DuckLake retries
  the catalog commit itself); two that delete or update rows of the same Parquet file, or create the same
  table, conflict and the later commit fails (`duckdb.TransactionException`). Rows of different runs are
  written by different transactions and so live in different files: concurrent runs don't conflict; the
  store retries a conflicting transaction from the start where that is safe (`CONFLICT_RETRIES`).
- appends alone never conflict, so two processes could both "take" a free lease; every lease write therefore
  first updates the one row of `lake_locks` (`LEASE_LOCK_SQL`): all lease transactions touch one file, the
  later of two concurrent ones fails and retries, and it then reads the winner's row.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
import time
from pathlib import Path

import duckdb

PREFIX = "ducklake:"
# The attached lake's name inside the DuckDB connection (its catalog: `lake.main.<table>`).
ALIAS = "lake"
# The wheels' DuckDB version (bin/setup-lake pins it).
LAKE_DUCKDB = "1.4.4"
# How often a transaction that lost a write conflict is run again (0.05 s growing to 1 s between tries).
CONFLICT_RETRIES = 60
# DuckLake's own retries of a catalog commit that raced another (snapshot id taken): more than its default 10,
# for many writers on one catalog.
_DUCKLAKE_SETTINGS = {"ducklake_max_retry_count": 100, "ducklake_retry_wait_ms": 50, "ducklake_retry_backoff": 1.5}

# The lake's own bookkeeping: one row per named lock; a transaction that updates it conflicts with every other
# transaction that does (same Parquet file), which DuckLake's append-friendly conflict rules otherwise never do.
LAKE_LOCKS_SQL = """
CREATE TABLE lake_locks (name VARCHAR, n BIGINT);
INSERT INTO lake_locks VALUES ('leases', 0);
"""
LEASE_LOCK_SQL = "UPDATE lake_locks SET n = n + 1 WHERE name = 'leases'"


class LakeUnavailable(RuntimeError):
    """The DuckDB in use can't open a DuckLake (its extensions are not installed for this DuckDB)."""


def is_lake(store: str | Path | None) -> bool:
    """Whether a `run.store` value names a DuckLake (`ducklake:...`) rather than a DuckDB file."""
    return store is not None and str(store).startswith(PREFIX)


def store_location(store: str | Path) -> str | Path:
    """What identifies a `run.store`: a lake's spec as written, a file's absolute path."""
    return str(store) if is_lake(store) else Path(store).expanduser().resolve()


def redact(spec: str) -> str:
    """The store spec with its password hidden, for messages: libpq's `password=secret` or `password='a b'`, and
    a URI's `//user:secret@host`."""
    spec = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", spec)
    return re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", spec)


def extension_dir() -> Path | None:
    """The DuckDB extension directory the duckdb-ext-* wheels installed (`.../duckdb_ext/extensions`), when it
    holds the ducklake extension for the running DuckDB version; None otherwise."""
    spec = importlib.util.find_spec("duckdb_ext")
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        folder = Path(base) / "extensions"
        if list(folder.glob(f"v{duckdb.__version__}/*/ducklake.duckdb_extension")):
            return folder
    return None


def _needed(spec: str) -> list[str]:
    """The extensions attaching `spec` needs: ducklake, and the catalog database's scanner."""
    catalog = spec[len(PREFIX):].split(":", 1)[0]
    return ["ducklake"] + (["postgres"] if catalog in ("postgres", "postgresql") else [])


def unavailable_message(spec: str, key: str = "run.store") -> str:
    return (f"{key} names a DuckLake ({redact(spec)}), but the DuckDB in use (duckdb {duckdb.__version__} in "
            f"{sys.prefix}) has no ducklake/postgres extension and none can be downloaded here: run bin/setup-lake "
            f"and use .venv-lake/bin/rsiflow (or .venv-lake/bin/python -m ...), which has DuckDB {LAKE_DUCKDB} with "
            f"them; or set {key} to a DuckDB file path")


def check_available(spec: str, key: str = "run.store") -> None:
    """LakeUnavailable (naming `key`) unless this interpreter's DuckDB can load what `spec` needs."""
    folder = extension_dir()
    files = {"ducklake": "ducklake", "postgres": "postgres_scanner"}   # `LOAD postgres` reads postgres_scanner
    if folder is None or any(not list(folder.glob(f"v{duckdb.__version__}/*/{files[n]}.duckdb_extension"))
                             for n in _needed(spec)):
        raise LakeUnavailable(unavailable_message(spec, key))


# One in-memory DuckDB per process and lake with the lake attached, by (spec, read_only): loading the two
# extensions costs ~3 s of CPU per connection (measured here), so a Store gets a cursor of it (its own connection
# and transactions on the same database) instead of a new connection each time a step opens the store.
_ATTACHED: dict[tuple[str, bool], duckdb.DuckDBPyConnection] = {}
_ATTACH_LOCK = threading.Lock()


def connect(spec: str, data_path: str | Path | None, read_only: bool) -> duckdb.DuckDBPyConnection:
    """A connection (a cursor of this process's attached lake, see `_ATTACHED`) with the lake in use
    (`USE lake`), so plain table names are the lake's; closing it leaves the lake attached for the next one.
    `data_path` (the Parquet folder) is created and passed when the lake is first attached; an existing lake
    keeps the path its catalog recorded. Raises LakeUnavailable without the extensions, duckdb.Error when the
    catalog can't be reached."""
    key = (spec, read_only)
    with _ATTACH_LOCK:
        base = _ATTACHED.get(key)
        if base is None:
            base = _ATTACHED[key] = _attach(spec, data_path, read_only)
        cursor = base.cursor()
        cursor.execute(f"USE {ALIAS}")
        cursor.execute("SET enable_progress_bar = false")   # DuckDB 1.4 draws one on stdout for slow queries
        return cursor


def forget(spec: str, read_only: bool) -> None:
    """Close this process's attachment of a lake (e.g. its catalog server restarted): the next `connect`
    attaches it again. Stores open on it stop working."""
    with _ATTACH_LOCK:
        base = _ATTACHED.pop((spec, read_only), None)
    if base is not None:
        base.close()


def _attach(spec: str, data_path: str | Path | None, read_only: bool) -> duckdb.DuckDBPyConnection:
    check_available(spec)
    con = duckdb.connect(config={"extension_directory": str(extension_dir()),
                                 "autoinstall_known_extensions": False, "autoload_known_extensions": False})
    try:
        con.execute("SET enable_progress_bar = false")
        for name in _needed(spec):
            con.execute(f"LOAD {name}")
        for name, value in _DUCKLAKE_SETTINGS.items():
            con.execute(f"SET GLOBAL {name} = {value}")
        options = []
        if data_path is not None and not read_only:
            folder = Path(data_path).expanduser().resolve()
            folder.mkdir(parents=True, exist_ok=True)
            options.append(f"DATA_PATH '{_quote(str(folder) + '/')}'")
        if read_only:
            options.append("READ_ONLY")
        attach = f"ATTACH '{_quote(spec)}' AS {ALIAS}" + (f" ({', '.join(options)})" if options else "")
        for attempt in range(CONFLICT_RETRIES):
            try:
                con.execute(attach)
                break
            except duckdb.Error as err:
                # the first attach of a new lake creates DuckLake's tables in the catalog database; of two
                # processes doing that at once one fails (PostgreSQL: duplicate key): the lake exists, attach again
                if "Failed to initialize DuckLake" not in str(err) or attempt == CONFLICT_RETRIES - 1:
                    raise
            time.sleep(min(0.05 * 1.5 ** attempt, 1.0))
        con.execute(f"USE {ALIAS}")
    except BaseException:
        con.close()
        raise
    return con


def _quote(text: str) -> str:
    return text.replace("'", "''")


# ---- migrations on the lake ------------------------------------------------------------------------------

_DEFAULT_NOW = re.compile(r"\s+DEFAULT\s+\(\s*now\(\)[^()]*\)", re.IGNORECASE)


def _strip_parenthesised(text: str, keyword: str) -> str:
    """Remove every `<keyword> (...)` (balanced parentheses) from `text`."""
    pattern = re.compile(r"\s+" + keyword + r"\s*\(", re.IGNORECASE)
    while (m := pattern.search(text)) is not None:
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        text = text[:m.start()] + text[i:]
    return text


def _strip_comments(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def lake_migration_sql(sql: str) -> str:
    """A migration's SQL as DuckLake takes it: comments, indexes, CHECK and key constraints and now() defaults
    removed (the schema's columns and types are unchanged)."""
    out = []
    for statement in _strip_comments(sql).split(";"):
        s = statement.strip()
        if not s or re.match(r"(CREATE|DROP)\s+INDEX\b", s, re.IGNORECASE):
            continue
        s = _strip_parenthesised(s, "CHECK")
        s = re.sub(r",\s*PRIMARY\s+KEY\s*\([^()]*\)", "", s, flags=re.IGNORECASE)   # table-level key
        s = re.sub(r"\s+PRIMARY\s+KEY\b", "", s, flags=re.IGNORECASE)
        s = re.sub(r"\s+UNIQUE\b", "", s, flags=re.IGNORECASE)
        s = _DEFAULT_NOW.sub("", s)
        out.append(s + ";")
    return "\n".join(out)


def now_defaults(sqls: list[str]) -> dict[str, set[str]]:
    """Columns declared `DEFAULT (now() ...)` in the given migrations, by table: on the lake (literal defaults
    only) the store fills them when an insert leaves them out."""
    found: dict[str, set[str]] = {}
    for sql in sqls:
        for statement in _strip_comments(sql).split(";"):
            m = re.match(r"\s*CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", statement, re.IGNORECASE)
            if m is None:
                continue
            for col in re.finditer(r"(\w+)\s+TIMESTAMP" + _DEFAULT_NOW.pattern, statement, re.IGNORECASE):
                found.setdefault(m.group(1), set()).add(col.group(1))
    return found
