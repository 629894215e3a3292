"""The gate step without a model: scripted outcomes (which held-out task each model solves) stand in for
play(), a real store records what happened. Growth plays only what a look adds, the champion's stored
results are reused task by task, every decision emits its Prefect event, and held-out samples are
prefixes of larger ones."""

import logging

import pytest

import rsiflow.tasks.gate as gate
from rsiflow.configs.loader import load_config
from rsiflow.configs.schema import ConfigError
from rsiflow.envs import make_env
from rsiflow.stores.store import Store
from tests.conftest import TINY, tiny_overrides

RUN = "tiny"
# which held-out task indices each model solves
SOLVES = {"base-path": {3, 7}, "r1-path": set(), "r2-path": set(range(8))}


@pytest.fixture
def scripted(monkeypatch):
    """Stand-ins for the backend and play(): play marks each episode solved per SOLVES and records
    (model path, task indices) per call; emitted events are recorded instead of sent."""
    calls, events = [], []

    def play(cfg, backend, episodes, temperature, seed, desc):
        calls.append((backend, [int(e.traj_id[-4:]) for e in episodes]))
        for e in episodes:
            e.success = int(e.traj_id[-4:]) in SOLVES[backend]
            e.status = "success" if e.success else "failure"
        return episodes

    monkeypatch.setattr(gate, "backend_for", lambda cfg, path, evaluation=False: path)
    monkeypatch.setattr(gate, "play", play)
    monkeypatch.setattr(gate, "get_run_logger", lambda: logging.getLogger("test-gate"))
    monkeypatch.setattr(gate, "emit_event", lambda **kwargs: events.append(kwargs))
    return calls, events


def register(store, round_no, model_id, path, role, parent=None):
    with store.step(RUN, round_no, "train" if round_no else "register_base") as tx:
        tx.insert("models", [{"model_id": model_id, "parent_id": parent, "path": path, "role": role}])


def test_growth_plays_only_what_each_look_adds_and_reuses_the_champions_stored_results(tmp_path, scripted):
    calls, events = scripted
    cfg = load_config([TINY], tiny_overrides(tmp_path, "gate.rule=paired_test", "gate.heldout_tasks=4",
                                             "gate.max_heldout_tasks=8", "diagnostics.enabled=false"))
    with Store(cfg.run.store) as store:
        store.create_run(RUN, RUN, {}, "tiny:0")
        register(store, 0, "tiny/base", "base-path", "base")
        register(store, 1, "tiny/r1/candidate", "r1-path", "candidate", "tiny/base")

    # round 1: the candidate solves nothing; at the first look it is behind (0 wins, 1 loss on task 3): reject
    assert gate.gate_candidate.fn(cfg, 1)["decision"] == "reject"
    assert calls == [("r1-path", [0, 1, 2, 3]), ("base-path", [0, 1, 2, 3])]
    assert not gate.partial_path(cfg, 1, "gate").exists()   # the saved plays go once the step is stored

    # round 2: solves all 8; first look 3 wins 0 losses, p = 1/8 > 0.05/2: grow; second look 6-0,
    # p = 1/64 <= 0.025: promote. The base reuses tasks 0-3 from round 1 and plays only 4-7.
    calls.clear()
    with Store(cfg.run.store) as store:
        register(store, 2, "tiny/r2/candidate", "r2-path", "candidate", "tiny/base")
    summary = gate.gate_candidate.fn(cfg, 2)
    assert summary["decision"] == "promote" and summary["n"] == 8 and summary["looks"] == 2
    assert calls == [("r2-path", [0, 1, 2, 3]), ("r2-path", [4, 5, 6, 7]), ("base-path", [4, 5, 6, 7])]
    with Store(cfg.run.store, read_only=True) as store:
        (decision,) = [d for d in store.promotion_history(RUN) if d["round"] == 2]
        ev = decision["evidence"]
        assert [look["verdict"] for look in ev["looks"]] == ["grow", "promote"]
        assert ev["p_value"] == 1 / 64 and ev["level"] == 0.025 and ev["wins"] == 6 and ev["losses"] == 0
        assert len(ev["task_ids"]) == 8 and ev["champion_tasks_reused"] == 4
        assert ev["champion_results_reused"] is False
        assert ev["champion_trajectories"][:4] == [f"tiny/r1/gate/champion/{i:04d}" for i in range(4)]
        assert ev["champion_trajectories"][4:] == [f"tiny/r2/gate/champion/{i:04d}" for i in range(4, 8)]
        assert store.champion(RUN) == "tiny/r2/candidate"
        (base_eval,) = [e for e in store.rows("SELECT * FROM evaluations WHERE round = 2 AND task_type = '*'"
                                              " AND model_id = 'tiny/base'")]
        assert base_eval["n"] == 8 and base_eval["successes"] == 2

    # round 3 trains nothing: skip; the new champion played the first 4 tasks in round 2: nothing to play
    calls.clear()
    assert gate.gate_candidate.fn(cfg, 3)["decision"] == "skip" and calls == []
    assert [(e["event"], e["payload"]["round"]) for e in events] == [
        ("rsiflow.gate.reject", 1), ("rsiflow.gate.promote", 2), ("rsiflow.gate.skip", 3)]
    assert {e["resource"]["prefect.resource.id"] for e in events} == {"rsiflow.run.tiny"}


