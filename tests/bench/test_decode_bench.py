"""bench.decode end to end on the tiny model: it plays, re-scores, times both top-p filters and both caches."""

import re
import subprocess
import sys

from tests.conftest import REPO


def test_bench_decode_prints_both_filters_both_caches_and_their_agreement():
    out = subprocess.run([sys.executable, "-m", "bench.decode", "--model", "tiny:0", "--episodes", "2", "--turns", "1",
                          "--batch", "4", "--repeats", "1", "--contexts", "40,90"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    hf = re.search(r"\| top-p, transformers TopPLogitsWarper \(full sort\) \| ([0-9.]+) \|", out.stdout)
    ours = re.search(r"\| top-p, rsiflow NucleusWarper \| ([0-9.]+) \|", out.stdout)
    agree = re.search(r"kept sets differ in (\d+) of (\d+) rows", out.stdout)
    assert hf and ours and agree, out.stdout
    assert float(hf.group(1)) > 0 and float(ours.group(1)) > 0
    assert int(agree.group(2)) >= 4 and int(agree.group(1)) == 0, out.stdout
    race = re.search(r"\| whole sampling step, sampler 'nucleus' [^|]* \| ([0-9.]+) \|", out.stdout)
    assert race and float(race.group(1)) > 0, out.stdout
    assert re.search(r"sampler 'nucleus' vs 'full': sampling step [0-9.]+x faster", out.stdout), out.stdout
    caches = re.findall(r"\| context (\d+) \| ([0-9.]+) \| ([0-9.]+) \| [0-9.]+x \| (True|False) \|", out.stdout)
    assert [c[0] for c in caches] == ["40", "90"], out.stdout
    assert all(c[3] == "True" for c in caches)  # the reserved cache gives the same logits bit for bit
    weights = re.findall(r"\| (float32|bfloat16, attention in [a-z0-9]+[^|]*) \| (\d+) \| ([0-9.]+) \| ([0-9.]+) \|",
                         out.stdout)
    assert len(weights) == 3 and weights[0][3] == "1.00", out.stdout
