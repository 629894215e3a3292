"""What every pipeline step needs: the store, the env factory, the champion's backend, ids.

Steps take small values (the config, the round number), open the store themselves for a short
write, and return small summaries. Ids are deterministic in (run, round, step, index), so a
step run again writes the same ids and replaces its rows.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from rsiflow.configs.schema import Config
from rsiflow.envs.rollout import Episode, play_episodes, waves
from rsiflow.models.backend import backend_for
from rsiflow.stores.store import Store

STEPS = ("generate", "evaluate", "distill", "train", "gate", "deploy")


def utcnow() -> datetime:
    """Naive UTC, as the store keeps timestamps; a step's start, passed to `Store.step`."""
    return datetime.now(UTC).replace(tzinfo=None)


def open_store(cfg: Config, read_only: bool = False) -> Store:
    """The run's store: its DuckDB file, or its DuckLake (run.store 'ducklake:...', data under run.lake_data_path)."""
    return Store(cfg.run.store, read_only=read_only, lake_data_path=cfg.run.lake_data_path)


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
         temp_logprobs: bool = True, make_env=None) -> list[Episode]:
    """`envs.rollout.play_episodes` with a progress bar (tqdm and the UI's progress artifact) named `desc`."""
    bar = TurnProgress(desc, cfg.env.max_turns * len(waves(episodes, getattr(backend, "max_live_episodes", None))))
    try:
        return play_episodes(cfg, backend, episodes, temperature, seed, make_env=make_env, on_turn=bar,
                             temp_logprobs=temp_logprobs)
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
