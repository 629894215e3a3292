"""The conformance check any env can run: does it honour the `envs.base.Env` contract?

    python -m envs.conformance arithmetic
    python -m envs.conformance examples.countdown_env:CountdownEnv --kwargs '{"max_steps": 3}'
    python -m envs.conformance household --tasks 24 --fuzz 3000

or from Python (the test suite runs it on every built-in env and on the example env):

    from envs.conformance import check_env
    report = check_env("arithmetic", tasks=12, fuzz=2000)
    assert report.ok, report

Checks (each one PASS, FAIL with the reason, or SKIP with the reason):

    class          `name` is a non-empty str, `task_types` a non-empty tuple of str
    splits         sample_tasks gives n TaskSpecs of the right env/split/type for "train" and
                   "heldout", JSON-ready specs that survive to_row/from_row, disjoint task ids
                   across splits; an unknown split raises ValueError
    determinism    same seed -> same tasks (also from a fresh instance); another seed -> other
                   tasks; the same task and actions -> the same observations, rewards and ends
    reset_step     reset gives a non-empty str; step gives a StepResult with a str observation,
                   float reward, bool done/success and info{"valid": bool, "feedback": str}
    admissible     admissible_actions() is None or a list of str, and each one it lists is
                   accepted (info["valid"] is True) when played (at least half of them where the
                   env class sets `admissible_exact = False`: its lists over-generate)
    expert         where expert_action() gives actions: following it solves every sampled task
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
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import SPLITS, Env, StepResult, TaskSpec

SYMBOL_RE = re.compile(r"[A-Za-z_][\w\-]*<[\w,\- ]*>")
MAX_OBSERVATION_CHARS = 50_000


class _CheckFailed(AssertionError):
    pass


class _Skip(Exception):
    pass


@dataclass
class CheckResult:
    name: str
    status: str          # "pass" | "fail" | "skip"
    detail: str = ""
    seconds: float = 0.0


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
        lines = [f"conformance of {self.env}: {'PASS' if self.ok else 'FAIL'}"]
        for r in self.results:
            lines.append(f"  {r.status.upper():4}  {r.name:13} {r.seconds:6.2f}s  {r.detail}")
        return "\n".join(lines)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise _CheckFailed(message)


def _check_result(result: Any, action: str) -> StepResult:
    where = f"step({_show(action)})"
    _require(isinstance(result, StepResult), f"{where} returned {type(result).__name__}, not StepResult")
    _require(isinstance(result.observation, str) and result.observation.strip() != "",
             f"{where}: the observation must be a non-empty str, got {result.observation!r:.80}")
    _require(len(result.observation) <= MAX_OBSERVATION_CHARS,
             f"{where}: the observation has {len(result.observation)} chars (echoes the action unbounded?)")
    _require(isinstance(result.reward, (int, float)) and not isinstance(result.reward, bool),
             f"{where}: reward must be a number, got {result.reward!r}")
    _require(isinstance(result.done, bool) and isinstance(result.success, bool),
             f"{where}: done and success must be bool, got {result.done!r}, {result.success!r}")
    _require(isinstance(result.info, dict) and isinstance(result.info.get("valid"), bool)
             and isinstance(result.info.get("feedback"), str) and result.info["feedback"] != "",
             f"{where}: info needs 'valid' (bool) and 'feedback' (str), got {result.info!r:.120}")
    _require(result.info["valid"] or result.info["feedback"] != "ok",
             f"{where}: a rejected action must say why (feedback other than 'ok')")
    return result


def _show(action: str, limit: int = 40) -> str:
    return repr(action if len(action) <= limit else action[:limit] + "...")


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
        from envs import make_env

        return (lambda: make_env(env, **(kwargs or {}))), env
    if isinstance(env, type):
        return (lambda: env(**(kwargs or {}))), f"{env.__module__}:{env.__qualname__}"
    return env, getattr(env, "__name__", repr(env))


def _play_expert(env: Env, task: TaskSpec, limit: int, after: list[str] = ()) -> tuple[bool, list[str]]:
    """Reset, play `after` (hostile actions), then follow the expert; (solved, the expert's actions)."""
    env.reset(task)
    for action in after:
        if _check_result(env.step(action), action).done:
            return False, []
    actions: list[str] = []
    for _ in range(limit):
        action = env.expert_action()
        if action is None:
            break
        _require(isinstance(action, str), f"expert_action() returned {type(action).__name__}")
        actions.append(action)
        result = _check_result(env.step(action), action)
        if result.done:
            return result.success, actions
    return False, actions


def check_env(env: str | type | Callable[[], Env], kwargs: dict | None = None, tasks: int = 12, seed: int = 0,
              fuzz: int = 2000, expert_limit: int = 200) -> ConformanceReport:
    """Run every check on an env (a built-in name, 'package.module:Class', a class, or a factory)."""
    make, label = _factory(env, kwargs)
    report = ConformanceReport(label)
    instance = make()
    _require(isinstance(instance, Env), f"{label} does not build an envs.base.Env (got {type(instance).__name__})")
    state: dict[str, Any] = {}
    checks = [("class", _check_class), ("splits", _check_splits), ("determinism", _check_determinism),
              ("reset_step", _check_reset_step), ("admissible", _check_admissible), ("expert", _check_expert),
              ("hindsight", _check_hindsight), ("canonicalize", _check_canonicalize),
              ("prompting", _check_prompting), ("fuzz", _check_fuzz)]
    try:
        for name, check in checks:
            start = time.perf_counter()
            try:
                detail = check(instance, make, tasks, seed, fuzz, expert_limit, state) or ""
                status = "pass"
            except _Skip as skip:
                status, detail = "skip", str(skip)
            except _CheckFailed as failure:
                status, detail = "fail", str(failure)
            except Exception as exc:  # the env raised where it must not
                tb = traceback.format_exc(limit=-2).strip().splitlines()
                status, detail = "fail", f"raised {type(exc).__name__}: {exc} [{' | '.join(tb[-3:])}]"
            report.results.append(CheckResult(name, status, detail, time.perf_counter() - start))
    finally:
        start = time.perf_counter()
        try:
            instance.close()
            instance.close()
            report.results.append(CheckResult("close", "pass", "close() twice", time.perf_counter() - start))
        except Exception as exc:
            report.results.append(CheckResult("close", "fail", f"close() raised {type(exc).__name__}: {exc}",
                                              time.perf_counter() - start))
    return report


def _check_class(env: Env, make, n, seed, fuzz, limit, state) -> str:
    cls = type(env)
    _require(isinstance(getattr(cls, "name", None), str) and cls.name != "", "the class needs a non-empty `name`")
    types = getattr(cls, "task_types", None)
    _require(isinstance(types, tuple) and types and all(isinstance(t, str) for t in types),
             "`task_types` must be a non-empty tuple of str")
    return f"name={cls.name!r}, {len(types)} task types"


def _check_splits(env: Env, make, n, seed, fuzz, limit, state) -> str:
    ids, contents = {}, {}
    for split in SPLITS:
        tasks = env.sample_tasks(split, n, seed)
        _require(isinstance(tasks, list) and len(tasks) == n, f"sample_tasks({split!r}, {n}) gave {len(tasks)} tasks")
        for task in tasks:
            _require(isinstance(task, TaskSpec), f"sample_tasks gave a {type(task).__name__}, not a TaskSpec")
            _require(task.env == env.name and task.split == split,
                     f"task {task.task_id}: env/split are {task.env!r}/{task.split!r}, expected {env.name!r}/{split!r}")
            _require(task.task_type in env.task_types, f"task type {task.task_type!r} is not in task_types")
            try:
                json.dumps(task.spec)
            except (TypeError, ValueError) as exc:
                raise _CheckFailed(f"task {task.task_id}: spec is not JSON-ready ({exc})") from None
            back = TaskSpec.from_row(task.to_row())
            _require(back.task_id == task.task_id and back.spec == task.spec,
                     f"task {task.task_id} does not survive to_row/from_row")
        ids[split] = {t.task_id for t in tasks}
        contents[split] = {(t.task_type, json.dumps(t.spec, sort_keys=True)) for t in tasks}
        state[split] = tasks
    _require(not ids["train"] & ids["heldout"], "a task id appears in both train and heldout")
    _require(not contents["train"] & contents["heldout"], "the same task (type and spec) is in both train and heldout")
    try:
        env.sample_tasks("no-such-split", 1, seed)
    except ValueError:
        pass
    else:
        raise _CheckFailed("sample_tasks('no-such-split') must raise ValueError")
    types = sorted({t.task_type for t in state["train"]})
    return f"{n} train + {n} heldout tasks, disjoint; train types: {', '.join(types)}"


def _probe_actions(env: Env, rng: random.Random) -> str:
    """An action for determinism probes: the expert's, else a random admissible one, else a fixed text."""
    action = env.expert_action()
    if action is None:
        admissible = env.admissible_actions()
        action = rng.choice(admissible) if admissible else "look"
    return action


def _check_determinism(env: Env, make, n, seed, fuzz, limit, state) -> str:
    _require("train" in state, "needs the splits check to pass")
    for split in SPLITS:
        again = [t.task_id for t in env.sample_tasks(split, n, seed)]
        _require(again == [t.task_id for t in state[split]], f"sample_tasks({split!r}, seed={seed}) differs between calls")
    other = make()
    try:
        _require([t.task_id for t in other.sample_tasks("train", n, seed)] == [t.task_id for t in state["train"]],
                 "a fresh instance samples other tasks for the same seed")
        _require([t.task_id for t in env.sample_tasks("train", n, seed + 1)] != [t.task_id for t in state["train"]],
                 "another seed gives exactly the same tasks")
        for task in state["train"][: min(n, 4)]:
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
                                             f"in two instances")
    finally:
        other.close()
    return "same seed -> same tasks and episodes (two instances); another seed -> other tasks"


