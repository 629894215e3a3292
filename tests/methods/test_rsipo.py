"""RSIPO's plain-Python parts on hand-made numbers: gains, noise, the empirical-Bayes trust weight
(docs/methods.md, RSIPO), the leak checker, the template writer, where the skill goes in a prompt, library
retrieval and retirement."""

import pytest

from rsiflow.envs.rollout import render_observation
from rsiflow.methods.rsipo.algorithm import (
    SKILL_HEADER,
    LibrarySkill,
    check_skill,
    clean_skill,
    concrete_ids,
    gain,
    library_entry,
    noise_variance,
    replay_observation,
    retrieve,
    skill_block,
    skill_messages,
    teacher_messages,
    template_skill,
    trust,
    with_skill,
)


def test_gain_and_noise_by_hand():
    student, replay = [1.0, 1.0, 0.0, 0.0], [0.0, 0.0]
    assert gain(student, replay) == pytest.approx(-0.5)               # 0 - 0.5
    assert noise_variance(student, replay) == pytest.approx(1 / 12)   # 0/2 + (1/3)/4
    assert noise_variance([0.0, 0.0, 0.0, 0.0], [1.0, 0.0]) == pytest.approx(0.25)  # 0.5/2 + 0
    with pytest.raises(ValueError, match="at least 2"):
        noise_variance([1.0], [0.0, 1.0])


def test_a_skill_that_hurts_gets_weight_zero():
    # x1 hurts (g -0.5, v 1/12), x2 helps surely (g 1, v 0), x3 helps noisily (g 0.5, v 1/4); c = 0.5
    t = trust([("x1", "a", -0.5, 1 / 12), ("x2", "a", 1.0, 0.0), ("x3", "a", 0.5, 0.25)], c=0.5)
    # ḡ = 1/3; sample Var(g) = 7/12; mean v = 1/9; τ² = 7/12 - 1/9 = 17/36
    assert t["x1"].type_mean == pytest.approx(1 / 3) and t["x1"].tau2 == pytest.approx(17 / 36)
    assert t["x1"].shrink == pytest.approx(17 / 20)                   # (17/36) / (17/36 + 3/36)
    assert t["x1"].shrunk == pytest.approx(1 / 3 + 0.85 * (-0.5 - 1 / 3))  # -0.375
    assert t["x1"].weight == 0.0                                      # clip(-0.75, 0, 1)
    assert t["x2"].shrink == 1.0 and t["x2"].shrunk == pytest.approx(1.0) and t["x2"].weight == 1.0
    assert t["x3"].shrink == pytest.approx(17 / 26)                   # (17/36) / (17/36 + 9/36)
    assert t["x3"].shrunk == pytest.approx(1 / 3 + 17 / 26 * (0.5 - 1 / 3))  # 0.44231
    assert t["x3"].weight == pytest.approx((1 / 3 + 17 / 26 / 6) / 0.5)     # 0.88462
    assert t["x1"].centred == pytest.approx(-0.5 - 1 / 3)             # ĝ = g - ḡ, the skill-writing advantage


def test_a_noisy_single_task_is_pulled_toward_its_type_mean():
    tests = [("b1", "b", 0.2, 0.01), ("b2", "b", 0.3, 0.01), ("b3", "b", 0.1, 0.01), ("b4", "b", 1.0, 0.5),
             ("other", "c", -1.0, 0.0)]  # another type's test does not enter b's fit
    t = trust(tests, c=1.0)
    # ḡ = 0.4; sample Var(g) = 0.5/3; mean v = 0.53/4; τ² = 0.16667 - 0.1325 = 0.0341667
    tau2 = 0.5 / 3 - 0.53 / 4
    assert t["b4"].tau2 == pytest.approx(tau2)
    assert t["b4"].shrink == pytest.approx(tau2 / (tau2 + 0.5))       # 0.064: mostly noise
    assert t["b4"].shrunk == pytest.approx(0.4 + tau2 / (tau2 + 0.5) * 0.6)  # 0.438, from a raw 1.0
    assert t["b1"].shrunk == pytest.approx(0.4 + tau2 / (tau2 + 0.01) * -0.2)  # 0.245: precise, kept near 0.2
    assert abs(t["b4"].shrunk - 0.4) < abs(1.0 - 0.4) / 10
    assert t["other"].type_mean == -1.0 and t["other"].tau2 == 0.0 and t["other"].weight == 0.0


