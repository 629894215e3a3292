"""The `openai` backend: retries and the error naming the URL (fast: a closed port, and a small HTTP server
that answers 503 before it answers); then against a real `vllm serve` of SmolLM2 (slow; skipped with the
reason where vLLM is not installed): greedy outputs and logprobs against the `hf` backend, and a redeploy
that makes the server serve new weights."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.loading import load_model_and_tokenizer, save_checkpoint
from rsiflow.models.openai_backend import OpenAIBackend


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_a_server_that_never_answers_is_an_error_naming_its_url(tiny_path):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(RuntimeError, match=f"{url}/models did not answer after 3 tries"):
        OpenAIBackend(str(tiny_path), base_url=url, retries=2, backoff_seconds=0.01)
    backend = OpenAIBackend(str(tiny_path), base_url=url, model="m", retries=1, backoff_seconds=0.01)
    with pytest.raises(RuntimeError, match=f"{url}/completions did not answer after 2 tries.*base_url"):
        backend.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_new_tokens=4))


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first two completions, then a completion of three tokens (the last one eos)."""
    calls: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append(body)
        if len(type(self).calls) <= 2:
            self.send_response(503)
            self.end_headers()
            return
        reply = {"choices": [{"text": "ab", "token_ids": [65, 66, self.server.eos],
                              "logprobs": {"token_logprobs": [-0.5, -0.25, -0.1]}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_retries_with_backoff_then_cuts_the_row_at_eos(tiny_path):
    _Flaky.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    backend = OpenAIBackend(str(tiny_path), base_url=f"http://127.0.0.1:{server.server_port}/v1", model="m",
                            retries=3, backoff_seconds=0.01)
    server.eos = backend.tokenizer.eos_token_id
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        [gen] = backend.generate([[{"role": "user", "content": "hi"}]],
                                 SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=7))
    finally:
        server.shutdown()
    assert len(_Flaky.calls) == 3
    sent = _Flaky.calls[-1]
    prompt = backend.tokenizer(backend.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                     add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False)["input_ids"]
    assert sent["prompt"] == prompt and sent["seed"] == 7 and sent["max_tokens"] == 4
    assert gen.token_ids == [65, 66] and gen.logprobs == [-0.5, -0.25] and gen.finish_reason == "stop"
    assert gen.temp_logprobs == gen.logprobs  # top_p 1: after temperature = temperature only
    assert gen.prompt_tokens == len(prompt)


def test_redeploy_none_refuses_another_checkpoint(tiny_path, tmp_path, model_cache):
    from rsiflow.models.loading import resolve_base_model

    url = f"http://127.0.0.1:{_closed_port()}/v1"
    backend = OpenAIBackend(str(tiny_path), base_url=url, model="m", retries=0)
    other = resolve_base_model("tiny:1", model_cache)
    with pytest.raises(RuntimeError, match="set backend.openai.redeploy"):
        OpenAIBackend(str(other), base_url=url, model="m", retries=0).generate(
            [[{"role": "user", "content": "hi"}]], SamplingParams(max_new_tokens=2))
    assert backend.serve(tiny_path)["action"] == "already serving"


# -- against a real `vllm serve` --------------------------------------------------------------------------

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France? Answer briefly."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "2 + 2 = ?"}],
]


@pytest.fixture
def served(vllm_server, smollm2_path):
    backend = OpenAIBackend(str(smollm2_path), base_url=vllm_server, redeploy="vllm_reload")
    backend.serve(smollm2_path)
    yield backend
    backend.serve(smollm2_path)


@pytest.mark.slow
def test_server_greedy_and_logprobs_match_the_hf_backend(served, smollm2_path):
    hf = HFBackend(smollm2_path, max_batch_size=8)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ours, theirs = served.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    assert sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs)) >= len(PROMPTS) - 1
    for a, b in zip(ours, theirs):
        assert a.prompt_tokens == b.prompt_tokens
        if a.token_ids == b.token_ids:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 2e-3
    sampled = served.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.8, seed=3))
    again = served.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.8, seed=3))
    assert [g.token_ids for g in sampled] == [g.token_ids for g in again]
    for g in sampled:  # temperature-only logprobs from the scoring request: never above the top-p ones
        assert len(g.temp_logprobs) == len(g.token_ids)
        assert all(t <= lp + 2e-3 for t, lp in zip(g.temp_logprobs, g.logprobs))


@pytest.mark.slow
def test_server_redeploy_serves_the_new_weights(served, smollm2_path, tmp_path):
    model, tok = load_model_and_tokenizer(smollm2_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[-4:]:
            layer.mlp.down_proj.weight.mul_(1 + 0.5 * torch.randn_like(layer.mlp.down_proj.weight))
    candidate = save_checkpoint(model, tok, tmp_path / "candidate")
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    before = served.generate(PROMPTS, params)
    record = served.serve(candidate)
    assert record["action"].startswith("reloaded weights in place") and record["url"] == served.base_url
    after = served.generate(PROMPTS, params)
    want = HFBackend(candidate, max_batch_size=8).generate(PROMPTS, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert sum(a.token_ids == w.token_ids for a, w in zip(after, want)) >= len(PROMPTS) - 1
