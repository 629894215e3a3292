"""RSIPO (docs/methods.md, RSIPO): skills written by the policy, checked by replay, trusted by empirical Bayes.

Per training task x of type k (G student rollouts without a skill, rewards R^S):
1. The policy writes a skill σ_x from its best rollout: a short, reusable procedure without the episode's
   concrete object ids (`skill_messages`); `check_skill` rejects one that leaks them. The `template` writer
   (for models too small to write usable skills) renders canonical actions instead (`template_skill`).
2. Replay: M rollouts of the same task from the same seed with σ_x in the task message (R^T).
3. g_x = mean(R^T) − mean(R^S); v_x = Var(R^T)/M + Var(R^S)/G (sample variances, ddof 1: v_x estimates
   the variance of the difference of two means).
4. Per type k over the round's tests: ḡ_k = mean g_x; τ²_k = max(0, Var_x(g_x) − mean_x(v_x)) (sample
   variance over the type's tests; 0 for a type with one test); B_x = τ²_k / (τ²_k + v_x) (0 when τ²_k = 0:
   no spread beyond noise, every gain is shrunk to the type's mean); g̃_x = ḡ_k + B_x (g_x − ḡ_k);
   w_x = clip(g̃_x / c, 0, 1); the centred gain ĝ_x = g_x − ḡ_k is the advantage of σ_x's writing tokens.
5. The library: skills persist across rounds with their tests; `retrieve` picks candidates of a task's
   type by lexical match with the task text; `library_entry` summarises a skill's tests (mean gain with an
   interval, last shrunk gain and weight) and retires it once its last `retire_after` shrunk gains are ≤ 0.

Plain Python: no model, no store. methods/rsipo/method.py runs the model and the replays.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import mean, variance

from rsiflow.envs.rollout import env_observation

SKILL_HEADER = "Skill (a procedure that helped on tasks of this kind):"
WRITERS = ("policy", "template")

_SKILL_SYSTEM = ("You turn an agent's episode into a skill: a short, reusable procedure for tasks of the same kind. "
                 "Write general steps (the object, the target), never the names with numbers of this episode.")


def _attempt_text(actions: list[str], max_actions: int = 12) -> str:
    shown = actions if len(actions) <= max_actions else (
        actions[: max_actions // 2] + ["..."] + actions[-max_actions // 2:])
    return "\n".join(f"{i}. {a}" for i, a in enumerate(shown, 1)) or "(no action)"


def _skill_request(task_type: str, task_text: str, actions: list[str], success: bool) -> str:
    outcome = "it succeeded" if success else "it did not succeed; keep what was useful"
    return (f"Task type: {task_type}\nTask:\n{task_text.strip()}\n\n"
            f"The agent's attempt ({outcome}):\n{_attempt_text(actions)}\n\n"
            "Write a skill for tasks of this type: 2-6 numbered steps in general words. Never name this episode's "
            "objects or places with their numbers (no 'mug 1', no '3').")


# One worked exchange before the real request, so that small policies answer in the format at all. Its task is
# deliberately unlike any built-in env's.
_SKILL_DEMO = (
    _skill_request("sharpen_then_place", "You are in a workshop. You see a toolbox 1, a grinder 1 and a bench 1.\n"
                   "Your task is to: put a sharp saw on bench 1.",
                   ["go to toolbox 1", "open toolbox 1", "take saw 1 from toolbox 1", "go to grinder 1",
                    "sharpen saw 1 with grinder 1", "go to bench 1", "put saw 1 in/on bench 1"], True),
    "1. Find the tool: go to the containers where it may be and open the closed ones.\n2. Take the tool.\n"
    "3. Go to the grinder and sharpen the tool with it.\n4. Go to the target and put the tool there.",
)


def skill_messages(task_type: str, task_text: str, actions: list[str], success: bool,
                   few_shot: bool = True) -> list[dict]:
    """The skill-writing prompt: the task, its type and one rollout's actions; the policy answers with the skill.
    With `few_shot`, one worked exchange first."""
    msgs = [{"role": "system", "content": _SKILL_SYSTEM}]
    if few_shot:
        msgs += [{"role": "user", "content": _SKILL_DEMO[0]}, {"role": "assistant", "content": _SKILL_DEMO[1]}]
    msgs.append({"role": "user", "content": _skill_request(task_type, task_text, actions, success)})
    return msgs


# ---- the leak checker ------------------------------------------------------------------------------

_NAMED = re.compile(r"\b([a-z][a-z_-]*) (\d+)\b")
_FUNCTION_WORDS = {"a", "an", "and", "at", "by", "from", "in", "is", "of", "on", "or", "plus", "minus", "than", "the",
                   "times", "to", "with", "was", "are", "be", "into", "onto", "over", "under"}
_NUMBER = re.compile(r"(?<![\w.])(\d+)(?![\w]|\.\d)")
_LIST_NUMBER = re.compile(r"^\s*(?:step\s*)?\d+\s*[.):]", re.IGNORECASE | re.MULTILINE)


def concrete_ids(texts: list[str]) -> set[str]:
    """The episode's concrete ids in `texts` (the task message, the executed actions), lowercased: every
    "<name> <number>" ("mug 1", "cabinet 3"; not after a function word: in "is 3" the id is the number 3), and
    every other standalone number (an arithmetic operand, an answer)."""
    ids: set[str] = set()
    for text in texts:
        low = text.lower()
        named = [m for m in _NAMED.finditer(low) if m.group(1) not in _FUNCTION_WORDS]
        ids.update(f"{m.group(1)} {m.group(2)}" for m in named)
        spans = [m.span(2) for m in named]
        ids.update(m.group(1) for m in _NUMBER.finditer(low)
                   if not any(a <= m.start(1) < b for a, b in spans))
    return ids


def leaked_ids(skill: str, ids: set[str]) -> list[str]:
    """The ids of `ids` the skill names, sorted (list numbering such as "1." at a line start is not a leak)."""
    text = _LIST_NUMBER.sub(" ", skill.lower())
    out = []
    for i in sorted(ids):
        pattern = rf"\b{re.escape(i)}\b" if not i.isdigit() else rf"(?<![\w.]){i}(?![\w]|\.\d)"
        if re.search(pattern, text):
            out.append(i)
    return out


def clean_skill(raw: str, max_chars: int = 600) -> str:
    """The skill as kept: stripped, blank lines dropped, at most `max_chars` characters (cut at a line end; a
    single line at a word end), so the stored text is exactly what `skill_block` shows."""
    lines = [line.rstrip() for line in raw.replace("\r", "").strip().splitlines() if line.strip()]
    text = "\n".join(lines)
    if len(text) > max_chars:
        cut = text[:max_chars]
        end = cut.rfind("\n") if "\n" in cut else cut.rfind(" ")
        text = (cut[:end] if end > 0 else cut).rstrip()
    return text


def check_skill(text: str, ids: set[str], min_words: int = 3) -> tuple[bool, str | None, list[str]]:
    """(usable, why not, leaked ids): a skill is usable when it has at least `min_words` words and names none of
    the episode's concrete ids. Unusable skills are stored with the reason, never replayed or taught."""
    leaked = leaked_ids(text, ids)
    if leaked:
        return False, "leaks the episode's ids: " + ", ".join(leaked), leaked
    if len(re.findall(r"[A-Za-z]{2,}", text)) < min_words:
        return False, f"fewer than {min_words} words", []
    return True, None, []


