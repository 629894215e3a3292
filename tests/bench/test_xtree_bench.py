"""bench.xtree at tiny sizes: both streams are timed against HF's BPE trainer, the planted routines of the synthetic
stream are found, and the household expert's sub-routines are listed per task type."""

from bench.xtree import exponent, household, main, synthetic


def test_prints_the_timing_table_and_the_planted_structure(capsys):
    main(["--sizes", "2000,4000", "--household-sizes", "1000"])
    out = capsys.readouterr().out
    assert "synthetic: growth exponent" in out and out.count("| synthetic |") == 2 and out.count("| household |") == 1
    assert "| 6/6 |" in out                                  # every planted routine is a node
    assert "| pick_heat_then_place | " in out and "heat<object,microwave>" in out


def test_streams_have_the_requested_size_and_are_seeded():
    traces, routines = synthetic(5000, seed=1)
    assert sum(len(t.symbols) for t in traces) == 5000 and len(routines) == 6
    assert [t.symbols for t in synthetic(5000, seed=1)[0]] == [t.symbols for t in traces]
    real = household(800, seed=0)
    assert sum(len(t.symbols) for t in real) == 800 and all(s.endswith(">") for t in real for s in t.symbols)
    assert any(t.success for t in real) and not all(t.success for t in real)


def test_exponent_is_the_log_log_slope():
    rows = [{"symbols": n, "t": 2e-6 * n ** 1.5} for n in (10, 100, 1000)]
    assert abs(exponent(rows, "t") - 1.5) < 1e-9
