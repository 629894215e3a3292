"""The hf backend's packed Linear layers (`backend.hf.packed_linears`) against PyTorch's own, in one run.

    python -m bench.packed [--model embedded:smollm2-135m-instruct] [--episodes 16] [--max-turns 6] [--dtype float32]

Plays the same household episodes through the engine (`kv_reuse` on, as the default config) with PyTorch's Linear
layers and with the packed ones (models/packed_linear.py), greedy and then sampled (temperature 1, top-p 0.95, the
same seed), each in a fresh backend in this process. Prints, for each, the seconds in `backend.generate` split
into prefill passes, decoding steps and the rest (bench.engine's clock), the ratio of the two, and how many
episodes played exactly the same generations (token for token, every turn) with the largest |delta logprob| of
their tokens: the two libraries sum in different orders, so float32 logprobs differ in the last bits, and a
sampled episode may draw another token where that moves a draw across a boundary.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.cli import add_model_args, model_path
from bench.engine import ForwardClock, Recorder
from rsiflow.envs import make_env
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend


def play(path: Path, packed: bool, dtype: str, tasks: list, params: SamplingParams, max_turns: int) -> dict:
    backend = HFBackend(path, kv_reuse=True, dtype=dtype, packed_linears=packed)
    episodes = [Episode(traj_id=f"b{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
    rec = Recorder(backend)
    clock = ForwardClock(backend.model)
    run_episodes(lambda: make_env("household"), episodes, rec, params, max_turns)
    clock.remove()
    prefill = sum(p["seconds"] for p in clock.passes if p["query"] > 1)
    decode = sum(p["seconds"] for p in clock.passes if p["query"] == 1)
    return {"seconds": rec.seconds, "prefill": prefill, "decode": decode, "other": rec.seconds - prefill - decode,
            "steps": sum(p["query"] == 1 for p in clock.passes), "episodes": episodes}


def compare(a: list[Episode], b: list[Episode]) -> tuple[int, float]:
    """Episodes whose turns generated the same tokens in both plays, and the largest |delta logprob| of those
    tokens."""
    same, worst = 0, 0.0
    for x, y in zip(a, b):
        if len(x.turns) == len(y.turns) and all(s.token_ids == t.token_ids for s, t in zip(x.turns, y.turns)):
            same += 1
            for s, t in zip(x.turns, y.turns):
                worst = max([worst, *(abs(p - q) for p, q in zip(s.logprobs, t.logprobs))])
    return same, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--dtype", default="float32", help="the backend's dtype (float32, bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = model_path(args)
    tasks = make_env("household").sample_tasks("train", args.episodes, args.seed)
    print(f"model {args.model}  dtype {args.dtype}  episodes {args.episodes}  max_turns {args.max_turns}  "
          f"torch threads {torch.get_num_threads()}")
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.95, seed=args.seed)
        runs = {}
        for packed in (False, True):
            t0 = time.perf_counter()
            runs[packed] = play(path, packed, args.dtype, tasks, params, args.max_turns)
            r = runs[packed]
            print(f"T={temperature:g} {'packed ' if packed else 'pytorch'}: backend.generate {r['seconds']:.1f} s "
                  f"(prefill {r['prefill']:.1f} s, decoding {r['decode']:.1f} s in {r['steps']} steps, other "
                  f"{r['other']:.1f} s); wall with model load {time.perf_counter() - t0:.1f} s")
        old, new = runs[False], runs[True]
        same, worst = compare(old["episodes"], new["episodes"])
        print(f"T={temperature:g} packed / pytorch: backend.generate {old['seconds'] / new['seconds']:.2f}x faster, "
              f"prefill {old['prefill'] / new['prefill']:.2f}x, decoding step "
              f"{old['decode'] / old['steps'] / (new['decode'] / new['steps']):.2f}x; episodes with the same "
              f"generations {same}/{len(tasks)} (largest |delta logprob| among them {worst:.1e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
