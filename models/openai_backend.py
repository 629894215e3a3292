"""The `openai` generation backend: any OpenAI-compatible completions server at a configured URL
(`vllm serve`, SGLang, a llama.cpp server).

Per `generate` call: the chats are templated here with the checkpoint's tokenizer (the same prompt
token ids as the `hf` backend), each row is one `POST {base_url}/completions` with the prompt as
token ids (up to `max_concurrency` at once), `logprobs: 1` and vLLM's `return_token_ids` (the sampled
ids; a server without it must return `token_id:<n>` logprob tokens via `return_tokens_as_token_ids`,
or the text is re-tokenized here and `extra["token_ids"] = "retokenized"`). Rows are cut at eos /
the first stop string by `models.backend.finish_row`, as for every backend. One seed per row
(`seed + i`) when the call is seeded.

Logprobs are what the server returns for the sampled tokens: `vllm serve --logprobs-mode
processed_logprobs` makes them the after-temperature/top-p ones the `Generation` contract promises
(the default `raw_logprobs` gives them before temperature: set the flag). `temp_logprobs` as in the
`vllm` backend: the same values when top_p = 1 or greedy; at temperature 1 with top_p < 1, a scoring
request over prompt + completion with vLLM's `prompt_logprobs` (`score_temp_logprobs`); else empty.

Connection errors and 502/503/504 are retried `retries` times with exponential backoff from
`backoff_seconds`; after that the error names the URL. A server serves one model: the backend
remembers, per URL, which checkpoint this process made the server serve, and a call for another one
(the gate's candidate, or the champion after it) first redeploys. The first call of a process redeploys
too (what a server holds after a crash is not known); only with `redeploy: none` is the server assumed
to serve the checkpoint the backend was opened on:
- `redeploy: vllm_reload`: `POST {root}/collective_rpc` with vLLM workers' `reload_weights` and the
  checkpoint path, then `POST {root}/reset_prefix_cache` (vLLM's dev endpoints: start the server with
  `VLLM_SERVER_DEV_MODE=1`; the path must be readable by the server);
- `redeploy: command`: runs `redeploy_command` (an argv list, `{path}` replaced; no shell), which must
  return once the server serves that checkpoint;
- `redeploy: none`: a call for another checkpoint is an error (one model, evaluated elsewhere).
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from models.backend import Generation, SamplingParams, finish_row, wants_scoring

# base_url -> the checkpoint that server serves now (as far as this process knows)
_SERVING: dict[str, str] = {}
_RETRY_STATUS = {502, 503, 504}


class OpenAIBackend:
    """GenerationBackend on an OpenAI-compatible completions server (see the module docstring)."""

    kind = "openai"

    def __init__(self, model_path: str, *, dtype: str = "float32", trust_remote_code: bool = False,
                 base_url: str = "http://127.0.0.1:8000/v1", model: str | None = None, api_key_env: str | None = None,
                 timeout: float = 600.0, retries: int = 5, backoff_seconds: float = 1.0, max_concurrency: int = 16,
                 score_temp_logprobs: bool | str = "auto", redeploy: str = "none",
                 redeploy_command: list[str] | None = None):
        import os

        import httpx
        from transformers import AutoTokenizer, GenerationConfig

        if redeploy not in ("none", "vllm_reload", "command"):
            raise ValueError(f"backend.openai.redeploy must be 'none', 'vllm_reload' or 'command', got {redeploy!r}")
        if redeploy == "command" and not redeploy_command:
            raise ValueError("backend.openai.redeploy is 'command' but backend.openai.redeploy_command is empty")
        self.model_path = str(model_path)
        self.base_url = base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.retries, self.backoff, self.max_concurrency = retries, backoff_seconds, max_concurrency
        self.score_temp_logprobs, self.redeploy, self.redeploy_command = score_temp_logprobs, redeploy, redeploy_command
        headers = {}
        if api_key_env and os.environ.get(api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
        self.http = httpx.Client(timeout=timeout, headers=headers)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        eos = {self.tokenizer.eos_token_id}
        try:
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
            eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        except OSError:
            pass
        self._eos_ids = {e for e in eos if e is not None}
        self.model = model or self._request("GET", "/models")["data"][0]["id"]
        if redeploy == "none":  # a server rsiflow cannot switch serves, by assumption, what it is opened on
            _SERVING.setdefault(self.base_url, self.model_path)

    @classmethod
    def open(cls, model_path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False,
             **options) -> OpenAIBackend:
        return cls(str(model_path), dtype=dtype, trust_remote_code=trust_remote_code, **options)

    # -- transport -------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, base: str | None = None):
        import httpx

        url = (base or self.base_url) + path
        delay, last = self.backoff, None
        for attempt in range(self.retries + 1):
            try:
                resp = self.http.request(method, url, json=body)
                if resp.status_code in _RETRY_STATUS:
                    last = f"HTTP {resp.status_code}"
                elif resp.status_code >= 400:
                    raise RuntimeError(f"{method} {url}: HTTP {resp.status_code}: {resp.text[:500]}")
                else:
                    return resp.json() if resp.content else None
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.retries:
                time.sleep(delay)
                delay *= 2
        raise RuntimeError(f"the generation server at {url} did not answer after {self.retries + 1} tries "
                           f"({last}); is it running? (backend.openai.base_url)")

    # -- weights ---------------------------------------------------------------------------------------
    def _switch(self, model_path: str) -> str:
        serving = _SERVING.get(self.base_url)
        if serving is not None and Path(serving).resolve() == Path(model_path).resolve():
            return "already serving"
        if self.redeploy == "none":
            raise RuntimeError(f"the server at {self.base_url} serves {serving}, and this call needs {model_path}: "
                               f"set backend.openai.redeploy ('vllm_reload' or 'command') so rsiflow can switch it")
        if self.redeploy == "vllm_reload":
            self._request("POST", "/collective_rpc", {"method": "reload_weights",
                                                       "kwargs": {"weights_path": str(model_path)}}, base=self.root)
            self._request("POST", "/reset_prefix_cache", base=self.root)
            action = "reloaded weights in place on the server (collective_rpc reload_weights)"
        else:
            argv = [part.replace("{path}", str(model_path)) for part in self.redeploy_command]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"backend.openai.redeploy_command {argv} exited {done.returncode}: "
                                   f"{(done.stderr or done.stdout)[-500:]}")
            action = f"ran {argv}"
        _SERVING[self.base_url] = str(model_path)
        return action

    def serve(self, model_path: str | Path) -> dict:
        """Redeploy: the server serves `model_path` from now on (`redeploy` says how)."""
        start = time.perf_counter()
        action = self._switch(str(model_path))
        self.model_path = str(model_path)
        return {"kind": self.kind, "action": action, "path": str(model_path), "url": self.base_url,
                "seconds": round(time.perf_counter() - start, 2)}

    # -- generation ------------------------------------------------------------------------------------
    def generate(self, conversations: list[list[dict]], params: SamplingParams,
                 tools: list[dict] | None = None) -> list[Generation]:
        if not conversations:
            return []
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1:
            raise ValueError(f"invalid sampling params {params}")
        self._switch(self.model_path)
        texts = self.tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=True,
                                                   tokenize=False)
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        exact = params.temperature == 0 or params.top_p >= 1.0
        score = not exact and params.temperature == 1.0 and wants_scoring(self.score_temp_logprobs, params)
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts))) as pool:
            return list(pool.map(lambda i: self._one(prompts[i], params, i, exact, score), range(len(prompts))))

    def _one(self, prompt: list[int], params: SamplingParams, i: int, exact: bool, score: bool) -> Generation:
        body = {"model": self.model, "prompt": prompt, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p if params.temperature > 0 else 1.0,
                "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False}
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = (params.seed + i) % (2**31)
        choice = self._request("POST", "/completions", body)["choices"][0]
        lp = choice.get("logprobs") or {}
        logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        extra = {}
        if choice.get("token_ids") is not None:
            tokens = [int(t) for t in choice["token_ids"]]
        elif all(str(t).startswith("token_id:") for t in lp.get("tokens") or ["?"]):
            tokens = [int(str(t).split(":", 1)[1]) for t in lp["tokens"]]
        else:
            tokens = self.tokenizer(choice.get("text", ""), add_special_tokens=False)["input_ids"]
            extra["token_ids"] = "retokenized"
        temp = logprobs if exact else []
        if score:
            ids = prompt + tokens
            scored = self._request("POST", "/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0.0, "prompt_logprobs": 0})
            plp = scored["choices"][0].get("prompt_logprobs") or []
            temp = [float(plp[j][str(ids[j])]["logprob"]) for j in range(len(prompt), len(ids))]
        gen = finish_row(tokens, logprobs, temp, params.stop, len(prompt), self._eos_ids, self._decode)
        gen.extra.update(extra)
        if not exact and not score:
            gen.extra["temp_logprobs"] = "unavailable at this temperature with top_p < 1"
        return gen

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
