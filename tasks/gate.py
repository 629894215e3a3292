"""gate: candidate and champion play the same held-out tasks with the same seeds; the config's
promotion rule decides; the decision and its evidence are recorded either way. A round that
trained no candidate (no examples) records a 'skip'; the champion stays.

The champion's held-out results are reused when the store already has them for exactly these
tasks (it played them as the previous round's candidate, or as the base in round 1): the same
model on the same tasks with the same seeds, so playing again would only cost time.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config
from envs.base import TaskSpec
from methods.rollout import Episode
from methods.stats import compare, should_promote
from tasks.common import backend_for, env_factory, episode_rows, open_store, play, utcnow
from tasks.evaluate import success_rows
from tasks.train import candidate_id


def heldout_tasks(cfg: Config) -> list[TaskSpec]:
    env = env_factory(cfg)()
    try:
        return env.sample_tasks("heldout", cfg.gate.heldout_tasks, cfg.gate.seed)
    finally:
        env.close()


def _stored_results(store, run_id: str, model_id: str, task_ids: list[str]) -> dict[str, dict] | None:
    """This model's stored held-out trajectories for these tasks (one per task), or None if any is missing."""
    found: dict[str, dict] = {}
    for r in store.eval_trajectories(run_id, model_id):
        found.setdefault(r["task_id"], r)
    return found if all(t in found for t in task_ids) else None


@task(name="gate", cache_policy=NONE)
def gate_candidate(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    tasks = heldout_tasks(cfg)
    task_ids = [t.task_id for t in tasks]
    cid = candidate_id(cfg, round)
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        trained = store.has_model(cid)
        paths = {m: store.model_path(m) for m in ((cid, champion) if trained else (champion,))}
        reused = _stored_results(store, run_id, champion, task_ids)

    # The champion plays only when the store lacks its results on these tasks (round 1: the base).
    to_play = [("candidate", cid)] if trained else []
    if reused is None:
        to_play.append(("champion", champion))
    played: dict[str, list[Episode]] = {}
    for tag, mid in to_play:
        episodes = [Episode(traj_id=f"{run_id}/r{round}/gate/{tag}/{i:04d}", task=t,
                            group_id=f"{run_id}/eval/{t.task_id}", sample_idx=0) for i, t in enumerate(tasks)]
        play(cfg, backend_for(cfg, paths[mid]), episodes, cfg.gate.temperature, cfg.gate.seed,
             f"round {round} gate: {tag}")
        played[mid] = episodes

    def outcome(mid: str) -> list[dict]:
        if mid in played:
            return [{"success": e.success, "gen_tokens": e.gen_tokens, "task_type": e.task.task_type,
                     "traj_id": e.traj_id} for e in played[mid]]
        return [{**reused[t.task_id], "task_type": t.task_type} for t in tasks]

    champ = outcome(champion)
    if trained:
        cand = outcome(cid)
        ev = compare([bool(r["success"]) for r in cand], [bool(r["success"]) for r in champ],
                     cfg.gate.rule, cfg.gate.confidence)
        decision = "promote" if should_promote(ev) else "reject"
        evidence = {**ev.to_dict(), "candidate_trajectories": [r["traj_id"] for r in cand]}
        summary = {"decision": decision, "candidate": ev.candidate_rate, "champion": ev.champion_rate,
                   "candidate_ci": ev.candidate_ci, "champion_ci": ev.champion_ci}
    else:
        decision = "skip"
        successes = sum(bool(r["success"]) for r in champ)
        evidence = {"reason": "no training examples this round: no candidate was trained",
                    "n": len(champ), "champion_successes": successes, "champion_rate": successes / len(champ)}
        summary = {"decision": decision, "champion": evidence["champion_rate"]}
    evidence.update(task_ids=task_ids, champion_results_reused=reused is not None,
                    champion_trajectories=[r["traj_id"] for r in champ])
    new_champion = cid if decision == "promote" else champion

    with open_store(cfg) as store, store.step(run_id, round, "gate", started) as tx:
        tx.insert("tasks", [t.to_row() for t in tasks])
        for mid, episodes in played.items():
            trajs, turns = episode_rows(episodes, mid, "eval")
            tx.insert("trajectories", trajs)
            tx.insert("turns", turns)
            tag = "candidate" if mid == cid else "champion"
            tx.insert("evaluations", success_rows(outcome(mid), mid, "heldout", cfg.env.name, cfg.gate.confidence,
                                                  f"{run_id}/r{round}/gate/{tag}"))
        tx.insert("gate_decisions", [{"candidate_id": cid if trained else None, "champion_id": champion,
                                      "decision": decision, "rule": cfg.gate.rule, "evidence": evidence,
                                      "new_champion_id": new_champion}])
        if trained:
            tx.set_model_role(cid, "champion" if decision == "promote" else "rejected")
    get_run_logger().info("round %d gate: %s", round, summary)
    return summary
