"""Create a run in the store and register its base model (round 0), once."""

from __future__ import annotations

from pathlib import Path

from configs.schema import Config
from models.loading import resolve_base_model
from tasks.common import open_store


def base_model_id(cfg: Config) -> str:
    return f"{cfg.run.name}/base"


def ensure_run(cfg: Config) -> str:
    """Idempotent: the run row, and the base model converted/located and registered as 'base'.

    A run name reused with a different config is an error (the store would mix two runs).
    The round count is not part of a run's identity: asking for more rounds continues it.
    """
    run_id = cfg.run.name
    identity = cfg.model_dump(mode="json")
    identity["run"].pop("rounds")
    with open_store(cfg) as store:
        store.create_run(run_id, run_id, identity, cfg.model.base)
        if store.completed_steps(run_id, 0) >= {"init"}:
            return run_id
    path = resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser())
    with open_store(cfg) as store, store.step(run_id, 0, "init") as tx:
        tx.insert("models", [{"model_id": base_model_id(cfg), "parent_id": None, "path": str(path), "role": "base"}])
    return run_id
