"""Create a run in the store and register its base model (round 0), once, after checking every input.

A run's identity is its config minus the operational keys (`OPERATIONAL`: where files live, how many rounds,
how the generation engine and Prefect are run). A run name reused with a config that differs in an identity
key is refused, naming the keys. Configs stored by older code are compared key by key, a key one side lacks
counting as the current code's default, so adding a config field never makes existing runs refuse to continue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rsiflow.configs.schema import Config, ConfigError
from rsiflow.envs import EnvError, check_env_kwargs, make_env
from rsiflow.models import threads
from rsiflow.stores.lake import is_lake
from rsiflow.tasks.common import open_store

# Keys (and sections) that say how a run is executed, not what it computes: changing them continues the run.
OPERATIONAL = (
    "run.rounds", "run.store", "run.run_dir", "run.model_cache", "prefect", "train.report_to", "train.keep_candidates",
    "run.lake_data_path", "run.threads", "run.omp_spin_count",
    "backend.hf.max_batch_size", "backend.hf.kv_reuse", "backend.hf.max_live_episodes",
    "backend.hf.packed_linears", "backend.hf.shared_prefix_attention",
    "backend.vllm.python", "backend.vllm.kv_cache_gib", "backend.vllm.gpu_memory_utilization",
    "backend.vllm.enforce_eager", "backend.vllm.threads", "backend.vllm.start_timeout",
    "backend.openai.base_url", "backend.openai.api_key_env", "backend.openai.timeout", "backend.openai.retries",
    "backend.openai.backoff_seconds", "backend.openai.max_concurrency", "backend.openai.redeploy",
    "backend.openai.redeploy_command", "backend.openai.base_urls", "backend.openai.reprobe_seconds",
    "train.accelerate_config", "train.main_process_port",
)


def base_model_id(cfg: Config) -> str:
    return f"{cfg.run.name}/base"


def check_env_config(cfg: Config) -> None:
    """Load the configured env, check its kwargs against its constructor and build it once, so a bad env name,
    module or kwarg fails before any work, naming the key and where its value came from."""
    name, kwargs = cfg.env.name, cfg.env.kwargs
    try:
        check_env_kwargs(name, kwargs)
    except EnvError as e:   # its message starts with the kwarg's key, or names the env
        key = str(e).split(":", 1)[0] if str(e).startswith("env.kwargs.") else None
        raise ConfigError(f"{cfg.source_of(key)}: {e}" if key else f"{cfg.source_of('env.name')}: env.name: {e}") \
            from None
    try:
        make_env(name, **kwargs).close()
    except Exception as e:   # the env's own code: any exception is its verdict on these kwargs
        raise ConfigError(f"{cfg.source_of('env.kwargs')}: env.kwargs: building env {name!r} with {kwargs} raised "
                          f"{type(e).__name__}: {e}") from None


def check_methods(cfg: Config) -> None:
    """Every name in distill.methods is a registered method or a 'package.module:Class' Method, and together they
    can run: each builds with the config, and their state keys resolve (methods.enabled_methods)."""
    from rsiflow.methods import enabled_methods, method_class

    for name in cfg.distill.methods:
        try:
            method_class(name)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"{cfg.source_of('distill.methods')}: distill.methods: {e}") from None
        except Exception as e:   # a method module of the user's that raises while it is imported
            raise ConfigError(f"{cfg.source_of('distill.methods')}: distill.methods: loading method {name!r} raised "
                              f"{type(e).__name__}: {e}") from None
    enabled_methods(cfg)


def method_tables(cfg: Config, store) -> None:
    """Create or upgrade the tables of each method of distill.methods (its `migrations`)."""
    from rsiflow.methods import enabled_methods

    for m in enabled_methods(cfg):
        if m.migrations:
            store.apply_method_migrations(m.name, m.migrations)


def check_base_model(cfg: Config) -> Path:
    """The base model's checkpoint folder (converted into the model cache the first time), with safetensors
    weights; ConfigError naming model.base otherwise."""
    from rsiflow.models.loading import resolve_base_model  # torch: loaded once a run starts (run.omp_spin_count)

    try:
        path = resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser())
    except (OSError, ValueError, LookupError) as e:
        raise ConfigError(f"{cfg.source_of('model.base')}: model.base: {e}") from None
    if not any(Path(path).glob("*.safetensors")):
        raise ConfigError(f"{cfg.source_of('model.base')}: model.base: {path} has no .safetensors weights; rsiflow "
                          f"loads safetensors only (convert it: load it yourself and save_pretrained(..., "
                          f"safe_serialization=True))")
    return Path(path)


def _flat(value: Any, defaults: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a config dump, descending into the sections of `defaults` (a free dict such as env.kwargs
    and a list are one value)."""
    out = {}
    for key, v in value.items():
        path = f"{prefix}{key}"
        d = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(v, dict) and isinstance(d, dict) and d:
            out.update(_flat(v, d, path + "."))
        else:
            out[path] = v
    return out


