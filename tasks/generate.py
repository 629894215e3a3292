"""generate: the champion plays G rollouts of each of this round's train tasks.

A sample in which two tasks share a task id is refused before anything is played or written (`train_tasks`): the
store keys tasks and trajectories by task id, so each trajectory of a repeated task would be counted once per repeat.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config
from rsiflow.envs.base import RepeatedTaskIds, TaskSpec, require_distinct_ids
from rsiflow.envs.rollout import Episode, env_factory, episode_rows, round_seed
from rsiflow.methods import needs_temp_logprobs
from rsiflow.models.backend import backend_for
from rsiflow.tasks.common import open_store, play, serving_champion, utcnow


def train_tasks(cfg: Config, seed: int) -> list[TaskSpec]:
    """The env's `generate.tasks_per_round` train tasks for `seed`. RepeatedTaskIds, in one line naming the env,
    the repeated ids and the fix, where two of them share a task id."""
    n = cfg.generate.tasks_per_round
    env = env_factory(cfg)()
    try:
        tasks = env.sample_tasks("train", n, seed)
    finally:
        env.close()
    try:
        require_distinct_ids(tasks, f"env {cfg.env.name!r}: sample_tasks('train', {n}, {seed})")
    except RepeatedTaskIds as exc:
        raise RepeatedTaskIds(f"{exc}; nothing of this round was played or written (rsiflow check-env "
                              f"{cfg.env.name} checks the env)") from None
    return tasks


@task(name="generate", cache_policy=NONE)
def generate_rollouts(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    champion, path = serving_champion(cfg)
    seed = round_seed(cfg, round_no)
    task_specs = train_tasks(cfg, seed)   # refuses repeated task ids before anything is played or written
    episodes = [
        Episode(traj_id=f"{run_id}/r{round_no}/gen/{ti:04d}-{g:02d}", task=t,
                group_id=f"{run_id}/r{round_no}/{t.task_id}", sample_idx=g)
        for ti, t in enumerate(task_specs) for g in range(cfg.generate.group_size)
    ]
    backend = backend_for(cfg, path)
    play(cfg, backend, episodes, cfg.backend.temperature, seed, f"round {round_no} generate",
         temp_logprobs=needs_temp_logprobs(cfg))
    trajs, turns = episode_rows(episodes, champion, "train")
    with open_store(cfg) as store, store.step(run_id, round_no, "generate", started) as tx:
        tx.insert("tasks", [t.to_row() for t in task_specs])
        tx.insert("trajectories", trajs)
        tx.insert("turns", turns)
    summary = {"episodes": len(episodes), "successes": sum(e.success for e in episodes),
               "errors": sum(e.status == "error" for e in episodes),
               "gen_tokens": sum(e.gen_tokens for e in episodes)}
    seconds = (utcnow() - started).total_seconds()
    get_run_logger().info(
        "round %d generate: %s played %d tasks x %d rollouts = %d episodes: %d succeeded, %d errors; "
        "%d tokens in %.0f s (%.1f tokens/s)", round_no, champion, len(task_specs), cfg.generate.group_size,
        summary["episodes"], summary["successes"], summary["errors"], summary["gen_tokens"], seconds,
        summary["gen_tokens"] / max(seconds, 1e-9))
    return summary
