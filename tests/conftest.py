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


_migrated: list[Path] = []   # the folder holding a migrated Prefect database, made on first use


def prefect_home(folder: Path) -> str:
    """A new PREFECT_HOME at `folder` for a test's subprocesses, holding a copy of a Prefect database already migrated:
    the temporary API server each `rsiflow` process starts then skips the migrations (on the 2-core EPYC a tiny
    run's server start and first flow took 28.5 s in an empty home, 16.8 s with the copy). The migrated database is
    made once per test process, by `prefect server database upgrade` (~16 s)."""
    import subprocess
    import sys

    if not _migrated:
        template = Path(tempfile.mkdtemp(prefix="rsiflow-test-prefect-migrated-"))
        atexit.register(shutil.rmtree, template, ignore_errors=True)
        env = {**os.environ, "PREFECT_HOME": str(template)}
        env.pop("PREFECT_API_URL", None)
        done = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"], env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"prefect server database upgrade failed ({done.returncode}): {done.stderr[-2000:]}")
        _migrated.append(template)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(_migrated[0] / "prefect.db", folder / "prefect.db")
    return str(folder)


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


# Slow tests CI's slow tier leaves out (`-m "slow and not full"`, .ci/run) to stay within its 45-minute budget on a
# 2-core CPU; the README's test command (`-m "slow or not slow"`) and `pytest -m full` run them. Each is the
# heaviest of its kind or covers a path another CI test also takes; seconds: its time in the slow tier on two
# workers, 2-core AVX2 EPYC, 2026-12-07 (docs/performance.md, "Test suite").
FULL_ONLY = {
    "tests/stores/test_lake.py::test_two_runs_at_once_on_a_lake_match_the_same_runs_on_files":
        "405 s; the Store API, migrations, leases and step writes on a lake stay in CI",
    "tests/flows/test_pooled_round.py::test_a_round_with_its_steps_on_two_process_pools":
        "258 s; deployments on a work pool stay in CI (tests/flows/test_processes.py)",
    "tests/flows/test_ui.py::test_prefect_ui_shows_rounds_history_and_a_failed_step":
        "245 s; a Prefect server, three flow runs and a browser",
    "tests/bench/test_share.py::test_two_rounds_at_once_are_timed_against_one_alone":
        "200 s; a bench's own end-to-end run (four tiny runs); its options are tested in the fast tier",
    "tests/models/test_openai_multi.py::test_two_vllm_servers_share_a_batch_and_survive_one_killed_mid_batch":
        "174 s; a second vllm serve; the same sharing and failover run against stand-in servers in the fast tier",
    "tests/models/test_vllm_backend.py::test_an_engine_killed_parent_leaves_no_process":
        "152 s; an engine of its own, started to be killed",
    "tests/models/test_vllm_backend.py::test_a_call_unwound_by_another_handler_is_not_waited_for_at_shutdown":
        "78 s; engine shutdown paths (with the next two: a new engine after each)",
    "tests/models/test_vllm_backend.py::test_an_interrupt_ends_the_call_in_flight_and_the_next_call_starts_a_new_engine":
        "76 s",
    "tests/models/test_vllm_backend.py::test_shutdown_during_a_generate_call_leaves_no_process": "70 s",
    "tests/bench/test_compare.py::test_a_packed_run_resumes_on_a_fresh_checkout":
        "141 s; packs are tested in the fast tier, a whole comparison stays in CI",
    "tests/bench/test_compare.py::test_a_run_stopped_during_its_final_test_split_plays_it_on_the_next_invocation":
        "94 s",
    "tests/envs/test_conformance.py::test_conformance_of_scienceworld":
        "138 s; the built-in envs' conformance stays in CI",
    "tests/envs/test_env_rounds.py::test_default_round_runs_from_config[scienceworld]":
        "90 s; ScienceWorld episodes and replays stay in CI (tests/envs/test_scienceworld.py)",
    "tests/flows/test_same_figures.py::test_the_same_config_run_twice_leaves_the_same_rows_and_checkpoints[grpo]":
        "136 s; the same check on ExIt stays in CI",
    "tests/models/test_accelerate_train.py::test_grpo_rows_with_riding_rows_two_processes_match_one":
        "109 s; two training processes for SFT and a GRPO round stay in CI",
    "tests/models/test_accelerate_train.py::test_sft_distillation_and_validation_rows_two_processes_match_one":
        "85 s",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Marks `slow` every test that uses the `prefect_api` fixture (it runs a Prefect flow against a
    temporary Prefect server), also where its file has no `@pytest.mark.slow`; marks `full` (and `slow`) the tests
    of FULL_ONLY; puts the tests of VLLM_TEST_FILES in one pytest-xdist group. `tryfirst` runs this before pytest's
    own `-m` selection."""
    for item in items:
        if "prefect_api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        if item.nodeid in FULL_ONLY:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.full)
        if item.path.name in VLLM_TEST_FILES:
            item.add_marker(pytest.mark.xdist_group("vllm"))


# ---- --cpu-durations N: the tests that took the most CPU ------------------------------------------------------------
# On 2 cores with two pytest-xdist workers a test's wall time says little: it stretches with what the other worker
# runs (a tiny round took 57 s alone and 284 s beside a test of four processes). CPU seconds (the worker's, with its
# threads, plus those of every child process it waited for) are what the tier's wall time is made of.

def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that used the most CPU seconds (their process and the child processes "
                          "they waited for, from setup to teardown) and how busy the machine's cores were")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot (Linux), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return sum(fields) - idle, sum(fields)


_cpu_report: dict = {"tests": [], "ticks": None}


def pytest_sessionstart(session):
    if session.config.getoption("--cpu-durations") is not None:
        _cpu_report["ticks"] = _machine_ticks()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.config.getoption("--cpu-durations") is not None:
        item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and _CPU_START in item.stash:
        outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            _cpu_report["tests"].append((cpu, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _cpu_report["tests"]:
        return
    tests = sorted(_cpu_report["tests"], reverse=True)
    write = terminalreporter.write_line
    terminalreporter.section(f"most CPU: {min(n, len(tests)) if n else len(tests)} of {len(tests)} tests")
    for cpu, nodeid in tests[:n or None]:
        write(f"{cpu:8.1f} s cpu  {nodeid}")
    write(f"all tests: {sum(c for c, _ in tests):.1f} s cpu")
    start, end = _cpu_report["ticks"], _machine_ticks()
    if start and end and end[1] > start[1]:
        write(f"the machine's cores were busy {(end[0] - start[0]) / (end[1] - start[1]):.0%} of the session "
              f"({os.cpu_count()} cores)")


_CPU_START = pytest.StashKey[float]()


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
