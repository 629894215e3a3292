"""What every step shares: the backend by kind with its own options, trust_remote_code reaching the loaders,
the prompt setup (prefix and tools) used for generation and training alike."""

import pytest

from rsiflow.configs.loader import load_config
from tests.conftest import TINY, tiny_overrides


def spy_on_loader(monkeypatch, module) -> dict:
    """Record the trust_remote_code that `module` passes to load_model_and_tokenizer (the real load still runs)."""
    seen, real = {}, module.load_model_and_tokenizer

    def spy(path, dtype="float32", trust_remote_code=False):
        seen["trust_remote_code"] = trust_remote_code
        return real(path, dtype=dtype)

    monkeypatch.setattr(module, "load_model_and_tokenizer", spy)
    return seen


def test_backend_for_opens_the_configured_kind_with_its_options_and_trust_remote_code(monkeypatch, tiny_path):
    import rsiflow.models.hf_backend as hb
    from rsiflow.models.backend import backend_for

    seen = spy_on_loader(monkeypatch, hb)
    hb.clear_backends()
    try:
        cfg = load_config([TINY], ["model.trust_remote_code=true", "backend.hf.max_batch_size=3"])
        backend = backend_for(cfg, str(tiny_path))
        assert backend.kind == "hf" and backend.max_batch_size == 3 and backend.kv_reuse is True
        assert seen == {"trust_remote_code": True}
    finally:
        hb.clear_backends()


def test_the_trainer_passes_trust_remote_code(monkeypatch, tiny_path, tmp_path):
    import rsiflow.models.trainer as trainer
    seen = spy_on_loader(monkeypatch, trainer)
    cfg = load_config([TINY])
    trainer.train_candidate(tiny_path, [], tmp_path / "c", cfg.train, trust_remote_code=True)
    assert seen == {"trust_remote_code": True}


@pytest.mark.parametrize("env,has_tools", [("household", False), ("tooluse", True)])
def test_prompt_setup_gives_the_prefix_and_the_env_tools(env, has_tools):
    from rsiflow.envs.rollout import prompt_setup

    prefix, tools = prompt_setup(load_config([TINY], [f"env.name={env}", "env.kwargs={}"]))
    assert prefix[0]["role"] == "system" and (tools is not None) == has_tools


def test_training_encodes_a_row_with_the_tools_generation_saw(tiny_path):
    from transformers import AutoTokenizer

    from rsiflow.models.encoding import encode_rows

    tok = AutoTokenizer.from_pretrained(tiny_path)
    tok.chat_template = "{% if tools %}TOOLS: {{ tools | tojson }}\\n{% endif %}" + tok.chat_template
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    msgs = [{"role": "user", "content": "price?"}, {"role": "assistant", "content": 'lookup(item="a")'}]
    (plain,), _ = encode_rows(tok, [{"kind": "sft", "messages": msgs, "example_id": "a"}], 512)
    (with_tools,), _ = encode_rows(tok, [{"kind": "sft", "messages": msgs, "example_id": "a", "tools": tools}], 512)
    assert len(with_tools["input_ids"]) > len(plain["input_ids"])

    def n_labels(row):
        return sum(x != -100 for x in row["labels"])

    assert n_labels(with_tools) == n_labels(plain) > 0  # the same action tokens are trained


def test_temperature_only_logprobs_are_asked_for_only_when_a_method_reads_them():
    """`score_temp_logprobs: auto` costs a full prefill per row on vLLM: the generate step asks for them only
    where GRPO's (or RSIPO's) correction needs them; an explicit option wins."""
    from rsiflow.methods import needs_temp_logprobs
    from rsiflow.models.backend import SamplingParams, wants_scoring

    def needs(methods):
        return needs_temp_logprobs(load_config([TINY], [f"distill.methods={methods}"]))

    assert not needs("[exit]") and not needs("[exit,srd]") and needs("[exit,grpo]") and needs("[grpo,rsipo]")
    asked, not_asked = SamplingParams(temp_logprobs=True), SamplingParams(temp_logprobs=False)
    assert wants_scoring("auto", asked) and not wants_scoring("auto", not_asked)
    assert wants_scoring(True, not_asked) and not wants_scoring(False, asked)


def test_redeploy_loads_nothing_in_a_process_that_holds_no_model(tiny_path, model_cache, tmp_path):
    """A deploy step in a fresh process (a pool worker, a resume after a kill) records the switch without loading
    the previous champion only to replace its weights; where a model is held, that one is switched."""
    from rsiflow.models.backend import backend_for
    from rsiflow.models.hf_backend import HFBackend, clear_backends
    from rsiflow.models.loading import resolve_base_model
    from rsiflow.tasks.common import redeploy_backend

    cfg = load_config([TINY], tiny_overrides(tmp_path))
    other = resolve_base_model("tiny:1", model_cache)
    clear_backends()
    try:
        assert not HFBackend.must_redeploy()
        record = redeploy_backend(cfg, str(tiny_path), str(other))
        assert record == {"kind": "hf", "action": "nothing loaded in this process: the next step loads it",
                          "path": str(other), "seconds": 0.0}
        assert not HFBackend.must_redeploy()
        held = backend_for(cfg, str(tiny_path))
        assert redeploy_backend(cfg, str(tiny_path), str(other))["action"] == "reloaded weights in process"
        assert held.model_path == str(other)
    finally:
        clear_backends()


