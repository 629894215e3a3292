"""Household: an ALFWorld-style procedural text world with ALFWorld's six task types.

A task is one small room of receptacles (cabinets, drawers, a fridge, a microwave, a sink basin,
tables...) holding numbered objects ("mug 1", "cd 2") and sometimes a lamp standing on one of them.
The agent goes from receptacle to receptacle, opens and closes the ones with doors, carries at most
one object, and cleans, heats or cools what it holds at the sink basin, microwave or fridge. It
all runs in plain Python; a TaskSpec's `spec` holds the whole layout, so `reset` rebuilds it exactly.

Splits: for each task type, the (object type, target type) combinations are ranked by a hash and
the first ~20% are held out; each split also draws its layouts from its own seed stream. Held-out
tasks therefore use combinations (and layouts) never seen in training, and every task type has
combinations in both splits.

Sizes: rooms default to 4 receptacles (more when a task needs them) and 2 distractor objects, and
`max_steps` (default 25) counts every action, bad ones included. The scripted expert needs at most
11 steps (pick_two with both sources and the target closed), so every task fits; a uniformly random
admissible policy succeeds on about 3% of tasks (7-9% on pick_and_place and look_at_obj_in_light,
about 1% on clean/heat/cool, ~0% on pick_two).
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any

from rsiflow.envs.base import SPLITS, Env, StepResult, TaskSpec, step_guard

TASK_TYPES = ("pick_and_place", "look_at_obj_in_light", "pick_clean_then_place",
              "pick_heat_then_place", "pick_cool_then_place", "pick_two_obj_and_place")

RECEPTACLE_TYPES = ("cabinet", "drawer", "countertop", "shelf", "fridge", "microwave", "sinkbasin",
                    "stoveburner", "desk", "sidetable", "dresser", "garbagecan", "coffeetable",
                    "diningtable")
OPENABLE = frozenset({"cabinet", "drawer", "fridge", "microwave"})
CONTAINERS = frozenset({"cabinet", "drawer", "fridge", "microwave", "garbagecan", "sinkbasin"})
# At most one of each of these per room; the others may repeat (cabinet 1, cabinet 2, ...).
UNIQUE = frozenset({"fridge", "microwave", "sinkbasin", "garbagecan", "desk", "dresser",
                    "coffeetable", "diningtable"})

FOOD = ("apple", "potato", "egg", "tomato", "lettuce", "bread")
DISHES = ("mug", "cup", "bowl", "plate", "pan")
THINGS = ("book", "cd", "pen", "pencil", "keychain", "cellphone", "creditcard", "vase", "statue",
          "watch", "remotecontrol", "alarmclock")
OBJECT_TYPES = FOOD + DISHES + THINGS
LAMP_HOSTS = {"desklamp": ("desk", "sidetable", "dresser"),
              "floorlamp": ("sidetable", "dresser", "coffeetable")}

# verb -> (receptacle type used as the tool, state it sets, past tense, gerund)
TRANSFORMS = {"clean": ("sinkbasin", "clean", "cleaned", "cleaning"),
              "heat": ("microwave", "hot", "heated", "heating"),
              "cool": ("fridge", "cool", "cooled", "cooling")}
TASK_VERB = {"pick_clean_then_place": "clean", "pick_heat_then_place": "heat",
             "pick_cool_then_place": "cool"}

PLACE_TARGETS = ("cabinet", "drawer", "countertop", "shelf", "desk", "sidetable", "dresser",
                 "coffeetable", "diningtable", "garbagecan")
# task type -> (object types, target types); for look_at_obj_in_light the "target" is the lamp type.
COMBO_SOURCES = {
    "pick_and_place": (OBJECT_TYPES, PLACE_TARGETS),
    "look_at_obj_in_light": (THINGS + ("bowl", "mug", "plate"), tuple(LAMP_HOSTS)),
    "pick_clean_then_place": (FOOD[:5] + DISHES,
                              ("cabinet", "countertop", "shelf", "diningtable", "drawer", "fridge")),
    "pick_heat_then_place": (("apple", "potato", "egg", "tomato", "bread", "mug", "cup", "plate"),
                             ("countertop", "diningtable", "cabinet", "shelf", "fridge", "garbagecan")),
    "pick_cool_then_place": (FOOD + DISHES,
                             ("countertop", "diningtable", "cabinet", "shelf", "microwave", "garbagecan")),
    "pick_two_obj_and_place": (OBJECT_TYPES, PLACE_TARGETS),
}
HELDOUT_FRACTION = 0.2


def _split_combos() -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Per split and task type, its (object type, target type) combinations (hash-ranked, disjoint)."""
    out: dict[str, dict[str, list[tuple[str, str]]]] = {"train": {}, "heldout": {}}
    for task_type, (objects, targets) in COMBO_SOURCES.items():
        combos = sorted(((o, t) for o in objects for t in targets),
                        key=lambda c: hashlib.sha1(f"{task_type}|{c[0]}|{c[1]}".encode()).hexdigest())
        n_heldout = max(1, round(HELDOUT_FRACTION * len(combos)))
        out["heldout"][task_type] = sorted(combos[:n_heldout])
        out["train"][task_type] = sorted(combos[n_heldout:])
    return out


