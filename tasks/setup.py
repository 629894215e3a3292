"""Create a run in the store and register its base model (round 0), once."""

from __future__ import annotations

from pathlib import Path

from configs.schema import Config, ConfigError
from envs import make_env
from models.loading import resolve_base_model
from tasks.common import open_store


def base_model_id(cfg: Config) -> str:
    return f"{cfg.run.name}/base"


def check_env(cfg: Config) -> None:
    """Build the configured env once, so a bad env name or kwargs fail before any work, naming the key."""
    try:
        make_env(cfg.env.name, **cfg.env.kwargs).close()
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        key = "env.kwargs" if isinstance(e, TypeError) and "argument" in str(e) else "env.name"
        raise ConfigError(f"{key}: {e}") from e


def check_methods(cfg: Config) -> None:
    """Every name in distill.methods is a registered method or a 'package.module:Class' Method."""
    from tasks.methods import method_class

    for name in cfg.distill.methods:
        try:
            method_class(name)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"distill.methods: {e}") from e


def ensure_run(cfg: Config) -> str:
    """Idempotent: the run row, and the base model converted/located and registered as 'base'.

    A run name reused with a different config is an error (the store would mix two runs).
    The round count is not part of a run's identity: asking for more rounds continues it.
    """
    check_env(cfg)
    check_methods(cfg)
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
