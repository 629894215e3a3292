"""SRD (Self-Retrospection Distillation, arXiv 2610.08077): hindsight pitfalls distilled into foresight.

Per group of rollouts of one task:
1. For failed trajectories the policy writes *pitfall notes* (1-3 blocks of Error / Rule / Example)
   from the task, its failed attempt, the env's privileged `hindsight()` facts, the failure kind
   and the env's feedback. Optionally, successes give *knowledge notes* (Knowledge / Rule + Details).
2. The *foresight pair*: the student prompt is the task only, asking the model to predict the
   pitfalls before acting; the student samples a foresight z. The teacher prompt is the same with
   "Observed pitfalls (privileged, do not reveal): <the group's notes>" in the user turn.
3. Training adds λ · D(teacher ‖ student) over the student's own z tokens (models/distill.py).
4. (ours) The action channel: the same notes in the episode's task message (teacher) or not
   (student), scored on the episode's own action tokens.

This module builds prompts, classifies failures, writes template notes and assembles the
teacher/student pairs; it never calls a model (methods/srd/method.py does, through a backend).
The privileged text only ever goes into the teacher's user turn, never into a system or
assistant message and never into the student's prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PRIVILEGED_HEADER = "Observed pitfalls (privileged, do not reveal):"
FORESIGHT_REQUEST = ("Before acting, predict the pitfalls of this task: write 1-3 short notes, each as "
                     "'Error: ... Rule: ... Example: ...'.")
FAILURE_KINDS = ("crash", "invalid_action", "timeout", "wrong_result")

_NOTE_SYSTEM = ("You review an agent's attempt at a task and write short notes that would help a future attempt. "
                "Be concrete and general: name the rule, not this episode's accident.")


@dataclass(frozen=True)
class Attempt:
    """What a note writer sees of one trajectory."""

    traj_id: str
    group_id: str
    task_id: str
    task_text: str                 # the task as the agent first saw it (the env's first observation)
    actions: list[str]             # the executed actions
    observations: list[str]        # the env's reply after each action (None-free; may be shorter)
    valid: list[bool]              # per action: did the env understand and execute it
    feedback: list[str]            # per action: the env's feedback kind ("ok", "inadmissible", ...)
    hindsight: list[str]           # the env's privileged facts after the episode
    success: bool
    status: str                    # success | failure | error
    n_turns: int
    max_turns: int
    error: str | None = None
    solution: list[str] | None = None   # env.solution() right after reset(task): actions that solve it from the start
    rules: list[str] = field(default_factory=list)   # env.rules() right after reset(task): no statement, no answer


@dataclass
class Note:
    note_id: str
    traj_id: str
    group_id: str
    task_id: str
    channel: str                   # pitfall | knowledge
    writer: str                    # policy | template
    failure_kind: str | None
    prompt: list[dict]             # the messages the writer was given (for template: the same prompt, for the record)
    text: str = ""
    n_tokens: int = 0
    usable: bool = False


@dataclass
class ForesightPair:
    """A teacher/student pair. `student` and `teacher` are chat messages ending with the user turn the
    completion answers (foresight channel), or whole conversations (action channel), identical except
    for the privileged text in one user message. Assistant messages at index >= `train_from` are the
    completion that is scored."""

    pair_id: str
    group_id: str
    task_id: str
    channel: str                   # pitfall | knowledge | action
    note_ids: list[str]
    student: list[dict]
    teacher: list[dict]
    privileged: str
    source_traj_id: str | None = None
    train_from: int | None = None
    completion_ids: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)


def failure_kind(a: Attempt) -> str:
    """crash (the env raised), invalid_action (most actions were not understood or not admissible),
    timeout (the turn limit ended it) or wrong_result (the env ended it as failed)."""
    if a.status == "error":
        return "crash"
    if a.valid and sum(not v for v in a.valid) * 2 > len(a.valid):
        return "invalid_action"
    if a.n_turns >= a.max_turns:
        return "timeout"
    return "wrong_result"


def _attempt_text(a: Attempt, max_actions: int = 12) -> str:
    lines = []
    steps = list(zip(a.actions, a.feedback))
    shown = steps if len(steps) <= max_actions else (
        steps[: max_actions // 2] + [("...", "")] + steps[-max_actions // 2:])
    for i, (act, fb) in enumerate(shown, 1):
        lines.append(f"{i}. {act}" + (f"  [{fb}]" if fb and fb != "ok" else ""))
    return "\n".join(lines) or "(no action)"


def _feedback_text(a: Attempt, max_items: int = 3) -> str:
    bad = [(act, obs) for act, obs, v in zip(a.actions, a.observations, a.valid) if not v]
    items = [f'"{act}" -> {obs.strip()[:160]}' for act, obs in bad[-max_items:]]
    if a.error:
        items.append(f"the env raised: {a.error.splitlines()[0][:160]}")
    if not items and a.observations:
        items.append(f"last observation: {a.observations[-1].strip()[:160]}")
    return "\n".join(items) or "(none)"


def _pitfall_request(task: str, attempt: str, kind: str, feedback: str, facts: list[str]) -> str:
    return (f"Task:\n{task.strip()}\n\n"
            f"The agent's failed attempt:\n{attempt}\n\n"
            f"Failure kind: {kind}\n\n"
            f"Env feedback:\n{feedback}\n\n"
            "What really was the case (privileged, revealed after the episode):\n"
            + "\n".join(f"- {h}" for h in facts) + "\n\n"
            "Write 1-3 pitfall notes for a future attempt at tasks like this one. Each note is three lines:\n"
            "Error: <what went wrong>\nRule: <the general rule that avoids it>\nExample: <one correct action>")


# One worked exchange shown before the real request (few-shot), so that small policies answer in
# the note format at all. Its task is deliberately unlike any built-in env's.
_PITFALL_DEMO = (
    _pitfall_request("You are in a workshop. You see a toolbox 1 and a bench 1.\n"
                     "Your task is to: put a sharp saw on bench 1.",
                     "1. go to bench 1\n2. put saw 1 in/on bench 1  [inadmissible]\n3. look", "invalid_action",
                     '"put saw 1 in/on bench 1" -> You are not carrying saw 1.',
                     ["saw 1 was in toolbox 1 (closed) at the start.",
                      "The saw must be sharpened with grinder 1 first."]),
    "Error: I tried to put the saw down without holding it.\nRule: find and take the object before placing it; "
    "open closed containers to find it.\nExample: open toolbox 1\n\n"
    "Error: the saw was never sharpened.\nRule: do every step the task names (sharpen) before placing.\n"
    "Example: sharpen saw 1 with grinder 1",
)


def pitfall_note_messages(a: Attempt, few_shot: bool = True) -> list[dict]:
    """The pitfall-note prompt (SRD step 2): task, failed attempt, privileged truth, failure kind, feedback;
    with `few_shot`, one worked example exchange first."""
    msgs = [{"role": "system", "content": _NOTE_SYSTEM}]
    if few_shot:
        msgs += [{"role": "user", "content": _PITFALL_DEMO[0]}, {"role": "assistant", "content": _PITFALL_DEMO[1]}]
    msgs.append({"role": "user", "content": _pitfall_request(a.task_text, _attempt_text(a), failure_kind(a),
                                                              _feedback_text(a), a.hindsight)})
    return msgs


def knowledge_note_messages(a: Attempt) -> list[dict]:
    """The knowledge-note prompt: what a successful attempt knew that a future attempt should too."""
    user = (f"Task:\n{a.task_text.strip()}\n\n"
            f"The agent's successful attempt:\n{_attempt_text(a)}\n\n"
            "Facts revealed after the episode:\n" + "\n".join(f"- {h}" for h in a.hindsight) + "\n\n"
            "Write 1-2 knowledge notes for future attempts at tasks like this one. Each note is two lines:\n"
            "Knowledge: <the rule that made it work>\nDetails: <the concrete steps>")
    return [{"role": "system", "content": _NOTE_SYSTEM}, {"role": "user", "content": user}]


_KIND_RULES = {  # the Rule where the env states none (Env.rules() is empty)
    "invalid_action": "reply with exactly one action in the format the instructions give.",
    "timeout": "head for the goal step by step and don't repeat actions that change nothing.",
    "crash": "reply with exactly one action in the format the instructions give.",
    "wrong_result": "check every condition of the task before the action that ends it.",
}


def _same_action(a: str, b: str) -> bool:
    """Equal up to case, whitespace and a trailing period (as `envs.rollout.project_action` normalises)."""
    return " ".join(a.lower().split()).rstrip(".") == " ".join(b.lower().split()).rstrip(".")


def first_divergence(actions: list[str], solution: list[str]) -> int:
    """The index of the attempt's first action that differs from the solution's action at the same
    place; the attempt's length when all its actions follow the solution."""
    for i, (act, planned) in enumerate(zip(actions, solution)):
        if not _same_action(act, planned):
            return i
    return min(len(actions), len(solution))


