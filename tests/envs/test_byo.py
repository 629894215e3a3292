"""Bring your own env: the one-file example, its config, and loading 'package.module:Class' from
the current directory the way the `rsiflow` console script does (no cwd on sys.path)."""

import subprocess
import sys

from rsiflow.configs.loader import load_config
from rsiflow.envs import make_env
from tests.conftest import REPO


def test_byo_config_names_the_example_class():
    cfg = load_config([REPO / "configs" / "default.yaml", REPO / "examples" / "byo.yaml"])
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    assert type(env).__name__ == "CountdownEnv" and env.max_steps == 3


def test_a_user_module_is_found_in_the_current_directory():
    code = ("import sys; assert '' not in sys.path and not any(p.rstrip('/') == '.' for p in sys.path); "
            "from rsiflow.envs import make_env; env = make_env('examples.countdown_env:CountdownEnv'); print(env.name)")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "countdown"


def test_the_example_plays_a_wrong_then_a_right_expression():
    env = make_env("examples.countdown_env:CountdownEnv")
    task = env.sample_tasks("heldout", 1, seed=0)[0]
    assert env.reset(task).startswith("Numbers: ")
    first = env.step("1 + 1")
    assert not first.done or env.max_steps == 1
    numbers = task.spec["numbers"]
    bad = env.step(f"{numbers[0]} + {numbers[0]} + {numbers[0]}")
    if numbers.count(numbers[0]) < 3:
        assert bad.info == {"valid": False, "feedback": "invalid_expression"} and "at most once" in bad.observation
    env.reset(task)
    result = env.step(task.spec["solution"])
    assert result.success and result.done
    assert env.canonicalize("(6 + 4) * 3") == "expr<3>" and env.canonicalize("hello") == "invalid<>"


def test_the_example_gives_its_solution_and_rules():
    env = make_env("examples.countdown_env:CountdownEnv")
    assert env.solution() is None and env.rules() == []
    task = env.sample_tasks("train", 1, seed=0)[0]
    env.reset(task)
    assert env.solution() == [task.spec["solution"]] and env.step(task.spec["solution"]).success
    assert env.rules() and not any(c.isdigit() for rule in env.rules() for c in rule)
