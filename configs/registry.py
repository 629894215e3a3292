"""The generation backends by `backend.kind`: "module:Class", imported on first use (a backend may need packages
the others don't). Plain data, here beside the config that names them, so validating `backend.kind` imports no
backend and the config package depends on nothing above it; models/backend.py opens them."""

from __future__ import annotations

BACKENDS: dict[str, str] = {
    "hf": "rsiflow.models.hf_backend:HFBackend",
    "vllm": "rsiflow.models.vllm_backend:VLLMBackend",
    "openai": "rsiflow.models.openai_backend:OpenAIBackend",
}
