"""Stopping rsiflow mid-call (Ctrl-C / SIGTERM: `models.backend.interrupt_calls_in_flight`, called by the CLI's
signal handler): a generate call in flight in another thread ends within a second with `Interrupted`, instead of
holding the exit until it would have finished, and a call started afterwards runs as usual (unless a step's
expired deadline holds the stop). hf (both decoding paths) on the tiny model; openai on a fake server (no request is
sent once stopping). vLLM's engine process: tests/models/test_vllm_backend.py (slow tier). The CLI end:
tests/flows/test_signals.py."""

from __future__ import annotations

import threading
import time

import pytest

from rsiflow.models.backend import Interrupted, SamplingParams, interrupt_calls_in_flight
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.openai_backend import OpenAIBackend
from tests.models.test_openai_multi import CHATS, FakeServer

LONG = SamplingParams(max_new_tokens=4000, temperature=1.0, seed=0)


def _call_in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except Exception as e:   # the test looks at what was raised
            out["error"] = e
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _interrupt_and_wait(thread: threading.Thread, out: dict) -> float:
    """Interrupt once the call is under way; seconds from the interrupt until the call ended."""
    time.sleep(1.0)
    assert thread.is_alive(), f"the call ended before the interrupt: {out}"
    start = time.monotonic()
    interrupt_calls_in_flight()
    thread.join(30)
    assert not thread.is_alive(), "the call did not end within 30 s of the interrupt"
    return out["ended"] - start


@pytest.mark.parametrize("kv_reuse", [False, True])
def test_hf_call_in_flight_ends_at_once(tiny_path, kv_reuse):
    backend = HFBackend(tiny_path, max_batch_size=4, kv_reuse=kv_reuse)
    chats = [[{"role": "user", "content": f"count to {i}"}] for i in range(4)]
    thread, out = _call_in_thread(lambda: backend.generate(chats, LONG))
    took = _interrupt_and_wait(thread, out)
    assert isinstance(out.get("error"), Interrupted), out
    assert "rsiflow is stopping" in str(out["error"])
    assert took < 2.0, f"the hf call ended {took:.1f} s after the interrupt"
    # A call started after the interrupt is not affected.
    gens = backend.generate(chats, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert len(gens) == 4 and all(g.token_ids for g in gens)


def test_openai_call_sends_no_request_once_stopping(tiny_path):
    server = FakeServer(delay=0.3)
    try:
        backend = OpenAIBackend(str(tiny_path), base_urls=[server.url], retries=2, backoff_seconds=0.01,
                                max_concurrency=2, redeploy="vllm_reload")
        seeded = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1.0, seed=11)
        thread, out = _call_in_thread(lambda: backend.generate(CHATS, seeded))   # 24 rows, 2 at a time: ~4 s
        took = _interrupt_and_wait(thread, out)
        assert isinstance(out.get("error"), Interrupted), out
        assert took < 1.5, f"the openai call ended {took:.1f} s after the interrupt"   # the requests in flight
        sent = server.completions
        assert 0 < sent < len(CHATS), sent
        time.sleep(0.5)
        assert server.completions == sent   # nothing sent after it
        assert len(backend.generate(CHATS[:3], seeded)) == 3
    finally:
        server.stop()


def test_a_step_deadline_that_passes_between_calls_stops_the_next_call(tiny_path):
    """The deadline may pass while a step loads a model or writes rows, with no call in flight: the step's next call
    ends at once (so the step stops), and calls after the step run as usual."""
    from rsiflow.flows.round import StepTimedOut, step_deadline

    backend = HFBackend(tiny_path, max_batch_size=4)
    chats = [[{"role": "user", "content": "count to 3"}]]
    with pytest.raises(StepTimedOut, match=r"step generate ran past prefect.step_timeout_s = 0.2 s .*\(Interrupted"):
        with step_deadline(0.2, "generate"):
            time.sleep(1.0)   # between calls when the deadline passes
            backend.generate(chats, LONG)
    gens = backend.generate(chats, SamplingParams(max_new_tokens=5, temperature=0.0))
    assert gens[0].token_ids
