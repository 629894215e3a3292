"""What a method contributes to a round (the seam every method implements).

The distill step builds a `DistillContext`, calls each enabled method's `read` while the store is
open (short reads), then `distill` with the store closed (a method may generate with the champion
for minutes), and writes every method's `Contribution` in one transaction: `examples` rows, the
method's own `tables` and its `metrics` (stored with the step, keyed by method name). The train
step asks each method for its `training_rows` (kinds the trainer knows), its `distill_loss` and its
`policy_loss`;
the gate step, once candidate and champion have played, asks each for its `assess`ment of the candidate
(figures and rows of its tables written in the gate's transaction, e.g. a self-judged win rate against the
base); the report shows each method's `round_metrics` (with its assessment merged in) and `report_section`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _play_quietly(cfg, backend, episodes: list, temperature: float, seed: int, desc: str, make_env=None) -> list:
    """A context's `play` where no step lent one (a method's own test): envs.rollout.play_episodes, no progress."""
    from rsiflow.envs.rollout import play_episodes

    return play_episodes(cfg, backend, episodes, temperature, seed, make_env=make_env)


@dataclass(frozen=True)
class Key:
    """A typed entry of a round's shared state (`DistillContext.state`): one method `provides` it, others
    `consumes` it (used when present) or `requires` it (the config is refused without a provider). The distill
    step runs a provider before its consumers, whatever the order of `distill.methods`."""

    name: str
    doc: str
    needs_consumer: bool = True   # a provider of it with no consumer among the enabled methods is a config error

    def __str__(self) -> str:
        return self.name


# The state keys the built-in methods share (a plugin may define its own Key anywhere).
REWARD_BONUS = Key("reward_bonus", "traj_id -> a reward added to the verifier's for the policy gradient's advantages")
TURN_WEIGHTS = Key("turn_weights", "traj_id -> one training weight per action of a successful trajectory")
POLICY_LOSS = Key("policy_loss", "the round trains a policy-gradient loss on 'pg' rows, which other terms ride on",
                  needs_consumer=False)


@dataclass
class Contribution:
    """What a method's distill gives the round: `examples` rows (example_id, method, source_traj_id, messages,
    weight, meta), rows of its own step-keyed `tables`, and its per-round `metrics` (stored with the step)."""

    examples: list[dict] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class DistillContext:
    """What every method's distill sees: the round, the champion, the round's generated trajectories
    (each with `messages`, the conversation as the model saw it, and `train_from`, where its own turns
    start), the prompt prefix and the env's tool schemas."""

    cfg: Any                      # configs.schema.Config
    round: int
    champion: str
    champion_path: str
    trajectories: list[dict]
    prefix: list[dict]
    tools: list[dict] | None = None
    # (cfg, backend, episodes, temperature, seed, desc, make_env=None) -> episodes: how the step plays episodes
    # (tasks.common.play: the config's env and sampling, with the step's progress bar)
    play: Callable[..., list] = _play_quietly
    state: dict = field(default_factory=dict)   # Key -> value: what the methods run so far provided
    _backend: Any = None

    @property
    def run_id(self) -> str:
        return self.cfg.run.name

    def provide(self, method: Method, key: Key, value: Any) -> None:
        """`method` puts its value of `key` in the round's state (it must list the key in its `provides`)."""
        if key not in method.provides():
            raise ValueError(f"method {method.name!r} provides {key} but does not declare it in `provides`")
        self.state[key] = value

    def get(self, key: Key, default: Any = None) -> Any:
        """The value of `key` a method provided before this one, or `default`."""
        return self.state.get(key, default)

    def backend(self):
        """The champion's generation backend (opened on first use, shared by the methods of the step)."""
        if self._backend is None:
            from rsiflow.models.backend import backend_for

            self._backend = backend_for(self.cfg, self.champion_path)
        return self._backend


@dataclass
class AssessContext:
    """What a method's `assess` sees in the gate step: the round, the trained candidate, the champion it was
    trained from, the run's base model (paths to their checkpoints) and the gate's held-out tasks."""

    cfg: Any                      # configs.schema.Config
    round: int
    candidate: str
    candidate_path: str
    champion: str
    champion_path: str
    base: str
    base_path: str
    heldout: list                 # envs.base.TaskSpec, the gate's sample in order
    play: Callable[..., list] = _play_quietly   # as DistillContext.play

    @property
    def run_id(self) -> str:
        return self.cfg.run.name


def num(value, spec: str) -> str:
    """A figure for a report table: formatted with `spec`, or "-" when missing."""
    return format(value, spec) if value is not None else "-"


def distill_row(example: dict, pair: dict) -> dict:
    """The "distill" training row of `example` (a privileged-teacher example whose meta names its pair): the
    pair's student and teacher conversations, scored on the student's sampled tokens with their sampling logprobs
    (the trainer SRD, X-Tree's context and RSIPO share)."""
    return {"kind": "distill", "example_id": example["example_id"], "weight": example["weight"],
            "train_from": pair["train_from"], "student": pair["student_messages"], "teacher": pair["teacher_messages"],
            "completion_ids": pair["completion_ids"], "sampling_logprobs": pair["sampling_logprobs"],
            "tools": example["meta"].get("tools")}


