"""The temporary Prefect API server of an `rsiflow run` or `rsiflow serve` without PREFECT_API_URL.

Prefect starts one itself on first use (`SubprocessASGIServer`), as a plain child: Ctrl-C at a terminal signals the
whole process group, so it died first and the flow run then retried reporting to it for minutes; and a `kill -9`
of the main process left it running. Its client also imports Prefect's whole server package to start it (~5 CPU-s
a process on the 2-core EPYC: `python -c "import prefect.server.api.server"` after rsiflow's imports). `start()`
runs the same server command itself, from the main thread, in its own session (the terminal's Ctrl-C doesn't reach
it; this process stops it at exit) and with a parent-death signal (the kernel sends it SIGTERM when this process
dies, however), then points this process's Prefect settings at it; child processes don't inherit that (their
environment is unchanged), and `user_api_url()` still answers None, so a check for a server that other processes
reach (work pools, `rsiflow deploy`) is not satisfied by it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_UVICORN_STARTUP_FAILURE = 3   # uvicorn's exit code when it can't bind its port
_started: list[str] = []       # the API URL of the server this process started, once it answers

log = logging.getLogger("prefect")


def _die_with_parent(parent: int, libc) -> None:
    """In a child between fork and exec: ask the kernel for SIGTERM when the parent dies, even by SIGKILL (Linux
    prctl PR_SET_PDEATHSIG); exit at once if it died already."""
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now, from Prefect's range for its temporary servers (8000-8999)."""
    for _ in range(50):
        port = random.randrange(8000, 9000)
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 8000-8999 for the temporary Prefect server")


def _stop(process: subprocess.Popen) -> None:
    """Terminate the server at exit (SIGTERM, then SIGKILL after 5 s), as Prefect does for its own."""
    if process.poll() is None:
        log.info("Stopping temporary server on http://127.0.0.1:%s", process.args[process.args.index("--port") + 1])
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def user_api_url() -> str | None:
    """PREFECT_API_URL as the user set it: None when unset, or when it points at the temporary server `start()`
    started for this process (which no other process knows of)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return None if not url or url in _started else url


def start() -> None:
    """Start the temporary Prefect API server for this process unless PREFECT_API_URL is set (by the user, or by an
    earlier call), wait until it answers, and point this process's Prefect settings at it."""
    import httpx
    import prefect
    import prefect.context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        get_current_settings,
    )

    if PREFECT_API_URL.value():
        return
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    parent = os.getpid()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    preexec = (lambda: _die_with_parent(parent, libc)) if libc is not None else None

    def launch(port: int) -> subprocess.Popen:
        # the command Prefect's own temporary server runs (prefect.server.api.server.SubprocessASGIServer)
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
             "error", "--lifespan", "on"], env=env, start_new_session=True, preexec_fn=preexec)
        atexit.register(_stop, process)
        return process

    port = _free_port()
    log.info("Starting temporary server on http://127.0.0.1:%d", port)
    process = launch(port)
    deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    with httpx.Client() as client:
        while True:
            if process.poll() == _UVICORN_STARTUP_FAILURE:   # another process took the port meanwhile
                port = _free_port()
                process = launch(port)
            elif process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect API server exited with code {process.returncode} "
                                   "before answering")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"http://127.0.0.1:{port}/api/health").status_code == 200:
                    break
            if time.monotonic() > deadline:
                _stop(process)
                raise RuntimeError("the temporary Prefect API server did not answer within "
                                   f"{PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()} s "
                                   "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}/api"
    _started.append(url)
    root = prefect.context.GLOBAL_SETTINGS_CONTEXT
    prefect.context.GLOBAL_SETTINGS_CONTEXT = prefect.context.SettingsContext(
        profile=root.profile, settings=root.settings.copy_with_update(updates={PREFECT_API_URL: url}))
