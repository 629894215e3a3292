"""bench.engine's figures from recorded forward passes and timings (no model run): prefill and decoding apart,
each against its own roof, and when vLLM's start pays off."""

import torch

from bench import roofline
from tests.bench.test_train_bench import _Model


def test_the_engine_bench_splits_prefill_from_decoding():
    from bench.engine import split_report

    model = _Model()
    passes = [{"rows": 2, "query": 5, "real": 8, "width": 5, "shared": 0, "seconds": 1.0},    # a padded prefill
              {"rows": 2, "query": 1, "real": 2, "width": 6, "shared": 0, "seconds": 0.5},    # two decoding steps,
              {"rows": 1, "query": 1, "real": 1, "width": 3, "shared": 4, "seconds": 0.25}]   # one with a prefix apart
    s = split_report(passes, model, generate_seconds=2.0, flops=1e9, bandwidth=1e9, kv_dtype=torch.float32)
    assert (s["prefill_tokens"], s["prefill_fed"], s["prefill_passes"]) == (8, 10, 1)
    assert (s["decode_tokens"], s["decode_steps"]) == (3, 2)
    assert s["outside_seconds"] == 0.25 and s["decode_rows"] == 1.5 and s["decode_context"] == 6.5
    least = (roofline.decode_step_limit(model, 2, 6, 1e9, 1e9)
             + roofline.decode_step_limit(model, 1, 3, 1e9, 1e9, shared=4))
    assert s["decode_of_limit"] == least / 0.75


def test_vllms_start_pays_off_once_the_seconds_it_saves_add_up_to_it():
    from bench.engine import break_even

    assert break_even(120.0, 3.0, 1.0) == 60.0   # 2 s saved an episode pays a 120 s start after 60 episodes
    assert break_even(120.0, 1.0, 1.0) is None and break_even(10.0, 1.0, 2.0) is None