def test_no_spread_beyond_noise_shrinks_every_gain_to_the_type_mean():
    t = trust([("p", "a", 0.5, 0.25), ("q", "a", 0.0, 0.0)], c=0.25)
    # ḡ 0.25; Var(g) 0.125 < mean v 0.125 → τ² = 0 → B = 0 (also for q, whose v is 0)
    assert t["p"].tau2 == 0.0 and t["p"].shrink == 0.0 and t["q"].shrink == 0.0
    assert t["p"].shrunk == t["q"].shrunk == pytest.approx(0.25) and t["q"].weight == 1.0
    with pytest.raises(ValueError, match="trust scale"):
        trust([("p", "a", 0.5, 0.25)], c=0.0)


def test_the_checker_rejects_a_skill_that_leaks_the_episodes_ids():
    ids = concrete_ids(["You see a cabinet 3 and a desk 1.\n\nYour task is to: put a mug in cabinet 3.",
                        "take mug 1 from desk 1"])
    assert ids == {"cabinet 3", "desk 1", "mug 1"}
    ok, why, leaked = check_skill("1. Go to the cabinet 3.\n2. Put the mug there.", ids)
    assert not ok and leaked == ["cabinet 3"] and "cabinet 3" in why
    # list numbering and other objects' numbers are not leaks
    assert check_skill("1. Find the mug.\n2. Take it.\n3. Put it in the cabinet 2.", ids) == (True, None, [])
    # arithmetic: the operands and the answer are ids; a general method is fine
    ids = concrete_ids(["What is 3 * 5?", "3 * 5 = 15. Answer: 15"])
    assert ids == {"3", "5", "15"}
    assert check_skill("Multiply: 3 times 5 is 15.", ids)[2] == ["15", "3", "5"]
    assert check_skill("1. Multiply the two numbers.\n2. Answer with the product.", ids)[0]
    assert check_skill("ok", set()) == (False, "fewer than 3 words", [])


def test_the_template_writer_renders_canonical_actions_without_ids():
    text = template_skill("pick_heat_then_place", ["go<receptacle>", "go<receptacle>", "take<object,receptacle>",
                                                   "heat<object,microwave>"], "expert")
    assert text == ("Procedure for pick_heat_then_place tasks (the expert's actions, in general form):\n"
                    "1. go <receptacle> (repeat, 2 times)\n2. take <object, receptacle>\n"
                    "3. heat <object, microwave>")
    assert check_skill(text, {"microwave 1", "mug 2"})[0]


def test_the_skill_sits_where_the_replay_had_it_and_only_in_the_teacher():
    obs, admissible = "You see a desk 1.\n\nYour task is to: examine the book.", ["go to desk 1", "look"]
    block = skill_block("1. Find the book.\n2. Use the lamp.")
    for show in (True, False):
        student_msg = render_observation(obs, admissible, show)
        replay_msg = render_observation(replay_observation(obs, block), admissible, show)
        assert with_skill(student_msg, block) == replay_msg       # the teacher is the policy the replay measured
    student = [{"role": "system", "content": "Act."}, {"role": "user", "content": render_observation(obs, admissible,
                                                                                                      True)},
               {"role": "assistant", "content": "go to desk 1"}, {"role": "user", "content": "ok"},
               {"role": "assistant", "content": "look"}]
    teacher = teacher_messages(student, 1, block)
    assert [m for i, m in enumerate(teacher) if i != 1] == [m for i, m in enumerate(student) if i != 1]
    assert SKILL_HEADER in teacher[1]["content"] and not any(SKILL_HEADER in m["content"] for m in student)
    with pytest.raises(ValueError, match="not a user turn"):
        teacher_messages(student, 2, block)


