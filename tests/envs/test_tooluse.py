"""ToolUseEnv: the declared call formats, errors as observations (never exceptions), the
calculator's safety, the expert, hindsight and the JSON tool schemas."""

import json

import pytest

from rsiflow.envs.base import TaskSpec
from rsiflow.envs.tooluse import TASK_TYPES, TOOLS, ToolError, ToolUseEnv, calculate, parse_call


def _task():
    spec = {"question": "How many dollars do 3 zorblets and 2 quimfen cost in total?",
            "table": {"zorblet": 17, "quimfen": 5, "brafen": 40}, "answer": 61,
            "lookups": ["zorblet", "quimfen"], "expression": "3 * 17 + 2 * 5"}
    return TaskSpec(env="tooluse", split="train", task_type="lookup_calc", seed=0, spec=spec)


@pytest.mark.parametrize("text, call", [
    ('lookup(item="zorblet")', ("lookup", "zorblet")),
    ("lookup('zorblet')", ("lookup", "zorblet")),
    ("lookup(zorblet)", ("lookup", "zorblet")),
    ('calculator(expression="3 * 17")', ("calculator", "3 * 17")),
    ("calculator(3 * 17 + 2)", ("calculator", "3 * 17 + 2")),
    ("answer(61)", ("answer", 61)), ("answer(value=61)", ("answer", 61)), ("answer(-4)", ("answer", "-4")),
    ('{"name": "lookup", "arguments": {"item": "zorblet"}}', ("lookup", "zorblet")),
    ('{"tool": "answer", "arguments": {"value": 61}}', ("answer", 61)),
    ('{"name": "calculator", "arguments": "{\\"expression\\": \\"2+2\\"}"}', ("calculator", "2+2")),
    ('<tool_call>\n{"name": "lookup", "arguments": {"item": "brafen"}}\n</tool_call>', ("lookup", "brafen")),
    ('Action: lookup(item="zorblet")\nthen more', ("lookup", "zorblet")),
    ('`answer(value=61)`', ("answer", 61)),
])
def test_call_formats(text, call):
    assert parse_call(text) == call


@pytest.mark.parametrize("text, feedback, words", [
    ("", "unparseable", "empty reply"),
    ("The answer is 61", "unparseable", "could not parse a tool call"),
    ("search(query='x')", "unknown_tool", 'unknown tool "search"'),
    ('{"name": "browser", "arguments": {}}', "unknown_tool", "unknown tool"),
    ("{not json", "unparseable", "not valid JSON"),
    ('{"arguments": {"item": "x"}}', "unparseable", 'no "name"'),
    ("lookup(item='a', extra=1)", "bad_arguments", "exactly one argument"),
    ("lookup(key='zorblet')", "bad_arguments", "exactly one argument, item"),
    ('{"name": "lookup", "arguments": {"key": "zorblet"}}', "bad_arguments", '"item"'),
    ("lookup(item=[1, 2])", "bad_arguments", "quoted string"),
    ("calculator(" + "1+" * 400 + "1)", "unparseable", "too long"),
])
def test_malformed_calls_say_what_is_wrong(text, feedback, words):
    with pytest.raises(ToolError) as err:
        parse_call(text)
    assert err.value.feedback == feedback and words in err.value.message


@pytest.mark.parametrize("expression, value", [("3 * 17 + 2 * 5", "61"), ("7 / 2", "3.5"), ("7 // 2", "3"),
                                                ("2 ** 10", "1024"), ("-(4 - 9)", "5"), ("0.1 + 0.2", "0.3"),
                                                ("3 × 4 ÷ 2", "6"), ("2^3", "8")])
def test_calculator(expression, value):
    from rsiflow.envs.tooluse import format_number

    assert format_number(calculate(expression)) == value


@pytest.mark.parametrize("expression, words", [
    ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "exponents"), ("10 ** 60", "too large"),
    ("__import__('os')", "only numbers"), ("x + 1", "only numbers"), ("1 +", "not an arithmetic expression"),
    ("(" * 300 + "1" + ")" * 300, "expression"), ("", "empty"), ("99999999999999999 * 99999", "too large"),
])
def test_calculator_refuses_safely(expression, words):
    with pytest.raises(ToolError) as err:
        calculate(expression)
    assert err.value.feedback == "tool_error" and words in err.value.message


