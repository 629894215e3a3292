"""RSIPO in a round: skills from the round's rollouts, replayed, trusted by empirical Bayes, kept in a library.

Thin over methods/rsipo/algorithm.py. In the distill step, per task of the round (the generate step's groups):
1. a skill from the group's best rollout, written by the champion (or by the named `template` writer), checked for
   leaked ids (`rsipo_skills`);
2. the tests: the new skill, and `library_candidates` skills of the task's type from the library (lexical match);
   each is replayed M times on the same task and seed with the skill in the task message, through the same backend
   and episode runner as generate (trajectories of purpose 'replay', step 'distill');
3. gains, noise, the per-type empirical-Bayes fit and trust weights (`rsipo_tests`);
4. training terms: the task's best trusted skill (weight > 0) in the teacher's task message, scored on the
   group's own rollouts by the privileged-teacher trainer SRD uses ("distill" rows, weighted by w, the term divided
   by the row count); and, for policy-written skills, skill evolution: the skill-writing tokens as "pg" rows of
   GRPO's loss with the type-centred gain as advantage;
5. the library after this round (`rsipo_library`): every skill with its tests; retired once its shrunk gain stays
   <= 0 for `retire_after` tests.
Replays cost M rollouts per test: M/G of the round's generation per skill tested.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from functools import partial
from statistics import mean

from rsiflow.configs.schema import ConfigError
from rsiflow.envs.base import TaskSpec
from rsiflow.envs.rollout import Episode, env_factory, episode_rows, round_seed
from rsiflow.methods.base import (
    POLICY_LOSS,
    Contribution,
    DistillContext,
    Key,
    Method,
    distill_row,
    num,
    teacher_loss,
    term_loss,
)
from rsiflow.methods.rsipo import queries
from rsiflow.methods.rsipo.algorithm import (
    LibrarySkill,
    check_skill,
    clean_skill,
    concrete_ids,
    gain,
    library_entry,
    noise_variance,
    replay_observation,
    retrieve,
    skill_block,
    skill_messages,
    teacher_messages,
    template_skill,
    trust,
)
from rsiflow.methods.rsipo.options import RsipoOptions
from rsiflow.models.backend import SamplingParams, backend_for

log = logging.getLogger(__name__)


class SkillPromptEnv:
    """The configured env with a skill in the task message: `reset(task)` returns the env's first observation with
    the skill block of that task id after it (`methods.rsipo.replay_observation`); everything else is the env's."""

    def __init__(self, inner, blocks: dict[str, str]):
        self._inner, self._blocks = inner, blocks

    @classmethod
    def build(cls, make_env, blocks: dict[str, str]) -> SkillPromptEnv:
        return cls(make_env(), blocks)

    def reset(self, task: TaskSpec) -> str:
        return replay_observation(self._inner.reset(task), self._blocks[task.task_id])

    def __getattr__(self, name):
        return getattr(self._inner, name)


def play_with_skills(ctx, backend, episodes: list[Episode], blocks: dict[str, str], temperature: float, seed: int,
                     desc: str) -> list[Episode]:
    """Play episodes as generate does (the step's `ctx.play`: the same runner, env settings and sampling), each
    task's skill block in its task message."""
    return ctx.play(ctx.cfg, backend, episodes, temperature, seed, desc,
                    make_env=partial(SkillPromptEnv.build, env_factory(ctx.cfg), blocks))


def _best(members: list[dict]) -> dict:
    """The group's best rollout: the highest reward, then a success, then the first sample."""
    return max(members, key=lambda t: (float(t["reward"] or 0.0), bool(t["success"]), -t["sample_idx"]))


