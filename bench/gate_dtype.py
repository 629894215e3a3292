"""Does the gate decide the same when its plays run in bfloat16 instead of float32? The evidence behind
`gate.dtype: sampler` (the gate, the final test split and the greedy diagnostics playing in the sampler's
cheaper dtype).

    python -m bench.gate_dtype --config configs/learn.yaml --candidate runs/learn/models/round-1-candidate \\
        [--tasks 192] [--samples 4] [--dtypes float32,bfloat16] [--out FILE.json]

Every model (the config's base, and `--candidate` when given) plays the same `--tasks` distinct held-out tasks
(drawn as the gate draws them, `gate.seed`) once greedy and, with `--samples k`, k times at the training
temperature, in each dtype, through the gate's own code (`tasks.gate.HeldoutPlays`, the backend opened with
`backend.<kind>.dtype` = that dtype and `gate.dtype: sampler`). The sampled plays use the same seeds in every
dtype, so where the two dtypes' logits pick the same tokens the plays are the same. It prints, per model and
dtype against the first (the trainer's dtype):

- greedy: the share of tasks whose actions are identical, success in both / only one, each success rate
  with its Wilson interval and the paired difference with its interval;
- sampled: each mean success and the paired difference of per-task success counts with its interval;
- with a candidate, the gate's decision (`gate.rule`, `gate.alpha`, no growth) on each block of
  `gate.heldout_tasks` tasks and on all tasks, greedy and sampled, in each dtype: how many decisions agree,
  and the p-values side by side;
- the wall seconds of each model's plays in each dtype and their ratio to the first dtype's (measured in
  this run, on this machine).

`--key K --values a,b` compares the values of another setting the same way instead of dtypes (e.g. `--key
backend.hf.shared_prefix_attention --values false,true --set backend.hf.dtype=float32`: does attending to the
shared prefix apart change the float32 gate's greedy plays?).

Equivalence is for the reader to judge from the figures; the bench does not declare it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rsiflow.configs.loader import load_config


def _pct(a: int, n: int) -> str:
    return f"{a}/{n} = {a / n:.3f}" if n else "0/0"


def play_model(cfg, tasks: list, path: str, tag: str, samples: int) -> tuple[dict, float]:
    """One model's greedy (and sampled) plays of `tasks` in `cfg`'s evaluation dtype, as the gate plays them;
    (per-task outcomes, wall seconds)."""
    from rsiflow.tasks.gate import HeldoutPlays, sample_seed

    g = cfg.gate
    plays = HeldoutPlays(cfg, tasks, {tag: path}, {tag: tag}, f"bench-gate-dtype/{tag}", g.seed,
                         {tag: sample_seed(g.seed, 1, tag)}, samples, f"gate dtype {cfg.backend.options()['dtype']}")
    t0 = time.perf_counter()
    plays.play_first(len(tasks))
    seconds = time.perf_counter() - t0
    out = {"greedy": [bool(plays.greedy[tag][i]["success"]) for i in range(len(tasks))],
           "actions": [plays.greedy[tag][i]["actions"] for i in range(len(tasks))]}
    if samples:
        out["sampled"] = [plays.sampled[tag][i]["successes"] for i in range(len(tasks))]
        out["sampled_actions"] = [[[t.action_text for t in e.turns] for e in plays.played_sampled[tag]
                                   if e.traj_id.rsplit("/", 1)[-1].startswith(f"{i:04d}-")] for i in range(len(tasks))]
    return out, seconds


def agreement(a: dict, b: dict, samples: int, confidence: float) -> dict:
    """Figures of b's plays against a's on the same tasks (a: the reference dtype)."""
    from rsiflow.stats.success import compare, wilson_interval

    n = len(a["greedy"])
    out = {"n": n, "identical_actions": sum(x == y for x, y in zip(a["actions"], b["actions"])),
           "both": sum(x and y for x, y in zip(a["greedy"], b["greedy"])),
           "only_reference": sum(x and not y for x, y in zip(a["greedy"], b["greedy"])),
           "only_other": sum(y and not x for x, y in zip(a["greedy"], b["greedy"]))}
    for key, outcomes in (("reference", a), ("other", b)):
        s = sum(outcomes["greedy"])
        out[f"{key}_greedy"] = [s, list(wilson_interval(s, n, confidence))]
    ev = compare(b["greedy"], a["greedy"], "paired_test", confidence)
    out["greedy_diff"] = [ev.paired_diff, list(ev.paired_diff_ci)]
    if samples:
        ev = compare(b["sampled"], a["sampled"], "paired_test", confidence, samples)
        out["sampled"] = {"reference": sum(a["sampled"]) / (n * samples), "other": sum(b["sampled"]) / (n * samples),
                          "diff": [ev.paired_diff, list(ev.paired_diff_ci)],
                          "identical_plays": sum(x == y for xs, ys in zip(a["sampled_actions"], b["sampled_actions"])
                                                 for x, y in zip(xs, ys)), "plays": n * samples}
    return out


def decisions(cand: dict, champ: dict, rule, block: int, samples: int) -> dict:
    """The gate's decision, candidate against champion, on each block of `block` tasks and on all of them."""
    from rsiflow.stats.gating import sequential_decision

    n = len(cand["greedy"])
    spans = [(s, s + block) for s in range(0, n - block + 1, block)] + [(0, n)]
    out = {}
    for metric, k in (("greedy", 1), ("sampled", samples)) if samples else (("greedy", 1),):
        rows = []
        for lo, hi in spans:
            c, h = cand[metric][lo:hi], champ[metric][lo:hi]
            result = sequential_decision(lambda m, c=c, h=h: (c[:m], h[:m]), [hi - lo], rule, k)
            rows.append({"tasks": [lo, hi], "decision": result.decision,
                         "p_value": result.looks[-1].get("p_value"), "wins": result.evidence.wins,
                         "losses": result.evidence.losses})
        out[metric] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate_dtype", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, help="run config (repeat for overlays)")
    parser.add_argument("--set", action="append", default=[], help="config override key.path=value")
    parser.add_argument("--candidate", help="a trained checkpoint folder to play beside the base (gives the "
                        "gate decisions)")
    parser.add_argument("--tasks", type=int, default=192, help="distinct held-out tasks (192: four gates of 48)")
    parser.add_argument("--samples", type=int, default=0, help="sampled plays per task (0: greedy only)")
    parser.add_argument("--dtypes", "--values", dest="dtypes", default="float32,bfloat16",
                        help="comma-separated values of --key; the first is the reference (the trainer's dtype)")
    parser.add_argument("--key", help="the config key the compared values set (default: backend.<kind>.dtype), "
                        "e.g. backend.hf.shared_prefix_attention with --values false,true")
    parser.add_argument("--out", help="also write every figure and per-task outcome to this JSON file")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if len(dtypes) < 2 or args.tasks < 1 or args.samples < 0:
        parser.error("give at least two --dtypes, --tasks >= 1 and --samples >= 0")

    from rsiflow.envs.rollout import env_factory
    from rsiflow.models.loading import resolve_base_model
    from rsiflow.stats.gating import Rule
    from rsiflow.tasks.gate import distinct_tasks

    base_cfg = load_config(args.config, args.set)
    env = env_factory(base_cfg)()
    try:
        tasks = distinct_tasks(env, "heldout", args.tasks, base_cfg.gate.seed)
    finally:
        env.close()
    base = base_cfg.model.base
    base_path = str(base if Path(base).is_dir() else resolve_base_model(base, Path(base_cfg.run.model_cache)
                                                                       .expanduser()))
    models = {"base": base_path}
    if args.candidate:
        if not Path(args.candidate).is_dir():
            parser.error(f"--candidate {args.candidate}: no such checkpoint folder")
        models["candidate"] = args.candidate
    kind = base_cfg.backend.kind
    key = args.key or f"backend.{kind}.dtype"
    column = "dtype" if key == f"backend.{kind}.dtype" else key
    results: dict = {d: {} for d in dtypes}
    seconds: dict = {d: {} for d in dtypes}
    for d in dtypes:
        cfg = load_config(args.config, [*args.set, f"{key}={d}", "gate.dtype=sampler"])
        for tag, path in models.items():
            results[d][tag], seconds[d][tag] = play_model(cfg, tasks, path, tag, args.samples)
            print(f"{tag} in {d}: {seconds[d][tag]:.1f} s", flush=True)

    g, ref = base_cfg.gate, dtypes[0]
    print(f"\nenv {base_cfg.env.name} {base_cfg.env.kwargs}, {len(tasks)} held-out tasks (seed {g.seed}), "
          f"backend {kind}, greedy at T={g.temperature:g}" + (f", {args.samples} sampled plays a task at "
                                                              f"T={base_cfg.backend.temperature:g}" if args.samples
                                                              else ""))
    figures: dict = {}
    lines = [f"| model | {column} | identical greedy actions | greedy success [95% CI] | succeeds in both / only "
             f"{ref} / only this | greedy diff vs {ref} [95% CI] |"
             + (f" sampled success | sampled diff vs {ref} [95% CI] | identical sampled plays |" if args.samples
                else "") + f" seconds | x vs {ref} |", "|---|---|---|---|---|---|" + ("---|---|---|" if args.samples
                                                                                    else "") + "---|---|"]
    for tag in models:
        for d in dtypes:
            f = agreement(results[ref][tag], results[d][tag], args.samples, g.confidence)
            figures.setdefault(tag, {})[d] = f
            s, (lo, hi) = f["other_greedy"]
            diff, (dlo, dhi) = f["greedy_diff"]
            row = (f"| {tag} | {d} | {_pct(f['identical_actions'], f['n'])} | {_pct(s, f['n'])} [{lo:.3f}, "
                   f"{hi:.3f}] | {f['both']} / {f['only_reference']} / {f['only_other']} | {diff:+.3f} "
                   f"[{dlo:+.3f}, {dhi:+.3f}] |")
            if args.samples:
                sp = f["sampled"]
                sd, (slo, shi) = sp["diff"]
                row += (f" {sp['other']:.3f} | {sd:+.3f} [{slo:+.3f}, {shi:+.3f}] | "
                        f"{_pct(sp['identical_plays'], sp['plays'])} |")
            row += f" {seconds[d][tag]:.1f} | {seconds[ref][tag] / seconds[d][tag]:.2f} |"
            lines.append(row)
    print("\n".join(lines))
    gates: dict = {}
    if args.candidate:
        rule = Rule(g.rule, g.alpha, g.margin, g.confidence)
        for d in dtypes:
            gates[d] = decisions(results[d]["candidate"], results[d]["base"], rule, g.heldout_tasks, args.samples)
        print(f"\ngate decisions, candidate against base ({g.rule}, alpha {g.alpha:g}), blocks of "
              f"{g.heldout_tasks} tasks and all {len(tasks)}:")
        print("| metric | tasks | " + " | ".join(f"{d}: decision (p, wins/losses)" for d in dtypes) + " | same |")
        print("|---|---|" + "---|" * len(dtypes) + "---|")
        agree = total = 0
        for metric in gates[ref]:
            for i, r0 in enumerate(gates[ref][metric]):
                cells = []
                for d in dtypes:
                    r = gates[d][metric][i]
                    p = "" if r["p_value"] is None else f"p {r['p_value']:.3g}, "
                    cells.append(f"{r['decision']} ({p}{r['wins']}/{r['losses']})")
                same = all(gates[d][metric][i]["decision"] == r0["decision"] for d in dtypes)
                agree, total = agree + same, total + 1
                print(f"| {metric} | {r0['tasks'][0]}-{r0['tasks'][1]} | " + " | ".join(cells)
                      + f" | {'yes' if same else 'NO'} |")
        print(f"decisions the same in every dtype: {agree} of {total}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "configs": args.config, "overrides": args.set, "models": models, "key": key, "dtypes": dtypes,
            "task_ids": [t.task_id for t in tasks], "samples": args.samples, "seconds": seconds,
            "figures": figures, "gates": gates,
            "outcomes": {d: {tag: {k: v for k, v in r.items() if k in ("greedy", "sampled")}
                             for tag, r in results[d].items()} for d in dtypes}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
