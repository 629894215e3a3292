"""Countdown: a complete bring-your-own rsiflow env in one file.

Reach a target number by combining some of the given numbers with + - * / (each number used at
most once). The reply is one line holding the expression, e.g. "(6 + 4) * 3" or "6 * 3 + 4 = 22".
A wrong expression gets its value as feedback ("that makes 18, not 22") and the agent tries again,
up to `max_steps` replies; a reply that is not such an expression gets an observation saying why.

Run it from a config (`env.name: examples.countdown_env:CountdownEnv`, see examples/byo.yaml):

    rsiflow run --config configs/default.yaml --config examples/byo.yaml

and check that it honours the interface:

    rsiflow check-env examples.countdown_env:CountdownEnv

What an env provides (envs/base.py):
  name                           class attribute: the env's name
  task_types                     class attribute, or an instance attribute set in __init__ (where they
                                 come from the kwargs or the env's data); results are broken down by them
  admissible_exact               class attribute, default True: every listed admissible action is accepted
  sample_tasks(split, n, seed)   deterministic TaskSpecs; "train" and "heldout" never overlap
  reset(task) -> str             start a task; the observation states the goal
  step(action) -> StepResult     observation, reward, done, success, info{valid, feedback}; never raises
  admissible_actions()           the valid actions where the env knows them (None: free-form)
  hindsight() -> list[str]       privileged facts about the episode (a solution, what went wrong)
  canonicalize(action) -> str    a `verb<role,...>` symbol without the concrete arguments
  instructions() -> str          the system prompt: what the agent is and the exact action format
  demonstration()                few-shot turns [(observation, admissible or None, action)]
  expert_action()                a scripted expert's next action (optional; enables checks)
  solution()                     the actions that solve the current task from its start (optional)
  rules()                        general rules for tasks like this one, without its answer (optional)
  tools()                        JSON schemas of tool-call actions for the chat template (optional)
  close()                        release resources
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import random
from fractions import Fraction

from rsiflow.envs.base import SPLITS, Env, StepResult, TaskSpec, step_guard

OPS = ("+", "-", "*", "/")


def _value(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of an expression of integers and + - * /; records the integers used."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.Div):
        left, right = _value(node.left, used), _value(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right,
                ast.Div: left / right if right else left}[type(node.op)]
    raise ValueError("only whole numbers, + - * / and parentheses are allowed")


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """(value, numbers used) of a reply's expression; raises ValueError saying what is wrong."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    expression = (lines[0] if lines else "").split("=")[0].strip().replace("×", "*").replace("x", "*")
    if not expression or len(expression) > 200:
        raise ValueError("write one expression of at most 200 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"{expression[:40]!r} is not an arithmetic expression") from None
    used: list[int] = []
    try:
        return _value(tree.body, used), used
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def solve(numbers: list[int], target: int) -> str | None:
    """An expression reaching `target` from some of `numbers` (exhaustive search), or None."""
    exprs = {}
    for i, n in enumerate(numbers):
        exprs[frozenset([i])] = {Fraction(n): str(n)}
    for size in range(2, len(numbers) + 1):
        for subset in itertools.combinations(range(len(numbers)), size):
            key, found = frozenset(subset), {}
            for r in range(1, size):
                for left in itertools.combinations(subset, r):
                    lk = frozenset(left)
                    for a, ea in exprs.get(lk, {}).items():
                        for b, eb in exprs.get(key - lk, {}).items():
                            for op in OPS:
                                if op == "/" and b == 0:
                                    continue
                                v = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0}[op]
                                found.setdefault(v, f"({ea} {op} {eb})")
            exprs[key] = found
    for key in sorted(exprs, key=len):
        if Fraction(target) in exprs[key]:
            expr = exprs[key][Fraction(target)]
            return expr[1:-1] if expr.startswith("(") and expr.endswith(")") else expr
    return None


