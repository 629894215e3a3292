"""Config loading: overlays, overrides, and errors that name the key path and the file."""

from pathlib import Path

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.reference import config_reference
from rsiflow.configs.schema import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_configs_validate():
    for f in ("default.yaml", "tiny.yaml"):
        cfg = load_config([REPO / "configs" / f])
        assert isinstance(cfg, Config)
    assert load_config([REPO / "configs" / "default.yaml"]).model.base == "embedded:smollm2-135m-instruct"
    assert load_config([REPO / "configs" / "tiny.yaml"]).model.base.startswith("tiny:")
    for overlay in ("srd.yaml", "grpo.yaml", "grpo-srd.yaml"):   # overlays validate on every base config
        for base in ("default.yaml", "arithmetic.yaml", "tooluse.yaml", "tiny.yaml"):
            load_config([REPO / "configs" / base, REPO / "configs" / overlay])


def test_overlay_and_override_win_in_order(tmp_path):
    base = write(tmp_path, "base.yaml", "train:\n  learning_rate: 1.0e-4\n  epochs: 3\nenv:\n  kwargs: {a: 1}\n")
    over = write(tmp_path, "over.yaml", "train:\n  epochs: 1\nenv:\n  kwargs: {b: 2}\n")
    cfg = load_config([base, over], ["train.batch_size=8", "run.name=exp-1"])
    assert cfg.train.learning_rate == 1e-4      # from base, untouched by the overlay
    assert cfg.train.epochs == 1                # overlay wins
    assert cfg.train.batch_size == 8            # --set wins
    assert cfg.env.kwargs == {"b": 2}           # kwargs is replaced as a whole, not merged
    assert cfg.run_dir == Path("runs/exp-1")


def test_unknown_key_names_path_and_file(tmp_path):
    bad = write(tmp_path, "bad.yaml", "train:\n  learnin_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config([bad])
    assert "train.learnin_rate" in str(e.value) and "unknown key" in str(e.value) and str(bad) in str(e.value)


def test_wrong_type_names_the_file_that_set_it(tmp_path):
    base = write(tmp_path, "base.yaml", "generate:\n  group_size: 4\n")
    over = write(tmp_path, "over.yaml", "generate:\n  group_size: many\n")
    with pytest.raises(ConfigError) as e:
        load_config([base, over])
    msg = str(e.value)
    assert "generate.group_size" in msg and str(over) in msg and str(base) not in msg


def test_override_errors_name_the_override():
    with pytest.raises(ConfigError, match=r"--set gate.rule=sometimes: gate.rule"):
        load_config([], ["gate.rule=sometimes"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config([], ["gate.rule"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config([tmp_path / "nope.yaml"])
    bad = write(tmp_path, "bad.yaml", "train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([bad])
    top = write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config([top])


def test_every_field_has_help():
    rows = config_reference()
    assert len(rows) > 30
    missing = [path for path, _, desc in rows if not desc.strip()]
    assert not missing, f"fields without a description: {missing}"


def test_unknown_env_and_bad_env_kwargs_fail_before_any_work(tmp_path):
    from rsiflow.tasks.setup import check_env_config

    with pytest.raises(ConfigError, match=r"env.name: unknown env 'kitchen'.*household"):
        check_env_config(load_config([], ["env.name=kitchen"]))
    with pytest.raises(ConfigError, match=r"--set env.kwargs.rooms=3: env.kwargs.rooms: .*takes no argument 'rooms'"):
        check_env_config(load_config([], ["env.kwargs.rooms=3"]))
    with pytest.raises(ConfigError, match=r"env.name: .*no_such_module"):
        check_env_config(load_config([], ["env.name=no_such_module:Env"]))


def test_the_configuration_reference_page_is_what_the_schema_says():
    """docs/configuration.md is generated from the schema's help texts: every key has its row, no stale key stays."""
    from rsiflow.configs.reference import PAGE, main

    assert main(["--check"]) == 0, f"{PAGE} is out of date: run python -m rsiflow.configs.reference"
    page = PAGE.read_text()
    table_keys = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    assert table_keys == {path for path, _, _ in config_reference()}


def test_backend_kind_and_its_own_options_section(tmp_path):
    cfg = load_config([], ["backend.hf.kv_reuse=true", "backend.hf.max_batch_size=4"])
    assert cfg.backend.options() == {"dtype": None, "max_batch_size": 4, "kv_reuse": True, "sampler": "full",
                                     "packed_linears": True, "shared_prefix_attention": "auto",
                                     "max_live_episodes": None}
    with pytest.raises(ConfigError, match=r"--set backend.kind=vllmx: backend.*unknown backend 'vllmx'"):
        load_config([], ["backend.kind=vllmx"])
    with pytest.raises(ConfigError, match=r"backend.max_batch_size: unknown key"):
        load_config([], ["backend.max_batch_size=4"])  # hf-only options live in backend.hf now


def test_options_of_another_backend_are_an_error(monkeypatch):
    from rsiflow.models import backend as backends

    monkeypatch.setitem(backends.BACKENDS, "other", "rsiflow.models.hf_backend:HFBackend")
    assert load_config([], ["backend.kind=other"]).backend.options() == {}
    with pytest.raises(ConfigError, match=r"backend.hf: options of the 'hf' backend, but backend.kind is 'other'"):
        load_config([], ["backend.kind=other", "backend.hf.kv_reuse=true"])


def test_unknown_method_fails_before_any_work():
    from rsiflow.tasks.setup import check_methods

    check_methods(load_config([], ["distill.methods=[exit,srd]"]))
    with pytest.raises(ConfigError, match=r"distill.methods.1: unknown method 'mass2'.*exit.*srd"):
        check_methods(load_config([], ["distill.methods=[exit,mass2]"]))
    with pytest.raises(ConfigError, match=r"distill.methods.0: .*no_such_module"):
        check_methods(load_config([], ["distill.methods=[no_such_module:Toy]"]))