def template_note(a: Attempt, channel: str = "pitfall") -> str:
    """A note assembled from the env's contract, without a model (the `template` writer, for models
    too small to write usable notes).

    Pitfall: Error from the failure kind and the first refused action; Rule from `a.rules` (the env's
    `rules()`: at most three, no task statement or answer), else a generic rule for the failure kind;
    Example: the solution's action where the attempt first left it (`first_divergence`), its first
    action where the attempt followed it to the end; no Example line without a solution.
    Knowledge: the env's first rule, with the successful attempt's own actions as Details.
    The hindsight facts are never used: they may state the task and its answer."""
    if channel == "knowledge":
        knowledge = a.rules[0] if a.rules else "follow the task statement step by step."
        return f"Knowledge: {knowledge}\nDetails: {'; '.join(a.actions) or '(no action)'}"
    kind = failure_kind(a)
    bad = [(act, fb) for act, fb, v in zip(a.actions, a.feedback, a.valid) if not v]
    if kind == "invalid_action" and bad:
        error = f"{len(bad)} of {len(a.actions)} actions were not valid (e.g. \"{bad[0][0]}\": {bad[0][1]})."
    elif kind == "timeout":
        error = f"the turn limit ({a.max_turns}) ran out before the task was done."
    elif kind == "crash":
        error = "the episode crashed."
    else:
        error = "the episode ended without completing the task."
    rule = " ".join(a.rules[:3]) or _KIND_RULES[kind]
    note = f"Error: {error}\nRule: {rule}"
    if a.solution:
        at = first_divergence(a.actions, a.solution)
        note += f"\nExample: {a.solution[at] if at < len(a.solution) else a.solution[0]}"
    return note


