"""The environment interface every rsiflow env implements.

An env instance plays one episode at a time: `reset(task)` then `step(action)` until done.
Task sets are deterministic: `sample_tasks(split, n, seed)` always returns the same tasks.
Bad actions (unparseable, not admissible) never raise: they return an observation that says
what was wrong, `info["valid"] = False`, and the episode goes on.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class TaskSpec:
    """One task: enough to rebuild it exactly (the env regenerates its world from `spec`)."""

    env: str
    split: str
    task_type: str
    seed: int
    spec: dict[str, Any] = field(hash=False, compare=False)

    @property
    def task_id(self) -> str:
        payload = json.dumps([self.env, self.split, self.task_type, self.seed, self.spec], sort_keys=True)
        return f"{self.env}-{hashlib.sha1(payload.encode()).hexdigest()[:12]}"

    def to_row(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "env": self.env, "split": self.split,
                "task_type": self.task_type, "seed": self.seed, "spec": json.dumps(self.spec, sort_keys=True)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TaskSpec:
        spec = row["spec"] if isinstance(row["spec"], dict) else json.loads(row["spec"])
        return cls(env=row["env"], split=row["split"], task_type=row["task_type"], seed=int(row["seed"]), spec=spec)


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    success: bool
    # info["valid"]: bool, whether the action was understood and executed;
    # info["feedback"]: "ok" | "unparseable" | "inadmissible" | "failed_precondition" | ...
    info: dict[str, Any] = field(default_factory=dict)


class Env(ABC):
    """One episode at a time: `reset(task)`, then `step(action)` until `done`.

    What a subclass declares besides its methods:

    name              str, a class attribute: the env's name (every TaskSpec.env it makes).
    task_types        tuple of str: the task types `sample_tasks` draws from, round-robin; results are
                      broken down by them. A class attribute, or an instance attribute set in `__init__`
                      where the types depend on the constructor's arguments or the env's data (tooluse's
                      `task_types` kwarg, a folder of game files whose families are only known once it
                      is read). Read it from an instance, never from the class.
    admissible_exact  bool, a class attribute (default True): every action `admissible_actions()` lists
                      is accepted when played. False where the lists over-generate (ScienceWorld's valid
                      actions: some listed ones are refused); the conformance check then only asks that
                      most of them are accepted.
    verifiable        bool, a class attribute (default True): `step` reports whether the task was solved.
                      False for a task family with no verifier (explain): success is never claimed, and
                      methods that need a judgement ask a judge (MASS) instead.
    """

    name: ClassVar[str]
    task_types: tuple[str, ...]
    admissible_exact: ClassVar[bool] = True
    """True: every listed admissible action is accepted when played; False: the lists over-generate."""
    verifiable: ClassVar[bool] = True
    """True: `step`'s success and reward say whether the task was solved; False: no verifier (never a success)."""

    @abstractmethod
    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split` ("train" or "heldout"), deterministic in `seed`, task types round-robin."""

    @abstractmethod
    def reset(self, task: TaskSpec) -> str:
        """Start `task`; return the first observation (it states the goal)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action text. Never raises on bad text: returns feedback instead."""

    def admissible_actions(self) -> list[str] | None:
        """The actions valid now, where the env knows them (None where it doesn't)."""
        return None

    @abstractmethod
    def hindsight(self) -> list[str]:
        """Privileged facts about the current episode (where things were, what was missed)."""

    @abstractmethod
    def canonicalize(self, action: str) -> str:
        """A typed `verb<role,...>` symbol without concrete arguments, e.g. `go<receptacle>`."""

    @abstractmethod
    def instructions(self) -> str:
        """System-prompt text: what the agent is, and the exact action format."""

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        """A few (observation, admissible actions, action) turns of a solved example task, shown to
        the agent as earlier chat turns before its own task (few-shot). Empty where there is none."""
        return []

    def expert_action(self) -> str | None:
        """A scripted expert's next action from the current state, where the env has one."""
        return None

    def solution(self) -> list[str] | None:
        """After `reset(task)`: action texts that, played in order from the task's start, solve the
        current task (the expert's plan); the same list whenever it is called during the episode.
        None where the env has none. The SRD template writer takes its Example from it."""
        return None

    def rules(self) -> list[str]:
        """After `reset(task)`: general rules for tasks like the current one (what an attempt must do
        or avoid), most important first, stated without the task's own statement, its answer or its
        solution's actions: a rule a model can learn before acting, not this task's answer. The SRD
        template writer's Rule line is made of them. Empty where the env states none."""
        return []

    def tools(self) -> list[dict] | None:
        """The tools the agent calls, as JSON schemas in the chat-template convention
        (`{"type": "function", "function": {"name", "description", "parameters"}}`, the `tools=`
        argument of transformers' `apply_chat_template`); None where actions are not tool calls."""
        return None

    def close(self) -> None:  # noqa: B027 (optional to override: most envs hold nothing to release)
        """Release resources (a JVM, a subprocess); may be called twice. Household has none."""


def step_guard(task: TaskSpec | None, done: bool, success: bool) -> StepResult | None:
    """What every env's `step()` checks first: a step before `reset()` is a programming error; a step
    after the episode ended changes nothing and says so. None: go on with the step."""
    if task is None:
        raise RuntimeError("call reset(task) before step()")
    if done:
        return StepResult("The episode is over.", 0.0, True, success, {"valid": False, "feedback": "episode_over"})
    return None


class RepeatedTaskIds(ValueError):
    """One `sample_tasks` call gave two or more tasks with the same task id. The store keys a task's row and its
    trajectories by task id, so a round would count each trajectory of a repeated task once per repeat, and the
    repeats' rollouts would form one group."""


REPEATED_IDS_FIX = ("A run stores a task once per id and would count every trajectory of a repeated task once per "
                    "repeat: give each repeat its own id (TaskSpec.seed is part of the id: set it to the repeat's "
                    "index, or to a seed of its own that the game takes at reset)")


def repeated_ids(tasks: list[TaskSpec]) -> str | None:
    """"gave N tasks with only K distinct task ids; repeated: ID (xC), ..." (the first 5 repeated ids), or None
    where the ids of `tasks` all differ."""
    counts = Counter(t.task_id for t in tasks)
    repeated = [(task_id, count) for task_id, count in counts.items() if count > 1]
    if not repeated:
        return None
    shown = ", ".join(f"{task_id} (x{count})" for task_id, count in repeated[:5])
    more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
    return f"gave {len(tasks)} tasks with only {len(counts)} distinct task ids; repeated: {shown}{more}"


def require_distinct_ids(tasks: list[TaskSpec], call: str) -> None:
    """RepeatedTaskIds where two of `tasks` share a task id, in one line: "`call` gave N tasks with only K distinct
    task ids; repeated: ..." (`repeated_ids`), what a repeat costs and the fix (`REPEATED_IDS_FIX`)."""
    if (summary := repeated_ids(tasks)) is not None:
        raise RepeatedTaskIds(f"{call} {summary}. {REPEATED_IDS_FIX}")


def hashed_split(text: str, heldout_buckets: int = 5) -> str:
    """'heldout' for one in `heldout_buckets` texts (by SHA-1), else 'train': a split no RNG can leak across."""
    return "heldout" if int(hashlib.sha1(text.encode()).hexdigest(), 16) % heldout_buckets == 0 else "train"


def sample_hashed_tasks(env: str, task_types: tuple[str, ...] | list[str], split: str, n: int, seed: int,
                        generate: Callable[[str, random.Random], dict[str, Any]]) -> list[TaskSpec]:
    """`n` tasks of `split`, types round-robin; task i comes from its own RNG seeded by (env, split,
    seed, i) and is redrawn until its spec's "question" hashes into `split` (`hashed_split`)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    tasks = []
    for i in range(n):
        task_type = task_types[i % len(task_types)]
        rng = random.Random(f"{env}:{split}:{seed}:{i}")
        task_seed = rng.randrange(2**31)
        while True:
            spec = generate(task_type, rng)
            if hashed_split(spec["question"]) == split:
                break
        tasks.append(TaskSpec(env=env, split=split, task_type=task_type, seed=task_seed, spec=spec))
    return tasks
