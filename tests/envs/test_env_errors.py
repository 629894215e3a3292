"""Loading an env fails with one EnvError naming the env: a module that raises while imported, a missing module,
kwargs its constructor doesn't take or of the wrong type (checked against its signature, as YAML gives them)."""

import pytest

from rsiflow.envs import EnvError, check_env_kwargs, env_class, make_env


def test_module_that_raises_at_import_names_the_env_and_the_line(tmp_path, monkeypatch):
    (tmp_path / "raising_env.py").write_text("x = 1\nraise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError) as info:
        make_env("raising_env:Env")
    assert str(info.value).startswith("env 'raising_env:Env': importing raising_env raised ImportError: needs libfoo (")
    assert "raising_env.py:2)" in str(info.value)


def test_missing_module_and_a_missing_dependency_of_a_module(tmp_path, monkeypatch):
    with pytest.raises(EnvError, match=r"env 'no_such_env:Env': no module 'no_such_env' on sys.path or in the "
                                       r"current directory"):
        env_class("no_such_env:Env")
    (tmp_path / "needy_env.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvError, match=r"importing needy_env failed: No module named 'no_such_dependency'"):
        env_class("needy_env:Env")


def test_kwargs_are_checked_against_the_constructor():
    check_env_kwargs("household", {"n_receptacles": 3, "max_steps": 10})
    check_env_kwargs("arithmetic", {"levels": ["L1"]})
    with pytest.raises(EnvError) as info:
        check_env_kwargs("household", {"n_receptacles": "4"})
    assert str(info.value) == ("env.kwargs.n_receptacles: '4' (str) is not a valid int for env 'household' "
                               "(HouseholdEnv(n_receptacles: int))")
    with pytest.raises(EnvError, match=r"env.kwargs.rooms: env 'household' \(HouseholdEnv\) takes no argument "
                                       r"'rooms'; it takes n_receptacles, n_distractors, max_steps"):
        check_env_kwargs("household", {"rooms": 3})
