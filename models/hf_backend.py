"""The `hf` generation backend: batched transformers `generate` on a local checkpoint.

What it really does, per `generate` call:
- applies the tokenizer's chat template (with the generation prompt) to every conversation,
  sorts the requests by prompt length and cuts them into chunks of at most `max_batch_size`
  (less padding, and the 2-core CPU slows down sharply above batch 16), left-pads each chunk
  with the pad token (= eos) and runs `model.generate` on it, no KV cache kept between calls;
- samples with temperature and top-p only (temperature 0: greedy); `seed` seeds torch's RNG for
  the call (results then depend on the seed and the batch, not on any earlier call);
- records per-token sampling logprobs: the log-softmax of the scores actually sampled from
  (after temperature/top-p; raw logits when greedy), taken at the sampled token;
- cuts each row at its first eos and at the first occurrence of any stop string.

What is kept, so a trainer can reproduce it: `token_ids` are the generated tokens before eos and,
when a stop string matched, the shortest token prefix whose decoded text covers `text` (the
completion cut right before the stop string). Tokens lying wholly inside or after the stop string
are dropped; a token that holds the end of `text` *and* the start of the stop string (e.g. ".\\n"
with stop "\\n") is kept, so `decode(token_ids)` starts with `text` and then is equal to it unless
such a straddling token exists. `logprobs[i]` belongs to `token_ids[i]`. `extra["stop"]` names the
stop string that matched (absent when none did).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from models.backend import Generation, SamplingParams
from models.loading import load_model_and_tokenizer

# SmolLM2-135M on the 2-core CPU, 268-token prompts, 16 new tokens, generated tok/s on an idle machine:
# batch 1: 16, 8: 32, 16: 33-39, 32: 43. With another process busy on a core, batch 32+ collapsed to
# 6-17 tok/s (OpenMP threads spin-waiting for the shared core) while 16 held ~30: 16 is the safe default.
DEFAULT_MAX_BATCH_SIZE = 16


class HFBackend:
    """GenerationBackend on transformers `generate` (CPU default; also runs on one GPU)."""

    def __init__(self, model_path: str | Path, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, dtype: str = "float32",
                 device: str | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.dtype = dtype
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.reload(model_path)

    def reload(self, model_path: str | Path) -> None:
        model, tokenizer = load_model_and_tokenizer(model_path, dtype=self.dtype)
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
        self.tokenizer = tokenizer
        self.model_path = str(model_path)

    def generate(self, conversations: list[list[dict]], params: SamplingParams) -> list[Generation]:
        if not conversations:
            return []
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {params}")
        texts = self.tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        # A seeded call must not disturb the global RNG stream of unseeded calls (CPU state restored after).
        seeded = torch.random.fork_rng(devices=[]) if params.seed is not None else contextlib.nullcontext()
        with seeded, torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start:start + self.max_batch_size]
                for i, generation in zip(chunk, self._generate_chunk([prompts[i] for i in chunk], params)):
                    results[i] = generation
        return results

    def _generate_chunk(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        pad = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)

        sample = params.temperature > 0
        processors = LogitsProcessorList()
        if sample and params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if sample and params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        # Warpers are passed in by hand (and disabled in the config) so the recorder runs after them.
        recorder = _SampledLogprobs()
        processors.append(recorder)
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
        )
        logprobs = recorder.finish(sequences)
        new_tokens = sequences[:, width:].tolist()
        return [
            self._finish_row(tokens, logprobs[row].tolist(), params.stop, len(prompts[row]))
            for row, tokens in enumerate(new_tokens)
        ]

    def _finish_row(self, tokens: list[int], logprobs: list[float], stop: tuple[str, ...], prompt_tokens: int):
        finish_reason = "length"
        eos_at = next((j for j, t in enumerate(tokens) if t in self._eos_ids), None)
        if eos_at is not None:
            tokens, finish_reason = tokens[:eos_at], "stop"
        text = self._decode(tokens)
        extra = {}
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            cut, matched = min(hits)
            text, finish_reason, extra["stop"] = text[:cut], "stop", matched
            # Shortest token prefix whose text covers `text` (decode is monotone here: scan down from the end).
            keep = len(tokens)
            while keep > 0 and self._decode(tokens[:keep - 1]).startswith(text):
                keep -= 1
            tokens = tokens[:keep]
        return Generation(
            text=text,
            token_ids=tokens,
            logprobs=logprobs[:len(tokens)],
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            extra=extra,
        )

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)


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


_BACKENDS: OrderedDict[tuple, HFBackend] = OrderedDict()
_MAX_CACHED_BACKENDS = 2  # e.g. the champion and a judge; each SmolLM2-135M copy is ~0.55 GB in fp32


def get_backend(model_path: str | Path, **kwargs) -> HFBackend:
    """A process-wide HFBackend for this checkpoint, loaded once and reused by later pipeline steps.

    Keeps the two most recently used backends. Don't `reload()` a backend obtained here (ask for
    the new path instead): a reloaded backend no longer matches its cache entry and is dropped.
    """
    key = (str(Path(model_path).resolve()), tuple(sorted(kwargs.items())))
    backend = _BACKENDS.get(key)
    if backend is not None and Path(backend.model_path).resolve() == Path(model_path).resolve():
        _BACKENDS.move_to_end(key)
        return backend
    _BACKENDS.pop(key, None)
    while len(_BACKENDS) >= _MAX_CACHED_BACKENDS:
        _BACKENDS.popitem(last=False)
    backend = _BACKENDS[key] = HFBackend(model_path, **kwargs)
    return backend


def clear_backends() -> None:
    """Forget every cached backend (frees their models once no one else holds them)."""
    _BACKENDS.clear()
