"""What prompt-lookup (n-gram) speculative decoding would save the hf engine: an estimate, nothing is built.

    python -m bench.lookup [--episodes 16] [--max-turns 6] [--ks 2,4,8]

1. Plays household episodes through the `hf` backend (kv_reuse, as configs/default.yaml), once greedy and once
   sampled (T = 1, top-p 0.95, nucleus), recording each chunk's rows: prompt token ids and the tokens it generated.
2. Replays every row offline: at each step, draft up to k tokens by finding the row's last 3 (else 2, else 1)
   tokens earlier in its prompt and output (the latest match) and copying what followed; the model's tokens
   accept the longest matching part of the draft, plus its own next token. A row needs one verifying pass per
   such step; a chunk as many as its slowest row (its rows decode in lockstep). For greedy rows this is exactly
   what verification would give (up to float rounding); for sampled rows, whose draft is accepted with the
   token's probability, the recorded draw stands in for one such draw.
3. Times one forward pass of 10 rows over 600 and 1,000 cached positions with 1 + k new tokens each (the verifying
   pass) against 1 token (a decoding step), in the engine's own cache layer.

Prints, per k, the chunks' decoding passes with and without drafts, the cost of a verifying pass in decoding
steps, and their quotient: how much faster decoding would be.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from bench.cli import add_model_args, model_path
from rsiflow.envs import make_env
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend, ReservedCacheLayer


def draft(context: list[int], k: int, longest: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's last n tokens (n = `longest`
    down to 1); [] when none occurs."""
    for n in range(min(longest, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def passes(prompt: list[int], out: list[int], k: int) -> int:
    """Verifying passes a row generating `out` after `prompt` needs with drafts of up to k tokens."""
    done = steps = 0
    while done < len(out):
        guess = draft(prompt + out[:done], k)
        accepted = 0
        while accepted < len(guess) and done + accepted < len(out) and guess[accepted] == out[done + accepted]:
            accepted += 1
        done += accepted + 1
        steps += 1
    return steps


def record(backend: HFBackend, episodes: int, max_turns: int, temperature: float) -> list[list[tuple]]:
    """Each chunk's rows (prompt ids, generated ids with the stopping token) of one play of `episodes`."""
    chunks, inner = [], HFBackend._generate_chunk_reusing
    eos = backend.tokenizer.eos_token_id   # a row that stopped generated its end token too (a stop string's
    # last token instead: close enough for a count)

    def recorded(self, prompts, matches, params, *args, **kwargs):
        prompts = [list(p) for p in prompts]
        generations = inner(self, prompts, matches, params, *args, **kwargs)
        chunks.append([(p, g.token_ids + ([eos] if g.finish_reason == "stop" else []))
                       for p, g in zip(prompts, generations)])
        return generations

    HFBackend._generate_chunk_reusing = recorded
    try:
        tasks = make_env("household").sample_tasks("train", episodes, 0)
        eps = [Episode(traj_id=f"l{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
        run_episodes(lambda: make_env("household"), eps, backend,
                     SamplingParams(max_new_tokens=16, temperature=temperature, top_p=0.95, seed=0), max_turns)
    finally:
        HFBackend._generate_chunk_reusing = inner
    return chunks


def pass_seconds(model, cached: int, news: list[int], rows: int = 10, repeats: int = 4) -> list[float]:
    """Least time of a forward pass of `rows` rows x n new tokens after `cached` positions in the engine's cache,
    for each n of `news` (the cached positions prefilled once)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedCacheLayer(cached + max(news)) for _ in cache.layers]
    ids = torch.randint(100, 1000, (rows, cached))
    best = [float("inf")] * len(news)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True, logits_to_keep=1)
        for _ in range(repeats):
            for j, new in enumerate(news):
                step = torch.randint(100, 1000, (rows, new))
                mask = torch.ones(rows, cached + new, dtype=torch.long)
                positions = torch.arange(cached, cached + new)[None].expand(rows, new)
                t0 = time.perf_counter()
                model(input_ids=step, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                      logits_to_keep=new)
                best[j] = min(best[j], time.perf_counter() - t0)
                for layer in cache.layers:   # forget the pass's tokens
                    layer.fill(layer.length - new)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--ks", default="2,4,8", help="draft lengths to estimate")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    path = model_path(args)
    backend = HFBackend(path, max_batch_size=16, kv_reuse=True, sampler="nucleus")
    print(f"model {args.model}  episodes {args.episodes}  max_turns {args.max_turns}  torch threads "
          f"{torch.get_num_threads()}")
    costs = {}
    for cached in (600, 1000):
        one, *verifying = pass_seconds(backend.model, cached, [1, *(1 + k for k in ks)])
        for k, seconds in zip(ks, verifying):
            costs.setdefault(k, []).append(seconds / one)
        print(f"a decoding step of 10 rows over {cached} positions: {one * 1e3:.0f} ms; a verifying pass of 1 + k "
              "tokens: " + ", ".join(f"k={k} {costs[k][-1]:.2f}x" for k in ks))
    for label, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        chunks = record(backend, args.episodes, args.max_turns, temperature)
        backend.clear_kv_store()
        plain = sum(max(len(out) for _, out in rows) for rows in chunks)
        for k in ks:
            drafted = sum(max(passes(p, out, k) for p, out in rows) for rows in chunks)
            cost = sum(costs[k]) / len(costs[k])
            print(f"{label:8} k={k}: {plain} decoding passes -> {drafted} verifying passes ({plain / drafted:.2f}x "
                  f"fewer); at {cost:.2f} steps a pass, decoding {plain / drafted / cost:.2f}x as fast")


if __name__ == "__main__":
    main()
