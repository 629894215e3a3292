"""Signals to `rsiflow run` (slow tier: real processes on configs/tiny.yaml): whatever ends it, no process is left
behind (the temporary Prefect server it starts gets a parent-death signal), and Ctrl-C or SIGTERM ends it within
seconds with one line. Before: `kill -9` or SIGTERM left the Prefect server running (reparented to init) for
minutes, and Ctrl-C exited ~150 s later with two httpx.ConnectError tracebacks (issue 15)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos import alive, descendants, group_members
from tests.conftest import REPO, TINY, prefect_home, tiny_overrides

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict:
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    return env


def as_terminal_job() -> None:
    """In the child before exec: SIGINT at its default, as a terminal's foreground job has it. pytest itself may run
    with SIGINT ignored (a background job of a script without job control), which its children inherit and rsiflow
    then keeps (README "Signals"), so a Ctrl-C test would measure nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`rsiflow run` on the tiny config in its own process group (as a shell starts a job), once its round's
    generate step is under way; returns the process and its log."""
    log = tmp_path / "run.log"
    # A generate step of ~1 min (the tiny round otherwise ends in seconds: on a loaded machine the signal landed
    # after it had finished, and the run exited 0).
    longer = ("generate.tasks_per_round=16", "generate.group_size=8", "backend.max_new_tokens=64")
    cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run", "--config", TINY,
           *[a for o in tiny_overrides(tmp_path, *longer) for a in ("--set", o)]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=as_terminal_job)
    deadline = time.monotonic() + 300
    while "round 1 of run 'tiny' starting" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the round never started:\n" + log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(2)   # inside generate
    return proc, log


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := {p for p in pids if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill_left(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killing_the_main_process_leaves_no_prefect_server(tmp_path, how):
    proc, log = start_run(tmp_path)
    children = descendants(proc.pid)
    assert children, "rsiflow run started no child process (its temporary Prefect server)"
    t0 = time.monotonic()
    os.kill(proc.pid, getattr(signal, how))   # the main process only, as `kill -9 PID` / `kill PID`
    proc.wait(timeout=120)
    exit_s = time.monotonic() - t0
    left = wait_gone(children, 20)
    kill_left(left)
    assert not left, f"left running after {how} of rsiflow run: {left}"
    out = log.read_text()
    if how == "SIGTERM":
        assert proc.returncode == 143 and exit_s < 60, (proc.returncode, exit_s)
        assert "rsiflow run: stopped by SIGTERM; run the same command again to resume" in out
        assert "Traceback" not in out
    print(f"{how}: exit {proc.returncode} after {exit_s:.1f} s; {len(children)} child process(es), none left")


def test_ctrl_c_exits_within_seconds_in_one_line(tmp_path):
    proc, log = start_run(tmp_path)
    children = descendants(proc.pid)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)   # a terminal's Ctrl-C: the whole foreground process group
    proc.wait(timeout=120)
    exit_s = time.monotonic() - t0
    left = wait_gone(children | group_members(proc.pid), 20)
    kill_left(left)
    out = log.read_text()
    assert not left, f"left running after Ctrl-C: {left}"
    assert proc.returncode == 130, out[-3000:]
    assert exit_s < 60, f"Ctrl-C took {exit_s:.0f} s to exit"
    assert "Traceback" not in out and "httpx" not in out, out[-3000:]
    assert "rsiflow run: stopped by Ctrl-C; run the same command again to resume (completed steps are kept)" in out
    print(f"Ctrl-C: exit {proc.returncode} after {exit_s:.1f} s")


def test_ctrl_c_and_sigterm_of_serve(tmp_path):
    """`rsiflow serve` (no PREFECT_API_URL: its own temporary server) stops within seconds in one line of its own,
    and its server with it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        log = tmp_path / f"serve-{sig.name}.log"
        cmd = [sys.executable, "-m", "rsiflow.flows.cli", "serve", "--config", TINY,
               *[a for o in tiny_overrides(tmp_path) for a in ("--set", o)]]
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=as_terminal_job)
        deadline = time.monotonic() + 300
        while "being served" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        children = descendants(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        proc.wait(timeout=120)
        exit_s = time.monotonic() - t0
        left = wait_gone(children, 20)
        kill_left(left)
        out = log.read_text()
        assert not left and exit_s < 60, (left, exit_s, out[-3000:])
        assert "Traceback" not in out, out[-3000:]
        assert "rsiflow serve: stopped; deployments improvement-round/tiny and self-improve/tiny stay registered" in out
        print(f"serve {sig.name}: exit {proc.returncode} after {exit_s:.1f} s")
