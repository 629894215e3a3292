"""Explain: short explanations with no verifier; only a judge (the model itself, MASS) can score them.

A task asks for a one- or two-sentence explanation: why an everyday phenomenon happens (`why`), what a
term means (`define`), or how two related things differ (`compare`). The questions are built from small
hand-written lists, so there are a few hundred distinct ones. The reply is one line; a reply with at least
three words ends the episode, a shorter one gets feedback and (up to `max_steps` replies) another try.

There is no verifier: the env never claims success (reward 0.0, success False for every episode) and says
so with `verifiable = False`. A method that needs a judgement (MASS's pairwise judge) asks the model; the
gate's success rate on this env is 0 for every model, so promote by another rule (`gate.rule: always`).

Splits: a question goes to a split by a hash of its text (about 1 in 5 held-out).
"""

from __future__ import annotations

import random
from typing import Any

from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard

TASK_TYPES = ("why", "define", "compare")

WHY = ("the sky looks blue on a clear day", "ice floats on water", "metal feels colder than wood at the same "
       "temperature", "bread goes stale", "a spoon looks bent in a glass of water", "we see lightning before we "
       "hear thunder", "leaves change colour in autumn", "salt melts ice on roads", "a balloon shrinks in the cold",
       "onions make people cry", "the moon shows phases", "dark clothes feel hot in the sun", "a bicycle stays "
       "upright when it moves", "milk turns sour", "sound travels faster in water than in air", "we have seasons",
       "a kettle whistles", "a magnet picks up iron but not aluminium", "wet sand is firmer than dry sand",
       "popcorn pops", "cut apples turn brown", "stars twinkle", "a rubber band heats up when stretched",
       "tides rise and fall twice a day", "a sunset looks red", "soap removes grease", "planes can fly",
       "yeast makes dough rise", "a glass of cold water gets wet on the outside", "hot air balloons rise")
TERMS = ("photosynthesis", "inflation", "a prime number", "gravity", "an algorithm", "evaporation", "a vaccine",
         "friction", "a watershed", "an ecosystem", "compound interest", "a metaphor", "erosion", "a catalyst",
         "democracy", "an atom", "a hypothesis", "a recession", "osmosis", "a fossil", "a variable in algebra",
         "renewable energy", "a tariff", "a virus", "a glacier", "supply and demand", "an alloy", "a protein",
         "a median", "momentum")
PAIRS = (("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("an alligator", "a crocodile"),
         ("mass", "weight"), ("a lake", "a pond"), ("a simile", "a metaphor"), ("heat", "temperature"),
         ("an asteroid", "a comet"), ("a hurricane", "a tornado"), ("debit", "credit"), ("a mean", "a median"),
         ("an epidemic", "a pandemic"), ("a rabbit", "a hare"), ("a frog", "a toad"), ("RAM", "a hard disk"),
         ("a conductor", "an insulator"), ("a democracy", "a monarchy"), ("a fruit", "a vegetable"),
         ("a star", "a planet"), ("an import", "an export"), ("a cell wall", "a cell membrane"),
         ("a solid", "a liquid"), ("a loan", "a grant"), ("an acid", "a base"))

_DEMO = [("Explain in one or two sentences why a metal spoon gets hot in a cup of tea.",
          "Metal conducts heat well, so heat from the hot tea flows quickly along the spoon to the handle."),
         ("Explain in one or two sentences: what is a noun?",
          "A noun is a word that names a person, place, thing or idea, such as 'teacher', 'city' or 'joy'.")]

MIN_WORDS = 3


def generate_question(task_type: str, rng: random.Random) -> dict[str, Any]:
    """One question of `task_type` (JSON-ready): the question and its subject(s)."""
    if task_type == "why":
        subject = rng.choice(WHY)
        return {"question": f"Explain in one or two sentences why {subject}.", "subject": subject}
    if task_type == "define":
        subject = rng.choice(TERMS)
        return {"question": f"Explain in one or two sentences: what is {subject}?", "subject": subject}
    a, b = rng.choice(PAIRS)
    if rng.random() < 0.5:
        a, b = b, a
    return {"question": f"Explain in one or two sentences: how does {a} differ from {b}?", "subject": f"{a}|{b}"}


class ExplainEnv(Env):
    """Short explanations judged only by a model; see the module docstring.

    task_types: which of why / define / compare to sample (default all three), round-robin.
    max_steps: replies per episode; only a reply under three words can be followed by another.
    """

    name = "explain"
    verifiable = False

    def __init__(self, task_types: list[str] | tuple[str, ...] | None = None, max_steps: int = 2):
        types = tuple(task_types) if task_types else TASK_TYPES
        unknown = [t for t in types if t not in TASK_TYPES]
        if unknown or not types or len(set(types)) != len(types) or max_steps < 1:
            raise ValueError(f"explain: task_types must be distinct, among {TASK_TYPES} (got {list(types)}), and "
                             f"max_steps >= 1 (got {max_steps})")
        self.task_types = types
        self.max_steps = max_steps
        self._task: TaskSpec | None = None
        self._done = self._success = False
        self._replies: list[str] = []

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed, generate_question)

    def reset(self, task: TaskSpec) -> str:
        self._task, self._done, self._success, self._replies = task, False, False, []
        return task.spec["question"]

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        line = (action.strip().splitlines() or [""])[0].strip()
        self._replies.append(line)
        if len(line.split()) < MIN_WORDS:
            self._done = len(self._replies) >= self.max_steps
            text = f"Write the explanation: one line of at least {MIN_WORDS} words."
            if self._done:
                text += " No replies left."
            return StepResult(text, 0.0, self._done, False, {"valid": False, "feedback": "too_short"})
        self._done = True
        return StepResult("Thank you. (No verifier: the explanation is not scored here.)", 0.0, True, False,
                          {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        if self._task is None:
            return []
        facts = [f"The question was: {self._task.spec['question']}",
                 "This env has no verifier: nothing says whether the explanation was right."]
        if self._replies and len(self._replies[-1].split()) < MIN_WORDS:
            facts.append(f"The last reply had fewer than {MIN_WORDS} words.")
        return facts

    def canonicalize(self, action: str) -> str:
        """`explain<short>` (under 25 words), `explain<long>`, or `invalid<>` (under three words)."""
        words = len((action.strip().splitlines() or [""])[0].split())
        if words < MIN_WORDS:
            return "invalid<>"
        return "explain<short>" if words < 25 else "explain<long>"

    def instructions(self) -> str:
        return ("You explain things clearly and correctly. Reply with one line: an explanation of one or two "
                "sentences, no preamble.")

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        return [(question, None, reply) for question, reply in _DEMO]

    def rules(self) -> list[str]:
        """General rules for a good explanation (no task's subject named)."""
        if self._task is None:
            return []
        rules = ["Name the cause or mechanism, not just a restatement of the question.",
                 "Keep it to one or two sentences on one line."]
        if self._task.task_type == "compare":
            rules.insert(0, "State the one difference that matters most between the two things, for both of them.")
        elif self._task.task_type == "define":
            rules.insert(0, "Say what kind of thing it is, then what sets it apart, with one example.")
        return rules
