"""The store's run registry: runs, rounds and their flow runs, step failures, the serving champion, and the
run leases that let one round of a run run at a time."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta

import duckdb

from rsiflow.stores import lake as lakes
from rsiflow.stores.common import backoff, pid_alive, rollback_quietly, utc_timestamp


class RunRegistry:
    """Store's runs, rounds and leases (a part of `Store`, stores/store.py)."""

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
                                      [run_id, name, json.dumps(config), base_model, utc_timestamp()])
            self._lake_tx(create, lock=True)
            self.create_run(run_id, name, config, base_model)   # the config check, had another process won
            return
        self._con.execute(
            "INSERT INTO runs VALUES (?, ?, ?, ?, ?)",
            [run_id, name, json.dumps(config), base_model, utc_timestamp()],
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
                                      " VALUES (?, ?, 'running', ?, ?)",
                                      [run_id, round_no, champion_before, utc_timestamp()])
            self._lake_tx(start)
            return
        self._con.execute(
            "INSERT INTO rounds (run_id, round, status, champion_before, started_at)"
            " VALUES (?, ?, 'running', ?, ?)"
            " ON CONFLICT (run_id, round) DO UPDATE SET status = 'running',"
            " champion_before = excluded.champion_before, finished_at = NULL",
            [run_id, round_no, champion_before, utc_timestamp()],
        )

    def finish_round(self, run_id: str, round_no: int, champion_after: str | None, metrics: dict) -> None:
        """Mark a started round completed with its resulting champion and metrics."""
        def finish() -> int:
            return self._con.execute(
                "UPDATE rounds SET status = 'completed', champion_after = ?, finished_at = ?, metrics = ?"
                " WHERE run_id = ? AND round = ?",
                [champion_after, utc_timestamp(), json.dumps(metrics), run_id, round_no],
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
                                  [run_id, round_no, flow_run_id, flow_run_name, deployment_id, utc_timestamp()])
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
                              " VALUES (?, ?, ?, 'failed', ?, ?, ?, NULL)", [*key, started_at, utc_timestamp(), error])
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
            now = utc_timestamp()
            con.begin()
            try:
                if self.lake:
                    con.execute(lakes.LEASE_LOCK_SQL)
                row = self.lease(run_id)
                ours = row is not None and row["holder"] == holder
                free = (row is None or ours or row["expires_at"] <= now
                        or (row["host"] == host and row["pid"] != pid and not pid_alive(row["pid"])))
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
                rollback_quietly(con)
                if self.lake:
                    self.conflicts_retried += 1
                    backoff(attempt)
                else:
                    time.sleep(0.01 * (attempt + 1))
                continue
            except BaseException:
                rollback_quietly(con)
                raise
            return now_row, (row if free and row is not None and not ours else None)
        raise RuntimeError(f"could not read or take the lease of run {run_id!r}: {attempt + 1} write conflicts in a"
                           " row")

    def heartbeat_lease(self, run_id: str, holder: str, ttl_s: float, flow_run_id: str | None = None,
                        flow_run_name: str | None = None) -> bool:
        """Renew `holder`'s lease for `ttl_s` seconds from now (and record the flow run now executing under it,
        when given); False when `holder` no longer holds the run (it was taken over)."""
        now = utc_timestamp()
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
