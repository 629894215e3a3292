"""Repeated task ids never reach the store or the gate: generate refuses a sample in which two tasks share an id,
before anything is played or written, and the gate's held-out sample holds each task (and each id) once, warning
when the split has fewer distinct tasks than asked. No model: the env is a fixed pool of named games."""

import dataclasses
import logging

import pytest

import rsiflow.tasks.gate as gate
import rsiflow.tasks.generate as generate
from rsiflow.configs.loader import load_config
from rsiflow.envs.arithmetic import ArithmeticEnv
from rsiflow.envs.base import RepeatedTaskIds, TaskSpec, require_distinct_ids
from tests.conftest import TINY, tiny_overrides

ENV = "tests.tasks.test_duplicate_task_ids"


class _Pool(ArithmeticEnv):
    """A folder of games of unequal size: type `small` holds 3, type `large` 10. Types round-robin; past a type's
    pool its games repeat, and a repeat is the same task (same seed, same spec: the same task id)."""

    name = "pool"
    SIZES = {"small": 3, "large": 10}

    def __init__(self):
        super().__init__()
        self.task_types = ("small", "large")

    def sample_tasks(self, split, n, seed):
        if split not in ("train", "heldout"):
            raise ValueError(split)
        tasks = []
        for i in range(n):
            task_type = self.task_types[i % 2]
            game = (i // 2 + seed) % self.SIZES[task_type]
            tasks.append(TaskSpec(self.name, split, task_type, self.repeat_seed(i, game),
                                  {"question": f"What is {game} + {len(task_type)}?", "answer": game + len(task_type),
                                   "game": f"{task_type}-{game}", "form": "expression", "steps": []}))
        return tasks

    def repeat_seed(self, i: int, game: int) -> int:
        return game


class _OwnSeeds(_Pool):
    """The documented fix: each repeat its own seed, hence its own task id (the spec still repeats)."""

    def repeat_seed(self, i: int, game: int) -> int:
        return i


@dataclasses.dataclass(frozen=True)
class _GameTask(TaskSpec):
    """A task whose id is its game's name alone: two variants of one game share it."""

    @property
    def task_id(self) -> str:
        return f"{self.env}-{self.spec['game']}"


class _Variants(_Pool):
    def sample_tasks(self, split, n, seed):
        return [_GameTask(t.env, t.split, t.task_type, t.seed, {**t.spec, "variant": i})
                for i, t in enumerate(_OwnSeeds.sample_tasks(self, split, n, seed))]


def _cfg(tmp_path, env: str, *extra: str):
    return load_config([TINY], tiny_overrides(tmp_path, f"env.name={ENV}:{env}", "env.kwargs={}", *extra))


# ---- generate ------------------------------------------------------------------------------------

def test_require_distinct_ids_names_the_repeats_their_counts_and_the_fix():
    tasks = _Pool().sample_tasks("train", 13, 0)
    require_distinct_ids(_OwnSeeds().sample_tasks("train", 13, 0), "fine")   # distinct ids: nothing to say
    with pytest.raises(RepeatedTaskIds) as info:
        require_distinct_ids(tasks, "sample_tasks('train', 13, 0)")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("sample_tasks('train', 13, 0) gave 13 tasks with only 9 distinct task ids; repeated: ")
    counts = {t.task_id: sum(u.task_id == t.task_id for u in tasks) for t in tasks}
    assert sorted(c for c in counts.values() if c > 1) == [2, 2, 3]    # small-0 x3, small-1 x2, small-2 x2
    first = tasks[0].task_id
    assert f"{first} (x3)" in message
    assert "give each repeat its own id (TaskSpec.seed is part of the id" in message


def test_generate_refuses_repeated_ids_naming_the_env_the_ids_and_the_fix(tmp_path):
    cfg = _cfg(tmp_path, "_Pool", "generate.tasks_per_round=24")
    with pytest.raises(RepeatedTaskIds) as info:
        generate.train_tasks(cfg, 0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"env '{ENV}:_Pool': sample_tasks('train', 24, 0) gave 24 tasks with only 13 distinct "
                              "task ids; repeated: pool-")
    assert "give each repeat its own id" in message and "nothing of this round was played or written" in message
    assert f"rsiflow check-env {ENV}:_Pool" in message
    ok = generate.train_tasks(_cfg(tmp_path, "_OwnSeeds", "generate.tasks_per_round=24"), 0)
    assert len(ok) == len({t.task_id for t in ok}) == 24


def test_the_generate_step_stops_before_it_plays_or_writes(tmp_path, monkeypatch):
    touched = []

    def must_not(what):
        def call(*args, **kwargs):
            touched.append(what)
            raise AssertionError(f"{what} was reached")
        return call

    monkeypatch.setattr(generate, "serving_champion", lambda cfg: ("tiny/base", "base-path"))
    for what in ("backend_for", "play", "open_store"):
        monkeypatch.setattr(generate, what, must_not(what))
    with pytest.raises(RepeatedTaskIds, match="only 13 distinct task ids"):
        generate.generate_rollouts.fn(_cfg(tmp_path, "_Pool", "generate.tasks_per_round=24"), 1)
    assert touched == []
    assert not (tmp_path / "store.duckdb").exists()


# ---- the gate's held-out sample ---------------------------------------------------------------------

def test_distinct_tasks_of_a_pool_of_unequal_types_gives_every_task_once(caplog):
    for env in (_Pool(), _OwnSeeds()):
        with caplog.at_level(logging.WARNING, logger="rsiflow.tasks.gate"):
            caplog.clear()
            tasks = gate.distinct_tasks(env, "heldout", 13, 0)
        assert len(tasks) == 13 and caplog.records == []
        assert len({t.task_id for t in tasks}) == 13
        assert sorted(t.spec["game"] for t in tasks) == sorted(
            [f"small-{g}" for g in range(3)] + [f"large-{g}" for g in range(10)])
        assert [t.task_id for t in tasks] == [t.task_id for t in gate.distinct_tasks(env, "heldout", 20, 0)][:13]


def test_distinct_tasks_warns_once_when_the_pool_is_smaller_than_asked(caplog):
    with caplog.at_level(logging.WARNING, logger="rsiflow.tasks.gate"):
        tasks = gate.distinct_tasks(_Pool(), "heldout", 20, 0)
    assert len(tasks) == 13 and len({t.task_id for t in tasks}) == 13
    (record,) = [r for r in caplog.records if r.name == "rsiflow.tasks.gate"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == ("pool heldout tasks (seed 0): asked for 20 distinct tasks, found 13 in a sample "
                                   "of 320")
    caplog.clear()
    exclude = {gate.spec_key(t) for t in tasks[:5]}
    with caplog.at_level(logging.WARNING, logger="rsiflow.tasks.gate"):
        rest = gate.distinct_tasks(_Pool(), "heldout", 10, 0, exclude)
    assert len(rest) == 8 and not {gate.spec_key(t) for t in rest} & exclude
    assert [r.getMessage() for r in caplog.records] == [
        "pool heldout tasks (seed 0): asked for 10 distinct tasks, found 8 in a sample of 160 (5 specs excluded)"]


def test_distinct_tasks_never_holds_one_task_id_twice():
    """Two variants of one game differ in spec but share the id the store keys them by: one of them is kept."""
    tasks = gate.distinct_tasks(_Variants(), "heldout", 13, 0)
    assert len(tasks) == 13 and len({t.task_id for t in tasks}) == 13
    drawn = _Variants().sample_tasks("heldout", 26, 0)
    assert len({gate.spec_key(t) for t in drawn}) == 26 > len({t.task_id for t in drawn}) == 13


def test_heldout_tasks_of_a_pool_config_plays_each_game_once(tmp_path):
    tasks = gate.heldout_tasks(_cfg(tmp_path, "_Pool", "gate.heldout_tasks=13"))
    assert len(tasks) == len({t.task_id for t in tasks}) == len({gate.spec_key(t) for t in tasks}) == 13
