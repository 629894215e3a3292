"""rsiflow environments: the `Env` interface and `make_env`, which builds one from a config name.

Built in: "household", "arithmetic", "tooluse" (plain Python) and "scienceworld" (needs the
optional `scienceworld` package and Java; imported only when asked for). Any other
"package.module:Class" naming an `Env` subclass works too; `python -m envs.conformance NAME`
checks that an env honours the interface.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import Any

from envs.arithmetic import ArithmeticEnv
from envs.base import Env, StepResult, TaskSpec
from envs.household import HouseholdEnv
from envs.tooluse import ToolUseEnv

__all__ = ["BUILTIN_ENVS", "LAZY_ENVS", "Env", "StepResult", "TaskSpec", "make_env"]

BUILTIN_ENVS: dict[str, type[Env]] = {"household": HouseholdEnv, "arithmetic": ArithmeticEnv,
                                      "tooluse": ToolUseEnv}
# Built-ins with optional dependencies: imported on first use, so the package works without them.
LAZY_ENVS: dict[str, str] = {"scienceworld": "envs.scienceworld:ScienceWorldEnv"}


def _import(module_name: str):
    """Import a user's env module from sys.path or, failing that, from the current directory (as
    `python -m` would; console scripts such as `rsiflow` don't put it on sys.path)."""
    try:
        return import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if cwd in sys.path or not (exc.name and module_name.startswith(exc.name)):
            raise
        sys.path.append(cwd)
        return import_module(module_name)


def make_env(name: str, **kwargs: Any) -> Env:
    """An env from a built-in name ("household", "arithmetic", "tooluse", "scienceworld") or a
    "package.module:Class" naming an Env subclass (looked up on sys.path, then in the current
    directory), constructed with `kwargs`."""
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name](**kwargs)
    if name in LAZY_ENVS:
        name = LAZY_ENVS[name]
    if ":" not in name:
        raise ValueError(f"unknown env {name!r}: built-in envs are {sorted([*BUILTIN_ENVS, *LAZY_ENVS])}; "
                         "a custom env is named in the form 'package.module:Class'")
    module_name, _, class_name = name.partition(":")
    cls = getattr(_import(module_name), class_name, None)
    if cls is None:
        raise ValueError(f"env {name!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"env {name!r} is not a subclass of envs.base.Env")
    return cls(**kwargs)
