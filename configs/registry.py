"""The plugins a config names, as "module:Class" strings imported on first use: generation backends by
`backend.kind` (a backend may need packages the others don't; models/backend.py opens them) and methods by their
name in `distill.methods` (methods/__init__.py builds them; the config validates each method's section,
`distill.<name>`, against the method's own `Options`). Plain data, here beside the config that names them, so the
config package imports nothing above it. Adding a built-in method or backend is one line here."""

from __future__ import annotations

from importlib import import_module

BACKENDS: dict[str, str] = {
    "hf": "rsiflow.models.hf_backend:HFBackend",
    "vllm": "rsiflow.models.vllm_backend:VLLMBackend",
    "openai": "rsiflow.models.openai_backend:OpenAIBackend",
}

METHODS: dict[str, str] = {
    "exit": "rsiflow.methods.exit.method:ExIt",
    "srd": "rsiflow.methods.srd.method:SRD",
    "grpo": "rsiflow.methods.grpo.method:GRPO",
    "xtree": "rsiflow.methods.xtree.method:XTree",
    "rsipo": "rsiflow.methods.rsipo.method:RSIPO",
    "mass": "rsiflow.methods.mass.method:MASS",
}


def load_plugin(target: str, what: str):
    """The object a "module:Class" string names (`what` says whose, for the error); ValueError if it can't be
    imported."""
    module, _, attr = target.partition(":")
    try:
        obj = getattr(import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {target!r}: {type(e).__name__}: {e}") from None
    return obj
