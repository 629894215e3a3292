"""A user's mistakes end `rsiflow` in one line on stderr (the cause, the file or --set that set it, what to do),
with the traceback only behind --debug, and nothing written first: each case below printed a traceback, wrote a
run row or created a store before (issue 15, "What failed")."""

import subprocess
import sys
import textwrap

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.flows.cli import main
from rsiflow.methods import Method
from rsiflow.stores import Store
from rsiflow.tasks.setup import identity
from tests.conftest import REPO, TINY, tiny_overrides


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def rsiflow_error(argv: list[str]) -> str:
    """Run `rsiflow argv` in process; return its one-line error (the message of the SystemExit it ends with)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("rsiflow"), message
    assert "\n" not in message, message
    assert "Traceback" not in message
    return message


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store.duckdb"


def run_args(tmp_path, *overrides: str, command: str = "run") -> list[str]:
    return [command, "--config", TINY, *sets(*tiny_overrides(tmp_path), *overrides)]


def test_set_value_that_is_not_yaml(tmp_path, store_path):
    # before: 52 lines of yaml.parser.ParserError
    msg = rsiflow_error(run_args(tmp_path, "train.learning_rate=[1"))
    assert "--set 'train.learning_rate=[1': the value is not valid YAML" in msg
    assert not store_path.exists()


def test_debug_shows_the_traceback(tmp_path):
    from rsiflow.configs.schema import ConfigError

    with pytest.raises(ConfigError):
        main(["run", "--debug", "--config", TINY, *sets(*tiny_overrides(tmp_path), "train.learning_rate=[1")])
    with pytest.raises(ConfigError):
        main(["--debug", "status", "--config", TINY, *sets(*tiny_overrides(tmp_path), "run.name=..")])


@pytest.mark.parametrize("command", ["status", "report"])
def test_read_only_commands_on_a_missing_store_create_nothing(tmp_path, store_path, command):
    # before: status printed a duckdb IOException traceback; report created an empty store and exited 0
    msg = rsiflow_error(run_args(tmp_path, command=command))
    assert f"store {store_path} does not exist" in msg and "rsiflow run" in msg
    assert f"run.store from --set run.store={store_path}" in msg
    assert not store_path.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["status", "report"])
def test_read_only_commands_on_a_store_without_the_run(tmp_path, store_path, command):
    with Store(store_path) as s:
        s.create_run("other", "other", {}, "tiny:0")
    msg = rsiflow_error(run_args(tmp_path, command=command))
    assert f"no run 'tiny' in {store_path} (runs there: other)" in msg


def test_bad_model_base_writes_nothing_and_the_corrected_command_is_accepted(tmp_path, store_path, tiny_path):
    # before: the run's row was written before the model was checked, so the corrected command was refused
    # ("run 'tiny' already exists with a different config")
    msg = rsiflow_error(run_args(tmp_path, "model.base=/nonexistent/model"))
    assert msg.startswith("rsiflow: --set model.base=/nonexistent/model: model.base: ")
    assert "not an HF checkpoint folder" in msg
    assert not store_path.exists()
    from rsiflow.tasks.setup import ensure_run

    cfg = load_config([TINY], tiny_overrides(tmp_path))
    ensure_run(cfg)
    with Store(store_path, read_only=True) as s:
        assert s.get_run("tiny") is not None and s.completed_steps("tiny", 0) == {"init"}


def test_a_checkpoint_without_safetensors_is_refused(tmp_path, store_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    msg = rsiflow_error(run_args(tmp_path, f"model.base={folder}"))
    assert "has no .safetensors weights; rsiflow loads safetensors only" in msg
    assert not store_path.exists()


def test_env_module_that_raises_at_import(tmp_path, store_path, monkeypatch):
    (tmp_path / "broken_env.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = rsiflow_error(run_args(tmp_path, "env.name=broken_env:MyEnv", "env.kwargs={}"))
    assert msg.startswith("rsiflow: --set env.name=broken_env:MyEnv: env.name: env 'broken_env:MyEnv': importing "
                          "broken_env raised RuntimeError: no GPU here")
    assert "broken_env.py:1" in msg
    assert not store_path.exists()


def test_env_constructor_that_raises(tmp_path, store_path, monkeypatch):
    (tmp_path / "picky_env.py").write_text(textwrap.dedent("""
        from rsiflow.envs.household import HouseholdEnv

        class PickyEnv(HouseholdEnv):
            def __init__(self, **kwargs):
                raise OSError("dataset folder /data/missing not found")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = rsiflow_error(run_args(tmp_path, "env.name=picky_env:PickyEnv", "env.kwargs={}"))
    assert "building env 'picky_env:PickyEnv' with {} raised OSError: dataset folder /data/missing not found" in msg
    assert not store_path.exists()


