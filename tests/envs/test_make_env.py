"""make_env: built-in names, 'module:Class' for user envs, and a helpful error for unknown names."""

import pytest

from rsiflow.envs import Env, EnvError, make_env
from rsiflow.envs.household import HouseholdEnv


def test_builtin_name_passes_kwargs():
    env = make_env("household", n_receptacles=6, max_steps=12)
    assert isinstance(env, HouseholdEnv)
    assert (env.n_receptacles, env.max_steps) == (6, 12)


def test_module_class_form():
    env = make_env("rsiflow.envs.household:HouseholdEnv", n_distractors=0)
    assert isinstance(env, HouseholdEnv) and isinstance(env, Env)
    assert env.n_distractors == 0


def test_module_class_that_is_not_an_env():
    with pytest.raises(EnvError, match="not a subclass"):
        make_env("collections:OrderedDict")
    with pytest.raises(ValueError, match="no attribute"):
        make_env("rsiflow.envs.household:NoSuchEnv")


def test_unknown_name_lists_builtins_and_module_form():
    with pytest.raises(ValueError) as err:
        make_env("alfworld")
    assert "household" in str(err.value) and "module:Class" in str(err.value)
