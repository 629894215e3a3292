"""bench.engine end to end at tiny size: the engine plays household episodes through the runner, the baseline
replays its calls, and the figures are printed (the bench broke once when the runner gained an argument)."""

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_bench_engine_prints_its_ratios():
    out = subprocess.run([sys.executable, "-m", "bench.engine", "--model", "tiny:0", "--episodes", "2",
                          "--max-turns", "2", "--max-new-tokens", "4", "--kv-reuse"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ratio = re.search(r"ratio    : engine / baseline = ([0-9.]+)", out.stdout)
    prefill = re.search(r"prefill  : (\d+) prompt tokens per episode vs final context (\d+)", out.stdout)
    assert ratio and float(ratio.group(1)) > 0
    assert prefill and int(prefill.group(1)) > 0 and int(prefill.group(2)) > 0
    # the roofline of the same run: a positive limit, and the engine's share of it below 1
    fraction = re.search(r"hf       : \d+ processed tok/s .* = ([0-9.]+) of the limit", out.stdout)
    assert fraction and 0 < float(fraction.group(1)) < 1, out.stdout
    # prefill and decoding apart, each against its own roof; the engine samples each row's first token from its
    # prefill's logits and every other one in a decoding step
    split = re.search(r"prefill  : (\d+) tokens .* = ([0-9.]+) of the matmul limit", out.stdout)
    decode = re.search(r"decode   : (\d+) tokens in (\d+) steps .* = ([0-9.]+) of the limit", out.stdout)
    sampled = re.search(r"engine   : (\d+) sampled tokens", out.stdout)
    rows = re.search(r"calls    : (\d+) rows", out.stdout)
    assert split and decode and sampled and rows, out.stdout
    # every episode's prompt tokens, shared prefixes once (the per-episode figure is rounded)
    assert int(split.group(1)) >= (int(prefill.group(1)) - 1) * 2
    assert int(decode.group(1)) == int(sampled.group(1)) - int(rows.group(1))
    # the tiny model's prefill can pass its "limit": its probe matmul (the MLP's shape, hidden 64) runs far
    # slower than its lm_head's; a real model's MLP is its bulk (bench/results/engine/)
    assert float(split.group(2)) > 0 and 0 < float(decode.group(3)) < 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_sampler_prints_its_mismatch_against_a_float32_trainer(dtype):
    """bf16 sampling by default, float32 when asked (packed layers, KV reuse, the prefix attended apart)."""
    out = subprocess.run([sys.executable, "-m", "bench.engine", "--model", "tiny:0", "--episodes", "2",
                          "--max-turns", "2", "--max-new-tokens", "4", "--kv-reuse", "--dtype", dtype,
                          "--no-baseline", "--mismatch-rows", "3", "--time-attention"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(rf"mismatch : {dtype} sampler vs float32 trainer over (\d+) tokens of (\d+) rows: mean \|delta "
                  r"logprob\| ([0-9.e-]+), KL\(sampler \|\| trainer\) (-?[0-9.e-]+), TIS-capped share ([0-9.]+)",
                  out.stdout)
    assert m, out.stdout
    assert int(m.group(2)) == 3 and int(m.group(1)) >= 3 and 0 <= float(m.group(5)) <= 1
    if dtype == "bfloat16":   # bf16 rounding moves the logprobs: a mismatch of exactly 0 would mean no scoring
        assert float(m.group(3)) > 0
    else:   # the same dtype: rounding-level differences only
        assert 0 <= float(m.group(3)) < 1e-3
    # attention timed inside the passes (the prefix the two episodes share attended apart: sampled calls): a part of
    # each kind of pass, every layer of every pass counted
    a = re.search(r"attention: prefill ([0-9.]+) s \((\d+) layer calls\) = ([0-9.]+) of prefill passes; decoding "
                  r"([0-9.]+) s \((\d+) layer calls\) = ([0-9.]+) of decoding steps", out.stdout)
    assert a, out.stdout
    assert int(a.group(2)) > 0 and int(a.group(5)) > 0 and 0 <= float(a.group(3)) <= 1 and 0 <= float(a.group(6)) <= 1
