"""gate: candidate and champion play the same held-out tasks with the same seeds; the config's
promotion rule decides on the paired outcomes (methods/gating.py); the decision and its evidence
are recorded either way, and a Prefect event `rsiflow.gate.<decision>` is emitted. A round that
trained no candidate (no examples) records a 'skip'; the champion stays. Once a trained candidate has
played, each enabled method may assess it (`Method.assess`, e.g. MASS's self-judged win rate against the
base): its rows go into the gate's transaction, its figures into the step's metrics.

With `gate.max_heldout_tasks` the sample grows look by look (n0, 2·n0, ... the maximum) while the
paired test is inconclusive; each look plays only the tasks it adds. The held-out sample is drawn
once at its largest size and every look takes its first n tasks, so a smaller sample is always the
start of a larger one.

The champion's held-out results are reused task by task when the store already has them (it
played them as the previous round's candidate, or as the base in round 1): the same model on the
same task with the same seed. At `gate.temperature: 0` (greedy) a result does not depend on which
batch it was played in; with sampling it does (the backend seeds each batched call).
"""

from __future__ import annotations

import logging

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.events import emit_event

from configs.schema import Config
from envs.base import TaskSpec
from methods.gating import Rule, look_sizes, sequential_decision
from methods.rollout import Episode
from tasks.common import backend_for, env_factory, episode_rows, open_store, play, utcnow
from tasks.evaluate import success_rows
from tasks.methods import AssessContext, enabled_methods
from tasks.train import candidate_id


def heldout_tasks(cfg: Config) -> list[TaskSpec]:
    """The held-out sample at its largest size (the last look's); a look of n tasks plays its first n."""
    env = env_factory(cfg)()
    try:
        return env.sample_tasks("heldout", look_sizes(cfg.gate.heldout_tasks, cfg.gate.max_heldout_tasks)[-1],
                                cfg.gate.seed)
    finally:
        env.close()


def _stored_results(store, run_id: str, model_id: str, task_ids: list[str]) -> dict[str, dict]:
    """This model's newest stored held-out trajectory for each of these tasks it has played."""
    wanted, found = set(task_ids), {}
    for r in store.eval_trajectories(run_id, model_id):
        if r["task_id"] in wanted:
            found.setdefault(r["task_id"], r)
    return found


def gate_event(run_id: str, round: int, decision: str, candidate: str | None, champion: str,
               new_champion: str, payload: dict) -> dict:
    """The keyword arguments of `emit_event` for one gate decision: the event `rsiflow.gate.<decision>`
    about the resource `rsiflow.run.<run>`, the models as related resources, the figures as payload."""
    related = [{"prefect.resource.id": f"rsiflow.model.{mid}", "prefect.resource.role": role,
                "prefect.resource.name": mid}
               for mid, role in ((candidate, "candidate"), (champion, "champion")) if mid is not None]
    return {"event": f"rsiflow.gate.{decision}",
            "resource": {"prefect.resource.id": f"rsiflow.run.{run_id}", "prefect.resource.name": run_id},
            "related": related,
            "payload": {"run": run_id, "round": round, "decision": decision, "candidate_id": candidate,
                        "champion_id": champion, "new_champion_id": new_champion, **payload}}