# ---- the template writer ---------------------------------------------------------------------------

def _render_symbol(symbol: str) -> str:
    verb, _, roles = symbol.partition("<")
    roles = roles.rstrip(">")
    return f"{verb} <{roles.replace(',', ', ')}>" if roles else verb


def template_skill(task_type: str, symbols: list[str], source: str, max_steps: int = 12) -> str:
    """A skill rendered from canonical `verb<role>` actions (no ids by construction), runs of one symbol folded into
    one step: the `template` writer. `source` says whose actions they were ("rollout" or "expert")."""
    steps: list[tuple[str, int]] = []
    for s in symbols:
        if steps and steps[-1][0] == s:
            steps[-1] = (s, steps[-1][1] + 1)
        else:
            steps.append((s, 1))
    lines = [f"{i}. {_render_symbol(s)}" + (f" (repeat, {n} times)" if n > 1 else "")
             for i, (s, n) in enumerate(steps[:max_steps], 1)]
    return f"Procedure for {task_type} tasks (the {source}'s actions, in general form):\n" + "\n".join(lines)


# ---- where the skill goes in a prompt ---------------------------------------------------------------

def skill_block(text: str) -> str:
    return f"{SKILL_HEADER}\n{text.strip()}"


def replay_observation(observation: str, block: str) -> str:
    """The task message a replay starts from: the env's first observation, then the skill block."""
    return f"{observation.rstrip()}\n\n{block}"


def with_skill(content: str, block: str) -> str:
    """A task message (as `envs.rollout.render_observation` made it) with the skill block after the env's
    observation and before the admissible actions and "Your action:": the same text a replay's task message has,
    so the teacher of the distillation is the policy the replay measured."""
    observation = env_observation(content)
    if not content.startswith(observation):
        raise ValueError("the task message does not start with its observation")
    return replay_observation(observation, block) + content[len(observation):]


def teacher_messages(student: list[dict], train_from: int, block: str) -> list[dict]:
    """The student's conversation with the skill in its task message (the user turn at `train_from`, before every
    assistant turn that is scored); raises if that message is not a user turn."""
    if not 0 <= train_from < len(student) or student[train_from]["role"] != "user":
        raise ValueError(f"the skill goes into the task message; message {train_from} is not a user turn")
    out = [dict(m) for m in student]
    out[train_from]["content"] = with_skill(out[train_from]["content"], block)
    return out


# ---- gains, noise and empirical-Bayes trust ----------------------------------------------------------

