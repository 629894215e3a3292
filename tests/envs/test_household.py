"""HouseholdEnv: the expert solves everything, bad actions never raise, splits are disjoint and
deterministic, and hindsight/canonical symbols say the right things."""

import random
import re

import pytest

from rsiflow.envs.base import TaskSpec
from rsiflow.envs.household import COMBOS, TASK_TYPES, HouseholdEnv


def _task(task_type="pick_clean_then_place", **goal):
    """A hand-made room: mug 1 in closed cabinet 1, the target cabinet 2 closed, a sink, a desk."""
    spec = {
        "goal": {"text": "put a clean mug in cabinet 2.", "object": "mug", "count": 1,
                 "verb": "clean", "target": "cabinet 2", "lamp": None, **goal},
        "receptacles": [{"name": "cabinet 1", "open": False}, {"name": "cabinet 2", "open": False},
                        {"name": "countertop 1", "open": True}, {"name": "sinkbasin 1", "open": True},
                        {"name": "desk 1", "open": True}],
        "objects": [{"name": "mug 1", "at": "cabinet 1"}, {"name": "apple 1", "at": "countertop 1"}],
        "lamps": [{"name": "desklamp 1", "at": "desk 1"}],
    }
    return TaskSpec(env="household", split="train", task_type=task_type, seed=0, spec=spec)


def _run_expert(env):
    result = None
    while (action := env.expert_action()) is not None:
        result = env.step(action)
        assert result.info["valid"], (action, result.observation)
    return result


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_expert_solves_every_task_within_max_steps(split):
    env = HouseholdEnv()
    for task in env.sample_tasks(split, 60 * len(TASK_TYPES), seed=3):
        env.reset(task)
        result = _run_expert(env)
        assert result.success and result.reward == 1.0 and result.done, task.spec["goal"]["text"]
        assert env._steps <= 11 < env.max_steps


def test_expert_recovers_from_any_state():
    env = HouseholdEnv(max_steps=60)
    rng = random.Random(4)
    for task in env.sample_tasks("train", 120, seed=9):
        env.reset(task)
        for _ in range(rng.randrange(15)):
            if env.step(rng.choice(env.admissible_actions())).done:
                break
        if not env._done:
            assert _run_expert(env).success


def test_reset_states_the_room_and_goal():
    obs = HouseholdEnv().reset(_task())
    assert obs == ("You are in the middle of a room. Looking quickly around you, you see a cabinet 1, "
                   "a cabinet 2, a countertop 1, a desk 1, and a sinkbasin 1.\n\n"
                   "Your task is to: put a clean mug in cabinet 2.")


def test_solution_on_hand_made_task():
    env = HouseholdEnv()
    assert env.solution() is None  # before any reset
    env.reset(_task())
    plan = ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to sinkbasin 1",
            "clean mug 1 with sinkbasin 1", "go to cabinet 2", "open cabinet 2", "put mug 1 in/on cabinet 2"]
    assert env.solution() == plan
    env.step("go to cabinet 1")
    assert env.solution() == plan  # always from the task's start


def test_observations_look_like_alfworld():
    env = HouseholdEnv()
    env.reset(_task())
    assert env.step("go to countertop 1").observation == \
        "You arrive at countertop 1. On the countertop 1, you see a apple 1."
    assert env.step("go to cabinet 1").observation == "You arrive at cabinet 1. The cabinet 1 is closed."
    assert env.step("open cabinet 1").observation == \
        "You open the cabinet 1. The cabinet 1 is open. In it, you see a mug 1."
    assert env.step("take mug 1 from cabinet 1").observation == "You pick up the mug 1 from the cabinet 1."
    assert env.step("inventory").observation == "You are carrying: a mug 1."


@pytest.mark.parametrize("text", ["> Go to Cabinet 1.", "Action: go to cabinet1\nand then open it",
                                  "  GO TO THE CABINET 1  ", "\n\ngo to cabinet 1"])
def test_tolerated_spellings(text):
    env = HouseholdEnv()
    env.reset(_task())
    assert env.step(text).info == {"valid": True, "feedback": "ok"}


@pytest.mark.parametrize("text", ["", "   ", "fly to the moon", "x" * 10_000, "go to \u2603 \x00\x07\u202e",
                                  "take mug from cabinet 1"])
def test_unparseable_actions_get_feedback_and_the_episode_goes_on(text):
    env = HouseholdEnv()
    env.reset(_task())
    result = env.step(text)
    assert result.info == {"valid": False, "feedback": "unparseable"}
    assert result.observation.startswith("Nothing happens. I don't understand")
    assert "go to <receptacle>" in result.observation and len(result.observation) < 400
    assert not result.done
    assert _run_expert(env).success


