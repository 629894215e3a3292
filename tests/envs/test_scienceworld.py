"""ScienceWorldEnv: ScienceWorld's own splits, the pooled JVMs (replay when shared, shut down on
close), the gold-path expert, refusals and symbols. Skipped with the reason where the
`scienceworld` package or Java is missing; the parts that need neither always run."""

import pytest

from rsiflow.envs import make_env
from rsiflow.envs.scienceworld import _POOL, normalize_observation, runtime_missing

needs_runtime = pytest.mark.skipif(bool(runtime_missing()), reason=f"ScienceWorld can't run here: {runtime_missing()}")
SHORT = ["find-non-living-thing", "lifespan-longest-lived"]


def test_missing_java_is_a_clear_error(monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    if runtime_missing() and "package" in runtime_missing():
        with pytest.raises(RuntimeError, match="optional 'scienceworld' package"):
            make_env("scienceworld")
    else:
        with pytest.raises(RuntimeError, match="needs a Java runtime"):
            make_env("scienceworld")


def test_bad_kwargs_are_refused_before_any_jvm_starts():
    with pytest.raises(ValueError, match="unknown task names"):
        make_env("scienceworld", task_names=["make-coffee"])
    with pytest.raises(ValueError, match="heldout"):
        make_env("scienceworld", heldout="validation")


def test_observations_are_normalized_to_one_order():
    a = ("This room is called the kitchen. In it, you see: \n\tthe agent\n\ta table. On the table is: a jug "
         "(containing nothing), a cup (containing water, sugar).\n\ta fridge\n\t\ta milk\nYou also see:\n\tA door")
    b = ("This room is called the kitchen. In it, you see: \n\ta fridge\n\t\ta milk\n\ta table. On the table is: "
         "a cup (containing water, sugar), a jug (containing nothing).\n\tthe agent\nYou also see:\n\tA door")
    assert normalize_observation(a) == normalize_observation(b)
    assert normalize_observation(a).splitlines()[0] == "This room is called the kitchen. In it, you see: "


@needs_runtime
@pytest.mark.slow
def test_splits_come_from_scienceworld_train_dev_test():
    env = make_env("scienceworld", task_names=SHORT)
    try:
        train = env.sample_tasks("train", 40, seed=0)
        dev = env.sample_tasks("heldout", 40, seed=0)
        test_env = make_env("scienceworld", task_names=SHORT, heldout="test")
        test = test_env.sample_tasks("heldout", 40, seed=0)
        test_env.close()
        assert [t.task_type for t in train[:4]] == SHORT * 2
        assert {t.spec["source"] for t in train} == {"train"} and {t.spec["source"] for t in dev} == {"dev"}
        assert {t.spec["source"] for t in test} == {"test"}
        for task_name in SHORT:
            variations = [{t.spec["variation"] for t in ts if t.task_type == task_name} for ts in (train, dev, test)]
            assert not variations[0] & variations[1] and not variations[1] & variations[2]
            assert not variations[0] & variations[2]
    finally:
        env.close()


@needs_runtime
@pytest.mark.slow
def test_expert_solves_and_hindsight_has_the_gold_path():
    env = make_env("scienceworld", task_names=SHORT, max_steps=40)
    try:
        for task in env.sample_tasks("heldout", 2, seed=3):
            obs = env.reset(task)
            assert obs.startswith("Your task is to")
            while (action := env.expert_action()) is not None:
                result = env.step(action)
                assert result.info["valid"], (action, result.observation)
            assert result.success and result.done and result.reward > 0
            facts = env.hindsight()
            assert any(f.startswith("A ") and "-step solution: " in f for f in facts)
            assert "Score reached: 100/100" in " ".join(facts)
    finally:
        env.close()


@pytest.mark.slow
@needs_runtime
def test_more_episodes_than_jvms_replay_to_the_same_results():
    """Three lockstep episodes on one JVM give exactly what three episodes in turn give."""
    sampler = make_env("scienceworld", task_names=SHORT)
    task = sampler.sample_tasks("train", 1, seed=5)[0]
    sampler.close()
    actions = ["look around", "teleport to kitchen", "look around", "pick up thermometer", "inventory"]

    def play(interleaved: bool) -> list[list[str]]:
        envs = [make_env("scienceworld", task_names=SHORT, max_jvms=1) for _ in range(3)]
        try:
            logs = [[e.reset(task)] for e in envs]
            order = ([(a, i) for a in actions for i in range(3)] if interleaved
                     else [(a, i) for i in range(3) for a in actions])
            for action, i in order:
                logs[i].append(envs[i].step(action).observation)
            assert len(_POOL.sims) == 1
            return logs
        finally:
            for e in envs:
                e.close()

    sequential, lockstep = play(False), play(True)
    assert lockstep == sequential
    assert _POOL.sims == []   # the last close shut the JVM down


@needs_runtime
@pytest.mark.slow
def test_refusals_never_reach_or_break_the_simulator():
    env = make_env("scienceworld", task_names=SHORT)
    try:
        env.reset(env.sample_tasks("train", 1, seed=0)[0])
        cases = [("", "unparseable", "no command"), ("x" * 300, "unparseable", "too long"),
                 ("reset task", "inadmissible", "disabled"), ("fly to the moon", "unparseable", "No known action"),
                 ("\x00\u202e\ud800 look", "ok", None)]
        for action, feedback, words in cases:
            result = env.step(action)
            assert result.info["feedback"] == feedback and not result.done, (action, result.observation)
            assert words is None or words in result.observation
        assert env.canonicalize("move metal pot to chair") == "move<object,container>"
        assert env.canonicalize("focus on banana") == "focus<object>"
        assert env.canonicalize("reset task") == "invalid<>" and env.canonicalize("") == "invalid<>"
    finally:
        env.close()
    processes = [s.sim._gateway.java_process for s in _POOL.sims]
    assert processes == []


@pytest.mark.slow
@needs_runtime
def test_solution_is_the_gold_path_without_ambiguity_choices_and_rules_name_the_family():
    env = make_env("scienceworld", task_names=["find-plant", "mendelian-genetics-known-plant"], max_steps=200)
    try:
        assert env.task_types == ("find-plant", "mendelian-genetics-known-plant")
        find, genetics = env.sample_tasks("train", 2, seed=0)
        env.reset(find)
        plan = env.solution()
        assert plan == [a for a in env._gold() if not a.isdigit()]
        for action in plan:
            result = env.step(action)
        assert result.done and result.success
        assert env.rules()[0].startswith("Find a thing of the kind the task names")
        env.reset(genetics)
        assert any(a.isdigit() for a in env._gold()) and not any(a.isdigit() for a in env.solution())
        assert env.rules()[0].startswith("Plant seeds of both parents")
    finally:
        env.close()
