"""HFBackend(kv_reuse=True) on the tiny model: reusing keys/values across calls changes what is prefilled,
never what is generated (greedy outputs equal the plain path's), and the kept store stays bounded."""

import pytest
import torch

from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend, NucleusWarper, clear_backends, get_backend

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, stop=("\n",))


def _start(i):
    return [{"role": "system", "content": "You play a text adventure. Answer with one action."},
            {"role": "user", "content": f"Room {i}: " + "a dusty corridor, " * (3 * i) + "a door. Your action:"}]


def _next_turn(conversations, generations, turn):
    """Like the episode runner: the action as the assistant message, then the next observation."""
    return [c + [{"role": "assistant", "content": g.text.strip()},
                 {"role": "user", "content": f"Turn {turn}: you see {'a lamp ' * (k % 3)}. Your action:"}]
            for k, (c, g) in enumerate(zip(conversations, generations))]


@pytest.fixture(scope="module")
def plain(tiny_path):
    return HFBackend(tiny_path, max_batch_size=4)


@pytest.fixture(params=[False, True], ids=["prefix-in-cache", "prefix-apart"])
def reusing(tiny_path, request):
    """The reusing backend both ways: a shared prefix copied into every row's cache, and attended apart
    (`shared_prefix_attention`; on by default only for half-precision weights, so forced on here)."""
    return HFBackend(tiny_path, max_batch_size=4, kv_reuse=True, shared_prefix_attention=request.param)


def _assert_same(expected, got, tol=1e-4):
    # Cached keys/values come from a different batch layout than a fresh prefill: logits agree to ~1e-6,
    # so tokens and texts must be identical and logprobs equal within `tol`.
    assert [g.text for g in got] == [g.text for g in expected]
    assert [g.token_ids for g in got] == [g.token_ids for g in expected]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in expected]
    assert [g.prompt_tokens for g in got] == [g.prompt_tokens for g in expected]
    for a, b in zip(expected, got):
        assert b.logprobs == pytest.approx(a.logprobs, abs=tol)
        assert b.temp_logprobs == pytest.approx(a.temp_logprobs, abs=tol) and len(b.temp_logprobs) == len(b.token_ids)


def test_greedy_multi_turn_equals_plain_and_reuses_the_history(plain, reusing):
    conversations = [_start(i) for i in range(6)]
    for turn in range(3):
        expected = plain.generate(conversations, GREEDY)
        got = reusing.generate(conversations, GREEDY)
        _assert_same(expected, got)
        for g in got:
            assert g.extra["prefill_tokens"] + g.extra["cached_tokens"] == g.prompt_tokens
            if turn == 0:
                assert g.extra["cached_tokens"] == 0
            else:
                assert g.extra["cached_tokens"] > 0
                assert g.extra["prefill_tokens"] < g.prompt_tokens / 2
        assert len({g.text for g in got}) > 1
        conversations = _next_turn(conversations, expected, turn)


def test_stop_strings_and_lengths_end_rows_as_in_the_plain_path(plain, reusing):
    conversations = [_start(i) for i in range(5)]
    for params in (SamplingParams(max_new_tokens=10, temperature=0.0, stop=("e", "an")),
                   SamplingParams(max_new_tokens=1, temperature=0.0),
                   SamplingParams(max_new_tokens=12, temperature=0.0)):
        for _ in range(2):  # second round: the same prompts again, now (all but one token) cached
            _assert_same(plain.generate(conversations, params), reusing.generate(conversations, params))
        assert all(g.extra["prefill_tokens"] == 1 for g in reusing.generate(conversations, params))
    # Stop strings taken from the plain outputs, so rows end at different steps (finished rows leave the batch).
    full = plain.generate(conversations, SamplingParams(max_new_tokens=12, temperature=0.0))
    stop = tuple({plain._decode(full[row].token_ids[at:at + 1]).strip() or "\n" for row, at in ((0, 6), (2, 3))})
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=stop)
    for _ in range(2):
        expected, got = plain.generate(conversations, params), reusing.generate(conversations, params)
        _assert_same(expected, got)
    assert sum(bool(g.extra.get("stop")) for g in got) >= 2
    assert len({len(g.token_ids) for g in got}) > 2


