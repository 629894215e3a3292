"""The explain env: no verifier (never a success, `verifiable` False), a retry for a reply under three words, disjoint
splits, the conformance check (expert and solution skipped: it has none)."""

import pytest

from rsiflow.envs import make_env
from rsiflow.envs.conformance import check_env
from rsiflow.envs.explain import ExplainEnv


def test_explain_passes_conformance():
    report = check_env("explain", tasks=12, seed=0, fuzz=1000)
    assert report.ok, str(report)
    by_name = {r.name: r.status for r in report.results}
    assert by_name["expert"] == by_name["solution"] == "skip" and by_name["rules"] == "pass"


def test_no_reply_is_ever_a_success():
    env = make_env("explain")
    assert env.verifiable is False and ExplainEnv.verifiable is False
    (task,) = env.sample_tasks("train", 1, 0)
    assert env.reset(task).startswith("Explain in one or two sentences")
    short = env.step("Because.")
    assert not short.done and short.info == {"valid": False, "feedback": "too_short"}
    full = env.step("Sunlight scatters off air molecules, and blue light scatters the most.")
    assert full.done and not full.success and full.reward == 0.0 and full.info["valid"]
    assert "no verifier" in " ".join(env.hindsight())


def test_two_short_replies_end_the_episode():
    env = ExplainEnv(max_steps=2)
    env.reset(env.sample_tasks("train", 1, 0)[0])
    env.step("no")
    last = env.step("")
    assert last.done and not last.success and "No replies left" in last.observation


def test_task_types_and_splits():
    env = ExplainEnv(task_types=["compare"])
    train, heldout = env.sample_tasks("train", 30, 1), env.sample_tasks("heldout", 30, 1)
    assert {t.task_type for t in train} == {"compare"}
    assert not {t.spec["question"] for t in train} & {t.spec["question"] for t in heldout}
    with pytest.raises(ValueError, match="task_types"):
        ExplainEnv(task_types=["poem"])
