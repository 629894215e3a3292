"""Rollout engine throughput against plain batched `model.generate` on the same prompts and lengths.

    python -m bench.engine [--model embedded:smollm2-135m-instruct] [--episodes 16] [--max-turns 6]

1. The engine (`envs.rollout.run_episodes` over the `hf` backend) plays household episodes in
   lockstep; every backend call is recorded (its conversations and how many tokens each row got).
2. The baseline replays exactly those calls with plain `model.generate`: the same templated
   prompts, the same chunking by `max_batch_size` after sorting by length, left padding, the
   same sampling settings, and `min_new_tokens = max_new_tokens =` the longest row the engine
   generated in that chunk (the engine's chunk also runs until its longest row stops).
   Tokenization, stop-string handling, logprob bookkeeping and env steps are outside the
   baseline: it is the ceiling of the `hf` backend.
Prints generated tokens/s of both and their ratio (engine / baseline), measured in this run,
plus prefill tokens per episode against the final context length.

With `--vllm`, the same recorded calls are replayed through the `vllm` backend (the same templated
prompt ids, each row sampling exactly as many tokens as the `hf` engine's row did, eos ignored, prefix
caching on), and the run also prints vLLM's engine start time, its generated tok/s and prefill per
episode against the `hf` engine's, vLLM's processed tokens/s against the same limit as the hf engine's, and
after how many such episodes in one process its start pays off (start / the seconds it saves an episode).

With `--dtype bfloat16` (or float16), or `--mismatch-rows N` in float32 (the sampler's packed layers, KV reuse
and prefix attended apart against the trainer's plain forward), the run also prints the mismatch of that sampler
against a float32 trainer, as a GRPO round's correction sees it: `--mismatch-rows` generations scored by a float32
copy of the model, mean |Δ logprob| of the sampled tokens, KL(sampler ‖ trainer), the share of tokens TIS caps,
the mean weight (models/mismatch.py).

Every run prints the hf engine's processed tokens/s (prefill + generated, in backend calls only) against
this machine's limit measured in the same run (bench/roofline.py): the matmul FLOP/s the model's device
reaches in its dtype, over the model's matmul FLOPs per token. On a GPU the model and the baseline run there
(`--dtype bfloat16` for its tensor cores).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import GenerationConfig

from bench import roofline
from bench.cli import add_model_args, model_path
from rsiflow.envs import make_env
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend


class ForwardClock:
    """Times every forward pass of the backend's model (hooks added from outside; the backend is unchanged) and
    keeps, per pass: rows, query length, real (unpadded) query tokens, context width (cached + new positions,
    pads included), the positions of a prefix all rows attend to from one copy outside the cache (`shared_kv`,
    `backend.hf.shared_prefix_attention`) and seconds. A pass with a one-token query is a decoding step; any
    other is a prefill."""

    def __init__(self, model: torch.nn.Module):
        self.passes: list[dict] = []
        self._t0 = 0.0
        self._pending: dict | None = None
        self._hooks = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                       model.register_forward_hook(self._after, with_kwargs=True)]

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        rows, query = ids.shape
        real = int(mask[:, -query:].sum()) if mask is not None else rows * query
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        width = mask.shape[1] if mask is not None else query + _cached(cache)
        shared = kwargs.get("shared_kv")
        self._pending = {"rows": rows, "query": query, "real": real, "width": width,
                         "shared": shared[0].shape[2] if shared else 0}
        self._t0 = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        if next(module.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        self._pending["seconds"] = time.perf_counter() - self._t0
        self.passes.append(self._pending)
        self._pending = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class AttentionClock:
    """Wall seconds inside the hf backend's attention function (`_sdpa_grouped`, which the float32-attention path
    of half-precision weights calls too), prefill calls and decoding steps apart, a prefix attended apart
    (`shared_kv`) counted with them: what attention costs of the forward passes `ForwardClock` times. Wraps the
    function where the model looks it up (its registered name) until `remove`."""

    def __init__(self):
        from transformers import AttentionInterface

        from rsiflow.models import hf_backend

        self.seconds = {"prefill": 0.0, "decoding": 0.0}
        self.calls = {"prefill": 0, "decoding": 0}
        self._inner = inner = hf_backend._sdpa_grouped

        def timed(module, query, *args, **kwargs):
            start = time.perf_counter()
            out = inner(module, query, *args, **kwargs)
            kind = "decoding" if query.shape[2] == 1 else "prefill"
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            return out

        hf_backend._sdpa_grouped = timed   # `_sdpa_in_float32` calls it by this name
        AttentionInterface.register(hf_backend.GROUPED_SDPA, timed)

    def remove(self) -> None:
        from transformers import AttentionInterface

        from rsiflow.models import hf_backend

        hf_backend._sdpa_grouped = self._inner
        AttentionInterface.register(hf_backend.GROUPED_SDPA, self._inner)


def _cached(cache) -> int:
    """Positions already in a cache passed to a forward without a mask (0: none)."""
    return int(cache.get_seq_length()) if cache is not None else 0


def split_report(passes: list[dict], model, generate_seconds: float, flops: float, bandwidth: float,
                 kv_dtype: torch.dtype) -> dict:
    """Prefill and decoding apart, each against its own limit (bench/roofline.py): prefill tokens/s over the
    matmul limit; decoding steps' least time (the larger of FLOPs / matmul throughput and bytes / read
    bandwidth, per step) over their measured time; and backend time outside forward passes (sampling, top-p,
    stop strings, batch bookkeeping)."""
    prefill = [p for p in passes if p["query"] > 1]
    decode = [p for p in passes if p["query"] == 1]
    per_token = roofline.flops_per_token(model)
    out = {"prefill_passes": len(prefill), "prefill_tokens": sum(p["real"] for p in prefill),
           "prefill_fed": sum(p["rows"] * p["query"] for p in prefill),
           "prefill_seconds": sum(p["seconds"] for p in prefill),
           "decode_steps": len(decode), "decode_tokens": sum(p["rows"] for p in decode),
           "decode_seconds": sum(p["seconds"] for p in decode),
           "decode_least_seconds": sum(roofline.decode_step_limit(model, p["rows"], p["width"], flops, bandwidth,
                                                                  kv_dtype, p["shared"]) for p in decode),
           "decode_bytes": sum(roofline.decode_step_bytes(model, p["rows"], p["width"], kv_dtype, p["shared"])
                               for p in decode)}
    out["outside_seconds"] = generate_seconds - out["prefill_seconds"] - out["decode_seconds"]
    out["prefill_rate"] = out["prefill_tokens"] / out["prefill_seconds"] if prefill else math.nan
    out["prefill_of_limit"] = out["prefill_rate"] * per_token / flops
    out["decode_rate"] = out["decode_tokens"] / out["decode_seconds"] if decode else math.nan
    out["decode_of_limit"] = out["decode_least_seconds"] / out["decode_seconds"] if decode else math.nan
    out["decode_rows"] = out["decode_tokens"] / len(decode) if decode else math.nan
    out["decode_context"] = sum(p["width"] + p["shared"] for p in decode) / len(decode) if decode else math.nan
    return out


class Recorder:
    """Passes calls to the real backend and keeps (conversations, generations) of each call."""

    def __init__(self, inner: HFBackend):
        self.inner, self.calls, self.seconds = inner, [], 0.0
        self.model_path = inner.model_path

    def generate(self, conversations, params, tools=None):
        if tools:
            raise ValueError("bench.engine replays household episodes, whose env has no tool schemas")
        t0 = time.perf_counter()
        gens = self.inner.generate(conversations, params)
        self.seconds += time.perf_counter() - t0
        self.calls.append(([list(c) for c in conversations], gens))
        return gens


def baseline_seconds(backend: HFBackend, calls, params: SamplingParams) -> tuple[float, int]:
    """Plain batched generate over the recorded calls; returns (seconds in generate, tokens generated)."""
    tok, model = backend.tokenizer, backend.model
    seconds, tokens = 0.0, 0
    for conversations, gens in calls:
        texts = tok.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for s in range(0, len(order), backend.max_batch_size):
            chunk = order[s:s + backend.max_batch_size]
            n_new = max(1, max(_sampled(gens[i]) for i in chunk))
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in chunk])
            pad = torch.tensor([width - len(prompts[i]) for i in chunk])
            mask = (torch.arange(width)[None, :] >= pad[:, None]).long()
            ids, mask = ids.to(model.device), mask.to(model.device)
            cfg = GenerationConfig(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=params.temperature > 0,
                                   temperature=params.temperature or None, top_p=params.top_p, top_k=0,
                                   pad_token_id=tok.pad_token_id, eos_token_id=None)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            seconds += time.perf_counter() - t0
            tokens += (out.shape[1] - width) * len(chunk)
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="the hf backend's dtype (float32, bfloat16, float16)")
    ap.add_argument("--kv-reuse", action="store_true", help="the engine's backend reuses KV caches across turns")
    ap.add_argument("--vllm", action="store_true", help="also replay the calls through the vllm backend")
    ap.add_argument("--vllm-python", default=None, help="interpreter with vllm (default: backend.vllm.python's)")
    ap.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM CPU KV cache, GiB")
    ap.add_argument("--mismatch-rows", type=int, default=None,
                    help="score this many generations with a float32 copy and print the sampler/trainer mismatch "
                    "(0: skip; default 32 with --dtype other than float32, else 0)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain-generate baseline (slowest part)")
    ap.add_argument("--max-live", type=int, default=None,
                    help="play the episodes in waves of this many (backend.hf.max_live_episodes; default: all at once)")
    ap.add_argument("--no-packed", action="store_true", help="backend.hf.packed_linears: false (PyTorch's own "
                    "Linear layers)")
    ap.add_argument("--sampler", default="full", choices=["full", "nucleus"], help="backend.hf.sampler")
    ap.add_argument("--shared-prefix-attention", default="auto", choices=["auto", "on", "off"],
                    help="backend.hf.shared_prefix_attention (auto: on for sampled calls, and for greedy "
                    "ones with half-precision weights)")
    ap.add_argument("--time-attention", action="store_true", help="also time the attention calls (prefill and "
                    "decoding apart) inside the forward passes")
    ap.add_argument("--kv-store-tokens", type=int, default=None,
                    help="the hf backend's room for keys/values kept between calls, in tokens (default 65,536)")
    args = ap.parse_args()

    path = model_path(args)
    backend = HFBackend(path, max_batch_size=args.batch, kv_reuse=args.kv_reuse, dtype=args.dtype,
                        sampler=args.sampler, packed_linears=not args.no_packed,
                        shared_prefix_attention={"on": True, "off": False}.get(args.shared_prefix_attention, "auto"),
                        **({"kv_store_max_tokens": args.kv_store_tokens} if args.kv_store_tokens is not None else {}))
    tasks = make_env("household").sample_tasks("train", args.episodes, args.seed)
    episodes = [Episode(traj_id=f"b{i}", task=t, group_id=t.task_id, sample_idx=0) for i, t in enumerate(tasks)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95, seed=args.seed)
    rec = Recorder(backend)
    clock = ForwardClock(backend.model)
    attention = AttentionClock() if args.time_attention else None
    t0 = time.perf_counter()
    run_episodes(lambda: make_env("household"), episodes, rec, params, args.max_turns, max_live=args.max_live)
    engine_s = time.perf_counter() - t0
    clock.remove()
    if attention is not None:
        attention.remove()
    kept = sum(len(g.token_ids) for _, gens in rec.calls for g in gens)
    sampled = sum(_sampled(g) for _, gens in rec.calls for g in gens)
    base_s, base_tokens = (math.nan, 0) if args.no_baseline else baseline_seconds(backend, rec.calls, params)

    # Same prompts, same lengths: both did the engine's work (`sampled` tokens); the baseline also
    # ran finished rows of a chunk to the chunk's longest row (as `generate` does), counted apart.
    engine_rate = sampled / engine_s
    base_rate = sampled / base_s
    prefill = sum(g.extra.get("prefill_tokens", g.prompt_tokens) for _, gens in rec.calls for g in gens) / len(episodes)
    final_ctx = sum(_final_context(backend, e) for e in episodes) / len(episodes)
    print(f"model {args.model}  kv_reuse {args.kv_reuse}  episodes {args.episodes}  max_turns {args.max_turns}  "
          f"batch {args.batch}  max_live {args.max_live}  sampler {args.sampler}  packed {not args.no_packed}  "
          f"torch threads {torch.get_num_threads()}")
    print(f"engine   : {sampled} sampled tokens ({kept} kept) in {engine_s:.2f} s = {engine_rate:.1f} tok/s "
          f"(of which backend.generate {rec.seconds:.2f} s)")
    print(f"baseline : the same {sampled} tokens in {base_s:.2f} s = {base_rate:.1f} tok/s (plain model.generate, same "
          f"prompts and lengths; {base_tokens} tokens incl. rows padded to their chunk's longest)")
    print(f"ratio    : engine / baseline = {engine_rate / base_rate:.3f}   (budget >= 0.9)")
    print(f"prefill  : {prefill:.0f} prompt tokens per episode vs final context {final_ctx:.0f} "
          f"= {prefill / final_ctx:.2f}x   (budget <= 1.2x, needs KV reuse across turns)")
    flops = roofline.matmul_flops(backend.model)
    per_token = roofline.flops_per_token(backend.model)
    limit = flops / per_token
    hf_processed = (prefill * len(episodes) + sampled) / rec.seconds
    print(f"limit    : matmul {flops / 1e9:.0f} GFLOP/s ({roofline.describe(backend.model)}) / "
          f"{per_token / 1e6:.0f} MFLOP per token = {limit:.0f} processed tok/s")
    print(f"hf       : {hf_processed:.0f} processed tok/s (prefill + generated, in backend.generate) "
          f"= {hf_processed / limit:.3f} of the limit")
    print(f"calls    : {sum(len(gens) for _, gens in rec.calls)} rows in {len(rec.calls)} backend calls")
    bandwidth = roofline.read_bandwidth(backend.model.device)
    sp = split_report(clock.passes, backend.model, rec.seconds, flops, bandwidth, backend.kv_dtype)
    print(f"prefill  : {sp['prefill_tokens']} tokens ({sp['prefill_fed']} fed with pads) in {sp['prefill_passes']} "
          f"passes, {sp['prefill_seconds']:.2f} s = {sp['prefill_rate']:.0f} tok/s = {sp['prefill_of_limit']:.3f} "
          "of the matmul limit")
    step_mb = sp["decode_bytes"] / max(1, sp["decode_steps"]) / 1e6
    print(f"decode   : {sp['decode_tokens']} tokens in {sp['decode_steps']} steps ({sp['decode_rows']:.1f} rows, "
          f"context {sp['decode_context']:.0f} a step), {sp['decode_seconds']:.2f} s = {sp['decode_rate']:.0f} "
          f"tok/s; read bandwidth {bandwidth / 1e9:.1f} GB/s, {step_mb:.0f} MB a step (weights + keys/values) -> "
          f"least {sp['decode_least_seconds']:.2f} s = {sp['decode_of_limit']:.3f} of the limit")
    print(f"other    : {sp['outside_seconds']:.2f} s of backend.generate outside forward passes "
          "(sampling, top-p, stop strings, batch bookkeeping)")
    if attention is not None:
        a, n = attention.seconds, attention.calls
        print(f"attention: prefill {a['prefill']:.2f} s ({n['prefill']} layer calls) = "
              f"{a['prefill'] / max(sp['prefill_seconds'], 1e-9):.2f} of prefill passes; decoding "
              f"{a['decoding']:.2f} s ({n['decoding']} layer calls) = "
              f"{a['decoding'] / max(sp['decode_seconds'], 1e-9):.2f} of decoding steps")
    rows = args.mismatch_rows if args.mismatch_rows is not None else (32 if args.dtype != "float32" else 0)
    if rows:
        m = mismatch(backend, path, rec, rows, params.temperature)
        if not m["tokens"]:
            print(f"mismatch : no sampled tokens with a logprob in {m['rows']} rows")
        else:
            print(f"mismatch : {args.dtype} sampler vs float32 trainer over {m['tokens']} tokens of {m['rows']} "
                  f"rows: mean |delta logprob| {m['mean_abs_delta']:.3g}, KL(sampler || trainer) "
                  f"{m['kl_sampler_trainer']:.3g}, TIS-capped share {m['capped_share']:.4f}, "
                  f"mean weight {m['weight_mean']:.4f}")
    if not args.vllm:
        return
    replay_vllm(args, path, backend, rec, params, sampled, engine_rate, prefill, limit)


def replay_vllm(args, path, backend: HFBackend, rec: Recorder, params: SamplingParams, sampled: int,
                hf_rate: float, hf_prefill: float, limit: float) -> None:
    from rsiflow.models.vllm_backend import VLLMBackend

    t0 = time.perf_counter()
    vb = VLLMBackend.open(path, python=args.vllm_python, kv_cache_gib=args.kv_cache_gib)
    start_s = time.perf_counter() - t0
    tok = backend.tokenizer
    seconds, generated, prefilled, prompt_total = 0.0, 0, 0, 0
    for conversations, gens in rec.calls:
        texts = tok.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        lengths = [max(1, _sampled(g)) for g in gens]
        t1 = time.perf_counter()
        rows = vb.replay(prompts, lengths, params)
        seconds += time.perf_counter() - t1
        generated += sum(len(r["token_ids"]) for r in rows)
        prefilled += sum(len(p) - r["cached_tokens"] for p, r in zip(prompts, rows))
        prompt_total += sum(len(p) for p in prompts)
    rate = generated / seconds
    processed = (prefilled + generated) / seconds
    n = args.episodes
    print(f"vllm     : engine start {start_s:.0f} s (this process: {vb.start_seconds} s in the engine)")
    print(f"vllm     : {generated} tokens (hf sampled {sampled}) in {seconds:.2f} s = {rate:.1f} tok/s "
          f"= {rate / hf_rate:.2f}x the hf engine's {hf_rate:.1f}")
    print(f"vllm     : prefill {prefilled / n:.0f} tokens per episode (prefix cache served "
          f"{1 - prefilled / prompt_total:.0%} of {prompt_total / n:.0f}) vs hf kv_reuse {hf_prefill:.0f}")
    print(f"vllm     : {processed:.0f} processed tok/s = {processed / limit:.2f} of the limit")
    hf_episode, vllm_episode = rec.seconds / n, seconds / n
    episodes = break_even(start_s, hf_episode, vllm_episode)
    if episodes is not None:
        print(f"vllm     : its start pays off after {episodes:.0f} episodes like these "
              f"in one process (hf {hf_episode:.2f} s an episode in backend.generate, vllm {vllm_episode:.2f} s)")
    else:
        print(f"vllm     : never pays off here (hf {hf_episode:.2f} s an episode, vllm {vllm_episode:.2f} s)")


def break_even(start_s: float, hf_episode_s: float, vllm_episode_s: float) -> float | None:
    """Episodes in one process after which an engine that starts in `start_s` and plays an episode in
    `vllm_episode_s` has cost no more than the hf backend at `hf_episode_s` an episode (None: never)."""
    if vllm_episode_s >= hf_episode_s:
        return None
    return start_s / (hf_episode_s - vllm_episode_s)


def mismatch(backend: HFBackend, path, rec: Recorder, rows: int, temperature: float) -> dict:
    """The sampler's dtype against the trainer's (float32): the first `rows` recorded generations are scored by a
    float32 copy of the model (their templated prompt plus the kept tokens, logits over `temperature`), and their
    sampled temperature-only logprobs compared with that score as the trainer's mismatch correction does (TIS,
    cap 2: models/mismatch.py)."""
    from rsiflow.models.loading import load_model_and_tokenizer
    from rsiflow.models.mismatch import Correction, correction_weight, mismatch_stats

    trainer = load_model_and_tokenizer(str(path), dtype="float32")[0].eval()
    tok, c = backend.tokenizer, Correction("tis")
    train_lp, sample_lp, weights, capped = [], [], [], []
    done = 0
    for conversations, gens in rec.calls:
        texts = tok.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        for text, g in zip(texts, gens):
            if done == rows:
                break
            if not g.token_ids:
                continue
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + list(g.token_ids)])
            with torch.inference_mode():
                logits = trainer(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1).tolist()
            for t, s in zip(lp, g.temp_logprobs):
                w, cap = correction_weight(t, s, c)
                train_lp.append(t)
                sample_lp.append(s)
                weights.append(w)
                capped.append(cap)
            done += 1
    return {"rows": done, **mismatch_stats(train_lp, sample_lp, weights, capped)}


def _sampled(g) -> int:
    """Tokens the engine sampled for a row: the kept ones plus the eos/stop token that ended it."""
    return len(g.token_ids) + (g.finish_reason == "stop")


def _final_context(backend: HFBackend, ep: Episode) -> int:
    text = backend.tokenizer.apply_chat_template(ep.messages, tokenize=False)
    return len(backend.tokenizer(text, add_special_tokens=False)["input_ids"])


if __name__ == "__main__":
    main()