def test_inadmissible_actions_say_what_is_wrong():
    env = HouseholdEnv()
    env.reset(_task())
    cases = [
        ("take apple 9 from cabinet 1", "You are not at cabinet 1. Go to it first."),
        ("go to cabinet 7", "There is no cabinet 7 in this room."),
        ("put mug 1 in cabinet 2", "You are not carrying mug 1."),
        ("go to cabinet 1", None),
        ("take mug 1 from cabinet 1", "cabinet 1 is closed. Open it first."),
        ("put apple 1 on cabinet 1", "You are not carrying apple 1."),
        ("use desklamp 1", "The desklamp 1 is not here."),
        ("open cabinet 1", None),
        ("open cabinet 1", "cabinet 1 is already open."),
        ("take apple 1 from cabinet 1", "There is no apple 1 in cabinet 1."),
        ("take mug 1 from cabinet 1", None),
        ("clean mug 1 with cabinet 1", "You can't clean things with cabinet 1; use a sinkbasin."),
        ("clean mug 1 with sinkbasin 1", "You are not at sinkbasin 1. Go to it first."),
        ("go to sinkbasin 1", None),
        ("take apple 1 from sinkbasin 1", "You are already carrying mug 1. Put it somewhere first."),
    ]
    for action, expected in cases:
        result = env.step(action)
        if expected is None:
            assert result.info["valid"], (action, result.observation)
        else:
            assert (result.observation, result.info) == (expected, {"valid": False, "feedback": "inadmissible"})
    assert _run_expert(env).success


def test_admissible_actions_are_always_accepted_and_random_play_never_raises():
    env = HouseholdEnv()
    rng = random.Random(0)
    garbage = ["", "look around", "take \u00e9\u00e9 1 from x 1", "put mug 99 in/on cabinet 1"]
    for task in env.sample_tasks("train", 120, seed=1) + env.sample_tasks("heldout", 60, seed=1):
        env.reset(task)
        result = None
        while result is None or not result.done:
            actions = env.admissible_actions()
            assert actions == sorted(actions) and "look" in actions and "inventory" in actions
            action = rng.choice(actions)
            assert env.canonicalize(action) != "invalid<>"
            env.hindsight()
            result = env.step(action)
            assert result.info["valid"], (action, result.observation)
            if not result.done and rng.random() < 0.2:
                result = env.step(rng.choice(garbage))
                assert not result.info["valid"]
        assert env.admissible_actions() == [] and env.expert_action() is None
        assert env.step("look").info["feedback"] == "episode_over"


def test_look_at_obj_in_light_needs_the_object_in_hand():
    env = HouseholdEnv()
    env.reset(_task("look_at_obj_in_light", text="examine the mug with the desklamp.", verb=None,
                    target=None, lamp="desklamp 1"))
    assert not env.step("go to desk 1").done
    assert not env.step("use desklamp 1").done
    for action in ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "use desklamp 1"]:
        result = env.step(action)
    assert not result.info["valid"]
    result = env.step("go to desk 1")
    result = env.step("use desklamp 1")
    assert result.success and result.reward == 1.0 and result.done


def test_pick_two_needs_both_objects_in_the_target():
    env = HouseholdEnv()
    task = _task("pick_two_obj_and_place", text="put two mug in cabinet 2.", verb=None, count=2)
    task.spec["objects"].append({"name": "mug 2", "at": "countertop 1"})
    env.reset(task)
    plan = env.solution()
    assert len(plan) == 10 and plan[-1] == "put mug 1 in/on cabinet 2"
    for action in plan[:-1]:
        assert not env.step(action).done
    assert env.step(plan[-1]).success


def test_max_steps_ends_the_episode_unsolved():
    env = HouseholdEnv(max_steps=3)
    env.reset(_task())
    results = [env.step("look") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert not results[-1].success and results[-1].reward == 0.0


def test_hindsight_of_a_failed_episode():
    env = HouseholdEnv(max_steps=6)
    env.reset(_task())
    for action in ["go to cabinet 1", "take mug 1 from cabinet 1", "blah", "look", "look", "look"]:
        env.step(action)
    facts = env.hindsight()
    assert "mug 1 was in cabinet 1 (closed) at the start." in facts
    assert "The mug must be cleaned with sinkbasin 1 before it is put in cabinet 2." in facts
    assert "You tried to take from cabinet 1 while it was closed." in facts
    assert "You never took a mug." in facts
    assert "1 of your actions were not understood." in facts
    assert "You ran out of steps (6) before finishing." in facts
    assert any(f.startswith("A 8-step solution: go to cabinet 1; open cabinet 1;") for f in facts)


def test_hindsight_names_a_skipped_clean():
    env = HouseholdEnv(max_steps=6)
    env.reset(_task())
    for action in ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to cabinet 2",
                   "open cabinet 2", "put mug 1 in cabinet 2"]:
        result = env.step(action)
    assert result.done and not result.success
    facts = env.hindsight()
    assert "You took mug 1 but never cleaned it with the sinkbasin." in facts
    assert "You put mug 1 in cabinet 2 without cleaning it first." in facts


