"""X-Tree's miner and uses on hand-made symbol streams whose right answers are known."""

import json
import random

import pytest

from rsiflow.methods.exit.algorithm import weight_runs
from rsiflow.methods.xtree.algorithm import (
    MineParams,
    Trace,
    bonus_weight,
    executed,
    mine,
    online_bonus,
    render,
    turn_weights,
)


def traces(*specs: tuple[str, bool], label: str = "") -> list[Trace]:
    """One trace per (string, success): each character is a symbol."""
    return [Trace(f"t{i}", list(s), ok, label) for i, (s, ok) in enumerate(specs)]


def spans(tree) -> list[str]:
    return ["".join(n.span) for n in tree.nodes]


def test_a_planted_subroutine_is_found_in_noise():
    rng = random.Random(3)
    noise = "defghijk"
    corpus = []
    for i in range(40):
        s = [rng.choice(noise) for _ in range(rng.randint(3, 8))]
        at = rng.randint(0, len(s))
        corpus.append(Trace(str(i), s[:at] + list("abc") + s[at:], i % 2 == 0))
    tree = mine(corpus)
    best = max(tree.nodes, key=lambda n: n.score)
    assert "".join(best.span) == "abc"
    assert best.freq == 40 and best.traces == 40 and best.succ == 0.5
    # X = f · len^p · (succ + eps)^p_s = 40 · 3 · 0.55
    assert best.score == pytest.approx(66.0)
    # its children: the pair merged first, then the third symbol
    assert (best.left, best.right) in (("#0", "c"), ("a", "#0"))


def test_a_span_that_stops_compressing_is_not_merged():
    # "abcd" in 4 traces: (a, b) f = 4, len 2: 4 - 1 > eta(2) = 1 + 0.5 * 2 = 2 -> merged
    # (ab, c) f = 4, len 3: 3 > 2.5 -> merged; (abc, d) f = 4, len 4: 3 > 3 is false -> not merged
    tree = mine(traces(*[("abcd", True)] * 4))
    assert spans(tree) == ["ab", "abc"]
    # with one more occurrence it compresses again: 5 - 1 > 3
    assert spans(mine(traces(*[("abcd", True)] * 5))) == ["ab", "abc", "abcd"]
    # three occurrences of a pair never compress: 3 - 1 > 2 is false
    assert spans(mine(traces(*[("ab", True)] * 3))) == []


def test_pairs_are_counted_without_overlap():
    # "aaaaa" holds two non-overlapping (a, a), counted from the run's start; four such traces: f = 8
    tree = mine(traces(*[("aaaaa", False)] * 4), MineParams(max_nodes=1))
    assert spans(tree) == ["aa"] and tree.nodes[0].freq == 8
    assert [(o.trace, o.start, o.end) for o in tree.occurrences][:2] == [(0, 0, 2), (0, 2, 4)]


def test_success_rate_and_score_by_hand():
    # "xy" in 3 successful and 1 failed trace, twice in one of them: f = 5, succ = 3/4 of the traces containing it
    tree = mine(traces(("xyxy", True), ("xyz", True), ("zxy", True), ("xy", False), ("zz", False)),
                MineParams(max_nodes=1))
    n = tree.nodes[0]
    assert "".join(n.span) == "xy" and n.freq == 5 and n.traces == 4 and n.succ == 0.75
    assert n.score == pytest.approx(5 * 2 * 0.8)   # f · len · (succ + 0.05)
    # the success factor decides between equally frequent spans: "pq" only in successes beats "uv" only in failures
    tree = mine(traces(*[("pq", True)] * 4, *[("uv", False)] * 4), MineParams(max_nodes=1))
    assert spans(tree) == ["pq"]
    # with p_s = 0 the success rate is ignored and ties go to the smaller token ids
    assert spans(mine(traces(*[("uv", True)] * 4, *[("pq", False)] * 4), MineParams(p_s=0, max_nodes=1))) == ["pq"]


def test_max_depth_bounds_the_tree():
    tree = mine(traces(*[("abcdefghij", True)] * 20), MineParams(max_depth=2))
    assert tree.nodes and max(n.depth for n in tree.nodes) == 2
    assert max(n.length for n in tree.nodes) <= 4          # a depth-2 node spans at most 2 · 2 actions


