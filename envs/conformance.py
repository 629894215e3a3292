"""The conformance check any env can run: does it honour the `rsiflow.envs.base.Env` contract?

    rsiflow check-env arithmetic
    rsiflow check-env examples.countdown_env:CountdownEnv --kwargs '{"max_steps": 3}'
    rsiflow check-env household --tasks 200 --fuzz 3000 --max-turns 12
    rsiflow check-env --config configs/default.yaml --config examples/byo.yaml

`python -m rsiflow.envs.conformance` takes the same arguments. The header names the env class and the file it was
loaded from, and where the module of a "package.module:Class" is in more than one folder of the import path (the
current directory included: `python -m` looks there first, `rsiflow` last), it lists them all, marking the one
loaded (`shadowing_note`).

With `--config` (repeatable: later files are overlays, as with `rsiflow run`) the env's name,
kwargs and turn limit come from the config's `env.name`, `env.kwargs` and `env.max_turns`; a
positional env, `--kwargs` or `--max-turns` given as well replaces that one value. Each check's
line is printed as soon as it finishes; the exit status is 1 when a check failed.

or from Python (the test suite runs it on every built-in env and on the example env):

    from rsiflow.envs.conformance import check_env
    report = check_env("arithmetic", tasks=12, fuzz=2000)
    assert report.ok, report

Every env call (building an instance included) must return within `step_timeout` seconds
(default 60, `--step-timeout`): past it, the call is interrupted (SIGALRM), the check fails naming
the call and its task, and the remaining checks run on a fresh instance. Code that never returns to
the Python interpreter (a C loop, a call that blocks signals) can't be interrupted, so with a limit
the checks run in a child process (forked, on Linux and macOS) that announces each env call to this
one before making it: a call still running a second or 10% past the limit, or a crash of the child,
fails its check naming the call (method, shortened action, task and type) and the episode's trail,
the child is killed, and the remaining checks run in a fresh child (`_watched_checks`). A failure
that happened in an episode names its last actions and last observation (shortened).

Checks (each one PASS, FAIL with the reason, or SKIP with the reason):

    class          the instance's `name` is a non-empty str, its `task_types` a non-empty tuple of
                   distinct str (a class attribute or one set in __init__), `admissible_exact` a bool
    splits         sample_tasks gives n TaskSpecs of the right env/split/type for "train" and
                   "heldout", JSON-ready specs that survive to_row/from_row, no task id twice in
                   one sample (a run would count a repeat's trajectories once per repeat), disjoint
                   task ids across splits, every declared task type where n covers them all; an
                   unknown split raises ValueError
    determinism    same seed -> same tasks (also from a fresh instance); another seed -> other
                   tasks; the same task and actions -> the same observations, rewards and ends
    reset_step     reset gives a non-empty str; step gives a StepResult with a str observation,
                   float reward, bool done/success and info{"valid": bool, "feedback": str}
    admissible     admissible_actions() is None or a list of str, and each one it lists is
                   accepted (info["valid"] is True) when played (at least half of them where the
                   env sets `admissible_exact = False`: its lists over-generate)
    expert         where expert_action() gives actions: following it solves every sampled task
    solution       where solution() is not None: playing it from a fresh reset solves the task,
                   and it is the same list after the episode
    max_turns      with `max_turns` (--max-turns, or env.max_turns of --config): the expert and the
                   solution need at most that many steps on every task (a failure names each task's
                   id, type and the start of its spec)
    rules          rules() is a list of non-empty str that restates no clause of the task's own
                   statement (its first observation, boilerplate aside) and names no action of its
                   solution that holds a number
    tools          tools() is None or a list of chat-template function schemas with distinct names
    hindsight      hindsight() is a list of str before, during and after an episode
    canonicalize   canonicalize() gives a `verb<role,...>` symbol for any text, garbage included
    prompting      instructions() is a non-empty str; demonstration() is a list of
                   (observation str, admissible list or None, action str)
    fuzz           `fuzz` random and hostile actions (empty, huge, unicode, control characters,
                   JSON and code fragments, near-misses of real actions): step never raises, the
                   result is well-typed, a rejected action says why (feedback other than "ok")
                   and does not end the episode when it is the first action, and the expert
                   still solves the task after a hostile action
    close          close() releases resources and can be called twice

The default of 100 tasks per split is what finds a bug that hits one task in 50 with 98%
probability (12 tasks, the old default, find it with 38%) and costs under a second on household,
arithmetic and tooluse.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import pickle
import random
import re
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rsiflow.envs.base import REPEATED_IDS_FIX, SPLITS, Env, StepResult, TaskSpec, repeated_ids

SYMBOL_RE = re.compile(r"[A-Za-z_][\w\-]*<[\w,\- ]*>")
MAX_OBSERVATION_CHARS = 50_000
DEFAULT_TASKS = 100
DEFAULT_STEP_TIMEOUT = 60.0


class _CheckFailed(AssertionError):
    pass


class _Skip(Exception):
    pass


class CallTimedOut(BaseException):
    """An env call ran past the time limit. A BaseException, so that an env's own `except Exception`
    around the hung call can't swallow it."""


@dataclass
class CheckResult:
    name: str
    status: str          # "pass" | "fail" | "skip"
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        return f"  {self.status.upper():4}  {self.name:13} {self.seconds:6.2f}s  {self.detail}"


@dataclass
class ConformanceReport:
    env: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.status != "fail" for r in self.results)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    def __str__(self) -> str:
        return "\n".join([f"conformance of {self.env}: {'PASS' if self.ok else 'FAIL'}"]
                         + [r.line() for r in self.results])


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise _CheckFailed(message)


def _show(action: str, limit: int = 40) -> str:
    return repr(action if len(action) <= limit else action[:limit] + "...")


# ---- time limits and the recorded episode ------------------------------------------------------

@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise CallTimedOut("<what> did not return within N s") when the block runs longer than
    `seconds`, by SIGALRM. No limit where `seconds` is None or 0, where there is no SIGALRM, or
    off the main thread. An alarm already set outside is restored afterwards, less the time spent."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise CallTimedOut(f"{what} did not return within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


