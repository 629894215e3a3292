"""The conformance check passes on every built-in env and on the bring-your-own example, fuzzing
included (thousands of random and hostile actions each), and it catches a broken env."""

import random

import pytest

from envs import BUILTIN_ENVS, LAZY_ENVS
from envs.base import StepResult
from envs.conformance import check_env, hostile_actions, main
from envs.household import HouseholdEnv
from envs.scienceworld import runtime_missing

PLAIN = sorted(BUILTIN_ENVS) + ["examples.countdown_env:CountdownEnv"]
SW_KWARGS = {"task_names": ["find-non-living-thing", "find-plant", "lifespan-longest-lived", "power-component"]}


@pytest.mark.parametrize("env", PLAIN)
def test_conformance_of_plain_python_envs(env):
    report = check_env(env, tasks=12, seed=0, fuzz=3000)
    assert report.ok, str(report)
    by_name = {r.name: r for r in report.results}
    assert by_name["fuzz"].status == "pass" and "3000 actions, none raised" in by_name["fuzz"].detail
    assert by_name["expert"].status == "pass" and "solved 24/24" in by_name["expert"].detail


@pytest.mark.slow
def test_conformance_of_scienceworld():
    if reason := runtime_missing():
        pytest.skip(f"ScienceWorld can't run here: {reason}")
    # Each action sent to ScienceWorld costs 30-50 ms, so the suite fuzzes it with 1000 (by hand:
    # python -m envs.conformance scienceworld --fuzz 3000).
    report = check_env("scienceworld", SW_KWARGS, tasks=4, seed=0, fuzz=1000)
    assert report.ok, str(report)
    by_name = {r.name: r for r in report.results}
    assert "1000 actions, none raised" in by_name["fuzz"].detail
    assert "solved 8/8" in by_name["expert"].detail


def test_every_builtin_is_covered():
    assert set(BUILTIN_ENVS) | set(LAZY_ENVS) == {"household", "arithmetic", "tooluse", "scienceworld"}


def test_hostile_actions_are_many_and_varied():
    actions = hostile_actions(3000, 0, ["go to cabinet 1", "answer(value=3)"])
    assert len(actions) == 3000
    assert "" in actions and any(len(a) >= 100_000 for a in actions) and any("\x00" in a for a in actions)
    assert any(not a.isascii() for a in actions) and any("cabinet" in a for a in actions)


class _Raises(HouseholdEnv):
    def step(self, action):
        if not action.strip():
            raise ValueError("empty action")
        return super().step(action)


class _NoFeedback(HouseholdEnv):
    def step(self, action):
        result = super().step(action)
        return StepResult(result.observation, result.reward, result.done, result.success, {})


class _Nondeterministic(HouseholdEnv):
    def reset(self, task):
        return super().reset(task) + f" ({random.random()})"


class _OverlappingSplits(HouseholdEnv):
    def sample_tasks(self, split, n, seed):
        super().sample_tasks(split, 0, seed)   # unknown splits still raise
        return [t.__class__(t.env, split, t.task_type, t.seed, t.spec) for t in super().sample_tasks("train", n, seed)]


@pytest.mark.parametrize("cls, check, words", [
    (_Raises, "fuzz", "raised ValueError"),
    (_NoFeedback, "reset_step", "info needs 'valid'"),
    (_Nondeterministic, "determinism", "different results"),
    (_OverlappingSplits, "splits", "in both train and heldout"),
])
def test_a_broken_env_fails_the_right_check(cls, check, words):
    report = check_env(cls, tasks=6, fuzz=200)
    assert not report.ok
    result = {r.name: r for r in report.results}[check]
    assert result.status == "fail" and words in result.detail, str(report)


def test_cli_exit_codes(capsys):
    assert main(["examples.countdown_env:CountdownEnv", "--tasks", "4", "--fuzz", "100"]) == 0
    assert "conformance of examples.countdown_env:CountdownEnv: PASS" in capsys.readouterr().out
    assert main(["tests.envs.test_conformance:_Raises", "--tasks", "4", "--fuzz", "100"]) == 1
