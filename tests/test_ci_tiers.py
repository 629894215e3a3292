"""The tests CI leaves out (tests/conftest.py FULL_ONLY) still exist under the names it lists: a renamed test would
otherwise slip back into CI's slow tier unnoticed, or the list would name nothing."""

import re

from tests.conftest import FULL_ONLY, REPO


def test_each_test_ci_leaves_out_is_a_test_of_its_file():
    for nodeid, why in FULL_ONLY.items():
        path, _, name = nodeid.partition("::")
        name, _, param = name.partition("[")
        source = (REPO / path).read_text()
        assert re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), f"{nodeid}: no such test in {path}"
        if param:
            assert f'"{param.rstrip("]")}"' in source, f"{nodeid}: no parameter {param.rstrip(']')!r} in {path}"
        assert why, nodeid


def test_ci_runs_the_slow_tier_without_them():
    ci = (REPO / ".ci" / "run").read_text()
    assert '-m "slow and not full"' in ci
