"""The episode runner: lockstep batching, and one crashing episode doesn't stop the batch."""

import os
from pathlib import Path

import pytest

from rsiflow.envs import make_env
from rsiflow.envs.household import HouseholdEnv
from rsiflow.envs.rollout import Episode, env_observation, render_observation, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.loading import resolve_base_model


@pytest.fixture(scope="module")
def backend():
    cache = Path(os.environ.get("RSIFLOW_CACHE", "~/.cache/rsiflow")).expanduser()
    return HFBackend(resolve_base_model("tiny:0", cache), max_batch_size=16)


class CallLog:
    """Wraps the real backend and records the batch size of every generate call."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []
        self.model_path = inner.model_path

    def generate(self, conversations, params, tools=None):
        self.batches.append(len(conversations))
        self.seeds = [*getattr(self, "seeds", []), params.seed]
        self.tools = tools
        return self.inner.generate(conversations, params, tools=tools)


class CrashOnSecondStep(HouseholdEnv):
    """A real household env that raises on its second step: a bug in a user's env."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 2:
            raise RuntimeError("simulated env bug")
        return super().step(action)


def episodes_for(tasks, g=2):
    return [Episode(traj_id=f"t{i}-{j}", task=t, group_id=t.task_id, sample_idx=j)
            for i, t in enumerate(tasks) for j in range(g)]


def test_lockstep_one_batched_call_per_turn(backend):
    tasks = make_env("household").sample_tasks("train", 3, seed=0)
    log = CallLog(backend)
    eps = run_episodes(lambda: make_env("household"), episodes_for(tasks), log,
                       SamplingParams(max_new_tokens=6, temperature=1.0, seed=0), max_turns=3)
    # all 6 episodes are live for every turn (a random tiny model won't finish a task in 3 turns)
    assert log.batches == [6, 6, 6]
    for ep in eps:
        assert ep.status in {"success", "failure"} and len(ep.turns) == 3
        assert ep.messages[0]["role"] == "system" and ep.messages[-1]["role"] == "assistant"
        # the few-shot prefix: system + the env's demonstration turns; then the episode's own turns
        assert ep.n_prefix == 1 + 2 * len(HouseholdEnv().demonstration())
        assert [m["role"] for m in ep.messages[ep.n_prefix:]] == ["user", "assistant"] * 3
        assert all(len(t.token_ids) == len(t.logprobs) for t in ep.turns)
        assert ep.hindsight and ep.gen_tokens == sum(len(t.token_ids) for t in ep.turns)
        assert "Valid actions:" in ep.messages[ep.n_prefix]["content"]


def test_crashing_episode_is_recorded_and_batch_goes_on(backend):
    tasks = make_env("household").sample_tasks("train", 2, seed=1)
    made = []

    def factory():
        env = CrashOnSecondStep() if not made else HouseholdEnv()
        made.append(env)
        return env

    log = CallLog(backend)
    eps = run_episodes(factory, episodes_for(tasks, g=2), log, SamplingParams(max_new_tokens=6, seed=0), max_turns=4)
    crashed, others = eps[0], eps[1:]
    assert crashed.status == "error" and "simulated env bug" in crashed.error and len(crashed.turns) == 1
    assert all(e.status in {"success", "failure"} and len(e.turns) == 4 for e in others)
    assert log.batches == [4, 4, 3, 3]   # it crashes during turn 2 and leaves the batch after it


def test_backend_failure_propagates(backend):
    class Broken(CallLog):
        def generate(self, conversations, params, tools=None):
            raise RuntimeError("backend down")

    tasks = make_env("household").sample_tasks("train", 1, seed=0)
    with pytest.raises(RuntimeError, match="backend down"):
        run_episodes(lambda: make_env("household"), episodes_for(tasks), Broken(backend), SamplingParams(), max_turns=2)


def test_env_observation_inverts_the_rendering():
    """SRD's notes quote the env's own observations: whatever render_observation appends must come off again."""
    for obs in ("You see a cabinet 1.", "line one\nline two", ""):
        for admissible in (None, [], ["go to cabinet 1", "look"]):
            for show in (True, False):
                assert env_observation(render_observation(obs, admissible, show)) == obs


def test_the_env_tools_reach_the_backend(backend):
    """ToolUseEnv's tool schemas go with every batched call (the chat template gets them)."""
    from rsiflow.envs.tooluse import ToolUseEnv

    env = ToolUseEnv()
    log = CallLog(backend)
    episodes = [Episode(traj_id=f"t{i}", task=t, group_id="g", sample_idx=0)
                for i, t in enumerate(env.sample_tasks("train", 2, 0))]
    run_episodes(ToolUseEnv, episodes, log, SamplingParams(max_new_tokens=4, temperature=0.0), max_turns=1)
    assert log.tools == env.tools() and log.tools


def test_more_episodes_than_max_live_play_in_waves_seeded_apart(backend):
    """max_live 4 over 6 episodes: two waves of 3, each played to its end before the next starts; the
    second wave's calls take another seed; every episode is played. The backend's max_live_episodes is the
    default limit."""
    from rsiflow.envs.rollout import WAVE_SEED_STRIDE, waves

    tasks = make_env("household").sample_tasks("train", 3, seed=0)
    log = CallLog(backend)
    eps = run_episodes(lambda: make_env("household"), episodes_for(tasks), log,
                       SamplingParams(max_new_tokens=6, temperature=1.0, seed=5), max_turns=2, max_live=4)
    assert log.batches == [3, 3, 3, 3]
    assert log.seeds == [5, 5, 5 + WAVE_SEED_STRIDE, 5 + WAVE_SEED_STRIDE]
    assert all(len(e.turns) == 2 and not e.live for e in eps)
    log.max_live_episodes = 2
    log.batches = []
    run_episodes(lambda: make_env("household"), episodes_for(tasks), log,
                 SamplingParams(max_new_tokens=6, temperature=1.0, seed=5), max_turns=1)
    assert log.batches == [2, 2, 2]
    assert [len(w) for w in waves(list(range(7)), 3)] == [3, 2, 2] and waves([1, 2], None) == [[1, 2]]
    assert [len(w) for w in waves(list(range(128)), 40)] == [32] * 4 and sum(waves(list(range(9)), 4), []) == list(
        range(9))
