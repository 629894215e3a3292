"""A user's own folder with packages named like rsiflow's subpackages (`envs`, `models`, `tasks`): rsiflow installs
one top-level package, `rsiflow`, so the user's `envs` is theirs, and `rsiflow check-env` run from that folder
checks the user's env and names the file it loaded it from (issue 23)."""

import subprocess
import sys
import textwrap
from pathlib import Path

# The user's env: a whole small Env subclass, importing rsiflow's interface by its installed name.
COUNTDOWN = textwrap.dedent('''
    """A one-step countdown: reach the target with one + of two of the given numbers."""

    from rsiflow.envs.base import SPLITS, Env, StepResult, TaskSpec, step_guard


    class CountdownEnv(Env):
        name = "countdown"
        task_types = ("sum",)

        def __init__(self):
            self._task = None

        def sample_tasks(self, split, n, seed):
            if split not in SPLITS:
                raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
            base = 0 if split == "train" else 1000
            tasks = []
            for i in range(n):
                a, b = 1 + (seed + i) % 9, 2 + (3 * i + seed) % 7
                spec = {"numbers": [a, b, 11 if split == "train" else 12], "target": a + b}   # splits never share one
                tasks.append(TaskSpec(self.name, split, "sum", base + i, spec))
            return tasks

        def reset(self, task):
            self._task, self._done, self._success = task, False, False
            numbers = ", ".join(map(str, task.spec["numbers"]))
            return f"Numbers: {numbers}. Target: {task.spec['target']}. Reply with one sum, e.g. 1 + 2."

        def step(self, action):
            if (over := step_guard(self._task, self._done, self._success)) is not None:
                return over
            parts = [p.strip() for p in action.split("+")]
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                return StepResult("Invalid: write two numbers joined by +.", 0.0, False, False,
                                  {"valid": False, "feedback": "invalid_expression"})
            self._done = True
            self._success = sum(map(int, parts)) == self._task.spec["target"]
            return StepResult("Correct." if self._success else "Wrong.", float(self._success), True,
                              self._success, {"valid": True, "feedback": "ok"})

        def hindsight(self):
            return [] if self._task is None else [f"A solution: {self.solution()[0]}."]

        def canonicalize(self, action):
            return "sum<>" if "+" in action else "invalid<>"

        def instructions(self):
            return "Reach the target by adding two of the given numbers. Reply with the sum only, e.g. 1 + 2."

        def demonstration(self):
            return [("Numbers: 3, 4, 11. Target: 7.", None, "3 + 4")]

        def expert_action(self):
            return None if self._task is None or self._done else self.solution()[0]

        def solution(self):
            if self._task is None:
                return None
            a, b, _ = self._task.spec["numbers"]
            return [f"{a} + {b}"]
''')


def _user_folder(root: Path) -> Path:
    """A user's folder holding packages of its own named envs, models and tasks."""
    (root / "envs").mkdir(parents=True)
    (root / "envs" / "__init__.py").write_text('MARK = "user envs"\n')
    (root / "envs" / "countdown.py").write_text(COUNTDOWN)
    for pkg in ("models", "tasks"):
        (root / pkg).mkdir()
        (root / pkg / "__init__.py").write_text(f'MARK = "user {pkg}"\n')
    return root


def test_check_env_from_a_user_folder_checks_the_users_env_and_names_its_file(tmp_path):
    folder = _user_folder(tmp_path / "work")
    rsiflow = Path(sys.executable).with_name("rsiflow")
    out = subprocess.run([str(rsiflow), "check-env", "envs.countdown:CountdownEnv", "--tasks", "3", "--fuzz", "50"],
                         cwd=folder, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    header = out.stdout.splitlines()[:2]
    assert header[0].startswith("conformance of envs.countdown:CountdownEnv ("), out.stdout
    assert str(folder / "envs" / "countdown.py") in header[1], out.stdout
    assert "conformance of envs.countdown:CountdownEnv: PASS" in out.stdout


def test_the_users_packages_and_rsiflows_coexist(tmp_path):
    folder = _user_folder(tmp_path / "work")
    code = ("import rsiflow.envs, rsiflow.models.backend, rsiflow.tasks, envs, models, tasks, envs.countdown; "
            "print(envs.MARK, models.MARK, tasks.MARK, sep='|'); "
            "print(envs.countdown.CountdownEnv.__mro__[1] is rsiflow.envs.Env); "
            "print(rsiflow.envs.make_env('arithmetic').name); "
            "print(rsiflow.envs.make_env('envs.countdown:CountdownEnv').name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["user envs|user models|user tasks", "True", "arithmetic", "countdown"]
