"""bench.shared_prefix runs the backend's own shared-prefix attention against SDPA over whole rows and prints both
timings; the two attentions agree to float rounding (the bench's figures are meaningless otherwise)."""

import re

from bench import shared_prefix


def test_both_attentions_agree_and_the_bench_prints_them(capsys):
    r = shared_prefix.compare(rows=3, shared=40, new=5, own=20, repeat=1)
    assert r["max_diff"] < 1e-5 and r["in_every_row"] > 0 and r["apart"] > 0
    r = shared_prefix.compare(rows=3, shared=40, new=1, own=20, repeat=1)   # a decoding step
    assert r["max_diff"] < 1e-5
    shared_prefix.main(["--repeat", "1", "--rows", "2", "--shared", "40"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 rows, 40-token shared prefix")
    assert len(lines) >= 3 and all(
        re.fullmatch(r".+ thread\(s\): prefix in every row [\d.]+ ms, apart [\d.]+ ms = [\d.]+x; largest difference "
                     r"\S+", line) for line in lines[1:])
