"""The `self-improve` flow: rounds until the run has `rounds` completed rounds (resuming after a crash)."""

from __future__ import annotations

from prefect import flow

from configs.schema import load_config
from flows.round import improvement_round
from tasks.common import open_store
from tasks.setup import ensure_run


@flow(name="self-improve")
def self_improve(config: list[str] = ["configs/default.yaml"], overrides: list[str] = [],  # noqa: B006 (Prefect's run form)
                 rounds: int | None = None) -> list[dict]:
    """Run rounds (each an `improvement-round` subflow) until `rounds` (default: run.rounds) are done."""
    cfg = load_config(config, overrides)
    target = cfg.run.rounds if rounds is None else rounds
    ensure_run(cfg)
    results = []
    while True:
        with open_store(cfg) as store:
            done = store.last_completed_round(cfg.run.name)
        if done >= target:
            return results
        results.append(improvement_round(config, overrides))
