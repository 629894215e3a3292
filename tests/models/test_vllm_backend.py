"""The `vllm` backend on the real vLLM engine (the CPU build here) serving SmolLM2-135M: greedy outputs
against the `hf` backend, logprobs against a forward pass, seeds, stop strings, prefix caching over an
episode batch, and a redeploy that makes the engine serve new weights. One engine for the whole pytest
run (the `vllm_backend` fixture); skipped with the reason where vLLM is not installed."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rsiflow.envs import make_env
from rsiflow.envs.rollout import Episode, run_episodes
from rsiflow.models.backend import SamplingParams
from rsiflow.models.hf_backend import HFBackend
from rsiflow.models.loading import load_model_and_tokenizer, save_checkpoint

pytestmark = pytest.mark.slow


def _conv(text):
    return [{"role": "user", "content": text}]


PROMPTS = [
    _conv("What is the capital of France? Answer briefly."),
    _conv("Write one sentence about the sea."),
    [{"role": "system", "content": "You are terse."}, _conv("Pick a door: 1, 2 or 3.")[0],
     {"role": "assistant", "content": "Door 2."}, _conv("Why?")[0]],
    _conv("List three fruits."),
    _conv("Translate 'good morning' to French."),
    _conv("2 + 2 = ?"),
]
# Rows whose greedy paths may part between two fp32 engines: when the top-2 logits at some step are closer
# than this, a different summation order in the kernels can flip the argmax (measured below, not assumed).
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def hf(smollm2_path):
    return HFBackend(smollm2_path, max_batch_size=8)


@pytest.fixture
def vllm(vllm_backend, smollm2_path):
    """The shared engine, serving SmolLM2 at the start and at the end of each test."""
    vllm_backend.serve(smollm2_path)
    yield vllm_backend
    vllm_backend.serve(smollm2_path)


def _forward_logprobs(hf, conversation, token_ids, temperature=1.0):
    tok = hf.tokenizer
    prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + token_ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1)[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()


def _min_top2_gap(hf, conversation, token_ids) -> float:
    tok = hf.tokenizer
    prompt = tok(tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = hf.model(torch.tensor([prompt + token_ids])).logits[0, len(prompt) - 1:-1]
    top2 = logits.topk(2, -1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def test_greedy_outputs_equal_the_hf_backend(vllm, hf):
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    ours, theirs = vllm.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a.token_ids != b.token_ids]
    for i in differing:  # a difference is allowed only where the greedy path passes a near tie
        assert _min_top2_gap(hf, PROMPTS[i], theirs[i].token_ids) < NEAR_TIE, (ours[i].text, theirs[i].text)
    assert len(differing) <= 1, [(ours[i].text, theirs[i].text) for i in differing]
    for a, b in zip(ours, theirs):
        assert a.prompt_tokens == b.prompt_tokens  # the same templated prompt ids
        if a.token_ids == b.token_ids:
            assert a.text == b.text and a.finish_reason == b.finish_reason


def test_logprobs_equal_a_forward_pass(vllm, hf):
    # greedy: log-softmax of the raw logits; T=0.7, top_p=1: after temperature (logprobs == temp_logprobs)
    for params in (SamplingParams(max_new_tokens=16, temperature=0.0),
                   SamplingParams(max_new_tokens=16, temperature=0.7, top_p=1.0, seed=3)):
        for conv, gen in zip(PROMPTS, vllm.generate(PROMPTS, params)):
            want = _forward_logprobs(hf, conv, gen.token_ids, params.temperature or 1.0)
            assert gen.temp_logprobs == gen.logprobs
            assert max(abs(a - b) for a, b in zip(gen.logprobs, want)) < 2e-3


def test_top_p_logprobs_are_the_sampled_distribution_and_temp_logprobs_the_trainers(vllm, hf):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.8, seed=5)
    for conv, gen in zip(PROMPTS, vllm.generate(PROMPTS, params)):
        want = _forward_logprobs(hf, conv, gen.token_ids)
        assert len(gen.temp_logprobs) == len(gen.token_ids)
        assert max(abs(a - b) for a, b in zip(gen.temp_logprobs, want)) < 2e-3
        # top-p renormalises over the kept tokens: never below the untruncated logprob, at most log(1/0.8) above
        for lp, tlp in zip(gen.logprobs, gen.temp_logprobs):
            assert tlp - 2e-3 <= lp <= tlp + math.log(1 / 0.8) + 2e-3


def test_seeds_repeat_and_48_seeded_requests_run(vllm):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=11)
    first, again = vllm.generate(PROMPTS, params), vllm.generate(PROMPTS, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    other = vllm.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, seed=12))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    many = vllm.generate(PROMPTS * 8, params)
    assert len(many) == 48 and all(g.token_ids for g in many)


def test_seeded_long_prompts_beyond_one_steps_token_budget(vllm):
    """16 seeded ~700-token prompts (a default round's first turn is 48 x ~600): more prefill than one engine
    step's 8,192 tokens (models/vllm_engine.py), which with chunked prefill on killed vLLM's CPU worker (a seeded
    request's generator rewound after a partial prefill). 48 prompts took 223 s of the slow tier on a 2-core AVX2
    CPU; 16 exceed the step's budget just as well."""
    long = [_conv(f"Case {i}. " + "The kitchen has a fridge, a microwave and a sink. " * 60 + "Answer briefly.")
            for i in range(16)]
    rows = vllm.generate(long, SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0, seed=5))
    assert len(rows) == 16 and all(g.token_ids for g in rows) and min(g.prompt_tokens for g in rows) > 600
    assert sum(g.prompt_tokens for g in rows) > 8192


def test_stop_strings_cut_rows_as_every_backend_does(vllm):
    gens = vllm.generate(PROMPTS, SamplingParams(max_new_tokens=40, temperature=0.0, stop=(" ", ".")))
    for g in gens:
        assert " " not in g.text and "." not in g.text
        if g.finish_reason == "stop" and "stop" in g.extra:
            decoded = vllm.tokenizer.decode(g.token_ids)
            assert decoded.startswith(g.text)


def test_episode_batch_reuses_the_prefix_cache(vllm):
    env_factory = lambda: make_env("household")  # noqa: E731
    env = env_factory()
    tasks = env.sample_tasks("train", 4, seed=0)
    env.close()
    episodes = [Episode(traj_id=f"t{i}", task=t, group_id="g", sample_idx=0) for i, t in enumerate(tasks)]
    calls = []

    class Recording:  # the runner's view of the backend, keeping each call's generations
        def generate(self, conversations, params, tools=None):
            gens = vllm.generate(conversations, params, tools=tools)
            calls.append(gens)
            return gens

    run_episodes(env_factory, episodes, Recording(), SamplingParams(max_new_tokens=16, temperature=1.0, seed=1),
                 max_turns=3)
    assert len(calls) >= 2
    later = [g for gens in calls[1:] for g in gens]
    # every later turn's prompt starts with the earlier turn's: most of it comes from the prefix cache
    assert sum(g.extra["cached_tokens"] for g in later) > 0.5 * sum(g.prompt_tokens for g in later)


def test_redeploy_serves_the_new_weights_in_place(vllm, hf, smollm2_path, tmp_path):
    model, tok = load_model_and_tokenizer(smollm2_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers[-4:]:
            layer.mlp.down_proj.weight.mul_(1 + 0.5 * torch.randn_like(layer.mlp.down_proj.weight))
    candidate = save_checkpoint(model, tok, tmp_path / "candidate")
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    before = vllm.generate(PROMPTS, params)
    record = vllm.serve(candidate)
    assert record["action"] == "reloaded weights in place" and record["kind"] == "vllm"
    after = vllm.generate(PROMPTS, params)
    want = HFBackend(candidate, max_batch_size=8).generate(PROMPTS, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    assert sum(a.token_ids == w.token_ids for a, w in zip(after, want)) >= len(PROMPTS) - 1
    assert vllm.serve(candidate)["action"] == "already serving"


def _group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (from /proc)."""
    import os

    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def _wait_gone(pgid: int, seconds: float = 30.0) -> list[int]:
    """The members of the group left after up to `seconds` (a killed process may take seconds to be torn down on a
    busy machine: one beside a test run and a pip install outlived 10 s)."""
    import time

    deadline = time.monotonic() + seconds
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _group_members(pgid)


def test_an_engine_killed_parent_leaves_no_process(smollm2_path, tmp_path):
    """kill -9 of the rsiflow process that started an engine: the engine host and vLLM's engine-core and worker
    processes are gone within seconds (the host's watchdog kills its process group)."""
    import signal
    import subprocess
    import sys

    from tests.conftest import vllm_python

    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from rsiflow.models import vllm_backend as vb\n"
        f"b = vb.VLLMBackend.open({str(smollm2_path)!r}, python={vllm_python()!r}, kv_cache_gib=1, "
        "enforce_eager=True)\n"
        "print(vb._ENGINE.handle.proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    pgid = int(proc.stdout.readline())
    assert len(_group_members(pgid)) >= 2  # the host and vLLM's engine-core (and workers)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone(pgid) == []


def test_an_interrupt_ends_the_call_in_flight_and_the_next_call_starts_a_new_engine(vllm_backend, smollm2_path):
    """Ctrl-C / SIGTERM of rsiflow (`interrupt_calls_in_flight`, from the CLI's signal handler) while a step's thread
    waits for a long generate call: the engine's process group is killed at once and the call raises
    `Interrupted` within seconds (before: the exit waited for the call, up to a minute a turn here); the next
    call starts a new engine and answers as the old one did."""
    import threading
    import time

    from rsiflow.models import vllm_backend as vb
    from rsiflow.models.backend import Interrupted, interrupt_calls_in_flight

    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = vllm_backend.generate(PROMPTS[:2], greedy)
    if not hasattr(vb._ENGINE.handle, "proc"):
        pytest.skip("the engine runs in this process: its calls can't be cut short")
    pgid, old_dir = vb._ENGINE.handle.proc.pid, vb._ENGINE.handle.dir
    out = {}

    def long_call():
        try:
            vllm_backend.generate(PROMPTS * 8, SamplingParams(max_new_tokens=2048, temperature=1.0, seed=0))
        except Exception as e:
            out["error"], out["ended"] = e, time.monotonic()

    worker = threading.Thread(target=long_call)
    worker.start()
    time.sleep(3)
    assert worker.is_alive()
    start = time.monotonic()
    interrupt_calls_in_flight()
    worker.join(30)
    assert not worker.is_alive() and isinstance(out.get("error"), Interrupted), out
    assert out["ended"] - start < 10, out["ended"] - start
    assert _wait_gone(pgid, 30) == []   # gone (how soon the stop returned is checked above)
    after = vllm_backend.generate(PROMPTS[:2], greedy)   # a new engine
    assert vb._ENGINE.handle.proc.pid != pgid
    assert not os.path.exists(old_dir)   # the dead engine's socket and log folder was removed when it was replaced
    assert [g.token_ids for g in after] == [g.token_ids for g in before]


def test_sigterm_delivered_to_another_thread_stops_a_call_in_the_main_thread(vllm_backend, smollm2_path):
    """`rsiflow run` makes its generate calls in the main thread (Prefect runs the step there), and the kernel may
    deliver SIGTERM / Ctrl-C to any thread of the process; Python runs the handler in the main thread only when
    that thread next runs Python code. The call waits in short polls, so the CLI's handler (`flows.cli._stop`)
    runs within a poll: the engine is killed and the stop unwinds in seconds (with one blocking read it waited
    for the whole call: 44 s into a turn here)."""
    import signal
    import threading
    import time

    from rsiflow.flows.cli import Terminated, _stop
    from rsiflow.models import vllm_backend as vb

    vllm_backend.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
    if not hasattr(vb._ENGINE.handle, "proc"):
        pytest.skip("the engine runs in this process: its calls can't be cut short")
    pgid = vb._ENGINE.handle.proc.pid
    previous = signal.signal(signal.SIGTERM, _stop)

    def signal_me():   # a thread of this process receives the signal, as the kernel may choose
        time.sleep(3)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    helper = threading.Thread(target=signal_me, daemon=True)
    try:
        helper.start()
        start = time.monotonic()
        with pytest.raises(Terminated):
            vllm_backend.generate(PROMPTS * 8, SamplingParams(max_new_tokens=2048, temperature=1.0, seed=0))
        took = time.monotonic() - start
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert took < 15, f"the call in the main thread ended {took:.0f} s after it began (signal at 3 s)"
    assert _wait_gone(pgid, 30) == []   # gone (how soon the stop returned is checked above)


def test_a_call_unwound_by_another_handler_is_not_waited_for_at_shutdown(vllm_backend, smollm2_path):
    """During a flow run Prefect's own SIGTERM handler is in place: it raises TerminationSignal in the waiting call
    (rsiflow's handler runs only after, when Prefect re-sends the signal), so the engine is left working on the
    abandoned request. It must not be reused, and shutting it down must kill it, not wait for that request: the
    default run's SIGTERM exit spent 15 s there."""
    import signal
    import threading
    import time

    from rsiflow.models import vllm_backend as vb

    class Unwound(Exception):
        pass

    def raise_unwound(signum, frame):
        raise Unwound

    vllm_backend.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
    if not hasattr(vb._ENGINE.handle, "proc"):
        pytest.skip("the engine runs in this process: its calls can't be cut short")
    handle = vb._ENGINE.handle
    previous = signal.signal(signal.SIGTERM, raise_unwound)
    helper = threading.Thread(target=lambda: (time.sleep(3), signal.pthread_kill(threading.get_ident(),
                                                                                 signal.SIGTERM)), daemon=True)
    try:
        helper.start()
        with pytest.raises(Unwound):
            vllm_backend.generate(PROMPTS * 8, SamplingParams(max_new_tokens=2048, temperature=1.0, seed=0))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handle.proc.poll() is None and not handle.alive()   # still working on the abandoned request: not reused
    start = time.monotonic()
    vb.shutdown_engine()
    assert time.monotonic() - start < 15
    assert _wait_gone(handle.proc.pid, 10) == []


def test_shutdown_during_a_generate_call_leaves_no_process(vllm_backend, smollm2_path):
    """Runs last in this file: stops the shared engine (the next user starts a new one) while a thread waits for
    a long generate call, as when Ctrl-C or SIGTERM stops rsiflow mid-step. The shutdown must not queue its stop
    behind that call (rsiflow hung until the call ended): the whole process group is gone within seconds and the
    waiting call fails saying the engine died."""
    import threading
    import time

    from rsiflow.models import vllm_backend as vb

    vllm_backend.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
    if not hasattr(vb._ENGINE.handle, "proc"):
        pytest.skip("the engine runs in this process: no child process group")
    pgid = vb._ENGINE.handle.proc.pid
    failed = []

    def long_call():
        try:
            vllm_backend.generate(PROMPTS * 8, SamplingParams(max_new_tokens=2048, temperature=1.0, seed=0))
        except RuntimeError as e:
            failed.append(e)

    worker = threading.Thread(target=long_call)
    worker.start()
    time.sleep(3)
    assert worker.is_alive()
    start = time.monotonic()
    vb.shutdown_engine()
    assert time.monotonic() - start < 15
    assert _wait_gone(pgid, 30) == []   # gone (how soon the stop returned is checked above)
    worker.join(30)
    assert not worker.is_alive() and failed and "died" in str(failed[0])
