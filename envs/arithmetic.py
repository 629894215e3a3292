"""Arithmetic: procedurally generated multi-step arithmetic and word problems with exact answers.

A task is one question whose answer is an integer. Five difficulty levels are the task types:

    level1  one + or - on numbers below 10                      "What is 7 + 5?"
    level2  one +, - or x on numbers up to 20 (x: up to 9 x 9)    expression or word problem
    level3  two operations, numbers up to 20                      expression or word problem
    level4  three operations, numbers up to 50, exact division    expression or word problem
    level5  four operations, numbers up to 100, exact division    expression or word problem

Every intermediate result is a non-negative integer and every division is exact, so the answer
is checked exactly. Expression problems are written with the usual precedence and the
parentheses it needs ("(7 + 5) * 3 - 4"); word problems tell the same chain of operations as a
story about a quantity ("Mia has 12 marbles. She gives away 5. ...").

The reply is one line; the answer is the integer after the last "answer" in it ("Answer: 42",
"The answer is 42"), or else the last integer in the line ("42.", "= 42", "7 + 5 = 12"). Commas
in numbers ("1,234") and a zero fraction ("42.0") are accepted. A reply without an integer is not
an answer: it gets feedback and the episode goes on (up to `max_steps` replies); the first reply
holding an integer ends the episode, right or wrong. Reward 1.0 for the exact answer, else 0.

Splits: every problem is assigned to a split by a hash of its question text (about 1 in 5 to
held-out), and each split draws from its own seed stream, so no held-out question is ever a
training question.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard

LEVELS = ("level1", "level2", "level3", "level4", "level5")
# level -> (operations, largest operand, allowed ops, word-problem share)
LEVEL_SPECS = {
    "level1": (1, 9, "+-", 0.0),
    "level2": (1, 20, "+-*", 0.5),
    "level3": (2, 20, "+-*", 0.5),
    "level4": (3, 50, "+-*/", 0.5),
    "level5": (4, 100, "+-*/", 0.5),
}

NAMES = ("Mia", "Tom", "Ana", "Leo", "Sara", "Ravi", "Yuki", "Omar", "Lena", "Ben", "Ivy", "Max")
ITEMS = ("marbles", "stickers", "apples", "coins", "pencils", "stamps", "cards", "shells", "books",
         "beads", "cookies", "stones")
_SYMBOL = {"+": "+", "-": "-", "*": "*", "/": "/"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

_INT = r"-?\d{1,3}(?:,\d{3})+(?![\d,])|-?\d+"
_NUMBER_RE = re.compile(rf"({_INT})(\.\d+)?")
_ANSWER_RE = re.compile(r"answer", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """The integer a reply gives as its answer, or None (see the module docstring)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return None
    line = lines[0][:500]
    keyword = list(_ANSWER_RE.finditer(line))
    if keyword:
        match = _NUMBER_RE.search(line, keyword[-1].end())
        candidates = [match] if match else []
    else:
        candidates = list(_NUMBER_RE.finditer(line))[-1:]
    if not candidates:
        return None
    whole, fraction = candidates[0].group(1), candidates[0].group(2)
    if fraction and set(fraction[1:]) != {"0"}:
        return None  # 3.5 is not an integer answer
    return int(whole.replace(",", ""))


def _apply(value: int, op: str, operand: int) -> int:
    return {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]


