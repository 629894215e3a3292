"""HFBackend on the tiny model: batching/padding can't change results, logprobs are the sampling ones,
stop strings and lengths end rows as documented."""

import pytest
import torch

from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend, clear_backends, get_backend
from rsiflow.models.loading import resolve_base_model

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def _conv(text):
    return [{"role": "user", "content": text}]


CONVERSATIONS = [
    _conv("hi"),
    _conv("Describe the rules of chess in detail, then explain why the Sicilian defence is popular. " * 3),
    [{"role": "system", "content": "You are terse."}, _conv("Pick a door.")[0],
     {"role": "assistant", "content": "Door 2."}, _conv("Why?")[0]],
    _conv("x"),
    _conv("What is the capital of France? Answer briefly."),
]


@pytest.fixture(scope="module")
def backend(tiny_path):
    return HFBackend(tiny_path, max_batch_size=8)


def _recompute_logprobs(backend, conversation, token_ids, temperature=1.0):
    """Log-probabilities of token_ids after the templated prompt, by one plain forward pass (no padding)."""
    tok = backend.tokenizer
    prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = backend.model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)


def test_batched_greedy_equals_one_at_a_time_in_input_order(backend):
    batched = backend.generate(CONVERSATIONS, GREEDY)
    alone = [backend.generate([c], GREEDY)[0] for c in CONVERSATIONS]
    assert [g.text for g in batched] == [g.text for g in alone]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    assert len({g.text for g in batched}) > 1  # the outputs depend on the prompt, so order is really checked
    for a, b in zip(batched, alone):
        assert a.prompt_tokens == b.prompt_tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_chunking_keeps_input_order(backend, monkeypatch):
    whole = backend.generate(CONVERSATIONS, GREEDY)
    monkeypatch.setattr(backend, "max_batch_size", 2)
    chunked = backend.generate(CONVERSATIONS, GREEDY)
    assert [g.token_ids for g in chunked] == [g.token_ids for g in whole]


def test_prompt_tokens_count_the_templated_prompt(backend):
    tok = backend.tokenizer
    out = backend.generate(CONVERSATIONS, GREEDY)
    for conversation, g in zip(CONVERSATIONS, out):
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert g.prompt_tokens == len(tok(text, add_special_tokens=False)["input_ids"])


def test_greedy_logprobs_match_a_forward_pass(backend):
    for conversation, g in zip(CONVERSATIONS, backend.generate(CONVERSATIONS, GREEDY)):
        expected = _recompute_logprobs(backend, conversation, g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)


def test_sampling_logprobs_are_those_of_the_warped_distribution(backend):
    out = backend.generate(CONVERSATIONS, SamplingParams(max_new_tokens=10, temperature=0.7, seed=1))
    for conversation, g in zip(CONVERSATIONS, out):
        assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)
        expected = _recompute_logprobs(backend, conversation, g.token_ids, temperature=0.7)
        assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)
    # top-p renormalises over the kept tokens: each sampled token gets at least its untruncated logprob
    out = backend.generate(CONVERSATIONS, SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.5, seed=1))
    for conversation, g in zip(CONVERSATIONS, out):
        untruncated = _recompute_logprobs(backend, conversation, g.token_ids, temperature=0.7)
        assert all(lp <= 0 for lp in g.logprobs)
        assert (torch.tensor(g.logprobs) >= untruncated - 1e-4).all()
        assert (torch.tensor(g.logprobs) > untruncated + 1e-3).any()


def test_same_seed_reproduces_samples(backend):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    first = backend.generate(CONVERSATIONS, params)
    backend.generate(CONVERSATIONS, SamplingParams(max_new_tokens=3))  # an unseeded call in between
    second = backend.generate(CONVERSATIONS, params)
    other = backend.generate(CONVERSATIONS, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=8))
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert [g.logprobs for g in first] == [g.logprobs for g in second]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_unseeded_calls_differ(backend):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    assert backend.generate(CONVERSATIONS, params)[0].token_ids != backend.generate(CONVERSATIONS, params)[0].token_ids


def test_max_new_tokens_ends_with_length(backend):
    for g in backend.generate(CONVERSATIONS, SamplingParams(max_new_tokens=5, temperature=0.0)):
        assert g.finish_reason == "length"
        assert len(g.token_ids) == len(g.logprobs) == 5
        assert g.text == backend.tokenizer.decode(g.token_ids)


def _token_starts(backend, token_ids):
    """Character offset where each token's text starts in the decoded completion."""
    return [len(backend.tokenizer.decode(token_ids[:i])) for i in range(len(token_ids))]


def test_stop_string_on_a_token_boundary_cuts_text_and_tokens(backend):
    conversation = [CONVERSATIONS[4]]
    full = backend.generate(conversation, SamplingParams(max_new_tokens=20, temperature=0.0))[0]
    start = _token_starts(backend, full.token_ids)[6]
    stop = full.text[start:start + 3]
    assert full.text.find(stop) == start
    out = backend.generate(conversation,
                           SamplingParams(max_new_tokens=20, temperature=0.0, stop=("@@never@@", stop)))[0]
    assert out.finish_reason == "stop" and out.extra["stop"] == stop
    assert out.text == full.text[:start]
    assert out.token_ids == full.token_ids[:6]  # the stop string's tokens are dropped
    assert out.logprobs == pytest.approx(full.logprobs[:6], abs=1e-5)


