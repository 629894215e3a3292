"""The conformance check's edge cases: a sample that repeats a task id fails the splits check naming the ids and
the fix; an env call stuck in native code that SIGALRM can't interrupt (a C loop holding the GIL, a call with the
alarm blocked) or a crash of the process is reported with the call within about the time limit, and the remaining
checks run in a fresh process; the max_turns failure says which tasks these are; the header names the file the
env was loaded from and says so where the module is in two folders of the import path."""

import collections
import itertools
import json
import os
import re
import signal
import sys
import time

import pytest

from rsiflow.envs.arithmetic import ArithmeticEnv
from rsiflow.envs.conformance import CHECKS, CallTimedOut, check_env, main, module_copies, shadowing_note, time_limit

NAMES = [name for name, _ in CHECKS] + ["close"]


class _RepeatsIds(ArithmeticEnv):
    """Each task twice in a row, task id included: "100 train (50 distinct)"."""

    def sample_tasks(self, split, n, seed):
        tasks = super().sample_tasks(split, (n + 1) // 2, seed)
        return [t for t in tasks for _ in range(2)][:n]


class _OwnIds(_RepeatsIds):
    """The fix: each repeat its own seed, so its own id."""

    def sample_tasks(self, split, n, seed):
        tasks = super().sample_tasks(split, n, seed)
        return [t.__class__(t.env, t.split, t.task_type, t.seed * 2 + i % 2, t.spec) for i, t in enumerate(tasks)]


def test_a_sample_that_repeats_task_ids_fails_the_splits_check_naming_them():
    report = check_env(_RepeatsIds, tasks=10, fuzz=50)
    splits = {r.name: r for r in report.results}["splits"]
    assert splits.status == "fail" and not report.ok
    first = _RepeatsIds().sample_tasks("train", 10, 0)[0].task_id
    assert f"sample_tasks('train', 10, 0) gave 10 tasks with only 5 distinct task ids; repeated: {first} (x2)" \
        in splits.detail
    assert "sample_tasks('heldout', 10, 0) gave 10 tasks with only 5 distinct task ids" in splits.detail
    assert "give each repeat its own id (TaskSpec.seed is part of the id: set it to the repeat's index" in splits.detail
    passed = {r.name: r for r in check_env(_OwnIds, tasks=10, fuzz=50).results}["splits"]
    assert passed.status == "pass" and "10 train (5 distinct)" in passed.detail and "distinct ids" in passed.detail


# ---- calls that SIGALRM can't stop ----------------------------------------------------------------

def _c_loop() -> None:
    """Consume an endless iterator in C: the loop holds the GIL and never returns to the interpreter."""
    collections.deque(itertools.count(), maxlen=0)


def _blocked_sleep() -> None:
    """Wait in a call with SIGALRM blocked, as native code that masks signals does."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)


def test_sigalrm_does_not_stop_a_c_loop():
    """What the watchdog is for: an alarm during a C loop is only handled once the loop is done (a finite one)."""
    def loop():
        collections.deque(itertools.islice(itertools.count(), 10_000_000), maxlen=0)

    full = []
    for _ in range(2):
        start = time.monotonic()
        loop()
        full.append(time.monotonic() - start)
    start = time.monotonic()
    with pytest.raises(CallTimedOut):
        with time_limit(min(full) / 10, "loop"):
            loop()
    assert time.monotonic() - start > 0.3 * min(full)   # the alarm came at a tenth; it was handled at the end


class _HangsInC(ArithmeticEnv):
    def step(self, action):
        if "\x00" in action:
            _c_loop()
        return super().step(action)


class _HindsightBlocksAlarm(ArithmeticEnv):
    def hindsight(self):
        _blocked_sleep()
        return super().hindsight()


class _Crashes(ArithmeticEnv):
    def step(self, action):
        if "\x00" in action:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(action)


def _run(cls, timeout=2.0):
    seen = []
    start = time.monotonic()
    report = check_env(cls, tasks=4, fuzz=100, step_timeout=timeout, on_result=seen.append)
    assert seen == report.results   # every result was handed over as it came
    assert [r.name for r in report.results] == NAMES
    return {r.name: r for r in report.results}, time.monotonic() - start


def test_a_step_stuck_in_a_c_loop_is_reported_with_its_call_within_the_time_limit():
    by_name, seconds = _run(_HangsInC)
    assert seconds < 2 + 1 + 8   # the limit, the watchdog's margin, the checks themselves on a loaded machine
    fuzz = by_name["fuzz"]
    assert fuzz.status == "fail", fuzz
    assert re.search(r"step\('\\x00'\) on task arithmetic-[0-9a-f]{12} \(level\d\) did not return within 2 s and "
                     r"could not be interrupted", fuzz.detail), fuzz.detail
    assert "the check process was killed; last actions: " in fuzz.detail and "'\\x00' (of " in fuzz.detail
    assert fuzz.detail.endswith("; the remaining checks run in a fresh process")
    assert 2 < fuzz.seconds < 2 + 1 + 8
    assert all(r.status != "fail" for name, r in by_name.items() if name != "fuzz")


def test_a_call_with_the_alarm_blocked_fails_its_check_and_the_later_checks_run_on_the_earlier_ones_state():
    by_name, seconds = _run(_HindsightBlocksAlarm)
    assert seconds < 2 + 1 + 8
    hindsight = by_name["hindsight"]
    assert hindsight.status == "fail"
    assert re.search(r"hindsight\(\) on task arithmetic-[0-9a-f]{12} \(level\d\) did not return within 2 s",
                     hindsight.detail), hindsight.detail
    # canonicalize, prompting and fuzz need the tasks the splits check sampled in the killed process
    for name in ("canonicalize", "prompting", "fuzz", "close"):
        assert by_name[name].status == "pass", by_name[name]
    assert "100 actions, none raised" in by_name["fuzz"].detail


def test_a_crash_of_the_check_process_fails_the_check_naming_the_call():
    by_name, _ = _run(_Crashes)
    fuzz = by_name["fuzz"]
    assert fuzz.status == "fail"
    assert re.search(r"the check process died \(killed by signal 9\) during step\('\\x00'\) on task "
                     r"arithmetic-[0-9a-f]{12}", fuzz.detail), fuzz.detail
    assert by_name["close"].status == "pass"


def _hung_build():
    _blocked_sleep()


def test_an_env_whose_building_hangs_raises_within_the_time_limit():
    start = time.monotonic()
    with pytest.raises(CallTimedOut, match=r"building _hung_build did not return within 1 s and could not be"):
        check_env(_hung_build, tasks=2, fuzz=10, step_timeout=1)
    assert time.monotonic() - start < 1 + 1 + 5


def test_results_stream_from_the_check_process_as_each_check_finishes(tmp_path):
    """The env runs in the watched child; when its hindsight check begins it waits for the parent to have been
    handed the result of the check before it (on_result writes a file): results that came only at the end would
    leave it waiting."""
    handed, mark = tmp_path / "tools-handed", tmp_path / "hindsight-saw"

    class Waits(ArithmeticEnv):
        def hindsight(self):
            if not mark.exists():
                deadline = time.monotonic() + 10
                while not handed.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                mark.write_text("handed" if handed.exists() else "not handed")
            return super().hindsight()

    def on_result(result):
        if result.name == "tools":
            handed.write_text("")

    report = check_env(Waits, tasks=4, fuzz=50, on_result=on_result)
    assert report.ok, str(report)
    assert mark.read_text() == "handed"


def test_an_env_that_cannot_be_built_raises_as_before():
    with pytest.raises(TypeError, match="takes no argument|unexpected keyword"):
        check_env("arithmetic", {"no_such_kwarg": 1}, tasks=2, fuzz=10)


# ---- what the failures and the header say -----------------------------------------------------------

def test_the_max_turns_failure_names_each_tasks_type_and_spec():
    report = check_env("arithmetic", {"levels": ["level2"]}, tasks=4, fuzz=50, max_turns=0)
    result = {r.name: r for r in report.results}["max_turns"]
    assert result.status == "fail"
    first = ArithmeticEnv(levels=["level2"]).sample_tasks("train", 4, 0)[0]
    spec = json.dumps(first.spec, ensure_ascii=False)
    excerpt = spec[:80] + ("..." if len(spec) > 80 else "")
    assert f"{first.task_id} (level2: {excerpt}) (expert 1, solution 1 steps)" in result.detail, result.detail


ENV_MODULE = '''
from rsiflow.envs.arithmetic import ArithmeticEnv


class ShadowEnv(ArithmeticEnv):
    """{where}"""
'''


def test_the_header_names_the_loaded_file_and_the_copies_it_shadows(tmp_path, monkeypatch, capsys):
    package = "shadowpkg_conformance"
    for where in ("first", "cwd"):
        folder = tmp_path / where / package
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "envmod.py").write_text(ENV_MODULE.format(where=where))
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    monkeypatch.chdir(tmp_path / "cwd")
    for name in [package, f"{package}.envmod"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    loaded, other = tmp_path / "first" / package / "envmod.py", tmp_path / "cwd" / package / "envmod.py"
    assert module_copies(f"{package}.envmod") == [str(loaded), str(other)]

    assert main([f"{package}.envmod:ShadowEnv", "--tasks", "2", "--fuzz", "10"]) == 0
    header = capsys.readouterr().out.splitlines()[:3]
    assert header[1] == f"  env class {package}.envmod:ShadowEnv from {loaded}"
    assert header[2] == (f"  note: {package}.envmod is in 2 places on the import path: {loaded} (loaded), {other}. "
                         "`python -m` puts the current directory first on sys.path, `rsiflow` looks there last: to "
                         "check another copy, run from another directory or put its folder first on PYTHONPATH")
    assert sys.modules[f"{package}.envmod"].ShadowEnv.__doc__ == "first"


def test_no_note_for_a_module_found_once_or_a_built_in(capsys):
    assert shadowing_note("arithmetic") is None
    assert shadowing_note("examples.countdown_env:CountdownEnv") is None
    assert main(["arithmetic", "--tasks", "2", "--fuzz", "10"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  env class rsiflow.envs.arithmetic:ArithmeticEnv from ") and out[1].endswith(
        os.path.join("envs", "arithmetic.py"))
    assert not out[2].startswith("  note:")
