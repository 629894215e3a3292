"""bench.survey on the tiny model: per-type rows whose figures are consistent (pass@k is at least the sampled
mean; greedy successes within n), distinct tasks only, and a JSON with the per-task outcomes."""

import json

from bench.survey import main
from tests.conftest import TINY


def test_survey_figures_are_consistent(tmp_path, capsys):
    out = tmp_path / "survey.json"
    assert main(["--config", TINY, "--set", "env.name=arithmetic", "--set", "env.kwargs={levels: [level1, level2]}",
                 "--set", "env.max_turns=2", "--set", "env.show_admissible=false", "--set",
                 "env.project_actions=false", "--tasks", "6", "--samples", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["task_type"] for r in result["rows"]} == {"level1", "level2", "all"}
    for r in result["rows"]:
        assert r["distinct"] == r["n"] and 0 <= r["greedy_successes"] <= r["n"]
        assert r["pass_at_3"] >= r["sampled_mean"] - 1e-12
    assert len(result["per_task"]) == 6 and all(len(t["sampled"]) == 3 for t in result["per_task"])
    assert "| all | 6 (6) |" in capsys.readouterr().out
