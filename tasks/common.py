"""What every pipeline step needs: the store, the env factory, the champion's backend, ids.

Steps take small values (the config, the round number), open the store themselves for a short
write, and return small summaries. Ids are deterministic in (run, round, step, index), so a
step run again writes the same ids and replaces its rows.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from rsiflow.configs.schema import Config
from rsiflow.envs import make_env
from rsiflow.envs.base import Env
from rsiflow.methods.rollout import Episode
from rsiflow.models.backend import SamplingParams
from rsiflow.stores.store import Store

STEPS = ("generate", "evaluate", "distill", "train", "gate", "deploy")


def utcnow() -> datetime:
    """Naive UTC, as the store keeps timestamps; a step's start, passed to `Store.step`."""
    return datetime.now(UTC).replace(tzinfo=None)


def open_store(cfg: Config, read_only: bool = False) -> Store:
    """The run's store: its DuckDB file, or its DuckLake (run.store 'ducklake:...', data under run.lake_data_path)."""
    return Store(cfg.run.store, read_only=read_only, lake_data_path=cfg.run.lake_data_path)


def env_factory(cfg: Config):
    return partial(make_env, cfg.env.name, **cfg.env.kwargs)


def backend_for(cfg: Config, model_path: str):
    """The configured generation backend (`backend.kind`, its own options section) serving `model_path`."""
    from rsiflow.models.backend import open_backend

    options = cfg.backend.options()
    dtype = options.pop("dtype", None) or cfg.model.dtype  # a backend may sample in another dtype than training
    return open_backend(cfg.backend.kind, model_path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
                        **options)


def redeploy_backend(cfg: Config, previous_path: str, path: str) -> dict:
    """Redeploy: the backend that served `previous_path` serves `path` from now on; what was done (kind, action,
    path, seconds). In a process that holds no model of this kind (a deploy step on a pool worker, a deploy
    resumed after a kill) nothing is loaded just to be switched: the next step that generates loads `path`. A
    backend class without `must_redeploy` is always opened and switched."""
    from rsiflow.models.backend import backend_class

    must = getattr(backend_class(cfg.backend.kind), "must_redeploy", None)   # optional for a backend
    if must is not None and not must():
        return {"kind": cfg.backend.kind, "action": "nothing loaded in this process: the next step loads it",
                "path": str(path), "seconds": 0.0}
    return backend_for(cfg, previous_path).serve(path)


def serving_champion(cfg: Config) -> tuple[str, str]:
    """(model id, checkpoint path) of the run's champion, read from the store's registry."""
    with open_store(cfg) as store:
        champion = store.champion(cfg.run.name)
        return champion, store.model_path(champion)


def sampling(cfg: Config, temperature: float, seed: int, temp_logprobs: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=cfg.backend.max_new_tokens, temperature=temperature,
                          top_p=cfg.backend.top_p if temperature > 0 else 1.0, seed=seed, temp_logprobs=temp_logprobs)


def round_seed(cfg: Config, round_no: int, salt: int = 0) -> int:
    return (cfg.run.seed * 1_000_003 + round_no * 7919 + salt) % (2**31)


def episode_rows(episodes: list[Episode], model_id: str, purpose: str) -> tuple[list[dict], list[dict]]:
    """Rows for the trajectories and turns tables."""
    trajs, turns = [], []
    for ep in episodes:
        trajs.append({
            "traj_id": ep.traj_id, "task_id": ep.task.task_id, "model_id": model_id, "group_id": ep.group_id,
            "sample_idx": ep.sample_idx, "purpose": purpose, "status": ep.status, "success": ep.success,
            "reward": ep.reward, "n_turns": len(ep.turns), "error": ep.error, "hindsight": ep.hindsight,
            "prompt_tokens": ep.prompt_tokens, "gen_tokens": ep.gen_tokens, "wall_s": ep.wall_s,
        })
        for i, t in enumerate(ep.turns):
            turns.append({
                "traj_id": ep.traj_id, "turn_idx": i, "observation": t.observation, "action_text": t.action_text,
                "raw_text": t.raw_text,
                "action_symbol": t.action_symbol, "token_ids": t.token_ids, "logprobs": t.logprobs,
                "temp_logprobs": t.temp_logprobs,
                "reward": t.reward, "done": t.done, "valid": t.valid, "feedback": t.feedback, "wall_s": t.wall_s,
            })
    return trajs, turns


def conversation(prefix: list[dict], turns: list[dict]) -> list[dict]:
    """Rebuild the exact conversation the model saw: the prompt prefix, then the stored turns."""
    msgs = list(prefix)
    for t in turns:
        msgs.append({"role": "user", "content": t["observation"]})
        msgs.append({"role": "assistant", "content": t["action_text"]})
    return msgs


