"""Migration 8 (RSIPO) on a store made before it: the trajectories table is rebuilt to take the 'replay' purpose
with every row, column and index kept; other purposes are still refused."""

from datetime import datetime

import duckdb
import pytest

from rsiflow.stores import Store
from rsiflow.stores.migrations import MIGRATIONS


def test_replay_purpose_on_a_store_from_before_migration_8(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR, applied_at TIMESTAMP)")
    for version, name, sql in MIGRATIONS:
        if version < 8:
            con.execute(sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, name, datetime(2026, 1, 1)])
    con.execute("INSERT INTO trajectories (traj_id, run_id, round, step, purpose, status, success, reward, hindsight)"
                " VALUES ('t1', 'r', 1, 'generate', 'train', 'success', true, 1.0, '[\"x\"]')")
    with pytest.raises(duckdb.ConstraintException):
        con.execute("INSERT INTO trajectories (traj_id, purpose) VALUES ('t2', 'replay')")
    columns = con.sql("SELECT column_name, data_type FROM information_schema.columns"
                      " WHERE table_name = 'trajectories' ORDER BY ordinal_position").fetchall()
    con.close()
    with Store(path) as store:
        assert store.con.sql("SELECT column_name, data_type FROM information_schema.columns"
                             " WHERE table_name = 'trajectories' ORDER BY ordinal_position").fetchall() == columns
        assert store.rows("SELECT traj_id, purpose, success, hindsight FROM trajectories") == [
            {"traj_id": "t1", "purpose": "train", "success": True, "hindsight": '["x"]'}]
        with store.step("r", 1, "distill") as tx:
            tx.insert("trajectories", [{"traj_id": "t1/replay", "purpose": "replay", "status": "failure"}])
        with pytest.raises(duckdb.ConstraintException), store.step("r", 1, "distill") as tx:
            tx.insert("trajectories", [{"traj_id": "t3", "purpose": "bogus"}])
        indexes = {n for (n,) in store.con.sql("SELECT index_name FROM duckdb_indexes()"
                                                " WHERE table_name = 'trajectories'").fetchall()}
        assert indexes == {"trajectories_traj_id", "trajectories_model_id"}
        assert max(v for (v,) in store.con.sql("SELECT version FROM schema_migrations").fetchall()) >= 8
