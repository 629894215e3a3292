"""Two rounds at once on one machine: the slowdown of each against one round alone, per thread policy.

    python -m bench.share --config configs/default.yaml [--set key=val ...] [--policy auto --policy cores] \\
        [--out bench/results/share/share.json]

Runs the config's first round as `rsiflow run` subprocesses (fresh run names and stores in a temporary folder,
so nothing is resumed): first one alone, then, for each `--policy`, two at once (the same config, two run names,
so the same work). The figure is each process's wall time (model load and Prefect start included) over the
alone run's, measured in the same invocation. Policies (`run.threads`):

- `auto`: rsiflow's default, each computing process takes an even share of the cores (models/threads.py);
- `cores`: every process takes every core (`run.threads` = the machine's cores: torch's own default);
- a number: that many threads per process;
- any of them with `+passive` (`cores+passive`): the processes also get OMP_WAIT_POLICY=PASSIVE, so an OpenMP
  thread with no work sleeps at once instead of spinning on a core another process needs;
- or with `+spin=N` (`auto+spin=10000`): GOMP_SPINCOUNT=N, how long (in spins) such a thread spins before it
  sleeps (libgomp, the OpenMP runtime of torch's CPU wheel; its default 300,000 without a wait policy).

The alone run uses `auto` (alone, that is every core); the base model is converted into the model cache
before any run is timed. A second run alone on half the cores gives the floor of an even split (skip it with
`--no-floor`): two rounds at once can't each beat it, so a pair at the floor shares the cores perfectly, and
the pair's slowdown against the run alone on every core is then how well one round used the second core.
Run it on a quiet machine: another job on the cores changes both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(configs: list[str], sets: list[str], name: str, folder: Path, threads: str,
         omp: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rsiflow.flows.cli", "run"]
    for c in configs:
        cmd += ["--config", c]
    for s in [*sets, f"run.name={name}", f"run.store={folder / name}.duckdb", f"run.run_dir={folder / name}",
              "run.rounds=1", f"run.threads={threads}"]:
        cmd += ["--set", s]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false",
           "PREFECT_HOME": str(folder / f"prefect-{name}")}
    for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the policy decides, not the caller
        env.pop(key, None)
    env.update(omp or {})
    log = open(folder / f"{name}.log", "w")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def timed(configs: list[str], sets: list[str], names: list[str], folder: Path, threads: str,
          omp: dict[str, str] | None = None) -> list[float]:
    """Start one `rsiflow run` per name at once; each one's wall seconds (an error names its log)."""
    t0 = time.perf_counter()
    procs = [_run(configs, sets, n, folder, threads, omp) for n in names]
    walls: list[float | None] = [None] * len(procs)
    while None in walls:  # each process's own end, whichever ends first
        for i, p in enumerate(procs):
            if walls[i] is None and p.poll() is not None:
                walls[i] = time.perf_counter() - t0
                p.log.close()
                if p.returncode != 0:
                    for other in procs:
                        if other.poll() is None:
                            other.kill()
                    tail = (folder / f"{names[i]}.log").read_text(errors="replace").splitlines()[-10:]
                    sys.exit(f"bench.share: run {names[i]} failed (exit {p.returncode}); last lines of "
                             f"{folder / names[i]}.log:\n" + "\n".join(tail))
        time.sleep(0.2)
    return walls


def _policy(policy: str, cores: int) -> tuple[str, dict[str, str]]:
    """`run.threads` and the OpenMP environment for a policy name ('auto', 'cores', '2', '...+passive',
    '...+spin=N')."""
    base, *options = policy.split("+")
    omp = {}
    for option in options:
        if option == "passive":
            omp["OMP_WAIT_POLICY"] = "PASSIVE"
        elif option.startswith("spin=") and option[5:].isdigit():
            omp["GOMP_SPINCOUNT"] = option[5:]
        else:
            raise SystemExit(f"bench.share: unknown policy option {option!r} in {policy!r} (passive, spin=N)")
    return (str(cores) if base == "cores" else base), omp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.share", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", required=True, help="run config (repeat for overlays)")
    p.add_argument("--set", action="append", default=[], help="config override key.path=value (every run)")
    p.add_argument("--policy", action="append", default=None,
                   help="run.threads of the two runs at once: auto, cores or a number (repeat; default auto, cores)")
    p.add_argument("--alone", action="append", default=[],
                   help="also time one round alone under this policy (repeat), against the baseline alone run")
    p.add_argument("--no-floor", action="store_true", help="skip the run alone on half the cores (the floor)")
    p.add_argument("--out", type=Path, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    from rsiflow.configs.loader import load_config
    from rsiflow.models.loading import resolve_base_model
    from rsiflow.models.threads import machine_cores

    cfg = load_config(args.config, args.set)
    if not Path(cfg.model.base).is_dir():  # convert (and cache) the base model before any run is timed
        resolve_base_model(cfg.model.base, Path(cfg.run.model_cache).expanduser())
    cores = machine_cores()
    policies = args.policy or ["auto", "cores"]
    result: dict = {"configs": args.config, "overrides": args.set, "cores": cores, "pairs": {}}
    with tempfile.TemporaryDirectory(prefix="rsiflow-share-") as tmp:
        folder = Path(tmp)
        alone = timed(args.config, args.set, ["alone"], folder, "auto")[0]
        result["alone_s"] = round(alone, 1)
        print(f"{cores} cores; one round alone: {alone:.1f} s", flush=True)
        for policy in args.alone:  # other policies alone, against the baseline
            base, omp = _policy(policy, cores)
            tag = policy.replace("+", "-").replace("=", "")
            wall = timed(args.config, args.set, [f"alone-{tag}"], folder, base, omp)[0]
            result.setdefault("alone_other", {})[policy] = {"wall_s": round(wall, 1),
                                                            "of_alone": round(wall / alone, 2)}
            print(f"one round alone, {policy}: {wall:.1f} s = {wall / alone:.2f}x of alone", flush=True)
        if cores > 1 and not args.no_floor:
            # The floor of an even split: one round alone on its share of the cores. Two rounds at once can't
            # each beat it, whatever the policy; the gap to it is what sharing costs beyond the split itself.
            share_of = max(1, cores // 2)
            floor = timed(args.config, args.set, ["floor"], folder, str(share_of))[0]
            result["alone_share_s"] = {"threads": share_of, "wall_s": round(floor, 1),
                                       "of_alone": round(floor / alone, 2)}
            print(f"one round alone on {share_of} thread(s) (an even split's floor): {floor:.1f} s = "
                  f"{floor / alone:.2f}x of alone", flush=True)
        for policy in policies:
            threads, omp = _policy(policy, cores)
            tag = policy.replace("+", "-").replace("=", "")
            walls = timed(args.config, args.set, [f"{tag}-a", f"{tag}-b"], folder, threads, omp)
            ratios = [w / alone for w in walls]
            result["pairs"][policy] = {"threads": threads, "omp_wait_policy": omp.get("OMP_WAIT_POLICY"),
                                       "gomp_spincount": omp.get("GOMP_SPINCOUNT"),
                                       "wall_s": [round(w, 1) for w in walls],
                                       "slowdown": [round(r, 2) for r in ratios]}
            floor = result.get("alone_share_s", {}).get("wall_s")
            wait = "".join(f" {k}={v}" for k, v in omp.items())
            print(f"two at once, run.threads={threads}{wait} ({policy}): {walls[0]:.1f} s and {walls[1]:.1f} s = "
                  f"{ratios[0]:.2f}x and {ratios[1]:.2f}x of alone"
                  + (f", {max(walls) / floor:.2f}x of the floor (the slower one)" if floor else ""), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
