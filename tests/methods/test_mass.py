"""MASS's plain-Python parts on hand-made inputs: Bradley-Terry against hand-computed rankings, the judge's order
symmetry and its agreement with a verifier, the workflow spec's JSON round-trip, rendering and validation, the
mutation operator, the ring tournament, and the SFT conversation (the bare task, never the workflow prompt)."""

import json
import math
import random

import pytest

from rsiflow.methods.mass.algorithm import (
    FINAL_ROLE,
    SEED_WORKFLOW,
    Agent,
    PairResult,
    SpecError,
    TaskPrompt,
    Workflow,
    agreement,
    bradley_terry,
    hop_messages,
    judge_pairs,
    mutate,
    oracle_pairs,
    parse_proposal,
    parse_verdict,
    ring_pairs,
    run_workflow,
    select_ranked,
    sft_messages,
    spec_diff,
    win_rate,
)

# ---- Bradley-Terry ----------------------------------------------------------------------------------------


def test_bt_without_prior_is_the_mle_of_a_two_item_record():
    # a beat b 2 of 3 games: the BT MLE has p_a / p_b = 2; mean 1 gives p_a = 4/3, p_b = 2/3.
    s = bradley_terry(["a", "b"], [("a", "b", 1.0), ("a", "b", 1.0), ("a", "b", 0.0)], prior=0.0)
    assert s["a"] == pytest.approx(math.log(4 / 3), abs=1e-9)
    assert s["b"] == pytest.approx(math.log(2 / 3), abs=1e-9)


def test_bt_prior_gives_the_hand_solved_fixed_point():
    # a beat b once, prior 0.5. With p_a = 1 + d, p_b = 1 - d (mean 1) the MM fixed point satisfies
    # p_a / p_b = [1.5 / (0.5/(p_a+1) + 1/2)] / [0.5 / (0.5/(p_b+1) + 1/2)], i.e.
    # (1+d)/(1-d) = 3 (3-d)(2+d) / ((2-d)(3+d)); solved by bisection by hand: d = 0.571993.
    s = bradley_terry(["a", "b"], [("a", "b", 1.0)])
    assert math.exp(s["a"]) == pytest.approx(1.571993, abs=1e-5)
    assert math.exp(s["b"]) == pytest.approx(0.428007, abs=1e-5)


def test_bt_ties_and_no_games_give_equal_scores():
    assert bradley_terry(["a", "b"], [("a", "b", 0.5)]) == {"a": 0.0, "b": 0.0}
    # with no games every item gets only the prior: p = prior / (prior / 2) = 2 for all, renormalised to 1
    assert bradley_terry(["a", "b", "c"], []) == {"a": 0.0, "b": 0.0, "c": 0.0}
    # a ring a > b > c > a is symmetric: equal scores
    ring = bradley_terry(["a", "b", "c"], [("a", "b", 1.0), ("b", "c", 1.0), ("c", "a", 1.0)])
    assert max(ring.values()) - min(ring.values()) < 1e-9


def test_bt_dominated_item_is_last_and_the_prior_keeps_it_finite():
    games = [("a", "b", 1.0), ("a", "c", 1.0), ("b", "c", 1.0)]   # c loses every game
    with_prior = bradley_terry(["a", "b", "c"], games)
    assert with_prior["a"] > with_prior["b"] > with_prior["c"] > -math.inf
    assert sum(math.exp(v) for v in with_prior.values()) == pytest.approx(3.0)   # mean 1
    without = bradley_terry(["a", "b", "c"], games, prior=0.0)
    assert without["c"] == -math.inf      # no prior: the MLE of a dominated item is p = 0
    # the prior pulls toward equality: on a 2-of-3 record the gap is below the MLE's log 2
    record = [("a", "b", 1.0), ("a", "b", 1.0), ("a", "b", 0.0)]
    shrunk = bradley_terry(["a", "b"], record)
    assert 0 < shrunk["a"] - shrunk["b"] < math.log(2)


def test_bt_order_of_games_and_items_does_not_matter():
    games = [("a", "b", 1.0), ("b", "c", 0.5), ("c", "a", 0.0), ("b", "a", 1.0), ("c", "b", 1.0)]
    one = bradley_terry(["a", "b", "c"], games)
    two = bradley_terry(["c", "a", "b"], list(reversed(games)))
    assert all(one[k] == pytest.approx(two[k], abs=1e-12) for k in one)


# ---- judge ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply,verdict", [("A. It is correct.", "A"), ("b - shorter", "B"), ("Tie: both fine", "tie"),
                                           ("Verdict: B because", "B"), ("Response A is better", "A"),
                                           ("I think neither", "invalid"), ("", "invalid"), ("Ab", "invalid")])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply)[0] == verdict


def _ask(rule):
    """A judge model as a function of the two responses it is shown (A first)."""
    def ask(convs):
        out = []
        for c in convs:
            text = c[-1]["content"]
            a = text.split("Response A: ")[1].split("\n\nResponse B: ")[0]
            b = text.split("Response B: ")[1].split("\n\nWhich")[0]
            out.append(rule(a, b))
        return out
    return ask


