"""Test-session setup: Prefect gets its own home (ephemeral API, no server), no telemetry; tests that
use the Prefect API fixture are marked slow."""

import os
import tempfile
from pathlib import Path

_prefect_home = tempfile.mkdtemp(prefix="rsiflow-test-prefect-")
os.environ["PREFECT_HOME"] = _prefect_home
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def tiny_overrides(tmp_path: Path, *extra: str) -> list[str]:
    """Overrides that keep a tiny run's store and run folder inside `tmp_path`."""
    return [f"run.store={tmp_path / 'store.duckdb'}", f"run.run_dir={tmp_path / 'runs' / '{name}'}", *extra]


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def prefect_api():
    """A temporary Prefect API for in-process flow runs, stopped cleanly at the end of the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def model_cache() -> Path:
    """The shared model cache (RSIFLOW_CACHE or ~/.cache/rsiflow): tiny models are built once and reused."""
    return Path(os.environ.get("RSIFLOW_CACHE", "~/.cache/rsiflow")).expanduser()


@pytest.fixture(scope="session")
def tiny_path(model_cache) -> Path:
    """The tiny random model of SmolLM2's architecture (`tiny:0`), built once into the model cache."""
    from models.loading import resolve_base_model

    return resolve_base_model("tiny:0", model_cache)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks `slow` every test that uses the `prefect_api` fixture (it runs a Prefect flow against a
    temporary Prefect server), also where its file has no `@pytest.mark.slow`. `tryfirst` runs this
    before pytest's own `-m` selection."""
    for item in items:
        if "prefect_api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
