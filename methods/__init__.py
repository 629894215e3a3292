"""The methods a round can use, registered in one dict: what each contributes to a round.

`distill.methods` in the config names them; the distill, train and report steps iterate over the
enabled ones and never name one. A method is one module with a `Method` subclass (base.py): it
turns the round's stored experience into training rows of a kind the trainer knows (models/encoding.py:
"sft" or "distill"), writes its own tables, reports its per-round figures and its report section.
Its algorithm lives in methods/ as plain Python; the module here is the glue to the store and the backend.

Add one: a folder `methods/<name>/` (its algorithm as plain Python, its `Method` subclass with its options, its
tables' migrations and its queries) and one line in configs/registry.py's METHODS; or, outside the repository,
name your `Method` subclass in the config as "package.module:Class" (no edit here at all): it gets the same
powers, its options as `distill.<its name>` and its own tables. docs/methods.md says how.
"""

from __future__ import annotations

from importlib import import_module

from rsiflow.configs.registry import METHODS
from rsiflow.methods.base import (
    POLICY_LOSS,
    REWARD_BONUS,
    TURN_WEIGHTS,
    AssessContext,
    Contribution,
    DistillContext,
    Key,
    Method,
)

__all__ = ["METHODS", "POLICY_LOSS", "REWARD_BONUS", "TURN_WEIGHTS", "AssessContext", "Contribution", "DistillContext",
           "Key", "Method", "enabled_methods", "method_class", "method_classes", "needs_temp_logprobs"]

def method_class(name: str) -> type[Method]:
    """The Method class of a registered name or of "package.module:Class"; ValueError otherwise."""
    target = METHODS.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown method {name!r}: registered methods are {sorted(METHODS)}; "
                         "a method of your own is named in the form 'package.module:Class'")
    module, _, attr = target.partition(":")
    cls = getattr(import_module(module), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(f"method {name!r}: {target} is not a subclass of rsiflow.methods.Method")
    return cls


def method_classes(cfg=None) -> dict[str, type[Method]]:
    """Method classes by their `name` (the key of their figures in the store): every registered one and, given a
    config, the methods of its own that it names as "package.module:Class"."""
    entries = [*METHODS, *(cfg.distill.methods if cfg is not None else [])]
    return {cls.name: cls for cls in map(method_class, entries)}


def needs_temp_logprobs(cfg) -> bool:
    """Whether a method of `distill.methods` trains on the rollouts' temperature-only logprobs (GRPO's mismatch
    correction): the generate step asks the backend for them only then."""
    return any(method_class(name).uses_temp_logprobs for name in cfg.distill.methods)


def enabled_methods(cfg) -> list[Method]:
    """The config's `distill.methods`, each built with the config, in the order their state keys need: a method
    that provides a key runs before the ones that consume or require it; otherwise the config's order. ConfigError
    when a required key has no provider, a provided one no consumer, or the keys make a cycle."""
    from rsiflow.configs.schema import ConfigError

    methods = [method_class(name)(cfg) for name in cfg.distill.methods]
    where = cfg.source_of("distill.methods")
    providers: dict[Key, Method] = {}
    for m in methods:
        for key in m.provides():
            if key in providers:
                raise ConfigError(f"{where}: distill.methods: {providers[key].name} and {m.name} both provide {key} "
                                  f"({key.doc}); enable one of them")
            providers[key] = m
    for m in methods:
        missing = sorted(str(k) for k in m.requires() if k not in providers)
        if missing:
            raise ConfigError(f"{where}: distill.methods: {m.name} requires {', '.join(missing)}, which no method of "
                              f"{cfg.distill.methods} provides (enable one that does)")
    for key, m in providers.items():
        if key.needs_consumer and not any(key in (o.consumes() | o.requires()) for o in methods if o is not m):
            raise ConfigError(f"{where}: distill.{m.name}: provides {key} ({key.doc}), but no method of "
                              f"{cfg.distill.methods} consumes it: enable one that does, or the option of "
                              f"distill.{m.name} that makes it")
    ordered: list[Method] = []
    while len(ordered) < len(methods):
        ready = [m for m in methods if m not in ordered
                 and all(providers[k] in ordered for k in m.consumes() | m.requires() if k in providers
                         and providers[k] is not m)]
        if not ready:
            stuck = [m.name for m in methods if m not in ordered]
            raise ConfigError(f"{where}: distill.methods: {stuck} need each other's state keys (a cycle)")
        ordered.append(ready[0])
    return ordered