def test_batches_mixing_hits_misses_and_shared_prefixes(plain, reusing, monkeypatch):
    first = [_start(i) for i in range(3)]
    reusing.generate(first, GREEDY)
    later = [
        _next_turn(first[:1], plain.generate(first[:1], GREEDY), 0)[0],   # continues row 0
        [{"role": "user", "content": "Something else entirely, never seen before."}],  # no hit
        first[1][:1] + [{"role": "user", "content": "Room 1, another observation."}],  # shares the system prompt
        first[2],                                                        # exactly a previous prompt
        first[2][:1] + [{"role": "user", "content": "x"}],              # short, shares the system prompt
        first[0][:1] + [{"role": "user", "content": first[0][1]["content"] + " more"}],  # shares most of row 0
    ]
    for batch_size in (2, 8):
        monkeypatch.setattr(reusing, "max_batch_size", batch_size)
        reusing.clear_kv_store()
        reusing.generate(first, GREEDY)
        got = reusing.generate(later, GREEDY)
        _assert_same(plain.generate(later, GREEDY), got)
        cached = [g.extra["cached_tokens"] for g in got]
        assert cached[1] == 0 or cached[1] < 5  # only the template's opening tokens can match
        assert cached[0] > cached[2] > 0 and cached[4] > 0 and cached[5] > cached[2]
        assert got[3].extra["prefill_tokens"] == 1


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_warped_ones(tiny_path, reusing):
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3, stop=("\n",))
    conversations = [_start(i) for i in range(4)]

    def play(backend):
        backend.clear_kv_store()
        out, convs = [], conversations
        for turn in range(2):
            gens = backend.generate(convs, params)
            out.append(gens)
            convs = _next_turn(convs, gens, turn)
        return out

    first, second = play(reusing), play(reusing)
    other = play(HFBackend(tiny_path, max_batch_size=4, kv_reuse=True))
    for a, b, c in zip(first, second, other):
        assert [g.token_ids for g in a] == [g.token_ids for g in b] == [g.token_ids for g in c]
        assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert first[-1][0].extra["cached_tokens"] > 0

    # The sampling logprobs are those of the tempered distribution (no top-p here), by one plain forward pass.
    params = SamplingParams(max_new_tokens=8, temperature=0.7, seed=5)
    reusing.generate(conversations, params)
    tok = reusing.tokenizer
    for conversation, g in zip(conversations, reusing.generate(conversations, params)):
        assert g.extra["cached_tokens"] > 0
        prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = reusing.model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1] / 0.7
        expected = logits.log_softmax(-1).gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)


def test_the_store_keeps_only_the_latest_call_and_respects_its_limit(tiny_path, plain, reusing):
    conversations = [_start(i) for i in range(4)]
    sizes = []
    for turn in range(8):
        gens = reusing.generate(conversations, GREEDY)
        assert len(reusing._kv_store) == len(conversations)
        assert reusing.kv_store_tokens <= sum(g.prompt_tokens + len(g.token_ids) for g in gens)
        sizes.append(reusing.kv_store_tokens)
        # Every other turn the episodes restart, so the store must shrink back instead of accumulating.
        conversations = _next_turn(conversations, gens, turn) if turn % 2 == 0 else [_start(i) for i in range(4)]
    assert max(sizes) < 2 * min(sizes)

    # A store too small for all rows: some rows find their own history, the others only a shared prefix.
    small = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True, kv_store_max_tokens=200)
    conversations = [_start(i) for i in range(4)]
    for turn in range(3):
        got = small.generate(conversations, GREEDY)
        _assert_same(plain.generate(conversations, GREEDY), got)
        if turn:
            assert len({g.extra["cached_tokens"] > 30 for g in got}) == 2
        assert 0 < small.kv_store_tokens <= 200
        conversations = _next_turn(conversations, got, turn)
    off = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True, kv_store_max_tokens=0)
    off.generate([_start(0)], GREEDY)
    assert off.kv_store_tokens == 0 and off.generate([_start(0)], GREEDY)[0].extra["cached_tokens"] == 0
    assert reusing.kv_store_tokens > 0
    assert reusing.serve(tiny_path)["action"] == "already serving" and reusing.kv_store_tokens > 0
    reusing._load(tiny_path)  # what serve() does for another checkpoint: keys/values of old weights are dropped
    assert reusing.kv_store_tokens == 0