def test_occurrences_match_the_frequency_and_the_spans():
    rng = random.Random(5)
    corpus = [Trace(str(i), [rng.choice("abcab") for _ in range(rng.randint(0, 30))], rng.random() < 0.5)
              for i in range(60)]
    tree = mine(corpus)
    assert tree.nodes
    for n in tree.nodes:
        occ = [o for o in tree.occurrences if o.node == n.idx]
        assert len(occ) == n.freq
        assert all(tuple(corpus[o.trace].symbols[o.start:o.end]) == n.span for o in occ)
        assert len({o.trace for o in occ}) == n.traces


def naive_mine(corpus: list[Trace], params: MineParams) -> list[tuple]:
    """The same miner without incremental counting: every pair re-counted from scratch before each merge."""
    alphabet = sorted({s for t in corpus for s in t.symbols})
    span = {i: (s,) for i, s in enumerate(alphabet)}
    depth = dict.fromkeys(span, 0)
    seqs = [[alphabet.index(s) for s in t.symbols] for t in corpus]
    out = []
    while params.max_nodes is None or len(out) < params.max_nodes:
        found: dict[tuple[int, int], list[int]] = {}
        for k, seq in enumerate(seqs):
            run = 0
            for a, b in zip(seq, seq[1:]):
                counted = a != b or run % 2 == 0
                run = run + 1 if a == b else 0
                if counted:
                    found.setdefault((a, b), []).append(k)
        best = None
        for (a, b), ks in found.items():
            f, ln, d = len(ks), len(span[a]) + len(span[b]), 1 + max(depth[a], depth[b])
            succ = sum(corpus[k].success for k in set(ks)) / len(set(ks))
            if d <= params.max_depth and f - 1 > params.eta(ln):
                key = (-params.score(f, ln, succ), a, b)
                best = min(best or key, key)
        if best is None:
            return out
        _, a, b = best
        new = len(span)
        span[new], depth[new] = span[a] + span[b], 1 + max(depth[a], depth[b])
        ks = found[(a, b)]
        out.append((span[new], len(ks), round(sum(corpus[k].success for k in set(ks)) / len(set(ks)), 12)))
        for k, seq in enumerate(seqs):
            merged, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == (a, b):
                    merged.append(new)
                    i += 2
                else:
                    merged.append(seq[i])
                    i += 1
            seqs[k] = merged
    return out


@pytest.mark.parametrize("seed", range(6))
def test_incremental_counting_gives_the_tree_of_counting_from_scratch(seed):
    rng = random.Random(seed)
    for _ in range(25):
        alphabet = "abcdef"[: rng.choice([2, 3, 4, 6])]
        corpus = [Trace(str(i), [rng.choice(alphabet) for _ in range(rng.randint(0, 25))], rng.random() < 0.5)
                  for i in range(rng.randint(1, 12))]
        params = MineParams(p=rng.choice([0.0, 1.0]), p_s=rng.choice([0.0, 1.0]), eta0=rng.choice([0.0, 1.0]),
                            eta1=rng.choice([0.0, 0.5]), max_depth=rng.choice([2, 3, 6]))
        got = [(n.span, n.freq, round(n.succ, 12)) for n in mine(corpus, params).nodes]
        assert got == naive_mine(corpus, params)


def test_mining_is_deterministic_and_ignores_the_order_of_the_traces():
    rng = random.Random(11)
    corpus = [Trace(str(i), [rng.choice("abcd") for _ in range(rng.randint(2, 20))], rng.random() < 0.3)
              for i in range(50)]
    a, b = mine(corpus), mine(corpus)
    assert [vars(n) for n in a.nodes] == [vars(n) for n in b.nodes] and a.occurrences == b.occurrences
    shuffled = mine(rng.sample(corpus, len(corpus)))
    assert [(n.span, n.freq, n.succ, n.left, n.right) for n in shuffled.nodes] == \
        [(n.span, n.freq, n.succ, n.left, n.right) for n in a.nodes]


