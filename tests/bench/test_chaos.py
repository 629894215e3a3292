"""bench/chaos.py's comparison: rows lost, duplicated and changed by key; time-dependent columns and the run's
folder left out."""

from bench.chaos import TIME_DEPENDENT, _normalise, compare


def test_compare_counts_lost_duplicate_and_changed_rows_by_key():
    ref = [("a", "1"), ("b", "2"), ("c", "3")]
    chaos = [("a", "1"), ("b", "2x"), ("b", "2"), ("d", "4")]
    # c lost; b twice (one duplicate) and its rows differ (changed); d extra (counted as a duplicate)
    assert compare(ref, chaos) == {"reference": 3, "chaos": 4, "lost": 1, "duplicate": 2, "changed": 1}
    assert compare(ref, list(reversed(ref))) == {"reference": 3, "chaos": 3, "lost": 0, "duplicate": 0,
                                                 "changed": 0}


def test_time_dependent_keys_and_folders_are_normalised():
    assert all(TIME_DEPENDENT.search(k) for k in ("started_at", "wall_s", "foresight_s", "step_seconds",
                                                   "train_runtime", "train_samples_per_second"))
    assert not any(TIME_DEPENDENT.search(k) for k in ("p_s", "success", "seed", "loss"))
    cell = '{"loss": 0.5, "train_runtime": 3.2, "path": "/tmp/x/runs/m", "steps": [{"wall_s": 1, "n": 4.0}]}'
    assert _normalise(cell, "/tmp/x") == {"loss": 0.5, "path": "<dir>/runs/m", "steps": [{"n": 4}]}


def test_a_redeploy_record_compares_by_kind_and_path_not_by_what_the_process_did():
    held = {"redeploy": {"kind": "hf", "action": "reloaded weights in process", "path": "/tmp/x/m2", "seconds": 1.5}}
    fresh = {"redeploy": {"kind": "hf", "action": "nothing loaded in this process: the next step loads it",
                          "path": "/tmp/x/m2", "seconds": 0.0}}
    assert _normalise(held, "/tmp/x") == _normalise(fresh, "/tmp/x") == {"redeploy": {"kind": "hf", "path": "<dir>/m2"}}
    assert _normalise({"action": "kept elsewhere"}, "/tmp/x") == {"action": "kept elsewhere"}
    other = {"redeploy": {**held["redeploy"], "path": "/tmp/x/m3"}}
    assert _normalise(other, "/tmp/x") != _normalise(held, "/tmp/x")