def test_judge_both_orders_cancel_position_bias():
    always_a = _ask(lambda a, b: "A because it comes first")
    (r,) = judge_pairs([("x", "y", "t", "task", "one", "two")], always_a)
    assert r.ab[0] == "A" and r.ba[0] == "A" and r.score == 0.5 and r.winner is None


def test_judge_is_order_symmetric():
    longer = _ask(lambda a, b: "A longer" if len(a) > len(b) else "B longer" if len(b) > len(a) else "tie")
    texts = {"x": "a long answer", "y": "short", "z": "same!"}
    for x, y in (("x", "y"), ("y", "z"), ("x", "z")):
        (fwd,) = judge_pairs([(x, y, "t", "task", texts[x], texts[y])], longer)
        (back,) = judge_pairs([(y, x, "t", "task", texts[y], texts[x])], longer)
        assert fwd.score == pytest.approx(1.0 - back.score)
        assert fwd.winner == back.winner
    (r,) = judge_pairs([("x", "y", "t", "task", texts["x"], texts["y"])], longer)
    assert r.score == 1.0 and r.winner == "x"


def test_oracle_judge_and_agreement_with_the_verifier():
    verified = {"x": True, "y": False, "z": False, "w": None}
    pairs = [("x", "y", "t", "q", "", ""), ("y", "z", "t", "q", "", "")]
    res = oracle_pairs(pairs, verified)
    assert [r.score for r in res] == [1.0, 0.5] and res[0].judge == "oracle"
    assert agreement(res, verified) == {"decided": 1, "agree": 1, "disagree": 0, "ties": 0, "rate": 1.0}
    with pytest.raises(ValueError, match="no verifier outcome for w"):
        oracle_pairs([("x", "w", "t", "q", "", "")], verified)
    wrong = [PairResult("x", "y", "t", ("B", "", ""), ("A", "", "")), PairResult("x", "z", "t", ("A", "", ""),
                                                                                ("A", "", ""))]
    assert agreement(wrong, verified) == {"decided": 2, "agree": 0, "disagree": 1, "ties": 1, "rate": 0.0}


def test_win_rate_counts_ties_half():
    w = win_rate([1.0, 0.5, 0.0, 0.75])
    assert w["rate"] == pytest.approx(2.25 / 4) and (w["wins"], w["ties"], w["losses"]) == (2, 1, 1)
    assert 0 < w["ci_low"] < w["rate"] < w["ci_high"] < 1


# ---- workflow spec ----------------------------------------------------------------------------------------


def test_spec_round_trips_through_json():
    w = Workflow(agents=(Agent("analyst", "List the facts.", "a short list"), Agent("checker", "Check.", "one line"),
                         Agent(FINAL_ROLE, "", "Answer in the required format.")),
                 hops=("analyst", "checker", FINAL_ROLE))
    again = Workflow.from_json(w.to_json())
    assert again == w and json.loads(again.to_json()) == w.to_dict()
    assert Workflow.from_json(Workflow.reference().to_json()).is_reference and not w.is_reference


@pytest.mark.parametrize("data,key", [
    ({"agents": [], "hops": ["solver"]}, "agents"),
    ({"agents": [{"role": "solver", "instruction": "", "contract": 3}], "hops": ["solver"]}, "agents[0].contract"),
    ({"agents": [{"role": "solver", "instruction": "", "contract": ""}], "hops": ["planner", "solver"]}, "hops[0]"),
    ({"agents": [{"role": "planner", "instruction": "p", "contract": "c"}], "hops": ["planner"]}, "hops[0]"),
    ({"agents": [{"role": "solver", "instruction": "", "contract": ""},
                 {"role": "planner", "instruction": "p", "contract": "c"}], "hops": ["solver"]}, "agents"),
    ({"agents": [{"role": "Bad Role", "instruction": "", "contract": ""}], "hops": ["Bad Role"]}, "agents[0].role"),
    ({"agents": [{"role": "solver", "instruction": "", "contract": ""}], "hops": ["solver"], "x": 1}, "unknown key"),
])
def test_invalid_specs_name_the_bad_key(data, key):
    with pytest.raises(SpecError, match=key.replace("[", r"\[").replace("]", r"\]")):
        Workflow.from_dict(data)


