"""A config error names where the bad value came from: a file, `--set`, or a deployment's parameter."""

import pytest

from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from tests.conftest import TINY


@pytest.mark.parametrize("origin", ["--set", "the deployment's `overrides` parameter"])
def test_an_override_error_names_its_origin_once(origin):
    with pytest.raises(ConfigError) as e:
        load_config([TINY], ["train.learning_rat=1"], origin=origin)
    assert f"{origin} train.learning_rat=1: train.learning_rat: unknown key" in str(e.value)
    assert str(e.value).count(origin) == 1
    with pytest.raises(ConfigError, match=f"^{origin} 'train': expected KEY.PATH=VALUE"):
        load_config([TINY], ["train"], origin=origin)
    cfg = load_config([TINY], ["train.learning_rate=3e-5"], origin=origin)
    assert cfg.source_of("train.learning_rate") == f"{origin} train.learning_rate=3e-5"
