"""Survey an env: a scripted expert's, a random policy's and a model's success per task type.

    python -m examples.env_survey --config configs/arithmetic.yaml --per-type 10
    python -m examples.env_survey --config configs/default.yaml --config examples/byo.yaml --per-type 10
    python -m examples.env_survey --config configs/scienceworld.yaml --per-type 3 --no-model

The env, its kwargs, the turn budget, prompting (few-shot, admissible lists, projection) and the
model come from the config, exactly as a round's gate would play them: held-out tasks
(`--split`), greedy decoding. Per task type it prints a markdown table row: n, the expert's
success (the env's `expert_action()`, within the env's own step limit), a random policy's success
(the env's `random_action(rng)` where it has one, else a uniformly random admissible action,
within `env.max_turns`) and the model's success. `--json FILE` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict

from rsiflow.configs.loader import load_config
from rsiflow.envs import make_env
from rsiflow.envs.base import Env, TaskSpec


def play_expert(env: Env, task: TaskSpec, limit: int = 500) -> bool | None:
    env.reset(task)
    if env.expert_action() is None:
        return None
    for _ in range(limit):
        action = env.expert_action()
        if action is None:
            return False
        result = env.step(action)
        if result.done:
            return result.success
    return False


def play_random(env: Env, task: TaskSpec, max_turns: int, rng: random.Random) -> bool | None:
    env.reset(task)
    for _ in range(max_turns):
        if hasattr(env, "random_action"):
            action = env.random_action(rng)
        else:
            actions = env.admissible_actions()
            if not actions:
                return None
            action = rng.choice(actions)
        result = env.step(action)
        if result.done:
            return result.success
    return False


def play_model(cfg, tasks: list[TaskSpec]) -> list[bool]:
    from pathlib import Path

    from rsiflow.envs.rollout import Episode, run_episodes
    from rsiflow.models.backend import SamplingParams, backend_for
    from rsiflow.models.loading import resolve_base_model

    path = resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser())
    backend = backend_for(cfg, str(path))
    episodes = [Episode(traj_id=f"survey-{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
    params = SamplingParams(max_new_tokens=cfg.backend.max_new_tokens, temperature=0.0, top_p=1.0, seed=cfg.gate.seed)
    run_episodes(lambda: make_env(cfg.env.name, **cfg.env.kwargs), episodes, backend, params, cfg.env.max_turns,
                 cfg.env.show_admissible, cfg.env.few_shot, cfg.env.project_actions)
    errors = [e.error for e in episodes if e.status == "error"]
    if errors:
        print(f"{len(errors)} model episodes errored, e.g. {errors[0]}", file=sys.stderr)
    return [e.success for e in episodes]


def _rate(values: list[bool | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{sum(known)}/{len(known)}" if known else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.env_survey", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="run config (repeat for overlays)")
    parser.add_argument("--set", action="append", default=[], help="config override key.path=value")
    parser.add_argument("--per-type", type=int, default=10, help="tasks per task type (default 10)")
    parser.add_argument("--split", default="heldout", choices=["train", "heldout"])
    parser.add_argument("--seed", type=int, default=None, help="task seed (default: the config's gate.seed)")
    parser.add_argument("--random-runs", type=int, default=5, help="random-policy episodes per task (default 5)")
    parser.add_argument("--no-model", action="store_true", help="skip the model (expert and random only)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    cfg = load_config(args.config, args.set)
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    try:
        types = list(env.task_types)   # the instance's: the kwargs may narrow them
        seed = cfg.gate.seed if args.seed is None else args.seed
        tasks = env.sample_tasks(args.split, args.per_type * len(types), seed)
        t0 = time.perf_counter()
        expert = {t.task_id: play_expert(env, t) for t in tasks}
        rng = random.Random(seed)
        rand = {t.task_id: [play_random(env, t, cfg.env.max_turns, rng) for _ in range(args.random_runs)]
                for t in tasks}
        t_scripted = time.perf_counter() - t0
    finally:
        env.close()
    model: dict[str, bool] = {}
    t_model = 0.0
    if not args.no_model:
        t0 = time.perf_counter()
        model = dict(zip([t.task_id for t in tasks], play_model(cfg, tasks)))
        t_model = time.perf_counter() - t0

    by_type: dict[str, list[TaskSpec]] = defaultdict(list)
    for t in tasks:
        by_type[t.task_type].append(t)
    rows = []
    print(f"env {cfg.env.name}, {args.split} split, seed {seed}, {args.per_type} tasks per type; random: "
          f"{args.random_runs} runs per task within {cfg.env.max_turns} turns; model {cfg.model.base} greedy "
          f"(scripted {t_scripted:.0f} s, model {t_model:.0f} s)")
    print("| task type | n | expert | random | model |\n|---|---|---|---|---|")
    for task_type, ts in list(by_type.items()) + [("all", tasks)]:
        row = {"task_type": task_type, "n": len(ts),
               "expert": _rate([expert[t.task_id] for t in ts]),
               "random": _rate([v for t in ts for v in rand[t.task_id]]),
               "model": _rate([model[t.task_id] for t in ts]) if model else "-"}
        rows.append(row)
        print(f"| {task_type} | {row['n']} | {row['expert']} | {row['random']} | {row['model']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": cfg.env.name, "split": args.split, "seed": seed, "model": cfg.model.base,
                       "rows": rows, "seconds": {"scripted": t_scripted, "model": t_model}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