def test_the_tokenizers_bpe_trainer_makes_the_same_merges_where_it_can_express_the_score():
    """With X = f (p = p_s = 0) and a constant threshold, X-Tree is plain BPE. HF's trainer counts equal
    neighbours with overlap, so the stream repeats no symbol within a trace (no span can then repeat back to back)."""
    from tokenizers import Tokenizer, models, trainers

    rng = random.Random(2)
    alphabet = [f"s{i:02d}" for i in range(40)]
    routines = [alphabet[i:i + 4] for i in range(0, 16, 4)]
    corpus = []
    for i in range(300):
        chosen = rng.sample(routines, 2)
        rest = [s for s in alphabet[16:] if rng.random() < 0.3]
        rng.shuffle(rest)
        corpus.append(Trace(str(i), chosen[0] + rest[:3] + chosen[1] + rest[3:6], True))
    k = 20
    own = [n.span for n in mine(corpus, MineParams(p=0, p_s=0, eta0=1, eta1=0, max_depth=64, max_nodes=k)).nodes]
    char = {s: chr(0x4E00 + i) for i, s in enumerate(sorted({s for t in corpus for s in t.symbols}))}
    back = {c: s for s, c in char.items()}
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(("".join(char[s] for s in t.symbols) for t in corpus),
                            trainers.BpeTrainer(vocab_size=len(char) + k, min_frequency=3, show_progress=False,
                                                initial_alphabet=list(char.values())))
    merges = json.loads(tok.to_str())["model"]["merges"]
    theirs = [tuple(back[c] for c in "".join(m)) for m in merges]
    assert len(own) == k and own == theirs


# ---- uses ----------------------------------------------------------------------------------------------


def small_tree():
    # "abc" in 5 successful traces (nodes ab, abc) and "xy" in 5 failed ones (node xy); the digits are noise
    return mine(traces(*[(f"abc{i}", True) for i in range(5)], *[(f"xy{i}", False) for i in range(5, 10)]))


def test_executed_nodes_are_contiguous_spans():
    tree = small_tree()
    assert spans(tree) == ["ab", "abc", "xy"]
    assert executed(tree.nodes, list("zabcx")) == [0, 1]
    assert executed(tree.nodes, list("abxcy")) == [0]      # a b x c: "abc" is not contiguous
    assert executed(tree.nodes, []) == []


def test_the_bonus_weight_at_group_win_rates_0_half_1():
    assert bonus_weight(0.0, 0.2) == pytest.approx(0.2)     # all fail: strongest
    assert bonus_weight(0.5, 0.2) == pytest.approx(0.1)
    assert bonus_weight(1.0, 0.2) == 0.0                    # all pass: the verifier says everything
    with pytest.raises(ValueError):
        bonus_weight(1.5, 0.2)


def test_online_bonus_by_hand():
    tree = small_tree()
    # all-fail group: lambda_g = 0.2; shares 2/3 (ab, abc), 1/3 (xy), 0
    out = online_bonus([(list("abcq"), False), (list("xyq"), False), (list("qq"), False)], tree.nodes, 0.2)
    assert out["lambda_g"] == pytest.approx(0.2) and out["win_rate"] == 0.0
    assert [r["share"] for r in out["rollouts"]] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert [r["bonus"] for r in out["rollouts"]] == pytest.approx([0.2 * 2 / 3, 0.2 / 3, 0.0])
    # half the group succeeded: half the weight
    out = online_bonus([(list("abc"), True), (list("xy"), False)], tree.nodes, 0.2)
    assert [r["bonus"] for r in out["rollouts"]] == pytest.approx([0.1 * 2 / 3, 0.1 / 3])
    # all passed: no bonus at all
    out = online_bonus([(list("abc"), True), (list("xy"), True)], tree.nodes, 0.2)
    assert [r["bonus"] for r in out["rollouts"]] == [0.0, 0.0]
    # no node for the task type: no bonus
    assert [r["bonus"] for r in online_bonus([(list("abc"), False)], [], 0.2)["rollouts"]] == [0.0]


def test_turn_weights_by_hand():
    tree = small_tree()
    ab, abc, xy = (n.score for n in tree.nodes)
    top = max(ab, abc, xy)
    w = turn_weights(tree.nodes, list("qabc"), alpha=1.0)
    raw = [1.0, 1 + abc / top, 1 + abc / top, 1 + abc / top]   # every action of "abc" is covered by its best node
    assert w == pytest.approx([x / (sum(raw) / 4) for x in raw])
    assert sum(w) / len(w) == pytest.approx(1.0)
    assert turn_weights(tree.nodes, list("qqq"), alpha=1.0) == [1.0, 1.0, 1.0]
    assert weight_runs([1.0, 2.0, 2.0, 1.0]) == [(0, 1, 1.0), (1, 3, 2.0), (3, 4, 1.0)]


def test_the_tree_renders_as_an_outline():
    tree = small_tree()
    text = render(tree, top=3)
    assert text.splitlines() == [
        "- a > b > c  (used 5x, success 1.00)",
        "  - a > b  (used 5x, success 1.00)",
        "- x > y  (used 5x, success 0.00)",
    ]
    assert render(tree, [tree.nodes[2]], top=3) == "- x > y  (used 5x, success 0.00)"
    assert render(mine([])) == ""
