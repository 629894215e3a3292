"""bench.train and bench.roofline at tiny size: the trainer's real path is timed and set against the limit
measured in the same process."""

import re
import subprocess
import sys

import pytest
import torch

from bench import roofline
from tests.conftest import REPO


def test_flops_per_token_counts_every_linear_weight_twice():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3, bias=False))
    assert roofline.flops_per_token(model) == 2 * (4 * 8 + 8 * 3)


@pytest.mark.slow
def test_bench_train_prints_its_fraction_of_the_limit():
    out = subprocess.run([sys.executable, "-m", "bench.train", "--model", "tiny:0", "--rows", "4",
                          "--batch-size", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    steps = re.search(r"rows     : (\d+) tokens .*, (\d+) optimizer steps", out.stdout)
    fraction = re.search(r"fraction : ([0-9.]+) of the limit", out.stdout)
    assert steps and int(steps.group(1)) > 0 and int(steps.group(2)) == 2
    assert fraction and 0 < float(fraction.group(1)) < 1, out.stdout


class _Config:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 2, 4, 2, 16


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.proj = torch.nn.Linear(16, 16, bias=False)  # 256 float32 weights = 1,024 bytes


def test_decode_step_bytes_count_the_weights_once_and_each_rows_keys_and_values():
    model = _Model()
    per_position = 2 * 2 * 2 * 4 * 4   # keys and values x layers x kv heads x head dim (16 / 4) x float32 bytes
    assert roofline.kv_bytes_per_position(model) == per_position
    assert roofline.kv_bytes_per_position(model, torch.bfloat16) == per_position // 2
    assert roofline.decode_step_bytes(model, rows=3, context=10) == 1024 + 3 * 10 * per_position
    # a prefix all rows attend to from one copy is read once
    assert roofline.decode_step_bytes(model, rows=3, context=4, shared=6) == 1024 + (3 * 4 + 6) * per_position


def test_a_decode_step_is_bound_by_the_slower_of_its_two_roofs():
    model = _Model()
    flops_bound = roofline.decode_step_limit(model, 2, 1, flops=1.0, bandwidth=1e12)
    assert flops_bound == 2 * roofline.flops_per_token(model)          # compute roof: 2 rows x 512 FLOPs
    bytes_bound = roofline.decode_step_limit(model, 2, 1, flops=1e12, bandwidth=1.0)
    assert bytes_bound == roofline.decode_step_bytes(model, 2, 1)      # memory roof


def test_read_bandwidth_is_a_positive_rate():
    assert roofline.read_bandwidth("cpu", gib=1 / 64, seconds=0.05) > 0
