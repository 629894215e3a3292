"""SRD's plain-Python parts: failure kinds, note prompts, the template writer, note cleaning, and
where the privileged text goes (the teacher's user turn only)."""

import re

import pytest

from rsiflow.envs import make_env
from rsiflow.envs.rollout import prompt_prefix, render_observation
from rsiflow.methods.srd.algorithm import (
    FORESIGHT_REQUEST,
    PRIVILEGED_HEADER,
    Attempt,
    Note,
    action_pair,
    clean_note,
    failure_kind,
    first_divergence,
    foresight_pair,
    knowledge_note_messages,
    pitfall_note_messages,
    template_note,
    with_privileged,
)


def play_attempt(env, task, actions, max_turns=8, status="failure", with_contract=True):
    """An Attempt of `actions` on `task`, played in `env`; with `with_contract`, the env's solution()
    and rules() taken right after reset, as methods/srd/method.py does."""
    first = env.reset(task)
    solution, rules = (env.solution(), env.rules()) if with_contract else (None, [])
    obs, valid, feedback = [], [], []
    for a in actions:
        r = env.step(a)
        obs.append(r.observation)
        valid.append(bool(r.info.get("valid", True)))
        feedback.append(r.info.get("feedback", "ok"))
    return Attempt(traj_id="r/t0", group_id="g0", task_id=task.task_id, task_text=first, actions=list(actions),
                   observations=obs[:-1], valid=valid, feedback=feedback, hindsight=env.hindsight(), success=False,
                   status=status, n_turns=len(actions), max_turns=max_turns, solution=solution, rules=rules)


def household_attempt(actions, max_turns=8, status="failure", seed=2, with_contract=True):
    env = make_env("household", n_receptacles=2, n_distractors=1)
    task = env.sample_tasks("train", 3, 0)[seed]
    return play_attempt(env, task, actions, max_turns, status, with_contract), env, task


def test_failure_kinds():
    a, _, _ = household_attempt(["fly", "jump", "look"])
    assert failure_kind(a) == "invalid_action"
    a, _, _ = household_attempt(["look", "inventory", "look"], max_turns=3)
    assert failure_kind(a) == "timeout"
    a, _, _ = household_attempt(["look"], max_turns=3)
    assert failure_kind(a) == "wrong_result"
    a, _, _ = household_attempt(["look"], status="error")
    assert failure_kind(a) == "crash"


def test_pitfall_prompt_carries_task_attempt_hindsight_kind_and_feedback():
    a, _, _ = household_attempt(["fly", "go to sinkbasin 1", "jump"])
    msgs = pitfall_note_messages(a)
    user = msgs[-1]["content"]
    assert a.task_text.strip() in user and "1. fly  [unparseable]" in user and "2. go to sinkbasin 1" in user
    assert "Failure kind: invalid_action" in user
    assert 'I don\'t understand "fly"' in user             # the env's feedback
    assert all(f"- {h}" in user for h in a.hindsight)      # the privileged truth
    # the worked example comes first, as an earlier exchange in the note format
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"].startswith("Error:")
    plain = pitfall_note_messages(a, few_shot=False)
    assert plain[-1] == msgs[-1] and len(plain) == 2
    assert "successful attempt" in knowledge_note_messages(a)[-1]["content"]


def test_template_writer_builds_a_usable_note_from_the_env_contract():
    a, env, _ = household_attempt(["look", "inventory"], max_turns=2)
    text = template_note(a)
    cleaned, usable = clean_note(text)
    assert usable and cleaned == text
    assert text.splitlines() == ["Error: the turn limit (2) ran out before the task was done.",
                                 "Rule: " + " ".join(env.rules()[:3]),
                                 "Example: " + env.solution()[0]]   # "look" already left the solution
    assert not any(h in text for h in a.hindsight)   # hindsight may state the task and its answer: never used


def test_template_writer_without_solution_or_rules_writes_a_generic_rule_and_no_example():
    a, _, _ = household_attempt(["fly", "jump", "look"], with_contract=False)
    text = template_note(a)
    assert text.splitlines() == ['Error: 2 of 3 actions were not valid (e.g. "fly": unparseable).',
                                 "Rule: reply with exactly one action in the format the instructions give."]
    assert clean_note(text) == (text, True)
    knowledge = template_note(a, "knowledge")
    assert knowledge == "Knowledge: follow the task statement step by step.\nDetails: fly; jump; look"
    assert clean_note(knowledge, "knowledge")[1]


def test_first_divergence():
    plan = ["go to desk 1", "take pen 1 from desk 1", "go to shelf 1"]
    assert first_divergence(["Go to desk 1.", "take pen 2 from desk 1"], plan) == 1
    assert first_divergence(["look"], plan) == 0
    assert first_divergence(["go to desk 1"], plan) == 1            # followed it as far as it went
    assert first_divergence(plan + ["look"], plan) == 3


def _numbered_names(spec):
    return [r["name"] for r in spec["receptacles"]] + [o["name"] for o in spec["objects"]] + \
        [lamp["name"] for lamp in spec["lamps"]]