COMBOS = _split_combos()

_NAME = r"(?:the |a )?([a-z]{1,20}) ?(\d{1,3})"
_PATTERNS = [(verb, re.compile(pattern)) for verb, pattern in [
    ("go", rf"go to {_NAME}"),
    ("open", rf"open {_NAME}"),
    ("close", rf"close {_NAME}"),
    ("take", rf"take {_NAME} from {_NAME}"),
    ("put", rf"put {_NAME} (?:in/on|in|on) {_NAME}"),
    ("clean", rf"clean {_NAME} with {_NAME}"),
    ("heat", rf"heat {_NAME} with {_NAME}"),
    ("cool", rf"cool {_NAME} with {_NAME}"),
    ("use", rf"use {_NAME}"),
    ("examine", rf"examine {_NAME}"),
    ("look", r"look"),
    ("inventory", r"inventory"),
]]
_ROLES = {"go": "receptacle", "open": "receptacle", "close": "receptacle",
          "take": "object,receptacle", "put": "object,receptacle", "clean": "object,sink",
          "heat": "object,microwave", "cool": "object,fridge", "use": "lamp", "look": "",
          "inventory": ""}
ACTION_FORMS = ("go to <receptacle>, open <receptacle>, close <receptacle>, "
                "take <object> from <receptacle>, put <object> in/on <receptacle>, "
                "clean/heat/cool <object> with <receptacle>, use <lamp>, examine <something>, "
                "look, inventory")


