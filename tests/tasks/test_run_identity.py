"""A run's identity across code versions (tasks/setup.py): a stored config is compared key by key, a key one side
lacks counting as the current default and operational keys ignored, so a config field added to the code (or
removed from it) never makes an existing run refuse to continue; a real change is refused, naming the keys."""

import copy

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.stores import Store
from rsiflow.tasks.setup import check_same_run, config_differences, ensure_run, identity
from tests.conftest import TINY, tiny_overrides


@pytest.fixture
def cfg(tmp_path):
    return load_config([TINY], tiny_overrides(tmp_path))


def test_same_config_has_no_differences(cfg):
    assert config_differences(identity(cfg), cfg) == []


def test_config_stored_by_older_code_continues(cfg):
    # what this session's code changes did to stored configs: sections and fields added (backend.vllm,
    # backend.openai, distill.xtree, gate fields), one removed (prefect.deployment)
    old = copy.deepcopy(identity(cfg))
    for section, key in [("backend", "vllm"), ("backend", "openai"), ("distill", "xtree"), ("gate", "alpha"),
                         ("gate", "max_heldout_tasks")]:
        del old[section][key]
    del old["prefect"]["cron"]
    old["prefect"]["deployment"] = "default"
    assert config_differences(old, cfg) == []
    check_same_run(old, cfg)


def test_added_field_set_away_from_its_default_is_a_difference(cfg, tmp_path):
    old = copy.deepcopy(identity(cfg))
    del old["gate"]["alpha"]
    changed = load_config([TINY], tiny_overrides(tmp_path, "gate.alpha=0.1"))
    assert config_differences(old, changed) == [("gate.alpha", 0.05, 0.1)]


def test_operational_keys_are_not_identity(cfg, tmp_path):
    moved = load_config([TINY], [f"run.store={tmp_path / 'moved.duckdb'}", f"run.run_dir={tmp_path}/elsewhere",
                                 "run.model_cache=/tmp/cache", "run.rounds=9", "prefect.cron=0 * * * *",
                                 "backend.hf.max_batch_size=4", "backend.hf.kv_reuse=false"])
    assert config_differences(identity(cfg), moved) == []


def test_identity_changes_are_listed_with_their_source(cfg, tmp_path):
    changed = load_config([TINY], tiny_overrides(tmp_path, "generate.group_size=3", "env.kwargs={n_receptacles: 3}",
                                                 "distill.methods=[exit, srd]"))
    assert config_differences(identity(cfg), changed) == [
        ("distill.methods", ["exit"], ["exit", "srd"]),
        ("env.kwargs", {"n_receptacles": 2, "n_distractors": 1}, {"n_receptacles": 3}),
        ("generate.group_size", 2, 3),
    ]
    with pytest.raises(ConfigError) as info:
        check_same_run(identity(cfg), changed)
    message = str(info.value)
    assert "\n" not in message
    assert "generate.group_size: 2 (stored) vs 3 (now, from --set generate.group_size=3)" in message
    assert "Use another run.name for a new config, or set these keys back" in message


def test_ensure_run_continues_a_run_stored_by_older_code(cfg, tiny_path):
    """The store's copy of the config lacks today's fields and has a removed one: ensure_run accepts it (before:
    "run 'tiny' already exists with a different config")."""
    old = copy.deepcopy(identity(cfg))
    del old["backend"]["vllm"]
    old["prefect"]["deployment"] = "default"
    with Store(cfg.run.store) as s:
        s.create_run("tiny", "tiny", old, cfg.model.base)
    assert ensure_run(cfg) == "tiny"
    with Store(cfg.run.store, read_only=True) as s:
        assert s.get_run("tiny")["config"] == old      # the stored config is kept as it was
        assert s.completed_steps("tiny", 0) == {"init"}
