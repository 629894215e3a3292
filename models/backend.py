"""The generation-backend protocol and the registry of backends, keyed by `backend.kind`.

A backend takes a batch of chat conversations (lists of {"role", "content"} messages), applies
the model's chat template with a generation prompt (and the env's tool schemas, where it has
any), samples one completion per conversation and returns text, token ids, per-token *sampling*
logprobs (log-probabilities of the sampled tokens under the distribution actually sampled from,
i.e. after temperature/top-p), their logprobs after temperature only (`temp_logprobs`, no
truncation: what a trainer recomputes) and a finish reason.

Stopping (Ctrl-C, SIGTERM): the CLI's signal handler calls `interrupt_calls_in_flight()` before the stop unwinds,
because Prefect waits for a step's thread, and that thread may be inside a long generate call. A call started
before it ends early with `Interrupted`: hf checks between decoding steps, vllm's engine process is killed (its
hook, `on_interrupt`), openai sends no further request. A backend checks with `interrupted_since(start)`, `start`
being `interrupts()` read when the call began (calls started afterwards run as usual, except while a step's expired
deadline holds the stop: `hold_interrupt`, so a deadline that passes between two calls still ends the step).

Redeploy is part of the protocol: `serve(model_path)` makes a backend serve another checkpoint
from then on (the `hf` backend reloads the weights in its process) and returns a record of what
it did, which the deploy step stores with the round.

A new backend is one module with a class that has `open` (a classmethod: a backend serving a
checkpoint, built or reused), `generate` and `serve`, named in `BACKENDS` (configs/registry.py); its options get their
own section of the config (`backend.<kind>`, configs/schema.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Protocol

from rsiflow.configs.registry import BACKENDS


class Interrupted(RuntimeError):
    """A generate call ended early: rsiflow is stopping (Ctrl-C or SIGTERM; `interrupt_calls_in_flight`)."""


_INTERRUPTS = 0  # how many times rsiflow was told to stop
_HELD = 0        # stops that also end calls started after them (`hold_interrupt`, until released)
_ON_INTERRUPT: list[Callable[[], None]] = []


def interrupts() -> int:
    """The interrupt count now; a call reads it when it starts and passes it to `interrupted_since`."""
    return _INTERRUPTS


def interrupted_since(start: int) -> bool:
    """Whether rsiflow was told to stop after the call that read `start` began, or a held stop is in force."""
    return _INTERRUPTS != start or _HELD > 0


def raise_if_interrupted(start: int, backend: str) -> None:
    if interrupted_since(start):
        raise Interrupted(f"{backend} generate call stopped: rsiflow is stopping (Ctrl-C or SIGTERM)")


def on_interrupt(hook: Callable[[], None]) -> Callable[[], None]:
    """Register `hook` (a backend's way to end its calls in flight at once, e.g. kill an engine process); run by
    `interrupt_calls_in_flight` in the main thread, from a signal handler: it must be quick and not block."""
    _ON_INTERRUPT.append(hook)
    return hook


def interrupt_calls_in_flight() -> None:
    """End every generate call in flight in this process (they raise `Interrupted`): Ctrl-C or SIGTERM is stopping
    rsiflow, and a step's thread waiting on a call would otherwise hold the exit until the call ends."""
    global _INTERRUPTS
    _INTERRUPTS += 1
    for hook in list(_ON_INTERRUPT):
        # Runs inside a signal handler: a hook's error must not replace the KeyboardInterrupt / Terminated being
        # raised (the stop goes on: the count above still ends hf and openai calls; only a call the failed hook was
        # to cut short runs on), and logging it here could deadlock on a logging lock the interrupted code holds.
        with contextlib.suppress(Exception):
            hook()


def hold_interrupt() -> Callable[[], None]:
    """Interrupt the calls in flight (`interrupt_calls_in_flight`) and keep ending every call that checks, started
    before or after, until the returned `release` is called: a step's deadline that passes while the step is between
    calls (loading a model, scoring, writing rows) still stops the step's next call."""
    global _HELD
    _HELD += 1
    interrupt_calls_in_flight()
    released = False

    def release() -> None:
        global _HELD
        nonlocal released
        if not released:
            released = True
            _HELD -= 1
    return release


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()   # generation of a row stops after any of these strings; text is cut before it
    seed: int | None = None      # seeds torch's sampler for this call when set
    # Whether the caller needs `Generation.temp_logprobs` (GRPO-style training on these rows). A backend that
    # must pay for them (vLLM at top_p < 1: a scoring pass) computes them under `score_temp_logprobs: auto`
    # only when this is set; hf computes them always.
    temp_logprobs: bool = True

    def check(self) -> None:
        """ValueError unless temperature >= 0, 0 < top_p <= 1 and max_new_tokens >= 1 (every backend's first step)."""
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {self}")


@dataclass
class Generation:
    text: str                    # completion text, cut at the first stop string / eos (not included)
    token_ids: list[int]         # the sampled token ids kept (matching `text`, eos/stop tokens excluded)
    logprobs: list[float]        # one sampling logprob per kept token
    finish_reason: str           # "stop" (eos or stop string) | "length"
    prompt_tokens: int           # tokens of the templated prompt (prefill for this request)
    extra: dict = field(default_factory=dict)
    # per kept token: its logprob after temperature only (no top-p/top-k truncation), what a trainer
    # recomputes; used for the rollout/trainer mismatch correction (models/mismatch.py)
    temp_logprobs: list[float] = field(default_factory=list)


class GenerationBackend(Protocol):
    kind: str
    model_path: str

    @classmethod
    def open(cls, model_path: str, *, dtype: str, trust_remote_code: bool, **options: Any) -> GenerationBackend:
        """A backend serving `model_path` with these options (it may reuse one the process already holds)."""
        ...

    def generate(self, conversations: list[list[dict]], params: SamplingParams,
                 tools: list[dict] | None = None) -> list[Generation]:
        """One batched call: one Generation per conversation, same order. `tools` (JSON schemas) go to the
        chat template of every conversation."""
        ...

    def serve(self, model_path: str) -> dict:
        """Redeploy: serve `model_path` from now on. Returns what was done (kind, action, path, seconds)."""
        ...

    @classmethod
    def must_redeploy(cls) -> bool:
        """Optional. Whether a redeploy from this process has something to switch: a model this process holds (hf),
        an engine it started (vllm), or servers elsewhere (openai: always). False in a fresh process (a deploy step
        on a pool worker, or resumed after a kill), where the next step that generates loads the champion anyway.
        A backend without it is always opened and switched (tasks.common.redeploy_backend)."""
        ...


def backend_class(kind: str) -> type:
    """The class registered for `kind`; ValueError naming the known kinds otherwise."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend kind {kind!r}: known kinds are {sorted(BACKENDS)}")
    module, _, name = BACKENDS[kind].partition(":")
    return getattr(import_module(module), name)


def open_backend(kind: str, model_path: str, *, dtype: str = "float32", trust_remote_code: bool = False,
                 **options: Any) -> GenerationBackend:
    """A `kind` backend serving `model_path` (see each backend's `open` for what it reuses)."""
    return backend_class(kind).open(str(model_path), dtype=dtype, trust_remote_code=trust_remote_code, **options)


def backend_for(cfg, model_path: str, evaluation: bool = False) -> GenerationBackend:
    """The configured generation backend of `cfg` (`backend.kind`, its own options section) serving `model_path`.

    Rollouts sample in the backend's dtype (`backend.<kind>.dtype`, default model.dtype). `evaluation` plays,
    the ones that measure a model (the gate, the final test split, the greedy diagnostics), use the trainer's
    dtype (`model.dtype`) unless `gate.dtype` is "sampler": a cheaper sampling dtype never decides a promotion."""
    from rsiflow.models import threads

    threads.configure(cfg.run.threads)
    options = cfg.backend.options()
    dtype = options.pop("dtype", None) or cfg.model.dtype  # a backend may sample in another dtype than training
    if dtype == "auto":
        dtype = auto_sampling_dtype(cfg.model.dtype)
    if evaluation and cfg.gate.dtype == "trainer":
        dtype = cfg.model.dtype
    return open_backend(cfg.backend.kind, model_path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
                        **options)


def native_bf16() -> bool:
    """Whether this machine multiplies bfloat16 natively where the hf backend runs: the CUDA GPU when there is one
    (bf16 support), else the CPU (AVX512-BF16 or AMX instructions; elsewhere PyTorch emulates bf16, slower than
    float32)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def auto_sampling_dtype(model_dtype: str) -> str:
    """`backend.hf.dtype: auto`: rollouts sample in bfloat16 when the trainer's dtype is float32 and the machine
    runs bf16 natively (`native_bf16`), else in the trainer's dtype."""
    return "bfloat16" if model_dtype == "float32" and native_bf16() else model_dtype


def wants_scoring(option: bool | str, params: SamplingParams) -> bool:
    """A server backend's `score_temp_logprobs` option for this call: True or False as set, or "auto" = when the
    call asks for temperature-only logprobs (`params.temp_logprobs`)."""
    return option is True or (option == "auto" and params.temp_logprobs)


def finish_row(tokens: list[int], logprobs: list[float], temp_logprobs: list[float], stop: tuple[str, ...],
               prompt_tokens: int, eos_ids: set[int], decode: Callable[[list[int]], str]) -> Generation:
    """One row's Generation from the tokens a sampler produced, the same way for every backend: cut at the
    first eos (not kept), then at the first occurrence of any stop string in the decoded text; `token_ids`
    becomes the shortest token prefix whose decoded text covers the cut text (a token that holds the end of
    the text *and* the start of the stop string is kept), and the logprob lists are cut to match."""
    finish_reason = "length"
    eos_at = next((j for j, t in enumerate(tokens) if t in eos_ids), None)
    if eos_at is not None:
        tokens, finish_reason = tokens[:eos_at], "stop"
    text = decode(tokens)
    extra = {}
    hits = [(text.find(s), s) for s in stop if s in text]
    if hits:
        cut, matched = min(hits)
        text, finish_reason, extra["stop"] = text[:cut], "stop", matched
        # Shortest token prefix whose text covers `text` (decode is monotone here: scan down from the end).
        keep = len(tokens)
        while keep > 0 and decode(tokens[:keep - 1]).startswith(text):
            keep -= 1
        tokens = tokens[:keep]
    return Generation(text=text, token_ids=list(tokens), logprobs=list(logprobs[:len(tokens)]),
                      finish_reason=finish_reason, prompt_tokens=prompt_tokens, extra=extra,
                      temp_logprobs=list(temp_logprobs[:len(tokens)]))