def _check_reset_step(env: Env, make, n, seed, fuzz, limit, state) -> str:
    for task in state["train"] + state["heldout"]:
        observation = env.reset(task)
        _require(isinstance(observation, str) and observation.strip() != "",
                 f"reset({task.task_id}) must return a non-empty str")
        rng = random.Random(seed)
        _check_result(env.step(_probe_actions(env, rng)), "probe")
    return f"{2 * n} resets"


def _check_admissible(env: Env, make, n, seed, fuzz, limit, state) -> str:
    rng = random.Random(seed)
    played = listed = accepted = 0
    exact = getattr(type(env), "admissible_exact", True)
    for task in state["train"][: max(1, n // 2)]:
        env.reset(task)
        for _ in range(10):
            actions = env.admissible_actions()
            if actions is None:
                raise _Skip("admissible_actions() is None: a free-form env") if played == 0 else _CheckFailed(
                    "admissible_actions() switched from a list to None mid-episode")
            _require(isinstance(actions, list) and all(isinstance(a, str) for a in actions),
                     "admissible_actions() must be None or a list of str")
            if not actions:
                break
            listed += len(actions)
            action = rng.choice(actions)
            result = _check_result(env.step(action), action)
            if result.info["valid"]:
                accepted += 1
            else:
                _require(not exact, f"admissible action {action!r} was rejected: {result.observation[:120]!r}")
            played += 1
            if result.done:
                break
    if exact:
        return f"{played} admissible actions played, all accepted ({listed} listed)"
    _require(accepted >= 0.5 * played, f"only {accepted}/{played} admissible actions were accepted")
    return (f"{accepted}/{played} admissible actions accepted ({listed} listed; the env declares "
            "admissible_exact = False: its lists over-generate)")


def _check_expert(env: Env, make, n, seed, fuzz, limit, state) -> str:
    env.reset(state["train"][0])
    if env.expert_action() is None:
        raise _Skip("expert_action() is None: the env has no scripted expert")
    solved, steps, failed = 0, 0, []
    tasks = state["train"] + state["heldout"]
    for task in tasks:
        ok, actions = _play_expert(env, task, limit)
        solved += ok
        steps += len(actions)
        if not ok:
            failed.append(task.task_id)
    _require(not failed, f"the expert failed {len(failed)}/{len(tasks)} tasks, e.g. {failed[:3]}")
    state["expert"] = True
    return f"expert solved {solved}/{len(tasks)} tasks ({steps / len(tasks):.1f} steps each)"


def _check_hindsight(env: Env, make, n, seed, fuzz, limit, state) -> str:
    def facts() -> list[str]:
        out = env.hindsight()
        _require(isinstance(out, list) and all(isinstance(f, str) for f in out), "hindsight() must be a list of str")
        return out

    counts = []
    for task in state["train"][: min(n, 6)]:
        env.reset(task)
        facts()
        rng = random.Random(seed)
        for _ in range(limit):
            result = env.step(_probe_actions(env, rng))
            facts()
            if result.done:
                break
        counts.append(len(facts()))
    return f"lists of str; {sum(counts) / len(counts):.1f} facts at the end of an episode"


def _check_canonicalize(env: Env, make, n, seed, fuzz, limit, state) -> str:
    texts = hostile_actions(min(fuzz, 300), seed, [])
    symbols = set()
    for task in state["train"][: min(n, 4)]:
        env.reset(task)
        rng = random.Random(seed)
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


def _check_prompting(env: Env, make, n, seed, fuzz, limit, state) -> str:
    text = env.instructions()
    _require(isinstance(text, str) and text.strip() != "", "instructions() must be a non-empty str")
    demo = env.demonstration()
    _require(isinstance(demo, list), "demonstration() must be a list")
    for turn in demo:
        _require(isinstance(turn, tuple) and len(turn) == 3, "each demonstration turn is (observation, admissible, action)")
        observation, admissible, action = turn
        _require(isinstance(observation, str) and isinstance(action, str)
                 and (admissible is None or (isinstance(admissible, list) and all(isinstance(a, str) for a in admissible))),
                 "demonstration turn types: (str, list[str] | None, str)")
    return f"{len(text)}-char instructions, {len(demo)} demonstration turns"


def _check_fuzz(env: Env, make, n, seed, fuzz, limit, state) -> str:
    if fuzz <= 0:
        raise _Skip("fuzz=0")
    tasks = state["train"] + state["heldout"]
    real: list[str] = []
    for task in tasks[:4]:
        env.reset(task)
        rng = random.Random(seed)
        for _ in range(6):
            action = _probe_actions(env, rng)
            real.append(action)
            if env.step(action).done:
                break
        real += (env.admissible_actions() or [])[:20]
    actions = hostile_actions(fuzz, seed, real)
    rejected, resets, episode = 0, 0, 0
    feedback: dict[str, int] = {}
    first = True
    env.reset(tasks[0])
    for action in actions:
        result = _check_result(env.step(action), action)
        if not result.info["valid"]:
            rejected += 1
            feedback[result.info["feedback"]] = feedback.get(result.info["feedback"], 0) + 1
            _require(not (first and result.done),
                     f"the rejected first action {_show(action)} ended the episode: {result.observation[:100]!r}")
        first = False
        if result.done:
            episode += 1
            resets += 1
            env.reset(tasks[episode % len(tasks)])
            first = True
    recovered = ""
    if state.get("expert"):
        for i, task in enumerate(tasks[: min(len(tasks), 6)]):
            ok, _ = _play_expert(env, task, limit, after=[actions[(i * 7) % len(actions)]])
            _require(ok, f"after the hostile action {_show(actions[(i * 7) % len(actions)])} the expert no longer "
                         f"solves task {task.task_id}")
        recovered = "; the expert still solves tasks after a hostile action"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(feedback.items(), key=lambda kv: -kv[1]))
    return f"{len(actions)} actions, none raised; {rejected} rejected ({kinds}); {resets} episodes ended{recovered}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("env", help="a built-in env name or 'package.module:Class'")
    parser.add_argument("--kwargs", default="{}", help="JSON object of constructor keyword arguments")
    parser.add_argument("--tasks", type=int, default=12, help="tasks sampled per split (default 12)")
    parser.add_argument("--fuzz", type=int, default=2000, help="random and hostile actions (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = check_env(args.env, json.loads(args.kwargs), tasks=args.tasks, seed=args.seed, fuzz=args.fuzz)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
