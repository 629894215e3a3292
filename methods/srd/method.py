"""SRD in a round: hindsight notes from the round's rollouts, foresight pairs, and their distillation.

Thin over methods/srd/algorithm.py: it reads the round's tasks and turns, asks the champion (through the
generation backend) to write the notes (or assembles them with the `template` writer), lets the
student sample its foresight, and contributes rows of the `notes`, `foresight` and `examples`
tables plus the round's SRD figures. At training time each SRD example becomes a "distill" row
(the pair's student and teacher conversations) for the trainer's privileged-teacher term.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from statistics import mean

from rsiflow.configs.schema import Config
from rsiflow.envs.base import TaskSpec
from rsiflow.envs.rollout import env_factory, env_observation, round_seed
from rsiflow.methods.base import Contribution, DistillContext, Method, distill_row, num, teacher_loss, term_loss
from rsiflow.methods.srd.algorithm import (
    Attempt,
    ForesightPair,
    Note,
    action_pair,
    clean_note,
    failure_kind,
    foresight_pair,
    knowledge_note_messages,
    pitfall_note_messages,
    template_note,
)
from rsiflow.methods.srd.options import SrdOptions
from rsiflow.models.backend import SamplingParams
from rsiflow.stats.groups import group_counts, group_stats

log = logging.getLogger(__name__)


def _task_facts(cfg: Config, specs: dict[str, TaskSpec]) -> tuple[dict[str, str], dict[str, dict], str]:
    """Each task's first observation, the env's solution from its start and its rules for such tasks (the
    env resets the task again: cheap and exact), and the env's instructions."""
    env = env_factory(cfg)()
    try:
        texts, facts = {}, {}
        for tid, spec in specs.items():
            texts[tid] = env.reset(spec)
            facts[tid] = {"solution": env.solution(), "rules": env.rules()}
        return texts, facts, env.instructions()
    finally:
        env.close()


def _attempts(cfg: Config, turns: list[dict], trajs: list[dict], task_text: dict[str, str],
              facts: dict[str, dict]) -> list[Attempt]:
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
            observations=[env_observation(x["observation"]) for x in ts[1:]],
            valid=[bool(x["valid"]) for x in ts], feedback=[x["feedback"] or "ok" for x in ts],
            hindsight=list(hindsight), success=bool(t["success"]), status=t["status"], n_turns=len(ts),
            max_turns=cfg.env.max_turns, error=t["error"], **facts[t["task_id"]]))
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


def _srd_rows(ctx: DistillContext, inputs: dict) -> dict:
    """Notes, foresight pairs and examples of this round; returns {"notes", "foresight", "examples": rows,
    "metrics": dict}."""
    cfg, round_no, trajs, champion = ctx.cfg, ctx.round, ctx.trajectories, ctx.champion
    scfg = cfg.distill.srd
    specs = {r["task_id"]: TaskSpec.from_row(r) for r in inputs["tasks"]}
    task_text, facts, instructions = _task_facts(cfg, specs)
    attempts = _attempts(cfg, inputs["turns"], trajs, task_text, facts)
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
        backend = ctx.backend()
        params = SamplingParams(max_new_tokens=scfg.note_max_tokens, temperature=scfg.note_temperature,
                                top_p=cfg.backend.top_p if scfg.note_temperature > 0 else 1.0,
                                seed=round_seed(cfg, round_no, 11))
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
        backend = backend or ctx.backend()
        params = SamplingParams(max_new_tokens=scfg.foresight_max_tokens, temperature=scfg.foresight_temperature,
                                top_p=cfg.backend.top_p if scfg.foresight_temperature > 0 else 1.0,
                                seed=round_seed(cfg, round_no, 12))
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
                        "meta": {"foresight_id": p.pair_id, "channel": p.channel, "train_from": p.train_from,
                                 # the action channel scores the episode's own turns, sampled with the env's tools
                                 **({"tools": ctx.tools} if ctx.tools and p.channel == "action" else {})}})
    counts = group_counts(group_stats([{"group_id": a.group_id, "reward": 1.0 if a.success else 0.0,
                                        "success": a.success} for a in attempts]))
    usable = [n for n in notes if n.usable]
    metrics = {
        **{f"groups_{k}" if k != "groups" else k: v for k, v in counts.items()},
        "writer": scfg.note_writer,
        "notes": len(notes), "usable": len(usable),
        "note_tokens": mean(n.n_tokens for n in notes) if notes and scfg.note_writer == "policy" else None,
        "groups_with_signal": len({p.group_id for p in pairs + action_pairs}),
        "foresight": len(pairs), "empty_foresight": empty_foresight,
        "foresight_tokens": mean(len(p.completion_ids) for p in pairs) if pairs else None,
        "action_pairs": len(action_pairs),
        "notes_s": float(f"{notes_s:.2f}"), "foresight_s": float(f"{foresight_s:.2f}"),
    }
    return {"notes": note_rows, "foresight": fs_rows, "examples": ex_rows, "metrics": metrics}


class SRD(Method):
    """SRD (docs/methods.md, SRD): pitfall notes from failures, distilled into foresight by the privileged teacher."""

    name = "srd"
    Options = SrdOptions
    tables = ("notes", "foresight")

    def read(self, store, ctx: DistillContext) -> dict:
        """The round's tasks and turns, read up front so the store is not held while the model writes."""
        return {"tasks": store.step_tasks(ctx.run_id, ctx.round, "generate"),
                "turns": store.step_turns(ctx.run_id, ctx.round, "generate")}

    def distill(self, ctx: DistillContext, inputs: dict) -> Contribution:
        out = _srd_rows(ctx, inputs)
        log.info("round %d SRD: %s", ctx.round, out["metrics"])
        return Contribution(examples=out["examples"], tables={"notes": out["notes"], "foresight": out["foresight"]},
                            metrics=out["metrics"])

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """Each SRD example is a "distill" row: its pair's student and teacher conversations, the student's
        sampled completion ids and their sampling logprobs."""
        pairs = store.foresight_pairs(run_id, round_no)
        return [distill_row(e, pairs[e["meta"]["foresight_id"]]) for e in examples]

    def distill_loss(self):
        return teacher_loss(self.cfg, self.cfg.distill.srd.loss_weight)

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        if distill_metrics is None:
            return None
        return {**distill_metrics, "distill_loss": term_loss(train_metrics, cls.name),
                "distill_examples": train_metrics.get("distill_examples"),
                "misaligned": train_metrics.get("distill_misaligned")}

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        rows = [r for r in rounds if r.get("srd")]
        if not rows:
            return []

        lines = ["SRD per round (notes: written / usable, by which writer; signal: groups that produced a "
                 "teacher/student pair; D: mean distillation loss over training steps):", "",
                 "| round | notes (usable) | writer | note tokens | groups with signal | foresight (tokens) | "
                 "action pairs | D |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["srd"]
            lines.append(f"| {r['round']} | {m['notes']} ({m['usable']}) | {m['writer']} | "
                         f"{num(m['note_tokens'], '.0f')} | "
                         f"{m['groups_with_signal']} | {m['foresight']} ({num(m['foresight_tokens'], '.0f')}) | "
                         f"{m['action_pairs']} | {num(m['distill_loss'], '.4f')} |")
        return lines