class RSIPO(Method):
    """RSIPO (docs/methods.md, RSIPO): skill-policy co-evolution on top of GRPO."""

    name = "rsipo"
    Options = RsipoOptions
    tables = ("rsipo_skills", "rsipo_tests", "rsipo_library", "trajectories", "turns", "foresight")
    uses_temp_logprobs = True  # the skill-evolution rows' mismatch correction (GRPO's trainer)

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.generate.group_size < 2:
            raise ConfigError(f"generate.group_size: rsipo needs at least 2 student rollouts per task for the gain's "
                              f"noise variance (now {cfg.generate.group_size})")

    def requires(self) -> set[Key]:
        return {POLICY_LOSS}   # its terms ride on the policy-gradient loss (GRPO's trainer)

    def read(self, store, ctx: DistillContext) -> dict:
        return {"tasks": store.step_tasks(ctx.run_id, ctx.round, "generate"),
                "library": queries.library(store, ctx.run_id, ctx.round)}

    # ---- distill --------------------------------------------------------------------------------------

    def distill(self, ctx: DistillContext, inputs: dict) -> Contribution:
        c, round_no = ctx.cfg.distill.rsipo, ctx.round
        specs = {r["task_id"]: TaskSpec.from_row(r) for r in inputs["tasks"]}
        order = sorted(specs)
        played = [t for t in ctx.trajectories if t["status"] != "error" and t["n_turns"]]
        groups: dict[str, list[dict]] = defaultdict(list)
        for t in sorted(played, key=lambda t: t["sample_idx"]):
            groups[t["task_id"]].append(t)

        # 1. skills
        t0 = time.perf_counter()
        facts = self._facts(specs, groups)
        skills = self._write_skills(ctx, order, specs, groups, facts)
        write_s = time.perf_counter() - t0

        # 2. tests: the new skill and library candidates per task
        library = [LibrarySkill(skill_id=r["skill_id"], task_type=r["task_type"], text=r["text"],
                                author_model_id=r["author_model_id"], writer=r["writer"],
                                written_round=r["written_round"], tests=list(r["tests"] or []), status=r["status"],
                                retired_round=r["retired_round"]) for r in inputs["library"]]
        tests: list[dict] = []
        for ti, task_id in enumerate(order):
            if task_id not in groups:
                continue
            spec = specs[task_id]
            new = skills.get(task_id)
            if new and new["usable"]:
                tests.append(self._test(ctx, ti, 0, new["skill_id"], round_no, "new", None, new["text"], spec, groups))
            for slot, (s, score) in enumerate(retrieve(library, spec.task_type, facts[task_id]["text"],
                                                       c.library_candidates), 1):
                tests.append(self._test(ctx, ti, slot, s.skill_id, s.written_round, "library", score, s.text, spec,
                                        groups))

        # 3. replays, one lockstep batch per slot (a task's new skill, its first library candidate, ...)
        t0 = time.perf_counter()
        replay_trajs, replay_turns = self._replay(ctx, tests, specs)
        replay_s = time.perf_counter() - t0

        # 4. gains, noise, empirical-Bayes trust
        for t in tests:
            if len(t["student_rewards"]) >= 2 and len(t["replay_rewards"]) >= 2:
                t["gain"] = gain(t["student_rewards"], t["replay_rewards"])
                t["noise_var"] = noise_variance(t["student_rewards"], t["replay_rewards"])
        valid = [t for t in tests if t.get("gain") is not None]
        fit = trust([(t["test_id"], t["task_type"], t["gain"], t["noise_var"]) for t in valid], c.trust_scale)
        for t in valid:
            f = fit[t["test_id"]]
            t.update(type_mean_gain=f.type_mean, tau2=f.tau2, shrink=f.shrink, shrunk_gain=f.shrunk,
                     centred_gain=f.centred, weight=f.weight)

        # 5. training terms
        pairs, examples = self._distill_pairs(ctx, valid, groups)
        evolution = self._evolution(ctx, valid, skills)

        # 6. the library after this round
        by_id = {s.skill_id: s for s in library}
        for s in skills.values():
            if s["usable"] and any(t["skill_id"] == s["skill_id"] for t in valid):
                by_id[s["skill_id"]] = LibrarySkill(skill_id=s["skill_id"], task_type=s["task_type"], text=s["text"],
                                                    author_model_id=s["model_id"], writer=s["writer"],
                                                    written_round=round_no)
        for t in valid:
            by_id[t["skill_id"]].tests.append({"round": round_no, "test_id": t["test_id"], "task_id": t["task_id"],
                                               "gain": t["gain"], "noise": t["noise_var"],
                                               "shrunk": t["shrunk_gain"], "weight": t["weight"]})
        was_active = {s.skill_id for s in library if s.status == "active"}
        entries = [library_entry(by_id[k], round_no, c.retire_after) for k in sorted(by_id)]

        metrics = self._metrics(skills, tests, valid, replay_trajs, examples, evolution, entries, was_active,
                                write_s, replay_s)
        log.info("round %d RSIPO: %d skills (%d usable, writer %s), %d tests, %d replays, mean gain %s, library %d "
                 "active", round_no, metrics["skills"], metrics["usable"], c.skill_writer, metrics["tests"],
                 metrics["replays"], num(metrics["mean_gain"], ".3f"), metrics["library_size"])
        return Contribution(
            examples=examples + evolution,
            tables={"rsipo_skills": list(skills.values()),
                    "rsipo_tests": [{k: v for k, v in t.items() if not k.startswith("_")} for t in tests],
                    "rsipo_library": entries,
                    "trajectories": replay_trajs, "turns": replay_turns, "foresight": pairs},
            metrics=metrics)

    def _facts(self, specs: dict[str, TaskSpec], groups: dict[str, list[dict]]) -> dict[str, dict]:
        """Per task: its first observation, the canonical symbols of the expert's solution (None without one) and
        of each of its rollouts (by traj_id)."""
        env = env_factory(self.cfg)()
        try:
            out = {}
            for task_id, spec in specs.items():
                text = env.reset(spec)
                solution = env.solution()
                out[task_id] = {
                    "text": text,
                    "expert": [env.canonicalize(a) for a in solution] if solution else None,
                    "symbols": {t["traj_id"]: [env.canonicalize(u["action_text"]) for u in t["turns"]]
                                for t in groups.get(task_id, [])}}
            return out
        finally:
            env.close()

    def _write_skills(self, ctx: DistillContext, order: list[str], specs: dict[str, TaskSpec],
                      groups: dict[str, list[dict]], facts: dict[str, dict]) -> dict[str, dict]:
        """One skill per task with rollouts, by task_id: rows of rsipo_skills."""
        c = self.cfg.distill.rsipo
        rows = {}
        for ti, task_id in enumerate(order):
            if task_id not in groups:
                continue
            best = _best(groups[task_id])
            actions = [u["action_text"] for u in best["turns"]]
            spec = specs[task_id]
            rows[task_id] = {"skill_id": f"{ctx.run_id}/r{ctx.round}/rsipo/{ti:04d}", "task_id": task_id,
                             "task_type": spec.task_type, "group_id": best["group_id"],
                             "source_traj_id": best["traj_id"], "writer": c.skill_writer, "model_id": None,
                             "template_source": None, "token_ids": None, "temp_logprobs": None, "n_tokens": None,
                             "prompt": skill_messages(spec.task_type, facts[task_id]["text"], actions,
                                                      bool(best["success"])),
                             "_ids": concrete_ids([facts[task_id]["text"], *actions])}
        if c.skill_writer == "policy" and rows:
            temperature = self.cfg.backend.temperature
            params = SamplingParams(max_new_tokens=c.skill_max_tokens, temperature=temperature,
                                    top_p=self.cfg.backend.top_p if temperature > 0 else 1.0,
                                    seed=round_seed(self.cfg, ctx.round, 21))
            gens = ctx.backend().generate([r["prompt"] for r in rows.values()], params)
            for r, g in zip(rows.values(), gens):
                r.update(model_id=ctx.champion, raw_text=g.text, token_ids=list(g.token_ids),
                         temp_logprobs=list(g.temp_logprobs), n_tokens=len(g.token_ids))
        elif rows:
            log.info("RSIPO skills by the 'template' writer (canonical actions of a successful rollout, else of the "
                     "env's expert solution), not by the policy")
            for task_id, r in rows.items():
                won = [t for t in groups[task_id] if t["success"]]
                if won or not facts[task_id]["expert"]:
                    source, symbols = "rollout", facts[task_id]["symbols"][(won[0] if won else _best(
                        groups[task_id]))["traj_id"]]
                else:
                    source, symbols = "expert", facts[task_id]["expert"]
                r.update(template_source=source, raw_text=template_skill(r["task_type"], symbols, source))
        for r in rows.values():
            r["text"] = clean_skill(r["raw_text"], c.skill_max_chars)
            r["usable"], r["reject_reason"], r["leaked_ids"] = check_skill(r["text"], r.pop("_ids"))
        return rows

    def _test(self, ctx, ti: int, slot: int, skill_id: str, skill_round: int, origin: str, score: float | None,
              text: str, spec: TaskSpec, groups: dict[str, list[dict]]) -> dict:
        students = groups[spec.task_id]
        return {"test_id": f"{ctx.run_id}/r{ctx.round}/rsipo-test/{ti:04d}-{slot}", "skill_id": skill_id,
                "skill_round": skill_round, "origin": origin, "retrieval_score": score, "task_id": spec.task_id,
                "task_type": spec.task_type, "task_seed": spec.seed, "group_id": students[0]["group_id"],
                "student_traj_ids": [t["traj_id"] for t in students],
                "student_rewards": [float(t["reward"] or 0.0) for t in students],
                "replay_traj_ids": [], "replay_rewards": [], "selected": False, "_slot": slot, "_ti": ti,
                "_block": skill_block(text)}

    def _replay(self, ctx: DistillContext, tests: list[dict], specs: dict[str, TaskSpec]):
        """M rollouts per test with its skill in the task message, on the same task (same seed) as the students."""
        cfg, m = self.cfg, self.cfg.distill.rsipo.replays
        trajs, turns = [], []
        for slot in sorted({t["_slot"] for t in tests}):
            batch = [t for t in tests if t["_slot"] == slot]
            blocks = {t["task_id"]: t["_block"] for t in batch}
            episodes = [Episode(traj_id=f"{ctx.run_id}/r{ctx.round}/replay/{t['_ti']:04d}-{slot}-{k:02d}",
                                task=specs[t["task_id"]], group_id=t["test_id"], sample_idx=k)
                        for t in batch for k in range(m)]
            play_with_skills(ctx, ctx.backend(), episodes, blocks, cfg.backend.temperature,
                             round_seed(cfg, ctx.round, 22 + slot), f"round {ctx.round} rsipo replay {slot}")
            by_test = defaultdict(list)
            for ep in episodes:
                by_test[ep.group_id].append(ep)
            for t in batch:
                t["replay_traj_ids"] = [ep.traj_id for ep in by_test[t["test_id"]]]
                t["replay_rewards"] = [float(ep.reward) for ep in by_test[t["test_id"]] if ep.status != "error"]
            rows, turn_rows = episode_rows(episodes, ctx.champion, "replay")
            trajs += rows
            turns += turn_rows
        return trajs, turns

    def _distill_pairs(self, ctx: DistillContext, valid: list[dict],
                       groups: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
        """Per task, its selected skill (the test with the highest shrunk gain among those with w > 0) in the
        teacher's task message, scored on the group's rollouts; rows of `foresight` (channel 'rsipo') and examples
        weighted by w."""
        c = self.cfg.distill.rsipo
        by_task: dict[str, list[dict]] = defaultdict(list)
        for t in valid:
            by_task[t["task_id"]].append(t)
        pairs, examples = [], []
        for task_id in sorted(by_task):
            trusted = [t for t in by_task[task_id] if t["weight"] > 0]
            if not trusted:
                continue
            chosen = max(trusted, key=lambda t: (t["shrunk_gain"], -t["_slot"]))
            chosen["selected"] = True
            students = sorted(groups[task_id], key=lambda t: t["traj_id"])[: c.distill_trajectories]
            for s in students:
                start = int(s["train_from"])
                student = [dict(msg) for msg in s["messages"]]
                pair_id = f"{s['traj_id']}/rsipo"
                pairs.append({"foresight_id": pair_id, "group_id": s["group_id"], "task_id": task_id,
                              "channel": "rsipo", "source_traj_id": s["traj_id"], "student_messages": student,
                              "teacher_messages": teacher_messages(student, start, chosen["_block"]),
                              "train_from": start, "model_id": ctx.champion})
                examples.append({"example_id": f"{pair_id}/distill", "method": self.name,
                                 "source_traj_id": s["traj_id"], "messages": student, "weight": chosen["weight"],
                                 "meta": {"kind": "distill", "foresight_id": pair_id, "test_id": chosen["test_id"],
                                          "skill_id": chosen["skill_id"], "train_from": start,
                                          **({"tools": ctx.tools} if ctx.tools else {})}})
        return pairs, examples

    def _evolution(self, ctx: DistillContext, valid: list[dict], skills: dict[str, dict]) -> list[dict]:
        """Skill evolution: each policy-written skill that was tested, its writing tokens as a policy-gradient row
        with the type-centred gain as advantage."""
        c = self.cfg.distill.rsipo
        if not c.evolution or c.skill_writer != "policy":
            return []
        rows = []
        for t in valid:
            if t["origin"] != "new":
                continue
            s = skills[t["task_id"]]
            rows.append({"example_id": f"{s['skill_id']}/evolution", "method": self.name,
                         "source_traj_id": s["source_traj_id"],
                         "messages": [*s["prompt"], {"role": "assistant", "content": s["raw_text"]}], "weight": 1.0,
                         "meta": {"kind": "evolution", "skill_id": s["skill_id"], "test_id": t["test_id"],
                                  "advantage": t["centred_gain"], "train_from": len(s["prompt"])}})
        return rows

    def _metrics(self, skills, tests, valid, replay_trajs, examples, evolution, entries, was_active, write_s,
                 replay_s) -> dict:
        active = [e for e in entries if e["status"] == "active"]
        top = []
        for task_type in sorted({e["task_type"] for e in active}):
            ranked = sorted((e for e in active if e["task_type"] == task_type),
                            key=lambda e: (-(e["last_shrunk_gain"] or 0.0), e["skill_id"]))[:3]
            top += [{k: e[k] for k in ("task_type", "skill_id", "n_tests", "mean_gain", "gain_ci_low", "gain_ci_high",
                                       "last_shrunk_gain", "last_weight")} | {"text": e["text"][:200]}
                    for e in ranked]
        return {
            "writer": self.cfg.distill.rsipo.skill_writer,
            "skills": len(skills), "usable": sum(s["usable"] for s in skills.values()),
            "leaked": sum(bool(s["leaked_ids"]) for s in skills.values()),
            "skill_tokens": (mean(s["n_tokens"] for s in skills.values())
                             if skills and self.cfg.distill.rsipo.skill_writer == "policy" else None),
            "tests": len(tests), "tests_library": sum(t["origin"] == "library" for t in tests),
            "tests_without_gain": len(tests) - len(valid),
            "replays": len(replay_trajs), "replay_successes": sum(bool(t["success"]) for t in replay_trajs),
            "mean_gain": mean(t["gain"] for t in valid) if valid else None,
            "mean_shrunk_gain": mean(t["shrunk_gain"] for t in valid) if valid else None,
            "trusted_tests": sum(t["weight"] > 0 for t in valid),
            "mean_weight": mean(t["weight"] for t in valid) if valid else None,
            "distill_rows": len(examples), "distill_tasks": len({e["meta"]["test_id"] for e in examples}),
            "evolution_rows": len(evolution),
            "evolution_nonzero": sum(e["meta"]["advantage"] != 0.0 for e in evolution),
            "library_size": len(active), "library_retired": len(entries) - len(active),
            "library_new": sum(e["skill_id"] in {r["skill_id"] for r in skills.values()} for e in entries),
            "library_retired_now": sum(e["skill_id"] in was_active and e["status"] == "retired" for e in entries),
            "library_mean_shrunk_gain": mean(e["last_shrunk_gain"] for e in active) if active else None,
            "library_top": top,
            "write_s": round(write_s, 2), "replay_s": round(replay_s, 2),
        }

    # ---- inference with a skill (the gate step) ------------------------------------------------------

    def assess_read(self, store, ctx):
        """RSIPO's library as it stands after this round's distill (the skills `assess` may put in a prompt)."""
        return queries.library(store, ctx.run_id, ctx.round + 1) if self.cfg.distill.rsipo.assess_tasks else []

    def assess(self, ctx, inputs=None):
        """With distill.rsipo.assess_tasks > 0: the trained candidate plays the gate's first held-out tasks whose type
        has an active library skill with a positive shrunk gain, bare and with the best such skill (highest last
        shrunk gain) in the task message, greedy at gate.seed; the with-skill episodes are stored (purpose
        'replay', step 'gate'); both successes and which way did better are the figures."""
        n = self.cfg.distill.rsipo.assess_tasks
        if n == 0:
            return None
        cfg = self.cfg
        library = inputs or []
        best: dict[str, dict] = {}
        for e in library:
            if e["status"] == "active" and (e["last_shrunk_gain"] or 0.0) > 0:
                if e["task_type"] not in best or e["last_shrunk_gain"] > best[e["task_type"]]["last_shrunk_gain"]:
                    best[e["task_type"]] = e
        tasks = [t for t in ctx.heldout[:n] if t.task_type in best]
        figures = {"assess_tasks": len(tasks), "assess_bare": None, "assess_with_skill": None, "assess_better": None,
                   "assess_skills": sorted({best[t.task_type]["skill_id"] for t in tasks})}
        if not tasks:
            return Contribution(metrics=figures)
        backend = backend_for(cfg, ctx.candidate_path)
        blocks = {t.task_id: skill_block(best[t.task_type]["text"]) for t in tasks}
        tag = f"{ctx.run_id}/r{ctx.round}/gate/rsipo"
        bare = [Episode(traj_id=f"{tag}-bare/{i:04d}", task=t, group_id=f"{tag}-bare/{t.task_id}", sample_idx=0)
                for i, t in enumerate(tasks)]
        skilled = [Episode(traj_id=f"{tag}-skill/{i:04d}", task=t, group_id=f"{tag}-skill/{t.task_id}", sample_idx=0)
                   for i, t in enumerate(tasks)]
        ctx.play(cfg, backend, bare, cfg.gate.temperature, cfg.gate.seed, f"round {ctx.round} rsipo assess, bare")
        play_with_skills(ctx, backend, skilled, blocks, cfg.gate.temperature, cfg.gate.seed,
                         f"round {ctx.round} rsipo assess, with skills")
        k0, k1 = sum(e.success for e in bare), sum(e.success for e in skilled)
        figures.update(assess_bare=k0, assess_with_skill=k1,
                       assess_better="skill" if k1 > k0 else "bare" if k0 > k1 else "tie")
        log.info("round %d RSIPO assess: candidate %s on %d held-out tasks: %d bare, %d with the library's best skill",
                 ctx.round, ctx.candidate, len(tasks), k0, k1)
        trajs, turns = episode_rows(skilled, ctx.candidate, "replay")
        return Contribution(tables={"trajectories": trajs, "turns": turns}, metrics=figures)

    # ---- training and reports -----------------------------------------------------------------------

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """Distillation examples become "distill" rows (the pair's student and teacher conversations, weight w);
        skill-evolution examples become "pg" rows (the skill-writing conversation, the centred gain as advantage,
        the sampled tokens with their logprobs after temperature only)."""
        pairs = store.foresight_pairs(run_id, round_no) if any(e["meta"]["kind"] == "distill" for e in examples) else {}
        evolution = any(e["meta"]["kind"] == "evolution" for e in examples)
        skills = queries.skills(store, run_id, round_no) if evolution else {}
        rows = []
        for e in examples:
            if e["meta"]["kind"] == "distill":
                rows.append(distill_row(e, pairs[e["meta"]["foresight_id"]]))
            else:
                s = skills[e["meta"]["skill_id"]]
                rows.append({"kind": "pg", "example_id": e["example_id"], "weight": e["weight"],
                             "messages": e["messages"], "train_from": e["meta"]["train_from"], "tools": None,
                             "advantage": e["meta"]["advantage"],
                             "sampled": [{"token_ids": s["token_ids"] or [],
                                          "temp_logprobs": s["temp_logprobs"] or []}]})
        return rows

    def distill_loss(self):
        return teacher_loss(self.cfg, self.cfg.distill.rsipo.loss_weight, normalise="rows")

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        if distill_metrics is None:
            return None
        return {**distill_metrics, "distill_loss": term_loss(train_metrics, cls.name)}

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        rows = [r for r in rounds if r.get("rsipo")]
        if not rows:
            return []
        lines = ["RSIPO per round (skills written / usable / leaking ids, by which writer; tests: replay checks, of "
                 "them of library skills; replays (successes); mean gain g and shrunk gain g̃ over the tests; trusted: "
                 "tests with w > 0; distillation rows and their mean loss D; evolution rows (non-zero advantage); "
                 "library: active skills (retired this round), their mean last shrunk gain):", "",
                 "| round | skills (usable, leaked) | writer | tests (library) | replays (succ.) | mean g | mean g̃ | "
                 "trusted | distill rows (D) | evolution | library (retired) | library g̃ |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            m = r["rsipo"]
            lines.append(f"| {r['round']} | {m['skills']} ({m['usable']}, {m['leaked']}) | {m['writer']} | "
                         f"{m['tests']} ({m['tests_library']}) | {m['replays']} ({m['replay_successes']}) | "
                         f"{num(m['mean_gain'], '+.3f')} | {num(m['mean_shrunk_gain'], '+.3f')} | "
                         f"{m['trusted_tests']} | "
                         f"{m['distill_rows']} ({num(m.get('distill_loss'), '.4f')}) | {m['evolution_rows']} "
                         f"({m['evolution_nonzero']}) | {m['library_size']} ({m['library_retired_now']}) | "
                         f"{num(m['library_mean_shrunk_gain'], '+.3f')} |")
        assessed = [r for r in rows if r["rsipo"].get("assess_tasks")]
        if assessed:
            lines += ["", "Inference with a skill (gate step, the candidate on held-out tasks whose type has a trusted "
                      "library skill, greedy; the promotion decision stays on the bare prompt):", ""]
            lines += [f"- round {r['round']}: {r['rsipo']['assess_bare']}/{r['rsipo']['assess_tasks']} bare, "
                      f"{r['rsipo']['assess_with_skill']}/{r['rsipo']['assess_tasks']} with the best library skill "
                      f"({r['rsipo']['assess_better']})" for r in assessed]
        last = rows[-1]
        lines += ["", f"Skill library after round {last['round']}: the top active skills per task type (tests; mean "
                  "replay gain with its 95% interval; last shrunk gain and trust weight):", "",
                  "| task type | skill | tests | mean gain [95% CI] | last g̃ | w | text |",
                  "|---|---|---|---|---|---|---|"]
        for e in last["rsipo"]["library_top"]:
            text = " / ".join(e["text"].splitlines())[:100].replace("|", "\\|")
            lines.append(f"| {e['task_type']} | {e['skill_id']} | {e['n_tests']} | {num(e['mean_gain'], '+.3f')} "
                         f"[{num(e['gain_ci_low'], '+.3f')}, {num(e['gain_ci_high'], '+.3f')}] | "
                         f"{num(e['last_shrunk_gain'], '+.3f')} | {num(e['last_weight'], '.2f')} | {text} |")
        if not last["rsipo"]["library_top"]:
            lines.append("| - | (no active skill) | | | | | |")
        return lines
