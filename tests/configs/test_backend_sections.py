"""Backend sections in the config: an overlay that switches backend.kind drops the other backends' options
set before it; the same or a later source setting them is still an error naming the key."""

import json

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.models.vllm_backend import reload_compatible

DEFAULT = "configs/default.yaml"


def test_an_overlay_switching_the_kind_drops_earlier_sections():
    cfg = load_config([DEFAULT, "configs/vllm-cpu.yaml"])
    assert cfg.backend.kind == "vllm" and cfg.backend.options()["kv_cache_gib"] == 4
    assert not cfg.backend.hf.model_fields_set  # default.yaml set hf.kv_reuse: dropped by the overlay
    cfg = load_config([DEFAULT], ["backend.kind=openai", "backend.openai.redeploy=vllm_reload"])
    assert cfg.backend.options()["redeploy"] == "vllm_reload"


@pytest.mark.parametrize("overrides", [
    ["backend.vllm.kv_cache_gib=2"],                          # kind stays hf
    ["backend.kind=vllm", "backend.hf.kv_reuse=false"],       # set after the switch
])
def test_another_backends_options_are_refused(overrides):
    with pytest.raises(ConfigError, match=r"backend\.(vllm|hf): options of the"):
        load_config([DEFAULT], overrides)


def test_bounds_and_choices_are_checked():
    with pytest.raises(ConfigError, match="backend.openai.redeploy"):
        load_config([DEFAULT], ["backend.kind=openai", "backend.openai.redeploy=ssh"])
    with pytest.raises(ConfigError, match="backend.vllm.kv_cache_gib"):
        load_config([DEFAULT], ["backend.kind=vllm", "backend.vllm.kv_cache_gib=0"])


def test_gpu_configs_load():
    for name in ("household", "arithmetic"):
        cfg = load_config([f"configs/gpu/{name}.yaml"])
        assert cfg.backend.kind == "vllm" and cfg.model.dtype == "bfloat16"


def test_in_place_reload_needs_the_same_config(tmp_path):
    def ckpt(name, **cfg):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30, **cfg}))
        return str(d)

    a = ckpt("a", _name_or_path="x", transformers_version="5.19")
    assert reload_compatible(a, ckpt("b", _name_or_path="y", transformers_version="5.24"))
    assert not reload_compatible(a, ckpt("c", num_hidden_layers=12))
    assert not reload_compatible(a, str(tmp_path / "missing"))
