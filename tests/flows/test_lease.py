"""The run lease as rounds use it (flows/lease.py), without Prefect: a second holder is refused with a one-line
message naming the first, or waits for it; the same context re-enters; a dead holder is taken over; a holder
taken over stops before its next step; `rsiflow run` exits with the message and starts no round."""

import os
import socket
import threading
import time

import duckdb
import pytest

import rsiflow.flows.lease as lease_mod
from rsiflow.configs.loader import load_config
from rsiflow.flows.lease import LeaseLostError, RunBusyError, run_lease
from rsiflow.stores import Store
from tests.conftest import TINY, tiny_overrides
from tests.stores.test_lease import dead_pid


@pytest.fixture
def cfg(tmp_path):
    return load_config([TINY], tiny_overrides(tmp_path))


def in_thread(fn):
    """Run fn in another thread (another holder: threads don't share the lease) and return what it returned
    or raised."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_second_holder_is_refused_with_the_holder_named(cfg):
    def second():
        with run_lease(cfg, wait_s=0):
            pass

    with run_lease(cfg) as lease:
        lease.set_flow_run("fr-1", "tiny-round-1")
        with pytest.raises(RunBusyError) as info:
            in_thread(second)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("run 'tiny' is busy: a round of it is running under flow run 'tiny-round-1' on host "
                              f"{socket.gethostname()} (pid {os.getpid()})")
    assert "waited 0 s" in message and "--wait" in message
    # released at the end of the block: the next holder gets it
    in_thread(second)
    with Store(cfg.run.store) as s:
        assert s.lease("tiny") is None


def test_same_context_reenters_without_waiting(cfg):
    with run_lease(cfg) as outer, run_lease(cfg, wait_s=0) as inner:
        assert inner is outer
        with Store(cfg.run.store) as s:
            assert s.lease("tiny")["holder"] == outer.holder
    with Store(cfg.run.store) as s:
        assert s.lease("tiny") is None


def test_waiting_starter_gets_the_run_when_the_holder_releases(cfg, monkeypatch):
    monkeypatch.setattr(lease_mod, "POLL_S", 0.05)
    holding, release = threading.Event(), threading.Event()
    got = []

    def first():
        with run_lease(cfg):
            got.append("first")
            holding.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    holding.wait(10)
    threading.Timer(0.5, release.set).start()

    def second():
        with run_lease(cfg, wait_s=30):
            got.append("second")

    in_thread(second)
    t.join()
    assert got == ["first", "second"]


def test_dead_holder_on_this_host_is_taken_over_at_once(cfg, capsys):
    with Store(cfg.run.store) as s:
        s.acquire_lease("tiny", "gone", 3600, socket.gethostname(), dead_pid(), None, "tiny-round-2")
    with run_lease(cfg, wait_s=0) as lease:
        with Store(cfg.run.store) as s:
            assert s.lease("tiny")["holder"] == lease.holder
    err = capsys.readouterr().err
    assert "took over the lease of flow run 'tiny-round-2'" in err and "its process is gone" in err


def test_holder_taken_over_stops_before_its_next_step(cfg, monkeypatch):
    monkeypatch.setattr(lease_mod, "HEARTBEAT_S", 0.05)
    with run_lease(cfg) as lease:
        with Store(cfg.run.store) as s:     # as if it had expired and another host took it, in one statement
            for _ in range(50):              # (retried while the heartbeat thread writes the row)
                try:
                    s.con.execute("UPDATE leases SET holder = 'other', host = 'host-b', pid = 4242,"
                                  " flow_run_name = 'tiny-round-3' WHERE run_id = 'tiny'")
                    break
                except duckdb.TransactionException:
                    time.sleep(0.01)
        for _ in range(200):
            if lease.lost:
                break
            time.sleep(0.02)
        with pytest.raises(LeaseLostError, match="taken over by flow run 'tiny-round-3' on host host-b"):
            lease.check()
    with Store(cfg.run.store) as s:           # leaving the block does not release the other holder's lease
        assert s.lease("tiny")["holder"] == "other"


def test_rsiflow_run_exits_with_one_line_when_the_run_is_busy(tmp_path, tiny_path, capsys):
    from rsiflow.flows.cli import main

    overrides = tiny_overrides(tmp_path)
    cfg = load_config([TINY], overrides)
    with Store(cfg.run.store) as s:
        s.acquire_lease("tiny", "other", 600, socket.gethostname(), os.getppid(), "fr-9", "tiny-round-1")
    with pytest.raises(SystemExit) as info:
        main(["run", "--config", TINY, *[a for o in overrides for a in ("--set", o)]])
    message = str(info.value.code)
    assert message.startswith("rsiflow: run 'tiny' is busy: a round of it is running under flow run 'tiny-round-1'")
    assert "\n" not in message
    with Store(cfg.run.store) as s:
        assert s.round_status("tiny", 1) is None   # no round was started
        assert s.lease("tiny")["holder"] == "other"
