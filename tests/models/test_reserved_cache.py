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
    for i, (batch, tokens) in enumerate([(4, 10), (4, 1), (3, 1), (3, 4), (3, 1)]):
        if i == 2:  # a row finished: dropped from both
            keep = torch.tensor([0, 2, 3])
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