class _Beacon:
    """What the check process is doing, in memory it shares with the process that watches it (`_watched_checks`):
    a call counter, odd while an env call is in progress, and that call's description and the episode's trail.
    Announcing a call writes memory only (no system call), so every guarded call can afford it."""

    SIZE = 4096

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, self.SIZE)   # anonymous, shared with a child forked after it is made
        self.calls = 0

    def enter(self, call: str, trail: str) -> None:
        data = f"{call}\n{trail}".encode("utf-8", "replace")[: self.SIZE - 16]
        struct.pack_into("I", self.memory, 8, len(data))
        self.memory[16:16 + len(data)] = data
        self.calls += 1
        struct.pack_into("q", self.memory, 0, 2 * self.calls - 1)

    def leave(self) -> None:
        struct.pack_into("q", self.memory, 0, 2 * self.calls)

    def state(self) -> tuple[int, str, str]:
        """(counter, call, trail) as the checking process last wrote them."""
        count, length = struct.unpack_from("q", self.memory, 0)[0], struct.unpack_from("I", self.memory, 8)[0]
        call, _, trail = self.memory[16:16 + length].decode("utf-8", "replace").partition("\n")
        return count, call, trail


_beacon: _Beacon | None = None   # set in the check process that `_watched_checks` watches


@contextmanager
def _guarded_call(seconds: float | None, what: str, env: _Guarded | None = None) -> Iterator[None]:
    """`time_limit(seconds, what)`, announced first to the watching process where there is one (the call, the task
    `env` is on and its episode's trail)."""
    beacon = _beacon
    if beacon is not None:
        beacon.enter(what + (env.on_task() if env is not None else ""), env.trail() if env is not None else "")
    try:
        with time_limit(seconds, what):
            yield
    finally:
        if beacon is not None:
            beacon.leave()


class _Guarded:
    """The env under check. Every method call is limited to `timeout` seconds (`time_limit`) and announced to the
    watching process (`_guarded_call`); the current task, the episode's actions and its latest observation are
    recorded for failure messages (`on_task`, `trail`). Attributes and methods not named here are the env's own,
    looked up on the instance."""

    def __init__(self, env: Env, timeout: float | None):
        self.unwrapped = env
        self._timeout = timeout
        self.task: TaskSpec | None = None
        self._on_task = ""
        self.actions: list[str] = []
        self.observation = ""

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.unwrapped, name)
        if not callable(value):
            return value

        def limited(*args: Any, **kwargs: Any) -> Any:
            with _guarded_call(self._timeout, f"{name}()", self):
                return value(*args, **kwargs)
        return limited

    def reset(self, task: TaskSpec) -> str:
        task_id = task.task_id
        self.task, self._on_task, self.actions, self.observation = None, "", [], ""
        with _guarded_call(self._timeout, f"reset({task_id})", self):
            observation = self.unwrapped.reset(task)
        self.task, self._on_task = task, f" on task {task_id} ({task.task_type})"
        self.observation = observation if isinstance(observation, str) else repr(observation)
        return observation

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        with _guarded_call(self._timeout, f"step({_show(action)})", self):
            result = self.unwrapped.step(action)
        observation = getattr(result, "observation", result)
        self.observation = observation if isinstance(observation, str) else repr(observation)
        return result

    def on_task(self) -> str:
        """" on task ID (TYPE)" of the task the last reset started, or ""."""
        return self._on_task

    def trail(self, n_actions: int = 3, chars: int = 160) -> str:
        """"last actions: a, b, c (of N); last observation: ..." of the current episode, shortened."""
        if not self.actions:
            return f"no action yet; first observation: {self.observation[:chars]!r}"
        shown = ", ".join(_show(a) for a in self.actions[-n_actions:])
        return (f"last actions: {shown} (of {len(self.actions)}); "
                f"last observation: {self.observation[:chars]!r}{'...' if len(self.observation) > chars else ''}")


def _check_result(result: Any, action: str, env: _Guarded) -> StepResult:
    """`result` if it is a well-typed StepResult; otherwise the check fails, naming the episode's trail."""
    where = f"step({_show(action)})"
    problem = None
    if not isinstance(result, StepResult):
        problem = f"{where} returned {type(result).__name__}, not StepResult"
    elif not (isinstance(result.observation, str) and result.observation.strip() != ""):
        problem = f"{where}: the observation must be a non-empty str, got {result.observation!r:.80}"
    elif len(result.observation) > MAX_OBSERVATION_CHARS:
        problem = f"{where}: the observation has {len(result.observation)} chars (echoes the action unbounded?)"
    elif not (isinstance(result.reward, (int, float)) and not isinstance(result.reward, bool)):
        problem = f"{where}: reward must be a number, got {result.reward!r}"
    elif not (isinstance(result.done, bool) and isinstance(result.success, bool)):
        problem = f"{where}: done and success must be bool, got {result.done!r}, {result.success!r}"
    elif not (isinstance(result.info, dict) and isinstance(result.info.get("valid"), bool)
              and isinstance(result.info.get("feedback"), str) and result.info["feedback"] != ""):
        problem = f"{where}: info needs 'valid' (bool) and 'feedback' (str), got {result.info!r:.120}"
    elif not (result.info["valid"] or result.info["feedback"] != "ok"):
        problem = f"{where}: a rejected action must say why (feedback other than 'ok')"
    if problem:
        raise _CheckFailed(f"{problem}; {env.trail()}")
    return result


# ---- hostile actions --------------------------------------------------------------------------

_FIXED_HOSTILE = [
    "", " ", "\n", "\t\t", "\n\n\n", "\x00", "\x00\x01\x02\x7f", "\r\n\r\n", "\x1b[31mred\x1b[0m",
    "\u202egnp.exe", "\u200b\u200c\u200d", "\ufeff", "\ud7ff", "😀" * 50, "ℌ𝔢𝔩𝔩𝔬 𝔴𝔬𝔯𝔩𝔡", "日本語のテキスト",
    "مرحبا بالعالم", "Ünïcödé àçtîön", "é" * 2000, "a" * 100_000, "9" * 5000, "-" * 3000, "(" * 500,
    ")" * 500, "[" * 300 + "]" * 300, "{" * 300, "\\", "\\x00", "%s%s%s%n", "{0}{1}{__class__}",
    "${HOME}", "$(rm -rf /)", "`ls`", "'; DROP TABLE turns; --", "<script>alert(1)</script>",
    "None", "null", "NaN", "inf", "-inf", "1e309", "0", "-1", "99999999999999999999999999999",
    "True", "[]", "{}", '{"name": null}', '{"name": "x", "arguments": [1, 2]}', '{"tool": {}}',
    "[" * 50 + "1" + "]" * 50, "lambda: 0", "__import__('os').system('ls')", "open('/etc/passwd')",
    "look" * 1000, "go to " * 200, "help", "?", "...", "Action:", "> ", "Answer:", "answer(",
    "answer()", "answer(value=)", "calculator()", "lookup()", "reset task", "exit", "quit",
    "\n".join(["look"] * 100), "x\n" * 10_000,
]
_ALPHABET = ("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789 .,;:!?()[]{}<>=+-*/\\\"'\n\t\x00\x07\u00e9\u4e2d"
             "\U0001F600\u202e")


