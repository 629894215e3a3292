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
