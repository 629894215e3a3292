"""SRD inside the distill step: hindsight notes from the round's rollouts, then foresight pairs.

Thin over methods/srd.py: it reads the round's trajectories, asks the champion (through the
generation backend) to write the notes (or assembles them with the `template` writer), lets the
student sample its foresight, and returns the rows for the `notes`, `foresight` and `examples`
tables plus the round's SRD counts. The distill task writes them in its one transaction.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import defaultdict
from statistics import mean

from configs.schema import Config
from envs.base import TaskSpec
from methods.groups import group_counts, group_stats
from methods.srd import (Attempt, ForesightPair, Note, action_pair, clean_note, failure_kind, foresight_pair,
                         knowledge_note_messages, pitfall_note_messages, template_note)
from models.backend import SamplingParams
from tasks.common import backend_for, env_factory, fetch_dicts, round_seed

log = logging.getLogger(__name__)

_RENDERED_TAIL = re.compile(r"\nValid actions:\n.*\Z|\nYour action:\s*\Z", re.DOTALL)


def _plain(observation: str) -> str:
    """An observation as the env wrote it (without the runner's action list and prompt)."""
    return _RENDERED_TAIL.sub("", observation)


def _task_texts(cfg: Config, specs: dict[str, TaskSpec]) -> tuple[dict[str, str], str]:
    """Each task's first observation (the env resets it again: cheap and exact) and the env's instructions."""
    env = env_factory(cfg)()
    try:
        return {tid: env.reset(spec) for tid, spec in specs.items()}, env.instructions()
    finally:
        env.close()


def load_inputs(store, run_id: str, round: int) -> dict:
    """What SRD reads from the store besides the trajectories: the round's tasks and turns.
    Read up front, so the store is not held open while the model writes."""
    return {
        "tasks": fetch_dicts(store, "SELECT task_id, env, split, task_type, seed, spec FROM tasks"
                             " WHERE run_id = ? AND round = ? AND step = 'generate'", [run_id, round]),
        "turns": fetch_dicts(store, "SELECT traj_id, turn_idx, observation, action_text, valid, feedback FROM turns"
                             " WHERE run_id = ? AND round = ? AND step = 'generate' ORDER BY traj_id, turn_idx",
                             [run_id, round]),
    }


def _attempts(cfg: Config, turns: list[dict], trajs: list[dict], task_text: dict[str, str]) -> list[Attempt]:
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for t in turns:
        by_traj[t["traj_id"]].append(t)
    out = []
    for t in trajs:
        ts = by_traj.get(t["traj_id"], [])
        hindsight = json.loads(t["hindsight"]) if isinstance(t["hindsight"], str) else (t["hindsight"] or [])
        out.append(Attempt(
            traj_id=t["traj_id"], group_id=t["group_id"], task_id=t["task_id"], task_text=task_text[t["task_id"]],
            actions=[x["action_text"] for x in ts],
            observations=[_plain(x["observation"]) for x in ts[1:]],
            valid=[bool(x["valid"]) for x in ts], feedback=[x["feedback"] or "ok" for x in ts],
            hindsight=list(hindsight), success=bool(t["success"]), status=t["status"], n_turns=len(ts),
            max_turns=cfg.env.max_turns, error=t["error"]))
    return out


def _pick(attempts: list[Attempt], want_success: bool, n: int) -> list[Attempt]:
    """Up to n attempts of the wanted outcome, one per distinct action sequence."""
    seen, out = set(), []
    for a in attempts:
        if a.success != want_success or (not want_success and a.status not in ("failure", "error")):
            continue
        key = tuple(a.actions)
        if key in seen:
            continue
        seen.add(key)
        out.append(a)
        if len(out) == n:
            break
    return out


def srd_rows(cfg: Config, round: int, inputs: dict, trajs: list[dict], champion: str, champion_path: str) -> dict:
    """Notes, foresight pairs and examples of this round. `trajs` come from trajectories_with_turns
    (messages + train_from), `inputs` from load_inputs. Returns {"notes", "foresight", "examples":
    rows, "metrics": dict}."""
    scfg = cfg.distill.srd
    specs = {r["task_id"]: TaskSpec.from_row(r) for r in inputs["tasks"]}
    task_text, instructions = _task_texts(cfg, specs)
    attempts = _attempts(cfg, inputs["turns"], trajs, task_text)
    by_group: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_group[a.group_id].append(a)

    # 1. which trajectories get notes
    wanted: list[tuple[Attempt, str]] = []
    for gid in sorted(by_group):
        if scfg.pitfall:
            wanted += [(a, "pitfall") for a in _pick(by_group[gid], False, scfg.notes_per_group)]
        if scfg.knowledge:
            wanted += [(a, "knowledge") for a in _pick(by_group[gid], True, scfg.notes_per_group)]
    notes: list[Note] = []
    for a, channel in wanted:
        prompt = pitfall_note_messages(a) if channel == "pitfall" else knowledge_note_messages(a)
        notes.append(Note(note_id=f"{a.traj_id}/note-{channel}", traj_id=a.traj_id, group_id=a.group_id,
                          task_id=a.task_id, channel=channel, writer=scfg.note_writer,
                          failure_kind=failure_kind(a) if channel == "pitfall" else None, prompt=prompt))

    # 2. write them
    t_notes = time.perf_counter()
    backend = None
    raw_texts: list[str] = []
    if notes and scfg.note_writer == "policy":
        backend = backend_for(cfg, champion_path)
        params = SamplingParams(max_new_tokens=scfg.note_max_tokens, temperature=scfg.note_temperature,
                                top_p=cfg.backend.top_p if scfg.note_temperature > 0 else 1.0,
                                seed=round_seed(cfg, round, 11))
        gens = backend.generate([n.prompt for n in notes], params)
        raw_texts = [g.text for g in gens]
        for n, g in zip(notes, gens):
            n.n_tokens = len(g.token_ids)
    elif notes:
        log.info("SRD notes by the 'template' writer (from the env's hindsight facts), not by the policy")
        by_id = {a.traj_id: a for a in attempts}
        raw_texts = [template_note(by_id[n.traj_id], n.channel) for n in notes]
    for n, raw in zip(notes, raw_texts):
        n.text, n.usable = clean_note(raw, n.channel)

    notes_s = time.perf_counter() - t_notes

    # 3. foresight pairs: one student sample (or more) per group and channel with a usable note
    t_foresight = time.perf_counter()
    notes_by_group: dict[str, list[Note]] = defaultdict(list)
    for n in notes:
        notes_by_group[n.group_id].append(n)
    pairs: list[ForesightPair] = []
    for gid in sorted(notes_by_group):
        gnotes = notes_by_group[gid]
        for channel in ("pitfall", "knowledge"):
            if not any(n.usable and n.channel == channel for n in gnotes):
                continue
            task_id = gnotes[0].task_id
            for k in range(scfg.foresight_samples):
                pairs.append(foresight_pair(f"{gid}/foresight-{channel}-{k}", gid, task_id, instructions,
                                            task_text[task_id], gnotes, channel))
    if pairs:
        backend = backend or backend_for(cfg, champion_path)
        params = SamplingParams(max_new_tokens=scfg.foresight_max_tokens, temperature=scfg.foresight_temperature,
                                top_p=cfg.backend.top_p if scfg.foresight_temperature > 0 else 1.0,
                                seed=round_seed(cfg, round, 12))
        gens = backend.generate([p.student for p in pairs], params)
        kept = []
        for p, g in zip(pairs, gens):
            if not g.text.strip():
                continue  # an empty foresight carries nothing to distill
            p.student = p.student + [{"role": "assistant", "content": g.text}]
            p.teacher = p.teacher + [{"role": "assistant", "content": g.text}]
            p.completion_ids, p.sampling_logprobs = list(g.token_ids), list(g.logprobs)
            kept.append(p)
        empty_foresight = len(pairs) - len(kept)
        pairs = kept
    else:
        empty_foresight = 0
    foresight_s = time.perf_counter() - t_foresight

    # 4. (ours) the action channel: the group's failed episodes, scored with the notes in the teacher's task message
    action_pairs: list[ForesightPair] = []
    if scfg.action_channel:
        traj_by_id = {t["traj_id"]: t for t in trajs}
        for gid in sorted(notes_by_group):
            if not any(n.usable and n.channel == "pitfall" for n in notes_by_group[gid]):
                continue
            for a in _pick(by_group[gid], False, scfg.action_trajectories):
                if a.actions:
                    action_pairs.append(action_pair(f"{a.traj_id}/foresight-action", traj_by_id[a.traj_id],
                                                    notes_by_group[gid]))

    note_rows = [{"note_id": n.note_id, "traj_id": n.traj_id, "group_id": n.group_id, "task_id": n.task_id,
                  "channel": n.channel, "writer": n.writer, "model_id": champion if n.writer == "policy" else None,
                  "failure_kind": n.failure_kind, "prompt": n.prompt, "text": n.text, "raw_text": raw,
                  "n_tokens": n.n_tokens if n.writer == "policy" else None,  # the template writer samples no tokens
                  "usable": n.usable} for n, raw in zip(notes, raw_texts)]
    fs_rows, ex_rows = [], []
    for p in pairs + action_pairs:
        fs_rows.append({"foresight_id": p.pair_id, "group_id": p.group_id, "task_id": p.task_id, "channel": p.channel,
                        "source_traj_id": p.source_traj_id, "note_ids": p.note_ids, "student_messages": p.student,
                        "teacher_messages": p.teacher, "train_from": p.train_from, "completion_ids": p.completion_ids,
                        "sampling_logprobs": p.sampling_logprobs, "model_id": champion,
                        "n_tokens": len(p.completion_ids) or None})
        source = p.source_traj_id or next(n.traj_id for n in notes if n.note_id == p.note_ids[0])
        ex_rows.append({"example_id": f"{p.pair_id}/srd", "method": "srd", "source_traj_id": source,
                        "messages": p.student, "weight": 1.0,
                        "meta": {"foresight_id": p.pair_id, "channel": p.channel, "train_from": p.train_from}})
    counts = group_counts(group_stats([{"group_id": a.group_id, "reward": 1.0 if a.success else 0.0,
                                        "success": a.success} for a in attempts]))
    usable = [n for n in notes if n.usable]
    metrics = {
        **{f"groups_{k}" if k != "groups" else k: v for k, v in counts.items()},
        "writer": scfg.note_writer,
        "notes": len(notes), "usable_notes": len(usable),
        "note_tokens_mean": mean(n.n_tokens for n in notes) if notes and scfg.note_writer == "policy" else None,
        "groups_with_signal": len({p.group_id for p in pairs + action_pairs}),
        "foresight": len(pairs), "empty_foresight": empty_foresight,
        "foresight_tokens_mean": mean(len(p.completion_ids) for p in pairs) if pairs else None,
        "action_pairs": len(action_pairs),
        "notes_s": float(f"{notes_s:.2f}"), "foresight_s": float(f"{foresight_s:.2f}"),
    }
    return {"notes": note_rows, "foresight": fs_rows, "examples": ex_rows, "metrics": metrics}
