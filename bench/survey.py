"""Headroom survey: how much room a model has on an env, per task type, before any training.

    python -m bench.survey --config configs/arithmetic.yaml --tasks 200 --samples 8 \\
        --out bench/results/learning-survey/arithmetic.json

With `--out`, each chunk of plays (25 tasks) is saved to `<out>.partial` as it finishes: the same command
after a stop resumes from there, with the same seeds, so the figures are those of an unbroken survey.

On `--tasks` held-out tasks (types round-robin, the gate's seed unless `--seed`), played exactly as a
round's gate plays them (the config's env, prompting, backend and `backend.max_new_tokens`), it measures
per task type:

- greedy success (one play per task, temperature 0) with a 95% Wilson interval;
- sampled success: the mean over `--samples` plays per task at the config's training temperature and
  top-p (what the generate step samples), i.e. the policy's expected success per task;
- pass@k: the share of tasks that at least one of the k samples solved (k = `--samples`);
- distinct tasks only: the sample is drawn as the gate draws its own (`tasks.gate.distinct_tasks`), so a
  family with a small space (one-step sums) is not counted twice over a repeated question; a type with
  fewer distinct held-out tasks than asked shows its n.

pass@k well above the sampled mean is room that ExIt and RL can take (they sharpen the policy
toward what it sometimes does); greedy far below the sampled mean says the greedy gate misreads the
policy. Pick a training family where greedy sits roughly between .2 and .6 and pass@k is well above it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

from rsiflow.configs.loader import load_config
from rsiflow.stats.success import wilson_interval as wilson


def _rate(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


CHUNK_TASKS = 25  # tasks per saved chunk: a stop loses at most one chunk's plays


def play_chunk(cfg, backend, episodes: list, temperature: float, seed: int, desc: str) -> None:
    """Play one chunk's episodes (the gate's play, with a progress bar)."""
    from rsiflow.tasks.common import play

    play(cfg, backend, episodes, temperature, seed, desc, temp_logprobs=False)


def _play_chunks(cfg, backend, tasks: list, samples: int, temperature: float, seed: int, phase: str,
                 done: dict, save) -> None:
    """Play `tasks` in chunks of CHUNK_TASKS (`samples` plays each), recording each chunk's outcomes in
    `done[phase][chunk]` and calling `save()` after each; chunks already in `done` are skipped. Each chunk has
    its own sampling seed (`seed` + chunk index), so a resumed survey plays exactly what an unbroken one does;
    `done["seconds"][phase]` sums the play time of the chunks, whichever session played them."""
    from rsiflow.envs.rollout import Episode

    kept = done.setdefault(phase, {})
    n_chunks = math.ceil(len(tasks) / CHUNK_TASKS)
    for c in range(n_chunks):
        if str(c) in kept:
            continue
        part = tasks[c * CHUNK_TASKS:(c + 1) * CHUNK_TASKS]
        eps = [Episode(traj_id=f"{phase}-{t.task_id}-{k}", task=t, group_id=t.task_id, sample_idx=k)
               for t in part for k in range(samples)]
        t0 = time.perf_counter()
        play_chunk(cfg, backend, eps, temperature, seed + c, f"survey {phase} chunk {c + 1}/{n_chunks} "
                   f"({len(eps)} plays)")
        kept[str(c)] = [{"task_id": e.task.task_id, "success": bool(e.success), "error": e.status == "error",
                         "gen_tokens": e.gen_tokens, "actions": [x.action_text for x in e.turns]} for e in eps]
        done.setdefault("seconds", {}).setdefault(phase, 0.0)
        done["seconds"][phase] = round(done["seconds"][phase] + time.perf_counter() - t0, 1)
        save()


def survey(cfg, tasks: list, samples: int, seed: int, done: dict | None = None, save=lambda: None) -> dict:
    """Play `tasks` greedy once and `samples` times sampled; per-type figures and the per-task outcomes.
    `done` holds the chunks a stopped survey already played (it is filled in as chunks finish, and `save`
    is called after each), so a survey resumes where it stopped."""
    from rsiflow.models.backend import backend_for
    from rsiflow.models.loading import resolve_base_model

    done = {} if done is None else done
    path = resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser()) \
        if not Path(cfg.model.base).is_dir() else Path(cfg.model.base)
    backend = backend_for(cfg, str(path))
    _play_chunks(cfg, backend, tasks, 1, 0.0, seed, "greedy", done, save)
    _play_chunks(cfg, backend, tasks, samples, cfg.backend.temperature, seed, "sampled", done, save)
    plays = {ph: {} for ph in ("greedy", "sampled")}
    for ph in plays:
        for chunk in done[ph].values():
            for r in chunk:
                plays[ph].setdefault(r["task_id"], []).append(r)
    per_task = []
    for t in tasks:
        g, outs = plays["greedy"][t.task_id][0], plays["sampled"][t.task_id]
        per_task.append({"task_id": t.task_id, "task_type": t.task_type, "greedy": g["success"],
                         "sampled": [r["success"] for r in outs], "greedy_action": g["actions"],
                         "question": json.dumps(t.spec, sort_keys=True)})
    every = [r for ph in plays.values() for rs in ph.values() for r in rs]
    errors = sum(r["error"] for r in every)
    tokens = sum(r["gen_tokens"] for r in every)
    by_type: dict[str, list[dict]] = defaultdict(list)
    for r in per_task:
        by_type[r["task_type"]].append(r)
    rows = []
    for task_type, rs in [*by_type.items(), ("all", per_task)]:
        g = [float(r["greedy"]) for r in rs]
        s = [_rate([float(x) for x in r["sampled"]]) for r in rs]
        p = [float(any(r["sampled"])) for r in rs]
        lo, hi = wilson(int(sum(g)), len(g), 0.95)
        rows.append({"task_type": task_type, "n": len(rs), "distinct": len({r["question"] for r in rs}),
                     "greedy": _rate(g), "greedy_successes": int(sum(g)), "greedy_ci": [lo, hi],
                     "sampled_mean": _rate(s), f"pass_at_{samples}": _rate(p)})
    return {"rows": rows, "per_task": per_task, "errors": errors, "gen_tokens": tokens,
            "seconds": dict(done.get("seconds", {}))}


def markdown(result: dict, samples: int) -> list[str]:
    lines = [f"| task type | n (distinct) | greedy [95% CI] | T = {result['temperature']:g} mean | pass@{samples} |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lo, hi = r["greedy_ci"]
        lines.append(f"| {r['task_type']} | {r['n']} ({r['distinct']}) | {r['greedy_successes']}/{r['n']} = "
                     f"{r['greedy']:.3f} [{lo:.3f}, {hi:.3f}] | {r['sampled_mean']:.3f} | "
                     f"{r[f'pass_at_{samples}']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.survey", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="run config (repeat for overlays)")
    parser.add_argument("--set", action="append", default=[], help="config override key.path=value")
    parser.add_argument("--tasks", type=int, default=200, help="distinct held-out tasks in all, types round-robin "
                        "(200)")
    parser.add_argument("--samples", type=int, default=8, help="sampled plays per task: k of pass@k (8)")
    parser.add_argument("--seed", type=int, default=None, help="task and sampling seed (default: gate.seed)")
    parser.add_argument("--out", help="write the figures (and per-task outcomes) to this JSON file; the plays "
                        "are kept in OUT.partial as they finish, so the same command resumes a stopped survey")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.samples < 1:
        parser.error("--tasks and --samples must be at least 1")

    cfg = load_config(args.config, args.set)
    from rsiflow.envs.rollout import env_factory
    from rsiflow.tasks.gate import distinct_tasks

    env = env_factory(cfg)()
    try:
        seed = cfg.gate.seed if args.seed is None else args.seed
        tasks = distinct_tasks(env, "heldout", args.tasks, seed)
    finally:
        env.close()
    key = {"configs": args.config, "overrides": args.set, "samples": args.samples, "seed": seed,
           "tasks": [t.task_id for t in tasks], "chunk_tasks": CHUNK_TASKS}
    partial = Path(f"{args.out}.partial") if args.out else None
    done: dict = {}
    if partial is not None and partial.exists():
        saved = json.loads(partial.read_text())
        if saved.get("key") != key:
            sys.exit(f"bench.survey: {partial} holds a survey with other settings (config, --set, --tasks, --samples "
                     "or --seed differ); run with the same ones to resume it, or delete it to start over")
        done = saved["done"]
        print(f"resuming from {partial}: " + ", ".join(f"{ph} {len(done.get(ph, {}))} chunks"
                                                       for ph in ("greedy", "sampled")), flush=True)

    def save() -> None:
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
            tmp = partial.with_name(partial.name + ".tmp")
            tmp.write_text(json.dumps({"key": key, "done": done}) + "\n")
            tmp.replace(partial)

    result = survey(cfg, tasks, args.samples, seed, done, save)
    result.update(env=cfg.env.name, kwargs=cfg.env.kwargs, model=cfg.model.base, split="heldout", seed=seed,
                  samples=args.samples, temperature=cfg.backend.temperature, top_p=cfg.backend.top_p,
                  max_new_tokens=cfg.backend.max_new_tokens, max_turns=cfg.env.max_turns,
                  few_shot=cfg.env.few_shot, configs=args.config, overrides=args.set)
    print(f"env {cfg.env.name} {cfg.env.kwargs}, {args.tasks} held-out tasks (seed {seed}), model {cfg.model.base}; "
          f"greedy {result['seconds']['greedy']:.0f} s, {args.samples} samples/task at T={cfg.backend.temperature:g} "
          f"top-p {cfg.backend.top_p:g} {result['seconds']['sampled']:.0f} s, {result['gen_tokens']} tokens, "
          f"{result['errors']} errors")
    print("\n".join(markdown(result, args.samples)))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
