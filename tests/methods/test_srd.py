"""SRD's plain-Python parts: failure kinds, note prompts, the template writer, note cleaning, and
where the privileged text goes (the teacher's user turn only)."""

import pytest

from envs import make_env
from methods.rollout import prompt_prefix, render_observation
from methods.srd import (FORESIGHT_REQUEST, PRIVILEGED_HEADER, Attempt, Note, action_pair, clean_note, failure_kind,
                         foresight_pair, knowledge_note_messages, pitfall_note_messages, template_note, with_privileged)


def household_attempt(actions, max_turns=8, status="failure", seed=2):
    env = make_env("household", n_receptacles=2, n_distractors=1)
    task = env.sample_tasks("train", 3, 0)[seed]
    first = env.reset(task)
    obs, valid, feedback = [], [], []
    for a in actions:
        r = env.step(a)
        obs.append(r.observation)
        valid.append(bool(r.info.get("valid", True)))
        feedback.append(r.info.get("feedback", "ok"))
    return Attempt(traj_id="r/t0", group_id="g0", task_id=task.task_id, task_text=first, actions=list(actions),
                   observations=obs[:-1], valid=valid, feedback=feedback, hindsight=env.hindsight(), success=False,
                   status=status, n_turns=len(actions), max_turns=max_turns), env, task


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
    assert pitfall_note_messages(a, few_shot=False)[-1] == msgs[-1] and len(pitfall_note_messages(a, few_shot=False)) == 2
    assert "successful attempt" in knowledge_note_messages(a)[-1]["content"]


def test_template_writer_builds_a_usable_note_from_hindsight():
    a, _, _ = household_attempt(["look", "inventory"], max_turns=2)
    text = template_note(a)
    cleaned, usable = clean_note(text)
    assert usable and cleaned == text
    assert text.startswith("Error: the turn limit (2) ran out")
    solution = next(h for h in a.hindsight if "-step solution" in h)
    assert text.splitlines()[-1] == "Example: " + solution.split(":", 1)[1].split(";")[0].strip()
    assert "The task was" not in text


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
