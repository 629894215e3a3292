"""ScienceWorld (Wang et al., 2022) behind the rsiflow env interface.

Needs the optional `scienceworld` package (`pip install -e ".[scienceworld]"`, version 1.2.3) and a
Java runtime (8+, e.g. OpenJDK 17) on PATH; constructing the env without them raises a clear error.

Tasks and splits: the task types are ScienceWorld's task names (30; `task_names` narrows them) and
a task is (task name, variation, simplification). ScienceWorld's own variation splits are kept:
rsiflow's "train" split samples ScienceWorld's train variations, and "heldout" samples its dev
variations (`heldout="dev"`, the default, for gating during a run) or its test variations
(`heldout="test"`, for a final report). Sampling is deterministic in the seed; task names go
round-robin.

Episodes: `reset` loads the task (simplifications default to "easy": teleport, open doors, ...)
and returns the task description and the first "look around". Actions are ScienceWorld's own
text commands. The reply's first line is sent (control characters removed, at most 200
characters); an empty or over-long reply, and the "reset task" meta-action, are refused without
reaching the simulator. ScienceWorld's "No known action matches that input." is reported as
`feedback="unparseable"`; an ambiguous command is resolved to ScienceWorld's first reading
(as common agent harnesses do; the gold path's own choices where it names them) and said so.
Reward is the change in ScienceWorld's score / 100, so an episode's rewards sum to its final
score / 100; success is a score of 100. The episode
ends at success, at ScienceWorld's own failure (score < 0), or after `max_steps` actions.

Admissible actions are ScienceWorld's valid action-object combinations (often hundreds: keep
`env.show_admissible: false` in the config). They over-generate: about one random listed action
in ten is refused when played ("No known action matches that input."; reported here as
`feedback="inadmissible"`). Observations are normalized (`normalize_observation`): ScienceWorld
lists a room's contents in an order that varies between loads of the same task. `expert_action()`,
`solution()` and `hindsight()` use the gold action sequence ScienceWorld generates for every task:
the expert follows it from where the agent's on-path actions left it (an off-path action that
changed the world may derail it); `solution()` is the whole of it, less its ambiguity choices.
`rules()` are the task family's recipe and two rules of every task (FAMILY_RULES).

JVMs: every ScienceWorld simulator is its own JVM (~200 MB fresh, ~1 s to start; its heap is
capped by `jvm_heap`, default 1 GB: uncapped, one grew to 4.5 GB over a few thousand steps).
All env instances of a process share a pool of at most `max_jvms` simulators; an instance
leases one at `reset`, and when more episodes are live than simulators (lockstep batches), a
simulator is taken over by another episode and the first one is restored on its next step by
reloading its task and replaying its actions (deterministic, ~0.3 s + ~30 ms per action). When
the last live instance is closed, the pool shuts every JVM down; an atexit hook does the same at
interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import re
import shutil
import threading
import time
from typing import Any

from rsiflow.envs.base import SPLITS, Env, StepResult, TaskSpec, step_guard

TASK_NAMES = (
    "boil", "change-the-state-of-matter-of", "chemistry-mix", "chemistry-mix-paint-secondary-color",
    "chemistry-mix-paint-tertiary-color", "find-animal", "find-living-thing", "find-non-living-thing",
    "find-plant", "freeze", "grow-fruit", "grow-plant", "identify-life-stages-1", "identify-life-stages-2",
    "inclined-plane-determine-angle", "inclined-plane-friction-named-surfaces",
    "inclined-plane-friction-unnamed-surfaces", "lifespan-longest-lived",
    "lifespan-longest-lived-then-shortest-lived", "lifespan-shortest-lived",
    "measure-melting-point-known-substance", "measure-melting-point-unknown-substance", "melt",
    "mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant", "power-component",
    "power-component-renewable-vs-nonrenewable-energy", "test-conductivity",
    "test-conductivity-of-unknown-substances", "use-thermometer",
)
# Tasks with short gold paths (5-16 actions with "easy"): a subset small models can reach.
SHORT_TASKS = ("find-non-living-thing", "find-living-thing", "find-plant", "find-animal",
               "lifespan-longest-lived", "lifespan-shortest-lived", "power-component")
HELDOUT_SOURCES = ("dev", "test")
MAX_ACTION_CHARS = 200
UNKNOWN_ACTION = "No known action matches that input."
BLOCKED = {"reset task": "The 'reset task' command is disabled here; the episode goes on."}
# Task-family rules (`rules()`): the family's recipe, keyed by task-name prefixes; no variation's objects.
FAMILY_RULES = (
    (("find-",), "Find a thing of the kind the task names (look around in each room), focus on it, then move "
                 "it to the box the task names."),
    (("lifespan-",), "Go to where the animals are, look around, and focus on the animals in the order the task "
                     "asks, by what you know of their life spans."),
    (("boil", "melt", "freeze", "change-the-state-of-matter-of"),
     "Focus on the substance first, then put it in a container and heat it (stove, oven) or cool it (freezer) "
     "until its state changes; a thermometer shows how far it has got."),
    (("chemistry-mix",), "Find the ingredients (and a recipe where the task mentions one), put them in one "
                         "container, mix it, then focus on the result."),
    (("grow-",), "Put seeds in flower pots with soil, water them, and wait for the plants to grow; focus on what "
                 "the task names."),
    (("identify-life-stages-",), "Focus on the life stages from earliest to latest; wait for the organism to "
                                 "grow where a stage is not there yet."),
    (("inclined-plane-",), "Time an object sliding down each inclined plane with the stopwatch, compare the "
                           "times, then focus on the plane the task asks for."),
    (("measure-melting-point-", "use-thermometer"),
     "Focus on the thermometer first, then the substance; measure its temperature with the thermometer, then "
     "act on the box the task's condition names."),
    (("mendelian-genetics-",), "Plant seeds of both parents, water them, let them pollinate and look at the "
                               "offspring's traits before choosing the box."),
    (("power-component",), "Focus on the light bulb, then connect a power source's anode and cathode to the "
                           "bulb's terminals with wires, closing the circuit."),
    (("test-conductivity",), "Focus on the object, put it in a circuit with a battery, wires and a light bulb, "
                             "and place it in the box the bulb's result names."),
)

# Canonical symbols: ScienceWorld's action templates -> verb<roles>.
_TEMPLATES = [(re.compile(p), s) for p, s in [
    (r"look around", "look_around<>"), (r"look at .+", "look_at<object>"), (r"look in .+", "look_in<container>"),
    (r"(?:go to|go) .+", "go<location>"), (r"teleport to .+", "teleport<location>"),
    (r"pick up .+", "pick_up<object>"), (r"put down .+", "put_down<object>"),
    (r"move .+ to .+", "move<object,container>"), (r"pour .+ (?:in|into) .+", "pour<object,container>"),
    (r"dunk .+ (?:in|into) .+", "dunk<object,container>"), (r"use .+ on .+", "use<tool,object>"),
    (r"use .+", "use<tool>"), (r"connect .+ to .+", "connect<object,object>"), (r"disconnect .+", "disconnect<object>"),
    (r"open .+", "open<object>"), (r"close .+", "close<object>"), (r"activate .+", "activate<device>"),
    (r"deactivate .+", "deactivate<device>"), (r"focus on .+", "focus<object>"), (r"mix .+", "mix<container>"),
    (r"read .+", "read<object>"), (r"eat .+", "eat<object>"), (r"flush .+", "flush<object>"),
    (r"inventory", "inventory<>"), (r"task", "task<>"), (r"wait1?", "wait<>"), (r"\d{1,2}", "choose<option>"),
]]


def _require_runtime() -> Any:
    """The scienceworld package, or an error saying what is missing."""
    try:
        import scienceworld
    except ImportError as exc:
        raise RuntimeError("the scienceworld env needs the optional 'scienceworld' package: "
                           "pip install -e '.[scienceworld]' (or pip install scienceworld==1.2.3)") from exc
    if shutil.which("java") is None:
        raise RuntimeError("the scienceworld env needs a Java runtime (8 or newer, e.g. OpenJDK 17) on PATH; "
                           "none was found")
    return scienceworld


def runtime_missing() -> str | None:
    """Why ScienceWorld can't run here (for skipping tests), or None when it can."""
    try:
        _require_runtime()
    except RuntimeError as exc:
        return str(exc)
    return None