def parse_action(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(verb, names) of an action text, or None when it doesn't parse.

    Only the first non-blank line counts; case, surrounding whitespace, a leading "> " or "Action:", a
    trailing period, "the"/"a" before a name and a missing space in "cabinet1" are tolerated.
    """
    lines = text.strip().splitlines()
    line = lines[0].strip().lower() if lines else ""
    line = re.sub(r"^(?:>\s*|action\s*:\s*)+", "", line).rstrip(". ")
    line = " ".join(line.split())
    for verb, pattern in _PATTERNS:
        match = pattern.fullmatch(line)
        if match:
            groups = match.groups()
            return verb, tuple(f"{groups[i]} {int(groups[i + 1])}" for i in range(0, len(groups), 2))
    return None


def _kind(name: str) -> str:
    """The type part of a name: "cabinet 2" -> "cabinet"."""
    return name.rsplit(" ", 1)[0]


def _order(name: str) -> tuple[str, int]:
    kind, number = name.rsplit(" ", 1)
    return kind, int(number)


def _prep(receptacle: str) -> str:
    return "in" if _kind(receptacle) in CONTAINERS else "on"


def _listing(names: list[str]) -> str:
    """ALFWorld's list style: "a apple 1", "a apple 1, and a mug 2", "nothing"."""
    items = [f"a {n}" for n in sorted(names, key=_order)]
    if not items:
        return "nothing"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _a(word: str) -> str:
    """"an apple", "a mug" (hindsight prose; observations keep ALFWorld's "a apple 1")."""
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


def _shorten(text: str, limit: int = 60) -> str:
    printable = "".join(c if c.isprintable() else " " for c in text)
    return printable if len(printable) <= limit else printable[:limit] + "..."


def generate_layout(task_type: str, obj_type: str, target_type: str, rng: random.Random,
                    n_receptacles: int, n_distractors: int) -> dict[str, Any]:
    """A room for one task: receptacles, objects with locations, lamps and the goal (JSON-ready).

    The room holds the receptacles the task needs (target or lamp host, tool) plus random ones up
    to `n_receptacles` (at least one besides the target). Openable receptacles start closed with
    probability 0.8. The goal objects (2 for pick_two, else 1; one spare with probability 0.25)
    never start in the target; `n_distractors` objects of other types go anywhere.
    """
    verb = TASK_VERB.get(task_type)
    look = task_type == "look_at_obj_in_light"
    host_type = rng.choice(LAMP_HOSTS[target_type]) if look else None
    kinds = [host_type if look else target_type] + ([TRANSFORMS[verb][0]] if verb else [])
    size = max(n_receptacles, len(kinds) + 1)
    while len(kinds) < size:
        kind = rng.choice(RECEPTACLE_TYPES)
        if not (kind in UNIQUE and kind in kinds):
            kinds.append(kind)
    receptacles = [f"{kind} {kinds[:i + 1].count(kind)}" for i, kind in enumerate(kinds)]
    opened = {r: _kind(r) not in OPENABLE or rng.random() < 0.2 for r in receptacles}

    anchor = rng.choice([r for r in receptacles if _kind(r) == kinds[0]])  # target or lamp host
    count = 2 if task_type == "pick_two_obj_and_place" else 1
    sources = receptacles if look else [r for r in receptacles if r != anchor]
    objects = [(obj_type, rng.choice(sources)) for _ in range(count + (rng.random() < 0.25))]
    others = [t for t in OBJECT_TYPES if t != obj_type]
    objects += [(rng.choice(others), rng.choice(receptacles)) for _ in range(n_distractors)]
    named = [(f"{kind} {[k for k, _ in objects[:i + 1]].count(kind)}", at)
             for i, (kind, at) in enumerate(objects)]

    lamps = []
    if look:
        lamps.append((f"{target_type} 1", anchor))
    elif rng.random() < 0.5:
        lamp_type = rng.choice(tuple(LAMP_HOSTS))
        hosts = [r for r in receptacles if _kind(r) in LAMP_HOSTS[lamp_type]]
        if hosts:
            lamps.append((f"{lamp_type} 1", rng.choice(hosts)))

    if look:
        text = f"examine the {obj_type} with the {target_type}."
    else:
        adjective = {"clean": "clean ", "heat": "hot ", "cool": "cool "}.get(verb or "", "")
        amount = "two" if count == 2 else "a"
        text = f"put {amount} {adjective}{obj_type} {_prep(anchor)} {anchor}."
    goal = {"text": text, "object": obj_type, "count": count, "verb": verb,
            "target": None if look else anchor, "lamp": lamps[0][0] if look else None}
    return {"goal": goal,
            "receptacles": [{"name": r, "open": opened[r]} for r in receptacles],
            "objects": [{"name": n, "at": at} for n, at in named],
            "lamps": [{"name": n, "at": at} for n, at in lamps]}


class _Refusal(Exception):
    """An action that parsed but can't be done now: what to tell the agent, and what to remember."""

    def __init__(self, observation: str, lesson: str | None = None):
        super().__init__(observation)
        self.observation = observation
        self.lesson = lesson


_DEMO_SEED = 20251130  # the few-shot demonstration's task


class HouseholdEnv(Env):
    """ALFWorld-style household tasks; see the module docstring.

    n_receptacles: receptacles per room (more are added when the task needs them).
    n_distractors: objects of other types than the goal object.
    max_steps: actions per episode, invalid ones included; the episode then ends unsolved.
    """

    name = "household"
    task_types = TASK_TYPES

    def __init__(self, n_receptacles: int = 4, n_distractors: int = 2, max_steps: int = 25):
        if n_receptacles < 1 or n_distractors < 0 or max_steps < 1:
            raise ValueError("household needs n_receptacles >= 1, n_distractors >= 0, max_steps >= 1")
        self.n_receptacles = n_receptacles
        self.n_distractors = n_distractors
        self.max_steps = max_steps
        self._task: TaskSpec | None = None

    # ---- tasks -------------------------------------------------------------------------------

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        """`n` tasks of `split`, task types round-robin. Task i's combination and layout come from
        its own RNG seeded by (split, seed, i), so splits use disjoint seed streams; the spec holds
        the whole layout and TaskSpec.seed is the RNG's first draw (an identifier only)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        tasks = []
        for i in range(n):
            task_type = TASK_TYPES[i % len(TASK_TYPES)]
            rng = random.Random(f"household:{split}:{seed}:{i}")
            task_seed = rng.randrange(2**31)
            obj_type, target_type = rng.choice(COMBOS[split][task_type])
            spec = generate_layout(task_type, obj_type, target_type, rng,
                                   self.n_receptacles, self.n_distractors)
            tasks.append(TaskSpec(env=self.name, split=split, task_type=task_type, seed=task_seed,
                                  spec=spec))
        return tasks

    def reset(self, task: TaskSpec) -> str:
        spec = task.spec
        self._task = task
        self._goal = spec["goal"]
        self._open = {r["name"]: r["open"] for r in spec["receptacles"]}
        self._where: dict[str, str | None] = {o["name"]: o["at"] for o in spec["objects"]}
        self._states: dict[str, set[str]] = {o: set() for o in self._where}
        self._lamps = {lamp["name"]: lamp["at"] for lamp in spec["lamps"]}
        self._at: str | None = None
        self._held: str | None = None
        self._steps = 0
        self._done = False
        self._success = False
        self._lit_with_object = False
        # What happened, for hindsight.
        self._lessons: list[str] = []
        self._taken: list[str] = []
        self._transformed: set[str] = set()
        self._puts: list[tuple[str, str, bool]] = []  # (object, receptacle, had the needed state)
        self._n_unparseable = 0
        return (f"You are in the middle of a room. Looking quickly around you, you see "
                f"{_listing(list(self._open))}.\n\nYour task is to: {self._goal['text']}")

    # ---- acting ------------------------------------------------------------------------------

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        self._steps += 1
        parsed = parse_action(action)
        if parsed is None:
            self._n_unparseable += 1
            observation = (f'Nothing happens. I don\'t understand "{_shorten(action)}". '
                           f"Valid actions look like: {ACTION_FORMS}.")
            info = {"valid": False, "feedback": "unparseable"}
        else:
            try:
                observation = getattr(self, f"_do_{parsed[0]}")(*parsed[1])
                info = {"valid": True, "feedback": "ok"}
            except _Refusal as refusal:
                observation = refusal.observation
                if refusal.lesson:
                    self._learn(refusal.lesson)
                info = {"valid": False, "feedback": "inadmissible"}
        self._success = self._goal_reached()
        self._done = self._success or self._steps >= self.max_steps
        if self._done and not self._success:
            observation += f" You have used all {self.max_steps} steps; the task is not done."
        return StepResult(observation, 1.0 if self._success else 0.0, self._done, self._success, info)

    def _learn(self, lesson: str) -> None:
        if lesson not in self._lessons:
            self._lessons.append(lesson)

    def _goal_reached(self) -> bool:
        if self._goal["lamp"]:
            return self._lit_with_object
        return sum(self._satisfied(o) for o in self._where) >= self._goal["count"]

    def _satisfied(self, obj: str) -> bool:
        """Whether `obj` counts towards a place goal: right type, in the target, in the right state."""
        goal = self._goal
        return (_kind(obj) == goal["object"] and self._where[obj] == goal["target"]
                and (goal["verb"] is None or TRANSFORMS[goal["verb"]][1] in self._states[obj]))

    def _visible(self, receptacle: str) -> list[str]:
        """Objects and lamps seen at `receptacle` (nothing while it is closed)."""
        if not self._open[receptacle]:
            return []
        return ([o for o, at in self._where.items() if at == receptacle]
                + [lamp for lamp, at in self._lamps.items() if at == receptacle])

    def _describe(self, receptacle: str) -> str:
        if _kind(receptacle) not in OPENABLE:
            return f"On the {receptacle}, you see {_listing(self._visible(receptacle))}."
        if not self._open[receptacle]:
            return f"The {receptacle} is closed."
        return f"The {receptacle} is open. In it, you see {_listing(self._visible(receptacle))}."

    def _require_receptacle(self, name: str) -> None:
        if name in self._where or name in self._lamps:
            raise _Refusal(f"{name} is not a receptacle.")
        if name not in self._open:
            raise _Refusal(f"There is no {name} in this room.",
                           f"You referred to {name}, which is not in this room.")

    def _require_at(self, receptacle: str, doing: str) -> None:
        if self._at != receptacle:
            raise _Refusal(f"You are not at {receptacle}. Go to it first.",
                           f"You tried to {doing} {receptacle} without going to it first.")

    def _require_open(self, receptacle: str, doing: str) -> None:
        if not self._open[receptacle]:
            raise _Refusal(f"{receptacle} is closed. Open it first.",
                           f"You tried to {doing} {receptacle} while it was closed.")

    def _require_held(self, obj: str) -> None:
        if self._held != obj:
            raise _Refusal(f"You are not carrying {obj}.",
                           f"You tried to use {obj} without carrying it.")

    def _do_go(self, receptacle: str) -> str:
        self._require_receptacle(receptacle)
        if self._at == receptacle:
            raise _Refusal(f"You are already at {receptacle}.")
        self._at = receptacle
        return f"You arrive at {receptacle}. {self._describe(receptacle)}"

    def _do_open(self, receptacle: str) -> str:
        self._require_receptacle(receptacle)
        self._require_at(receptacle, "open")
        if _kind(receptacle) not in OPENABLE:
            raise _Refusal(f"{receptacle} cannot be opened.")
        if self._open[receptacle]:
            raise _Refusal(f"{receptacle} is already open.")
        self._open[receptacle] = True
        return f"You open the {receptacle}. {self._describe(receptacle)}"

    def _do_close(self, receptacle: str) -> str:
        self._require_receptacle(receptacle)
        self._require_at(receptacle, "close")
        if _kind(receptacle) not in OPENABLE:
            raise _Refusal(f"{receptacle} cannot be closed.")
        if not self._open[receptacle]:
            raise _Refusal(f"{receptacle} is already closed.")
        self._open[receptacle] = False
        return f"You close the {receptacle}."

    def _do_take(self, obj: str, receptacle: str) -> str:
        self._require_receptacle(receptacle)
        self._require_at(receptacle, "take from")
        self._require_open(receptacle, "take from")
        if self._held is not None:
            raise _Refusal(f"You are already carrying {self._held}. Put it somewhere first.",
                           "You tried to take a second object while already carrying one.")
        if self._lamps.get(obj) == receptacle:
            raise _Refusal(f"You can't pick up the {obj}.")
        if self._where.get(obj) != receptacle:
            raise _Refusal(f"There is no {obj} {_prep(receptacle)} {receptacle}.",
                           f"You tried to take {obj} from {receptacle}, but it was not there.")
        self._where[obj] = None
        self._held = obj
        self._taken.append(obj)
        return f"You pick up the {obj} from the {receptacle}."

    def _do_put(self, obj: str, receptacle: str) -> str:
        self._require_receptacle(receptacle)
        self._require_held(obj)
        self._require_at(receptacle, "put something in")
        self._require_open(receptacle, "put something in")
        self._where[obj] = receptacle
        self._held = None
        verb = self._goal["verb"]
        self._puts.append((obj, receptacle, verb is None or TRANSFORMS[verb][1] in self._states[obj]))
        return f"You put the {obj} in/on the {receptacle}."

    def _transform(self, verb: str, obj: str, tool: str) -> str:
        tool_type, state, _, _ = TRANSFORMS[verb]
        self._require_receptacle(tool)
        if _kind(tool) != tool_type:
            raise _Refusal(f"You can't {verb} things with {tool}; use a {tool_type}.",
                           f"You tried to {verb} something with {tool} instead of a {tool_type}.")
        self._require_held(obj)
        self._require_at(tool, f"{verb} something with")
        self._states[obj].discard({"hot": "cool", "cool": "hot"}.get(state, ""))  # heat undoes cool
        self._states[obj].add(state)
        if _kind(obj) == self._goal["object"] and verb == self._goal["verb"]:
            self._transformed.add(obj)
        return f"You {verb} the {obj} using the {tool}."

    def _do_clean(self, obj: str, tool: str) -> str:
        return self._transform("clean", obj, tool)

    def _do_heat(self, obj: str, tool: str) -> str:
        return self._transform("heat", obj, tool)

    def _do_cool(self, obj: str, tool: str) -> str:
        return self._transform("cool", obj, tool)

    def _do_use(self, lamp: str) -> str:
        if lamp not in self._lamps:
            raise _Refusal(f"There is no {lamp} you can use here.",
                           f"You tried to use {lamp}, which is not a lamp in this room.")
        if self._at != self._lamps[lamp]:
            raise _Refusal(f"The {lamp} is not here.",
                           f"You tried to use {lamp} away from {self._lamps[lamp]}, where it stands.")
        if self._goal["lamp"] == lamp:
            if self._held is not None and _kind(self._held) == self._goal["object"]:
                self._lit_with_object = True
            else:
                self._learn(f"You used {lamp} without holding {_a(self._goal['object'])}.")
        return f"You turn on the {lamp}."

    def _do_examine(self, name: str) -> str:
        if name in self._open:
            self._require_at(name, "examine")
            return self._describe(name)
        if name != self._held and (self._at is None or name not in self._visible(self._at)):
            raise _Refusal(f"You don't see {name} here.")
        states = sorted(self._states.get(name, ()))
        return f"This is a normal {name}." + (f" It is {' and '.join(states)}." if states else "")

    def _do_look(self) -> str:
        if self._at is None:
            return ("You are in the middle of a room. Looking quickly around you, you see "
                    f"{_listing(list(self._open))}.")
        return f"You are at {self._at}. {self._describe(self._at)}"

    def _do_inventory(self) -> str:
        return f"You are carrying: a {self._held}." if self._held else "You are not carrying anything."

    def admissible_actions(self) -> list[str]:
        """Sorted: look, inventory, go to every other receptacle, and at the current one: open or
        close it, take what is visible (hands empty) or put what is held, clean/heat/cool at a
        sink basin/microwave/fridge while holding something, use a lamp standing there."""
        if self._task is None or self._done:
            return []
        actions = ["look", "inventory"] + [f"go to {r}" for r in self._open if r != self._at]
        here = self._at
        if here is not None:
            if _kind(here) in OPENABLE:
                actions.append(f"{'close' if self._open[here] else 'open'} {here}")
            if self._open[here] and self._held is None:
                actions += [f"take {o} from {here}" for o, at in self._where.items() if at == here]
            if self._open[here] and self._held is not None:
                actions.append(f"put {self._held} in/on {here}")
            if self._held is not None:
                actions += [f"{verb} {self._held} with {here}"
                            for verb, (tool, *_) in TRANSFORMS.items() if _kind(here) == tool]
            actions += [f"use {lamp}" for lamp, at in self._lamps.items() if at == here]
        return sorted(actions)

    # ---- expert ------------------------------------------------------------------------------

    def expert_action(self) -> str | None:
        """Next action of a short plan from the current state, knowing where everything is.

        Holding a goal object: process it (clean/heat/cool) if needed, then put it in the target
        (or use the lamp with it). Otherwise fetch the goal object that is cheapest to reach
        (already here, then open receptacles), first putting down anything else held there.
        """
        if self._task is None or self._done:
            return None
        goal, held = self._goal, self._held
        if held is not None and _kind(held) == goal["object"]:
            if goal["lamp"]:
                return self._reach(self._lamps[goal["lamp"]], f"use {goal['lamp']}", need_open=False)
            verb = goal["verb"]
            if verb and TRANSFORMS[verb][1] not in self._states[held]:
                tool = next(r for r in self._open if _kind(r) == TRANSFORMS[verb][0])
                return self._reach(tool, f"{verb} {held} with {tool}", need_open=False)
            return self._reach(goal["target"], f"put {held} in/on {goal['target']}")
        wanted = [o for o, at in self._where.items()
                  if _kind(o) == goal["object"] and at is not None and not self._satisfied(o)]
        obj = min(wanted, key=lambda o: (self._where[o] != self._at, not self._open[self._where[o]],
                                         _order(o)))
        source = self._where[obj]
        action = f"take {obj} from {source}" if held is None else f"put {held} in/on {source}"
        return self._reach(source, action)

    def _reach(self, receptacle: str, action: str, need_open: bool = True) -> str:
        if self._at != receptacle:
            return f"go to {receptacle}"
        if need_open and not self._open[receptacle]:
            return f"open {receptacle}"
        return action

    def solution(self) -> list[str] | None:
        """The expert's actions from the start of the current task (played in a separate instance,
        so this episode is untouched); None before the first `reset`."""
        if self._task is None:
            return None
        env = HouseholdEnv(max_steps=50)  # the expert needs at most 11 steps from the start
        env.reset(self._task)
        plan = []
        while (action := env.expert_action()) is not None:
            plan.append(action)
            env.step(action)
        return plan

    def rules(self) -> list[str]:
        """The task type's recipe, then (where this layout needs them) opening closed receptacles to
        find the object and before putting it in the target, then acting only where you are. No
        object, receptacle or lamp of the task is named."""
        if self._task is None:
            return []
        goal, spec = self._goal, self._task.spec
        task_type = self._task.task_type
        if task_type == "look_at_obj_in_light":
            rules = ["Take the object first, then go to where the lamp stands and use the lamp while holding it."]
        elif task_type == "pick_two_obj_and_place":
            rules = ["Carry one object at a time: put the first one in the target, then fetch the second; "
                     "both must end up there."]
        elif goal["verb"]:
            tool, _, past, _ = TRANSFORMS[goal["verb"]]
            rules = [f"{goal['verb'].capitalize()} the object with the {tool} while holding it, then put it in "
                     f"the target: putting it there before it is {past} does not count."]
        else:
            rules = ["Find the object, take it, go to the target and put it there."]
        started_open = {r["name"]: r["open"] for r in spec["receptacles"]}
        if any(_kind(o["name"]) == goal["object"] and not started_open[o["at"]] for o in spec["objects"]):
            rules.append("Objects can be inside closed receptacles: open a closed cabinet, drawer, fridge or "
                         "microwave to see what is in it.")
        if goal["target"] and not started_open[goal["target"]]:
            rules.append("Open a closed receptacle before putting anything in it.")
        rules.append("Act only where you are: go to a receptacle before opening it, taking from it or putting "
                     "into it; names include their number.")
        return rules

    # ---- hindsight and symbols ---------------------------------------------------------------

    def hindsight(self) -> list[str]:
        """Where the goal objects, target, tool and lamp were at the start, what the task needed,
        the expert's plan, the mistakes made so far and, once an episode has failed, what was missed."""
        if self._task is None:
            return []
        goal, spec = self._goal, self._task.spec
        kind, target = goal["object"], goal["target"]
        started_open = {r["name"]: r["open"] for r in spec["receptacles"]}

        def place(receptacle: str) -> str:
            closed = " (closed)" if not started_open[receptacle] else ""
            return f"{_prep(receptacle)} {receptacle}{closed}"

        facts = [f"The task was: {goal['text']}"]
        facts += [f"{o['name']} was {place(o['at'])} at the start."
                  for o in spec["objects"] if _kind(o["name"]) == kind]
        if goal["lamp"]:
            host = self._lamps[goal["lamp"]]
            facts.append(f"{goal['lamp']} stands on {host}: the {kind} must be held while using "
                         f"{goal['lamp']} there.")
        else:
            if not started_open[target]:
                facts.append(f"{target} was closed at the start: it must be opened before putting "
                             "anything in it.")
            if goal["verb"]:
                tool = next(r for r in self._open if _kind(r) == TRANSFORMS[goal["verb"]][0])
                facts.append(f"The {kind} must be {TRANSFORMS[goal['verb']][2]} with {tool} "
                             f"before it is put {_prep(target)} {target}.")
            if goal["count"] == 2:
                facts.append(f"Two {kind} objects must end up {_prep(target)} {target}, carried one at a time.")
        plan = self.solution()
        facts.append(f"A {len(plan)}-step solution: {'; '.join(plan)}.")
        facts += self._lessons
        if self._done and not self._success:
            facts += self._missed()
        return facts

    def _missed(self) -> list[str]:
        """What a failed episode left undone, compared with the plan."""
        goal = self._goal
        kind, target, verb = goal["object"], goal["target"], goal["verb"]
        taken = [o for o in self._taken if _kind(o) == kind]
        missed = []
        if not taken:
            missed.append(f"You never took {_a(kind)}.")
        elif goal["lamp"]:
            missed.append(f"You never used {goal['lamp']} at {self._lamps[goal['lamp']]} while "
                          f"holding {_a(kind)}.")
        else:
            if verb and not self._transformed:
                tool_type, _, past, _ = TRANSFORMS[verb]
                missed.append(f"You took {taken[0]} but never {past} it with the {tool_type}.")
            for obj, receptacle, ready in self._puts:
                if _kind(obj) != kind:
                    continue
                if receptacle != target:
                    missed.append(f"You put {obj} {_prep(receptacle)} {receptacle} instead of {target}.")
                elif not ready:
                    missed.append(f"You put {obj} {_prep(target)} {target} without "
                                  f"{TRANSFORMS[verb][3]} it first.")
            if not any(r == target for o, r, _ in self._puts if _kind(o) == kind):
                missed.append(f"You never put {_a(kind)} {_prep(target)} {target}.")
            if goal["count"] == 2 and sum(self._satisfied(o) for o in self._where) == 1:
                missed.append(f"Only one {kind} ended up {_prep(target)} {target}; the task needs two.")
        if self._n_unparseable:
            missed.append(f"{self._n_unparseable} of your actions were not understood.")
        if self._steps >= self.max_steps:
            missed.append(f"You ran out of steps ({self.max_steps}) before finishing.")
        return missed

    def canonicalize(self, action: str) -> str:
        """`verb<roles>` without arguments, e.g. "take mug 1 from cabinet 2" -> `take<object,receptacle>`;
        `invalid<>` when the text doesn't parse."""
        parsed = parse_action(action)
        if parsed is None:
            return "invalid<>"
        verb, names = parsed
        if verb == "examine":
            return f"examine<{'receptacle' if _kind(names[0]) in RECEPTACLE_TYPES else 'object'}>"
        return f"{verb}<{_ROLES[verb]}>"

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        """The scripted expert solving a fixed pick-and-place train task (a separate env instance,
        so this env's episode is untouched). Small models copy the action format from it: measured
        with SmolLM2-135M, 23/24 valid first actions (greedy) with a demonstration against 0/24
        without."""
        demo = HouseholdEnv(self.n_receptacles, self.n_distractors, self.max_steps)
        obs = demo.reset(demo.sample_tasks("train", 1, seed=_DEMO_SEED)[0])
        turns = []
        while True:
            action = demo.expert_action()
            turns.append((obs, demo.admissible_actions(), action))
            res = demo.step(action)
            if res.done:
                return turns
            obs = res.observation

    def instructions(self) -> str:
        return (
            "You are an agent in a household. Reply with exactly one action per turn, no explanation. "
            "Actions: go to <receptacle>, open/close <receptacle>, take <object> from <receptacle>, "
            "put <object> in/on <receptacle>, clean/heat/cool <object> with <sinkbasin/microwave/fridge>, "
            "use <lamp>, examine <thing>, look, inventory. Names include their number (\"mug 1\"); act only "
            "where you are; open closed receptacles first; carry one object at a time."
        )