_LABELS = {"pitfall": ("error", "rule", "example"), "knowledge": ("knowledge", "rule", "details")}
_BLOCK_START = re.compile(r"^\s*(?:\d+[.)]\s*|[-*]\s*)?(Error|Knowledge)\s*:", re.IGNORECASE | re.MULTILINE)


def clean_note(text: str, channel: str = "pitfall", max_blocks: int = 3, max_chars: int = 800) -> tuple[str, bool]:
    """(cleaned text, usable). A block starts at 'Error:' (pitfall) or 'Knowledge:' (knowledge) and
    keeps its labelled lines (Error/Rule/Example, or Knowledge/Rule/Details) up to the first line with
    another label; repeated blocks are dropped; at most `max_blocks` are kept. A note is usable when
    one block is left. Unusable notes are stored and counted, never given to the teacher."""
    text = text.replace("\r", "").strip()
    key = "error" if channel == "pitfall" else "knowledge"
    starts = [m for m in _BLOCK_START.finditer(text) if m.group(1).lower() == key]
    if not starts:
        return text[:max_chars], False
    labels = _LABELS[channel]
    blocks: list[str] = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        kept = []
        for line in text[m.start():end].strip().splitlines():
            head, sep, body = line.strip().lstrip("-*0123456789.) ").partition(":")
            if not sep:
                if kept and line.strip():
                    kept[-1] += " " + line.strip()  # a wrapped line of the field above
                continue
            if head.strip().lower() not in labels:
                break  # the writer ran on into something else ("Failure kind: ...")
            if body.strip():
                kept.append(f"{head.strip().capitalize()}: {body.strip()}")
        if kept and kept[0].lower().startswith(key) and kept not in [b.splitlines() for b in blocks]:
            blocks.append("\n".join(kept))
        if len(blocks) == max_blocks:
            break
    cleaned = "\n\n".join(blocks)[:max_chars]
    return cleaned, bool(blocks)