def test_rendering_puts_notes_and_contract_around_the_bare_task_message():
    prefix = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "demo q"},
              {"role": "assistant", "content": "demo a"}]
    w = SEED_WORKFLOW
    first = hop_messages(w, 0, prefix, "What is 2 + 3?\nYour action:", "What is 2 + 3?", [])
    assert first[0]["role"] == "system" and "planner" in first[0]["content"]
    assert "What is 2 + 3?" in first[1]["content"] and "at most 3 short numbered steps" in first[1]["content"]
    last = hop_messages(w, 1, prefix, "What is 2 + 3?\nYour action:", "What is 2 + 3?", [("planner", "1. add")])
    assert last[:3] == prefix
    assert last[3]["content"] == ("Note from the planner: 1. add\n\nWhat is 2 + 3?\n(Follow your team's notes.)\n"
                                  "Your action:")
    one_line = hop_messages(Workflow(agents=(Agent(FINAL_ROLE, "", "short"),), hops=(FINAL_ROLE,)), 0, [], "Q?", "Q?",
                            [])
    assert one_line[-1]["content"] == "Q?\n(short)"
    bare = hop_messages(Workflow.reference(), 0, prefix, "What is 2 + 3?\nYour action:", "What is 2 + 3?", [])
    assert bare == [*prefix, {"role": "user", "content": "What is 2 + 3?\nYour action:"}]


def test_run_workflow_feeds_each_hop_the_notes_before_it():
    seen = []

    def generate(convs, final):
        seen.append((final, [c[-1]["content"] for c in convs]))
        return [("ANSWER 5" if final else f"note{len(seen)}", 3) for _ in convs]

    tasks = [TaskPrompt("t1", "What is 2 + 3?", "What is 2 + 3?\nYour action:"), TaskPrompt("t2", "q2", "q2 msg")]
    eps = run_workflow(SEED_WORKFLOW, "w0", tasks, [], generate, lambda i, t: f"e{i}")
    assert [e.final for e in eps] == ["ANSWER 5", "ANSWER 5"] and eps[0].gen_tokens == 6 and eps[0].final_tokens == 3
    assert seen[0][0] is False and seen[1][0] is True
    assert seen[1][1][0].startswith("Note from the planner: note1")


@pytest.mark.parametrize("seed", range(40))
def test_every_mutation_is_a_valid_spec_and_says_what_it_did(seed):
    rng = random.Random(seed)
    w = Workflow.reference() if seed % 2 else SEED_WORKFLOW
    ops = set()
    for _ in range(12):
        new, what = mutate(w, rng)
        assert Workflow.from_json(new.to_json()) == new          # valid and serialisable
        assert what["op"] in ("add_hop", "remove_hop", "reorder_hops", "change_contract") and what["detail"]
        assert new != w
        assert spec_diff(w, new)                                  # something changed
        ops.add(what["op"])
        w = new
    assert len(ops) >= 2


def test_a_proposal_is_parsed_and_validated():
    text = 'Sure! {"agents": [{"role": "solver", "instruction": "", "contract": "short"}], "hops": ["solver"]} done'
    assert parse_proposal(text).agent("solver").contract == "short"
    with pytest.raises(SpecError, match="no JSON object"):
        parse_proposal("I would add a checker.")
    with pytest.raises(SpecError, match="hops"):
        parse_proposal('{"agents": [{"role": "solver", "instruction": "", "contract": ""}], "hops": "solver"}')


# ---- tournament, selection and SFT data -------------------------------------------------------------------


@pytest.mark.parametrize("n,m", [(4, 2), (6, 3), (18, 6), (5, 4)])
def test_ring_tournament_gives_each_item_m_games(n, m):
    pairs = ring_pairs(n, m)
    assert len(set(pairs)) == len(pairs) and all(i < j for i, j in pairs)
    assert all(sum(i in p for p in pairs) == m for i in range(n))
    with pytest.raises(ValueError):
        ring_pairs(n, n)


def test_selection_takes_top_ranks_for_training_and_the_next_for_validation():
    sel = select_ranked({"a": 0.1, "b": 2.0, "c": -1.0, "d": 0.5}, train_top=2, val_next=1)
    assert sel == {"b": (1, "train"), "d": (2, "train"), "a": (3, "validation"), "c": (4, None)}


def test_sft_data_carries_the_bare_task_never_the_workflow_prompt():
    prefix = [{"role": "system", "content": "Solve it."}]
    tasks = [TaskPrompt("t1", "What is 2 + 3?", "What is 2 + 3?\nYour action:")]
    prompts = []

    def generate(convs, final):
        prompts.extend(json.dumps(c) for c in convs)
        return [("Answer: 5" if final else "1. add the numbers", 4) for _ in convs]

    w = Workflow(agents=(Agent("analyst", "List the facts.", "a short list"),
                         Agent(FINAL_ROLE, "Use the notes.", "Answer in the required format.")),
                 hops=("analyst", FINAL_ROLE))
    (ep,) = run_workflow(w, "w1", tasks, prefix, generate, lambda i, t: "e")
    msgs = sft_messages(prefix, tasks[0].message, ep.final)
    assert msgs == [*prefix, {"role": "user", "content": "What is 2 + 3?\nYour action:"},
                    {"role": "assistant", "content": "Answer: 5"}]
    text = json.dumps(msgs)
    for workflow_text in ("Note from the", "analyst", "List the facts", "Answer in the required format",
                          "Use the notes", "1. add the numbers"):
        assert workflow_text not in text
        assert any(workflow_text in p for p in prompts)   # ... though the workflow's prompts had it