def test_skill_prompt_shows_the_rollout_and_asks_for_general_steps():
    msgs = skill_messages("pick_and_place", "Your task is to: put a mug in cabinet 3.", ["go to desk 1"], True)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "1. go to desk 1" in msgs[-1]["content"] and "pick_and_place" in msgs[-1]["content"]


def _skill(sid, task_type, text, shrunk_gains):
    s = LibrarySkill(sid, task_type, text, "m", "policy", 1)
    s.tests = [{"round": r + 1, "test_id": f"{sid}/t{r}", "task_id": "t", "gain": g, "noise": 0.01, "shrunk": g,
                "weight": max(g, 0)} for r, g in enumerate(shrunk_gains)]
    return s


def test_library_retrieval_by_type_and_lexical_match():
    lib = [_skill("heat", "heat", "Take the mug to the microwave and heat it.", [0.2]),
           _skill("heat2", "heat", "Go around and look.", [0.5]),
           _skill("cool", "cool", "Take the mug to the fridge and cool it.", [0.9]),
           _skill("old", "heat", "Heat the mug in the microwave.", [-0.1, -0.2])]
    lib[3].status = "retired"
    got = retrieve(lib, "heat", "Your task is to: heat a mug and put it in the microwave.", k=2)
    assert [s.skill_id for s, _ in got] == ["heat", "heat2"]   # same type, active only, best match first
    assert got[0][1] > got[1][1] >= 0
    assert retrieve(lib, "heat", "anything", k=0) == []
    # equal match: the higher last shrunk gain first
    tie = [_skill("a", "x", "alpha", [0.1]), _skill("b", "x", "alpha", [0.3])]
    assert [s.skill_id for s, _ in retrieve(tie, "x", "beta", k=2)] == ["b", "a"]


def test_retirement_after_shrunk_gains_stay_at_or_below_zero():
    s = _skill("s", "x", "text", [-0.1])
    e = library_entry(s, round_no=1, retire_after=2)
    assert e["status"] == "active" and e["nonpositive_streak"] == 1     # one test: on probation
    s.tests.append({"round": 2, "test_id": "s/t1", "task_id": "t", "gain": 0.3, "noise": 0.01, "shrunk": 0.0,
                    "weight": 0.0})
    e = library_entry(s, round_no=2, retire_after=2)
    assert e["status"] == "retired" and e["retired_round"] == 2 and e["nonpositive_streak"] == 2
    assert e["n_tests"] == 2 and e["mean_gain"] == pytest.approx(0.1)
    assert e["gain_ci_low"] == pytest.approx(0.1 - 1.96 * 0.02 ** 0.5 / 2)  # mean ± z·sqrt(Σv)/n
    good = _skill("g", "x", "text", [-0.1, 0.2])
    assert library_entry(good, round_no=2, retire_after=2)["status"] == "active"  # a positive re-test keeps it
    s.tests.append({"round": 3, "test_id": "s/t2", "task_id": "t", "gain": 0.9, "noise": 0.01, "shrunk": 0.9,
                    "weight": 1.0})
    assert library_entry(s, round_no=3, retire_after=2)["status"] == "retired"  # retired stays retired


@pytest.mark.parametrize("raw", ["word " * 200, "x" * 700, "first line\n" + "word " * 200])
def test_a_cut_skill_is_stored_as_the_block_shows_it(raw):
    text = clean_skill(raw, max_chars=600)
    assert len(text) <= 600 and text == text.strip() and text
    assert skill_block(text) == f"{SKILL_HEADER}\n{text}"   # what is stored is what a replay shows