# ---- the JVM pool -----------------------------------------------------------------------------

class _Sim:
    """One ScienceWorld simulator (a JVM) and the episode whose state it currently holds."""

    _ids = itertools.count()

    def __init__(self, heap: str | None):
        from scienceworld import ScienceWorldEnv

        self.id = next(self._ids)
        # The JVM's heap defaults to a quarter of RAM and is then used freely (4+ GB seen after a few
        # thousand steps); -Xmx bounds it. JAVA_TOOL_OPTIONS reaches the JVM py4j launches.
        saved = os.environ.get("JAVA_TOOL_OPTIONS")
        if heap:
            os.environ["JAVA_TOOL_OPTIONS"] = f"{saved or ''} -Xmx{heap}".strip()
        try:
            self.sim = ScienceWorldEnv("", envStepLimit=1_000_000)
        finally:
            if saved is None:
                os.environ.pop("JAVA_TOOL_OPTIONS", None)
            else:
                os.environ["JAVA_TOOL_OPTIONS"] = saved
        self.owner: object | None = None     # the env whose episode this simulator holds
        self.last_used = time.monotonic()

    def shutdown(self) -> None:
        try:
            self.sim.close()
        except Exception:
            pass
        process = getattr(getattr(self.sim, "_gateway", None), "java_process", None)
        if process is not None:
            try:
                process.wait(timeout=10)
            except Exception:
                process.kill()