def test_plain_backend_keeps_nothing_and_get_backend_passes_kv_reuse(tiny_path, plain):
    plain.generate([_start(0)], GREEDY)
    assert plain.kv_store_tokens == 0
    clear_backends()
    try:
        assert get_backend(tiny_path, kv_reuse=True).kv_reuse
        assert not get_backend(tiny_path).kv_reuse
    finally:
        clear_backends()


def test_rows_without_any_cache_next_to_cached_rows(plain, reusing, monkeypatch):
    """Every templated prompt shares at least its first token with any stored entry, so force real misses:
    fully padded cache rows (their leading pads attend to nothing) must not disturb the other rows."""
    conversations = [_start(i) for i in range(6)]
    gens = reusing.generate(conversations, GREEDY)
    conversations = _next_turn(conversations, gens, 0)
    lookup = reusing._longest_prefix
    monkeypatch.setattr(reusing, "_longest_prefix", lambda p, apart: (None, 0) if len(p) % 2 else lookup(p, apart))
    monkeypatch.setattr(reusing, "max_batch_size", 6)
    got = reusing.generate(conversations, GREEDY)
    _assert_same(plain.generate(conversations, GREEDY), got)
    assert {g.extra["cached_tokens"] == 0 for g in got} == {True, False}
    for g in got:
        assert all(lp == lp for lp in g.logprobs)  # no NaN


def test_a_prefix_shared_by_a_whole_call_is_encoded_once(plain, reusing):
    demo = [{"role": "system", "content": "You play a text adventure. Answer with one action."},
            {"role": "user", "content": "Example room: " + "a table, " * 30 + "a door. Your action:"},
            {"role": "assistant", "content": "open door"}]
    conversations = [demo + [{"role": "user", "content": f"Room {i}: " + "a chair, " * i + "Your action:"}]
                     for i in range(6)]
    got = reusing.generate(conversations, GREEDY)  # an empty store: nothing to reuse but the shared prefix
    _assert_same(plain.generate(conversations, GREEDY), got)
    cached = {g.extra["cached_tokens"] for g in got}
    assert len(cached) == 1 and cached.pop() > 60  # every row reused the same few-shot prefix
    assert all(g.extra["prefill_tokens"] + g.extra["cached_tokens"] == g.prompt_tokens for g in got)
    # below the threshold (one prompt, or a short common prefix) nothing is shared
    assert reusing.generate(conversations[:1], GREEDY)[0].extra["cached_tokens"] > 0  # (the store's own entry)
    reusing.clear_kv_store()
    assert reusing.generate(conversations[:1], GREEDY)[0].extra["cached_tokens"] == 0