def test_canonicalize():
    env = HouseholdEnv()
    assert env.canonicalize("go to cabinet 3") == "go<receptacle>"
    assert env.canonicalize("take mug 1 from cabinet 2") == "take<object,receptacle>"
    assert env.canonicalize("put mug 1 in/on shelf 1") == "put<object,receptacle>"
    assert env.canonicalize("put mug 1 on shelf 1") == "put<object,receptacle>"
    assert env.canonicalize("clean mug 1 with sinkbasin 1") == "clean<object,sink>"
    assert env.canonicalize("heat apple 1 with microwave 1") == "heat<object,microwave>"
    assert env.canonicalize("cool apple 1 with fridge 1") == "cool<object,fridge>"
    assert env.canonicalize("use desklamp 1") == "use<lamp>"
    assert env.canonicalize("open fridge 1") == "open<receptacle>"
    assert env.canonicalize("close drawer 2") == "close<receptacle>"
    assert env.canonicalize("examine mug 1") == "examine<object>"
    assert env.canonicalize("examine drawer 2") == "examine<receptacle>"
    assert env.canonicalize("look") == "look<>"
    assert env.canonicalize("> Inventory.") == "inventory<>"
    assert env.canonicalize("fly to the moon") == "invalid<>"


def _combo(task):
    """(task type, object type, target receptacle type or lamp type) of a task."""
    goal = task.spec["goal"]
    return task.task_type, goal["object"], (goal["target"] or goal["lamp"]).rsplit(" ", 1)[0]


def test_heldout_combinations_never_appear_in_train():
    env = HouseholdEnv()
    train = {_combo(t) for t in env.sample_tasks("train", 2000, seed=0)}
    heldout = {_combo(t) for t in env.sample_tasks("heldout", 600, seed=0)}
    assert not train & heldout
    assert {c[0] for c in train} == {c[0] for c in heldout} == set(TASK_TYPES)
    for task_type in TASK_TYPES:
        assert COMBOS["train"][task_type] and COMBOS["heldout"][task_type]
        assert not set(COMBOS["train"][task_type]) & set(COMBOS["heldout"][task_type])


def test_sampling_is_deterministic_and_seeded():
    env = HouseholdEnv()
    first, again = env.sample_tasks("train", 30, seed=5), env.sample_tasks("train", 30, seed=5)
    assert [t.spec for t in first] == [t.spec for t in again]
    assert [t.task_id for t in first] == [t.task_id for t in again]
    assert [t.task_type for t in first[:6]] == list(TASK_TYPES)
    assert [t.spec for t in env.sample_tasks("train", 30, seed=6)] != [t.spec for t in first]
    assert len({t.task_id for t in first}) == 30


def test_reset_rebuilds_a_task_from_its_stored_row():
    env = HouseholdEnv()
    task = env.sample_tasks("heldout", 3, seed=2)[2]
    first = env.reset(task)
    plan = env.solution()
    restored = TaskSpec.from_row(task.to_row())
    assert env.reset(restored) == first and env.solution() == plan


def test_rules_follow_the_layout_and_name_nothing_of_the_task():
    env = HouseholdEnv()
    assert env.rules() == []
    env.reset(_task())
    assert env.rules() == [
        "Clean the object with the sinkbasin while holding it, then put it in the target: putting it there before it "
        "is cleaned does not count.",
        "Objects can be inside closed receptacles: open a closed cabinet, drawer, fridge or microwave to see what is "
        "in it.",
        "Open a closed receptacle before putting anything in it.",
        "Act only where you are: go to a receptacle before opening it, taking from it or putting into it; names "
        "include their number."]
    for task in env.sample_tasks("heldout", 60, seed=0):
        env.reset(task)
        text = " ".join(env.rules())
        assert not re.search(r"[a-z]+ \d", text) and task.spec["goal"]["text"] not in text