class _Pool:
    """At most `max_jvms` simulators shared by the live env instances of this process."""

    def __init__(self):
        self.lock = threading.RLock()
        self.sims: list[_Sim] = []
        self.live = 0
        self.scratch = object()   # owner of a simulator used for lookups (variations, demonstration)

    def acquire(self, env: object, max_jvms: int, heap: str | None = None) -> _Sim:
        with self.lock:
            free = [s for s in self.sims if s.owner is None or s.owner is self.scratch]
            if free:
                sim = min(free, key=lambda s: s.last_used)
            elif len(self.sims) < max_jvms:
                sim = _Sim(heap)
                self.sims.append(sim)
            else:
                sim = min(self.sims, key=lambda s: s.last_used)   # its episode is replayed when needed
            sim.owner = env
            sim.last_used = time.monotonic()
            return sim

    def release(self, env: object) -> None:
        with self.lock:
            for sim in self.sims:
                if sim.owner is env:
                    sim.owner = None

    def enter(self) -> None:
        with self.lock:
            self.live += 1

    def leave(self) -> None:
        with self.lock:
            self.live = max(0, self.live - 1)
            if self.live == 0:
                self.shutdown()

    def shutdown(self) -> None:
        with self.lock:
            sims, self.sims = self.sims, []
        for sim in sims:
            sim.shutdown()


_POOL = _Pool()
atexit.register(_POOL.shutdown)

_VARIATIONS: dict[tuple[str, str, str], list[int]] = {}   # (task, simplification, source) -> variations
_GOLD: dict[tuple[str, int, str], list[str]] = {}         # (task, variation, simplification) -> gold path
_DEMO: dict[str, list[tuple[str, list[str] | None, str]]] = {}


def _split_top(text: str) -> list[str]:
    """`text` split at ", " outside parentheses."""
    parts, depth, current, i = [], 0, "", 0
    while i < len(text):
        c = text[i]
        depth += (c == "(") - (c == ")")
        if depth == 0 and text.startswith(", ", i):
            parts.append(current)
            current, i = "", i + 2
            continue
        current += c
        i += 1
    parts.append(current)
    return parts


