"""Tool use: multi-turn questions that need a calculator and a lookup table, with exact answers.

Each task is a question about a small shop whose price list the agent cannot see: the items have
made-up names ("zorblet", "quimfen") and random integer prices, so the only way to the answer is
to call the tools. Three tools, described as JSON schemas in the transformers / TRL chat-template
convention (`tools()`; the same text is in `instructions()`):

    calculator(expression)  evaluates + - * / // % ** and parentheses exactly
    lookup(item)            the price of an item in the shop's table
    answer(value)           the final answer (an integer); ends the episode

The action is plain text holding one call, in either form:

    lookup(item="zorblet")          calculator("3 * 17 + 2 * 5")        answer(61)
    {"name": "lookup", "arguments": {"item": "zorblet"}}   (optionally inside <tool_call>...</tool_call>)

Only the first non-blank line counts (the JSON form may span lines inside a tool_call block).
A malformed call, an unknown tool, a bad argument or a tool error gets an observation starting
with "Error:" that says what was wrong, `info["valid"] = False`, and the episode goes on until
`answer` or `max_steps` calls. Reward 1.0 when the answer is exactly right, else 0.

Task types: `calc` (big arithmetic, no table needed), `lookup` (one price), `lookup_calc`
(the total of two quantities of two items), `compare` (how much more one item costs than
another). Splits: a question is assigned to a split by a hash of its text (about 1 in 5
held-out), so no held-out question is a training question.
"""

from __future__ import annotations

import ast
import json
import random
import re
from fractions import Fraction
from typing import Any

from rsiflow.envs.base import Env, StepResult, TaskSpec, sample_hashed_tasks, step_guard

TASK_TYPES = ("calc", "lookup", "lookup_calc", "compare")
TOOL_NAMES = ("calculator", "lookup", "answer")
MAX_CALL_CHARS = 400
MAX_MAGNITUDE = 10**15

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z", "br", "gl", "tr", "sn")
_VOWELS = ("a", "e", "i", "o", "u")
_ENDINGS = ("let", "fen", "dox", "mit", "rel", "nak", "pin", "zor", "lum", "wick")

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calculator",
        "description": ("Evaluate an arithmetic expression exactly: integers and decimals, + - * / // % ** "
                        "and parentheses."),
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "description": "The expression, e.g. \"3 * 17 + 2\"."}},
            "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "lookup",
        "description": "The price (in dollars) of an item in the shop's price list.",
        "parameters": {"type": "object", "properties": {
            "item": {"type": "string", "description": "The item's name, e.g. \"zorblet\"."}},
            "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "answer",
        "description": "Give the final answer to the question (an integer). Ends the episode.",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "integer", "description": "The answer."}},
            "required": ["value"]}}},
]
_ARG_NAMES = {tool["function"]["name"]: tool["function"]["parameters"]["required"][0] for tool in TOOLS}

CALL_FORMAT = ('one call per reply, e.g. lookup(item="zorblet"), calculator(expression="3 * 17 + 2"), '
               'answer(value=61), or JSON {"name": "lookup", "arguments": {"item": "zorblet"}}')


class ToolError(Exception):
    """A call that can't be executed: what to tell the agent and the feedback kind."""

    def __init__(self, message: str, feedback: str):
        super().__init__(message)
        self.message = message
        self.feedback = feedback


# ---- parsing calls ----------------------------------------------------------------------------

def _call_text(text: str) -> str:
    """The part of a reply holding the call: a <tool_call> block's body, else the first non-blank line."""
    block = re.search(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL)
    if block:
        return " ".join(block.group(1).split())
    lines = [line for line in text.strip().splitlines() if line.strip()]
    line = lines[0].strip() if lines else ""
    line = re.sub(r"^(?:>\s*|action\s*:\s*|call\s*:\s*)+", "", line, flags=re.IGNORECASE)
    return line.strip().strip("`").strip()


