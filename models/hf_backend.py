"""The `hf` generation backend: batched transformers `generate` on a local checkpoint.

What it really does, per `generate` call:
- applies the tokenizer's chat template (with the generation prompt) to every conversation,
  sorts the requests by prompt length and cuts them into chunks of at most `max_batch_size`
  (less padding), left-pads each chunk with the pad token (= eos) and runs `model.generate` on it,
  no KV cache kept between calls;
- samples with temperature and top-p only (temperature 0: greedy); `seed` seeds torch's RNG for
  the call (results then depend on the seed and the batch, not on any earlier call);
- records per-token sampling logprobs: the log-softmax of the scores actually sampled from
  (after temperature/top-p; raw logits when greedy), taken at the sampled token; and, as
  `temp_logprobs`, the log-softmax after temperature only (no top-p truncation: what a trainer that
  divides its logits by the temperature recomputes; the same as `logprobs` when greedy or top_p = 1);
- cuts each row at its first eos and at the first occurrence of any stop string.

What is kept, so a trainer can reproduce it: `token_ids` are the generated tokens before eos and,
when a stop string matched, the shortest token prefix whose decoded text covers `text` (the
completion cut right before the stop string). Tokens lying wholly inside or after the stop string
are dropped; a token that holds the end of `text` *and* the start of the stop string (e.g. ".\\n"
with stop "\\n") is kept, so `decode(token_ids)` starts with `text` and then is equal to it unless
such a straddling token exists. `logprobs[i]` belongs to `token_ids[i]`. `extra["stop"]` names the
stop string that matched (absent when none did).

KV reuse across calls (opt-in, `kv_reuse=True`; for the episode runner, which sends every live
episode's whole, grown conversation each turn): after every call the backend keeps, per request, the
token ids it holds keys/values for (the prompt and the sampled tokens fed back, i.e. all but the last
one) with those per-layer keys/values (batch 1, no padding) -- only the latest call's entries, at most
`kv_store_max_tokens` tokens in all (~46 kB per token for SmolLM2-135M in fp32: the 65,536 default is
~3 GB). A request then reuses the entry with the longest common token prefix, cropped to at most
prompt length - 1, and prefills only the rest; a token prefix that all requests of a call share
(the system prompt and few-shot turns of a batch of new episodes) and that no entry holds is
encoded once, batch 1, and reused by each of them (with `shared_prefix_attention`, kept out of the rows'
decoding cache and attended to once for the whole batch: `_attend_to_shared_prefix`; a call that attends over
whole rows reuses only the prefix of entries computed that way, `_KVEntry.apart`); rows with different
cached and new lengths share a batch as [pad][cached][pad][new] with explicit position ids, then a
hand-written decode loop samples
exactly as above (temperature, top-p, the same logprobs, eos and stop strings, `_finish_row`) and drops
finished rows from the batch. `prompt_tokens` stays the full prompt; `extra["prefill_tokens"]` and
`extra["cached_tokens"]` say how much was encoded and how much reused.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AttentionInterface,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rsiflow.models import threads
from rsiflow.models.backend import (
    Generation,
    SamplingParams,
    finish_row,
    interrupted_since,
    interrupts,
    native_bf16,
    raise_if_interrupted,
)
from rsiflow.models.loading import load_model_and_tokenizer
from rsiflow.models.packed_linear import pack_linears

# SmolLM2-135M on the 2-core CPU, 268-token prompts, 16 new tokens, generated tok/s on an idle machine:
# batch 1: 16, 8: 32, 16: 33-39, 32: 43. With another process busy on a core, batch 32+ collapsed to
# 6-17 tok/s (OpenMP threads spin-waiting for the shared core) while 16 held ~30: 16 is the safe default.
DEFAULT_MAX_BATCH_SIZE = 16
# Most tokens of keys/values kept between calls with kv_reuse (~46 kB/token for SmolLM2-135M fp32: ~3 GB).
DEFAULT_KV_STORE_MAX_TOKENS = 1 << 16
# With kv_reuse, a token prefix shared by all prompts of a call (system prompt + few-shot turns) at least
# this long is encoded once and reused by every prompt.
MIN_SHARED_PREFIX = 32
# A prefill pass's fixed cost in tokens of work (`prefill_groups`): rows are split into separate passes only where
# that saves more padding than this per extra pass. SmolLM2-135M, one thread: a pass of 128 tokens took 396 ms and
# of 256 726 ms (2.6 ms a token), so ~65 ms (~25 tokens) a pass is fixed; short passes also run their matmuls less
# efficiently (32 tokens: 4.7 ms a token), hence a little above that.
PREFILL_PASS_TOKENS = 32


@dataclass
class _KVEntry:
    """Keys/values of one token sequence, kept between calls: ids (T,) and the keys/values as segments in order
    (at most two), each a list with one (2, kv heads, n, head dim) tensor per layer, their n summing to T. An
    episode's entry shares the first segment of the entry its turn reused (the same tensors, not copies: the prefix
    all rows of the first call shared) and holds the rest as one new segment; copying the whole sequence out of the
    decoding cache each turn was 3.7% of a bf16 engine run's generate time (py-spy, docs/performance.md). One
    tensor per layer, not one for all: a few MB each, which the C allocator serves from memory it already holds,
    where a single tensor of every layer (~46 MB at 1,000 tokens) is a fresh mapping each time, its pages faulted
    in on the first write (3-4x slower to fill, one thread). `apart`: the keys/values after the first segment were
    computed attending to it apart (`_attend_to_shared_prefix`), equal to attention over the whole row up to float
    rounding only, so a call that attends over whole rows reuses no more than the first segment."""
    ids: np.ndarray
    segments: list[list[torch.Tensor]]
    apart: bool = False

    def head(self, n: int) -> list[list[torch.Tensor]]:
        """The segments of the first n tokens (views; the last one cut at n)."""
        out, left = [], n
        for segment in self.segments:
            if left <= 0:
                break
            size = segment[0].shape[2]
            out.append(segment if size <= left else [kv[:, :, :left] for kv in segment])
            left -= size
        return out


class HFBackend:
    """GenerationBackend on transformers `generate` (CPU default; also runs on one GPU)."""

    kind = "hf"

    def __init__(self, model_path: str | Path, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, dtype: str = "float32",
                 device: str | None = None, kv_reuse: bool = False,
                 kv_store_max_tokens: int = DEFAULT_KV_STORE_MAX_TOKENS, trust_remote_code: bool = False,
                 sampler: str = "full", max_live_episodes: int | None = None, packed_linears: bool = True,
                 shared_prefix_attention: bool | str = "auto"):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_live_episodes is not None and max_live_episodes < 1:
            raise ValueError(f"max_live_episodes must be >= 1 or None, got {max_live_episodes}")
        self.max_live_episodes = max_live_episodes   # read by the episode runner (envs.rollout.run_episodes)
        if sampler not in ("full", "nucleus"):
            raise ValueError(f"sampler must be 'full' or 'nucleus', got {sampler!r}")
        self.sampler = sampler
        if shared_prefix_attention not in (True, False, "auto"):
            raise ValueError(f"shared_prefix_attention must be true, false or 'auto', got {shared_prefix_attention!r}")
        self.shared_prefix_attention = shared_prefix_attention
        if kv_store_max_tokens < 0:
            raise ValueError(f"kv_store_max_tokens must be >= 0, got {kv_store_max_tokens}")
        self.max_batch_size = max_batch_size
        self.kv_reuse = kv_reuse
        self.kv_store_max_tokens = kv_store_max_tokens
        self._kv_store: list[_KVEntry] = []
        self.dtype = dtype
        self.packed_linears = packed_linears
        self.trust_remote_code = trust_remote_code
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cpu" and dtype == "bfloat16" and not native_bf16() and not _SLOW_BF16_SAID:
            _SLOW_BF16_SAID.append(True)
            logging.getLogger(__name__).warning(
                "the hf backend runs in bfloat16 on a CPU without bf16 matrix instructions (AVX512-BF16 or AMX): "
                "PyTorch emulates them there, several times slower than float32 (SmolLM2-135M's Linear layers on an "
                "AVX2 CPU: 7.6 against 48-68 GFLOP/s); backend.hf.dtype: auto samples in float32 on such a CPU")
        self._load(model_path)

    @classmethod
    def open(cls, model_path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False,
             **options) -> HFBackend:
        """The process-wide backend serving `model_path` with these options (loaded once, then reused by
        later pipeline steps); see `get_backend`."""
        return get_backend(model_path, dtype=dtype, trust_remote_code=trust_remote_code, **options)

    @classmethod
    def must_redeploy(cls) -> bool:
        """Whether this process holds a loaded HFBackend (see GenerationBackend.must_redeploy)."""
        return bool(_BACKENDS)

    def serve(self, model_path: str | Path) -> dict:
        """Redeploy in this process: load `model_path`'s weights into this backend (nothing to do when it
        already serves them). Returns {kind, action, path, seconds}."""
        start = time.perf_counter()
        if Path(model_path).resolve() == Path(self.model_path).resolve():
            return {"kind": self.kind, "action": "already serving", "path": str(model_path), "seconds": 0.0}
        self._load(model_path)
        return {"kind": self.kind, "action": "reloaded weights in process", "path": str(model_path),
                "seconds": round(time.perf_counter() - start, 2)}

    def _load(self, model_path: str | Path) -> None:
        model, tokenizer = load_model_and_tokenizer(model_path, dtype=self.dtype,
                                                    trust_remote_code=self.trust_remote_code)
        saved = model.generation_config
        # Sampling settings come from SamplingParams only: drop whatever the checkpoint suggests.
        model.generation_config = GenerationConfig(
            bos_token_id=saved.bos_token_id,
            eos_token_id=saved.eos_token_id if saved.eos_token_id is not None else tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        eos = model.generation_config.eos_token_id
        self._eos_ids = set(eos) if isinstance(eos, list) else {eos}
        self.model = model.to(self.device)
        if self.packed_linears and self.device == "cpu":
            pack_linears(self.model)   # oneDNN on weights packed once: decoding ~1.7x faster (models.packed_linear)
        # On CPU, PyTorch's attention kernel decodes far slower in bfloat16/float16 than in float32: a bf16 decode
        # step took 2.22x float32's at a 1,200-token context, and 0.75x with attention in float32 (`python -m
        # bench.decode`). So attention runs in float32 there, on keys/values cached in float32, and only the Linear
        # layers in the weights' dtype.
        self._kv_dtype = torch.float32 if self.device == "cpu" and self.model.dtype != torch.float32 else None
        self._attention_per_position = attention_per_position(self.model)
        if self._kv_dtype is not None:
            self.model.set_attn_implementation(FLOAT32_SDPA)
        elif self.device == "cpu" and self.model.config._attn_implementation == "sdpa":
            self.model.set_attn_implementation(GROUPED_SDPA)
        # only our attention functions know how to attend to a prefix kept outside the decoding cache
        can = self.model.config._attn_implementation in (GROUPED_SDPA, FLOAT32_SDPA)
        # "auto": sampled calls always; greedy calls (the gate's plays) where attention already runs in another
        # dtype than the weights (half precision on CPU), not in float32, where attending to the prefix apart would
        # move the trainer's greedy logits in the last bits.
        on = self.shared_prefix_attention
        self._attend_prefix_apart = {
            "greedy": can and (self._kv_dtype is not None if on == "auto" else bool(on)),
            "sampled": can and bool(on)}   # true or "auto"
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self._kv_store = []  # keys/values of the old weights are worthless now
        if self.kv_reuse:
            layers = DynamicCache(config=model.config).layers
            if not layers or any(type(layer) is not DynamicLayer for layer in layers):
                raise ValueError(f"kv_reuse needs a model whose cache layers are all plain DynamicLayer "
                                 f"(no sliding window / linear attention): {model_path}")

    def clear_kv_store(self) -> None:
        """Forget the keys/values kept for reuse (the same outputs up to floating-point rounding, slower)."""
        self._kv_store = []

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype decoding caches keys and values in (float32 for half-precision weights on CPU)."""
        return self._kv_dtype or self.model.dtype

    @property
    def kv_store_tokens(self) -> int:
        """Tokens whose keys/values are kept for reuse now, counted per entry (a prefix several entries share, the
        same tensors, counts in each: the budget `kv_store_max_tokens` is held against this count)."""
        return sum(len(entry.ids) for entry in self._kv_store)

    def generate(self, conversations: list[list[dict]], params: SamplingParams,
                 tools: list[dict] | None = None) -> list[Generation]:
        if not conversations:
            return []
        params.check()
        start_count = interrupts()
        texts = self.tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=True,
                                                   tokenize=False)
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        if self.kv_reuse:
            # The old entries live on only in `matches` and their chunk's `bases`, dropped once the chunk is done
            # (a new entry keeps its base's first segment, the shared prefix).
            apart = self._attend_prefix_apart["sampled" if params.temperature > 0 else "greedy"]
            matches = self._share_common_prefix(prompts, [self._longest_prefix(p, apart) for p in prompts])
            self._kv_store = []
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) - matches[i][1])
            new_store: list[_KVEntry] = []
        else:
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        # A seeded call must not disturb the global RNG stream of unseeded calls (CPU state restored after).
        seeded = torch.random.fork_rng(devices=[]) if params.seed is not None else contextlib.nullcontext()
        with seeded, torch.inference_mode(), threads.computing():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(order), self.max_batch_size):
                threads.refresh()  # this process's share of the cores (models/threads.py)
                chunk = order[start:start + self.max_batch_size]
                if self.kv_reuse:
                    generations = self._generate_chunk_reusing(
                        [prompts[i] for i in chunk], [matches[i] for i in chunk], params, new_store, start_count,
                        apart)
                    for i in chunk:
                        matches[i] = None
                else:
                    generations = self._generate_chunk([prompts[i] for i in chunk], params, start_count)
                for i, generation in zip(chunk, generations):
                    results[i] = generation
        if self.kv_reuse:
            self._kv_store = new_store
        return results

    # ---- KV reuse -------------------------------------------------------------------------------------

    def _longest_prefix(self, prompt: list[int], apart: bool) -> tuple[_KVEntry | None, int]:
        """The stored entry sharing the longest token prefix with `prompt`, and how many of its tokens to
        reuse (at most len(prompt) - 1: at least one token must be fed to get logits). A call that does not attend
        to its shared prefix apart reuses only the first segment of an entry computed that way (`_KVEntry.apart`)."""
        best, best_len = None, 0
        if len(prompt) < 2 or not self._kv_store:
            return None, 0
        ids = np.asarray(prompt, dtype=np.int64)
        for entry in self._kv_store:
            n = min(len(ids), len(entry.ids))
            if entry.apart and not apart:
                n = min(n, entry.segments[0][0].shape[2])
            if n <= best_len:
                continue
            differ = np.flatnonzero(ids[:n] != entry.ids[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best_len:
                best, best_len = entry, common
        best_len = min(best_len, len(prompt) - 1)
        return (best, best_len) if best_len > 0 else (None, 0)

    def _share_common_prefix(self, prompts: list[list[int]],
                             matches: list[tuple[_KVEntry | None, int]]) -> list[tuple[_KVEntry | None, int]]:
        """Prefill the longest token prefix all `prompts` share once (batch 1) and let every prompt whose
        stored match is shorter reuse it: the first turn of a batch of episodes shares the system prompt
        and the few-shot turns, which would otherwise be encoded once per episode."""
        if len(prompts) < 2:
            return matches
        first = np.asarray(prompts[0], dtype=np.int64)
        lcp = min(len(p) for p in prompts) - 1  # at least one token of each prompt must still be fed
        for p in prompts[1:]:
            if lcp <= 0:
                break
            differ = np.flatnonzero(np.asarray(p[:lcp], dtype=np.int64) != first[:lcp])
            if len(differ):
                lcp = int(differ[0])
        if lcp < MIN_SHARED_PREFIX or sum(c < lcp for _, c in matches) < 2:
            return matches
        ids = prompts[0][:lcp]
        cache = DynamicCache(config=self.model.config)
        cache.layers = [ReservedCacheLayer(lcp, dtype=self._kv_dtype) for _ in cache.layers]
        with torch.inference_mode():
            self.model(input_ids=torch.tensor([ids], device=self.device), cache=cache, use_cache=True, logits_to_keep=1)
        shared = self._extract_row(cache, 0, 0, 0, 0, ids)
        return [(shared, lcp) if c < lcp else (e, c) for e, c in matches]

    def _generate_chunk_reusing(self, prompts: list[list[int]], matches: list[tuple[_KVEntry | None, int]],
                                params: SamplingParams, new_store: list[_KVEntry],
                                start_count: int, apart: bool) -> list[Generation]:
        """Prefill each row's uncached tokens after its reused keys/values, then decode token by token
        (`Interrupted` between two tokens once rsiflow is stopping: `start_count` as in models.backend).

        The decoding cache lays row i (c cached, n new tokens) out as [pad x (C-c)] [cached] [pad x (N-n)] [new]
        (C, N: the chunk's largest); pads are masked, and position ids count only real tokens, so each row sees
        exactly its own sequence. Rows whose lengths differ widely are prefilled in groups (`prefill_groups`).
        With `apart`, a shared prefix all rows reuse is attended apart (`_prefix_to_attend_apart`).
        """
        device = self.device
        batch = len(prompts)
        prefix = self._prefix_to_attend_apart(matches) if apart else None
        skip = prefix[0].shape[2] if prefix is not None else 0
        if prefix is not None:
            # The decoding cache holds each row's tokens after the shared prefix only: every row attends to the
            # prefix's one copy (`_attend_to_shared_prefix`), which is neither copied into the batch nor out of it.
            matches[:] = [(_KVEntry(entry.ids[skip:], entry.segments[1:]) if c > skip else None, c - skip)
                          for entry, c in matches]
        shared_kv = {"shared_kv": prefix} if prefix is not None else {}
        cached = [c for _, c in matches]
        new = [p[skip + c:] for p, c in zip(prompts, cached)]
        c_max, n_max = max(cached), max(len(x) for x in new)
        capacity = c_max + n_max + params.max_new_tokens
        groups = prefill_groups([len(x) for x in new], cached, self._attention_per_position)
        if len(groups) == 1:
            # Room for the whole call up front: each decoding step writes its token in place instead of copying
            # the layer's whole cache into a grown tensor (DynamicLayer's concatenation); the same values, bit for
            # bit.
            order = list(range(batch))
            cache, logits = self._prefill(new, matches, order, capacity, skip=skip, shared_kv=prefix)
        else:
            # Rows of very different lengths: each group gets its own prefill pass (less padding), over a window
            # of the decoding cache holding its rows (batch rows in group order) and positions from its longest
            # cached prefix to the end of the chunk's layout; the positions between its longest new segment and
            # the chunk's are masked pads of that pass.
            order = [i for rows in groups for i in rows]   # batch row -> chunk row
            cache = DynamicCache(config=self.model.config)
            cache.layers = [ReservedCacheLayer(capacity, dtype=self._kv_dtype) for _ in cache.layers]
            cfg = self.model.config
            heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            for layer in cache.layers:
                layer.allocate(batch, heads, head_dim, self.model.dtype, device)
            logits, start = None, 0
            for rows in groups:
                stop = start + len(rows)
                c_part, n_part = max(cached[i] for i in rows), max(len(new[i]) for i in rows)
                windows = []
                for layer in cache.layers:
                    windows.append(layer.window(slice(start, stop), c_max - c_part, c_max + n_max))
                _, part_logits = self._prefill(new, matches, rows, 0, into=windows, gap=n_max - n_part, skip=skip,
                                               shared_kv=prefix)
                if logits is None:
                    logits = part_logits.new_empty(batch, *part_logits.shape[1:])
                logits[start:stop] = part_logits
                start = stop
            for layer in cache.layers:
                layer.fill(c_max + n_max)
        bases = [entry for entry, _ in matches]   # each row's reused entry: its new entry shares those segments
        matches.clear()
        mask = torch.tensor([[0] * (c_max - cached[i]) + [1] * cached[i] + [0] * (n_max - len(new[i]))
                             + [1] * len(new[i]) for i in order], device=device)
        next_position = torch.tensor([len(prompts[i]) for i in order], device=device)

        sample = params.temperature > 0
        warpers = _warpers(params)

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        temp_logprobs: list[list[float]] = [[] for _ in range(batch)]
        temperature_only = _warpers(params, top_p=False)
        results: list[Generation | None] = [None] * batch
        active = order  # chunk rows still in the batch, in batch order
        budget = self.kv_store_max_tokens - sum(len(e.ids) for e in new_store)
        for step in range(params.max_new_tokens):
            raise_if_interrupted(start_count, "hf")
            threads.refresh()  # re-counted every step: another process may have started or stopped computing
            # Drawn in the chunk's row order whatever order the batch holds its rows in (prefill groups,
            # `fill_holes`), so a seeded call samples the same tokens as with the rows in order.
            draw_order = sorted(range(len(active)), key=active.__getitem__) if sample else None
            if sample and self.sampler == "nucleus":
                sampled, sampled_logprobs, sampled_temp = sample_nucleus(logits, params.temperature, params.top_p,
                                                                         draw_order)
            else:
                scores = warpers(None, logits)
                if not sample:
                    sampled = torch.argmax(scores, dim=-1)
                elif draw_order == list(range(len(active))):
                    sampled = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    draw = torch.tensor(draw_order, device=device)
                    drawn = torch.multinomial(torch.softmax(scores[draw], dim=-1), num_samples=1).squeeze(1)
                    sampled = torch.empty_like(drawn).index_copy_(0, draw, drawn)
                sampled_logprobs = torch.log_softmax(scores, dim=-1).gather(1, sampled[:, None]).squeeze(1)
                if sample:
                    temp_scores = torch.log_softmax(temperature_only(None, logits), dim=-1)
                    sampled_temp = temp_scores.gather(1, sampled[:, None]).squeeze(1)
                else:  # greedy: no warper, so the scores are the logits and both logprobs are the same
                    sampled_temp = sampled_logprobs
            keep = []
            for b, (row, token, logprob, temp) in enumerate(zip(active, sampled.tolist(), sampled_logprobs.tolist(),
                                                                 sampled_temp.tolist())):
                tokens[row].append(token)
                logprobs[row].append(logprob)
                temp_logprobs[row].append(temp)
                done = (token in self._eos_ids or step == params.max_new_tokens - 1
                        or (params.stop and any(s in self._decode(tokens[row]) for s in params.stop)))
                if not done:
                    keep.append(b)
                    continue
                # KV held for this row: its cached and new prompt tokens, and every sampled token but the last.
                known = len(prompts[row]) + len(tokens[row]) - 1
                if known <= budget:
                    budget -= known
                    new_store.append(self._extract_row(cache, b, c_max - cached[row], cached[row],
                                                       c_max + n_max - len(new[row]), prompts[row] + tokens[row][:-1],
                                                       bases[row], prefix))
                results[row] = self._finish_row(tokens[row], logprobs[row], temp_logprobs[row], params.stop,
                                                len(prompts[row]))
                results[row].extra.update(prefill_tokens=len(new[row]), cached_tokens=skip + cached[row])
            if not keep:
                break
            if len(keep) < len(active):
                keep = fill_holes(keep)
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                mask, next_position, sampled = mask[index], next_position[index], sampled[index]
                active = [active[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = self.model(input_ids=sampled[:, None], attention_mask=mask, position_ids=next_position[:, None],
                             cache=cache, use_cache=True, logits_to_keep=1, **shared_kv)
            logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
            del out
            next_position = next_position + 1
        return results

    def _prefix_to_attend_apart(self, matches: list[tuple[_KVEntry | None, int]]) -> list[torch.Tensor] | None:
        """The first segment every row of a chunk reuses whole (the same tensors: the system prompt and few-shot
        turns the call's first rows shared, `_share_common_prefix`), which the chunk then attends to apart; None
        when the rows do not all start with one such segment."""
        if len(matches) < 2:
            return None
        first = matches[0][0].segments[0] if matches[0][0] is not None else None
        if first is None or first[0].shape[2] < MIN_SHARED_PREFIX:
            return None
        for entry, cached in matches:
            if entry is None or entry.segments[0] is not first or cached < first[0].shape[2]:
                return None
        return first

    def _prefill(self, new: list[list[int]], matches: list[tuple[_KVEntry | None, int]], rows: list[int],
                 capacity: int, into: list[ReservedCacheLayer] | None = None, gap: int = 0, skip: int = 0,
                 shared_kv: list[torch.Tensor] | None = None) -> tuple[DynamicCache, torch.Tensor]:
        """One forward pass over `rows`' uncached tokens after their reused keys/values. Row i (c cached, n new
        tokens) is laid out as [pad x (C-c)] [cached] [pad x gap] [pad x (N-n)] [new] (C, N: the rows' largest);
        pads are masked, and position ids count only real tokens, so each row sees exactly its own sequence.
        With `shared_kv` (one (2, kv heads, `skip`, head dim) tensor per layer), every row's sequence starts with
        those `skip` tokens, attended apart and not in the cache: positions start after them.
        The cache's layers are `into` (windows of a larger cache) or new ones with room for `capacity`
        positions. Returns the cache and each row's float32 logits of its next token."""
        threads.refresh()
        device, pad = self.device, self.tokenizer.pad_token_id
        cached = [matches[i][1] for i in rows]
        part = [new[i] for i in rows]
        c_max, n_max = max(cached), max(len(x) for x in part)
        cache = DynamicCache(config=self.model.config)
        if into is None:
            cache.layers = [ReservedCacheLayer(max(capacity, c_max + n_max), dtype=self._kv_dtype)
                            for _ in cache.layers]
        else:
            cache.layers = into
        if c_max or into is not None:
            heads = [matches[i][0].head(c) if c else None for i, c in zip(rows, cached)]
            for index, layer in enumerate(cache.layers):
                layer.preload([[segment[index] for segment in h] if h else None for h in heads], c_max, gap)
        input_ids = torch.tensor([[pad] * (n_max - len(x)) + x for x in part], device=device)
        mask = torch.tensor([[0] * (c_max - c) + [1] * c + [0] * (gap + n_max - len(x)) + [1] * len(x)
                             for c, x in zip(cached, part)], device=device)
        positions = torch.tensor([[0] * (n_max - len(x)) + list(range(skip + c, skip + c + len(x)))
                                  for c, x in zip(cached, part)], device=device)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=True, logits_to_keep=1, **({"shared_kv": shared_kv} if shared_kv else {}))
        return cache, out.logits[:, -1].to(copy=True, dtype=torch.float32)

    @staticmethod
    def _extract_row(cache: DynamicCache, b: int, cached_at: int, n_cached: int, new_at: int,
                     ids: list[int], base: _KVEntry | None = None,
                     prefix: list[torch.Tensor] | None = None) -> _KVEntry:
        """Batch row b's keys/values without pads: [cached_at, cached_at + n_cached) then [new_at, end). With
        `base`, the entry the row's n_cached cached tokens were preloaded from, base's first segment (the prefix
        a call's rows share: the system prompt and few-shot turns, or an older turn's tokens) is kept as it is, not
        copied, when the cached part covers it; the rest is copied as one segment. With `prefix`, the keys/values
        of `ids`' first tokens, attended apart (the cache holds the tokens after them), it is the first segment."""
        end = new_at + len(ids) - n_cached - (prefix[0].shape[2] if prefix is not None else 0)
        # computed attending apart: with the prefix apart now, or copied from such an entry past its first segment
        apart = prefix is not None or (base is not None and base.apart and base.segments[0][0].shape[2] < n_cached)
        if prefix is not None:
            segments = [prefix]
        elif base is not None and base.segments[0][0].shape[2] <= n_cached:
            # base's first segment is shared (views); the rest is copied (one segment: fewer, larger copies next turn)
            kept = base.segments[0][0].shape[2]
            segments, cached_at, n_cached = [base.segments[0]], cached_at + kept, n_cached - kept
        else:
            segments = []
        kv = []
        for layer in cache.layers:   # copied once, straight into the entry
            keys = layer.keys
            entry = keys.new_empty(2, keys.shape[1], n_cached + end - new_at, keys.shape[3])
            for j, t in enumerate((layer.keys, layer.values)):
                if n_cached:
                    entry[j, :, :n_cached] = t[b, :, cached_at:cached_at + n_cached]
                entry[j, :, n_cached:] = t[b, :, new_at:end]
            kv.append(entry)
        return _KVEntry(ids=np.asarray(ids, dtype=np.int64), segments=[*segments, kv], apart=apart)

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams, start_count: int) -> list[Generation]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)

        sample = params.temperature > 0
        # Warpers are passed in by hand (and disabled in the config) so the recorders run between and after them:
        # temperature, its recorder, top-p, the recorder of the distribution actually sampled from.
        temp_recorder, recorder = _SampledLogprobs(), _SampledLogprobs()
        processors = LogitsProcessorList([*_warpers(params, top_p=False), temp_recorder,
                                          *[w for w in _warpers(params) if isinstance(w, NucleusWarper)], recorder])
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=sample,
            **({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {}),  # no built-in warpers
            stop_strings=list(params.stop) or None,
        )
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=processors,
            tokenizer=self.tokenizer,
            stopping_criteria=StoppingCriteriaList([_StopWhenInterrupted(start_count)]),
        )
        raise_if_interrupted(start_count, "hf")
        logprobs, temp_logprobs = recorder.finish(sequences), temp_recorder.finish(sequences)
        new_tokens = sequences[:, width:].tolist()
        return [
            self._finish_row(tokens, logprobs[row].tolist(), temp_logprobs[row].tolist(), params.stop,
                             len(prompts[row]))
            for row, tokens in enumerate(new_tokens)
        ]

    def _finish_row(self, tokens: list[int], logprobs: list[float], temp_logprobs: list[float], stop: tuple[str, ...],
                    prompt_tokens: int) -> Generation:
        return finish_row(tokens, logprobs, temp_logprobs, stop, prompt_tokens, self._eos_ids, self._decode)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class ReservedCacheLayer(DynamicLayer):
    """A DynamicLayer whose keys/values live in a buffer of `capacity` tokens allocated once (grown, with a copy,
    only if an update overflows it): `keys`/`values` are views of its filled part, so an update writes the new
    tokens in place. DynamicLayer concatenates, copying the layer's whole cache every decoding step; on SmolLM2-135M
    at batch 16 that copy was ~25% of a decoding step at a 1,200-token context (`python -m bench.decode`).
    `dtype`: keep keys/values in this dtype (None: the model's), e.g. float32 beside half-precision weights."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity, self.length, self.dtype = capacity, 0, dtype
        self._keys = self._values = None
        self._window = False   # a window of another layer's buffer (`window`): writes land there, it cannot grow

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._keys is None or end > self._keys.shape[-2]:
            if self._window:
                raise RuntimeError(f"a cache window of {self._keys.shape[-2]} positions cannot take {end}")
            batch, heads, _, dim = key_states.shape
            size, dtype = max(end, self.capacity), self.dtype or key_states.dtype
            keys = key_states.new_empty(batch, heads, size, dim, dtype=dtype)
            values = value_states.new_empty(batch, heads, size, dim, dtype=dtype)
            if self._keys is not None:
                keys[..., :self.length, :] = self._keys[..., :self.length, :]
                values[..., :self.length, :] = self._values[..., :self.length, :]
            self._keys, self._values = keys, values
        self._keys[..., self.length:end, :] = key_states
        self._values[..., self.length:end, :] = value_states
        self.length = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def allocate(self, batch: int, heads: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Reserve the buffer (`batch` rows x `capacity` positions, in this layer's dtype or else `dtype`) before
        anything is written: windows (`window`) then fill it."""
        shape = (batch, heads, self.capacity, dim)
        self._keys = torch.empty(shape, dtype=self.dtype or dtype, device=device)
        self._values = torch.empty(shape, dtype=self.dtype or dtype, device=device)
        self.lazy_initialization(self._keys, self._values)
        self.keys, self.values = self._keys[..., :0, :], self._values[..., :0, :]

    def window(self, rows: slice, start: int, stop: int) -> ReservedCacheLayer:
        """A layer over batch rows `rows` and positions [start, stop) of this layer's buffer: a prefill through
        it writes its keys/values straight into their place here. The rows' positions before `start` are zeroed."""
        self._keys[rows, :, :start] = 0   # the rows' positions before the window: pads (masked, must be finite)
        self._values[rows, :, :start] = 0
        part = ReservedCacheLayer(stop - start, self.dtype)
        part._keys, part._values = self._keys[rows, :, start:stop], self._values[rows, :, start:stop]
        part._window = True
        part.lazy_initialization(part._keys, part._values)
        part.keys, part.values = part._keys[..., :0, :], part._values[..., :0, :]
        return part

    def fill(self, length: int) -> None:
        """Mark the first `length` positions filled (written through windows)."""
        self.length = length
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def preload(self, rows: list[list[torch.Tensor] | None], width: int, gap: int = 0) -> None:
        """Fill an empty layer with one batch row per entry of `rows` (keys and values of c cached positions as
        parts laid one after the other, each (2, heads, n, dim), their n summing to c; None for c = 0),
        right-aligned in `width` positions after zeroed pads, then `gap` zeroed positions in every row (pads are
        masked, but must be finite), written straight into the buffer (allocated here unless `allocate` or `window`
        gave one)."""
        if self._keys is None:
            template = next(parts[0] for parts in rows if parts)
            _, heads, _, dim = template.shape
            self.lazy_initialization(template[:1], template[1:])
            dtype = self.dtype or template.dtype
            shape = (len(rows), heads, max(self.capacity, width + gap), dim)
            self._keys, self._values = template.new_empty(shape, dtype=dtype), template.new_empty(shape, dtype=dtype)
        for b, parts in enumerate(rows):
            start = width - sum(kv.shape[2] for kv in parts or ())
            for j, dst in enumerate((self._keys, self._values)):
                dst[b, :, :start] = 0
                at = start
                for kv in parts or ():
                    dst[b, :, at:at + kv.shape[2]] = kv[j]
                    at += kv.shape[2]
        if gap:
            self._keys[:, :, width:width + gap] = 0
            self._values[:, :, width:width + gap] = 0
        self.fill(width + gap)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices`. Where no row moves up (finished rows dropped in order, or the last rows
        moved into their holes: `fill_holes`), rows move inside the buffer without a new allocation, only those
        that change place; other selections are gathered into a new buffer."""
        if self._keys is None:
            return
        keep = indices.tolist()
        # moved in order of the new position: safe while every row is read before its own slot is overwritten
        if len(set(keep)) == len(keep) and all(old >= new for new, old in enumerate(keep)):
            for new_row, old_row in enumerate(keep):
                if new_row != old_row:
                    self._keys[new_row] = self._keys[old_row]
                    self._values[new_row] = self._values[old_row]
            self._keys, self._values = self._keys[:len(keep)], self._values[:len(keep)]
        else:
            self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[..., :self.length, :], self._values[..., :self.length, :]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the hf backend never crops its decoding cache")


def fill_holes(keep: list[int]) -> list[int]:
    """The rows of a batch to keep (ascending), reordered so that as few rows as possible move: a kept row stays
    where it is unless it lies beyond the new batch size, and those rows fill the slots of the dropped ones. Rows
    of a batch are computed independently, so their order changes nothing but which rows the cache must copy
    (one per dropped row instead of every row after it): bit for bit on one thread; on two, the decoding
    attention kernel splits its work by batch position, and logprobs differ in the last bits."""
    n = len(keep)
    movers = iter(b for b in keep if b >= n)
    kept = set(keep)
    return [p if p in kept else next(movers) for p in range(n)]


def prefill_groups(new: list[int], cached: list[int], attention_per_position: float,
                   pass_tokens: float | None = None) -> list[list[int]]:
    """Split a chunk's rows (`new[i]` uncached tokens after `cached[i]` reused ones) into prefill passes.

    One pass over rows of different lengths pads each row to the longest: it computes len(rows) x N tokens, each
    attending over C + N positions (C, N: the rows' largest cached and new counts). In token units a pass costs
    len(rows) x N x (1 + `attention_per_position` x (C + N)) plus `pass_tokens` (a pass's fixed cost: weights read
    once, the framework's per-layer work, small matmuls). Rows sorted by new length, the contiguous split of least
    total cost is found exactly (dynamic programming over the split points); a chunk of even rows stays one pass.
    """
    pass_tokens = PREFILL_PASS_TOKENS if pass_tokens is None else pass_tokens
    order = sorted(range(len(new)), key=lambda i: (new[i], cached[i]))
    best = [0.0] + [math.inf] * len(order)   # best[k]: least cost of the first k rows (in `order`)
    cut = [0] * (len(order) + 1)
    for k in range(1, len(order) + 1):
        c_max = 0
        for start in range(k - 1, -1, -1):   # the last pass holds order[start:k]
            c_max = max(c_max, cached[order[start]])
            n_max = new[order[k - 1]]
            cost = best[start] + (k - start) * n_max * (1 + attention_per_position * (c_max + n_max)) + pass_tokens
            if cost < best[k]:
                best[k], cut[k] = cost, start
    groups, k = [], len(order)
    while k:
        groups.append(sorted(order[cut[k]:k]))
        k = cut[k]
    return groups[::-1]


def attention_per_position(model: torch.nn.Module) -> float:
    """A query token's attention FLOPs per attended position (scores and weighted values: 4 x heads x head dim
    per layer) as a share of its matmul FLOPs (2 per Linear weight): what each padded position adds to a token."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linear = 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim / max(1, linear)


def _sdpa_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that a prefill (query longer than one token) of a grouped-query model
    on CPU attends with `enable_gqa` instead of first copying each key/value head once per query head it serves
    (transformers does that copy whenever there is a mask, which our padded batches always have). The same
    output bit for bit; a prefill over a 1,000-token cache took 0.57x the time (see docs/performance.md).
    Decoding steps (one query token) go to transformers unchanged: it already attends there without the copy.
    With `shared_kv` (the hf backend's shared prefix, kept outside the cache), see `_attend_to_shared_prefix`."""
    shared = kwargs.pop("shared_kv", None)
    if shared is not None:
        return _attend_to_shared_prefix(module, query, key, value, attention_mask, scaling, shared), None
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] == 1 or groups == 1 or query.device.type != "cpu" or attention_mask is None
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _attend_to_shared_prefix(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None,
                             shared: list[torch.Tensor]) -> torch.Tensor:
    """Attention of every row's queries to a token prefix all rows share, then to their own keys/values (`key`,
    `value`: the cache, which holds each row's tokens after the prefix), merged through the two parts' log-sum-exps
    (cascade attention): the prefix's keys/values (`shared[layer]`, (2, kv heads, p, head dim)) are read once for
    the whole batch, as one matrix product over all rows' queries, instead of once per row from a copy in each.
    The same attention up to float rounding (the softmax is summed in two parts). Returns (batch, query length,
    heads, head dim), as the attention functions do."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim ** -0.5
    if attention_mask is None and length > 1:   # causal over the cache's last `length` positions
        span = key.shape[2]
        attention_mask = (torch.arange(span, device=query.device)[None, :]
                          <= torch.arange(span - length, span, device=query.device)[:, None])[None, None]
    attention_mask, blind = _additive_mask(attention_mask, query.dtype)
    own, own_lse = flash(query, key, value, attn_mask=attention_mask, scale=scale)
    if blind is not None:
        own_lse = own_lse.masked_fill(blind, float("-inf"))
    # the prefix: all rows' queries of a key/value head as the rows of one (batch 1) attention
    kv = shared[module.layer_idx]
    rows = query.reshape(batch, kv_heads, groups, length, dim).transpose(0, 1).reshape(1, kv_heads, -1, dim)
    head, head_lse = flash(rows, kv[0:1], kv[1:2], scale=scale)
    head = head.view(kv_heads, batch, groups, length, dim).transpose(0, 1).reshape(batch, heads, length, dim)
    head_lse = head_lse.view(kv_heads, batch, groups, length).transpose(0, 1).reshape(batch, heads, length)
    top = torch.maximum(own_lse, head_lse)
    own_weight, head_weight = (own_lse - top).exp_()[..., None], (head_lse - top).exp_()[..., None]
    out = (own * own_weight + head * head_weight) / (own_weight + head_weight)
    return out.transpose(1, 2).contiguous()


_SLOW_BF16_SAID: list = []   # the warning that bfloat16 is emulated on this CPU, said once a process
_LAST_MASK: list = [None, None, None]   # the last mask `_additive_mask` converted (a weak reference) and its result


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mask as the CPU flash kernel takes it (0 / -inf in the query's dtype) and the queries it leaves no key
    at all (pads: the kernel gives them a log-sum-exp of 0, which the merge must not weigh), or None. Every layer
    of a forward pass gets the same mask tensor: it is converted once, for the first layer."""
    if mask is None:
        return None, None
    last, converted, blind = _LAST_MASK
    if last is not None and last() is mask and converted.dtype == dtype:
        return converted, blind
    if mask.dtype == torch.bool:
        converted = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    else:
        converted = mask.to(dtype)
    blind = torch.isneginf(converted).all(-1)
    _LAST_MASK[:] = [weakref.ref(mask), converted, blind if blind.any() else None]
    return converted, _LAST_MASK[2]


def _sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
    """`_sdpa_grouped` computed in float32 and returned in the query's dtype (keys/values already float32, as
    ReservedCacheLayer keeps them for half-precision weights on CPU, are not copied)."""
    out, weights = _sdpa_grouped(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(query.dtype), weights


GROUPED_SDPA = "rsiflow_sdpa_grouped"
FLOAT32_SDPA = "rsiflow_sdpa_float32"
AttentionInterface.register(GROUPED_SDPA, _sdpa_grouped)
AttentionInterface.register(FLOAT32_SDPA, _sdpa_in_float32)
# The masks SDPA gets (padding, cached rows): transformers builds none for an attention name it has no mask for.
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)


class _StopWhenInterrupted(StoppingCriteria):
    """Ends `model.generate` at the next token once rsiflow is stopping (the caller then raises `Interrupted`)."""

    def __init__(self, start_count: int):
        self.start_count = start_count

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), interrupted_since(self.start_count), dtype=torch.bool,
                          device=input_ids.device)


def _warpers(params: SamplingParams, top_p: bool = True) -> LogitsProcessorList:
    """Temperature then top-p, the only warpers applied (temperature 0 = greedy: none); without `top_p`,
    the temperature alone."""
    warpers = LogitsProcessorList()
    if params.temperature > 0 and params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if top_p and params.temperature > 0 and params.top_p < 1.0:
        warpers.append(NucleusWarper(params.top_p))
    return warpers


def _ranked_nucleus(probs: torch.Tensor, top_p: float, first_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """The most likely tokens of each row of `probs`, descending, as many as its nucleus needs: (probabilities,
    token ids, whether each is in the nucleus), (rows, k) each. A token is in it when the probability ranked
    above it is below `top_p` (the most likely always is). Only the `first_k` most likely are ranked first, and
    only the rows whose nucleus is wider than that are ranked again, 8x wider each time (most rows are peaked:
    ranking the whole batch that wide cost more than the rest of a step); narrower rows are padded with
    probability 0 (never in the nucleus) and token 0."""
    vocab = probs.shape[-1]
    k = min(first_k, vocab)
    top, index = probs.topk(k, dim=-1)  # descending
    mass = top.cumsum(dim=-1)
    while k < vocab and bool((need := mass[:, -1] < top_p).any()):
        k = min(8 * k, vocab)
        rows = need.nonzero().squeeze(1)
        wider, wider_index = probs[rows].topk(k, dim=-1)
        top = torch.nn.functional.pad(top, (0, k - top.shape[1]))
        index = torch.nn.functional.pad(index, (0, k - index.shape[1]))
        top[rows], index[rows] = wider, wider_index
        mass = top.cumsum(dim=-1)
    kept = (mass - top < top_p) & (top > 0)   # the mass ranked above each token; padding is never kept
    kept[:, 0] = True
    return top, index, kept


def sample_nucleus(logits: torch.Tensor, temperature: float, top_p: float, draw_order: list[int] | None = None,
                   first_k: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row from the nucleus (top-p) of softmax(logits / temperature), drawn among the nucleus's
    tokens only: returns (tokens, their logprobs under the nucleus distribution, their logprobs at the
    temperature alone), the first two as `NucleusWarper` then `torch.multinomial` would give, in distribution.

    The draw is an exponential race: with E_i ~ Exp(1) independent, argmax_i p_i / E_i is token i with
    probability p_i / sum p (the smallest of independent exponential times E_i / p_i). It needs one random
    number per nucleus token instead of multinomial's one per vocabulary entry (49,152 for SmolLM2), which was
    most of a sampling step's cost outside the model. Probabilities are float64, as in `NucleusWarper`.
    `draw_order`: the order in which rows take their random numbers (default: as given), so a seeded call draws
    the same tokens whatever order the batch holds its rows in."""
    logp = (logits.double() / temperature).log_softmax(dim=-1)
    top, index, kept = _ranked_nucleus(logp.exp(), top_p, first_k)
    kept_p = top.where(kept, torch.zeros((), dtype=top.dtype, device=top.device))
    times = torch.empty_like(kept_p).exponential_()
    if draw_order is not None and draw_order != list(range(len(draw_order))):
        times = torch.empty_like(times).index_copy_(0, torch.tensor(draw_order, device=times.device), times)
    choice = (kept_p / times.clamp_min(torch.finfo(times.dtype).tiny)).argmax(dim=-1, keepdim=True)
    tokens = index.gather(1, choice).squeeze(1)
    logprobs = (kept_p.gather(1, choice).squeeze(1) / kept_p.sum(dim=-1)).log()
    temp_logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs.float(), temp_logprobs.float()


class NucleusWarper(LogitsProcessor):
    """Top-p (nucleus) filtering: keeps a token when the probability of the tokens ranked above it is below
    `top_p` (so the most likely token always stays), masks the rest to -inf. The kept set is transformers'
    `TopPLogitsWarper`'s (which removes a token when the ascending cumulative probability up to it is at most
    1 - top_p: the same condition), up to floating-point rounding exactly at the boundary and the order of tied
    probabilities. Instead of sorting the whole vocabulary every decoding step it ranks only the `first_k` most
    likely tokens, and ranks a row 8x as wide again while their mass is below `top_p` in it: on SmolLM2's
    49,152-token vocabulary the full sort took most of a sampling step's non-model time (`python -m bench.decode`)."""

    def __init__(self, top_p: float, first_k: int = 128):
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {top_p}")
        self.top_p, self.first_k = float(top_p), first_k

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.FloatTensor) -> torch.FloatTensor:
        # float64: a float32 softmax's total is off by ~1e-5, enough to move the boundary of a wide nucleus
        probs = scores.double().softmax(dim=-1)
        _, index, keep_ranked = _ranked_nucleus(probs, self.top_p, self.first_k)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        row_of = torch.arange(len(probs), device=probs.device)[:, None].expand_as(index)
        keep[row_of[keep_ranked], index[keep_ranked]] = True   # padding (index 0, never kept) writes nothing
        return scores.masked_fill(~keep, -float("inf"))


class _SampledLogprobs(LogitsProcessor):
    """Last logits processor: keeps log-softmax(final scores) and, one step later, reads it at the sampled token.

    At step t `input_ids` ends with the token sampled at step t-1, so only one (batch, vocab) tensor is
    held at a time instead of all scores (`output_scores` would keep steps x batch x vocab floats).
    """

    def __init__(self):
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.LongTensor) -> torch.Tensor:
        """(batch, new tokens) logprobs of the sampled tokens."""
        self.steps.append(self.previous.gather(1, sequences[:, -1:]).squeeze(1))
        self.previous = None
        return torch.stack(self.steps, dim=1).cpu()


_BACKENDS: list[tuple[tuple, HFBackend]] = []  # (options, backend), least recently used first
_MAX_CACHED_BACKENDS = 2  # e.g. the champion and a candidate; each SmolLM2-135M copy is ~0.55 GB in fp32


def get_backend(model_path: str | Path, **kwargs) -> HFBackend:
    """A process-wide HFBackend serving this checkpoint with these options, loaded once and reused by
    later pipeline steps. Keeps the two most recently used. A backend redeployed with `serve()` is
    found under the checkpoint it serves now.

    A reused backend starts with an empty KV store (`kv_reuse`): what a step samples then depends only
    on its inputs, not on which calls earlier steps made in this process, so a step resumed in a fresh
    process after a kill samples exactly what it would have (bench/chaos checks this). Reuse across the
    turns and episodes of one step, where it pays, is untouched.
    """
    options = tuple(sorted(kwargs.items()))
    path = Path(model_path).resolve()
    for i, (opts, backend) in enumerate(_BACKENDS):
        if opts == options and Path(backend.model_path).resolve() == path:
            _BACKENDS.append(_BACKENDS.pop(i))
            backend.clear_kv_store()
            return backend
    while len(_BACKENDS) >= _MAX_CACHED_BACKENDS:
        _BACKENDS.pop(0)
    backend = HFBackend(model_path, **kwargs)
    _BACKENDS.append((options, backend))
    return backend


def clear_backends() -> None:
    """Forget every cached backend (frees their models once no one else holds them)."""
    _BACKENDS.clear()
