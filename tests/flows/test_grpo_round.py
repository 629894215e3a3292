"""GRPO in a real round on the tiny model: advantages stored per trajectory with lineage, summing to 0 in
every mixed group; a candidate trained with TRL's GRPO loss; the round's GRPO figures reported.

The tiny random model solves no real env, so the round plays a coin env defined here: one reply, which
wins when its length is even (about half of random replies): groups come out mixed, as GRPO needs.
"""

import json
from collections import defaultdict

import duckdb
import pytest

from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard
from tests.conftest import TINY, tiny_overrides


class CoinEnv(Env):
    name = "coin"
    task_types = ("coin",)

    def __init__(self, always: bool = False):
        self.always = always  # every reply wins: every group is uniform
        self._task, self._done, self._success = None, False, False

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed,
                                   lambda task_type, rng: {"question": f"Coin {rng.randrange(10**9)}"})

    def reset(self, task: TaskSpec) -> str:
        self._task, self._done, self._success = task, False, False
        return f"{task.spec['question']}: say anything."

    def step(self, action: str) -> StepResult:
        guard = step_guard(self._task, self._done, self._success)
        if guard:
            return guard
        self._done, self._success = True, self.always or len(action) % 2 == 0
        return StepResult("Done.", float(self._success), True, self._success, {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        return ["Replies of even length win."]

    def canonicalize(self, action: str) -> str:
        return "say<text>"

    def instructions(self) -> str:
        return "Reply with one line of text."


@pytest.mark.slow
def test_grpo_round_on_mixed_groups(tmp_path, prefect_api):
    from rsiflow.flows.round import improvement_round

    overrides = tiny_overrides(tmp_path, "env.name=tests.flows.test_grpo_round:CoinEnv", "env.kwargs={}",
                               "env.max_turns=1", "env.show_admissible=false", "env.project_actions=false",
                               "generate.group_size=4", "distill.methods=[grpo]", "distill.grpo.passes=2")
    result = improvement_round([TINY], overrides)
    assert result["round"] == 1
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)

    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()

    rows = q("SELECT e.source_traj_id, e.meta, t.reward, t.group_id FROM examples e"
             " JOIN trajectories t ON t.traj_id = e.source_traj_id WHERE e.method = 'grpo'")
    assert len(rows) == 16  # every generated trajectory, with lineage
    by_group = defaultdict(list)
    for _, meta, reward, group in rows:
        m = json.loads(meta)
        assert m["reward"] == reward and m["group_id"] == group
        by_group[group].append((reward, m["advantage"]))
    mixed = [g for g in by_group.values() if len({r for r, _ in g}) > 1]
    assert mixed, "the coin env should give mixed groups"
    for g in by_group.values():
        assert abs(sum(a for _, a in g)) < 1e-6                       # advantages sum to 0 per group
        if g not in mixed:
            assert all(a == 0.0 for _, a in g)                        # uniform groups: zero, kept and counted
        else:
            assert all((a > 0) == (r > 0) for r, a in g)              # winners up, losers down
    (tm,), = q("SELECT train_metrics FROM models WHERE model_id = 'tiny/r1/candidate'")
    tm = json.loads(tm)
    assert tm["pg_rows"] == sum(len(g) for g in mixed) and tm["passes"] == 2
    assert tm["mismatch_mean_abs_delta"] is not None and tm["correction"] == "tis"
    (metrics,), = q("SELECT metrics FROM rounds WHERE round = 1")
    grpo = json.loads(metrics)["grpo"]
    assert grpo["mixed"] == len(mixed) and grpo["mixed"] + grpo["all_fail"] + grpo["all_pass"] == 4
    assert grpo["pg_rows"] == tm["pg_rows"]
    con.close()
    report = (tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert "GRPO per round" in report


@pytest.mark.slow
def test_a_round_of_uniform_groups_trains_no_candidate(tmp_path, prefect_api):
    """Every group all-pass: every advantage is 0, nothing can be trained, so no candidate (a copy of the
    champion) is registered or gated: the gate records a skip, the rows are still stored and counted."""
    from rsiflow.flows.round import improvement_round

    overrides = tiny_overrides(tmp_path, "env.name=tests.flows.test_grpo_round:CoinEnv", "env.kwargs={always: true}",
                               "env.max_turns=1", "env.show_admissible=false", "env.project_actions=false",
                               "distill.methods=[grpo]")
    result = improvement_round([TINY], overrides)
    assert result["results"]["train"]["skipped"] == "all 8 rows have advantage 0 (uniform groups: no policy gradient)"
    assert result["results"]["train"]["pg_skipped_zero_advantage"] == 8
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)
    assert con.execute("SELECT decision FROM gate_decisions").fetchall() == [("skip",)]
    (reason,), = con.execute("SELECT evidence->>'reason' FROM gate_decisions").fetchall()
    assert reason == "all 8 rows have advantage 0 (uniform groups: no policy gradient): no candidate was trained"
    assert con.execute("SELECT count(*) FROM models").fetchall() == [(1,)]
    assert con.execute("SELECT count(*) FROM examples WHERE method = 'grpo'").fetchall() == [(8,)]
    (metrics,), = con.execute("SELECT metrics FROM rounds WHERE round = 1").fetchall()
    assert json.loads(metrics)["grpo"]["all_pass"] == 4
    con.close()
