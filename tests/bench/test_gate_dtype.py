"""bench.gate_dtype: the same dtype twice agrees with itself on every figure; another dtype plays the same tasks
and the report has a row per model and dtype; the gate's decisions are the gate's own on each block."""

import json

from bench.gate_dtype import decisions, main
from rsiflow.stats.gating import Rule
from tests.conftest import TINY

ARGS = ["--config", TINY, "--set", "env.name=arithmetic", "--set", "env.kwargs={levels: [level1, level2]}",
        "--set", "env.max_turns=2", "--set", "env.show_admissible=false", "--set", "env.project_actions=false",
        "--set", "gate.heldout_tasks=3", "--tasks", "6", "--samples", "2"]


def test_one_dtype_against_itself_agrees_everywhere(tmp_path, tiny_path, capsys):
    out = tmp_path / "same.json"
    assert main([*ARGS, "--candidate", str(tiny_path), "--dtypes", "float32,float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    f = result["figures"]["candidate"]["float32"]
    assert f["identical_actions"] == 6 and f["only_reference"] == f["only_other"] == 0
    assert f["sampled"]["identical_plays"] == 12 and f["sampled"]["diff"][0] == 0
    assert [len(result["gates"]["float32"][m]) for m in ("greedy", "sampled")] == [3, 3]  # two blocks and all six
    assert "decisions the same in every dtype: 6 of 6" in capsys.readouterr().out


def test_bfloat16_plays_the_same_tasks(tmp_path, capsys):
    out = tmp_path / "bf16.json"
    assert main([*ARGS, "--samples", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["outcomes"]) == {"float32", "bfloat16"}
    assert all(len(result["outcomes"][d]["base"]["greedy"]) == 6 for d in ("float32", "bfloat16"))
    text = capsys.readouterr().out
    assert "| base | float32 | 6/6 = 1.000 |" in text and "| base | bfloat16 |" in text


def test_decisions_per_block_are_the_gates():
    rule = Rule("paired_test", 0.05)
    cand = {"greedy": [True] * 10 + [False] * 10}
    champ = {"greedy": [False] * 10 + [False] * 10}
    rows = decisions(cand, champ, rule, 10, 0)["greedy"]
    assert [(r["tasks"], r["decision"], r["wins"]) for r in rows] == [
        ([0, 10], "promote", 10), ([10, 20], "reject", 0), ([0, 20], "promote", 10)]
