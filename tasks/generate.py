"""generate: the champion plays G rollouts of each of this round's train tasks."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config
from rsiflow.methods.rollout import Episode
from rsiflow.tasks.common import (
    backend_for,
    env_factory,
    episode_rows,
    open_store,
    play,
    round_seed,
    serving_champion,
    utcnow,
)
from rsiflow.tasks.methods import needs_temp_logprobs


@task(name="generate", cache_policy=NONE)
def generate_rollouts(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    champion, path = serving_champion(cfg)
    seed = round_seed(cfg, round)
    env = env_factory(cfg)()
    try:
        task_specs = env.sample_tasks("train", cfg.generate.tasks_per_round, seed)
    finally:
        env.close()
    episodes = [
        Episode(traj_id=f"{run_id}/r{round}/gen/{ti:04d}-{g:02d}", task=t, group_id=f"{run_id}/r{round}/{t.task_id}",
                sample_idx=g)
        for ti, t in enumerate(task_specs) for g in range(cfg.generate.group_size)
    ]
    backend = backend_for(cfg, path)
    play(cfg, backend, episodes, cfg.backend.temperature, seed, f"round {round} generate",
         temp_logprobs=needs_temp_logprobs(cfg))
    trajs, turns = episode_rows(episodes, champion, "train")
    with open_store(cfg) as store, store.step(run_id, round, "generate", started) as tx:
        tx.insert("tasks", [t.to_row() for t in task_specs])
        tx.insert("trajectories", trajs)
        tx.insert("turns", turns)
    summary = {"episodes": len(episodes), "successes": sum(e.success for e in episodes),
               "errors": sum(e.status == "error" for e in episodes),
               "gen_tokens": sum(e.gen_tokens for e in episodes)}
    seconds = (utcnow() - started).total_seconds()
    get_run_logger().info(
        "round %d generate: %s played %d tasks x %d rollouts = %d episodes: %d succeeded, %d errors; "
        "%d tokens in %.0f s (%.1f tokens/s)", round, champion, len(task_specs), cfg.generate.group_size,
        summary["episodes"], summary["successes"], summary["errors"], summary["gen_tokens"], seconds,
        summary["gen_tokens"] / max(seconds, 1e-9))
    return summary
