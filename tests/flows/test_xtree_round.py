"""X-Tree in a real round on the tiny model, every use on: the tree stored with its occurrences, the online bonus
next to the verifier reward (which stays as the env gave it) and inside GRPO's advantages, ExIt's rows split by
token weights, the tree as the privileged teacher's context, all trained into one candidate and reported.

The tiny random model solves no real env, so the round plays a three-turn env defined here: an action of even
length is `up<text>`, of odd length `down<text>`, and an episode with two ups in a row wins (about a third of
random episodes): groups come out mixed and the symbol streams have structure to mine.
"""

import json
from collections import defaultdict

import duckdb
import pytest

from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard
from tests.conftest import TINY, tiny_overrides


class UpDownEnv(Env):
    name = "updown"
    task_types = ("updown",)

    def __init__(self):
        self._task, self._done, self._success, self._symbols = None, False, False, []

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed,
                                   lambda task_type, rng: {"question": f"Walk {rng.randrange(10**9)}"})

    def reset(self, task: TaskSpec) -> str:
        self._task, self._done, self._success, self._symbols = task, False, False, []
        return f"{task.spec['question']}: say a word, three times."

    def step(self, action: str) -> StepResult:
        guard = step_guard(self._task, self._done, self._success)
        if guard:
            return guard
        self._symbols.append(self.canonicalize(action))
        self._success = any(a == b == "up<text>" for a, b in zip(self._symbols, self._symbols[1:]))
        self._done = self._success or len(self._symbols) == 3
        return StepResult("Again." if not self._done else "Done.", float(self._success and self._done), self._done,
                          self._success, {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        return ["Two even-length replies in a row win."]

    def canonicalize(self, action: str) -> str:
        return "up<text>" if len(action.strip()) % 2 == 0 else "down<text>"

    def instructions(self) -> str:
        return "Reply with one word."


@pytest.mark.slow
def test_a_round_with_every_xtree_use(tmp_path, prefect_api):
    from rsiflow.flows.round import improvement_round

    overrides = tiny_overrides(tmp_path, "env.name=tests.flows.test_xtree_round:UpDownEnv", "env.kwargs={}",
                               "env.max_turns=3", "env.show_admissible=false", "env.project_actions=false",
                               "generate.group_size=4", "distill.methods=[xtree,grpo,exit]",
                               "distill.exit.dedupe=false", "distill.xtree.bonus=true",
                               "distill.xtree.token_weights=true", "distill.xtree.context=true",
                               "distill.xtree.eta0=0", "distill.xtree.eta1=0")
    improvement_round([TINY], overrides)
    con = duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True)

    def q(sql, *p):
        return con.execute(sql, list(p)).fetchall()

    (tree_id, n_traj, n_nodes, uses), = q("SELECT tree_id, n_trajectories, n_nodes, uses FROM xtree_trees")
    assert tree_id == "tiny/r1/xtree" and n_traj == 16 and n_nodes > 0 and uses == ["bonus", "token_weights", "context"]
    # occurrences point at turns whose symbols spell the node's span
    bad = q("SELECT count(*) FROM xtree_occurrences o JOIN xtree_nodes n USING (tree_id, node_idx)"
            " WHERE n.span <> (SELECT list(u.action_symbol ORDER BY u.turn_idx) FROM turns u"
            "   WHERE u.traj_id = o.traj_id AND u.turn_idx >= o.turn_start AND u.turn_idx < o.turn_end)")
    assert bad == [(0,)]
    # the bonus sits next to the verifier reward, which stays the env's; GRPO trained on their sum
    rows = q("SELECT b.traj_id, b.verifier_reward, t.reward, b.bonus, b.lambda_g, b.win_rate, e.meta"
             " FROM xtree_bonus b JOIN trajectories t USING (traj_id)"
             " JOIN examples e ON e.source_traj_id = b.traj_id AND e.method = 'grpo'")
    assert len(rows) == 16
    groups = defaultdict(list)
    for _, verifier, reward, bonus, lam, win, meta in rows:
        meta = json.loads(meta)
        assert verifier == reward == meta["reward"] and meta["shaped_reward"] == pytest.approx(reward + bonus)
        assert lam == pytest.approx(0.2 * (1 - win))
        groups[meta["group_id"]].append(meta["advantage"])
    assert all(abs(sum(a)) < 1e-6 for a in groups.values())
    # ExIt: each success split into runs of equal token weight, mean weight 1 per trajectory
    weights = defaultdict(list)
    for src, w, meta in q("SELECT source_traj_id, weight, meta FROM examples WHERE method = 'exit'"):
        s, e = json.loads(meta).get("turns", [0, None])
        n = e - s if e is not None else q("SELECT n_turns FROM trajectories WHERE traj_id = ?", src)[0][0]
        weights[src] += [w] * n
    (succ,), = q("SELECT count(*) FROM trajectories WHERE step = 'generate' AND success")
    assert len(weights) == succ and all(sum(w) / len(w) == pytest.approx(1.0) for w in weights.values())
    # context pairs trained by the privileged-teacher term, in the same candidate as GRPO and ExIt
    (tm,), = q("SELECT train_metrics FROM models WHERE model_id = 'tiny/r1/candidate'")
    tm = json.loads(tm)
    (pairs,), = q("SELECT count(*) FROM foresight WHERE channel = 'xtree'")
    assert pairs > 0 and tm["distill_examples"] == pairs and tm["distill_loss_mean"] is not None
    trained = {m for (m,) in q("SELECT DISTINCT e.method FROM train_inputs i JOIN examples e USING (example_id)")}
    assert {"xtree", "grpo"} <= trained and ("exit" in trained) == (succ > 0)
    con.close()
    report = (tmp_path / "runs" / "tiny" / "report" / "report.md").read_text()
    assert "X-Tree per round" in report and "Top nodes of round 1's tree" in report and "<text>" in report
