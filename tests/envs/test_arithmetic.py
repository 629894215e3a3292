"""ArithmeticEnv: exact answers tolerant of formatting, levels, disjoint splits, one-step episodes."""

import random
import re
from fractions import Fraction

import pytest

from rsiflow.envs.arithmetic import LEVELS, ArithmeticEnv, generate_problem, parse_answer


@pytest.mark.parametrize("text, value", [
    ("Answer: 42", 42), ("42", 42), ("42.", 42), ("= 42", 42), ("The answer is 42.", 42), ("answer:42", 42),
    ("6 + 5 = 11, 11 - 2 = 9. Answer: 9", 9), ("7 + 5 = 12", 12), ("Answer: 1,234", 1234), ("Answer: -3", -3),
    ("42.0", 42), ("  Answer: 7  \nmore text 99", 7), ("Answer: 12 because 3 * 4", 12),
])
def test_answers_in_many_formats(text, value):
    assert parse_answer(text) == value


@pytest.mark.parametrize("text", ["", "   ", "no idea", "3.5", "Answer: x", "\x00\u202e", "a" * 100_000 + "5"])
def test_replies_without_an_integer(text):
    assert parse_answer(text) is None


@pytest.mark.parametrize("level", LEVELS)
def test_problems_are_exact_and_expressions_match_their_answers(level):
    rng = random.Random(level)
    n_ops = int(level[-1]) - 1 or 1
    for _ in range(500):
        p = generate_problem(level, rng)
        assert isinstance(p["answer"], int) and p["answer"] >= 0
        assert len(p["steps"]) == n_ops
        assert p["steps"][-1].endswith(f"= {p['answer']}")
        if p["form"] == "expression":
            expression = p["question"].removeprefix("What is ").removesuffix("?")
            assert eval(re.sub(r"(\d+)", r"Fraction(\1)", expression), {"Fraction": Fraction}) == p["answer"]


def test_one_step_episodes_and_a_retry_for_unparseable_replies():
    env = ArithmeticEnv()
    task = env.sample_tasks("train", 1, seed=0)[0]
    assert env.reset(task) == task.spec["question"]
    result = env.step("I am not sure")
    assert (result.done, result.info) == (False, {"valid": False, "feedback": "unparseable"})
    assert "Answer: <integer>" in result.observation
    result = env.step(f"Answer: {task.spec['answer']}")
    assert result.done and result.success and result.reward == 1.0
    env.reset(task)
    result = env.step(f"Answer: {task.spec['answer'] + 1}")
    assert result.done and not result.success and result.reward == 0.0 and result.info["valid"]
    assert any("off by +1" in f for f in env.hindsight())
    assert env.step("Answer: 1").info["feedback"] == "episode_over"


def test_levels_round_robin_and_splits_disjoint():
    env = ArithmeticEnv()
    train = env.sample_tasks("train", 1000, seed=0)
    heldout = env.sample_tasks("heldout", 500, seed=0)
    assert [t.task_type for t in train[:10]] == list(LEVELS) * 2
    assert not {t.spec["question"] for t in train} & {t.spec["question"] for t in heldout}
    assert len({t.spec["question"] for t in heldout}) > 300


def test_levels_kwarg_and_demonstration_format():
    env = ArithmeticEnv(levels=["level2"])
    assert {t.task_type for t in env.sample_tasks("heldout", 10, 1)} == {"level2"}
    for _question, admissible, reply in env.demonstration():
        assert admissible is None and reply.endswith(f"Answer: {parse_answer(reply)}")
    assert "Answer: <integer>" in env.instructions()
    with pytest.raises(ValueError):
        ArithmeticEnv(levels=["level9"])


def test_canonicalize():
    env = ArithmeticEnv()
    assert env.canonicalize("Answer: 42") == "answer<integer>"
    assert env.canonicalize("6 + 5 = 11. Answer: 11") == "answer<working,integer>"
    assert env.canonicalize("hmm") == "invalid<>"


def test_levels_are_the_instances_task_types():
    assert ArithmeticEnv(levels=["level2", "level4"]).task_types == ("level2", "level4")
    assert ArithmeticEnv().task_types == LEVELS


@pytest.mark.parametrize("level", LEVELS)
def test_solution_is_a_worked_reply_and_rules_name_no_number(level):
    env = ArithmeticEnv(levels=[level])
    assert env.solution() is None and env.rules() == []
    for task in env.sample_tasks("train", 20, seed=0):
        env.reset(task)
        (reply,) = env.solution()
        assert reply == f"{', '.join(task.spec['steps'])}. Answer: {task.spec['answer']}"
        assert env.step(reply).success
        rules = env.rules()
        assert rules[-1] == "End the one-line reply with 'Answer: <integer>'; every answer is a whole number."
        assert not any(c.isdigit() for rule in rules for c in rule)
        word = "running total" in rules[0]
        assert word == (task.spec["form"] == "word")
