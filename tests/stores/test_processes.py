"""Other processes: a writer holding the lock gives a clear error (or a wait), and a writer
killed mid-step leaves the file as of its last commit."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rsiflow.stores import Store, StoreLockedError

REPO = Path(__file__).resolve().parents[2]


def start(script: str) -> subprocess.Popen:
    """Run a Python script in the repo root; it prints 'ready' when it reaches its checkpoint."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
def test_locked_store_raises_then_opens_after_holder_exits(tmp_path):
    path = tmp_path / "rsiflow.duckdb"
    holder = start(f"""
        import time
        from rsiflow.stores import Store
        store = Store({str(path)!r})
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        with pytest.raises(StoreLockedError) as info:
            Store(path, wait_s=0.5)
        assert str(path) in str(info.value)
        assert f"process {holder.pid}" in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    with Store(path, wait_s=0.5) as store:
        assert store.list_runs() == []


@pytest.mark.slow
def test_opening_waits_for_a_short_holder(tmp_path):
    path = tmp_path / "rsiflow.duckdb"
    holder = start(f"""
        import time
        from rsiflow.stores import Store
        with Store({str(path)!r}) as store:
            print("ready", flush=True)
            time.sleep(0.5)
    """)
    with Store(path, wait_s=20) as store:
        assert store.list_runs() == []
    holder.wait()


@pytest.mark.slow
def test_kill_mid_step_keeps_last_commit(tmp_path):
    path = tmp_path / "rsiflow.duckdb"
    writer = start(f"""
        import time
        import pyarrow as pa
        from rsiflow.stores import Store
        store = Store({str(path)!r})
        with store.step("r", 0, "A") as tx:
            tx.insert("trajectories", [{{"traj_id": "a1"}}, {{"traj_id": "a2"}}])
        cm = store.step("r", 0, "B")
        tx = cm.__enter__()
        n = 300_000  # large enough that DuckDB writes row groups to the file before commit
        tx.insert("turns", pa.table({{"traj_id": pa.array(["b"] * n), "turn_idx": pa.array(range(n), pa.int32())}}))
        tx.insert("trajectories", [{{"traj_id": "b1"}}])
        print("ready", flush=True)
        time.sleep(60)
    """)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()

    with Store(path) as store:
        rows = store.con.sql("SELECT step, traj_id FROM trajectories ORDER BY traj_id").fetchall()
        assert rows == [("A", "a1"), ("A", "a2")]
        assert store.con.sql("SELECT count(*) FROM turns").fetchall()[0][0] == 0
        steps = store.con.sql("SELECT step, status FROM steps").fetchall()
        assert steps == [("A", "completed")]
        assert store.completed_steps("r", 0) == {"A"}
        # the file stays writable after recovery
        with store.step("r", 0, "B") as tx:
            tx.insert("trajectories", [{"traj_id": "b1"}])
    with Store(path, read_only=True) as store:
        assert store.completed_steps("r", 0) == {"A", "B"}
