"""Test-session setup: Prefect gets its own home (ephemeral API, no server), no telemetry; tests that
use the Prefect API fixture are marked slow."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_prefect_home = tempfile.mkdtemp(prefix="rsiflow-test-prefect-")
atexit.register(shutil.rmtree, _prefect_home, ignore_errors=True)  # the temp folder holds no leftovers
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
    from rsiflow.models.loading import resolve_base_model

    return resolve_base_model("tiny:0", model_cache)


# Tests that start vLLM engines or servers: under pytest-xdist (`-n 2 --dist loadgroup`, the slow tier in CI) they
# all run in one worker, which starts the session's one engine (`vllm_backend`) and holds its memory.
VLLM_TEST_FILES = {"test_vllm_backend.py", "test_openai_backend.py", "test_openai_multi.py", "test_served_rounds.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks `slow` every test that uses the `prefect_api` fixture (it runs a Prefect flow against a
    temporary Prefect server), also where its file has no `@pytest.mark.slow`, and puts the tests of
    VLLM_TEST_FILES in one pytest-xdist group. `tryfirst` runs this before pytest's own `-m` selection."""
    for item in items:
        if "prefect_api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if item.path.name in VLLM_TEST_FILES:
            item.add_marker(pytest.mark.xdist_group("vllm"))


def vllm_python() -> str | None:
    """The interpreter that runs the vLLM engine here (None = this one), or pytest.skip with the reason."""
    from rsiflow.models.vllm_backend import DEFAULT_PYTHON, vllm_importable

    if vllm_importable():
        return None
    if not DEFAULT_PYTHON.exists():
        pytest.skip(f"vLLM is not installed: neither importable here nor at {DEFAULT_PYTHON} (bash bin/setup-vllm)")
    return str(DEFAULT_PYTHON)


@pytest.fixture(scope="session")
def smollm2_path(model_cache) -> Path:
    """SmolLM2-135M-Instruct as a safetensors checkpoint (converted once from the embedded GGUF)."""
    from rsiflow.models.loading import resolve_base_model

    return resolve_base_model("embedded:smollm2-135m-instruct", model_cache)


@pytest.fixture(scope="session")
def vllm_backend(smollm2_path):
    """The process's one vLLM engine on SmolLM2 (started once per pytest run; engine start is minutes on
    2 cores). Tests may switch its weights; tests/models/test_vllm_backend.py's `vllm` fixture switches back."""
    from rsiflow.configs.loader import load_config
    from rsiflow.models.vllm_backend import VLLMBackend, shutdown_engine

    vllm_python()  # skips, saying why, where vLLM is not installed
    # The options as configs/vllm-cpu.yaml gives them (a float from the config once crashed vLLM's start);
    # enforce_eager: no torch.compile, so the engine starts in ~1 min instead of ~3 on 2 cores.
    cfg = load_config([str(REPO / "configs/default.yaml"), str(REPO / "configs/vllm-cpu.yaml")],
                      ["backend.vllm.kv_cache_gib=2", "backend.vllm.enforce_eager=true"])
    options = cfg.backend.options()
    backend = VLLMBackend.open(smollm2_path, dtype=options.pop("dtype") or cfg.model.dtype, **options)
    yield backend
    shutdown_engine()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def wait_for_server(proc, url: str, log, timeout_s: float = 900) -> None:
    """Wait until the `vllm serve` process `proc` (a Popen) answers GET `url`/models; fail the test with its log's
    tail if it exits or doesn't answer within `timeout_s`."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"vllm serve did not answer within {timeout_s:g} s:\n{log.read_text()[-3000:]}")
        time.sleep(2)


@pytest.fixture(scope="session")
def vllm_server(smollm2_path, tmp_path_factory):
    """A real `vllm serve` of SmolLM2 on a loopback port (started once per pytest run), with the dev endpoints
    rsiflow's `vllm_reload` redeploy uses. Yields its base URL (…/v1)."""
    import subprocess
    import sys

    python = vllm_python() or sys.executable
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    with open(log, "w") as out:
        # `python -m vllm.entrypoints.openai.api_server` is `vllm serve`: vllm-cpu's `vllm` script fails at start
        # (it asks for the version of a distribution named "vllm"; the CPU build's is "vllm-cpu")
        proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(smollm2_path),
                                 "--host", "127.0.0.1", "--port", str(port),
                                 "--served-model-name", "rsiflow", "--dtype", "float32", "--max-model-len", "4096",
                                 "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
                                 "--generation-config", "vllm", "--enforce-eager"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for_server(proc, url, log)
        yield url
    finally:
        import contextlib
        import signal

        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