def identity(cfg: Config) -> dict:
    """What is stored as the run's config: the whole config but run.rounds."""
    data = cfg.model_dump(mode="json")
    data["run"].pop("rounds")
    return data


def config_differences(stored: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, stored value, new value) for each identity key whose value differs. A key one side lacks counts as
    the current code's default; a key the current code no longer has is ignored; OPERATIONAL keys are ignored."""
    defaults_tree = Config().model_dump(mode="json")
    defaults = _flat(defaults_tree, defaults_tree)
    old, new = _flat(stored, defaults_tree), _flat(cfg.model_dump(mode="json"), defaults_tree)
    diffs = []
    for key in sorted(defaults):
        if any(key == op or key.startswith(op + ".") for op in OPERATIONAL):
            continue
        before, after = old.get(key, defaults[key]), new.get(key, defaults[key])
        if before != after:
            diffs.append((key, before, after))
    return diffs


def check_same_run(stored: dict, cfg: Config) -> None:
    """ConfigError listing the identity keys in which `cfg` differs from the run's stored config."""
    diffs = config_differences(stored, cfg)
    if diffs:
        shown = "; ".join(f"{k}: {a!r} (stored) vs {b!r} (now, from {cfg.source_of(k)})" for k, a, b in diffs)
        raise ConfigError(f"run {cfg.run.name!r} in {cfg.run.store} was created with another config: {shown}. "
                          "Use another run.name for a new config, or set these keys back to continue the run")


def ensure_run(cfg: Config) -> str:
    """Idempotent: check the inputs (env, methods, store, config against the run's stored one, base model),
    then write the run row and register the base model as 'base' (round 0's 'init' step). Nothing is written
    before every input is checked. The round count is not part of a run's identity: asking for more rounds
    continues it."""
    threads.apply_spin_count(cfg.run.omp_spin_count)   # first: the checks below may load torch
    check_env_config(cfg)
    check_methods(cfg)
    run_id = cfg.run.name
    # An existing store is checked before anything else is written (a store refused on opening is left as it
    # was). Not read-only: the round's lease heartbeat opens it read-write from another thread of this process,
    # and DuckDB refuses a read-only and a read-write connection to one file in one process.
    if is_lake(cfg.run.store) or Path(cfg.run.store).expanduser().exists():
        with open_store(cfg) as store:
            run = store.get_run(run_id)
            if run is not None:
                check_same_run(run["config"], cfg)
            if run is not None and store.completed_steps(run_id, 0) >= {"init"}:
                method_tables(cfg, store)
                return run_id
    path = check_base_model(cfg)
    with open_store(cfg) as store:
        method_tables(cfg, store)
        if store.get_run(run_id) is None:
            store.create_run(run_id, run_id, identity(cfg), cfg.model.base)
        with store.step(run_id, 0, "init") as tx:
            tx.insert("models", [{"model_id": base_model_id(cfg), "parent_id": None, "path": str(path),
                                  "role": "base"}])
    return run_id
