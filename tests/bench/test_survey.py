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


ARGS = ["--config", TINY, "--set", "env.name=arithmetic", "--set", "env.kwargs={levels: [level1, level2]}",
        "--set", "env.max_turns=2", "--set", "env.show_admissible=false", "--set", "env.project_actions=false",
        "--tasks", "6", "--samples", "2"]


def test_a_stopped_survey_resumes_to_the_figures_of_an_unbroken_one(tmp_path, monkeypatch):
    import bench.survey as survey

    monkeypatch.setattr(survey, "CHUNK_TASKS", 2)  # 3 greedy chunks, then 3 sampled chunks
    whole = tmp_path / "whole.json"
    assert main([*ARGS, "--out", str(whole)]) == 0

    broken = tmp_path / "broken.json"
    partial = tmp_path / "broken.json.partial"
    real_play, calls = survey.play_chunk, []

    def stop_on_fourth(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # the first sampled chunk: greedy is saved, nothing sampled yet
            raise KeyboardInterrupt
        return real_play(*a, **k)

    monkeypatch.setattr(survey, "play_chunk", stop_on_fourth)
    try:
        main([*ARGS, "--out", str(broken)])
    except KeyboardInterrupt:
        pass
    saved = json.loads(partial.read_text())["done"]
    assert len(saved["greedy"]) == 3 and not saved.get("sampled") and not broken.exists()

    played = []
    monkeypatch.setattr(survey, "play_chunk", lambda *a, **k: played.append(a[4]) or real_play(*a, **k))
    assert main([*ARGS, "--out", str(broken)]) == 0
    assert len(played) == 3 and not partial.exists()  # only the sampled chunks were played again
    a, b = json.loads(whole.read_text()), json.loads(broken.read_text())
    assert a["rows"] == b["rows"] and a["per_task"] == b["per_task"]

    # another setting refuses the partial file instead of mixing two surveys
    partial.write_text(json.dumps({"key": {"samples": 99}, "done": {}}))
    try:
        main([*ARGS, "--out", str(broken)])
    except SystemExit as e:
        assert "other settings" in str(e) and str(partial) in str(e)
    else:
        raise AssertionError("a partial file of other settings was taken")