def test_a_gate_stopped_after_the_candidates_plays_resumes_with_the_champions(tmp_path, scripted, monkeypatch):
    calls, _ = scripted
    cfg = load_config([TINY], tiny_overrides(tmp_path, "gate.rule=paired_test", "gate.heldout_tasks=4",
                                             "diagnostics.enabled=false"))
    with Store(cfg.run.store) as store:
        store.create_run(RUN, RUN, {}, "tiny:0")
        register(store, 0, "tiny/base", "base-path", "base")
        register(store, 1, "tiny/r1/candidate", "r1-path", "candidate", "tiny/base")
    scripted_play = gate.play

    def stop_at_the_champion(cfg, backend, *args, **kwargs):
        if backend == "base-path":
            raise KeyboardInterrupt  # the attempt is stopped here
        return scripted_play(cfg, backend, *args, **kwargs)

    monkeypatch.setattr(gate, "play", stop_at_the_champion)
    with pytest.raises(KeyboardInterrupt):
        gate.gate_candidate.fn(cfg, 1)
    assert calls == [("r1-path", [0, 1, 2, 3])] and gate.partial_path(cfg, 1, "gate").exists()
    monkeypatch.setattr(gate, "play", scripted_play)
    assert gate.gate_candidate.fn(cfg, 1)["decision"] == "reject"
    assert calls == [("r1-path", [0, 1, 2, 3]), ("base-path", [0, 1, 2, 3])]   # the candidate did not play again
    with Store(cfg.run.store, read_only=True) as store:
        assert len(store.rows("SELECT * FROM trajectories WHERE round = 1")) == 8
    assert not gate.partial_path(cfg, 1, "gate").exists()


def test_gate_event_names_the_decision_the_run_and_the_models(monkeypatch):
    sent = []
    monkeypatch.setattr(gate, "emit_event", lambda **kwargs: sent.append(kwargs))
    event = gate.gate_event("m1", 3, "promote", "m1/r3/candidate", "m1/r2/candidate", "m1/r3/candidate",
                            {"rule": "paired_test", "candidate": 0.5, "champion": 0.25, "p_value": 0.03})
    gate.emit_gate_event(event, logging.getLogger("test-gate"))
    (kwargs,) = sent
    assert kwargs["event"] == "rsiflow.gate.promote"
    assert kwargs["resource"] == {"prefect.resource.id": "rsiflow.run.m1", "prefect.resource.name": "m1"}
    assert [(r["prefect.resource.id"], r["prefect.resource.role"]) for r in kwargs["related"]] == [
        ("rsiflow.model.m1/r3/candidate", "candidate"), ("rsiflow.model.m1/r2/candidate", "champion")]
    assert kwargs["payload"]["round"] == 3 and kwargs["payload"]["decision"] == "promote"
    assert kwargs["payload"]["rule"] == "paired_test" and kwargs["payload"]["p_value"] == 0.03
    skip = gate.gate_event("m1", 4, "skip", None, "m1/r3/candidate", "m1/r3/candidate", {})
    assert [r["prefect.resource.role"] for r in skip["related"]] == ["champion"]


def test_a_failing_event_is_logged_and_never_fails_the_step(monkeypatch, caplog):
    def broken(**kwargs):
        raise ConnectionError("no API")

    monkeypatch.setattr(gate, "emit_event", broken)
    with caplog.at_level(logging.WARNING, logger="test-gate"):
        gate.emit_gate_event(gate.gate_event("m1", 1, "reject", "c", "h", "h", {}), logging.getLogger("test-gate"))
    assert "rsiflow.gate.reject" in caplog.text and "ConnectionError: no API" in caplog.text


@pytest.mark.parametrize("name, kwargs", [("household", {"n_receptacles": 2, "n_distractors": 1}),
                                          ("arithmetic", {}), ("tooluse", {})])
def test_heldout_samples_are_prefixes_of_larger_ones(name, kwargs):
    """The gate draws the largest sample once and takes prefixes; the built-in envs also give the same
    first n tasks when asked for n, so results stored before growth was enabled are still reused."""
    env = make_env(name, **kwargs)
    try:
        small, large = env.sample_tasks("heldout", 6, 1234), env.sample_tasks("heldout", 18, 1234)
    finally:
        env.close()
    assert [t.task_id for t in small] == [t.task_id for t in large[:6]]


def test_heldout_tasks_draws_the_largest_look(tmp_path):
    cfg = load_config([TINY], tiny_overrides(tmp_path, "gate.rule=paired_test", "gate.heldout_tasks=4",
                                             "gate.max_heldout_tasks=10"))
    assert len(gate.heldout_tasks(cfg)) == 10


def test_growth_config_errors():
    with pytest.raises(ConfigError, match="paired_test only, not 'no_worse'"):
        load_config([], ["gate.rule=no_worse", "gate.max_heldout_tasks=48"])
    with pytest.raises(ConfigError, match="below gate.heldout_tasks"):
        load_config([], ["gate.max_heldout_tasks=12"])
    assert load_config([], []).gate.rule == "paired_test" and load_config([], []).gate.max_heldout_tasks is None