def test_env_kwarg_of_the_wrong_type_names_its_source(tmp_path, store_path):
    # before: "configs/tiny.yaml: env.name: '<' not supported between instances of 'str' and 'int'"
    msg = rsiflow_error(run_args(tmp_path, "env.kwargs.n_receptacles=abc"))
    assert msg == ("rsiflow: --set env.kwargs.n_receptacles=abc: env.kwargs.n_receptacles: 'abc' (str) is not a "
                   "valid int for env 'household' (HouseholdEnv(n_receptacles: int))")
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("env:\n  kwargs: {n_receptacles: 2, n_distractor: 1}\n")
    msg = rsiflow_error(["run", "--config", TINY, "--config", str(overlay), *sets(*tiny_overrides(tmp_path))])
    assert msg.startswith(f"rsiflow: {overlay}: env.kwargs.n_distractor: env 'household' (HouseholdEnv) takes no "
                          "argument 'n_distractor'; it takes n_receptacles, n_distractors, max_steps")
    assert not store_path.exists()


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_rounds_below_one(tmp_path, store_path, rounds):
    # before: --rounds 0 ran a round; --rounds -1 exited 0 (after writing the run)
    msg = rsiflow_error([*run_args(tmp_path), "--rounds", rounds])
    assert msg.startswith(f"rsiflow: --rounds {rounds}: must be at least 1")
    assert not store_path.exists()


@pytest.mark.parametrize("override, expected", [
    ("backend.max_new_tokens=100000000", "backend.max_new_tokens: Input should be less than or equal to 8192"),
    ("env.max_turns=100000", "env.max_turns: Input should be less than or equal to 500"),
    ("generate.tasks_per_round=10000000", "generate.tasks_per_round: Input should be less than or equal to 100000"),
    ("gate.heldout_tasks=10000000", "gate.heldout_tasks: Input should be less than or equal to 100000"),
    ("run.name=..", "run.name: '..' is not a safe run name"),
    ("run.name=a/b", "run.name: 'a/b' is not a safe run name"),
    ("run.name=.hidden", "run.name: '.hidden' is not a safe run name"),
])
def test_sizes_that_would_hang_a_run_and_unsafe_names(tmp_path, store_path, override, expected):
    # before: accepted (max_new_tokens=1e8 took a turn from ~4 s to 141 s+; run.name=.. put the run folder at the
    # repository root)
    msg = rsiflow_error(run_args(tmp_path, override))
    assert msg == f"rsiflow: invalid config: --set {override}: {expected}" or msg.startswith(
        f"rsiflow: invalid config: --set {override}: {expected}")
    assert not store_path.exists()


def test_same_run_name_with_another_config_names_the_keys(tmp_path, store_path):
    # before: "run 'tiny' already exists with a different config" inside a traceback, no key named
    cfg = load_config([TINY], tiny_overrides(tmp_path))
    with Store(store_path) as s:
        s.create_run("tiny", "tiny", identity(cfg), cfg.model.base)
    msg = rsiflow_error(run_args(tmp_path, "generate.tasks_per_round=5", "train.learning_rate=0.01"))
    assert msg.startswith(f"rsiflow: run 'tiny' in {store_path} was created with another config: "
                          "generate.tasks_per_round: 4 (stored) vs 5 (now, from --set generate.tasks_per_round=5); "
                          "train.learning_rate: 0.001 (stored) vs 0.01 (now, from --set train.learning_rate=0.01). "
                          "Use another run.name")