def parse_call(text: str) -> tuple[str, Any]:
    """(tool name, its one argument) of a reply; raises ToolError ("unparseable", "unknown_tool",
    "bad_arguments") with a message for the agent."""
    call = _call_text(text)
    if not call:
        raise ToolError(f"Error: empty reply. Make {CALL_FORMAT}.", "unparseable")
    if len(call) > MAX_CALL_CHARS:
        raise ToolError(f"Error: the call is too long ({len(call)} characters; at most {MAX_CALL_CHARS}).",
                        "unparseable")
    if call.startswith("{"):
        return _parse_json_call(call)
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*\.?", call, re.DOTALL)
    if not match:
        raise ToolError(f'Error: could not parse a tool call in "{_shorten(call)}". Make {CALL_FORMAT}.',
                        "unparseable")
    name, inner = match.group(1), match.group(2)
    _check_tool(name)
    try:
        node = ast.parse(f"f({inner})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        if name == "calculator":
            return name, inner.strip()   # calculator(3*(4+5) — the calculator reports the problem
        raise ToolError(f"Error: could not read the arguments of {name}: \"{_shorten(inner)}\". "
                        f"Make {CALL_FORMAT}.", "bad_arguments") from None
    assert isinstance(node, ast.Call)
    expected = _ARG_NAMES[name]
    values = [(None, a) for a in node.args] + [(k.arg, k.value) for k in node.keywords]
    if len(values) != 1 or (values[0][0] not in (None, expected)):
        raise ToolError(f"Error: {name} takes exactly one argument, {expected}; e.g. {_example(name)}.",
                        "bad_arguments")
    value = values[0][1]
    if isinstance(value, ast.Constant) and isinstance(value.value, (str, int, float)) \
            and not isinstance(value.value, bool):
        return name, value.value
    if name == "lookup" and isinstance(value, ast.Name):   # lookup(zorblet)
        return name, value.id
    if name in ("calculator", "answer"):   # calculator(3 * 7), answer(-4): the source text itself
        return name, ast.get_source_segment(f"f({inner})", value) or ""
    raise ToolError(f"Error: {name}'s {expected} must be a quoted string; e.g. {_example(name)}.", "bad_arguments")


def _parse_json_call(call: str) -> tuple[str, Any]:
    try:
        data = json.loads(call)
    except (ValueError, RecursionError):
        raise ToolError(f'Error: the JSON call is not valid JSON: "{_shorten(call)}". Make {CALL_FORMAT}.',
                        "unparseable") from None
    if not isinstance(data, dict):
        raise ToolError(f"Error: a JSON call must be an object. Make {CALL_FORMAT}.", "unparseable")
    name = data.get("name", data.get("tool"))
    if not isinstance(name, str):
        raise ToolError(f'Error: the JSON call has no "name". Make {CALL_FORMAT}.', "unparseable")
    _check_tool(name)
    args = data.get("arguments", data.get("args", {}))
    if isinstance(args, str):   # OpenAI-style arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            args = None
    expected = _ARG_NAMES[name]
    if not isinstance(args, dict) or set(args) != {expected} or isinstance(args[expected], (dict, list, bool)) \
            or args[expected] is None:
        raise ToolError(f'Error: {name} takes "arguments": {{"{expected}": ...}}; e.g. {_example(name)}.',
                        "bad_arguments")
    return name, args[expected]


def _check_tool(name: str) -> None:
    if name not in TOOL_NAMES:
        raise ToolError(f'Error: unknown tool "{_shorten(name, 30)}". The tools are {", ".join(TOOL_NAMES)}.',
                        "unknown_tool")


def _example(name: str) -> str:
    return {"calculator": 'calculator(expression="3 * 17 + 2")', "lookup": 'lookup(item="zorblet")',
            "answer": "answer(value=61)"}[name]


def _shorten(text: str, limit: int = 60) -> str:
    printable = "".join(c if c.isprintable() else " " for c in text)
    return printable if len(printable) <= limit else printable[:limit] + "..."


# ---- the calculator ---------------------------------------------------------------------------

def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; raises ToolError("tool_error") on anything else."""
    text = str(expression).strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise ToolError("Error: calculator: the expression is empty.", "tool_error")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f'Error: calculator: "{_shorten(text)}" is not an arithmetic expression.',
                        "tool_error") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ToolError("Error: calculator: the expression is nested too deeply.", "tool_error") from None
    return value


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        op = type(node.op)
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise ToolError("Error: calculator: division by zero.", "tool_error")
        if op is ast.Pow:
            if right.denominator != 1 or abs(right) > 64:
                raise ToolError("Error: calculator: exponents must be whole numbers up to 64.", "tool_error")
            if left == 0 and right < 0:
                raise ToolError("Error: calculator: division by zero.", "tool_error")
            if abs(left) > 1 and abs(right) * max(len(str(left.numerator)), len(str(left.denominator))) > 40:
                raise ToolError("Error: calculator: the result is too large.", "tool_error")
        result = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right,
                  ast.Div: lambda: left / right, ast.FloorDiv: lambda: Fraction(left // right),
                  ast.Mod: lambda: left % right, ast.Pow: lambda: left ** int(right)}.get(op)
        if result is None:
            raise ToolError(f"Error: calculator: the operator {type(node.op).__name__} is not supported.", "tool_error")
        return _bounded(result())
    raise ToolError("Error: calculator: only numbers, + - * / // % ** and parentheses are allowed.", "tool_error")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ToolError("Error: calculator: the result is too large.", "tool_error")
    return value


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def _as_integer(value: Any) -> int | None:
    """An answer's integer value ("42", 42, 42.0, "Answer: 42"), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    match = re.fullmatch(r"\s*(?:answer\s*[:=]?\s*)?(-?\d[\d,]*)(?:\.0+)?\s*\.?\s*", str(value), re.IGNORECASE)
    if not match or not re.fullmatch(r"-?\d{1,3}(?:,\d{3})*|-?\d+", match.group(1)):
        return None
    return int(match.group(1).replace(",", ""))


# ---- tasks ------------------------------------------------------------------------------------

def _item_name(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_ENDINGS)


def generate_task(task_type: str, rng: random.Random) -> dict[str, Any]:
    """One task (JSON-ready): the question, the shop's table, the answer and the expert's plan."""
    names: list[str] = []
    while len(names) < 5:
        name = _item_name(rng)
        if name not in names:
            names.append(name)
    table = {name: rng.randint(2, 99) for name in names}
    a, b = names[0], names[1]
    if task_type == "calc":
        x, y, z = rng.randint(100, 9999), rng.randint(11, 99), rng.randint(100, 9999)
        op = rng.choice(["+", "-"])
        expression = f"{x} * {y} {op} {z}"
        question = f"What is {x} * {y} {op} {z}?"
        lookups: list[str] = []
    elif task_type == "lookup":
        question = f"How many dollars does one {a} cost?"
        expression, lookups = None, [a]
    elif task_type == "lookup_calc":
        m, n = rng.randint(2, 12), rng.randint(2, 12)
        question = f"How many dollars do {m} {a}s and {n} {b}s cost in total?"
        expression, lookups = f"{m} * {table[a]} + {n} * {table[b]}", [a, b]
    elif task_type == "compare":
        if table[a] == table[b]:
            table[a] += 1
        if table[a] < table[b]:
            a, b = b, a
        question = f"How many dollars more does one {a} cost than one {b}?"
        expression, lookups = f"{table[a]} - {table[b]}", [a, b]
    else:
        raise ValueError(f"unknown tooluse task type {task_type!r}")
    answer = int(calculate(expression)) if expression else table[a]
    return {"question": question, "table": table, "answer": answer, "lookups": lookups,
            "expression": expression}


_DEMO_SPEC = {"question": "How many dollars do 3 glomits and 2 tuzor cost in total?",
              "table": {"glomit": 14, "tuzor": 25, "brafen": 7}, "answer": 92,
              "lookups": ["glomit", "tuzor"], "expression": "3 * 14 + 2 * 25"}


class ToolUseEnv(Env):
    """Calculator + lookup-table questions; see the module docstring.

    task_types: the task types to sample (default all four), round-robin; the instance's `task_types`.
    max_steps: calls per episode, malformed ones included; the episode then ends unsolved.
    """

    name = "tooluse"

    def __init__(self, task_types: list[str] | tuple[str, ...] | None = None, max_steps: int = 8):
        chosen = tuple(task_types) if task_types else TASK_TYPES
        unknown = [t for t in chosen if t not in TASK_TYPES]
        if unknown or max_steps < 1:
            raise ValueError(f"tooluse: task_types must be among {TASK_TYPES} (got {unknown}) and max_steps >= 1")
        self.task_types = chosen
        self.max_steps = max_steps
        self._task: TaskSpec | None = None

    def tools(self) -> list[dict[str, Any]]:
        """The tools as JSON schemas (transformers' `apply_chat_template(tools=...)` format); a fresh
        copy on every call."""
        return json.loads(json.dumps(TOOLS))

    def sample_tasks(self, split: str, n: int, seed: int) -> list[TaskSpec]:
        return sample_hashed_tasks(self.name, self.task_types, split, n, seed, generate_task)

    def reset(self, task: TaskSpec) -> str:
        self._task = task
        self._steps = 0
        self._done = False
        self._success = False
        self._looked_up: set[str] = set()
        self._computed: set[str] = set()     # results the calculator returned
        self._answers: list[int] = []
        self._errors: dict[str, int] = {}
        return f"{task.spec['question']}\nUse the tools; finish with answer(value=<integer>)."

    def step(self, action: str) -> StepResult:
        if (over := step_guard(self._task, self._done, self._success)) is not None:
            return over
        self._steps += 1
        reward = 0.0
        try:
            name, argument = parse_call(action)
            observation = getattr(self, f"_tool_{name}")(argument)
            info = {"valid": True, "feedback": "ok"}
            if name == "answer":
                self._done = True
                reward = 1.0 if self._success else 0.0
        except ToolError as error:
            observation = error.message
            info = {"valid": False, "feedback": error.feedback}
            self._errors[error.feedback] = self._errors.get(error.feedback, 0) + 1
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            observation += f" You have used all {self.max_steps} calls; the question is not answered."
        return StepResult(observation, reward, self._done, self._success, info)

    def _tool_calculator(self, expression: Any) -> str:
        value = format_number(calculate(str(expression)))
        self._computed.add(value)
        return f"calculator returned: {value}"

    def _tool_lookup(self, item: Any) -> str:
        table = self._task.spec["table"]
        key = str(item).strip().lower()
        if key not in table and key.rstrip("s") in table:   # "zorblets"
            key = key.rstrip("s")
        if key not in table:
            raise ToolError(f'Error: lookup: no item "{_shorten(str(item), 30)}" in the price list. '
                            f"Items: {', '.join(sorted(table))}.", "tool_error")
        self._looked_up.add(key)
        return f"lookup returned: one {key} costs {table[key]} dollars"

    def _tool_answer(self, value: Any) -> str:
        answer = _as_integer(value)
        if answer is None:
            raise ToolError(f'Error: answer: "{_shorten(str(value), 30)}" is not an integer; e.g. answer(value=61).',
                            "bad_arguments")
        self._answers.append(answer)
        self._success = answer == self._task.spec["answer"]
        return "Correct." if self._success else "Wrong answer."

    # ---- expert, hindsight, symbols -----------------------------------------------------------

    def expert_action(self) -> str | None:
        """Look up every item the question needs, compute the expression, answer."""
        if self._task is None or self._done:
            return None
        spec = self._task.spec
        for item in spec["lookups"]:
            if item not in self._looked_up:
                return f'lookup(item="{item}")'
        if spec["expression"] and str(spec["answer"]) not in self._computed:
            return f'calculator(expression="{spec["expression"]}")'
        return f"answer(value={spec['answer']})"

    def solution(self) -> list[str] | None:
        """Look up every item the question needs, compute the expression (where there is one), answer."""
        if self._task is None:
            return None
        spec = self._task.spec
        plan = [f'lookup(item="{item}")' for item in spec["lookups"]]
        plan += [f'calculator(expression="{spec["expression"]}")'] if spec["expression"] else []
        return plan + [f"answer(value={spec['answer']})"]

    def rules(self) -> list[str]:
        """What the task type needs (which tools, how to combine the prices) and the call format; no
        item, price or number of the task is named."""
        if self._task is None:
            return []
        rules = {
            "calc": ["Compute with calculator(expression=...) instead of by hand: large products are easy "
                     "to get wrong."],
            "lookup": ["Prices are only known through lookup(item=...): look up the item the question names; "
                       "never guess a price."],
            "lookup_calc": ["Prices are only known through lookup(item=...): look up every item the question "
                            "names before computing.",
                            "Multiply each item's quantity by its price and add the products in one calculator "
                            "call."],
            "compare": ["Prices are only known through lookup(item=...): look up both items before computing.",
                        "Subtract the cheaper item's price from the dearer item's price."],
        }[self._task.task_type]
        return rules + ["Make one tool call per reply and finish with answer(value=<integer>), giving the number "
                        "the tools produced."]

    def random_action(self, rng: random.Random) -> str:
        """A random well-formed call: a lookup of an item named in the question (or a made-up one),
        a calculator call on numbers seen so far, or an answer among those numbers (the survey's
        random-policy baseline)."""
        assert self._task is not None
        spec = self._task.spec
        words = re.findall(r"[a-z]+", spec["question"])
        items = [w.rstrip("s") for w in words if w.rstrip("s") in spec["table"]] or list(spec["table"])
        numbers = [int(n) for n in re.findall(r"\d+", spec["question"])] or [0]
        numbers += [int(v) for v in self._computed if v.lstrip("-").isdigit()]
        numbers += [spec["table"][k] for k in self._looked_up]
        kind = rng.choice(["lookup", "calculator", "answer"])
        if kind == "lookup":
            return f'lookup(item="{rng.choice(items)}")'
        if kind == "calculator":
            return f'calculator(expression="{rng.choice(numbers)} {rng.choice("+-*")} {rng.choice(numbers)}")'
        return f"answer(value={rng.choice(numbers)})"

    def hindsight(self) -> list[str]:
        if self._task is None:
            return []
        spec = self._task.spec
        facts = [f"The question was: {spec['question']}"]
        facts += [f"lookup(item=\"{item}\") returns {spec['table'][item]} dollars." for item in spec["lookups"]]
        if spec["expression"]:
            facts.append(f"The answer is {spec['expression']} = {spec['answer']}.")
        else:
            facts.append(f"The answer is {spec['answer']}.")
        plan = self.solution()
        facts.append(f"A {len(plan)}-call solution: {'; '.join(plan)}.")
        missed = [i for i in spec["lookups"] if i not in self._looked_up]
        if self._done and not self._success:
            if missed:
                facts.append(f"You never looked up {', '.join(missed)}.")
            wrong = [a for a in self._answers if a != spec["answer"]]
            if wrong:
                facts.append(f"You answered {wrong[-1]}, off by {wrong[-1] - spec['answer']:+d}.")
            if not self._answers:
                facts.append("You never called answer(...).")
        for kind, count in sorted(self._errors.items()):
            facts.append(f"{count} of your calls failed with {kind.replace('_', ' ')}.")
        return facts

    def canonicalize(self, action: str) -> str:
        """`tool<argument>` of a well-formed call (`lookup<item>`, `calculator<expression>`,
        `answer<value>`), `invalid<>` otherwise."""
        try:
            name, _ = parse_call(action)
        except ToolError:
            return "invalid<>"
        return f"{name}<{_ARG_NAMES[name]}>"

    def instructions(self) -> str:
        lines = [f"- {t['function']['name']}({_ARG_NAMES[t['function']['name']]}): {t['function']['description']}"
                 for t in TOOLS]
        return ("You answer questions about a shop by calling tools. The prices are only known through lookup. "
                "Reply with exactly one tool call per turn, no explanation. Tools:\n" + "\n".join(lines)
                + f"\nFormat: {CALL_FORMAT}.")

    def demonstration(self) -> list[tuple[str, list[str] | None, str]]:
        """The expert solving a fixed lookup_calc task (lookup, lookup, calculator, answer)."""
        demo = ToolUseEnv(max_steps=self.max_steps + 4)
        observation = demo.reset(TaskSpec(env=self.name, split="train", task_type="lookup_calc", seed=0,
                                          spec=_DEMO_SPEC))
        turns = []
        while (action := demo.expert_action()) is not None:
            turns.append((observation, None, action))
            observation = demo.step(action).observation
        return turns