def run_dir(cfg: Config) -> Path:
    d = cfg.run_dir
    d.mkdir(parents=True, exist_ok=True)
    return d


def prompt_setup(cfg: Config) -> tuple[list[dict], list[dict] | None]:
    """The prompt prefix every episode of this config starts with (system + few-shot turns) and the env's
    tool schemas for the chat template (None where it has none)."""
    from rsiflow.methods.rollout import prompt_prefix

    env: Env = env_factory(cfg)()
    try:
        return prompt_prefix(env, cfg.env.show_admissible, cfg.env.few_shot), env.tools()
    finally:
        env.close()


class StepProgress:
    """A Prefect progress artifact of the current task run, shown in the UI while the step runs (nothing
    outside a task run). Updates are sent at most every `every_s` seconds, the last one always."""

    def __init__(self, description: str, every_s: float = 2.0):
        from prefect.artifacts import create_progress_artifact
        from prefect.context import TaskRunContext

        self.every_s, self.sent_at = every_s, time.monotonic()
        self.id = create_progress_artifact(0.0, description=description) if TaskRunContext.get() else None

    def update(self, done: float, total: float, description: str, last: bool = False) -> None:
        from prefect.artifacts import update_progress_artifact

        if self.id is None or (not last and time.monotonic() - self.sent_at < self.every_s):
            return
        self.sent_at = time.monotonic()
        update_progress_artifact(self.id, progress=100.0 * min(done / total, 1.0) if total else 100.0,
                                 description=description)


class TurnProgress:
    """Progress over turns of a lockstep batch (live episodes, generated tokens/s): a tqdm bar where the step
    runs and a Prefect progress artifact in the UI."""

    def __init__(self, desc: str, max_turns: int):
        from tqdm.auto import tqdm

        self.desc, self.max_turns = desc, max_turns
        self.bar = tqdm(total=max_turns, desc=desc, unit="turn", leave=False)
        self.ui = StepProgress(f"{desc}: starting")
        self.tokens = 0
        self.live = 0

    def __call__(self, tokens: int, live: int) -> None:
        self.tokens += tokens
        self.live = live
        rate = self.tokens / max(self.bar.format_dict["elapsed"], 1e-9)
        self.bar.set_postfix(live=live, tok_s=f"{rate:.1f}")
        self.bar.update(1)
        self.ui.update(self.bar.n, self.max_turns, f"{self.desc}: turn {self.bar.n} of at most {self.max_turns}, "
                       f"{live} episodes still playing, {self.tokens} tokens ({rate:.1f}/s)")

    def close(self) -> None:
        rate = self.tokens / max(self.bar.format_dict["elapsed"], 1e-9)
        self.ui.update(1, 1, f"{self.desc}: done after {self.bar.n} turns, {self.tokens} tokens ({rate:.1f}/s)",
                       last=True)
        self.bar.close()


def play(cfg: Config, backend, episodes: list[Episode], temperature: float, seed: int, desc: str,
         temp_logprobs: bool = True) -> list[Episode]:
    """Run episodes in lockstep with a progress bar (`temp_logprobs`: whether training will read them)."""
    from rsiflow.methods.rollout import run_episodes

    bar = TurnProgress(desc, cfg.env.max_turns)
    try:
        return run_episodes(env_factory(cfg), episodes, backend, sampling(cfg, temperature, seed, temp_logprobs),
                            cfg.env.max_turns, cfg.env.show_admissible, cfg.env.few_shot,
                            cfg.env.project_actions, on_turn=bar)
    finally:
        bar.close()


def trajectories_with_turns(store: Store, run_id: str, round_no: int, step: str, prefix: list[dict],
                            tools: list[dict] | None = None) -> list[dict]:
    """The step's trajectories, each with `messages` (the conversation rebuilt from the prompt prefix
    and its turns), `turns` (the stored turn rows: sampled token ids and logprobs), `train_from` (where
    the episode's own messages start) and `tools`."""
    trajs = store.step_trajectories(run_id, round_no, step)
    by_traj: dict[str, list[dict]] = {}
    for t in store.step_turns(run_id, round_no, step):
        by_traj.setdefault(t["traj_id"], []).append(t)
    for t in trajs:
        t["turns"] = by_traj.get(t["traj_id"], [])
        t["messages"] = conversation(prefix, t["turns"])
        t["train_from"] = len(prefix)
        t["tools"] = tools
    return trajs
