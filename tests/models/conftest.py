import os
from pathlib import Path

import pytest

from models.loading import resolve_base_model


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The shared model cache (RSIFLOW_CACHE or ~/.cache/rsiflow): tiny models are built once and reused."""
    return Path(os.environ.get("RSIFLOW_CACHE", "~/.cache/rsiflow")).expanduser()


@pytest.fixture(scope="session")
def tiny_path(model_cache) -> Path:
    return resolve_base_model("tiny:0", model_cache)