def hostile_actions(n: int, seed: int, real_actions: list[str]) -> list[str]:
    """`n` hostile action texts: the fixed list first, then random strings and near-misses of
    `real_actions` (dropped/duplicated/swapped characters, case changes, extra words)."""
    rng = random.Random(seed)
    out = list(_FIXED_HOSTILE[:n])
    while len(out) < n:
        kind = rng.random()
        if real_actions and kind < 0.5:
            out.append(near_miss(rng.choice(real_actions), rng))
        elif kind < 0.8:
            out.append("".join(rng.choice(_ALPHABET) for _ in range(rng.choice([1, 3, 10, 40, 200]))))
        else:
            out.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(1, 60))))
    return out


def near_miss(action: str, rng: random.Random) -> str:
    if not action:
        return "x"
    i = rng.randrange(len(action))
    edits = [
        lambda a: a[:i] + a[i + 1:],                       # drop a character
        lambda a: a[:i] + a[i] + a[i:],                    # duplicate one
        lambda a: a[:i] + rng.choice("xqz19 ") + a[i + 1:],  # replace one
        lambda a: a.upper(), lambda a: a.title(),
        lambda a: a + rng.choice([".", "!", " please", " now", " 2", "\nthen look"]),
        lambda a: rng.choice(["", "> ", "Action: ", "I will ", "  "]) + a,
        lambda a: " ".join(reversed(a.split())),
        lambda a: a.replace(" ", ""), lambda a: a.replace(" ", "  "),
        lambda a: re.sub(r"\d+", lambda m: str(int(m.group()) + rng.randint(1, 99)), a),
        lambda a: a.split(" ")[0], lambda a: a[: max(1, len(a) // 2)],
    ]
    return rng.choice(edits)(action)


# ---- the check --------------------------------------------------------------------------------

def _factory(env: str | type | Callable[[], Env], kwargs: dict | None) -> tuple[Callable[[], Env], str]:
    if isinstance(env, str):
        from rsiflow.envs import make_env

        return (lambda: make_env(env, **(kwargs or {}))), env
    if isinstance(env, type):
        return (lambda: env(**(kwargs or {}))), f"{env.__module__}:{env.__qualname__}"
    return env, getattr(env, "__name__", repr(env))


@dataclass
class _Run:
    """What every check gets: the env under check, a factory of fresh guarded instances, the
    settings, and `state` that earlier checks fill for later ones (the sampled tasks, step counts)."""

    env: _Guarded
    make: Callable[[], _Guarded]
    tasks: int
    seed: int
    fuzz: int
    expert_limit: int
    max_turns: int | None
    state: dict[str, Any] = field(default_factory=dict)

    def all_tasks(self) -> list[TaskSpec]:
        _require("train" in self.state, "needs the splits check to pass")
        return self.state["train"] + self.state["heldout"]


def check_env(env: str | type | Callable[[], Env], kwargs: dict | None = None, tasks: int = DEFAULT_TASKS,
              seed: int = 0, fuzz: int = 2000, expert_limit: int = 200, max_turns: int | None = None,
              step_timeout: float | None = DEFAULT_STEP_TIMEOUT,
              on_result: Callable[[CheckResult], None] | None = None) -> ConformanceReport:
    """Run every check on an env (a built-in name, 'package.module:Class', a class, or a factory):
    `tasks` per split, `fuzz` hostile actions, at most `expert_limit` expert steps per task, the
    turn limit `max_turns` (None: not checked), `step_timeout` seconds per env call (None: no
    limit). `on_result` is called with each check's result as soon as it is known.

    With a `step_timeout`, where the OS can fork (Linux, macOS), the env runs in a child process that this one
    watches (`_watched_checks`): a call that ignores SIGALRM is reported and the child killed; the env's own
    side effects (class attributes, globals) then happen in that child. Without a limit, or without fork, the env
    runs in this process. An env that can't be built raises here either way."""
    build, label = _factory(env, kwargs)
    report = ConformanceReport(label)

    def record(result: CheckResult) -> None:
        report.results.append(result)
        if on_result:
            on_result(result)

    settings = {"tasks": tasks, "seed": seed, "fuzz": fuzz, "expert_limit": expert_limit, "max_turns": max_turns}
    if step_timeout and "fork" in multiprocessing.get_all_start_methods():
        _watched_checks(build, label, settings, step_timeout, record)
    else:
        _run_checks(build, label, settings, step_timeout, 0, {}, lambda result, state: record(result))
    return report


def _check_name(index: int) -> str:
    return CHECKS[index][0] if index < len(CHECKS) else "close"


def _run_checks(build: Callable[[], Env], label: str, settings: dict, step_timeout: float | None, first: int,
                state: dict, record: Callable[[CheckResult, dict], None],
                on_built: Callable[[], None] | None = None) -> None:
    """The checks from CHECKS[first] on, then close (`first` = len(CHECKS): close only), on one instance built
    here (the exception of its building is raised), with `state` as earlier checks left it; `record(result,
    state)` after each. A check whose env call ran past its time limit renews the instance."""

    def make() -> _Guarded:
        with _guarded_call(step_timeout, f"building {label}"):
            instance = build()
        _require(isinstance(instance, Env),
                 f"{label} does not build an rsiflow.envs.base.Env (got {type(instance).__name__})")
        return _Guarded(instance, step_timeout)

    run = _Run(make(), make, settings["tasks"], settings["seed"], settings["fuzz"], settings["expert_limit"],
               settings["max_turns"], state)
    if on_built:
        on_built()
    for name, check in CHECKS[first:]:
        start = time.perf_counter()
        renew = False
        try:
            detail = check(run) or ""
            status = "pass"
        except _Skip as skip:
            status, detail = "skip", str(skip)
        except _CheckFailed as failure:
            status, detail = "fail", str(failure)
        except CallTimedOut as timeout:
            status, detail, renew = "fail", f"{timeout}{run.env.on_task()}; {run.env.trail()}", True
        except Exception as exc:  # the env raised where it must not
            tb = traceback.format_exc(limit=-2).strip().splitlines()
            status, detail = "fail", (f"raised {type(exc).__name__}: {exc} [{' | '.join(tb[-3:])}]; "
                                      f"{run.env.trail()}")
        if renew:  # the hung instance is closed as far as it lets itself be; the rest runs on a fresh one
            try:
                run.env.close()
            except (Exception, CallTimedOut):
                pass
            try:
                run.env = make()
            except (Exception, CallTimedOut) as exc:
                detail += f"; a fresh instance could not be built ({exc}): the remaining checks are not run"
                record(CheckResult(name, status, detail, time.perf_counter() - start), run.state)
                return
            detail += "; the remaining checks run on a fresh instance"
        record(CheckResult(name, status, detail, time.perf_counter() - start), run.state)

    start = time.perf_counter()
    try:
        run.env.close()
        run.env.close()
        record(CheckResult("close", "pass", "close() twice", time.perf_counter() - start), run.state)
    except (Exception, CallTimedOut) as exc:
        record(CheckResult("close", "fail", f"close() raised {type(exc).__name__}: {exc}",
                           time.perf_counter() - start), run.state)


# ---- the watchdog: the checks in a child process ----------------------------------------------

def _send(conn: Any, message: tuple, fallback: tuple) -> None:
    """Send `message`, or `fallback` where `message` does not survive pickling (an env's own exception or task
    spec)."""
    try:
        pickle.loads(pickle.dumps(message))
    except Exception:
        message = fallback
    conn.send(message)


def _child(build: Callable[[], Env], label: str, settings: dict, step_timeout: float, first: int, state: dict,
           conn: Any, beacon: _Beacon) -> None:
    """The check process: `_run_checks`, announcing every env call on `beacon` and sending over `conn`
    ("built",) once its instance is built, ("result", CheckResult, the entries of the state that changed) after
    each check, ("raised", exc) where building raised (or the env ended the process with SystemExit), and
    ("done",) at the end."""
    global _beacon
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C stops the watching process, which kills this one
    if sys.platform == "linux":   # and where that process is killed outright, this one goes with it
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    _beacon = beacon
    sent = dict(state)

    def record(result: CheckResult, state: dict) -> None:
        changed = {key: value for key, value in state.items() if sent.get(key) is not value}
        sent.update(changed)
        _send(conn, ("result", result, changed), ("result", result, {}))

    try:
        _run_checks(build, label, settings, step_timeout, first, state, record, on_built=lambda: conn.send(("built",)))
    except BaseException as exc:
        exc.add_note("in the check process:\n" + traceback.format_exc().rstrip())
        _send(conn, ("raised", exc), ("raised", RuntimeError(f"{type(exc).__name__}: {exc}")))
    conn.send(("done",))
    conn.close()


def _died(child: Any, beacon: _Beacon) -> str:
    """Why the check process ended without saying so: its exit status and the call it was in, if any."""
    child.join(1.0)
    code = child.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    count, call, trail = beacon.state()
    during = (f"during {call}" + (f"; {trail}" if trail else "")) if count % 2 else "between env calls"
    return f"the check process died ({how}) {during}"


def _watched_checks(build: Callable[[], Env], label: str, settings: dict, step_timeout: float,
                    record: Callable[[CheckResult], None]) -> None:
    """Run the checks in a forked child process and `record` its results as they come. The child keeps the
    SIGALRM limit of every call (`time_limit`) and announces each call on a `_Beacon`; where one call is still in
    progress `step_timeout` + max(1 s, 10%) after it began (native code that never returns to the interpreter,
    such as a C loop, which SIGALRM can't interrupt), or the child dies (a crash in native code), the child is
    killed and its check fails naming the call (method, shortened action, task) and the episode's trail. The
    remaining checks then run in a fresh child, from the state the earlier checks left; where that child can't
    build an instance, they are not run. A process the env started itself may outlive a killed child."""
    ctx = multiprocessing.get_context("fork")
    limit = step_timeout + max(1.0, step_timeout / 10)
    tick = min(0.2, step_timeout / 4)
    first, state = 0, {}
    pending: CheckResult | None = None   # the killed child's check: recorded once the next child has an instance

    def finish_pending(suffix: str) -> None:
        record(CheckResult(pending.name, pending.status, pending.detail + suffix, pending.seconds))

    while first <= len(CHECKS):
        beacon = _Beacon()
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(build, label, settings, step_timeout, first, state, send, beacon),
                            name=f"conformance of {label}")
        child.start()
        send.close()
        index, built, started = first, False, time.monotonic()
        watched, since = 0, 0.0   # the call in progress (the beacon's odd counter) and when it was first seen
        stopped, hung, message = "", False, ("",)   # why the child was stopped, whether a call hung; the last message
        try:
            while True:
                if receive.poll(tick):
                    try:
                        message = receive.recv()
                    except EOFError:
                        stopped = _died(child, beacon)
                        break
                    kind = message[0]
                    if kind == "built":
                        built, started = True, time.monotonic()
                        if pending is not None:
                            finish_pending("; the remaining checks run in a fresh process")
                            pending = None
                    elif kind == "result":
                        record(message[1])
                        state = {**state, **message[2]}
                        index, started = index + 1, time.monotonic()
                    elif kind == "raised":
                        if pending is not None:
                            finish_pending(f"; a fresh instance could not be built ({message[1]}): the remaining "
                                           "checks are not run")
                            return
                        raise message[1]
                    elif kind == "done":
                        return
                    continue
                if child.exitcode is not None and not receive.poll(0):
                    stopped = _died(child, beacon)
                    break
                count, call, trail = beacon.state()
                if count % 2 == 0:
                    watched = 0
                elif count != watched:
                    watched, since = count, time.monotonic()
                elif time.monotonic() - since > limit:
                    stopped = (f"{call} did not return within {step_timeout:g} s and could not be interrupted (native "
                               "code that never returns to the Python interpreter?): the check process was killed"
                               + (f"; {trail}" if trail else ""))
                    hung = True
                    break
        finally:   # a child that said it is done gets a moment to exit (flush its output), any other none
            child.join(2.0 if not stopped and message[0] in ("done", "raised") else 0)
            if child.is_alive():
                child.kill()
            child.join()
            receive.close()
            beacon.memory.close()
        if not built:   # building the instance hung or crashed the child
            if pending is None:
                raise CallTimedOut(stopped) if hung else RuntimeError(f"building {label}: {stopped}")
            finish_pending(f"; a fresh instance could not be built ({stopped}): the remaining checks are not run")
            return
        if index > len(CHECKS):   # every result came; the child ended before it said so
            return
        pending = CheckResult(_check_name(index), "fail", stopped, time.monotonic() - started)
        first = index + 1
        if first > len(CHECKS):
            finish_pending("")
            return


def _check_class(run: _Run) -> str:
    env = run.env
    name = getattr(env, "name", None)
    _require(isinstance(name, str) and name != "", "the env needs a non-empty str `name` (a class attribute)")
    types = getattr(env, "task_types", None)
    _require(isinstance(types, tuple) and types != () and all(isinstance(t, str) for t in types),
             "`task_types` must be a non-empty tuple of str (a class attribute or one set in __init__), "
             f"got {types!r:.80}")
    _require(len(set(types)) == len(types), f"`task_types` lists a type twice: {types}")
    _require(isinstance(env.admissible_exact, bool), f"`admissible_exact` must be a bool, got {env.admissible_exact!r}")
    return f"name={name!r}, {len(types)} task types, admissible_exact={env.admissible_exact}"


def _check_splits(run: _Run) -> str:
    """Both splits' samples; a task id repeated within one sample fails the check once both are in `run.state`
    (the later checks still run on them)."""
    env, n, seed = run.env, run.tasks, run.seed
    ids, contents, repeated = {}, {}, []
    for split in SPLITS:
        tasks = env.sample_tasks(split, n, seed)
        _require(isinstance(tasks, list) and len(tasks) == n, f"sample_tasks({split!r}, {n}) gave {len(tasks)} tasks")
        for task in tasks:
            _require(isinstance(task, TaskSpec), f"sample_tasks gave a {type(task).__name__}, not a TaskSpec")
            _require(task.env == env.name and task.split == split,
                     f"task {task.task_id}: env/split are {task.env!r}/{task.split!r}, expected {env.name!r}/{split!r}")
            _require(task.task_type in env.task_types,
                     f"task type {task.task_type!r} is not in the instance's task_types {env.task_types}")
            try:
                json.dumps(task.spec)
            except (TypeError, ValueError) as exc:
                raise _CheckFailed(f"task {task.task_id}: spec is not JSON-ready ({exc})") from None
            back = TaskSpec.from_row(task.to_row())
            _require(back.task_id == task.task_id and back.spec == task.spec,
                     f"task {task.task_id} does not survive to_row/from_row")
        if n >= len(env.task_types):
            missing = [t for t in env.task_types if t not in {task.task_type for task in tasks}]
            _require(not missing, f"sample_tasks({split!r}, {n}) never gave the declared task types {missing}: "
                                  "task_types must list the types the instance samples (round-robin)")
        ids[split] = {t.task_id for t in tasks}
        contents[split] = {(t.task_type, json.dumps(t.spec, sort_keys=True)) for t in tasks}
        run.state[split] = tasks
        if (summary := repeated_ids(tasks)) is not None:
            repeated.append(f"sample_tasks({split!r}, {n}, {seed}) {summary}")
    _require(not repeated, f"{'; '.join(repeated)}. {REPEATED_IDS_FIX}")
    _require(not ids["train"] & ids["heldout"], "a task id appears in both train and heldout")
    _require(not contents["train"] & contents["heldout"], "the same task (type and spec) is in both train and heldout")
    try:
        env.sample_tasks("no-such-split", 1, seed)
    except ValueError:
        pass
    else:
        raise _CheckFailed("sample_tasks('no-such-split') must raise ValueError")
    return (f"{n} train ({len(contents['train'])} distinct) + {n} heldout ({len(contents['heldout'])} distinct) "
            f"tasks, distinct ids, disjoint; types: {', '.join(sorted({t.task_type for t in run.state['train']}))}")


def _probe_actions(env: _Guarded, rng: random.Random) -> str:
    """An action for determinism probes: the expert's, else a random admissible one, else a fixed text."""
    action = env.expert_action()
    if action is None:
        admissible = env.admissible_actions()
        action = rng.choice(admissible) if admissible else "look"
    return action


def _check_determinism(run: _Run) -> str:
    env, n, seed = run.env, run.tasks, run.seed
    _require("train" in run.state, "needs the splits check to pass")
    for split in SPLITS:
        again = [t.task_id for t in env.sample_tasks(split, n, seed)]
        _require(again == [t.task_id for t in run.state[split]],
                 f"sample_tasks({split!r}, seed={seed}) differs between calls")
    other = run.make()
    try:
        _require([t.task_id for t in other.sample_tasks("train", n, seed)] == [t.task_id for t in run.state["train"]],
                 "a fresh instance samples other tasks for the same seed")
        _require([t.task_id for t in env.sample_tasks("train", n, seed + 1)] != [t.task_id for t in run.state["train"]],
                 "another seed gives exactly the same tasks")
        for task in run.state["train"][: min(n, 4)]:
            traces = []
            for instance in (env, other):
                rng = random.Random(seed)
                trace = [instance.reset(task)]
                for _ in range(6):
                    action = _probe_actions(instance, rng)
                    result = instance.step(action)
                    trace.append((action, result.observation, result.reward, result.done, result.success))
                    if result.done:
                        break
                traces.append(trace)
            _require(traces[0] == traces[1], f"task {task.task_id}: the same actions gave different results "
                                             f"in two instances; {env.trail()}")
    finally:
        other.close()
    return "same seed -> same tasks and episodes (two instances); another seed -> other tasks"


def _check_reset_step(run: _Run) -> str:
    env = run.env
    tasks = run.all_tasks()
    for task in tasks:
        observation = env.reset(task)
        _require(isinstance(observation, str) and observation.strip() != "",
                 f"reset({task.task_id}) must return a non-empty str")
        action = _probe_actions(env, random.Random(run.seed))
        _check_result(env.step(action), action, env)
    return f"{len(tasks)} resets"


def _check_admissible(run: _Run) -> str:
    env, rng = run.env, random.Random(run.seed)
    played = listed = accepted = 0
    exact = env.admissible_exact
    for task in run.all_tasks()[: max(1, run.tasks // 2)]:
        env.reset(task)
        for _ in range(10):
            actions = env.admissible_actions()
            if actions is None:
                raise _Skip("admissible_actions() is None: a free-form env") if played == 0 else _CheckFailed(
                    f"admissible_actions() switched from a list to None mid-episode; {env.trail()}")
            _require(isinstance(actions, list) and all(isinstance(a, str) for a in actions),
                     "admissible_actions() must be None or a list of str")
            if not actions:
                break
            listed += len(actions)
            action = rng.choice(actions)
            result = _check_result(env.step(action), action, env)
            if result.info["valid"]:
                accepted += 1
            else:
                _require(not exact, f"admissible action {action!r} was rejected: {result.observation[:120]!r}; "
                                    f"{env.trail()}")
            played += 1
            if result.done:
                break
    if exact:
        return f"{played} admissible actions played, all accepted ({listed} listed)"
    _require(accepted >= 0.5 * played, f"only {accepted}/{played} admissible actions were accepted")
    return (f"{accepted}/{played} admissible actions accepted ({listed} listed; the env declares "
            "admissible_exact = False: its lists over-generate)")


def _play_expert(env: _Guarded, task: TaskSpec, limit: int, after: list[str] = ()) -> tuple[bool, list[str]]:
    """Reset, play `after` (hostile actions), then follow the expert; (solved, the expert's actions)."""
    env.reset(task)
    for action in after:
        if _check_result(env.step(action), action, env).done:
            return False, []
    actions: list[str] = []
    for _ in range(limit):
        action = env.expert_action()
        if action is None:
            break
        _require(isinstance(action, str), f"expert_action() returned {type(action).__name__}")
        actions.append(action)
        result = _check_result(env.step(action), action, env)
        if result.done:
            return result.success, actions
    return False, actions


def _check_expert(run: _Run) -> str:
    env, tasks = run.env, run.all_tasks()
    env.reset(tasks[0])
    if env.expert_action() is None:
        raise _Skip("expert_action() is None: the env has no scripted expert")
    steps: dict[str, int] = {}   # task id -> the expert's steps (a task sampled twice counts once)
    counts, failed = [], []
    for task in tasks:
        ok, actions = _play_expert(env, task, run.expert_limit)
        if ok:
            steps[task.task_id] = len(actions)
            counts.append(len(actions))
        else:
            failed.append(f"{task.task_id} ({len(actions)} expert steps; {env.trail()})")
    _require(not failed, f"the expert failed {len(failed)}/{len(tasks)} tasks: {' | '.join(failed[:3])}")
    run.state["expert"] = True
    run.state["expert_steps"] = steps
    return (f"expert solved {len(tasks)}/{len(tasks)} tasks ({sum(counts) / len(counts):.1f} steps each, "
            f"at most {max(counts)})")


def _check_solution(run: _Run) -> str:
    env, tasks = run.env, run.all_tasks()
    steps: dict[str, int] = {}   # task id -> the solution's steps (a task sampled twice counts once)
    counts, failed, none = [], [], 0
    for task in tasks:
        env.reset(task)
        plan = env.solution()
        if plan is None:
            none += 1
            continue
        _require(isinstance(plan, list) and plan and all(isinstance(a, str) for a in plan),
                 f"task {task.task_id}: solution() must be None or a non-empty list of str, got {plan!r:.80}")
        result = None
        for action in plan:
            result = _check_result(env.step(action), action, env)
            if result.done:
                break
        if not (result.done and result.success):
            ended = "it ended unsolved" if result.done else "the episode did not end"
            failed.append(f"{task.task_id} ({ended} after {len(env.actions)} of {len(plan)} actions; {env.trail()})")
        else:
            steps[task.task_id] = len(env.actions)
            counts.append(len(env.actions))
        _require(env.solution() == plan, f"task {task.task_id}: solution() changed during the episode "
                                         "(it must always give the plan from the task's start)")
    if none == len(tasks):
        raise _Skip("solution() is None: the env gives no solution")
    _require(not failed, f"playing solution() from a fresh reset failed {len(failed)}/{len(tasks) - none} "
                         f"tasks: {' | '.join(failed[:3])}")
    run.state["solution_steps"] = steps
    return (f"solution() solved {len(counts)}/{len(counts)} tasks ({sum(counts) / len(counts):.1f} steps each, "
            f"at most {max(counts)})" + (f"; None on {none} tasks" if none else ""))


def _describe(task: TaskSpec, chars: int = 80) -> str:
    """"ID (TYPE: spec excerpt)": which task it is, for a reader who has no store to look the id up in."""
    spec = json.dumps(task.spec, ensure_ascii=False)
    return f"{task.task_id} ({task.task_type}: {spec[:chars]}{'...' if len(spec) > chars else ''})"


def _check_max_turns(run: _Run) -> str:
    if run.max_turns is None:
        raise _Skip("no turn limit given (--max-turns N, or --config)")
    counted = {who: run.state[f"{who}_steps"] for who in ("expert", "solution") if f"{who}_steps" in run.state}
    if not counted:
        raise _Skip("neither an expert nor a solution to count steps of")
    over: dict[str, dict[str, int]] = {}
    for who, steps in counted.items():
        for task_id, n in steps.items():
            if n > run.max_turns:
                over.setdefault(task_id, {})[who] = n
    by_id = {t.task_id: t for t in run.all_tasks()}
    shown = [f"{_describe(by_id[task_id])} ({', '.join(f'{who} {n}' for who, n in by.items())} steps)"
             for task_id, by in list(over.items())[:8]]
    _require(not over, f"on {len(over)}/{len(run.all_tasks())} tasks the expert or solution needs more than "
                       f"env.max_turns = {run.max_turns} steps (a run ends those episodes first): "
                       f"{', '.join(shown)}{', ...' if len(over) > 8 else ''}")
    most = ", ".join(f"{who} at most {max(steps.values())}" for who, steps in counted.items())
    return f"every task fits in env.max_turns = {run.max_turns} steps ({most})"


_CLAUSE_END = re.compile(r"[.?!:;\n]")


def _check_rules(run: _Run) -> str:
    """Each task's statement (its first observation) is cut into clauses at . ? ! : ; and line ends;
    a clause of 8 or more characters found in fewer than half of the statements is the task's own
    (not boilerplate every task repeats), and no rule may contain it."""
    env, tasks = run.env, run.all_tasks()
    seen = []
    for task in tasks:
        statement = env.reset(task)
        rules = env.rules()
        _require(isinstance(rules, list) and all(isinstance(r, str) and r.strip() for r in rules),
                 f"task {task.task_id}: rules() must be a list of non-empty str, got {rules!r:.80}")
        clauses = {c.strip() for c in _CLAUSE_END.split(statement) if len(c.strip()) >= 8}
        actions = [a for a in (env.solution() or []) if any(c.isdigit() for c in a)]
        seen.append((task, rules, clauses, actions))
    counts: dict[str, int] = {}
    for _, _, clauses, _ in seen:
        for clause in clauses:
            counts[clause] = counts.get(clause, 0) + 1
    for task, rules, clauses, actions in seen:
        own = [c for c in clauses if counts[c] * 2 < len(tasks)]
        for rule in rules:
            for text in own:
                _require(text not in rule,
                         f"task {task.task_id}: the rule {rule!r:.100} restates the task ({text!r:.80})")
            for action in actions:
                _require(action not in rule, f"task {task.task_id}: the rule {rule!r:.100} names the solution's "
                                             f"action {action!r:.60}")
    if not any(rules for _, rules, _, _ in seen):
        raise _Skip("rules() is empty: SRD's template writer then writes a generic Rule")
    per_task = sum(len(rules) for _, rules, _, _ in seen) / len(seen)
    return f"{per_task:.1f} rules per task, none restating the task or naming its solution's actions"


def _check_tools(run: _Run) -> str:
    tools = run.env.tools()
    if tools is None:
        raise _Skip("tools() is None: actions are not tool calls")
    _require(isinstance(tools, list) and tools, f"tools() must be None or a non-empty list, got {tools!r:.80}")
    names = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        _require(isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict),
                 f'each tool is {{"type": "function", "function": {{...}}}}, got {tool!r:.80}')
        name, parameters = function.get("name"), function.get("parameters")
        _require(isinstance(name, str) and name != "" and isinstance(function.get("description"), str),
                 f"tool {name!r}: the function needs a non-empty str name and a str description")
        _require(isinstance(parameters, dict) and parameters.get("type") == "object"
                 and isinstance(parameters.get("properties"), dict),
                 f'tool {name!r}: parameters must be a JSON schema {{"type": "object", "properties": {{...}}}}')
        required = parameters.get("required", [])
        _require(isinstance(required, list) and set(required) <= set(parameters["properties"]),
                 f"tool {name!r}: required {required!r} must be a list of its properties")
        names.append(name)
    _require(len(set(names)) == len(names), f"tool names repeat: {names}")
    try:
        json.dumps(tools)
    except (TypeError, ValueError) as exc:
        raise _CheckFailed(f"tools() is not JSON-ready ({exc})") from None
    return f"{len(tools)} function schemas: {', '.join(names)}"


def _check_hindsight(run: _Run) -> str:
    env = run.env

    def facts() -> list[str]:
        out = env.hindsight()
        _require(isinstance(out, list) and all(isinstance(f, str) for f in out),
                 f"hindsight() must be a list of str; {env.trail()}")
        return out

    counts = []
    for task in run.all_tasks()[: min(run.tasks, 6)]:
        env.reset(task)
        facts()
        rng = random.Random(run.seed)
        for _ in range(run.expert_limit):
            result = env.step(_probe_actions(env, rng))
            facts()
            if result.done:
                break
        counts.append(len(facts()))
    return f"lists of str; {sum(counts) / len(counts):.1f} facts at the end of an episode"


def _check_canonicalize(run: _Run) -> str:
    env = run.env
    texts = hostile_actions(min(run.fuzz, 300), run.seed, [])
    symbols = set()
    for task in run.all_tasks()[: min(run.tasks, 4)]:
        env.reset(task)
        rng = random.Random(run.seed)
        for _ in range(8):
            action = _probe_actions(env, rng)
            texts.append(action)
            if env.step(action).done:
                break
    for text in texts:
        symbol = env.canonicalize(text)
        _require(isinstance(symbol, str) and SYMBOL_RE.fullmatch(symbol) is not None,
                 f"canonicalize({_show(text)}) = {symbol!r:.60} is not a verb<role,...> symbol")
        symbols.add(symbol)
    return f"{len(texts)} texts -> {len(symbols)} symbols, e.g. {', '.join(sorted(symbols)[:4])}"


def _check_prompting(run: _Run) -> str:
    text = run.env.instructions()
    _require(isinstance(text, str) and text.strip() != "", "instructions() must be a non-empty str")
    demo = run.env.demonstration()
    _require(isinstance(demo, list), "demonstration() must be a list")
    for turn in demo:
        _require(isinstance(turn, tuple) and len(turn) == 3,
                 "each demonstration turn is (observation, admissible, action)")
        observation, admissible, action = turn
        listed = admissible is None or (isinstance(admissible, list) and all(isinstance(a, str) for a in admissible))
        _require(isinstance(observation, str) and isinstance(action, str) and listed,
                 "demonstration turn types: (str, list[str] | None, str)")
    return f"{len(text)}-char instructions, {len(demo)} demonstration turns"


def _check_fuzz(run: _Run) -> str:
    if run.fuzz <= 0:
        raise _Skip("fuzz=0")
    env, tasks = run.env, run.all_tasks()
    real: list[str] = []
    for task in tasks[:4]:
        env.reset(task)
        rng = random.Random(run.seed)
        for _ in range(6):
            action = _probe_actions(env, rng)
            real.append(action)
            if env.step(action).done:
                break
        real += (env.admissible_actions() or [])[:20]
    actions = hostile_actions(run.fuzz, run.seed, real)
    rejected, episode = 0, 0
    feedback: dict[str, int] = {}
    first = True
    env.reset(tasks[0])
    for action in actions:
        result = _check_result(env.step(action), action, env)
        if not result.info["valid"]:
            rejected += 1
            feedback[result.info["feedback"]] = feedback.get(result.info["feedback"], 0) + 1
            _require(not (first and result.done),
                     f"the rejected first action {_show(action)} ended the episode: {result.observation[:100]!r}")
        first = False
        if result.done:
            episode += 1
            env.reset(tasks[episode % len(tasks)])
            first = True
    recovered = ""
    if run.state.get("expert"):
        for i, task in enumerate(tasks[: min(len(tasks), 6)]):
            hostile = actions[(i * 7) % len(actions)]
            ok, _ = _play_expert(env, task, run.expert_limit, after=[hostile])
            _require(ok, f"after the hostile action {_show(hostile)} the expert no longer solves task {task.task_id}; "
                         f"{env.trail()}")
        recovered = "; the expert still solves tasks after a hostile action"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(feedback.items(), key=lambda kv: -kv[1]))
    return f"{len(actions)} actions, none raised; {rejected} rejected ({kinds}); {episode} episodes ended{recovered}"


CHECKS: list[tuple[str, Callable[[_Run], str]]] = [
    ("class", _check_class), ("splits", _check_splits), ("determinism", _check_determinism),
    ("reset_step", _check_reset_step), ("admissible", _check_admissible), ("expert", _check_expert),
    ("solution", _check_solution), ("max_turns", _check_max_turns), ("rules", _check_rules), ("tools", _check_tools),
    ("hindsight", _check_hindsight), ("canonicalize", _check_canonicalize), ("prompting", _check_prompting),
    ("fuzz", _check_fuzz),
]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The check's command-line options, on `parser` (`main`'s own, or the `rsiflow check-env` subcommand's)."""
    parser.add_argument("env", nargs="?",
                        help="a built-in env name or 'package.module:Class' (default: the config's env.name)")
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="an rsiflow config: env.name, env.kwargs and env.max_turns come from it "
                             "(repeat for overlays)")
    parser.add_argument("--kwargs", help="JSON object of constructor keyword arguments "
                                         "(default: the config's env.kwargs, else {})")
    parser.add_argument("--max-turns", type=int, help="fail tasks whose expert or solution needs more steps "
                                                      "(default: the config's env.max_turns, else not checked)")
    parser.add_argument("--tasks", type=int, default=DEFAULT_TASKS,
                        help=f"tasks sampled per split (default {DEFAULT_TASKS})")
    parser.add_argument("--fuzz", type=int, default=2000, help="random and hostile actions (default 2000)")
    parser.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT,
                        help=f"seconds one env call may take before it fails the check "
                             f"(default {DEFAULT_STEP_TIMEOUT:g}; 0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


