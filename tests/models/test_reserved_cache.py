"""The hf backend's decoding cache (ReservedCacheLayer) holds exactly what transformers' DynamicLayer holds."""

import torch
from transformers.cache_utils import DynamicLayer

from rsiflow.models.hf_backend import ReservedCacheLayer


def _kv(batch, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, tokens, 8, generator=g), torch.randn(batch, 3, tokens, 8, generator=g)


def _assert_same(a, b):
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


def test_updates_rows_dropped_and_overflow_match_a_dynamic_layer():
    plain, reserved = DynamicLayer(), ReservedCacheLayer(capacity=12)
    # rows dropped: one in the middle, its slot filled by the last row (fill_holes: one row moves, in place), the
    # first (the others move down in place), then a reordering (gathered into a new buffer)
    drops = {2: [0, 3, 2], 4: [1, 2], 5: [1, 0]}
    for i, (batch, tokens) in enumerate([(4, 10), (4, 1), (3, 1), (3, 4), (2, 1), (2, 1)]):
        if i in drops:
            keep = torch.tensor(drops[i])
            plain.batch_select_indices(keep)
            reserved.batch_select_indices(keep)
            _assert_same(plain, reserved)
        k, v = _kv(batch, tokens, seed=i)
        got, want = reserved.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if i == 0:
            assert reserved._keys.shape[-2] == 12  # room reserved up front
        if i == 3:  # 12 + 4 > 12: grown, with what it held copied
            assert reserved._keys.shape[-2] >= 16
    _assert_same(plain, reserved)


def test_fill_holes_moves_only_rows_beyond_the_new_batch_size():
    from rsiflow.models.hf_backend import fill_holes

    assert fill_holes([0, 2, 3]) == [0, 3, 2]
    assert fill_holes([0, 3, 5, 6]) == [0, 5, 6, 3]
    assert fill_holes([0, 1, 2]) == [0, 1, 2] and fill_holes([5, 7, 9]) == [5, 7, 9] and fill_holes([]) == []


def test_preloaded_and_placed_rows_are_the_padded_layout_a_dynamic_layer_gets():
    # preload: cached rows right-aligned after zeroed pads; place: a group's prefill moved into a wider layout
    g = torch.Generator().manual_seed(3)
    cached = [5, 0, 2]
    rows = [torch.randn(2, 3, c, 8, generator=g) if c else None for c in cached]
    padded = torch.zeros(2, 3, 3, 5, 8)
    for b, (kv, c) in enumerate(zip(rows, cached)):
        if c:
            padded[:, b, :, 5 - c:] = kv
    plain, reserved = DynamicLayer(), ReservedCacheLayer(capacity=9)
    plain.update(padded[0], padded[1])
    # each row as its parts laid end to end (the first row in two segments, as a reused entry keeps them)
    reserved.preload([[rows[0][:, :, :2], rows[0][:, :, 2:]], None, [rows[2]]], width=5)
    _assert_same(plain, reserved)
    k, v = _kv(3, 2, seed=4)  # the new tokens then go in place after them
    assert all(torch.equal(a, b) for a, b in zip(reserved.update(k, v), plain.update(k, v)))



def test_a_window_prefills_straight_into_its_rows_and_positions_of_a_larger_cache():
    # A group of 2 rows (5 cached positions at most, 2 new) prefilled into rows 1-2 of a 3-row chunk laid out for
    # 7 cached and 4 new positions: the window spans positions [7 - 5, 7 + 4), its gap of 4 - 2 positions zeroed.
    import pytest

    chunk = ReservedCacheLayer(capacity=14)
    chunk.allocate(3, 3, 8, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 3, 3, 8, generator=g)]
    window = chunk.window(slice(1, 3), 2, 11)
    window.preload([[kv] for kv in rows], width=5, gap=2)
    assert window.get_seq_length() == 7
    k, v = _kv(2, 2, seed=6)
    window.update(k, v)
    for b, kv in ((1, rows[0]), (2, rows[1])):
        c = kv.shape[2]
        for j, buf in enumerate((chunk._keys, chunk._values)):
            assert torch.equal(buf[b, :, 7 - c:7], kv[j])                 # cached, right-aligned at the chunk's C
            assert not buf[b, :, :7 - c].any() and not buf[b, :, 7:9].any()   # pads (before and in the window), gap
            assert torch.equal(buf[b, :, 9:11], (k, v)[j][b - 1])          # new tokens at the end of the layout
    with pytest.raises(RuntimeError, match="cannot take"):
        window.update(*_kv(2, 1, seed=7))                                 # a window never grows