def _choose_op(value: int, ops: str, top: int, rng: random.Random) -> tuple[str, int] | None:
    """An operation on `value` that keeps every result a non-negative integer (divisions exact)."""
    candidates = []
    for op in ops:
        if op == "+":
            candidates.append(("+", rng.randint(1, top)))
        elif op == "-" and value >= 1:
            candidates.append(("-", rng.randint(1, min(value, top))))
        elif op == "*":
            limit = 9 if top <= 20 else 12
            if value <= top * 3:
                candidates.append(("*", rng.randint(2, limit)))
        elif op == "/":
            divisors = [d for d in range(2, 13) if value % d == 0 and value // d >= 1]
            if divisors and value > 0:
                candidates.append(("/", rng.choice(divisors)))
    return rng.choice(candidates) if candidates else None


def _expression(start: int, chain: list[tuple[str, int]]) -> str:
    """The chain `((start op a) op b) ...` written with precedence and only the parentheses it needs."""
    text, last_prec = str(start), 3
    for op, operand in chain:
        prec = _PRECEDENCE[op]
        if last_prec < prec:
            text = f"({text})"
        text = f"{text} {_SYMBOL[op]} {operand}"
        last_prec = prec
    return text


def _story(start: int, chain: list[tuple[str, int]], rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    pronoun = "She" if name in ("Mia", "Ana", "Sara", "Yuki", "Lena", "Ivy") else "He"
    sentences = [f"{name} has {start} {item}."]
    for i, (op, operand) in enumerate(chain):
        then = "Then " + pronoun.lower() if i else pronoun
        if op == "+":
            more = f"{operand} more {item}" if operand > 1 else "one more"
            sentences.append(rng.choice([f"{then} finds {operand} more.", f"{then} gets {more}."]))
        elif op == "-":
            sentences.append(rng.choice([f"{then} gives away {operand}.", f"{then} loses {operand} {item}."]))
        elif op == "*":
            sentences.append(f"{then} ends up with {operand} times as many {item}.")
        else:
            sentences.append(f"{then} shares them equally among {operand} friends and keeps one share.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)


def generate_problem(level: str, rng: random.Random) -> dict[str, Any]:
    """One problem of `level` (JSON-ready): question, answer, and the worked steps."""
    n_ops, top, ops, word_share = LEVEL_SPECS[level]
    while True:
        start = rng.randint(1, top)
        value, chain, steps = start, [], []
        for _ in range(n_ops):
            choice = _choose_op(value, ops, top, rng)
            if choice is None:
                break
            op, operand = choice
            new = _apply(value, op, operand)
            steps.append(f"{value} {_SYMBOL[op]} {operand} = {new}")
            chain.append((op, operand))
            value = new
        if len(chain) == n_ops:
            break
    if rng.random() < word_share:
        question, form = _story(start, chain, rng), "word"
    else:
        # A chain written as an expression must evaluate to the same value under precedence.
        question, form = f"What is {_expression(start, chain)}?", "expression"
    return {"question": question, "answer": value, "steps": steps, "form": form}


_DEMO = [  # (question, reply): the format, shown as earlier chat turns
    ("What is (8 - 3) * 4?", "8 - 3 = 5, 5 * 4 = 20. Answer: 20"),
    ("Ben has 6 coins. He gets 5 more coins. Then he gives away 2. How many coins does Ben have now?",
     "6 + 5 = 11, 11 - 2 = 9. Answer: 9"),
    ("What is 4 + 3?", "4 + 3 = 7. Answer: 7"),
    ("Ana has 9 shells. She gives away 4. How many shells does Ana have now?", "9 - 4 = 5. Answer: 5"),
]


class ArithmeticEnv(Env):
    """Single-turn arithmetic and word problems; see the module docstring.

    levels: the task types to sample (default all five), round-robin; the instance's `task_types`.
    max_steps: replies per episode; only replies without an integer can be followed by another.
    """

    name = "arithmetic"

    def __init__(self, levels: list[str] | tuple[str, ...] | None = None, max_steps: int = 2):
        levels = tuple(levels) if levels else LEVELS
        unknown = [lv for lv in levels if lv not in LEVELS]
        if unknown or max_steps < 1:
            raise ValueError(f"arithmetic: levels must be among {LEVELS} (got {unknown}) and max_steps >= 1")
        self.task_types = levels
        self.max_steps = max_steps
        self._task: TaskSpec | None = None

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        """`n` problems of `split`, levels round-robin; problem i comes from its own RNG seeded by
        (split, seed, i) and is redrawn until its question hashes into `split`."""
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed, generate_problem)

    def reset(self, task: TaskSpec) -> str:
        self._task = task
        self._steps = 0
        self._done = False
        self._success = False
        self._given: int | None = None
        self._n_unparseable = 0
        return task.spec["question"]

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        self._steps += 1
        answer = parse_answer(action)
        if answer is None:
            self._n_unparseable += 1
            self._done = self._steps >= self.max_steps
            observation = ("No integer answer found in your reply. Reply with one line ending in "
                           "'Answer: <integer>', e.g. 'Answer: 42'.")
            if self._done:
                observation += " No replies left; the problem is not solved."
            return StepResult(observation, 0.0, self._done, False, {"valid": False, "feedback": "unparseable"})
        self._given = answer
        self._done = True
        self._success = answer == self._task.spec["answer"]
        observation = "Correct." if self._success else "Wrong answer."
        return StepResult(observation, 1.0 if self._success else 0.0, True, self._success,
                          {"valid": True, "feedback": "ok"})

    def hindsight(self) -> list[str]:
        """The answer and its worked steps; once answered wrongly, by how much it was off."""
        if self._task is None:
            return []
        spec = self._task.spec
        facts = [f"The question was: {spec['question']}", f"The answer is {spec['answer']}.",
                 f"Worked solution: {'; '.join(spec['steps'])}."]
        if self._given is not None and not self._success:
            facts.append(f"You answered {self._given}, off by {self._given - spec['answer']:+d}.")
        if self._n_unparseable:
            facts.append(f"{self._n_unparseable} of your replies held no integer answer.")
        return facts

    def canonicalize(self, action: str) -> str:
        """`answer<integer>` for a direct answer, `answer<working,integer>` when the reply shows working
        (an '=' or more than one number), `invalid<>` without an integer."""
        if parse_answer(action) is None:
            return "invalid<>"
        line = action.strip().splitlines()[0]
        worked = "=" in line or len(_NUMBER_RE.findall(line)) > 1
        return "answer<working,integer>" if worked else "answer<integer>"

    def instructions(self) -> str:
        return ("You solve arithmetic and word problems. Reply with one line: optionally short working, "
                "then 'Answer: <integer>' (for example 'Answer: 42'). Every answer is a whole number.")

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        """Four solved problems with one-line working, as many steps as each problem has (the last two
        have one: with two-step examples last, SmolLM2-135M added a spurious second step to one-step
        problems)."""
        return [(question, None, reply) for question, reply in _DEMO]

    def expert_action(self) -> str | None:
        if self._task is None or self._done:
            return None
        return f"Answer: {self._task.spec['answer']}"

    def solution(self) -> list[str] | None:
        """One reply: the worked steps, then the answer ("8 - 3 = 5, 5 * 4 = 20. Answer: 20", the
        demonstration's format)."""
        if self._task is None:
            return None
        spec = self._task.spec
        return [f"{', '.join(spec['steps'])}. Answer: {spec['answer']}"]

    def rules(self) -> list[str]:
        """How to read this problem's form (a story, or an expression with its precedence), to show
        the working of a multi-step problem, and the reply format. No number of the problem is named."""
        if self._task is None:
            return []
        spec = self._task.spec
        ops = {step.split()[1] for step in spec["steps"]}
        rules = []
        if spec["form"] == "word":
            rules.append("Turn each sentence into one operation on the running total, in order: finding or "
                         "getting more adds, giving away or losing subtracts, 'times as many' multiplies, "
                         "sharing equally and keeping one share divides.")
        elif ops & {"*", "/"} and ops & {"+", "-"}:
            rules.append("Multiply and divide before adding and subtracting, and work out parentheses first.")
        else:
            rules.append("Work the operations from left to right.")
        if len(spec["steps"]) > 1:
            rules.append("Write each intermediate result before the next operation: one slip changes the answer.")
        rules.append("End the one-line reply with 'Answer: <integer>'; every answer is a whole number.")
        return rules

    def random_action(self, rng: random.Random) -> str:
        """A uniformly random guess between 0 and twice the largest number in the question (the
        random-policy baseline of the survey)."""
        assert self._task is not None
        numbers = [int(n) for n in re.findall(r"\d+", self._task.spec["question"])]
        return f"Answer: {rng.randint(0, 2 * max(numbers))}"
