"""The generation-backend protocol shared by `hf`, `vllm` and `openai` backends.

A backend takes a batch of chat conversations (lists of {"role", "content"} messages), applies
the model's chat template with a generation prompt, samples one completion per conversation and
returns text, token ids, per-token *sampling* logprobs (log-probabilities of the sampled tokens
under the distribution actually sampled from, i.e. after temperature/top-p) and a finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0     # 0 means greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()   # generation of a row stops after any of these strings; text is cut before it
    seed: int | None = None      # seeds torch's sampler for this call when set


@dataclass
class Generation:
    text: str                    # completion text, cut at the first stop string / eos (not included)
    token_ids: list[int]         # the sampled token ids kept (matching `text`, eos/stop tokens excluded)
    logprobs: list[float]        # one sampling logprob per kept token
    finish_reason: str           # "stop" (eos or stop string) | "length"
    prompt_tokens: int           # tokens of the templated prompt (prefill for this request)
    extra: dict = field(default_factory=dict)


class GenerationBackend(Protocol):
    model_path: str

    def generate(self, conversations: list[list[dict]], params: SamplingParams) -> list[Generation]:
        """One batched call: one Generation per conversation, same order."""
        ...

    def reload(self, model_path: str) -> None:
        """Serve another checkpoint (the new champion) from now on."""
        ...