def test_an_episode_with_errors_goes_on_and_the_expert_finishes_it():
    env = ToolUseEnv()
    obs = env.reset(_task())
    assert "3 zorblets and 2 quimfen" in obs and "answer(value=<integer>)" in obs
    for text, feedback in [("search(q='price')", "unknown_tool"), ("lookup(item='gizmo')", "tool_error"),
                           ("what is the price?", "unparseable"), ("answer(value='sixty')", "bad_arguments")]:
        result = env.step(text)
        assert not result.done and result.info == {"valid": False, "feedback": feedback}
        assert result.observation.startswith("Error:")
    assert env.step('lookup(item="zorblets")').observation == "lookup returned: one zorblet costs 17 dollars"
    plan = []
    while (action := env.expert_action()) is not None:
        plan.append(action)
        result = env.step(action)
    assert plan == ['lookup(item="quimfen")', 'calculator(expression="3 * 17 + 2 * 5")', "answer(value=61)"]
    assert result.success and result.reward == 1.0 and result.done
    facts = env.hindsight()
    assert 'lookup(item="zorblet") returns 17 dollars.' in facts
    assert "1 of your calls failed with unknown tool." in facts


def test_a_wrong_answer_ends_the_episode_and_hindsight_says_what_was_missed():
    env = ToolUseEnv()
    env.reset(_task())
    env.step('lookup(item="zorblet")')
    result = env.step("answer(51)")
    assert result.done and not result.success and result.reward == 0.0 and result.info["valid"]
    facts = env.hindsight()
    assert "You never looked up quimfen." in facts and "You answered 51, off by -10." in facts


def test_max_steps_ends_the_episode():
    env = ToolUseEnv(max_steps=2)
    env.reset(_task())
    assert not env.step("nonsense").done
    result = env.step("nonsense")
    assert result.done and not result.success and "used all 2 calls" in result.observation


def test_tool_schemas_follow_the_chat_template_convention():
    tools = ToolUseEnv().tools()
    assert [t["function"]["name"] for t in tools] == ["calculator", "lookup", "answer"]
    for tool in tools:
        assert tool["type"] == "function" and tool["function"]["parameters"]["type"] == "object"
        assert tool["function"]["parameters"]["required"]
    assert json.loads(json.dumps(TOOLS)) == tools


def test_tools_render_in_the_tokenizer_chat_template():
    """The schemas are accepted by transformers' apply_chat_template(tools=...) (the tiny model's
    tokenizer; its template may ignore them, but it must not reject them)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from rsiflow.models.loading import resolve_base_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model("tiny:0", Path("~/.cache/rsiflow").expanduser()))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=ToolUseEnv().tools(),
                                         tokenize=False, add_generation_prompt=True)
    assert "hi" in text


def test_splits_and_task_types():
    env = ToolUseEnv()
    train = env.sample_tasks("train", 400, seed=0)
    heldout = env.sample_tasks("heldout", 200, seed=0)
    assert [t.task_type for t in train[:4]] == list(TASK_TYPES)
    assert not {t.spec["question"] for t in train} & {t.spec["question"] for t in heldout}
    for t in train + heldout:
        assert all(item in t.spec["table"] for item in t.spec["lookups"])
    assert {t.task_type for t in ToolUseEnv(task_types=["calc"]).sample_tasks("train", 5, 0)} == {"calc"}


def test_canonicalize():
    env = ToolUseEnv()
    assert env.canonicalize('lookup(item="x")') == "lookup<item>"
    assert env.canonicalize("calculator(1+1)") == "calculator<expression>"
    assert env.canonicalize('{"name": "answer", "arguments": {"value": 3}}') == "answer<value>"
    assert env.canonicalize("frobnicate(1)") == "invalid<>"


def test_task_types_kwarg_is_the_instances_task_types():
    assert ToolUseEnv(task_types=["calc", "compare"]).task_types == ("calc", "compare")
    assert ToolUseEnv().task_types == TASK_TYPES


def test_solution_and_rules():
    env = ToolUseEnv()
    assert env.solution() is None and env.rules() == []
    env.reset(_task())
    assert env.solution() == ['lookup(item="zorblet")', 'lookup(item="quimfen")',
                              'calculator(expression="3 * 17 + 2 * 5")', "answer(value=61)"]
    for action in env.solution():
        result = env.step(action)
    assert result.done and result.success
    rules = " ".join(env.rules())
    assert "lookup(item=...)" in rules and "answer(value=<integer>)" in rules
    assert not any(word in rules for word in ("zorblet", "quimfen", "17", "61", "3 * 17"))


TOOL_TEMPLATE = (  # a Hermes-style chat template that renders the schemas, as tool-calling models' templates do
    "{%- if tools %}<tools>{{ '\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "</tools>{{ '\\n' }}{%- endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")


def test_tools_are_rendered_by_a_tool_calling_chat_template():
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = ToolUseEnv().tools()
    rendered, _ = render_jinja_template([[{"role": "user", "content": "hi"}]], tools=tools,
                                        chat_template=TOOL_TEMPLATE, add_generation_prompt=True)
    lines = rendered[0].splitlines()
    assert [json.loads(line) for line in lines[1:4]] == tools and lines[4] == "</tools>"
    assert rendered[0].endswith("<|user|>hi\n<|assistant|>")
