"""The gate's sampled metric and the final test split without a model: scripted outcomes stand in for play() (a
model solves sampled play j of task i when (i, j) is in its set), a real store records what happened."""

import logging

import pytest

import rsiflow.tasks.final_test as final_test
import rsiflow.tasks.gate as gate
from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.envs import make_env
from rsiflow.stores.store import Store
from tests.conftest import TINY, tiny_overrides

RUN = "tiny"
K = 4


def _index(traj_id: str) -> tuple[int, int]:
    """(task index, sample index) of a gate or test trajectory id ('.../0003' greedy, '.../0003-02' sampled)."""
    last = traj_id.rsplit("/", 1)[-1]
    task, _, sample = last.partition("-")
    return int(task), int(sample or 0)


@pytest.fixture
def scripted(monkeypatch):
    """play() marks each episode solved per `solves[path]` (greedy: the set `greedy`, sampled: pairs (i, j));
    records (path, temperature, seed, number of episodes) per call."""
    calls, solves = [], {}

    def play(cfg, backend, episodes, temperature, seed, desc):
        calls.append((backend, temperature, seed, len(episodes)))
        for e in episodes:
            i, j = _index(e.traj_id)
            got = solves[backend]["sampled"] if temperature > 0 else solves[backend]["greedy"]
            e.success = (i, j) in got if temperature > 0 else i in got
            e.status = "success" if e.success else "failure"
        return episodes

    for module in (gate, final_test):
        monkeypatch.setattr(module, "play", play, raising=False)
    monkeypatch.setattr(gate, "backend_for", lambda cfg, path, evaluation=False: path)
    monkeypatch.setattr(gate, "get_run_logger", lambda: logging.getLogger("test-gate"))
    monkeypatch.setattr(gate, "emit_event", lambda **kwargs: None)
    return calls, solves


def register(store, round_no, model_id, path, role, parent=None):
    with store.step(RUN, round_no, "train" if round_no else "register_base") as tx:
        tx.insert("models", [{"model_id": model_id, "parent_id": parent, "path": path, "role": role}])


def _cfg(tmp_path, *extra):
    return load_config([TINY], tiny_overrides(tmp_path, "gate.rule=paired_test", "gate.heldout_tasks=10",
                                              f"gate.samples={K}", "diagnostics.enabled=false", *extra))


def test_the_sampled_metric_decides_on_per_task_counts_with_independent_fresh_seeds(tmp_path, scripted):
    calls, solves = scripted
    cfg = _cfg(tmp_path, "gate.metric=sampled")
    # greedy: both solve tasks 0-4 (no difference); sampled: the base solves 1 of 4 plays of every task, the
    # candidate 3 of 4: every task +2, p = 2^-10 (all 10 signs must be +)
    solves["base-path"] = {"greedy": set(range(5)), "sampled": {(i, 0) for i in range(10)}}
    solves["r1-path"] = {"greedy": set(range(5)), "sampled": {(i, j) for i in range(10) for j in range(3)}}
    with Store(cfg.run.store) as store:
        store.create_run(RUN, RUN, {}, "tiny:0")
        register(store, 0, "tiny/base", "base-path", "base")
        register(store, 1, "tiny/r1/candidate", "r1-path", "candidate", "tiny/base")
    summary = gate.gate_candidate.fn(cfg, 1)
    assert summary["decision"] == "promote" and summary["metric"] == "sampled" and summary["samples"] == K
    assert summary["candidate"] == 0.75 and summary["champion"] == 0.25
    assert summary["p_value"] == 2 ** -10
    sampled_calls = [c for c in calls if c[1] > 0]
    assert [(c[0], c[3]) for c in sampled_calls] == [("r1-path", 10 * K), ("base-path", 10 * K)]
    assert sampled_calls[0][2] != sampled_calls[1][2]                   # independent seeds
    assert sampled_calls[0][2] == gate.sample_seed(cfg.gate.seed, 1, "candidate")
    assert gate.sample_seed(cfg.gate.seed, 2, "champion") != gate.sample_seed(cfg.gate.seed, 1, "champion")
    with Store(cfg.run.store, read_only=True) as store:
        (d,) = store.promotion_history(RUN)
        ev = d["evidence"]
        assert ev["paired"]["greedy"]["wins"] == 0 and ev["paired"]["greedy"]["p_value"] == 1.0
        assert ev["paired"]["sampled"]["paired_diff"] == 0.5 and ev["detectable_gain"] > 0
        assert ev["heldout"]["candidate"]["sampled"]["successes"] == 30
        rows = store.rows("SELECT model_id, split, n, successes FROM evaluations WHERE task_type = '*' ORDER BY 1, 2")
        assert rows == [{"model_id": "tiny/base", "split": "heldout", "n": 10, "successes": 5},
                        {"model_id": "tiny/base", "split": "heldout:sampled", "n": 40, "successes": 10},
                        {"model_id": "tiny/r1/candidate", "split": "heldout", "n": 10, "successes": 5},
                        {"model_id": "tiny/r1/candidate", "split": "heldout:sampled", "n": 40, "successes": 30}]
        # the sampled plays are never taken for the greedy results the gate reuses
        assert all(r["traj_id"].count("/sampled/") == 0 for r in store.eval_trajectories(RUN, "tiny/base"))