DESCRIPTION = __doc__.split("\n\n")[0]


def env_origin(name: str) -> str:
    """`module:Class from FILE` of the class an env name loads, or why it does not load (building it for the check
    then raises the same error)."""
    import inspect

    from rsiflow.envs import EnvError, env_class

    try:
        cls = env_class(name)
    except EnvError as exc:
        return f"not loaded: {exc}"
    try:
        where = inspect.getsourcefile(cls) or inspect.getfile(cls)
    except (OSError, TypeError):   # a class without a source file (built in C, defined interactively)
        where = "no file"
    return f"{cls.__module__}:{cls.__qualname__} from {where}"


def module_copies(module_name: str) -> list[str]:
    """The files that hold `module_name` ("pkg.mod": pkg/mod.py, pkg/mod/__init__.py or an extension module) in
    the folders of sys.path, in the order an import looks at them, then in the current directory where sys.path
    lacks it (where `rsiflow.envs.env_class` looks last). An import takes the first; the others are shadowed."""
    from importlib.machinery import all_suffixes

    parts = module_name.split(".")
    cwd = os.getcwd()
    folders = [entry or cwd for entry in sys.path]
    if cwd not in folders:
        folders.append(cwd)
    found: list[str] = []
    for folder in folders:
        base = os.path.join(os.path.abspath(folder), *parts)
        for path in [os.path.join(base, "__init__.py"), *(base + suffix for suffix in all_suffixes())]:
            if os.path.isfile(path) and os.path.realpath(path) not in map(os.path.realpath, found):
                found.append(path)
                break
    return found


