"""The run's report: the serving model per round, empty cells the Prefect UI shows as text, the whole history in
the run-level artifact, promotions marked on the plot."""

from rsiflow.tasks.report import (
    NONE,
    heldout_series,
    history_markdown,
    markdown_table,
    plot_png,
    promotion_points,
    round_table,
)


def _h(k, n):
    return {"successes": k, "n": n, "success_rate": k / n, "ci_low": max(0.0, k / n - 0.1),
            "ci_high": min(1.0, k / n + 0.1)}


def _rows(n_rounds=12):
    rows, champion = [], "r/base"
    for i in range(1, n_rounds + 1):
        promote = i in (2, 7)
        candidate = None if i == 5 else f"r/r{i}/candidate"   # round 5 trained nothing
        after = candidate if promote else champion
        rows.append({"round": i, "methods": [], "train_success": 0.25, "all_fail": 1, "all_pass": 0, "mixed": 3,
                     "projected": None, "examples": 0 if candidate is None else 8, "train_loss": None,
                     "champion_before": champion, "champion_heldout": _h(3 + i, 24),
                     "candidate_heldout": None if candidate is None else _h(4 + i, 24),
                     "decision": "skip" if candidate is None else ("promote" if promote else "reject"),
                     "rule": "paired_test", "wins": None if candidate is None else 5, "losses": 2,
                     "p_value": None if candidate is None else 0.03, "metric": "greedy", "detectable_gain": 0.1,
                     "champion_sampled": None, "candidate_sampled": None, "champion_after": after,
                     "step_seconds": {"generate": 10.0, "gate": 5.0}})
        champion = after
    return rows


def test_the_rounds_table_names_the_serving_model_and_has_no_bullet_cells():
    rows = _rows()
    table = round_table(rows)
    assert [t["serving model"] for t in table][:3] == ["r/base", "r/r2/candidate", "r/r2/candidate"]
    assert table[6]["serving model"] == "r/r7/candidate"
    assert table[4]["candidate held-out"] == NONE and table[4]["wins / losses"] == NONE
    assert not [c for t in table for c in t.values() if str(c).strip() in ("-", "")]
    md = markdown_table("r", rows)
    assert "| serving model |" in md and "| promote (greedy, p 0.03) | `r/r2/candidate` |" in md


def test_the_history_artifact_keeps_every_round():
    rows = _rows(12)
    text = history_markdown("r", rows)
    lines = [line for line in text.splitlines() if line.startswith("- round ")]
    assert [int(line.split()[2].rstrip(":")) for line in lines] == list(range(1, 13))
    assert "- round 7: promote (paired_test, p 0.03); `r/r7/candidate` serves; held-out 11/24" in text
    assert "- round 5: skip (paired_test); `r/r2/candidate` serves" in text
    assert history_markdown("r", []).endswith("no round yet\n")


def test_the_plot_marks_the_promotions(tmp_path):
    rows = _rows(8)
    series = [(label, h) for label, h in heldout_series(rows) if h]
    assert promotion_points(rows, series) == [(2, 6 / 24), (7, 11 / 24)]
    assert plot_png("r", rows, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
