"""The methods a round can use, registered in one dict: what each contributes to a round.

`distill.methods` in the config names them; the distill, train and report steps iterate over the
enabled ones and never name one. A method is one module with a `Method` subclass (base.py): it
turns the round's stored experience into training rows of a kind the trainer knows (models/encoding.py:
"sft" or "distill"), writes its own tables, reports its per-round figures and its report section.
Its algorithm lives in methods/ as plain Python; the module here is the glue to the store and the backend.

Add one: write `methods/<name>.py` (`rsiflow.methods.<name>`) with a `Method` subclass and name it
here, or name it in the config as "package.module:Class" (no edit here at all).
"""

from __future__ import annotations

from importlib import import_module

from rsiflow.configs.registry import METHODS
from rsiflow.methods.base import AssessContext, Contribution, DistillContext, Method

__all__ = ["METHODS", "AssessContext", "Contribution", "DistillContext", "Method", "enabled_methods", "method_class",
           "needs_temp_logprobs"]

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


def needs_temp_logprobs(cfg) -> bool:
    """Whether a method of `distill.methods` trains on the rollouts' temperature-only logprobs (GRPO's mismatch
    correction): the generate step asks the backend for them only then."""
    return any(method_class(name).uses_temp_logprobs for name in cfg.distill.methods)


def enabled_methods(cfg) -> list[Method]:
    """The config's `distill.methods`, in order, each built with the config."""
    return [method_class(name)(cfg) for name in cfg.distill.methods]