def test_store_paths_that_cannot_hold_a_store(tmp_path):
    (tmp_path / "a_file").write_text("x")
    not_duckdb = tmp_path / "notes.duckdb"
    not_duckdb.write_text("hello")
    under_a_file = tmp_path / "a_file" / "s.duckdb"
    cases = [  # (run.store, command, expected)
        ("/proc/rsiflow.duckdb", "run", "store /proc/rsiflow.duckdb can't be opened or created (DuckDB: IO Error: "
                                        "Cannot open file"),
        ("/proc/rsiflow.duckdb", "status", "store /proc/rsiflow.duckdb does not exist"),
        (under_a_file, "run", f"store {under_a_file}: {tmp_path / 'a_file'} is a file, not a folder"),
        (under_a_file, "status", f"store {under_a_file} does not exist"),
        (not_duckdb, "run", f"store {not_duckdb} is not a DuckDB database"),
        (not_duckdb, "status", f"store {not_duckdb} is not a DuckDB database"),
        (tmp_path, "run", f"store {tmp_path} is a folder"),
        (tmp_path, "status", f"store {tmp_path} is a folder"),
    ]
    for path, command, expected in cases:
        msg = rsiflow_error([command, "--config", TINY, *sets(f"run.store={path}",
                                                              f"run.run_dir={tmp_path}/runs/{{name}}")])
        assert expected in msg and f"(run.store from --set run.store={path})" in msg, msg
    assert not_duckdb.read_text() == "hello"


def test_store_with_a_newer_schema_is_refused_naming_both_versions(tmp_path, store_path):
    # before: a store at schema version 99 was accepted and written to
    from rsiflow.stores.migrations import MIGRATIONS

    with Store(store_path) as s:
        s.con.execute("INSERT INTO schema_migrations VALUES (99, 'from the future', now())")
    newest = max(v for v, _, _ in MIGRATIONS)
    for command in ("run", "status", "report"):
        msg = rsiflow_error(run_args(tmp_path, command=command))
        assert f"store {store_path} has schema version 99, newer than this code's ({newest})" in msg
    import duckdb

    con = duckdb.connect(str(store_path), read_only=True)  # nothing written: no run, no newer migration applied
    assert con.execute("SELECT count(*) FROM runs").fetchall() == [(0,)]
    assert con.execute("SELECT max(version) FROM schema_migrations").fetchall() == [(99,)]
    con.close()


def test_store_locked_by_another_process(tmp_path, store_path, monkeypatch):
    # before: the message was good, the 27-line traceback around it was not
    Store(store_path).close()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time, duckdb
        con = duckdb.connect({str(store_path)!r})
        print("ready", flush=True)
        time.sleep(60)
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        monkeypatch.setattr(Store.__init__, "__defaults__", (False, 0.3, None))  # wait 0.3 s for the lock, not 30
        for command in ("run", "status"):
            msg = rsiflow_error(run_args(tmp_path, command=command))
            assert f"store {store_path} is locked by process {holder.pid} (waited 0.3 s)" in msg
    finally:
        holder.kill()
        holder.wait()


class Crashing(Method):
    """A method whose distill step raises, as a bug or a dead engine would."""
    name = "crashing"

    def distill(self, ctx, inputs):
        raise RuntimeError("engine died\nsecond line of the message")


@pytest.mark.slow
def test_a_failing_step_ends_in_one_line_naming_round_and_step_and_resumes(tmp_path):
    # before: Prefect's 60-line traceback of the flow run, after the task's own logged traceback
    args = run_args(tmp_path, "distill.methods=[tests.flows.test_errors:Crashing]", "prefect.retries=0")
    msg = rsiflow_error([*args, "--rounds", "1"])
    assert msg.startswith("rsiflow run: round 1 of run 'tiny': step distill failed: RuntimeError: engine died;"), msg
    assert "resumes" in msg
    with Store(str(tmp_path / "store.duckdb"), read_only=True) as store:
        assert store.completed_steps("tiny", 1) == {"generate", "evaluate"}