def emit_gate_event(event: dict, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Send the event, best-effort: the decision is already stored, so a failure to send is logged
    with its cause and never fails the step."""
    try:
        emit_event(**event)
    except Exception as error:  # any failure to notify must leave the recorded decision standing
        logger.warning("could not emit the Prefect event %s: %s: %s", event["event"], type(error).__name__, error)


@task(name="gate", cache_policy=NONE)
def gate_candidate(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    sizes = look_sizes(cfg.gate.heldout_tasks, cfg.gate.max_heldout_tasks)
    tasks = heldout_tasks(cfg)
    cid = candidate_id(cfg, round)
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        trained = store.has_model(cid)
        paths = {m: store.model_path(m) for m in ((cid, champion) if trained else (champion,))}
        stored = _stored_results(store, run_id, champion, [t.task_id for t in tasks])
        base = store.base_model(run_id)
        base_path = store.model_path(base)

    # results[model][i]: the model's outcome on held-out task i, from the store or played here
    results: dict[str, dict[int, dict]] = {m: {} for m in paths}
    results[champion] = {i: {**stored[t.task_id], "task_type": t.task_type}
                         for i, t in enumerate(tasks) if t.task_id in stored}
    played: dict[str, list[Episode]] = {m: [] for m in paths}
    tag = {cid: "candidate", champion: "champion"}

    def play_first(n: int) -> None:
        """Give every model a result on the first n tasks, playing only the ones it lacks."""
        for mid in paths:
            missing = [i for i in range(n) if i not in results[mid]]
            if not missing:
                continue
            episodes = [Episode(traj_id=f"{run_id}/r{round}/gate/{tag[mid]}/{i:04d}", task=tasks[i],
                                group_id=f"{run_id}/eval/{tasks[i].task_id}", sample_idx=0) for i in missing]
            play(cfg, backend_for(cfg, paths[mid]), episodes, cfg.gate.temperature, cfg.gate.seed,
                 f"round {round} gate: {tag[mid]} ({len(missing)} of {n} tasks)")
            played[mid] += episodes
            for i, e in zip(missing, episodes):
                results[mid][i] = {"success": e.success, "gen_tokens": e.gen_tokens,
                                   "task_type": e.task.task_type, "traj_id": e.traj_id}

    def outcomes(n: int) -> tuple[list[bool], list[bool]]:
        play_first(n)
        return ([bool(results[cid][i]["success"]) for i in range(n)],
                [bool(results[champion][i]["success"]) for i in range(n)])

    if trained:
        result = sequential_decision(outcomes, sizes, Rule(cfg.gate.rule, cfg.gate.alpha, cfg.gate.margin,
                                                           cfg.gate.confidence))
        ev, decision, n = result.evidence, result.decision, result.evidence.n
        evidence = {**result.to_dict(), "alpha": cfg.gate.alpha, "margin": cfg.gate.margin, "look_sizes": sizes,
                    "candidate_trajectories": [results[cid][i]["traj_id"] for i in range(n)]}
        summary = {"decision": decision, "candidate": ev.candidate_rate, "champion": ev.champion_rate,
                   "candidate_ci": ev.candidate_ci, "champion_ci": ev.champion_ci, "n": n, "wins": ev.wins,
                   "losses": ev.losses, "p_value": evidence.get("p_value"), "looks": len(result.looks)}
        line = result.describe()
    else:
        decision, n = "skip", sizes[0]
        play_first(n)
        successes = sum(bool(results[champion][i]["success"]) for i in range(n))
        evidence = {"reason": "no training examples this round: no candidate was trained",
                    "n": n, "champion_successes": successes, "champion_rate": successes / n}
        summary = {"decision": decision, "champion": evidence["champion_rate"], "n": n}
        line = f"no candidate (no training examples) -> skip; champion {successes}/{n}"
    evidence.update(task_ids=[t.task_id for t in tasks[:n]], champion_results_reused=not played[champion],
                    champion_tasks_reused=n - len(played[champion]),
                    champion_trajectories=[results[champion][i]["traj_id"] for i in range(n)])
    new_champion = cid if decision == "promote" else champion
    # each enabled method's own assessment of the candidate (e.g. MASS: win rate against the base, self-judged)
    assessed = {}
    if trained:
        actx = AssessContext(cfg=cfg, round=round, candidate=cid, candidate_path=paths[cid], champion=champion,
                             champion_path=paths[champion], base=base, base_path=base_path, heldout=tasks)
        assessed = {m.name: (m, c) for m in enabled_methods(cfg) if (c := m.assess(actx)) is not None}

    with open_store(cfg) as store, store.step(run_id, round, "gate", started) as tx:
        tx.insert("tasks", [t.to_row() for t in tasks[:n]])
        for mid, episodes in played.items():
            if not episodes:
                continue
            trajs, turns = episode_rows(episodes, mid, "eval")
            tx.insert("trajectories", trajs)
            tx.insert("turns", turns)
            tx.insert("evaluations", success_rows([results[mid][i] for i in range(n)], mid, "heldout", cfg.env.name,
                                                  cfg.gate.confidence, f"{run_id}/r{round}/gate/{tag[mid]}"))
        tx.insert("gate_decisions", [{"candidate_id": cid if trained else None, "champion_id": champion,
                                      "decision": decision, "rule": cfg.gate.rule, "evidence": evidence,
                                      "new_champion_id": new_champion}])
        if trained:
            tx.set_model_role(cid, "champion" if decision == "promote" else "rejected")
        for name, (m, c) in assessed.items():
            unknown = set(c.tables) - set(m.tables)
            if unknown:
                raise ValueError(f"method {name!r} assessed into tables it does not declare in `tables`: "
                                 f"{sorted(unknown)}")
            for table, rows in c.tables.items():
                tx.insert(table, rows)
        if assessed:
            tx.metrics({name: c.metrics for name, (_, c) in assessed.items()})
    logger = get_run_logger()
    logger.info("round %d gate: %s", round, line)
    emit_gate_event(gate_event(run_id, round, decision, cid if trained else None, champion, new_champion,
                               {"rule": cfg.gate.rule, **summary}), logger)
    return summary
