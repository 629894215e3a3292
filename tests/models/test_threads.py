"""The thread policy (models/threads.py): each computing rsiflow process takes an even share of the cores, re-counted
as other processes start and stop computing; a fixed setting is kept; a dead process's mark is not counted."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rsiflow.models import threads
from tests.conftest import TINY, tiny_overrides


@pytest.fixture
def policy(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "FOLDER", tmp_path / "cores")
    monkeypatch.setattr(threads, "machine_cores", lambda: 4)
    monkeypatch.setattr(threads, "GROW_AFTER_S", 0.0)
    monkeypatch.setattr(threads, "_last_shared", -float("inf"))
    before = torch.get_num_threads()
    threads.configure("auto")
    yield tmp_path / "cores"
    threads.configure("auto")
    torch.set_num_threads(before)


def _other_process(folder, *, exit_at_once=False, leave=False):
    """A process that enters a compute region (its mark in `folder`) and waits on stdin (or exits at once, or
    leaves the region and then waits)."""
    mode = "exit" if exit_at_once else "leave" if leave else "stay"
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from rsiflow.models import threads
        threads.FOLDER = Path({str(folder)!r})
        threads.machine_cores = lambda: 4
        with threads.computing():
            if {mode!r} != "leave":
                print("in", flush=True)
                os._exit(0) if {mode!r} == "exit" else sys.stdin.readline()
        if {mode!r} == "leave":
            print("in", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "in"
    return proc


def test_an_even_share_of_the_cores_at_least_one():
    assert [threads.share(4, n) for n in (0, 1, 2, 3, 4, 9)] == [4, 4, 2, 1, 1, 1]


def test_a_process_alone_takes_every_core_and_shares_them_while_another_computes(policy):
    with threads.computing():
        assert torch.get_num_threads() == 4 and threads.computing_processes(policy) == 1
        other = _other_process(policy)
        try:
            assert threads.computing_processes(policy) == 2
            assert threads.refresh() == 2 and torch.get_num_threads() == 2
        finally:
            other.communicate("\n", timeout=60)
        assert threads.refresh() == 4 and torch.get_num_threads() == 4  # the other one has ended
    assert not any(policy.iterdir())  # this process's mark goes with its region


def test_the_cores_come_back_only_after_the_other_process_paused_a_while(policy, monkeypatch):
    """A pause of the other process between two compute calls doesn't hand its cores over at once."""
    monkeypatch.setattr(threads, "GROW_AFTER_S", 3600.0)
    with threads.computing():
        other = _other_process(policy)
        try:
            assert threads.refresh() == 2
        finally:
            other.communicate("\n", timeout=60)
        assert threads.refresh() == 2          # the other one just paused (here: ended)
        monkeypatch.setattr(threads, "GROW_AFTER_S", 0.0)
        assert threads.refresh() == 4          # ... long enough ago


def test_a_process_between_its_regions_is_not_counted(policy):
    """E.g. the test process after an in-process round, while a run it started computes: that run takes every
    core."""
    other = _other_process(policy, leave=True)
    try:
        assert threads.computing_processes(policy) == 0
        with threads.computing():
            assert threads.refresh() == 4
    finally:
        other.communicate("\n", timeout=60)
    assert not any(policy.iterdir())


def test_a_zombie_inside_its_region_is_not_counted(policy):
    """A process killed inside its region and not yet reaped by its parent is a zombie: it computes nothing."""
    other = _other_process(policy, exit_at_once=True)
    for _ in range(100):  # until it has exited (a zombie: this test has not waited on it)
        if threads._proc_stat(other.pid)[0] == "Z":
            break
        time.sleep(0.05)
    assert threads._proc_stat(other.pid)[0] == "Z"
    assert threads.computing_processes(policy) == 0
    other.wait(timeout=60)


def test_a_dead_process_mark_is_not_counted_and_is_removed(policy):
    other = _other_process(policy, exit_at_once=True)
    other.wait(timeout=60)
    assert [p.name for p in policy.iterdir()] == [str(other.pid)]  # it died inside its region
    with threads.computing():
        assert threads.computing_processes(policy) == 1 and threads.refresh() == 4
        assert [p.name for p in policy.iterdir()] == [str(os.getpid())]  # the dead one's mark is gone
    assert not any(policy.iterdir())  # this process's mark goes with its region


def test_omp_num_threads_caps_the_share(policy, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with threads.computing():
        assert threads.refresh() == 1


def test_regions_nest_and_a_fixed_count_leaves_no_mark(policy):
    with threads.computing():
        with threads.computing():
            assert threads.computing_processes(policy) == 1
        assert threads.computing_processes(policy) == 1  # still inside the outer region
    assert threads.computing_processes(policy) == 0 and not any(policy.iterdir())  # out of every region
    threads.configure(3)
    with threads.computing():
        assert threads.refresh() == 3 and torch.get_num_threads() == 3
        assert threads.computing_processes(policy) == 0
    with pytest.raises(ValueError, match="'auto' or a positive integer"):
        threads.configure(0)


def test_the_config_key_takes_auto_or_a_count_and_names_a_bad_value(tmp_path):
    from rsiflow.configs.loader import load_config
    from rsiflow.configs.schema import ConfigError


    assert load_config([TINY]).run.threads == "auto"
    assert load_config([TINY], ["run.threads=2"]).run.threads == 2
    with pytest.raises(ConfigError, match="run.threads"):
        load_config([TINY], ["run.threads=many"])


def test_the_spin_count_reaches_the_environment_before_torch_loads(tmp_path):
    """run.omp_spin_count is applied by ensure_run, the first thing a run does; the modules a run imports before it
    must not load torch (libgomp reads GOMP_SPINCOUNT once, when torch loads)."""
    script = textwrap.dedent(f"""
        import os, sys
        os.environ.pop("GOMP_SPINCOUNT", None)
        import rsiflow.flows.cli, rsiflow.flows.round, rsiflow.flows.self_improve, rsiflow.flows.pooled_step
        from rsiflow.configs.loader import load_config
        from rsiflow.tasks.setup import ensure_run
        assert "torch" not in sys.modules, "importing the flows loaded torch"
        cfg = load_config([{TINY!r}], {tiny_overrides(tmp_path, "run.omp_spin_count=7777")!r})
        ensure_run(cfg)
        assert "torch" in sys.modules   # the base model's check loaded it, after the count was set
        print("GOMP_SPINCOUNT", os.environ.get("GOMP_SPINCOUNT"))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GOMP_SPINCOUNT 7777" in out.stdout


def test_a_spin_count_that_comes_after_torch_is_reported_once_and_not_pretended(monkeypatch, caplog):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(threads, "_late_spin_counts", set())
    assert threads.apply_spin_count(None)             # nothing asked: nothing to do
    assert "GOMP_SPINCOUNT" not in os.environ
    with caplog.at_level("WARNING", logger=threads.__name__):
        assert not threads.apply_spin_count(5000)     # torch is loaded in this process
        assert not threads.apply_spin_count(5000)
    assert "GOMP_SPINCOUNT" not in os.environ
    warnings = [r.getMessage() for r in caplog.records if "omp_spin_count" in r.getMessage()]
    assert len(warnings) == 1 and "export GOMP_SPINCOUNT=5000" in warnings[0]
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")      # exported before start: already in effect
    assert threads.apply_spin_count(5000)
