"""The conformance check passes on every built-in env and on the bring-your-own example, fuzzing
included (thousands of random and hostile actions each), and it catches a broken env: a rare
expert bug at the default task count, a wrong solution, a task that needs more turns than the
config gives, an env call that hangs, bad rules, tool schemas or task types."""

import os
import random
import time

import pytest

from rsiflow.envs import BUILTIN_ENVS, LAZY_ENVS
from rsiflow.envs.base import Env, StepResult
from rsiflow.envs.conformance import DEFAULT_TASKS, CallTimedOut, check_env, hostile_actions, main, time_limit
from rsiflow.envs.household import HouseholdEnv, _kind
from rsiflow.envs.scienceworld import runtime_missing
from rsiflow.envs.tooluse import ToolUseEnv

PLAIN = sorted(BUILTIN_ENVS) + ["examples.countdown_env:CountdownEnv"]
SW_KWARGS = {"task_names": ["find-non-living-thing", "find-plant", "lifespan-longest-lived", "power-component"]}


@pytest.mark.parametrize("env", PLAIN)
def test_conformance_of_plain_python_envs(env):
    report = check_env(env, tasks=12, seed=0, fuzz=3000)
    assert report.ok, str(report)
    by_name = {r.name: r for r in report.results}
    assert by_name["fuzz"].status == "pass" and "3000 actions, none raised" in by_name["fuzz"].detail
    if env == "explain":   # no verifier: no expert, no solution
        assert by_name["expert"].status == by_name["solution"].status == "skip"
    else:
        assert by_name["expert"].status == "pass" and "solved 24/24" in by_name["expert"].detail
        assert by_name["solution"].status == "pass" and "solved 24/24" in by_name["solution"].detail
    assert by_name["rules"].status == "pass"
    assert by_name["tools"].status == ("pass" if env == "tooluse" else "skip")
    assert by_name["max_turns"].status == "skip"   # no turn limit given


@pytest.mark.slow
def test_conformance_of_scienceworld():
    if reason := runtime_missing():
        pytest.skip(f"ScienceWorld can't run here: {reason}")
    # Each action sent to ScienceWorld costs 30-50 ms, so the suite fuzzes it with 400 (by hand:
    # rsiflow check-env scienceworld --fuzz 3000).
    report = check_env("scienceworld", SW_KWARGS, tasks=4, seed=0, fuzz=400)
    assert report.ok, str(report)
    by_name = {r.name: r for r in report.results}
    assert "400 actions, none raised" in by_name["fuzz"].detail
    assert "solved 8/8" in by_name["expert"].detail and "solved 8/8" in by_name["solution"].detail


def test_every_builtin_is_covered():
    assert set(BUILTIN_ENVS) | set(LAZY_ENVS) == {"household", "arithmetic", "tooluse", "explain", "scienceworld"}


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


class _ShortSolution(HouseholdEnv):
    def solution(self):
        return super().solution()[:-1]


class _RestatingRules(HouseholdEnv):
    def rules(self):
        return [f"Do this: {self._goal['text']}"]


class _UndeclaredSchema(ToolUseEnv):
    def tools(self):
        tools = super().tools()
        del tools[0]["function"]["parameters"]["type"]
        return tools


class _ExtraTaskType(HouseholdEnv):
    task_types = HouseholdEnv.task_types + ("make_coffee",)


class _ListTaskTypes(HouseholdEnv):
    def __init__(self):
        super().__init__()
        self.task_types = list(HouseholdEnv.task_types)


@pytest.mark.parametrize("cls, check, words", [
    (_Raises, "fuzz", "raised ValueError"),
    (_NoFeedback, "reset_step", "info needs 'valid'"),
    (_Nondeterministic, "determinism", "different results"),
    (_OverlappingSplits, "splits", "in both train and heldout"),
    (_ShortSolution, "solution", "the episode did not end after"),
    (_RestatingRules, "rules", "restates the task"),
    (_UndeclaredSchema, "tools", "parameters must be a JSON schema"),
    (_ExtraTaskType, "splits", "never gave the declared task types ['make_coffee']"),
    (_ListTaskTypes, "class", "must be a non-empty tuple of str"),
])
def test_a_broken_env_fails_the_right_check(cls, check, words):
    report = check_env(cls, tasks=8, fuzz=200)
    assert not report.ok
    result = {r.name: r for r in report.results}[check]
    assert result.status == "fail" and words in result.detail, str(report)


def test_cli_exit_codes(capsys):
    assert main(["examples.countdown_env:CountdownEnv", "--tasks", "4", "--fuzz", "100"]) == 0
    assert "conformance of examples.countdown_env:CountdownEnv: PASS" in capsys.readouterr().out
    assert main(["tests.envs.test_conformance:_Raises", "--tasks", "4", "--fuzz", "100"]) == 1


class _SpareObjectBug(HouseholdEnv):
    """An expert bug that shows only on pick-two tasks with a spare third object: none among the first
    12 tasks of either split at seed 0, 7 among the first 100."""

    def expert_action(self):
        goal = self._goal
        if (self._task.task_type == "pick_two_obj_and_place" and not self._done
                and sum(_kind(o) == goal["object"] for o in self._where) == 3):
            return "inventory"
        return super().expert_action()


def test_the_default_task_count_finds_a_rare_expert_bug_and_names_its_last_actions():
    assert DEFAULT_TASKS >= 100
    assert check_env(_SpareObjectBug, tasks=12, fuzz=100).ok   # the old default missed it
    report = check_env(_SpareObjectBug, fuzz=100)
    expert = {r.name: r for r in report.results}["expert"]
    assert expert.status == "fail" and "the expert failed 7/200 tasks" in expert.detail
    assert "last actions: 'inventory', 'inventory', 'inventory' (of 25)" in expert.detail
    assert "last observation: 'You are not carrying anything. You have used all 25 steps" in expert.detail