class CountdownEnv(Env):
    """Countdown with 3 or 4 numbers. max_steps: replies per episode."""

    name = "countdown"
    task_types = ("three_numbers", "four_numbers")

    def __init__(self, max_steps: int = 3):
        if max_steps < 1:
            raise ValueError("countdown needs max_steps >= 1")
        self.max_steps = max_steps
        self._task: TaskSpec | None = None

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        """Task i comes from its own RNG seeded by (split, seed, i); a puzzle belongs to the split its
        hash says (about 1 in 5 held out), so train and held-out puzzles never overlap."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        tasks = []
        for i in range(n):
            task_type = self.task_types[i % 2]
            rng = random.Random(f"countdown:{split}:{seed}:{i}")
            while True:
                numbers = [rng.randint(1, 12) for _ in range(3 if task_type == "three_numbers" else 4)]
                target = rng.randint(10, 60)
                digest = hashlib.sha1(f"{sorted(numbers)}:{target}".encode()).hexdigest()
                in_split = ("heldout" if int(digest, 16) % 5 == 0 else "train") == split
                if in_split and target not in numbers and (solution := solve(numbers, target)):
                    break
            spec = {"numbers": numbers, "target": target, "solution": solution}
            tasks.append(TaskSpec(self.name, split, task_type, int(digest[:8], 16), spec))
        return tasks

    def reset(self, task: TaskSpec) -> str:
        self._task, self._steps, self._done, self._success = task, 0, False, False
        self._tries: list[str] = []
        numbers = ", ".join(map(str, task.spec["numbers"]))
        return f"Numbers: {numbers}. Target: {task.spec['target']}."

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        self._steps += 1
        spec = self._task.spec
        try:
            value, used = evaluate(action)
            pool = list(spec["numbers"])
            for n in used:
                if n not in pool:
                    given = ", ".join(map(str, spec["numbers"]))
                    raise ValueError(f"{n} is not among the numbers left to use ({given}; each at most once)")
                pool.remove(n)
        except ValueError as error:
            observation, info = f"Invalid: {error}.", {"valid": False, "feedback": "invalid_expression"}
        else:
            info = {"valid": True, "feedback": "ok"}
            self._tries.append(f"{action.strip().splitlines()[0][:80]} = {float(value):g}")
            self._success = value == spec["target"]
            shown = str(value) if value.denominator == 1 else f"{float(value):.3g}"
            observation = "Correct." if self._success else f"That makes {shown}, not {spec['target']}. Try again."
        self._done = self._success or self._steps >= self.max_steps
        if self._done and not self._success:
            observation += " No tries left."
        return StepResult(observation, 1.0 if self._success else 0.0, self._done, self._success, info)

    def hindsight(self) -> list[str]:
        if self._task is None:
            return []
        spec = self._task.spec
        facts = [f"A solution: {spec['solution']} = {spec['target']}."]
        facts += [f"You tried {t}." for t in self._tries]
        return facts

    def canonicalize(self, action: str) -> str:
        """`expr<n_numbers>`, e.g. `expr<3>` for "(6 + 4) * 3"; `invalid<>` when it doesn't parse."""
        try:
            _, used = evaluate(action)
        except ValueError:
            return "invalid<>"
        return f"expr<{len(used)}>"

    def instructions(self) -> str:
        return ("Reach the target number by combining some of the given numbers with + - * / and parentheses, "
                "each number at most once. Reply with one line: the expression only, e.g. (6 + 4) * 3.")

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        return [("Numbers: 3, 7, 2. Target: 20.", None, "(3 + 7) * 2"),
                ("Numbers: 9, 4, 5, 1. Target: 41.", None, "9 * 4 + 5")]

    def expert_action(self) -> str | None:
        return None if self._task is None or self._done else self._task.spec["solution"]

    def solution(self) -> list[str] | None:
        """One reply: the expression the task was generated with."""
        return None if self._task is None else [self._task.spec["solution"]]

    def rules(self) -> list[str]:
        """The game's rules and the reply format, without this puzzle's numbers."""
        if self._task is None:
            return []
        return ["Use only the given numbers, each at most once; you need not use all of them.",
                "Check that the expression's value equals the target exactly before replying.",
                "Reply with the expression only, on one line."]

    def random_action(self, rng: random.Random) -> str:
        """Random numbers from the task joined by random operators (a random-policy baseline)."""
        numbers = list(self._task.spec["numbers"])
        rng.shuffle(numbers)
        picked = numbers[: rng.randint(2, len(numbers))]
        return " ".join(f"{n} {rng.choice(OPS)}" for n in picked[:-1]) + f" {picked[-1]}"