def test_decoding_with_the_reserved_cache_gives_the_same_logits(tiny_path):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    ids = torch.randint(5, 200, (3, 20), generator=torch.Generator().manual_seed(0))
    logits = []
    for reserved in (False, True):
        cache = DynamicCache(config=model.config)
        if reserved:
            cache.layers = [ReservedCacheLayer(24) for _ in cache.layers]
        with torch.inference_mode():
            out = model(input_ids=ids, cache=cache, use_cache=True)
            steps = [out.logits[:, -1]]
            for _ in range(6):
                out = model(input_ids=steps[-1].argmax(-1)[:, None], cache=cache, use_cache=True)
                steps.append(out.logits[:, -1])
        logits.append(torch.stack(steps))
    assert torch.equal(logits[0], logits[1])


def test_half_precision_weights_on_cpu_attend_in_float32_over_a_float32_cache(tiny_path):
    from rsiflow.models.backend import SamplingParams
    from rsiflow.models.hf_backend import FLOAT32_SDPA, GROUPED_SDPA, HFBackend

    conversations = [[{"role": "user", "content": f"Room {i}: a corridor, a door. Your action:"}] for i in range(3)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    full = HFBackend(tiny_path, kv_reuse=True)
    assert full.model.config._attn_implementation == GROUPED_SDPA and full._kv_dtype is None
    half = HFBackend(tiny_path, dtype="bfloat16", kv_reuse=True)
    assert next(half.model.parameters()).dtype == torch.bfloat16
    assert half.model.config._attn_implementation == FLOAT32_SDPA
    generations = half.generate(conversations, greedy)
    assert all(g.token_ids for g in generations)
    assert {kv.dtype for entry in half._kv_store for segment in entry.segments
                                     for kv in segment} == {torch.float32}  # what the next turn reuses


def test_float32_attention_is_sdpa_on_the_upcast_inputs():
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rsiflow.models.hf_backend import _sdpa_in_float32

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 8, generator=g).bfloat16()
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    got, _ = _sdpa_in_float32(module, q, k, v, None, scaling=0.3)
    want, _ = sdpa_attention_forward(module, q.float(), k, v, None, scaling=0.3)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_grouped_prefill_attention_is_transformers_sdpa_bit_for_bit():
    # A masked prefill of a grouped-query model: transformers copies each key/value head per query head it
    # serves; `enable_gqa` attends without the copy and must give the same output, bit for bit.
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rsiflow.models.hf_backend import _sdpa_grouped

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    for queries, cached in ((7, 0), (5, 40), (1, 40)):   # a fresh prefill, one after cached keys, a decoding step
        length = queries + cached
        q = torch.randn(3, 6, queries, 8, generator=g)
        k, v = torch.randn(3, 2, length, 8, generator=g), torch.randn(3, 2, length, 8, generator=g)
        mask = torch.ones(queries, length, dtype=torch.bool).tril(diagonal=cached)[None, None].repeat(3, 1, 1, 1)
        mask[1, :, :, :cached // 2] = False   # a padded row
        got, _ = _sdpa_grouped(module, q, k, v, mask, scaling=0.3)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        assert got.shape == want.shape == (3, queries, 6, 8) and torch.equal(got, want)


def test_half_precision_cached_turns_score_like_a_plain_forward(tiny_path):
    # The cached layout ([pad][cached][pad][new]) needs its padding mask: a custom attention name gets none from
    # transformers unless one is registered for it, and the rows then attend to their pads.
    from rsiflow.models.backend import SamplingParams
    from rsiflow.models.hf_backend import HFBackend

    backend = HFBackend(tiny_path, dtype="bfloat16", kv_reuse=True)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    conversations = [[{"role": "user", "content": "Room: " + "a dusty corridor, " * (3 * i) + "a door. Action:"}]
                     for i in range(3)]
    first = backend.generate(conversations, greedy)
    conversations = [c + [{"role": "assistant", "content": g.text}, {"role": "user", "content": "Next?" * (i + 1)}]
                     for i, (c, g) in enumerate(zip(conversations, first))]
    second = backend.generate(conversations, greedy)
    assert all(g.extra["cached_tokens"] > 0 for g in second)
    tok = backend.tokenizer
    for conversation, g in zip(conversations, second):
        prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logits = backend.model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0].float()
        scored = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        scored = scored.gather(1, torch.tensor(g.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(scored, torch.tensor(g.logprobs), atol=0.05), (scored, g.logprobs)