def test_stop_string_inside_a_token_keeps_that_token(backend):
    conversation = [CONVERSATIONS[4]]
    full = backend.generate(conversation, SamplingParams(max_new_tokens=20, temperature=0.0))[0]
    starts = _token_starts(backend, full.token_ids) + [len(full.text)]
    i = next(i for i in range(2, len(full.token_ids)) if starts[i + 1] - starts[i] >= 3
             and full.text.find(full.text[starts[i] + 1:starts[i] + 3]) == starts[i] + 1)
    stop = full.text[starts[i] + 1:starts[i] + 3]
    out = backend.generate(conversation, SamplingParams(max_new_tokens=20, temperature=0.0, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:starts[i] + 1]
    assert out.token_ids == full.token_ids[:i + 1]  # the straddling token is kept: its first char is in text
    assert backend.tokenizer.decode(out.token_ids).startswith(out.text)


def test_eos_ends_a_row_with_stop_and_is_not_kept(backend):
    eos = backend.tokenizer.eos_token_id
    g = backend._finish_row([11, 12, eos, eos, eos], [-1.0, -2.0, -3.0, -4.0, -5.0], [-0.5, -1.5, -2.5, -3.5, -4.5],
                            (), prompt_tokens=9)
    assert (g.token_ids, g.logprobs, g.finish_reason, g.prompt_tokens) == ([11, 12], [-1.0, -2.0], "stop", 9)
    assert g.temp_logprobs == [-0.5, -1.5]
    assert g.text == backend.tokenizer.decode([11, 12])


def test_empty_request_list(backend):
    assert backend.generate([], GREEDY) == []


@pytest.mark.parametrize("bad", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}])
def test_invalid_sampling_params_are_refused(backend, bad):
    with pytest.raises(ValueError, match="invalid sampling params"):
        backend.generate(CONVERSATIONS[:1], SamplingParams(**bad))


def test_serve_redeploys_the_new_checkpoint_and_says_what_it_did(tiny_path, model_cache):
    backend = HFBackend(tiny_path)
    before = backend.generate(CONVERSATIONS[:2], GREEDY)
    other = resolve_base_model("tiny:1", model_cache)
    record = backend.serve(other)
    assert record["kind"] == "hf" and record["action"] == "reloaded weights in process" and record["path"] == str(other)
    assert backend.model_path == str(other)
    assert [g.token_ids for g in backend.generate(CONVERSATIONS[:2], GREEDY)] != [g.token_ids for g in before]
    assert backend.serve(other)["action"] == "already serving"


def test_get_backend_reuses_a_loaded_model_and_finds_a_redeployed_one(tiny_path, model_cache):
    clear_backends()
    try:
        a = get_backend(tiny_path, max_batch_size=4)
        assert get_backend(str(tiny_path), max_batch_size=4) is a
        other = resolve_base_model("tiny:1", model_cache)
        b = get_backend(other, max_batch_size=4)
        assert b is not a
        a.serve(other)  # the deploy step: the old champion's backend now serves the new one
        assert get_backend(other, max_batch_size=4) in (a, b)
        assert get_backend(tiny_path, max_batch_size=4) not in (a, b)  # nobody serves it any more: loaded anew
    finally:
        clear_backends()


def test_open_backend_by_kind(tiny_path):
    from rsiflow.configs.registry import BACKENDS
    from rsiflow.models.backend import open_backend

    assert "hf" in BACKENDS
    clear_backends()
    try:
        b = open_backend("hf", tiny_path, max_batch_size=3, kv_reuse=False)
        assert b.kind == "hf" and b.max_batch_size == 3 and b.generate(CONVERSATIONS[:1], GREEDY)[0].token_ids
        with pytest.raises(ValueError, match="unknown backend kind 'nope'.*hf"):
            open_backend("nope", tiny_path)
    finally:
        clear_backends()


def test_tools_reach_the_chat_template(tiny_path):
    """The env's tool schemas go to the chat template (a template that renders them shows them in the prompt)."""
    backend = HFBackend(tiny_path)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "price of an item",
                                               "parameters": {"type": "object", "properties": {}}}}]
    plain = backend.generate(CONVERSATIONS[:1], GREEDY)[0].prompt_tokens
    assert backend.generate(CONVERSATIONS[:1], GREEDY, tools=tools)[0].prompt_tokens == plain  # SmolLM2's ignores them
    backend.tokenizer.chat_template = ("{% if tools %}TOOLS: {{ tools | tojson }}\n{% endif %}"
                                       + backend.tokenizer.chat_template)
    assert backend.generate(CONVERSATIONS[:1], GREEDY, tools=tools)[0].prompt_tokens > plain + 10


def test_temperature_only_logprobs_differ_from_sampling_ones_only_under_top_p(backend):
    """temp_logprobs are log-softmax(logits / T) at the sampled token: equal to the sampling logprobs without top-p
    truncation, and no larger than them with it (truncation renormalises the kept mass upwards)."""
    for params, equal in ((SamplingParams(max_new_tokens=6, temperature=0.7, top_p=1.0, seed=1), True),
                          (SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.5, seed=1), False)):
        for g in backend.generate(CONVERSATIONS[:3], params):
            assert len(g.temp_logprobs) == len(g.logprobs) == len(g.token_ids)
            if equal:
                assert g.temp_logprobs == pytest.approx(g.logprobs, abs=1e-5)
            else:
                assert all(t <= s + 1e-6 for t, s in zip(g.temp_logprobs, g.logprobs))
