"""The parts of the hf backend's decoding step, each against what transformers does in its place, in one run.

    python -m bench.decode [--model embedded:smollm2-135m-instruct] [--episodes 16] [--turns 2] [--top-p 0.95]
        [--contexts 300,1200]

1. Plays `--episodes` household episodes for `--turns` turns with the hf backend at temperature 1, then runs the
   model once over each played conversation and keeps the logits at every position where the model generated a
   token: the distributions a sampling step really sees (how wide the nucleus is decides what top-p costs).
2. Times, on batches of `--batch` of those rows (the engine's decode batch), in this process and this run:
   transformers' `TopPLogitsWarper` (a full sort of the vocabulary), rsiflow's `NucleusWarper` (the same kept
   set from the top-ranked tokens), the rest of a sampling step (softmax, multinomial, two log-softmaxes), the
   whole sampling step of `backend.hf.sampler: nucleus` (`sample_nucleus`: drawn among the nucleus only), and
   one decode step of the model itself at that batch (the context of the played episodes).
3. Times the model's decode step at `--contexts` tokens of context with transformers' `DynamicLayer` cache (which
   concatenates, copying each layer's whole cache every step) and with the backend's `ReservedCacheLayer` (written in
   place), and checks that both give the same logits bit for bit.
4. Times prefill and the decode step at the longest of `--contexts` with bfloat16 weights: attention in bfloat16
   (transformers' SDPA) and in float32 on a float32 cache (what the hf backend does on CPU), against float32.
Prints ms per step of each, the ratio of the two top-p filters, what top-p adds to a decode step before and
after, the nucleus sizes seen, in how many rows the two kept sets differ (tokens at the boundary, see
tests/models/test_nucleus.py), and the decode step with either cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import TopPLogitsWarper

from bench.cli import add_model_args, model_path
from bench.engine import Recorder
from rsiflow.envs import make_env
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import FLOAT32_SDPA, HFBackend, NucleusWarper, ReservedCacheLayer, sample_nucleus


def played_logits(backend: HFBackend, rec: Recorder) -> tuple[torch.Tensor, int]:
    """Logits (rows, vocab) at every generated position of the recorded calls, and the mean prompt length."""
    tok, model = backend.tokenizer, backend.model
    rows, lengths = [], []
    with torch.inference_mode():
        for conversations, gens in rec.calls:
            texts = tok.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
            for text, g in zip(texts, gens):
                prompt = tok(text, add_special_tokens=False)["input_ids"]
                if not g.token_ids:
                    continue
                ids = torch.tensor([prompt + g.token_ids])
                logits = model(input_ids=ids).logits[0].float()
                rows.append(logits[len(prompt) - 1:len(prompt) - 1 + len(g.token_ids)])
                lengths.append(len(prompt))
    return torch.cat(rows), round(statistics.mean(lengths))


def per_call_ms(fn, batches: list[torch.Tensor], repeats: int) -> float:
    fn(batches[0])
    t0 = time.perf_counter()
    for _ in range(repeats):
        for b in batches:
            fn(b)
    return 1000 * (time.perf_counter() - t0) / (repeats * len(batches))


def decode_step_ms(model, batch: int, context: int, steps: int = 8, reserved: bool = True,
                   kv_dtype: torch.dtype | None = None, prefill: list | None = None) -> tuple[float, torch.Tensor]:
    """One decode step of `batch` rows after a prefill of `context` tokens each (random ids, seeded), with the
    backend's reserved cache (keys/values in `kv_dtype`) or transformers' DynamicLayer; and the last step's logits.
    The prefill's tokens/s is appended to `prefill` when given."""
    ids = torch.randint(100, 20_000, (batch, context), generator=torch.Generator().manual_seed(context))
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        if reserved:
            cache.layers = [ReservedCacheLayer(context + steps + 1, dtype=kv_dtype) for _ in cache.layers]
        t0 = time.perf_counter()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        if prefill is not None:
            prefill.append(batch * context / (time.perf_counter() - t0))
        nxt = out.logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt[:, None], cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
    return 1000 * (time.perf_counter() - t0) / steps, out.logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="rows per sampling step (the engine's decode batch)")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--contexts", default="300,1200", help="contexts (tokens) of the cache comparison")
    args = ap.parse_args()

    path = model_path(args)
    backend = HFBackend(path, max_batch_size=args.batch, kv_reuse=True)
    tasks = make_env("household").sample_tasks("train", args.episodes, args.seed)
    episodes = [Episode(traj_id=f"s{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
    rec = Recorder(backend)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=args.top_p, stop=("\n",), seed=args.seed)
    run_episodes(lambda: make_env("household"), episodes, rec, params, args.turns)
    logits, context = played_logits(backend, rec)
    n = len(logits) // args.batch * args.batch
    batches = [logits[i:i + args.batch] for i in range(0, n, args.batch)]

    hf, ours = TopPLogitsWarper(args.top_p), NucleusWarper(args.top_p)
    hf_ms = per_call_ms(lambda b: hf(None, b.clone()), batches, args.repeats)
    ours_ms = per_call_ms(lambda b: ours(None, b), batches, args.repeats)

    def rest(b):
        torch.multinomial(torch.softmax(b, dim=-1), num_samples=1)
        torch.log_softmax(b, dim=-1)
        torch.log_softmax(b, dim=-1)

    rest_ms = per_call_ms(rest, batches, args.repeats)
    # backend.hf.sampler 'nucleus': the whole sampling step (top-p, draw, both logprobs) among the nucleus only
    race_ms = per_call_ms(lambda b: sample_nucleus(b, 1.0, args.top_p), batches, args.repeats)
    step_ms, _ = decode_step_ms(backend.model, args.batch, context)
    kept_hf = ~torch.isinf(hf(None, logits[:n].clone()))
    kept_ours = ~torch.isinf(ours(None, logits[:n]))
    sizes = sorted(kept_hf.sum(-1).tolist())
    differ = int((kept_hf != kept_ours).any(-1).sum())

    print(f"rows: {n} generated positions of {args.episodes} household episodes x {args.turns} turns at T = 1 "
          f"(mean prompt {context} tokens); batch {args.batch}; top_p {args.top_p}; torch threads "
          f"{torch.get_num_threads()}")
    print(f"nucleus size: median {sizes[len(sizes) // 2]}, p90 {sizes[int(0.9 * (len(sizes) - 1))]}, "
          f"max {sizes[-1]} tokens of {logits.shape[-1]}")
    print("| per sampling step | ms | of a decode step |\n|---|---|---|")
    print(f"| model decode step (batch {args.batch}, context {context}) | {step_ms:.1f} | 1 |")
    print(f"| top-p, transformers TopPLogitsWarper (full sort) | {hf_ms:.2f} | {hf_ms / step_ms:.3f} |")
    print(f"| top-p, rsiflow NucleusWarper | {ours_ms:.2f} | {ours_ms / step_ms:.3f} |")
    print(f"| softmax + multinomial + 2 log-softmax | {rest_ms:.2f} | {rest_ms / step_ms:.3f} |")
    print(f"| whole sampling step, sampler 'nucleus' (top-p, draw among the nucleus, 2 logprobs) | {race_ms:.2f} | "
          f"{race_ms / step_ms:.3f} |")
    print(f"top-p speed-up: {hf_ms / ours_ms:.1f}x; a sampled decode step (model + top-p + rest) "
          f"{(step_ms + hf_ms + rest_ms) / (step_ms + ours_ms + rest_ms):.2f}x faster; kept sets differ in "
          f"{differ} of {n} rows")
    print(f"sampler 'nucleus' vs 'full': sampling step {(ours_ms + rest_ms) / race_ms:.1f}x faster; a sampled decode "
          f"step {(step_ms + ours_ms + rest_ms) / (step_ms + race_ms):.2f}x faster")

    print(f"| decode step (batch {args.batch}) | DynamicLayer (concatenating) ms | rsiflow ReservedCacheLayer ms | "
          "speed-up | same logits |")
    print("|---|---|---|---|---|")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        rows = {}
        for reserved in (False, True, False, True):  # interleaved, each measured twice; the faster of the two kept
            ms, logits = decode_step_ms(backend.model, args.batch, ctx, reserved=reserved)
            best = rows.get(reserved, (float("inf"), None))[0]
            rows[reserved] = (min(ms, best), logits)
        same = torch.equal(rows[False][1], rows[True][1])
        print(f"| context {ctx} | {rows[False][0]:.1f} | {rows[True][0]:.1f} | {rows[False][0] / rows[True][0]:.2f}x | "
              f"{same} |")

    ctx = max(int(c) for c in args.contexts.split(","))
    model = backend.model
    variants = [("float32", torch.float32, "sdpa", None),
                ("bfloat16, attention in bfloat16", torch.bfloat16, "sdpa", None),
                ("bfloat16, attention in float32 (rsiflow on CPU)", torch.bfloat16, FLOAT32_SDPA, torch.float32)]
    print(f"| weights (batch {args.batch}, context {ctx}) | prefill tok/s | decode step ms | of float32's step |")
    print("|---|---|---|---|")
    first = None
    for name, dtype, attention, kv_dtype in variants:
        model.to(dtype)
        model.set_attn_implementation(attention)
        prefill: list[float] = []
        ms = min(decode_step_ms(model, args.batch, ctx, kv_dtype=kv_dtype, prefill=prefill)[0] for _ in range(2))
        first = first or ms
        print(f"| {name} | {max(prefill):.0f} | {ms:.1f} | {ms / first:.2f} |")
    model.to(torch.float32)
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
