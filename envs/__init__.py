"""rsiflow environments: the `Env` interface and `make_env`, which builds one from a config name.

Built in: "household", "arithmetic", "tooluse", "explain" (no verifier; plain Python) and "scienceworld" (needs the
optional `scienceworld` package and Java; imported only when asked for). Any other
"package.module:Class" naming an `Env` subclass works too; `rsiflow check-env NAME`
(or `python -m rsiflow.envs.conformance NAME`) checks that an env honours the interface.
"""

from __future__ import annotations

import inspect
import os
import sys
from importlib import import_module
from typing import Any

from rsiflow.envs.arithmetic import ArithmeticEnv
from rsiflow.envs.base import Env, StepResult, TaskSpec
from rsiflow.envs.explain import ExplainEnv
from rsiflow.envs.household import HouseholdEnv
from rsiflow.envs.tooluse import ToolUseEnv

__all__ = ["BUILTIN_ENVS", "LAZY_ENVS", "Env", "EnvError", "StepResult", "TaskSpec", "check_env_kwargs", "env_class",
           "make_env"]

BUILTIN_ENVS: dict[str, type[Env]] = {"household": HouseholdEnv, "arithmetic": ArithmeticEnv,
                                      "tooluse": ToolUseEnv, "explain": ExplainEnv}
# Built-ins with optional dependencies: imported on first use, so the package works without them.
LAZY_ENVS: dict[str, str] = {"scienceworld": "rsiflow.envs.scienceworld:ScienceWorldEnv"}


class EnvError(ValueError):
    """An env that can't be loaded or built, or kwargs its constructor doesn't take; the message names the env."""


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


def _where(err: BaseException) -> str:
    """' (file:line)' of the innermost frame of a traceback, or ''."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})" if tb is not None else ""


def env_class(name: str) -> type[Env]:
    """The Env subclass a config name means: a built-in name or "package.module:Class" (looked up on sys.path,
    then in the current directory). EnvError, naming the env, for an unknown name, a module that is missing or
    raises while it is imported, or an attribute that is not an Env subclass."""
    if name in BUILTIN_ENVS:
        return BUILTIN_ENVS[name]
    spec = LAZY_ENVS.get(name, name)
    if ":" not in spec:
        raise EnvError(f"unknown env {name!r}: built-in envs are {sorted([*BUILTIN_ENVS, *LAZY_ENVS])}; "
                       "a custom env is named in the form 'package.module:Class'")
    module_name, _, class_name = spec.partition(":")
    try:
        module = _import(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise EnvError(f"env {name!r}: no module {module_name!r} on sys.path or in the current directory "
                           f"({os.getcwd()})") from None
        raise EnvError(f"env {name!r}: importing {module_name} failed: {err}{_where(err)}") from err
    except Exception as err:
        raise EnvError(f"env {name!r}: importing {module_name} raised {type(err).__name__}: {err}"
                       f"{_where(err)}") from err
    cls = getattr(module, class_name, None)
    if cls is None:
        raise EnvError(f"env {name!r}: module {module_name!r} has no attribute {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise EnvError(f"env {name!r} is not a subclass of rsiflow.envs.base.Env")
    return cls


def check_env_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """EnvError naming the first kwarg the env's constructor doesn't take, or whose value doesn't match the
    parameter's annotation (checked strictly, as YAML gives it: '4' is not an int)."""
    from pydantic import TypeAdapter, ValidationError

    cls = env_class(name)
    try:
        params = inspect.signature(cls.__init__, eval_str=True).parameters
    except (NameError, TypeError, ValueError):   # annotations that can't be resolved: let the constructor judge
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n: p for n, p in params.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key, value in kwargs.items():
        param = named.get(key)
        if param is None:
            if takes_any:
                continue
            raise EnvError(f"env.kwargs.{key}: env {name!r} ({cls.__name__}) takes no argument {key!r}; it takes "
                           f"{', '.join(named) or 'none'}")
        if param.annotation is param.empty:
            continue
        try:
            TypeAdapter(param.annotation).validate_python(value, strict=True)
        except ValidationError:
            shown = inspect.formatannotation(param.annotation)
            raise EnvError(f"env.kwargs.{key}: {value!r} ({type(value).__name__}) is not a valid {shown} for env "
                           f"{name!r} ({cls.__name__}({key}: {shown}))") from None
        except Exception:   # an annotation pydantic can't check: let the constructor judge
            continue


def make_env(name: str, **kwargs: Any) -> Env:
    """An env from a built-in name ("household", "arithmetic", "tooluse", "explain", "scienceworld") or a
    "package.module:Class" naming an Env subclass (looked up on sys.path, then in the current
    directory), constructed with `kwargs`."""
    return env_class(name)(**kwargs)