# Per built-in env: a task, an attempt that follows the solution for `k` actions and then goes wrong
# (by a function of the solution), the task's statement and the literal answers the Rule must not hold.
CASES = {
    "household": (("household", {"n_receptacles": 2, "n_distractors": 1}), 2, 2,
                  lambda sol: sol[:2] + ["fly", "look"],
                  lambda task, first: task.spec["goal"]["text"], lambda task: _numbered_names(task.spec)),
    "arithmetic": (("arithmetic", {}), 2, 0, lambda sol: ["Answer: 1000003"],
                   lambda task, first: task.spec["question"],
                   lambda task: [str(task.spec["answer"])] + task.spec["steps"]),
    "tooluse": (("tooluse", {}), 2, 1, lambda sol: sol[:1] + ["answer(value=1000003)"],
                lambda task, first: task.spec["question"],
                lambda task: [str(task.spec["answer"]), task.spec["expression"]]
                + [str(task.spec["table"][i]) for i in task.spec["lookups"]]),
    "countdown": (("examples.countdown_env:CountdownEnv", {}), 1, 0, lambda sol: ["1 + 1", "2 + 2"],
                  lambda task, first: first, lambda task: [task.spec["solution"], str(task.spec["target"])]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_rule_holds_no_statement_or_answer_and_the_example_is_the_solutions_next_action(case):
    (name, kwargs), task_index, k, attempt_of, statement_of, answers_of = CASES[case]
    env = make_env(name, **kwargs)
    task = env.sample_tasks("train", 3, 0)[task_index]
    first = env.reset(task)
    solution = env.solution()
    a = play_attempt(env, task, attempt_of(solution))
    assert a.solution == solution and a.rules
    lines = template_note(a).splitlines()
    rule = next(line for line in lines if line.startswith("Rule: "))
    assert statement_of(task, first) not in rule
    for answer in answers_of(task):
        assert not re.search(rf"(?<![\w.]){re.escape(answer)}(?!\w)", rule), (answer, rule)
    assert lines[-1] == f"Example: {solution[k]}"
    assert clean_note("\n".join(lines))[1]


def test_clean_note_keeps_labelled_blocks_and_flags_free_text():
    text, ok = clean_note("Sure! Here are notes.\n1. Error: took the wrong mug.\nRule: read the number.\n"
                          "Example: take mug 2 from desk 1\nFailure kind: timeout\n\nError: took the wrong mug.\n"
                          "Rule: read the number.\nExample: take mug 2 from desk 1")
    assert ok and text == "Error: took the wrong mug.\nRule: read the number.\nExample: take mug 2 from desk 1"
    assert clean_note("You are in a room. You see a desk.") == ("You are in a room. You see a desk.", False)
    assert clean_note("Error:   \nRule:") [1] is False
    many = "\n\n".join(f"Error: e{i}\nRule: r{i}" for i in range(5))
    assert clean_note(many)[0].count("Error:") == 3


def _note(text, usable=True, channel="pitfall", nid="n0"):
    return Note(note_id=nid, traj_id="t", group_id="g0", task_id="k", channel=channel, writer="template",
                failure_kind="timeout", prompt=[], text=text, usable=usable)


def test_privileged_text_appears_only_in_the_teachers_user_turn():
    secret = "Error: x\nRule: the mug 1 was in the fridge 1"
    pair = foresight_pair("p", "g0", "k", "You act.", "Your task is to: cool a mug.",
                          [_note(secret), _note("Error: junk", usable=False, nid="n1")])
    assert pair.note_ids == ["n0"]  # unusable notes never reach the teacher
    assert not any("fridge 1" in m["content"] or PRIVILEGED_HEADER in m["content"] for m in pair.student)
    holders = [i for i, m in enumerate(pair.teacher) if "fridge 1" in m["content"]]
    assert holders == [len(pair.teacher) - 1] and pair.teacher[-1]["role"] == "user"
    assert pair.teacher[0] == pair.student[0]  # same system prompt
    assert pair.teacher[-1]["content"].endswith(FORESIGHT_REQUEST)  # the request stays last, after the notes
    assert pair.student[-1]["content"] == "Your task is to: cool a mug.\n\n" + FORESIGHT_REQUEST
    assert pair.train_from == len(pair.student)
    with pytest.raises(ValueError, match="no usable"):
        foresight_pair("p", "g0", "k", "You act.", "task", [_note("junk", usable=False)])
    with pytest.raises(ValueError, match="user turn"):
        with_privileged(pair.student, 0, "secret")


def test_action_channel_puts_the_notes_in_the_episodes_task_message_only():
    env = make_env("household", n_receptacles=2, n_distractors=1)
    task = env.sample_tasks("train", 1, 0)[0]
    prefix = prompt_prefix(env)
    msgs = prefix + [{"role": "user", "content": render_observation(env.reset(task), env.admissible_actions(), True)},
                     {"role": "assistant", "content": "look"},
                     {"role": "user", "content": "You see nothing.\nYour action:"},
                     {"role": "assistant", "content": "inventory"}]
    traj = {"traj_id": "t0", "group_id": "g0", "task_id": task.task_id, "messages": msgs, "train_from": len(prefix)}
    pair = action_pair("p", traj, [_note("Error: a\nRule: SECRET-FACT")])
    diff = [i for i, (s, t) in enumerate(zip(pair.student, pair.teacher)) if s != t]
    assert diff == [len(prefix)] and pair.teacher[len(prefix)]["role"] == "user"
    assert "SECRET-FACT" in pair.teacher[len(prefix)]["content"]
    assert not any("SECRET-FACT" in m["content"] for m in pair.student)
    assert pair.student == msgs and pair.source_traj_id == "t0" and pair.train_from == len(prefix)
