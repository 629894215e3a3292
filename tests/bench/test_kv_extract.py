"""bench.kv_extract runs and prints both copies' figures (it times `HFBackend._extract_row` with and without a base
entry, so it breaks if that signature or `_KVEntry` changes)."""

import re

from bench import kv_extract


def test_bench_kv_extract_prints_both_copies_and_their_ratio(capsys):
    kv_extract.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("threads ") and "600 of them the shared prefix" in lines[0]
    assert len(lines) == 4
    for line in lines[1:]:
        assert re.fullmatch(r"whole sequence copied [\d.]+ ms/row; shared prefix kept [\d.]+ ms/row = [\d.]+", line)
