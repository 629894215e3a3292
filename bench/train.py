"""Trainer throughput against the machine's limit, measured in the same run.

    python -m bench.train [--model embedded:smollm2-135m-instruct] [--rows 32] [--batch-size 4] [--epochs 1]

Trains a candidate through the real path (`models.trainer.train_candidate`, TRL's SFTTrainer with rsiflow's
collator and loss) on solved household episodes by the env's scripted expert: the rows ExIt trains on, with
the few-shot demonstration in the prompt. Prints the tokens processed per second (every input token of a row
goes forward and backward, labelled or not) between the end of the first optimizer step and the end of the
last (model loading, the first step's warm-up and the checkpoint save left out; the tokens of those steps taken as
(N - 1) / N of all, the rows being shuffled into steps of equal size), and that rate as a fraction
of the limit bench/roofline.py measures in the same process for the model's dtype and device: the matmul
FLOP/s reached there over 3 x the model's forward matmul FLOPs per token.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench import roofline
from bench.cli import add_model_args, model_path
from rsiflow.configs.schema import TrainConfig
from rsiflow.envs import make_env
from rsiflow.envs.rollout import prompt_prefix, render_observation
from rsiflow.models.encoding import encode_rows
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.trainer import train_candidate


def expert_rows(n: int, seed: int) -> list[dict]:
    """`n` SFT rows: household training tasks solved by the scripted expert, as the rollout presents them."""
    env = make_env("household")
    rows = []
    for i, task in enumerate(env.sample_tasks("train", n, seed)):
        prefix = prompt_prefix(env)
        msgs = [*prefix, {"role": "user", "content": render_observation(env.reset(task), env.admissible_actions(),
                                                                        True)}]
        for _ in range(50):
            res = env.step(action := env.expert_action())
            msgs.append({"role": "assistant", "content": action})
            if res.done:
                break
            msgs.append({"role": "user", "content": render_observation(res.observation, env.admissible_actions(),
                                                                       True)})
        else:
            raise RuntimeError(f"the household expert did not finish task {task.task_id} in 50 steps")
        rows.append({"example_id": f"e{i}", "kind": "sft", "messages": msgs, "weight": 1.0,
                     "train_from": len(prefix)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32", help="float32, or bfloat16 (a GPU's mixed precision)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    path = model_path(args)
    rows = expert_rows(args.rows, args.seed)
    cfg = TrainConfig(learning_rate=1e-5, epochs=args.epochs, batch_size=args.batch_size)
    encoded, _ = encode_rows(AutoTokenizer.from_pretrained(path), rows, cfg.max_length)
    tokens = sum(len(r["input_ids"]) for r in encoded)
    labelled = sum(sum(lab != -100 for lab in r["labels"]) for r in encoded)

    marks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rsiflow-bench-train-") as out:
        t0 = time.perf_counter()
        metrics, _ = train_candidate(path, rows, Path(out) / "cand", cfg, seed=args.seed, dtype=args.dtype,
                                     on_step=lambda step, total: marks.append(time.perf_counter()))
        wall = time.perf_counter() - t0
    steps = len(marks)
    if steps < 2:
        raise SystemExit(f"{steps} optimizer step(s): give more --rows or --epochs to time steps 2..N")
    timed_tokens = tokens * args.epochs * (steps - 1) / steps
    rate = timed_tokens / (marks[-1] - marks[0])

    model, _ = load_model_and_tokenizer(path, dtype=args.dtype)
    if torch.cuda.is_available():
        model = model.to("cuda")
    per_token = 3 * roofline.flops_per_token(model)
    flops = roofline.matmul_flops(model)
    limit = flops / per_token
    print(f"model {args.model}  rows {len(encoded)}  batch {args.batch_size}  epochs {args.epochs}  "
          f"dtype {args.dtype}  torch threads {torch.get_num_threads()}")
    print(f"rows     : {tokens} tokens ({tokens / len(encoded):.0f} a row, {labelled} labelled), "
          f"{steps} optimizer steps, loss {metrics['first_loss']:.3f} -> {metrics['last_loss']:.3f}")
    print(f"trainer  : {rate:.0f} processed tok/s over steps 2..{steps} "
          f"({marks[-1] - marks[0]:.2f} s; {wall:.1f} s with load, warm-up and save)")
    print(f"limit    : matmul {flops / 1e9:.0f} GFLOP/s ({roofline.describe(model)}) / "
          f"{per_token / 1e6:.0f} MFLOP per trained token (3 x forward) = {limit:.0f} tok/s")
    print(f"fraction : {rate / limit:.3f} of the limit")


if __name__ == "__main__":
    main()