def shadowing_note(name: str) -> str | None:
    """Where the module of a 'package.module:Class' env name is in more than one folder of the import path: which
    file was loaded, which were not, and how to choose. None for a built-in name or a module found once."""
    from rsiflow.envs import BUILTIN_ENVS, LAZY_ENVS

    if name in BUILTIN_ENVS or name in LAZY_ENVS or ":" not in name:
        return None
    module_name = name.partition(":")[0]
    copies = module_copies(module_name)
    if len(copies) < 2:
        return None
    module = sys.modules.get(module_name)
    loaded = os.path.realpath(getattr(module, "__file__", None) or "")
    shown = ", ".join(f"{path}{' (loaded)' if os.path.realpath(path) == loaded else ''}" for path in copies)
    return (f"{module_name} is in {len(copies)} places on the import path: {shown}. `python -m` puts the current "
            "directory first on sys.path, `rsiflow` looks there last: to check another copy, run from another "
            "directory or put its folder first on PYTHONPATH")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The check of parsed `add_arguments` options, printed line by line; 0 when it passed, else 1."""
    name, kwargs, max_turns = args.env, {}, args.max_turns
    if args.config:
        from rsiflow.configs.loader import load_config
        from rsiflow.configs.schema import ConfigError

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            parser.error(str(exc))
        name = name or cfg.env.name
        kwargs = dict(cfg.env.kwargs)
        max_turns = cfg.env.max_turns if max_turns is None else max_turns
    if name is None:
        parser.error("name an env (a built-in name or 'package.module:Class') or give --config FILE")
    if args.kwargs is not None:
        try:
            kwargs = json.loads(args.kwargs)
        except ValueError as exc:
            parser.error(f"--kwargs is not JSON: {exc}")
        if not isinstance(kwargs, dict):
            parser.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")

    print(f"conformance of {name} (kwargs {json.dumps(kwargs)}; {args.tasks} tasks per split, fuzz {args.fuzz}, "
          f"max_turns {max_turns}, step timeout {args.step_timeout:g} s)", flush=True)
    print(f"  env class {env_origin(name)}", flush=True)
    if note := shadowing_note(name):
        print(f"  note: {note}", flush=True)
    report = check_env(name, kwargs, tasks=args.tasks, seed=args.seed, fuzz=args.fuzz, max_turns=max_turns,
                       step_timeout=args.step_timeout or None, on_result=lambda r: print(r.line(), flush=True))
    print(f"conformance of {name}: {'PASS' if report.ok else 'FAIL'}", flush=True)
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m rsiflow.envs.conformance",
                                                   description=DESCRIPTION))
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