def test_a_step_reopening_the_backend_starts_with_an_empty_kv_store(tiny_path):
    """What a step samples must not depend on earlier steps' calls in the same process (exact resumes)."""
    clear_backends()
    try:
        first = get_backend(tiny_path, kv_reuse=True)
        first.generate([_start(0)], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert first.kv_store_tokens > 0
        again = get_backend(tiny_path, kv_reuse=True)
        assert again is first and again.kv_store_tokens == 0
    finally:
        clear_backends()


@pytest.mark.parametrize("pass_tokens", [0, 1e9])
def test_rows_prefilled_in_groups_generate_what_one_pass_does(plain, reusing, monkeypatch, pass_tokens):
    """pass_tokens 0: every row of a different length gets its own prefill pass, its keys/values then placed in
    the decoding cache's layout; 1e9: one pass a chunk, as before grouping. Both must match the plain path."""
    from rsiflow.models import hf_backend

    monkeypatch.setattr(hf_backend, "PREFILL_PASS_TOKENS", pass_tokens)
    passes = []
    prefill = reusing._prefill
    monkeypatch.setattr(reusing, "_prefill", lambda *a, **k: passes.append(len(a[2])) or prefill(*a, **k))
    monkeypatch.setattr(reusing, "max_batch_size", 6)
    conversations = [_start(i) for i in range(6)]
    split = False
    for turn in range(3):
        passes.clear()
        got = reusing.generate(conversations, GREEDY)
        _assert_same(plain.generate(conversations, GREEDY), got)
        assert sum(passes) == 6   # every row prefilled once (one chunk of 6)
        split |= len(passes) > 1
        if pass_tokens:
            assert len(passes) == 1
        conversations = _next_turn(conversations, got, turn)
    assert split == (pass_tokens == 0)


def test_prefill_groups_split_only_where_padding_costs_more_than_a_pass():
    from rsiflow.models.hf_backend import prefill_groups

    assert prefill_groups([100, 101, 99, 100], [0, 0, 0, 0], 0.0, pass_tokens=32) == [[0, 1, 2, 3]]
    assert prefill_groups([10, 500, 12, 490], [0, 0, 0, 0], 0.0, pass_tokens=32) == [[0, 2], [1, 3]]
    # attention over padded cached positions counts too: equal new lengths, very different cached ones
    assert prefill_groups([50, 50], [0, 4000], 0.0, pass_tokens=32) == [[0, 1]]
    assert prefill_groups([50, 50], [0, 4000], 1e-3, pass_tokens=32) == [[0], [1]]


def test_prefill_groups_find_the_cheapest_contiguous_split():
    import itertools
    import random

    from rsiflow.models.hf_backend import prefill_groups

    def cost(groups, new, cached, a, t):
        return sum(len(g) * max(new[i] for i in g) * (1 + a * (max(cached[i] for i in g) + max(new[i] for i in g)))
                   + t for g in groups)

    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 7)
        new = [rng.randint(1, 400) for _ in range(n)]
        cached = [rng.choice([0, rng.randint(1, 2000)]) for _ in range(n)]
        a, t = rng.choice([0.0, 2.6e-4, 1e-3]), rng.choice([0, 32, 200])
        order = sorted(range(n), key=lambda i: (new[i], cached[i]))
        brute = min(cost([order[i:j] for i, j in zip((0,) + cuts, cuts + (n,))], new, cached, a, t)
                    for k in range(n) for cuts in itertools.combinations(range(1, n), k))
        got = prefill_groups(new, cached, a, pass_tokens=t)
        assert sorted(i for g in got for i in g) == list(range(n))
        assert cost(got, new, cached, a, t) == pytest.approx(brute)


@pytest.mark.parametrize("temperature,sampler", [(0.0, "full"), (1.0, "full"), (1.0, "nucleus")])
def test_dropping_finished_rows_by_filling_their_slots_changes_no_bit(reusing, monkeypatch, temperature, sampler):
    """Finished rows leave the decoding batch by moving the last rows into their slots (fill_holes) instead of
    shifting every later row; rows are computed independently and sampled in their original order, so greedy
    and seeded outputs are the same, bit for bit, as with every row kept in order. On one thread: on two,
    PyTorch's decoding attention splits its work by batch position, and logprobs then differ in the last bits
    (4.8e-7 here) with the same tokens (models/threads.py)."""
    from rsiflow.models import hf_backend, threads

    monkeypatch.setattr(threads, "_setting", threads._setting)   # the session's setting, restored after the test
    threads.configure(1)

    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3, stop=("a",))  # rows end unevenly
    conversations = [_start(i) for i in range(10)]
    monkeypatch.setattr(reusing, "max_batch_size", 10)
    monkeypatch.setattr(reusing, "sampler", sampler)
    reordered = []

    def filling(keep):
        order = hf_backend_fill(keep)
        reordered.append(order != sorted(order))
        return order

    hf_backend_fill = hf_backend.fill_holes
    runs = []
    for fill in (lambda keep: keep, filling):
        monkeypatch.setattr(hf_backend, "fill_holes", fill)
        reusing.clear_kv_store()
        runs.append(reusing.generate(conversations, params))
    first, second = runs
    assert any(reordered)   # some batch held its rows out of order
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert [g.logprobs for g in first] == [g.logprobs for g in second]


