"""bench.sampler end to end on the tiny model: it plays, re-scores, times both top-p filters and prints them."""

import re
import subprocess
import sys

from tests.conftest import REPO


def test_bench_sampler_prints_both_filters_and_their_agreement():
    out = subprocess.run([sys.executable, "-m", "bench.sampler", "--model", "tiny:0", "--episodes", "2", "--turns", "1",
                          "--batch", "4", "--repeats", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    hf = re.search(r"\| top-p, transformers TopPLogitsWarper \(full sort\) \| ([0-9.]+) \|", out.stdout)
    ours = re.search(r"\| top-p, rsiflow NucleusWarper \| ([0-9.]+) \|", out.stdout)
    agree = re.search(r"kept sets differ in (\d+) of (\d+) rows", out.stdout)
    assert hf and ours and agree, out.stdout
    assert float(hf.group(1)) > 0 and float(ours.group(1)) > 0
    assert int(agree.group(2)) >= 4 and int(agree.group(1)) == 0, out.stdout
