"""CPU threads of rsiflow's processes: the machine's cores shared among the rsiflow processes computing on it.

torch starts as many compute threads as the machine has cores, in every process. Two processes that compute at
once then run twice as many threads as there are cores, and the threads of one process wait on each other at
every operation while the other process holds a core: on 2 cores, two household rounds at once had not finished
after 4.8x the time of one alone when they were stopped; with this policy each took 1.64x (one thread alone,
the floor of an even split, takes 1.45x). Figures and the bench: docs/performance.md.

`run.threads: auto` (the default) gives each computing process `cores // n` threads, where n is the number of
rsiflow processes of this user on this machine that are inside a compute region (a `generate` call of the hf
backend, a training run), or left one less than `GRACE_S` seconds ago, at the time, itself included. The grace
is for the gaps between a process's compute calls (env steps between two turns, the store between two steps), so
that the other process does not take every core in each gap (on the bench it changed nothing measurable: 1.63x
without, 1.64x with). A process enters a region with `computing()`; it announces itself by a file `<pid>` in a
per-user folder of the temporary directory (holding when it left its last region; removed at exit; a file of a
dead process is ignored and removed; an OMP_NUM_THREADS in the environment caps the share), and `refresh()`
(called per batch of a generate call and per optimizer step) re-counts and changes torch's thread count when the
share changed, so a process that started alone drops to its share as soon as another one starts computing, and
takes the cores back when it ends. A number (`run.threads: 2`) fixes the count instead. The vLLM engine has its
own setting (`backend.vllm.threads`); processes of `accelerate launch` each take `cores // train.processes`.

Figures and thread counts: on this project's 2-core CPU, SmolLM2-135M's logits in fp32 and its greedy tokens were
bit-identical at 1 and 2 threads, so sharing changed no figure there; a kernel that splits a sum over threads
would differ in the last bits, and a fixed `run.threads` makes a run independent of what else runs.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import tempfile
import threading
import time
from pathlib import Path

FOLDER = Path(tempfile.gettempdir()) / f"rsiflow-cores-{os.getuid() if hasattr(os, 'getuid') else 0}"
GRACE_S = 30.0  # a process that left its compute region less than this ago still counts as computing

_lock = threading.Lock()
_setting: int | str = "auto"
_depth = 0
_applied: int | None = None


def machine_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's --cpus)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cores)


def configure(setting: int | str) -> None:
    """The process's policy: "auto" (share the cores) or a fixed thread count; applied at the next refresh."""
    global _setting, _applied
    if setting != "auto" and (not isinstance(setting, int) or setting < 1):
        raise ValueError(f"threads must be 'auto' or a positive integer, not {setting!r}")
    with _lock:
        _setting, _applied = setting, None


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot) from /proc: tells a live process from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not started or not Path("/proc").is_dir() or _start_time(pid) == started


def computing_processes(folder: Path | None = None, now: float | None = None) -> int:
    """How many processes are in a compute region now or left one less than GRACE_S ago (files of dead
    processes are removed on the way)."""
    folder = folder or FOLDER
    now = time.time() if now is None else now
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in folder.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                started, _, left = entry.read_text().strip().partition(" ")
            except OSError:
                continue
            if not _alive(int(entry.name), started):
                entry.unlink(missing_ok=True)
            elif not left or now - float(left) < GRACE_S:
                n += 1
    return n


def _mark(left: float | None) -> None:
    """This process's file: its start time, and when it left its last region (none while inside one)."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    path = FOLDER / str(os.getpid())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(_start_time(os.getpid()) + ("" if left is None else f" {left:.3f}") + "\n")
    tmp.replace(path)


def _unmark() -> None:
    (FOLDER / str(os.getpid())).unlink(missing_ok=True)


atexit.register(_unmark)


def share(cores: int, computing: int) -> int:
    """Threads for one of `computing` processes on `cores` cores: an even share, at least one."""
    return max(1, cores // max(1, computing))


def threads_now() -> int:
    """The thread count the policy gives this process now (under "auto", never more than an OMP_NUM_THREADS set
    in the environment: a user's or `accelerate launch`'s cap)."""
    if _setting != "auto":
        return int(_setting)
    n = share(machine_cores(), computing_processes() if _depth else 1)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(n, int(cap)) if cap.isdigit() and int(cap) > 0 else n


def refresh() -> int:
    """Set torch's thread count to the policy's figure if it changed; returns it."""
    global _applied
    n = threads_now()
    if n != _applied:
        import torch

        with _lock:
            torch.set_num_threads(n)
            _applied = n
    return n


@contextlib.contextmanager
def computing():
    """A compute region of this process (re-entrant): counted by every other rsiflow process's share while in it
    and for GRACE_S seconds after it."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1 and _setting == "auto":
            _mark(None)
    try:
        refresh()
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _setting == "auto":
                _mark(time.time())
