"""The `openai` generation backend: one or several OpenAI-compatible completions servers (`vllm serve`,
SGLang, a llama.cpp server) serving the same checkpoint.

Per `generate` call: the chats are templated here with the checkpoint's tokenizer (the same prompt
token ids as the `hf` backend), each row is one `POST {url}/completions` with the prompt as token ids,
`logprobs: 1` and vLLM's `return_token_ids` (the sampled ids; a server without it must return
`token_id:<n>` logprob tokens via `return_tokens_as_token_ids`, or the text is re-tokenized here and
`extra["token_ids"] = "retokenized"`). Rows are cut at eos / the first stop string by
`models.backend.finish_row`, as for every backend. One seed per row (`seed + i`, whichever server runs
it) when the call is seeded, so spreading a batch over servers gives the rows one server would.

Several servers (`base_urls`; `base_url` is the one-server form): each row goes to the live server with
the fewest of this call's requests in flight (ties in turn), at most `max_concurrency` per server.
Connection errors, timeouts and 502/503/504 are retried `retries` times with exponential backoff from
`backoff_seconds` on the same server; after that the server is taken out of rotation (a warning names it
and the error), and the row, like every other row then in flight there, runs again on another live
server. Other HTTP errors (4xx, 500) are errors of the request and raise: retrying them elsewhere would
take every server out for one bad request. With no server left, the call fails with an error naming
every URL and its last error. Rotation state is per process (like what each server serves): a server
out of rotation gets one quick probe (`GET /models`, one try) at the start of a call once
`reprobe_seconds` have passed since it failed, or at once when no server is left; one that answers is
redeployed to the current checkpoint before it gets a request.

Logprobs are what the server returns for the sampled tokens: `vllm serve --logprobs-mode
processed_logprobs` makes them the after-temperature/top-p ones the `Generation` contract promises
(the default `raw_logprobs` gives them before temperature: set the flag). `temp_logprobs` as in the
`vllm` backend: the same values when top_p = 1 or greedy; at temperature 1 with top_p < 1, a scoring
request over prompt + completion with vLLM's `prompt_logprobs` (`score_temp_logprobs`), on the server
that sampled the row; else empty.

A server serves one model: the backend remembers, per URL, which checkpoint this process made the
server serve, and a call for another one (the gate's candidate, or the champion after it) first
redeploys every live server (in parallel); a server whose redeploy fails is taken out of rotation, so
no row is ever sent to a server not known to serve the call's checkpoint. The first call of a process
redeploys too (what a server holds after a crash is not known); only with `redeploy: none` is a server
assumed to serve the checkpoint the backend was opened on:
- `redeploy: vllm_reload`: `POST {root}/collective_rpc` with vLLM workers' `reload_weights` and the
  checkpoint path, then `POST {root}/reset_prefix_cache` (vLLM's dev endpoints: start the server with
  `VLLM_SERVER_DEV_MODE=1`; the path must be readable by the server);
- `redeploy: command`: runs `redeploy_command` once per server (an argv list, `{path}` replaced by the
  checkpoint and `{url}` by the server's base URL; no shell; with several servers it must name `{url}`),
  which must return once that server serves the checkpoint;
- `redeploy: none`: a call for another checkpoint is an error (one model, evaluated elsewhere).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rsiflow.configs.schema import server_urls
from rsiflow.models.backend import (
    Generation,
    SamplingParams,
    finish_row,
    interrupts,
    raise_if_interrupted,
    wants_scoring,
)

# Per process, shared by every OpenAIBackend (a deploy step's backend and the next step's see the same servers):
_SERVING: dict[str, str] = {}              # base URL -> the checkpoint that server serves (as far as we know)
_DOWN: dict[str, tuple[float, str]] = {}   # base URL -> (time.monotonic() it was taken out, its last error)
_STATE = threading.Lock()                  # guards _SERVING and _DOWN
_RETRY_STATUS = {502, 503, 504}
PROBE_TIMEOUT = 10.0                       # seconds a re-probe of a server out of rotation may take (at most)
log = logging.getLogger(__name__)


class ServerDown(RuntimeError):
    """One server did not answer (connection error, timeout, 502/503/504) after its retries."""


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _root(url: str) -> str:
    """The server's root (its dev endpoints live there): the base URL without a trailing /v1."""
    return url[:-3] if url.endswith("/v1") else url


