"""The `self-improve` flow: rounds until the run has `rounds` completed rounds (resuming after a crash).

It holds the run's lease (flows/lease.py) across all its rounds; each round is an `improvement-round`
subflow that finds the lease already held by its parent and runs under it.
"""

from __future__ import annotations

from prefect import flow

from rsiflow.configs.loader import load_config
from rsiflow.flows.lease import run_lease
from rsiflow.flows.round import label_flow_run, round_flow
from rsiflow.tasks.common import open_store
from rsiflow.tasks.setup import ensure_run


@flow(name="self-improve")
def self_improve(config: list[str] = ["configs/default.yaml"], overrides: list[str] = [],  # noqa: B006 (Prefect's run form)
                 rounds: int | None = None, lease_wait_s: float = 0.0) -> list[dict]:
    """Run rounds (each an `improvement-round` subflow) until `rounds` (default: run.rounds) are done; if a
    round of the run is running elsewhere, wait up to `lease_wait_s` seconds for it, then fail naming it."""
    cfg = load_config(config, overrides)
    target = cfg.run.rounds if rounds is None else rounds
    ensure_run(cfg)
    results = []
    with run_lease(cfg, lease_wait_s) as lease:
        lease.set_flow_run(*label_flow_run(cfg, f"{cfg.run.name}-self-improve"))
        while True:
            with open_store(cfg) as store:
                done = store.last_completed_round(cfg.run.name)
            if done >= target:
                return results
            results.append(round_flow(cfg, max(done, 0) + 1)(config, overrides))