def _sort_listing(line: str) -> str:
    match = re.match(r"^(.*?(?:is|are): )(.+?)(\.?\s*)$", line)
    if match and ", " in match.group(2):
        return match.group(1) + ", ".join(sorted(_split_top(match.group(2)))) + match.group(3)
    return line


def normalize_observation(text: str) -> str:
    """ScienceWorld lists a room's contents in an order that varies between loads of the same task
    (object ids), though the world is the same. Sort the tab-indented listing lines (with their
    nested lines) and the items of "X is: a, b, c" lists, so that the same task and actions always
    give the same text."""
    root: list = []
    stack: list = [(-1, root)]
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip("\t"))
        node = (_sort_listing(line), [])
        if indent == 0:
            root.append(node)
            stack = [(-1, root), (0, node[1])]
            continue
        while stack[-1][0] >= indent:
            stack.pop()
        stack[-1][1].append(node)
        stack.append((indent, node[1]))

    def emit(nodes: list, top: bool) -> list[str]:
        out = []
        for line, children in (nodes if top else sorted(nodes, key=lambda n: n[0])):
            out.append(line)
            out += emit(children, False)
        return out

    return "\n".join(emit(root, True))


def _clean(text: str) -> str:
    """The reply's first non-blank line, printable characters only, spaces collapsed, lower case."""
    for line in text.splitlines():
        line = "".join(c if c.isprintable() else " " for c in line)
        line = " ".join(line.split())
        if line:
            return re.sub(r"^(?:>\s*|action\s*:\s*)+", "", line, flags=re.IGNORECASE).rstrip(".").strip().lower()
    return ""


def _shorten(text: str, limit: int = 60) -> str:
    printable = "".join(c if c.isprintable() else " " for c in text)
    return printable if len(printable) <= limit else printable[:limit] + "..."