def foresight_student(instructions: str, task_text: str) -> list[dict]:
    """The student's prompt: the task only, asking for pitfalls before acting."""
    return [{"role": "system", "content": instructions},
            {"role": "user", "content": f"{task_text.strip()}\n\n{FORESIGHT_REQUEST}"}]


def privileged_block(notes: list[str]) -> str:
    """The teacher's extra text: the header and the notes, each distinct note once."""
    distinct = list(dict.fromkeys(n.strip() for n in notes if n.strip()))
    return PRIVILEGED_HEADER + "\n" + "\n\n".join(distinct)


def with_privileged(messages: list[dict], user_index: int, privileged: str) -> list[dict]:
    """A copy of `messages` with `privileged` added to the user message at `user_index`, before the
    request when the message ends with the foresight request. Raises if that message is not a user turn."""
    if not 0 <= user_index < len(messages) or messages[user_index]["role"] != "user":
        raise ValueError(f"privileged text goes into a user turn; message {user_index} is not one")
    out = [dict(m) for m in messages]
    content = out[user_index]["content"]
    if content.endswith(FORESIGHT_REQUEST):
        head = content[: -len(FORESIGHT_REQUEST)].rstrip()
        out[user_index]["content"] = f"{head}\n\n{privileged}\n\n{FORESIGHT_REQUEST}"
    else:
        out[user_index]["content"] = f"{content.rstrip()}\n\n{privileged}"
    return out


def foresight_pair(pair_id: str, group_id: str, task_id: str, instructions: str, task_text: str,
                   notes: list[Note], channel: str = "pitfall") -> ForesightPair:
    """Student = task only; teacher = the same + the group's usable notes of `channel` in the user turn."""
    usable = [n for n in notes if n.usable and n.channel == channel]
    if not usable:
        raise ValueError(f"group {group_id}: no usable {channel} note to build a teacher from")
    student = foresight_student(instructions, task_text)
    privileged = privileged_block([n.text for n in usable])
    teacher = with_privileged(student, len(student) - 1, privileged)
    return ForesightPair(pair_id, group_id, task_id, channel, [n.note_id for n in usable], student, teacher, privileged,
                         train_from=len(student))


def action_pair(pair_id: str, traj: dict, notes: list[Note]) -> ForesightPair:
    """(ours) The action channel: the episode's conversation (`traj["messages"]`, whose first
    `traj["train_from"]` messages are the prompt prefix) as the student; the teacher has the group's
    pitfall notes in the episode's first user message. Scored on the episode's own actions."""
    usable = [n for n in notes if n.usable and n.channel == "pitfall"]
    if not usable:
        raise ValueError(f"trajectory {traj['traj_id']}: no usable pitfall note")
    start = int(traj["train_from"])
    student = [dict(m) for m in traj["messages"]]
    privileged = privileged_block([n.text for n in usable])
    teacher = with_privileged(student, start, privileged)
    return ForesightPair(pair_id, traj["group_id"], traj["task_id"], "action", [n.note_id for n in usable],
                         student, teacher, privileged, source_traj_id=traj["traj_id"], train_from=start)
