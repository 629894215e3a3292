"""Loading the run config: YAML files merged left to right, `a.b=c` overrides on top, validated into the schema
(configs/schema.py); every value remembers where it came from, so an error names the key path and the file or
`--set` override that gave it.

    load_config(["configs/default.yaml", "configs/overlay.yaml"], ["train.learning_rate=1e-5"])
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rsiflow.configs.schema import Config, ConfigError, key_source


def _merge(base: dict, overlay: dict, sources: dict, source: str, prefix: tuple = ()) -> None:
    for key, value in overlay.items():
        path = prefix + (str(key),)
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "kwargs":
            _merge(base[key], value, sources, source, path)
        else:
            base[key] = copy.deepcopy(value)
            sources[path] = source
            if isinstance(value, dict):
                for sub in _leaf_paths(value, path):
                    sources[sub] = source


def _leaf_paths(d: dict, prefix: tuple) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append(prefix + (str(k),))
        if isinstance(v, dict):
            out.extend(_leaf_paths(v, prefix + (str(k),)))
    return out


def _parse_override(text: str, origin: str = "--set") -> tuple[tuple[str, ...], Any]:
    if "=" not in text:
        raise ConfigError(f"{origin} {text!r}: expected KEY.PATH=VALUE, e.g. train.learning_rate=1e-5")
    key, raw = text.split("=", 1)
    path = tuple(p for p in key.strip().split(".") if p)
    if not path:
        raise ConfigError(f"{origin} {text!r}: empty key")
    if not raw.strip():
        return path, ""
    try:
        return path, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{origin} {text!r}: the value is not valid YAML ({problem}); write a list as [a, b] and "
                          f"quote a string that starts with [, {{, * or & ({origin} 'key=\"text\"')") from None


def _drop_overridden_backend_sections(data: dict, sources: dict, order: list[str]) -> None:
    """An overlay that switches `backend.kind` drops the other backends' sections set by the files before it
    (`configs/default.yaml` sets `backend.hf`; `configs/vllm-cpu.yaml` on top of it switches to vllm). A section
    of another backend set by the same source as the kind, or by a later one, stays and is an error."""
    backend = data.get("backend")
    if not isinstance(backend, dict) or ("backend", "kind") not in sources:
        return
    rank = {source: i for i, source in enumerate(order)}
    kind_rank = rank.get(sources[("backend", "kind")], -1)
    for name in [k for k, v in backend.items() if isinstance(v, dict) and k != backend.get("kind")]:
        set_by = {rank.get(src, -1) for path, src in sources.items() if path[:2] == ("backend", name)}
        if set_by and max(set_by) < kind_rank:
            del backend[name]


def load_config(files: list[str | Path], overrides: list[str] = (), origin: str = "--set") -> Config:
    """Merge YAML files left to right, apply `a.b=c` overrides, validate. Raises ConfigError. `origin` names
    where the overrides came from in errors and `source_of` ("--set" on the command line; a deployment's
    parameter when a deployment passed them)."""
    data: dict = {}
    sources: dict[tuple, str] = {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        _merge(data, loaded, sources, str(path))
    for text in overrides:
        key, value = _parse_override(text, origin)
        nested: Any = value
        for part in reversed(key):
            nested = {part: nested}
        _merge(data, nested, sources, f"{origin} {text}")
    _drop_overridden_backend_sections(data, sources, [str(Path(f)) for f in files]
                                      + [f"{origin} {text}" for text in overrides])
    try:
        cfg = Config.model_validate(data)
        cfg._sources = sources
        return cfg
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(str(p) for p in err["loc"])
            key = ".".join(loc) or "(top level)"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            lines.append(f"{key_source(loc, sources)}: {key}: {msg}")
        raise ConfigError("invalid config: " + lines[0] if len(lines) == 1
                          else "invalid config:\n  " + "\n  ".join(lines)) from None