def test_a_backend_without_must_redeploy_is_always_opened_and_switched(monkeypatch, tmp_path):
    from rsiflow.tasks.common import redeploy_backend

    class Plain:   # a user's backend with only open/generate/serve
        def serve(self, path):
            return {"kind": "plain", "action": "switched", "path": path, "seconds": 0.0}

    monkeypatch.setattr("rsiflow.models.backend.backend_class", lambda kind: Plain)
    monkeypatch.setattr("rsiflow.tasks.common.backend_for", lambda cfg, path: Plain())
    cfg = load_config([TINY], tiny_overrides(tmp_path))
    assert redeploy_backend(cfg, "old", "new") == {"kind": "plain", "action": "switched", "path": "new",
                                                   "seconds": 0.0}


@pytest.mark.parametrize("gate_dtype,expected", [("trainer", "float32"), ("sampler", "bfloat16")])
def test_rollouts_sample_in_the_backend_dtype_and_evaluation_in_the_trainer_dtype(tiny_path, gate_dtype, expected):
    import torch

    import rsiflow.models.hf_backend as hb
    from rsiflow.models.backend import backend_for

    hb.clear_backends()
    try:
        cfg = load_config([TINY], ["backend.hf.dtype=bfloat16", f"gate.dtype={gate_dtype}"])
        assert cfg.model.dtype == "float32"
        rollouts = backend_for(cfg, str(tiny_path))
        assert next(rollouts.model.parameters()).dtype == torch.bfloat16
        evaluation = backend_for(cfg, str(tiny_path), evaluation=True)
        assert next(evaluation.model.parameters()).dtype == getattr(torch, expected)
    finally:
        hb.clear_backends()


@pytest.mark.parametrize("native,model_dtype,expected", [(True, "float32", "bfloat16"), (False, "float32", "float32"),
                                                        (True, "float16", "float16"), (False, "bfloat16", "bfloat16")])
def test_auto_samples_in_bf16_only_where_the_machine_runs_it_natively(monkeypatch, native, model_dtype, expected):
    from rsiflow.models import backend

    monkeypatch.setattr(backend, "native_bf16", lambda: native)
    assert backend.auto_sampling_dtype(model_dtype) == expected


@pytest.mark.parametrize("native", [True, False])
def test_auto_rollouts_and_a_trainer_dtype_gate(monkeypatch, tiny_path, native):
    import torch

    import rsiflow.models.hf_backend as hb
    from rsiflow.models import backend

    monkeypatch.setattr(backend, "native_bf16", lambda: native)
    hb.clear_backends()
    try:
        cfg = load_config([TINY], ["backend.hf.dtype=auto"])
        rollouts = backend.backend_for(cfg, str(tiny_path))
        assert next(rollouts.model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
        evaluation = backend.backend_for(cfg, str(tiny_path), evaluation=True)
        assert next(evaluation.model.parameters()).dtype == torch.float32
    finally:
        hb.clear_backends()


@pytest.mark.parametrize("native", [True, False])
def test_bf16_asked_for_on_a_cpu_that_emulates_it_is_warned_about_once(monkeypatch, caplog, tiny_path, native):
    import rsiflow.models.hf_backend as hb

    monkeypatch.setattr(hb, "native_bf16", lambda: native)
    monkeypatch.setattr(hb, "_SLOW_BF16_SAID", [])
    with caplog.at_level("WARNING", logger=hb.__name__):
        for dtype in ("bfloat16", "bfloat16", "float32"):
            hb.HFBackend(tiny_path, dtype=dtype, device="cpu")
    said = [r.getMessage() for r in caplog.records if "without bf16 matrix instructions" in r.getMessage()]
    assert len(said) == (0 if native else 1)


def test_the_bf16_probe_agrees_with_the_cpu_flags():
    from pathlib import Path

    import torch

    from rsiflow.models.backend import native_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if torch.cuda.is_available() or not cpuinfo.exists():
        pytest.skip("checks the CPU probe against /proc/cpuinfo on a machine without a GPU")
    flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for f in line.split()}
    assert native_bf16() == bool(flags & {"avx512_bf16", "amx_tile"})


def test_the_gate_plays_with_the_evaluation_backend(monkeypatch, tiny_path):
    import rsiflow.tasks.gate as gate
    from rsiflow.envs import make_env

    asked = []

    def spy(cfg, path, evaluation=False):
        asked.append(evaluation)
        raise RuntimeError("stop here")

    monkeypatch.setattr(gate, "backend_for", spy)
    cfg = load_config([TINY], ["backend.hf.dtype=bfloat16"])
    task = make_env(cfg.env.name, **cfg.env.kwargs).sample_tasks("heldout", 1, 0)[0]
    plays = gate.HeldoutPlays(cfg, [task], {"m": str(tiny_path)}, {"m": "m"}, "p", 0, {"m": 1}, 0, "gate")
    with pytest.raises(RuntimeError, match="stop here"):
        plays.play_first(1)
    assert asked == [True]
