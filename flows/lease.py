"""The run lease: one round of a run at a time, whatever starts it (cron, the UI, `rsiflow run`, `self-improve`).

`run_lease(cfg, wait_s)` takes the run's row in the store's `leases` table for this process (host, pid, flow
run), renews it from a heartbeat thread every HEARTBEAT_S seconds while the block runs, and gives it back at the
end. A second starter polls for up to `wait_s` seconds and then raises `RunBusyError`, whose one-line message
names the holder. A lease whose holder stopped heartbeating for LEASE_TTL_S seconds (killed, its machine gone)
is taken over; one whose process on this host no longer exists is taken over at once.

Re-entrant within one context: code that holds the lease (the `self-improve` flow, `rsiflow run`) runs rounds
that ask for it again, and they run under the outer holder (a context variable carries it into Prefect
subflows, which run in the same thread). Other threads and processes are other holders.

This is the guarantee that works without a Prefect server; the deployments' concurrency limit (flows/cli.py,
prefect.yaml) only keeps a second run of the same deployment from starting.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from rsiflow.configs.schema import Config
from rsiflow.stores.lake import store_location
from rsiflow.stores.store import Store, StoreLockedError

LEASE_TTL_S = 120.0   # a lease not renewed for this long is taken over
HEARTBEAT_S = 15.0    # renewal period (a heartbeat may wait up to 30 s for DuckDB's file lock)
POLL_S = 5.0          # how often a waiting starter looks again


class RunBusyError(RuntimeError):
    """Another holder runs a round of this run."""


class LeaseLostError(RuntimeError):
    """This holder's lease was taken over (it did not heartbeat for LEASE_TTL_S seconds)."""


def _say(message: str) -> None:
    """To the flow run's log (the Prefect UI) inside a flow run, else to stderr."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().info(message)
    except MissingContextError:
        print(f"rsiflow: {message}", file=sys.stderr, flush=True)


def describe(lease: dict) -> str:
    """Who holds a lease, since when and how fresh it is, in one line."""
    now = datetime.now(UTC).replace(tzinfo=None)
    who = f"flow run {lease['flow_run_name']!r}" if lease["flow_run_name"] else "a process"
    return (f"{who} on host {lease['host']} (pid {lease['pid']}) since {lease['acquired_at']:%Y-%m-%d %H:%M:%S} UTC, "
            f"last heartbeat {(now - lease['heartbeat_at']).total_seconds():.0f} s ago")


class RunLease:
    """This process's claim on one run in one store; see the module docstring."""

    def __init__(self, cfg: Config):
        self.run_id = cfg.run.name
        self.store_path = store_location(cfg.run.store)   # a file's absolute path, or a DuckLake's spec
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.holder = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self.flow_run: tuple[str | None, str | None] = (None, None)
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, wait_s: float) -> None:
        """Take the lease, polling every POLL_S seconds for up to `wait_s`; RunBusyError after that."""
        deadline = time.monotonic() + wait_s
        announced = False
        while True:
            try:
                with Store(self.store_path) as store:
                    lease, replaced = store.acquire_lease(self.run_id, self.holder, LEASE_TTL_S, self.host, self.pid,
                                                          *self.flow_run)
            except StoreLockedError:
                if time.monotonic() >= deadline:
                    raise
                continue   # the Store waited for DuckDB's file lock already; look again
            if lease["holder"] == self.holder:
                break
            if time.monotonic() >= deadline:
                raise RunBusyError(
                    f"run {self.run_id!r} is busy: a round of it is running under {describe(lease)}; waited "
                    f"{wait_s:g} s. Wait longer (rsiflow run --wait SECONDS, or the flow's lease_wait_s parameter) "
                    f"or stop that holder (a holder that stops heartbeating is taken over after {LEASE_TTL_S:g} s).")
            if not announced:
                _say(f"run {self.run_id!r}: waiting up to {wait_s:g} s for the round running under {describe(lease)}")
                announced = True
            time.sleep(max(0.0, min(POLL_S, deadline - time.monotonic())))
        if replaced is not None:
            gone = replaced["expires_at"] > lease["acquired_at"]
            _say(f"run {self.run_id!r}: took over the lease of {describe(replaced)}: "
                 + ("its process is gone" if gone else "it expired"))
        self._thread = threading.Thread(target=self._heartbeat, name=f"rsiflow-lease-{self.run_id}", daemon=True)
        self._thread.start()

    def set_flow_run(self, flow_run_id: str | None, flow_run_name: str | None) -> None:
        """Record the flow run now executing under the lease (what a second starter's message names)."""
        if flow_run_id is None:
            return
        self.flow_run = (flow_run_id, flow_run_name)
        with Store(self.store_path) as store:
            if not store.heartbeat_lease(self.run_id, self.holder, LEASE_TTL_S, *self.flow_run):
                self.lost = self._taken_over(store)
        self.check()

    def _taken_over(self, store: Store) -> str:
        lease = store.lease(self.run_id)
        return (f"the lease of run {self.run_id!r} was taken over by "
                + (describe(lease) if lease else "nobody (it was released)"))

    def check(self) -> None:
        """Raise LeaseLostError if another holder has taken the run over (call before each step)."""
        if self.lost:
            raise LeaseLostError(f"{self.lost}; this round stops here")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with Store(self.store_path) as store:
                    if not store.heartbeat_lease(self.run_id, self.holder, LEASE_TTL_S, *self.flow_run):
                        self.lost = self._taken_over(store)
                        return
            except StoreLockedError:
                continue   # another process writes the store right now: renew at the next beat
            except Exception as err:
                self.lost = f"the lease of run {self.run_id!r} could not be renewed: {type(err).__name__}: {err}"
                return

    def release(self) -> None:
        """Stop the heartbeat and give the lease back (if the store stays locked, the lease expires instead)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            with Store(self.store_path) as store:
                store.release_lease(self.run_id, self.holder)
        except StoreLockedError as err:
            _say(f"run {self.run_id!r}: could not give the lease back ({err}); it expires in {LEASE_TTL_S:g} s")


_HELD: ContextVar[tuple[RunLease, ...]] = ContextVar("rsiflow_run_leases", default=())


@contextmanager
def run_lease(cfg: Config, wait_s: float = 0.0) -> Iterator[RunLease]:
    """Hold the run's lease for the block (re-entrant: a lease this context holds already is reused)."""
    store_path = store_location(cfg.run.store)
    for lease in _HELD.get():
        if (lease.store_path, lease.run_id) == (store_path, cfg.run.name):
            yield lease
            return
    lease = RunLease(cfg)
    lease.acquire(wait_s)
    token = _HELD.set(_HELD.get() + (lease,))
    try:
        yield lease
    finally:
        _HELD.reset(token)
        lease.release()