def test_the_nucleus_sampler_is_seeded_and_its_logprobs_are_the_full_samplers(tiny_path, reusing, monkeypatch):
    """sampler 'nucleus': seeded calls repeat, and each drawn token's logprobs (nucleus and temperature-only)
    are what the 'full' path computes for that token by its own log-softmax of the same logits."""
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=11)
    conversations = [_start(i) for i in range(5)]
    monkeypatch.setattr(reusing, "sampler", "nucleus")
    first = reusing.generate(conversations, params)
    reusing.clear_kv_store()
    assert [g.token_ids for g in reusing.generate(conversations, params)] == [g.token_ids for g in first]
    tok = reusing.tokenizer
    for conversation, g in zip(conversations, first):
        prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = reusing.model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1].double()
        ids = torch.tensor(g.token_ids)[:, None]
        temp = (logits / 0.8).log_softmax(-1)
        nucleus = NucleusWarper(0.9)(None, logits / 0.8).log_softmax(-1)
        assert bool(torch.isfinite(nucleus.gather(1, ids)).all())   # every token drawn from the nucleus
        assert torch.allclose(torch.tensor(g.temp_logprobs).double(), temp.gather(1, ids).squeeze(1), atol=1e-4)
        assert torch.allclose(torch.tensor(g.logprobs).double(), nucleus.gather(1, ids).squeeze(1), atol=1e-4)


def test_a_turns_entry_shares_the_keys_values_it_reused_and_holds_the_whole_sequence(reusing):
    """Each episode's stored keys/values are two segments: the prefix the first call's rows shared (encoded once,
    the same tensors in every entry and in every later turn's entries, not copies) and the episode's own tokens;
    laid end to end they equal the row's keys/values of one plain forward pass."""
    rules = "You play a text adventure. Answer with one action. Never explain. " * 4
    conversations = [[{"role": "system", "content": rules}, *_start(i)[1:]] for i in range(3)]
    storage = set()
    for turn in range(3):
        gens = reusing.generate(conversations, GREEDY)
        for entry in reusing._kv_store:
            assert len(entry.segments) == 2 and sum(s[0].shape[2] for s in entry.segments) == len(entry.ids)
            storage |= {kv.untyped_storage().data_ptr() for kv in entry.segments[0]}
            with torch.no_grad():
                out = reusing.model(torch.tensor([entry.ids.tolist()]), use_cache=True)
            for index, layer in enumerate(out.past_key_values.layers):
                stored = torch.cat([segment[index] for segment in entry.segments], dim=2)
                assert torch.allclose(stored[0], layer.keys[0], atol=1e-4)
                assert torch.allclose(stored[1], layer.values[0], atol=1e-4)
        assert len(storage) == len(reusing.model.model.layers)   # one shared prefix, never copied
        conversations = _next_turn(conversations, gens, turn)


def _watch_prefix_attention(monkeypatch) -> tuple[list[int], list[dict]]:
    """Record the prefix length of every attention to a prefix kept apart; and a system prompt plus one example turn
    long enough to be such a prefix."""
    from rsiflow.models import hf_backend

    seen = []
    real = hf_backend._attend_to_shared_prefix
    monkeypatch.setattr(hf_backend, "_attend_to_shared_prefix",
                        lambda *args: seen.append(args[6][0].shape[2]) or real(*args))
    demo = [{"role": "system", "content": "You play a text adventure. Answer with one action. " * 3},
            {"role": "user", "content": "Example room: " + "a table, " * 20 + "a door. Your action:"},
            {"role": "assistant", "content": "open door"}]
    return seen, demo


