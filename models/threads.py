"""CPU threads of rsiflow's processes: the machine's cores shared among the rsiflow processes computing on it.

torch starts as many compute threads as the machine has cores, in every process. Two processes that compute at
once then run twice as many threads as there are cores, and the threads of one process wait on each other at
every operation while the other process holds a core: on 2 cores, two household rounds at once had not finished
after 4.8x the time of one alone when they were stopped; with this policy each took 1.63-1.75x, and 1.45-1.48x
with idle OpenMP threads that spin less before they sleep (`run.omp_spin_count`, `apply_spin_count`; one thread
alone, the floor of an even split, takes 1.45x). Figures and the bench: docs/performance.md.

`run.threads: auto` (the default) gives each computing process `cores // n` threads, where n is the number of
rsiflow processes of this user on this machine inside a compute region (a `generate` call of the hf backend, a
training run) at the time, itself included. A process enters a region with `computing()`, which puts a file `<pid>`
in a per-user folder of the temporary directory for the region's length (a file of a dead or zombie process is
ignored and removed; an OMP_NUM_THREADS in the environment caps the share), and `refresh()` (called per chunk of a
generate call, and with the hf backend's reused caches per prefill pass and decoding step, and per optimizer step)
re-counts and changes torch's thread count when the share changed, so a process that started alone drops to its
share as soon as another one starts computing, and takes the cores back once no other one has computed for
GROW_AFTER_S (5 s). A process between two compute calls (env steps, the store, waiting on a child) is not counted: an
earlier version counted it for 30 s after its region, which changed nothing measurable on the bench (1.63x without,
1.64x with) and gave a run started right after another process computed one thread. The wait is this process's own
memory instead: a run that starts after another ended still takes every core. Without it, on a 2-core AVX2 CPU, two
rounds at once took 1.85-1.88x one alone under `auto` against 1.56-1.57x with one thread each; with it 1.56x
(bench/results/share/run-7-avx2-policy1.txt, run-8-avx2-grow.txt): each pause of the other process between two calls
handed it both cores, and when the other resumed, three threads ran on two cores until the next re-count.
A number (`run.threads: 2`) fixes the count instead. The vLLM engine has its own setting
(`backend.vllm.threads`); processes of `accelerate launch` each take `cores // train.processes`.

Figures and thread counts: a run's figures are the same to the last bit at the same thread count, not across counts.
PyTorch's CPU attention kernel splits the keys over threads when the query is one token (each decoding step), so
sampled logprobs differ in the last bits between 1 and 2 threads (a tiny run: 18 of 34 turns' logprobs by about
1e-6, the same tokens; a flip of a sampled token is possible where two tokens are that close), while prefill
forwards of SmolLM2-135M were bit-identical and the tiny run's trained checkpoints the same bytes. Under `auto`, a
run that shares the cores with another computing run therefore matches a run alone only up to rounding; fix
`run.threads` where runs must match bit for bit while others compute (bench.lake does).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

FOLDER = Path(tempfile.gettempdir()) / f"rsiflow-cores-{os.getuid() if hasattr(os, 'getuid') else 0}"

_lock = threading.Lock()
_setting: int | str = "auto"
_depth = 0
_applied: int | None = None
_late_spin_counts: set[str] = set()   # run.omp_spin_count values already reported as too late
# Seconds after this process last saw another one computing before it takes every core again (threads_now).
GROW_AFTER_S = 5.0
_last_shared = -math.inf   # time.monotonic() when threads_now last counted another computing process


def machine_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's --cpus)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cores)


def apply_spin_count(count: int | None) -> bool:
    """Set GOMP_SPINCOUNT (`run.omp_spin_count`) for this process and the processes it starts. The OpenMP runtime
    reads it once, when torch loads, so it takes effect only if torch is not imported yet; returns whether the
    environment now holds `count` (None: nothing to do, True). A count that comes too late is logged, once."""
    if count is None:
        return True
    value = str(count)
    if os.environ.get("GOMP_SPINCOUNT") == value:
        return True
    if "torch" in sys.modules:
        if value in _late_spin_counts:
            return False
        _late_spin_counts.add(value)
        logging.getLogger(__name__).warning(
            "run.omp_spin_count=%s not applied: torch was loaded before the config was read (GOMP_SPINCOUNT=%s); "
            "export GOMP_SPINCOUNT=%s before starting rsiflow", value, os.environ.get("GOMP_SPINCOUNT", "unset"), value)
        return False
    os.environ["GOMP_SPINCOUNT"] = value
    return True


def configure(setting: int | str) -> None:
    """The process's policy: "auto" (share the cores) or a fixed thread count; applied at the next refresh."""
    global _setting, _applied
    if setting != "auto" and (not isinstance(setting, int) or setting < 1):
        raise ValueError(f"threads must be 'auto' or a positive integer, not {setting!r}")
    with _lock:
        _setting, _applied = setting, None


def _proc_stat(pid: int) -> tuple[str, str]:
    """The process's state letter and start time (clock ticks since boot) from /proc: tells a live process from
    a zombie or a reused pid; ("", "") where /proc has none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0], fields[19]


def _alive(pid: int, started: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not Path("/proc").is_dir():
        return True
    state, start = _proc_stat(pid)
    return state != "Z" and (not started or start == started)


def computing_processes(folder: Path | None = None) -> int:
    """How many processes are in a compute region now (files of dead processes are removed on the way)."""
    folder = folder or FOLDER
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in folder.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                started = entry.read_text().strip()
            except OSError:
                continue
            if _alive(int(entry.name), started):
                n += 1
            else:
                entry.unlink(missing_ok=True)
    return n


def _mark() -> None:
    """This process's file while it is inside a compute region: its start time."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    path = FOLDER / str(os.getpid())
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(_proc_stat(os.getpid())[1] + "\n")
    tmp.replace(path)


def _unmark() -> None:
    (FOLDER / str(os.getpid())).unlink(missing_ok=True)


atexit.register(_unmark)


def share(cores: int, computing: int) -> int:
    """Threads for one of `computing` processes on `cores` cores: an even share, at least one."""
    return max(1, cores // max(1, computing))


def threads_now() -> int:
    """The thread count the policy gives this process now (under "auto", never more than an OMP_NUM_THREADS set
    in the environment: a user's or `accelerate launch`'s cap). A process that saw another one computing less than
    GROW_AFTER_S ago keeps its share instead of taking every core back during the other's pause between two
    compute calls."""
    global _last_shared
    if _setting != "auto":
        return int(_setting)
    computing_now = computing_processes() if _depth else 1
    n = share(machine_cores(), computing_now)
    if computing_now > 1:
        _last_shared = time.monotonic()
    elif _applied is not None and _applied < n and time.monotonic() - _last_shared < GROW_AFTER_S:
        n = _applied
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
    """A compute region of this process (re-entrant): counted by every other rsiflow process's share while in
    it."""
    global _depth
    with _lock:
        _depth += 1
        if _depth == 1 and _setting == "auto":
            _mark()
    try:
        refresh()
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _unmark()