def term_loss(train_metrics: dict, name: str) -> float | None:
    """A method's mean distillation loss over the round's steps: its own term's when several methods distilled
    (the trainer's `distill_terms`), else the one term's."""
    terms = train_metrics.get("distill_terms")
    return terms[name]["loss_mean"] if terms and name in terms else train_metrics.get("distill_loss_mean")


def teacher_loss(cfg, loss_weight: float, **extra):
    """models.sft_trainer.DistillLoss with this method's `loss_weight` and the divergence settings of distill.srd (one
    set for every privileged-teacher term: SRD, X-Tree's context, RSIPO)."""
    from rsiflow.models.sft_trainer import DistillLoss

    s = cfg.distill.srd
    return DistillLoss(loss_weight=loss_weight, divergence=s.divergence, beta=s.beta, top_k=s.top_k,
                       is_clip=s.is_clip, ema_rate=s.ema_rate, **extra)


class Method:
    """One method's contributions to a round. Subclass it, set `name` (and `tables` if it writes its
    own), implement `distill`; override the rest where the defaults don't fit."""

    name: ClassVar[str]
    # Its options: a configs.section.Section subclass, validated as the config's `distill.<name>` (None: it has none)
    Options: ClassVar[type | None] = None
    tables: ClassVar[tuple[str, ...]] = ()   # step-keyed tables its distill writes besides `examples`
    # Its own tables' schema, as (version, name, sql) numbered from 1 for this method: applied and recorded by
    # (method, version) when a run that enables it is set up (stores/migrations.py, apply_method_migrations). A
    # table a step writes carries (run_id, round, step), so a rerun of the step clears its rows. Add a version for
    # a change; never edit an applied one.
    migrations: ClassVar[tuple[tuple[int, str, str], ...]] = ()
    # Its training reads the sampler's temperature-only logprobs (Generation.temp_logprobs): a backend that must
    # pay for them (vLLM at top_p < 1, `score_temp_logprobs: auto`) computes them only when a method says so.
    uses_temp_logprobs: ClassVar[bool] = False
    # Its examples are verified experience whose training rows stay valid in later rounds (SFT on verified successes,
    # e.g. ExIt): the train step's replay buffer (train.replay) gives its examples of earlier rounds to its
    # `training_rows` with the round's own. False (the default) for rows tied to the policy that sampled them (GRPO's
    # advantages and sampling logprobs, privileged-teacher pairs scored on the champion's own samples).
    replayable: ClassVar[bool] = False

    def __init__(self, cfg):
        self.cfg = cfg

    def provides(self) -> set[Key]:
        """The state keys this method's distill puts in the round's state with these options (`ctx.provide`)."""
        return set()

    def consumes(self) -> set[Key]:
        """Keys this method reads when a method of the round provides them (it runs after that method)."""
        return set()

    def requires(self) -> set[Key]:
        """Keys without which this method can't run: the config is refused unless an enabled method provides them."""
        return set()

    @property
    def options(self):
        """This method's section of the config (`distill.<name>`, an instance of `Options`)."""
        return getattr(self.cfg.distill, self.name)

    def read(self, store, ctx: DistillContext) -> Any:
        """What `distill` needs from the store beyond ctx.trajectories (named Store methods only)."""
        return None

    def distill(self, ctx: DistillContext, inputs: Any) -> Contribution:
        """Turn the round's experience into examples (and rows of the method's tables)."""
        raise NotImplementedError

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """Training rows (models/encoding.py) for this method's examples of the round (and, for a `replayable`
        method, its replayed examples of earlier rounds). Default: each example is an SFT row on its messages (loss
        from meta.train_from on, except the assistant messages listed in meta.untrained: row key `untrained`) with
        its weight."""
        return [{"kind": "sft", "example_id": e["example_id"], "messages": e["messages"], "weight": e["weight"],
                 "train_from": (e["meta"] or {}).get("train_from", 0), "tools": (e["meta"] or {}).get("tools"),
                 "untrained": list((e["meta"] or {}).get("untrained") or [])}
                for e in examples]

    def assess_read(self, store, ctx: AssessContext) -> Any:
        """What `assess` needs from the store (named Store methods only), read by the gate step while the store is
        open; given to `assess` as `inputs`."""
        return None

    def assess(self, ctx: AssessContext, inputs: Any = None) -> Contribution | None:
        """Figures about the round's trained candidate, computed by the gate step with the store closed (it may
        generate with the models): its `metrics` are stored in the gate step's metrics under the method's name and
        merged into the round's figures (report, rounds.metrics); its `tables` rows (declared in `tables`) are
        written in the gate's transaction; no examples. Default: None (nothing to assess)."""
        return None

    def distill_loss(self):
        """The models.sft_trainer.DistillLoss for this method's "distill" rows (None: it emits none)."""
        return None

    def policy_loss(self):
        """The models.grpo_trainer.PolicyLoss for this method's "pg" rows (None: it emits none)."""
        return None

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        """The figures of one round shown in reports and stored in `rounds.metrics[name]`: by default
        what distill recorded."""
        return distill_metrics

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        """Markdown lines for the run report (`rounds`: report rows, each with `round` and this method's
        figures under its name). Default: none."""
        return []