def test_the_greedy_metric_ignores_a_sampled_gain(tmp_path, scripted):
    calls, solves = scripted
    cfg = _cfg(tmp_path)                                          # gate.metric greedy (default), samples recorded
    solves["base-path"] = {"greedy": set(range(5)), "sampled": set()}
    solves["r1-path"] = {"greedy": set(range(5)), "sampled": {(i, j) for i in range(10) for j in range(K)}}
    with Store(cfg.run.store) as store:
        store.create_run(RUN, RUN, {}, "tiny:0")
        register(store, 0, "tiny/base", "base-path", "base")
        register(store, 1, "tiny/r1/candidate", "r1-path", "candidate", "tiny/base")
    summary = gate.gate_candidate.fn(cfg, 1)
    assert summary["decision"] == "reject" and summary["metric"] == "greedy"
    with Store(cfg.run.store, read_only=True) as store:
        (d,) = store.promotion_history(RUN)
        assert d["evidence"]["paired"]["sampled"]["p_value"] == 2 ** -10


def test_sampled_metric_needs_samples():
    with pytest.raises(ConfigError, match="gate.samples to at least 2"):
        load_config([], ["gate.metric=sampled"])


def test_distinct_tasks_drops_repeats_and_excluded_specs():
    env = make_env("arithmetic", levels=["level1"])     # one-step sums below 10: a small space, many repeats
    drawn = env.sample_tasks("heldout", 40, 7)
    assert len({gate.spec_key(t) for t in drawn}) < 40
    tasks = gate.distinct_tasks(env, "heldout", 12, 7)
    keys = [gate.spec_key(t) for t in tasks]
    assert len(tasks) == 12 and len(set(keys)) == 12
    assert keys == [gate.spec_key(t) for t in gate.distinct_tasks(env, "heldout", 20, 7)][:12]   # a prefix
    other = gate.distinct_tasks(env, "heldout", 5, 8, exclude=set(keys))
    assert not {gate.spec_key(t) for t in other} & set(keys)
    # the split holds fewer distinct tasks than asked: all of them, not a repeat
    everything = gate.distinct_tasks(env, "heldout", 10_000, 7)
    assert len(everything) == len({gate.spec_key(t) for t in everything}) < 200


def test_final_test_split_is_disjoint_from_the_gate_and_never_read_by_it(tmp_path, scripted):
    calls, solves = scripted
    cfg = _cfg(tmp_path, "gate.test_tasks=6", "gate.rule=always")
    solves["base-path"] = {"greedy": {0}, "sampled": {(0, 0)}}
    solves["r1-path"] = {"greedy": {0, 1, 2}, "sampled": {(i, 0) for i in range(6)}}
    with Store(cfg.run.store) as store:
        store.create_run(RUN, RUN, {}, "tiny:0")
        register(store, 0, "tiny/base", "base-path", "base")
        register(store, 1, "tiny/r1/candidate", "r1-path", "candidate", "tiny/base")
    assert gate.gate_candidate.fn(cfg, 1)["decision"] == "promote"
    with Store(cfg.run.store) as store:
        store.start_round(RUN, 1, "tiny/base")
        store.finish_round(RUN, 1, "tiny/r1/candidate", {})
    heldout = {gate.spec_key(t) for t in gate.heldout_tasks(cfg)}
    test = final_test.final_test_tasks(cfg)
    assert len(test) == 6 and not {gate.spec_key(t) for t in test} & heldout
    result = final_test.final_test(cfg)
    assert result["models"]["champion"]["greedy"]["successes"] == 3
    assert result["models"]["base"]["greedy"]["successes"] == 1
    assert result["models"]["champion"]["sampled"]["successes"] == 6
    assert result["champion_vs_base"]["greedy"]["wins"] == 2
    with Store(cfg.run.store, read_only=True) as store:
        assert final_test.stored_final_test(store, RUN) == result
        splits = {r["split"] for r in store.rows("SELECT DISTINCT split FROM evaluations")}
        assert {"test", "test:sampled"} <= splits
        # the gate's reuse reads held-out greedy plays only
        assert all("/test/" not in r["traj_id"] for r in store.eval_trajectories(RUN, "tiny/base"))
    assert any("Final test split" in line for line in final_test.describe(result))


def test_final_test_reuses_a_checkpoint_another_run_played_under_the_same_settings(tmp_path, scripted):
    calls, solves = scripted
    solves["base-path"] = {"greedy": {0}, "sampled": {(0, 0)}}
    first = _cfg(tmp_path, "gate.test_tasks=6")
    second = _cfg(tmp_path, "gate.test_tasks=6", "run.name=other")
    for cfg in (first, second):
        with Store(cfg.run.store) as store:
            store.create_run(cfg.run.name, cfg.run.name, {}, "tiny:0")
            with store.step(cfg.run.name, 0, "register_base") as tx:
                tx.insert("models", [{"model_id": f"{cfg.run.name}/base", "parent_id": None, "path": "base-path",
                                      "role": "base"}])
    one = final_test.final_test(first)
    played = len(calls)
    two = final_test.final_test(second)
    assert len(calls) == played and two["reused"] == ["base"] and one["reused"] == []
    assert two["models"] == one["models"] and two["outcomes"] == one["outcomes"]
    third = _cfg(tmp_path, "gate.test_tasks=6", "run.name=third", "gate.test_seed=99")   # other tasks: played
    with Store(third.run.store) as store:
        store.create_run("third", "third", {}, "tiny:0")
        with store.step("third", 0, "register_base") as tx:
            tx.insert("models", [{"model_id": "third/base", "parent_id": None, "path": "base-path", "role": "base"}])
    assert final_test.final_test(third)["reused"] == [] and len(calls) > played
