"""The final test split: held-out tasks no promotion decision reads, played by the base and the serving champion.

Every gate decides on the same held-out sample round after round, so a run that promotes on it selects for that
sample's noise as well as for real gains; the champion's gate figures are optimistic. The test split is
`gate.test_tasks` held-out tasks drawn with `gate.test_seed`, none equal to a task of the gate's sample (at its
largest size), played greedy and with `gate.samples` sampled plays per task (base and champion with independent
seeds). It is stored as step "test" of the run's last completed round (trajectories of purpose 'test' and
'test_sampled', evaluations of split 'test' and 'test:sampled'); the gate never reads them.
"""

from __future__ import annotations

import hashlib
import json

from rsiflow.configs.schema import Config
from rsiflow.envs.rollout import env_factory
from rsiflow.stats.success import compare
from rsiflow.tasks.common import open_store, utcnow
from rsiflow.tasks.gate import (
    HeldoutPlays,
    distinct_tasks,
    heldout_tasks,
    paired_figures,
    partial_path,
    sample_seed,
    spec_key,
)


def final_test_tasks(cfg: Config) -> list:
    """The test split's tasks: distinct, none equal to a task of the gate's held-out sample."""
    exclude = {spec_key(t) for t in heldout_tasks(cfg)}
    env = env_factory(cfg)()
    try:
        return distinct_tasks(env, "heldout", cfg.gate.test_tasks, cfg.gate.test_seed, exclude)
    finally:
        env.close()


def play_key(cfg: Config, tasks: list) -> str:
    """What decides a model's plays of the test split, besides its weights: the tasks, the prompting, the backend
    and sampling settings and the seeds. Two runs with the same key play a checkpoint identically."""
    settings = {"tasks": [t.task_id for t in tasks], "env": cfg.env.model_dump(), "backend": cfg.backend.model_dump(),
                "gate": {k: getattr(cfg.gate, k) for k in ("temperature", "samples", "test_seed")},
                "dtype": cfg.model.dtype}
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stored_outcomes(store, key: str, path: str) -> dict | None:
    """A checkpoint's per-task test outcomes stored by any run of the store under the same play key."""
    for row in store.completed_step_metrics("test"):
        found = (row["metrics"] or {}).get("final_test") or {}
        if found.get("play_key") != key:
            continue
        for tag, p in (found.get("paths") or {}).items():
            if p == path and tag in (found.get("outcomes") or {}):
                return found["outcomes"][tag]
    return None


def final_test(cfg: Config) -> dict:
    """Play the test split with the run's base and its champion, store it, and return the figures: per model
    greedy (and sampled) success with intervals and per task type; the champion against the base, paired. A
    checkpoint that a run of the store already played under the same settings (`play_key`: e.g. the shared base
    model of a comparison's runs) is not played again: its stored outcomes are the same plays."""
    started = utcnow()
    run_id, g = cfg.run.name, cfg.gate
    tasks = final_test_tasks(cfg)
    if not tasks:
        raise ValueError("gate.test_tasks: the env's held-out split has no task outside the gate's sample")
    key = play_key(cfg, tasks)
    with open_store(cfg) as store:
        round_no = max(store.last_completed_round(run_id), 0)
        base, champion = store.base_model(run_id), store.champion(run_id)
        paths = {m: store.model_path(m) for m in dict.fromkeys((base, champion))}
        known = {m: _stored_outcomes(store, key, p) for m, p in paths.items()}
    tags = {base: "base", champion: "champion"} if champion != base else {base: "base"}
    plays = HeldoutPlays(cfg, tasks, paths, tags, f"{run_id}/r{round_no}/test", g.test_seed,
                         {m: sample_seed(g.test_seed, 0, tags[m]) for m in paths}, g.samples,
                         f"final test ({len(tasks)} tasks)", checkpoint=partial_path(cfg, round_no, "test"))
    n = len(tasks)
    for m, outcomes in known.items():
        if outcomes is not None:
            plays.greedy[m] = {i: {"success": bool(x), "gen_tokens": 0, "task_type": t.task_type, "traj_id": None}
                               for i, (x, t) in enumerate(zip(outcomes["greedy"], tasks))}
            if g.samples and outcomes.get("sampled") is not None:
                plays.sampled[m] = {i: {"successes": x, "plays": g.samples, "gen_tokens": 0,
                                        "task_type": t.task_type} for i, (x, t) in enumerate(zip(outcomes["sampled"],
                                                                                                   tasks))}
    plays.play_first(n)
    outcomes = {tags[m]: {"greedy": [int(bool(plays.greedy[m][i]["success"])) for i in range(n)],
                          "sampled": [plays.sampled[m][i]["successes"] for i in range(n)] if g.samples else None}
                for m in paths}
    result = {"round": round_no, "tasks": n, "requested": g.test_tasks, "seed": g.test_seed, "base_id": base,
              "champion_id": champion, "models": {tags[m]: plays.summary(m, n) for m in paths},
              "play_key": key, "paths": {tags[m]: p for m, p in paths.items()}, "outcomes": outcomes,
              "reused": sorted(tags[m] for m, o in known.items() if o is not None)}
    if champion != base:
        paired = {"greedy": paired_figures(compare(*plays.outcomes("greedy", champion, base, n), "paired_test",
                                                   g.confidence), g.alpha)}
        if g.samples:
            paired["sampled"] = paired_figures(compare(*plays.outcomes("sampled", champion, base, n), "paired_test",
                                                       g.confidence, g.samples), g.alpha)
        result["champion_vs_base"] = paired
    rows = plays.rows(n, "test", f"{run_id}/r{round_no}/test")
    with open_store(cfg) as store, store.step(run_id, round_no, "test", started) as tx:
        tx.insert("tasks", [t.to_row() for t in tasks])
        for table in ("trajectories", "turns", "evaluations"):
            tx.insert(table, rows[table])
        tx.metrics({"final_test": result})
    plays.discard_checkpoint()
    return result


def stored_final_test(store, run_id: str) -> dict | None:
    """The run's newest stored final test (the figures `final_test` returned), or None."""
    for round_no in range(store.last_completed_round(run_id), -1, -1):
        found = (store.step_metrics(run_id, round_no, "test") or {}).get("final_test")
        if found:
            return found
    return None


def describe(result: dict) -> list[str]:
    """Markdown lines: the test split's figures per model and the champion against the base."""
    lines = [f"Final test split ({result['tasks']} held-out tasks never read by a promotion decision, seed "
             f"{result['seed']}; after round {result['round']}):", "",
             "| model | greedy [95% CI] | sampled [95% CI] |", "|---|---|---|"]
    for tag, figures in result["models"].items():
        cells = []
        for metric in ("greedy", "sampled"):
            f = figures.get(metric)
            cells.append(f"{f['successes']}/{f['plays']} = {f['rate']:.3f} [{f['ci'][0]:.3f}, {f['ci'][1]:.3f}]"
                         if f else "-")
        model = result["champion_id"] if tag == "champion" else result["base_id"]
        lines.append(f"| {tag} `{model}` | {cells[0]} | {cells[1]} |")
    for metric, p in (result.get("champion_vs_base") or {}).items():
        lines.append(f"\nchampion vs base, {metric}: {p['paired_diff']:+.3f} [{p['paired_diff_ci'][0]:+.3f}, "
                     f"{p['paired_diff_ci'][1]:+.3f}], {p['wins']} tasks better, {p['losses']} worse, one-sided "
                     f"p = {p['p_value']:.3g}")
    return lines