def gain(student: list[float], replay: list[float]) -> float:
    """g = mean(R^T) − mean(R^S)."""
    return mean(replay) - mean(student)


def noise_variance(student: list[float], replay: list[float]) -> float:
    """v = Var(R^T)/M + Var(R^S)/G with sample variances (ddof 1); both need at least 2 rewards."""
    if len(student) < 2 or len(replay) < 2:
        raise ValueError(f"noise variance needs at least 2 student and 2 replay rewards (got {len(student)} "
                         f"and {len(replay)})")
    return variance(replay) / len(replay) + variance(student) / len(student)


@dataclass(frozen=True)
class Trust:
    """One test's place in its type's empirical-Bayes fit (module docstring, step 4)."""

    gain: float          # g_x
    noise: float         # v_x
    type_mean: float     # ḡ_k
    tau2: float          # τ²_k
    shrink: float        # B_x
    shrunk: float        # g̃_x
    centred: float       # ĝ_x = g_x − ḡ_k
    weight: float        # w_x = clip(g̃_x / c, 0, 1)


def trust(tests: list[tuple[str, str, float, float]], c: float) -> dict[str, Trust]:
    """{key: Trust} for tests given as (key, task type, g, v), the fit done per task type (module docstring)."""
    if c <= 0:
        raise ValueError(f"the trust scale c must be > 0 (got {c})")
    by_type: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
    for key, task_type, g, v in tests:
        by_type[task_type].append((key, g, v))
    out = {}
    for members in by_type.values():
        gains = [g for _, g, _ in members]
        g_bar = mean(gains)
        spread = variance(gains) if len(gains) > 1 else 0.0
        tau2 = max(0.0, spread - mean(v for _, _, v in members))
        for key, g, v in members:
            b = tau2 / (tau2 + v) if tau2 > 0 else 0.0
            shrunk = g_bar + b * (g - g_bar)
            out[key] = Trust(gain=g, noise=v, type_mean=g_bar, tau2=tau2, shrink=b, shrunk=shrunk,
                             centred=g - g_bar, weight=min(max(shrunk / c, 0.0), 1.0))
    return out


# ---- the library -------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z]{3,}")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def lexical_score(query: str, text: str) -> float:
    """Jaccard overlap of the words (3+ letters, numbers and ids left out) of a task text and a skill."""
    a, b = _words(query), _words(text)
    return len(a & b) / len(a | b) if a | b else 0.0


@dataclass
class LibrarySkill:
    """A skill of the library and its replay tests so far (each: round, test_id, task_id, gain, noise, shrunk,
    weight)."""

    skill_id: str
    task_type: str
    text: str
    author_model_id: str | None
    writer: str
    written_round: int
    tests: list[dict] = field(default_factory=list)
    status: str = "active"          # active | retired
    retired_round: int | None = None


def retrieve(library: list[LibrarySkill], task_type: str, task_text: str, k: int) -> list[tuple[LibrarySkill, float]]:
    """Up to k active skills of `task_type` for a task, best lexical match with the task text first (ties: the
    higher last shrunk gain, then the older skill), with their scores."""
    if k <= 0:
        return []
    pool = [s for s in library if s.status == "active" and s.task_type == task_type]
    scored = [(s, lexical_score(task_text, s.text)) for s in pool]
    scored.sort(key=lambda p: (-p[1], -(p[0].tests[-1]["shrunk"] if p[0].tests else 0.0), p[0].skill_id))
    return scored[:k]


def library_entry(skill: LibrarySkill, round_no: int, retire_after: int, z: float = 1.96) -> dict:
    """A skill's library summary after `round`'s tests, and its status: the mean gain over its tests with a
    normal interval (mean ± z·sqrt(Σ v)/n: tests are independent replays), the last gain, shrunk gain and weight,
    how many of its latest tests in a row had a shrunk gain ≤ 0; retired (from this round on) once that streak
    reaches `retire_after`. A retired skill stays retired."""
    tests = skill.tests
    streak = 0
    for t in reversed(tests):
        if t["shrunk"] > 0:
            break
        streak += 1
    if skill.status == "active" and tests and streak >= retire_after:
        skill.status, skill.retired_round = "retired", round_no
    n = len(tests)
    m = mean(t["gain"] for t in tests) if tests else None
    half = z * math.sqrt(sum(t["noise"] for t in tests)) / n if tests else None
    last = tests[-1] if tests else {}
    return {"skill_id": skill.skill_id, "task_type": skill.task_type, "text": skill.text,
            "author_model_id": skill.author_model_id, "writer": skill.writer, "written_round": skill.written_round,
            "status": skill.status, "retired_round": skill.retired_round, "n_tests": n, "mean_gain": m,
            "gain_ci_low": m - half if tests else None, "gain_ci_high": m + half if tests else None,
            "last_gain": last.get("gain"), "last_shrunk_gain": last.get("shrunk"), "last_weight": last.get("weight"),
            "nonpositive_streak": streak, "tests": list(tests)}
