"""The run lease in the store: one holder at a time; a conflicting holder is told who holds it; an
expired lease, or one whose process on this host is gone, is taken over; only the holder renews or
releases it."""

import subprocess
import sys
import threading
import time

from rsiflow.stores import Store

HOST = "host-a"


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_then_conflict_names_the_holder(store):
    lease, replaced = store.acquire_lease("r", "A", 60, HOST, 111, flow_run_id="f1", flow_run_name="r-round-1")
    assert lease["holder"] == "A" and replaced is None
    assert (lease["host"], lease["pid"], lease["flow_run_name"]) == (HOST, 111, "r-round-1")
    # a second holder on another host gets the current row back, unchanged
    lease2, replaced = store.acquire_lease("r", "B", 60, "host-b", 222)
    assert lease2 == lease and replaced is None
    # another run is independent
    assert store.acquire_lease("other", "B", 60, "host-b", 222)[0]["holder"] == "B"


def test_refused_taker_gets_the_row_it_saw_even_if_the_holder_releases_right_after(store):
    """The holder may release between the refused taker's commit and any re-read: the answer is the row the
    taker's transaction saw (a re-read returned None here, and RunLease crashed on it)."""
    held, _ = store.acquire_lease("r", "A", 60, "host-b", 111)

    class ReleaseAfterCommit:
        def __init__(self, con):
            self.con = con

        def __getattr__(self, name):
            return getattr(self.con, name)

        def commit(self):
            self.con.commit()
            self.con.execute("DELETE FROM leases WHERE run_id = 'r'")   # A releases, right then

    store._con = ReleaseAfterCommit(store._con)
    try:
        lease, replaced = store.acquire_lease("r", "B", 60, HOST, 222)
    finally:
        store._con = store._con.con
    assert lease == held and replaced is None
    assert store.lease("r") is None


def test_acquire_again_by_the_holder_renews_and_keeps_acquired_at(store):
    first, _ = store.acquire_lease("r", "A", 60, HOST, 111)
    time.sleep(0.01)
    again, replaced = store.acquire_lease("r", "A", 60, HOST, 111)
    assert again["holder"] == "A" and replaced is None
    assert again["acquired_at"] == first["acquired_at"] and again["expires_at"] > first["expires_at"]


def test_expired_lease_is_taken_over(store):
    store.acquire_lease("r", "A", 0.05, "host-b", 111)
    time.sleep(0.1)
    lease, replaced = store.acquire_lease("r", "B", 60, HOST, 222)
    assert lease["holder"] == "B" and replaced["holder"] == "A"
    # A's heartbeat and release now fail: it no longer holds the run
    assert not store.heartbeat_lease("r", "A", 60)
    assert not store.release_lease("r", "A")
    assert store.lease("r")["holder"] == "B"


def test_dead_holder_on_this_host_is_taken_over_at_once(store):
    store.acquire_lease("r", "A", 3600, HOST, dead_pid())
    lease, replaced = store.acquire_lease("r", "B", 60, HOST, 222)
    assert lease["holder"] == "B" and replaced["holder"] == "A"


def test_live_holder_on_this_host_is_not_taken_over(store):
    import os

    store.acquire_lease("r", "A", 3600, HOST, os.getppid())   # our parent: alive
    assert store.acquire_lease("r", "B", 60, HOST, 222)[0]["holder"] == "A"
    # a dead pid on *another* host says nothing about that host's process: not taken over before expiry
    store.acquire_lease("s", "A", 3600, "host-b", dead_pid())
    assert store.acquire_lease("s", "B", 60, HOST, 222)[0]["holder"] == "A"


def test_heartbeat_extends_and_records_the_flow_run(store):
    first, _ = store.acquire_lease("r", "A", 60, HOST, 111)
    time.sleep(0.01)
    assert store.heartbeat_lease("r", "A", 60, flow_run_id="f2", flow_run_name="r-round-2")
    now = store.lease("r")
    assert now["expires_at"] > first["expires_at"] and now["heartbeat_at"] > first["heartbeat_at"]
    assert (now["flow_run_id"], now["flow_run_name"]) == ("f2", "r-round-2")
    assert store.heartbeat_lease("r", "A", 60)        # no flow run given: the recorded one stays
    assert store.lease("r")["flow_run_name"] == "r-round-2"


def test_release_only_by_the_holder(store):
    store.acquire_lease("r", "A", 60, HOST, 111)
    assert not store.release_lease("r", "B")
    assert store.release_lease("r", "A")
    assert store.lease("r") is None
    assert store.acquire_lease("r", "B", 60, HOST, 222)[0]["holder"] == "B"


def test_lease_survives_reopening_the_store(tmp_path):
    path = tmp_path / "s.duckdb"
    with Store(path) as s:
        s.acquire_lease("r", "A", 60, HOST, 111)
    with Store(path) as s:
        assert s.acquire_lease("r", "B", 60, "host-b", 222)[0]["holder"] == "A"


def test_two_connections_racing_for_a_free_lease_one_wins(tmp_path):
    """Threads of one process share DuckDB's database: the transaction makes exactly one of them the holder."""
    path = tmp_path / "s.duckdb"
    Store(path).close()
    results, barrier = {}, threading.Barrier(8)

    def take(name):
        with Store(path) as s:
            barrier.wait()
            results[name] = s.acquire_lease("r", name, 60, HOST, 111)[0]["holder"]

    threads = [threading.Thread(target=take, args=(f"T{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with Store(path) as s:
        winner = s.lease("r")["holder"]
    assert len(results) == 8
    assert sum(name == holder for name, holder in results.items()) == 1
    assert set(results.values()) == {winner}