def test_the_shared_prefix_is_attended_apart_when_on(tiny_path, plain, monkeypatch):
    """`shared_prefix_attention` on: every chunk whose rows all start with the call's shared prefix attends to that
    prefix apart (one copy, outside the rows' cache) and generates what the plain path does, turn after turn; off:
    never. auto: sampled calls, and greedy ones too for bfloat16 weights on CPU; float32 greedy calls (the gate's
    plays) attend over whole rows as before."""
    seen, demo = _watch_prefix_attention(monkeypatch)
    for on in (False, True):
        seen.clear()
        backend = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True, shared_prefix_attention=on)
        conversations = [demo + [{"role": "user", "content": f"Room {i}: " + "a chair, " * i + "Your action:"}]
                         for i in range(6)]
        for turn in range(3):
            got = backend.generate(conversations, GREEDY)
            _assert_same(plain.generate(conversations, GREEDY), got)
            conversations = _next_turn(conversations, got, turn)
        assert bool(seen) == on
        if on:   # always the call's shared prefix (system prompt + example), never more
            assert len(set(seen)) == 1 and seen[0] > 60
            assert all(len(entry.segments) == 2 and entry.segments[0][0].shape[2] == seen[0]
                       for entry in backend._kv_store)
    assert HFBackend(tiny_path, kv_reuse=True)._attend_prefix_apart == {"greedy": False, "sampled": True}
    if not torch.cuda.is_available():
        assert HFBackend(tiny_path, kv_reuse=True, dtype="bfloat16")._attend_prefix_apart == {"greedy": True,
                                                                                               "sampled": True}
    with pytest.raises(ValueError, match="shared_prefix_attention"):
        HFBackend(tiny_path, kv_reuse=True, shared_prefix_attention="sometimes")


def test_float32_greedy_calls_reuse_only_the_prefix_of_what_sampled_calls_computed_apart(tiny_path, plain,
                                                                                          monkeypatch):
    """auto on float32 weights: a sampled call attends to its shared prefix apart, a greedy call does not, and a greedy
    call after a sampled one reuses only the first segment (the prefix, computed over whole rows) of the entries the
    sampled call left: the keys/values after it were computed apart and differ in the last bits. Its own entries it
    then reuses in full."""
    seen, demo = _watch_prefix_attention(monkeypatch)
    conversations = [demo + [{"role": "user", "content": f"Room {i}: " + "a chair, " * i + "Your action:"}]
                     for i in range(6)]
    backend = HFBackend(tiny_path, max_batch_size=4, kv_reuse=True)
    sampled = backend.generate(conversations, SamplingParams(max_new_tokens=8, temperature=0.9, seed=1, stop=("\n",)))
    assert seen and all(entry.apart for entry in backend._kv_store)
    prefix = seen[0]
    seen.clear()
    conversations = _next_turn(conversations, sampled, 0)
    got = backend.generate(conversations, GREEDY)
    assert not seen
    assert [g.extra["cached_tokens"] for g in got] == [prefix] * len(got)
    assert not any(entry.apart for entry in backend._kv_store)
    _assert_same(plain.generate(conversations, GREEDY), got)
    conversations = _next_turn(conversations, got, 1)
    again = backend.generate(conversations, GREEDY)
    assert all(g.extra["cached_tokens"] > prefix for g in again)
    _assert_same(plain.generate(conversations, GREEDY), again)


def test_shared_prefix_attention_equals_attention_over_whole_rows_pads_and_float_masks_included():
    """`_attend_to_shared_prefix` against SDPA over [prefix][own] per row: a query that sees none of its own keys (a
    pad) attends to the prefix alone; a bool mask and its additive float form give the same; each layer of a pass
    gets the same mask object, converted once."""
    from types import SimpleNamespace

    from rsiflow.models.hf_backend import _attend_to_shared_prefix

    g = torch.Generator().manual_seed(7)
    query, key, value = (torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g),
                         torch.randn(2, 2, 5, 8, generator=g))
    prefix = torch.randn(2, 2, 6, 8, generator=g)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[0, :, 0] = False          # row 0's first query sees none of its own keys
    mask[1, :, :, :2] = False      # row 1 has two pads before its tokens
    whole_k = torch.cat([prefix[0:1].expand(2, -1, -1, -1), key], 2)
    whole_v = torch.cat([prefix[1:2].expand(2, -1, -1, -1), value], 2)
    whole_mask = torch.cat([torch.ones(2, 1, 3, 6, dtype=torch.bool), mask], 3)
    expected = torch.nn.functional.scaled_dot_product_attention(query, whole_k, whole_v, attn_mask=whole_mask,
                                                                enable_gqa=True).transpose(1, 2)
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    for layer in (0, 1):           # two layers of one pass: the same mask tensor
        for m in (mask, additive):
            got = _attend_to_shared_prefix(SimpleNamespace(layer_idx=layer), query, key, value, m, None,
                                           [prefix, prefix])
            assert torch.allclose(got, expected, atol=1e-5)
