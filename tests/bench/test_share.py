"""bench.share on the tiny model: one round alone, then two at once under each policy, every run completing, with
a slowdown per process against the alone run; a failing run names its log."""

import json

import pytest

from bench.share import main
from tests.conftest import TINY


@pytest.mark.slow
def test_two_rounds_at_once_are_timed_against_one_alone(tmp_path, capsys, model_cache):
    out = tmp_path / "share.json"
    assert main(["--config", TINY, "--set", f"run.model_cache={model_cache}", "--policy", "1+passive",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["alone_s"] > 0 and set(result["pairs"]) == {"1+passive"}
    if result["cores"] > 1:  # the floor: one round alone on half the cores
        assert result["alone_share_s"]["threads"] == result["cores"] // 2
    pair = result["pairs"]["1+passive"]
    assert pair["omp_wait_policy"] == "PASSIVE" and len(pair["wall_s"]) == 2 and all(s > 0 for s in pair["slowdown"])
    assert "two at once, run.threads=1 OMP_WAIT_POLICY=PASSIVE (1+passive)" in capsys.readouterr().out


def test_a_failing_run_names_its_log(tmp_path, model_cache):
    with pytest.raises(SystemExit, match=r"run alone failed .*alone\.log"):
        main(["--config", TINY, "--set", f"run.model_cache={model_cache}", "--set", "env.name=nosuchpackage.mod:Env",
              "--policy", "auto"])


def test_policy_options_set_the_openmp_environment():
    from bench.share import _policy

    assert _policy("auto", 2) == ("auto", {})
    assert _policy("cores+passive", 2) == ("2", {"OMP_WAIT_POLICY": "PASSIVE"})
    assert _policy("1+spin=10000", 2) == ("1", {"GOMP_SPINCOUNT": "10000"})
    with pytest.raises(SystemExit, match="unknown policy option 'spin=x'"):
        _policy("auto+spin=x", 2)