def test_max_turns_fails_the_tasks_whose_expert_needs_more_steps(tmp_path, capsys):
    report = check_env("household", tasks=12, fuzz=100, max_turns=6)
    result = {r.name: r for r in report.results}["max_turns"]
    assert result.status == "fail" and "needs more than env.max_turns = 6 steps" in result.detail
    assert "(expert 7, solution 7 steps)" in result.detail
    assert {r.name: r for r in check_env("household", tasks=12, fuzz=100, max_turns=11).results}[
        "max_turns"].status == "pass"
    # the same from a config: env.name, env.kwargs and env.max_turns
    config = tmp_path / "run.yaml"
    config.write_text("env:\n  name: household\n  kwargs: {n_receptacles: 2}\n  max_turns: 6\n")
    assert main(["--config", str(config), "--tasks", "12", "--fuzz", "100"]) == 1
    out = capsys.readouterr().out
    assert 'conformance of household (kwargs {"n_receptacles": 2}; 12 tasks per split' in out
    assert "FAIL  max_turns" in out and "env.max_turns = 6 steps" in out
    assert main(["--config", str(config), "--tasks", "12", "--fuzz", "100", "--max-turns", "11"]) == 0


class _HangsOnNul(HouseholdEnv):
    """A step that never returns on a NUL byte (a game engine waiting on a pipe that never answers)."""

    def step(self, action):
        if "\x00" in action:
            read_end, write_end = os.pipe()
            try:
                os.read(read_end, 1)
            finally:
                os.close(read_end)
                os.close(write_end)
        return super().step(action)


def test_a_hanging_step_fails_its_check_and_the_rest_run_on_a_fresh_instance():
    seen = []
    start = time.monotonic()
    report = check_env(_HangsOnNul, tasks=6, fuzz=200, step_timeout=0.5, on_result=seen.append)
    assert time.monotonic() - start < 30
    fuzz = {r.name: r for r in report.results}["fuzz"]
    assert fuzz.status == "fail" and "step('\\x00') did not return within 0.5 s" in fuzz.detail
    assert "last actions:" in fuzz.detail and "a fresh instance" in fuzz.detail
    assert [r.name for r in report.results][-1] == "close" and report.results[-1].status == "pass"
    assert seen == report.results   # every result was handed over as it came


class _Spy(HouseholdEnv):
    reported: list = []
    results: list = []

    def hindsight(self):
        self.reported.append(len(self.results))
        return super().hindsight()


def test_each_result_is_reported_when_its_check_finishes():
    # in this process (no time limit: no watching child), so the env sees what on_result was handed
    report = check_env(_Spy, tasks=6, fuzz=50, step_timeout=None, on_result=_Spy.results.append)
    assert report.ok
    order = [r.name for r in report.results]
    assert min(_Spy.reported) == order.index("hindsight")   # the checks before it were out already


def test_time_limit_restores_an_outer_alarm():
    with pytest.raises(CallTimedOut, match="outer did not return within 0.3 s"):
        with time_limit(0.3, "outer"):
            with time_limit(5, "inner"):
                pass
            time.sleep(2)


def test_the_contract_defaults():
    assert Env.admissible_exact is True and HouseholdEnv.admissible_exact is True

    class Bare(Env):
        name = "bare"
        task_types = ("one",)
        sample_tasks = reset = step = hindsight = canonicalize = instructions = lambda self, *a: None

    bare = Bare()
    assert bare.solution() is None and bare.rules() == [] and bare.tools() is None


class _OverGenerates(HouseholdEnv):
    """Lists one action too many: refused when played."""

    admissible_exact = False

    def admissible_actions(self):
        return super().admissible_actions() + ["go to garage 9"]


def test_admissible_exact_is_read_from_the_env():
    by_name = {r.name: r for r in check_env(_OverGenerates, tasks=6, fuzz=100).results}
    assert by_name["admissible"].status == "pass" and "admissible_exact = False" in by_name["admissible"].detail

    class Exact(_OverGenerates):
        admissible_exact = True

    by_name = {r.name: r for r in check_env(Exact, tasks=6, fuzz=100).results}
    assert by_name["admissible"].status == "fail" and "'go to garage 9' was rejected" in by_name["admissible"].detail


def test_task_types_are_read_from_the_instance():
    report = check_env("tooluse", {"task_types": ["calc", "compare"]}, tasks=6, fuzz=100)
    assert report.ok, str(report)
    assert "2 task types" in report.results[0].detail


class _RepeatsATask(HouseholdEnv):
    """A fixed pool's way past its size: the last task repeats the first, task id included."""

    def sample_tasks(self, split, n, seed):
        tasks = super().sample_tasks(split, n, seed)
        return tasks[:-1] + tasks[:1]


def test_a_repeated_task_id_fails_the_splits_and_the_later_checks_still_play_every_task():
    by_name = {r.name: r for r in check_env(_RepeatsATask, tasks=8, fuzz=100).results}
    splits = by_name["splits"]
    assert splits.status == "fail"
    assert ("sample_tasks('train', 8, 0) gave 8 tasks with only 7 distinct task ids; repeated: household-"
            in splits.detail)
    assert "(x2)" in splits.detail and "give each repeat its own id" in splits.detail
    assert "expert solved 16/16" in by_name["expert"].detail
    assert "solution() solved 16/16" in by_name["solution"].detail and "None" not in by_name["solution"].detail