class ScienceWorldEnv(Env):
    """ScienceWorld tasks; see the module docstring.

    task_names: ScienceWorld task names to sample (default all 30), round-robin; the instance's `task_types`.
    simplification: ScienceWorld simplification string ("easy" by default; "" for none).
    heldout: which ScienceWorld split the "heldout" split draws from: "dev" (default) or "test".
    max_steps: actions per episode, refused ones included.
    max_jvms: most simulators (JVMs) alive in this process, shared by all instances.
    list_admissible: whether admissible_actions() lists ScienceWorld's valid actions (else None).
    jvm_heap: the most heap each simulator's JVM may use (java -Xmx; default "1g"; None: Java's default,
        a quarter of RAM, which a long-lived simulator does fill).
    """

    name = "scienceworld"
    # ScienceWorld's valid-action lists over-generate: some listed combinations ("move chair to
    # sewer") are refused when played. The conformance check then only asks that most are accepted.
    admissible_exact = False

    def __init__(self, task_names: list[str] | tuple[str, ...] | None = None, simplification: str = "easy",
                 heldout: str = "dev", max_steps: int = 30, max_jvms: int = 8, list_admissible: bool = True,
                 jvm_heap: str | None = "1g"):
        chosen = tuple(task_names) if task_names else TASK_NAMES
        unknown = [t for t in chosen if t not in TASK_NAMES]
        if unknown:
            raise ValueError(f"scienceworld: unknown task names {unknown}; known: {', '.join(TASK_NAMES)}")
        if heldout not in HELDOUT_SOURCES:
            raise ValueError(f"scienceworld: heldout must be one of {HELDOUT_SOURCES}, got {heldout!r}")
        if max_steps < 1 or max_jvms < 1:
            raise ValueError("scienceworld needs max_steps >= 1 and max_jvms >= 1")
        _require_runtime()
        self.task_types = chosen
        self.simplification = simplification
        self.heldout = heldout
        self.max_steps = max_steps
        self.max_jvms = max_jvms
        self.list_admissible = list_admissible
        self.jvm_heap = jvm_heap
        self._sim: _Sim | None = None
        self._task: TaskSpec | None = None
        self._closed = False
        _POOL.enter()

    # ---- simulator access ---------------------------------------------------------------------

    def _scratch_sim(self) -> _Sim:
        """A simulator for lookups that clobber its state (any episode it held is replayed later)."""
        sim = _POOL.acquire(self, self.max_jvms, self.jvm_heap)
        sim.owner = _POOL.scratch
        return sim

    def _live_sim(self) -> _Sim:
        """The simulator holding this episode's state, restoring it (reload + replay) if it was taken."""
        sim = self._sim
        if sim is not None and sim.owner is self and sim in _POOL.sims:
            sim.last_used = time.monotonic()
            return sim
        sim = self._sim = _POOL.acquire(self, self.max_jvms, self.jvm_heap)
        self._load(sim)
        for command in self._sent:
            sim.sim.step(command)
        return sim

    def _load(self, sim: _Sim) -> tuple[str, dict]:
        spec = self._task.spec
        sim.sim.load(spec["task"], spec["variation"], spec["simplification"], generateGoldPath=True)
        sim.sim.clear_run_histories()
        observation, info = sim.sim.reset()
        key = (spec["task"], spec["variation"], spec["simplification"])
        if key not in _GOLD:
            _GOLD[key] = [a for a in sim.sim.get_gold_action_sequence() if a]
        return observation, info

    def _variations(self, task: str, source: str) -> list[int]:
        key = (task, self.simplification, source)
        if key not in _VARIATIONS:
            sim = self._scratch_sim()
            sim.sim.load(task, 0, self.simplification)
            for src, getter in (("train", sim.sim.get_variations_train), ("dev", sim.sim.get_variations_dev),
                                ("test", sim.sim.get_variations_test)):
                _VARIATIONS[(task, self.simplification, src)] = sorted(getter())
        return _VARIATIONS[key]

    # ---- the interface ------------------------------------------------------------------------

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks, task names round-robin; "train" draws ScienceWorld train variations, "heldout"
        its dev (or test) variations; task i's variation comes from an RNG seeded by (split, seed, i)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        source = "train" if split == "train" else self.heldout
        tasks = []
        for i in range(n):
            task = self.task_types[i % len(self.task_types)]
            rng = random.Random(f"scienceworld:{split}:{source}:{seed}:{i}")
            variation = rng.choice(self._variations(task, source))
            spec = {"task": task, "variation": variation, "simplification": self.simplification, "source": source}
            tasks.append(TaskSpec(env=self.name, split=split, task_type=task, seed=variation, spec=spec))
        return tasks

    def reset(self, task: TaskSpec) -> str:
        if self._closed:
            raise RuntimeError("this scienceworld env is closed")
        self._task = task
        self._sent: list[str] = []      # every command sent to the simulator, for replay
        self._actions: list[str] = []   # the agent's actions as executed
        self._steps = 0
        self._score = 0
        self._done = False
        self._success = False
        self._gold_pos = 0
        self._refused: dict[str, int] = {}
        sim = self._sim if self._sim is not None and self._sim.owner is self and self._sim in _POOL.sims \
            else _POOL.acquire(self, self.max_jvms, self.jvm_heap)
        self._sim = sim
        observation, info = self._load(sim)
        self._admissible = self._valid_actions(info)
        self._description = sim.sim.get_task_description()
        return f"{self._description}\n\n{normalize_observation(observation.strip())}"

    def _valid_actions(self, info: dict) -> list[str]:
        return sorted(a for a in info.get("valid", []) if a not in BLOCKED)

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        self._steps += 1
        command = _clean(action)
        reward = 0.0
        if not command:
            observation, info = ("Nothing happens: the reply holds no command. " + self._forms()), \
                {"valid": False, "feedback": "unparseable"}
        elif len(command) > MAX_ACTION_CHARS:
            observation, info = (f"Nothing happens: the command is too long ({len(command)} characters; "
                                 f"at most {MAX_ACTION_CHARS}). " + self._forms()), \
                {"valid": False, "feedback": "unparseable"}
        elif command in BLOCKED:
            observation, info = BLOCKED[command], {"valid": False, "feedback": "inadmissible"}
        else:
            observation, info, reward = self._send(command)
        if not info["valid"]:
            self._refused[info["feedback"]] = self._refused.get(info["feedback"], 0) + 1
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            observation += f"\nYou have used all {self.max_steps} steps; the task is not done."
        return StepResult(observation, reward, self._done, self._success, info)

    def _send(self, command: str) -> tuple[str, dict, float]:
        sim = self._live_sim()
        gold = self._gold()
        self._skip_choices(gold)
        on_path = self._gold_pos < len(gold) and command == gold[self._gold_pos]
        observation, _, completed, info = sim.sim.step(command)
        self._sent.append(command)
        note = ""
        if observation.strip().startswith("Ambiguous request"):
            # The gold path resolves its own ambiguities with the number it names; anyone else gets
            # ScienceWorld's first reading.
            following = gold[self._gold_pos + 1] if on_path and self._gold_pos + 1 < len(gold) else ""
            choice = following if following.isdigit() else "0"
            observation, _, completed, info = sim.sim.step(choice)
            self._sent.append(choice)
            note = f"(Ambiguous command: took reading {choice}.) "
            if on_path and following.isdigit():
                self._gold_pos += 1
        if observation.strip() == UNKNOWN_ACTION:
            if command in self._admissible:   # ScienceWorld listed it, but it is not possible now
                return (f"That is not possible now ({UNKNOWN_ACTION})",
                        {"valid": False, "feedback": "inadmissible"}, 0.0)
            return (f"{UNKNOWN_ACTION} " + self._forms(), {"valid": False, "feedback": "unparseable"}, 0.0)
        self._actions.append(command)
        if on_path:
            self._gold_pos += 1
        score = int(info.get("score", 0))
        reward = (score - self._score) / 100.0
        self._score = score
        self._admissible = self._valid_actions(info)
        self._success = score >= 100
        self._done = bool(completed) or self._success or score < 0
        if score < 0:
            note += "(The task has failed.) "
        return note + normalize_observation(observation.strip()), {"valid": True, "feedback": "ok"}, reward

    @staticmethod
    def _forms() -> str:
        return ("Commands look like: look around, look at <thing>, go to <place>, teleport to <place>, "
                "pick up <thing>, move <thing> to <container>, open <thing>, activate <device>, "
                "use <thing> on <thing>, focus on <thing>, wait, inventory.")

    def admissible_actions(self) -> list[str] | None:
        if not self.list_admissible:
            return None
        if self._task is None or self._done:
            return []
        return list(self._admissible)

    def expert_action(self) -> str | None:
        if self._task is None or self._done:
            return None
        gold = self._gold()
        self._skip_choices(gold)
        return gold[self._gold_pos] if self._gold_pos < len(gold) else None

    def _skip_choices(self, gold: list[str]) -> None:
        """Move the gold-path position past ambiguity choices ("0"): `step()` makes them itself when
        ScienceWorld asks, so they are never actions of their own."""
        while self._gold_pos < len(gold) and gold[self._gold_pos].isdigit():
            self._gold_pos += 1

    def solution(self) -> list[str] | None:
        """ScienceWorld's gold path for the current task without its ambiguity choices (`step()` makes
        them); None before the first `reset` or where ScienceWorld gives no gold path."""
        if self._task is None:
            return None
        return [a for a in self._gold() if not a.isdigit()] or None

    def rules(self) -> list[str]:
        """The task family's recipe (FAMILY_RULES), then focusing only on what the task names, then
        moving between rooms; no object or place of the variation is named."""
        if self._task is None:
            return []
        task = self._task.spec["task"]
        rules = [rule for prefixes, rule in FAMILY_RULES if task.startswith(prefixes)][:1]
        return rules + ["Focus only on what the task names, and only when it says to: focusing on anything else "
                        "fails the task.",
                        "Go from room to room (open doors that are closed) and look around after arriving."]

    def _gold(self) -> list[str]:
        spec = self._task.spec
        key = (spec["task"], spec["variation"], spec["simplification"])
        if key not in _GOLD:
            self._live_sim()
        return _GOLD[key]

    def hindsight(self) -> list[str]:
        """The task, ScienceWorld's gold path, the score reached and the goals still open."""
        if self._task is None:
            return []
        spec = self._task.spec
        facts = [f"The task was: {self._description}",
                 f"ScienceWorld task {spec['task']}, variation {spec['variation']} ({spec['source']} split)."]
        gold = self._gold()
        shown = gold if len(gold) <= 40 else gold[:40] + [f"... ({len(gold) - 40} more)"]
        facts.append(f"A {len(gold)}-step solution: {'; '.join(shown)}.")
        facts.append(f"Score reached: {self._score}/100 after {self._steps} steps.")
        if self._actions and not self._success and not self._closed:
            try:
                progress = self._live_sim().sim.get_goal_progress().strip()
            except Exception:
                progress = ""
            if progress:
                lines = [line.strip() for line in progress.splitlines() if line.strip()]
                facts.append("Goal progress: " + " | ".join(lines))
        if self._done and not self._success and self._gold_pos < len(gold):
            facts.append(f"The solution's step {self._gold_pos + 1} ('{gold[self._gold_pos]}') was where you left it.")
        for kind, count in sorted(self._refused.items()):
            facts.append(f"{count} of your actions were refused ({kind}).")
        return facts

    def canonicalize(self, action: str) -> str:
        command = _clean(action)
        if not command or len(command) > MAX_ACTION_CHARS or command in BLOCKED:
            return "invalid<>"
        for pattern, symbol in _TEMPLATES:
            if pattern.fullmatch(command):
                return symbol
        return "invalid<>"

    def instructions(self) -> str:
        return ("You are an agent in ScienceWorld, a text world of rooms, objects, substances and devices. "
                "Reply with exactly one command per turn, no explanation. Commands: look around, look at <thing>, "
                "look in <container>, go to <place>, teleport to <place>, pick up <thing>, put down <thing>, "
                "move <thing> to <container>, pour <thing> in <container>, open/close <thing>, "
                "activate/deactivate <device>, use <thing> on <thing>, connect <thing> to <thing>, mix <container>, "
                "read <thing>, eat <thing>, wait, inventory, focus on <thing>. Focus only on what the task names: "
                "focusing on the wrong thing fails the task.")

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        """The gold path of a fixed train task (find-non-living-thing, variation 0: 5 actions), without
        admissible lists (they run to hundreds of actions). Computed once per process."""
        key = self.simplification
        if key not in _DEMO:
            demo = ScienceWorldEnv(("find-non-living-thing",), self.simplification, max_steps=40,
                                   max_jvms=self.max_jvms, list_admissible=False, jvm_heap=self.jvm_heap)
            try:
                task = TaskSpec(self.name, "train", "find-non-living-thing", 0,
                                {"task": "find-non-living-thing", "variation": 0,
                                 "simplification": self.simplification, "source": "train"})
                observation = demo.reset(task)
                turns = []
                while (action := demo.expert_action()) is not None:
                    turns.append((observation, None, action))
                    result = demo.step(action)
                    observation = result.observation
                    if result.done:
                        break
                _DEMO[key] = turns
            finally:
                demo.close()
        return list(_DEMO[key])

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random valid action (the survey's random-policy baseline)."""
        actions = self._admissible or ["look around"]
        return rng.choice(actions)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _POOL.release(self)
        self._sim = None
        _POOL.leave()