class OpenAIBackend:
    """GenerationBackend on OpenAI-compatible completions servers (see the module docstring)."""

    kind = "openai"

    def __init__(self, model_path: str, *, dtype: str = "float32", trust_remote_code: bool = False,
                 base_url: str | None = None, base_urls: list[str] | None = None, model: str | None = None,
                 api_key_env: str | None = None, timeout: float = 600.0, retries: int = 5,
                 backoff_seconds: float = 1.0, max_concurrency: int = 16, score_temp_logprobs: bool | str = "auto",
                 redeploy: str = "none", redeploy_command: list[str] | None = None, reprobe_seconds: float = 60.0):
        import os

        import httpx
        from transformers import AutoTokenizer, GenerationConfig

        if redeploy not in ("none", "vllm_reload", "command"):
            raise ValueError(f"backend.openai.redeploy must be 'none', 'vllm_reload' or 'command', got {redeploy!r}")
        if redeploy == "command" and not redeploy_command:
            raise ValueError("backend.openai.redeploy is 'command' but backend.openai.redeploy_command is empty")
        self.base_urls = server_urls(base_url, base_urls)
        if redeploy == "command" and len(self.base_urls) > 1 and not any("{url}" in p for p in redeploy_command):
            raise ValueError("backend.openai.redeploy_command must contain '{url}' when backend.openai.base_urls "
                             "lists several servers (it is run once per server)")
        self.base_url = self.base_urls[0]
        self.model_path = str(model_path)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff_seconds
        self.max_concurrency, self.reprobe_seconds = max_concurrency, reprobe_seconds
        self.score_temp_logprobs, self.redeploy, self.redeploy_command = score_temp_logprobs, redeploy, redeploy_command
        headers = {}
        if api_key_env and os.environ.get(api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
        # enough pooled connections for every request in flight: waiting on the pool would time out like a server
        n_conn = max_concurrency * len(self.base_urls) + 2 * len(self.base_urls)
        self.http = httpx.Client(timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn))
        self._load = dict.fromkeys(self.base_urls, 0)   # this backend's requests in flight, per server
        self._turn = 0                                   # where the next tie between servers starts
        self._slots = threading.Condition()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        eos = {self.tokenizer.eos_token_id}
        try:
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
            eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        except OSError:
            pass
        self._eos_ids = {e for e in eos if e is not None}
        self._reprobe()   # servers an earlier backend of this process took out may answer again
        self.model = model or self._served_name()
        if redeploy == "none":  # a server rsiflow cannot switch serves, by assumption, what it is opened on
            with _STATE:
                for url in self.base_urls:
                    _SERVING.setdefault(url, self.model_path)

    @classmethod
    def open(cls, model_path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False,
             **options) -> OpenAIBackend:
        return cls(str(model_path), dtype=dtype, trust_remote_code=trust_remote_code, **options)

    @classmethod
    def must_redeploy(cls) -> bool:
        """Always: the servers keep serving what they were last switched to, whichever process switched them."""
        return True

    # -- transport -------------------------------------------------------------------------------------
    def _request(self, url: str, method: str, path: str, body: dict | None = None, *, root: bool = False,
                 tries: int | None = None, timeout: float | None = None):
        """One request to one server, retried on connection errors / timeouts / 502-504; ServerDown after the
        last try (or as soon as another request took the server out of rotation). Other HTTP errors raise
        RuntimeError."""
        import httpx

        full = (_root(url) if root else url) + path
        tries = self.retries + 1 if tries is None else tries
        delay, last = self.backoff, None
        for attempt in range(tries):
            try:
                resp = self.http.request(method, full, json=body, timeout=timeout or self.timeout)
                if resp.status_code in _RETRY_STATUS:
                    last = f"HTTP {resp.status_code}"
                elif resp.status_code >= 400:
                    raise RuntimeError(f"{method} {full}: HTTP {resp.status_code}: {resp.text[:500]}")
                else:
                    return resp.json() if resp.content else None
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < tries:
                if url in _DOWN:   # another request found it dead meanwhile: stop waiting on it
                    break
                time.sleep(delay)
                delay *= 2
        raise ServerDown(f"the generation server at {full} did not answer after {attempt + 1} tries ({last}); "
                         f"is it running? (backend.openai.base_url/base_urls)")

    # -- rotation --------------------------------------------------------------------------------------
    def _take_out(self, url: str, error: str) -> None:
        """Out of rotation for every backend of this process until a re-probe finds it answering; what it serves
        is unknown from now on (unless redeploy is 'none': it can only serve its one model)."""
        with _STATE:
            fresh = url not in _DOWN
            _DOWN[url] = (time.monotonic(), error)
            if self.redeploy != "none":
                _SERVING.pop(url, None)
        with self._slots:
            self._slots.notify_all()
        if fresh:
            left = [u for u in self.base_urls if u not in _DOWN]
            log.warning("openai backend: generation server %s taken out of rotation (%s); %d of %d left: %s",
                        url, error, len(left), len(self.base_urls), ", ".join(left) or "none")

    def _serves(self, url: str, model_path: str) -> bool:
        return url not in _DOWN and _same(_SERVING.get(url), model_path)

    def _no_server_error(self, model_path: str) -> RuntimeError:
        why = []
        for url in self.base_urls:
            if url in _DOWN:
                why.append(f"{url}: {_DOWN[url][1]}")
            else:
                why.append(f"{url}: serves {_SERVING.get(url) or 'an unknown checkpoint'}, not {model_path}")
        return RuntimeError(f"no generation server is left ({len(self.base_urls)} configured in "
                            f"backend.openai.base_url/base_urls): " + "; ".join(why))

    def _reprobe(self) -> None:
        """One quick `GET /models` for each server out of rotation whose `reprobe_seconds` have passed (for every
        one when none is live); one that answers is back in rotation (it is redeployed before use)."""
        now = time.monotonic()
        none_live = all(u in _DOWN for u in self.base_urls)
        due = [u for u in self.base_urls if u in _DOWN and (none_live or now - _DOWN[u][0] >= self.reprobe_seconds)]
        for url in due:
            try:
                self._request(url, "GET", "/models", tries=1, timeout=min(self.timeout, PROBE_TIMEOUT))
            except (ServerDown, RuntimeError) as exc:
                with _STATE:
                    _DOWN[url] = (time.monotonic(), str(exc))
                continue
            with _STATE:
                _DOWN.pop(url, None)
            log.warning("openai backend: generation server %s answers again: back in rotation", url)

    def _served_name(self) -> str:
        """The model name of the first server that answers `GET /models`."""
        for url in self.base_urls:
            if url in _DOWN and len(self.base_urls) > 1:
                continue
            try:
                return self._request(url, "GET", "/models")["data"][0]["id"]
            except ServerDown as exc:
                if len(self.base_urls) == 1:
                    raise
                self._take_out(url, str(exc))
        raise self._no_server_error(self.model_path)

    # -- weights ---------------------------------------------------------------------------------------
    def _switch(self, url: str, model_path: str) -> str:
        """Make one server serve `model_path` (`redeploy` says how); raises if it could not."""
        if self.redeploy == "vllm_reload":
            self._request(url, "POST", "/collective_rpc", {"method": "reload_weights",
                                                           "kwargs": {"weights_path": str(model_path)}}, root=True)
            self._request(url, "POST", "/reset_prefix_cache", root=True)
            return "reloaded weights in place on the server (collective_rpc reload_weights)"
        argv = [part.replace("{path}", str(model_path)).replace("{url}", url) for part in self.redeploy_command]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"backend.openai.redeploy_command {argv} exited {done.returncode}: "
                               f"{(done.stderr or done.stdout)[-500:]}")
        return f"ran {argv}"

    def _ready(self, model_path: str) -> dict[str, str]:
        """Every live server serves `model_path` after this: those that don't are redeployed (in parallel); one
        whose redeploy fails is taken out of rotation. Returns url -> what was done; an error when none is left."""
        live = [u for u in self.base_urls if u not in _DOWN]
        stale = [u for u in live if not _same(_SERVING.get(u), model_path)]
        if stale and self.redeploy == "none":
            url = stale[0]
            raise RuntimeError(f"the server at {url} serves {_SERVING.get(url)}, and this call needs {model_path}: "
                               f"set backend.openai.redeploy ('vllm_reload' or 'command') so rsiflow can switch it")
        actions = dict.fromkeys(live, "already serving")

        def switch(url: str) -> None:
            try:
                actions[url] = self._switch(url, model_path)
            except (ServerDown, RuntimeError) as exc:   # it may still serve the old model: never use it
                actions.pop(url)
                self._take_out(url, f"redeploy of {model_path} failed: {exc}")
                return
            with _STATE:
                _SERVING[url] = str(model_path)

        if stale:
            with ThreadPoolExecutor(max_workers=len(stale)) as pool:
                list(pool.map(switch, stale))
        if not any(self._serves(u, model_path) for u in self.base_urls):
            raise self._no_server_error(model_path)
        return actions

    def serve(self, model_path: str | Path) -> dict:
        """Redeploy: every live server serves `model_path` from now on (`redeploy` says how); a server whose
        redeploy fails is out of rotation."""
        start = time.perf_counter()
        self._reprobe()
        actions = self._ready(str(model_path))
        self.model_path = str(model_path)
        kinds = sorted(set(actions.values()))
        action = kinds[0] if len(kinds) == 1 else "; ".join(kinds)
        if len(actions) > 1:
            action += f" ({len(actions)} servers)"
        return {"kind": self.kind, "action": action, "path": str(model_path), "url": next(iter(actions)),
                "urls": actions, "out_of_rotation": {u: _DOWN[u][1] for u in self.base_urls if u in _DOWN},
                "seconds": round(time.perf_counter() - start, 2)}

    # -- generation ------------------------------------------------------------------------------------
    def generate(self, conversations: list[list[dict]], params: SamplingParams,
                 tools: list[dict] | None = None) -> list[Generation]:
        if not conversations:
            return []
        params.check()
        self._reprobe()
        self._ready(self.model_path)
        texts = self.tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=True,
                                                   tokenize=False)
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        exact = params.temperature == 0 or params.top_p >= 1.0
        score = not exact and params.temperature == 1.0 and wants_scoring(self.score_temp_logprobs, params)
        workers = min(self.max_concurrency * len(self.base_urls), len(prompts))
        start_count = interrupts()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda i: self._row(prompts[i], params, i, exact, score, start_count),
                                 range(len(prompts))))

    def _acquire(self) -> str:
        """A live server serving this backend's checkpoint with a free slot: the fewest in flight, ties in turn.
        Waits while all of them are full; an error naming every server when none is left."""
        with self._slots:
            while True:
                ok = [u for u in self.base_urls if self._serves(u, self.model_path)]
                if not ok:
                    raise self._no_server_error(self.model_path)
                free = [u for u in ok if self._load[u] < self.max_concurrency]
                if free:
                    n = len(self.base_urls)
                    url = min(free, key=lambda u: (self._load[u], (self.base_urls.index(u) - self._turn) % n))
                    self._turn = (self.base_urls.index(url) + 1) % n
                    self._load[url] += 1
                    return url
                self._slots.wait(timeout=1.0)

    def _release(self, url: str) -> None:
        with self._slots:
            self._load[url] -= 1
            self._slots.notify()

    def _row(self, prompt: list[int], params: SamplingParams, i: int, exact: bool, score: bool,
             start_count: int) -> Generation:
        """Row i on some live server; again on another one if that server goes down meanwhile. Once rsiflow is
        stopping (models.backend) no request is sent: the call ends when the requests already sent come back."""
        while True:
            raise_if_interrupted(start_count, "openai")
            url = self._acquire()
            try:
                gen = self._one(url, prompt, params, i, exact, score)
            except ServerDown as exc:
                self._take_out(url, str(exc))
                log.info("openai backend: row %d runs again on another server (%s is out of rotation)", i, url)
                continue
            finally:
                self._release(url)
            gen.extra["server"] = url
            return gen

    def _one(self, url: str, prompt: list[int], params: SamplingParams, i: int, exact: bool,
             score: bool) -> Generation:
        body = {"model": self.model, "prompt": prompt, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p if params.temperature > 0 else 1.0,
                "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False}
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = (params.seed + i) % (2**31)
        choice = self._request(url, "POST", "/completions", body)["choices"][0]
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
            scored = self._request(url, "POST", "/completions", {"model": self.model, "prompt": ids, "max_tokens": 1,
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
