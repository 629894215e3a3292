"""Headroom survey: how much room a model has on an env, per task type, before any training.

    python -m bench.survey --config configs/arithmetic.yaml --tasks 200 --samples 8 \\
        --out bench/results/learning-survey/arithmetic.json

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
import sys
import time
from collections import defaultdict
from pathlib import Path

from rsiflow.configs.loader import load_config
from rsiflow.stats.success import wilson_interval as wilson


def _rate(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def survey(cfg, tasks: list, samples: int, seed: int) -> dict:
    """Play `tasks` greedy once and `samples` times sampled; per-type figures and the per-task outcomes."""
    from rsiflow.envs.rollout import Episode
    from rsiflow.models.backend import backend_for
    from rsiflow.models.loading import resolve_base_model
    from rsiflow.tasks.common import play

    path = resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser()) \
        if not Path(cfg.model.base).is_dir() else Path(cfg.model.base)
    backend = backend_for(cfg, str(path))
    greedy = [Episode(traj_id=f"greedy-{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
    t0 = time.perf_counter()
    play(cfg, backend, greedy, 0.0, seed, f"survey greedy ({len(greedy)} tasks)", temp_logprobs=False)
    t_greedy = time.perf_counter() - t0
    sampled = [Episode(traj_id=f"sample-{i}-{k}", task=t, group_id=t.task_id, sample_idx=k)
               for i, t in enumerate(tasks) for k in range(samples)]
    t0 = time.perf_counter()
    play(cfg, backend, sampled, cfg.backend.temperature, seed, f"survey sampled ({len(sampled)} plays)",
         temp_logprobs=False)
    t_sampled = time.perf_counter() - t0
    per_task = []
    for i, t in enumerate(tasks):
        outs = [e.success for e in sampled[i * samples:(i + 1) * samples]]
        per_task.append({"task_id": t.task_id, "task_type": t.task_type, "greedy": bool(greedy[i].success),
                         "sampled": [bool(x) for x in outs], "greedy_action": [x.action_text for x in greedy[i].turns],
                         "question": json.dumps(t.spec, sort_keys=True)})
    errors = sum(e.status == "error" for e in greedy + sampled)
    tokens = sum(e.gen_tokens for e in greedy + sampled)
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
            "seconds": {"greedy": round(t_greedy, 1), "sampled": round(t_sampled, 1)}}


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
    parser.add_argument("--out", help="write the figures (and per-task outcomes) to this JSON file")
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
    result = survey(cfg, tasks, args.samples, seed)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
