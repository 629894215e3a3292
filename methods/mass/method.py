"""MASS in a round: workflow search, teacher collection and SFT data in distill; the candidate against the base in
the gate (docs/methods.md, MASS).

Thin over algorithm.py. The champion (through the round's generation backend) plays every sub-agent, proposes
workflow versions (or the structured mutation operator does, `distill.mass.proposer`) and judges pairs of outputs
(or the env's verifier does, `distill.mass.judge: oracle`). MASS fits the Method seam as a distill method that runs
its own multi-agent episodes: the generate step's single-agent rollouts are not used, only the round's tasks.

distill, per round (one task family = the run's env):
1. search: the reference (the bare task prompt, one hop) and versions v0..vN play the round's first
   `search_tasks` tasks greedily; each version is judged against the reference and against the champion of the
   moment (both orders); it replaces the champion only if it beats both. v0 is the previous round's retained
   workflow, else a planner -> solver seed; v1.. are proposed from the history.
2. teacher collection (only if the retained workflow is not the reference, or with `teacher: single_agent`, the
   control, where the bare task plays): K episodes per task, sampled; ring tournament of m opponents each; a
   Bradley-Terry fit per task; the top ranks become SFT examples, the next ones validation examples.
3. SFT examples: the bare task prompt (the env's prefix and the task message) with the episode's final answer.

gate (`assess`): the candidate and the run's base answer the gate's first `assess_tasks` held-out tasks greedily;
the candidate judges each pair in both orders; the env's verifier compares them too where it has one. Stored as
episodes and verdicts of purpose 'assess'; the figures join the round's MASS figures.

Every workflow, episode, verdict and ranking is a row of the mass_* tables (migration 9), keyed by the step.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter, defaultdict
from statistics import mean

from rsiflow.configs.schema import ConfigError
from rsiflow.envs import env_class
from rsiflow.envs.base import TaskSpec
from rsiflow.envs.rollout import ACTION_STOP, env_factory, prompt_setup, render_observation, round_seed
from rsiflow.methods.base import AssessContext, Contribution, DistillContext, Method, num
from rsiflow.methods.mass import queries
from rsiflow.methods.mass.algorithm import (
    SEED_WORKFLOW,
    Episode,
    PairResult,
    SpecError,
    TaskPrompt,
    Workflow,
    agreement,
    bradley_terry,
    judge_pairs,
    mutate,
    oracle_pairs,
    parse_proposal,
    proposal_messages,
    ring_pairs,
    run_workflow,
    select_ranked,
    sft_messages,
    spec_diff,
    win_rate,
)
from rsiflow.methods.mass.options import MassOptions
from rsiflow.models.backend import SamplingParams, backend_for

log = logging.getLogger(__name__)


class _Env:
    """The round's tasks as the model sees them, and the env's verifier of a final answer."""

    def __init__(self, cfg, specs: list[TaskSpec]):
        self.cfg, self.specs = cfg, {s.task_id: s for s in specs}
        self.env = env_factory(cfg)()
        self.verifiable = bool(getattr(self.env, "verifiable", True))
        self.prompts = []
        for s in specs:
            text = self.env.reset(s)
            message = render_observation(text, self.env.admissible_actions(), cfg.env.show_admissible)
            self.prompts.append(TaskPrompt(s.task_id, text, message))

    def verify(self, episodes: list[Episode]) -> None:
        """Fill in each episode's success and reward from the env (one step with its final answer); None where
        the env has no verifier, or the answer does not end the episode (then it is not solved: False)."""
        for ep in episodes:
            if not self.verifiable:
                continue
            self.env.reset(self.specs[ep.task_id])
            res = self.env.step(ep.final)
            ep.success, ep.reward = bool(res.done and res.success), float(res.reward)

    def close(self) -> None:
        self.env.close()


class _Model:
    """The model's calls for MASS through one backend: workflow hops, judge replies, proposals."""

    def __init__(self, cfg, backend, tools, seed: int):
        self.cfg, self.backend, self.tools, self.seed, self.calls = cfg, backend, tools, seed, 0

    def _params(self, max_new_tokens: int, temperature: float, stop=()) -> SamplingParams:
        self.calls += 1
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=self.cfg.backend.top_p if temperature > 0 else 1.0, stop=tuple(stop),
                              seed=self.seed + self.calls)

    def hops(self, temperature: float):
        c = self.cfg.distill.mass

        def generate(convs, final):
            params = self._params(self.cfg.backend.max_new_tokens if final else c.hop_max_tokens, temperature,
                                  ACTION_STOP if final else ())
            gens = self.backend.generate(convs, params, tools=self.tools if final else None)
            return [(g.text, len(g.token_ids)) for g in gens]
        return generate

    def ask(self, convs: list[list[dict]]) -> list[str]:
        gens = self.backend.generate(convs, self._params(self.cfg.distill.mass.judge_max_tokens, 0.0))
        return [g.text for g in gens]

    def propose(self, messages: list[dict]) -> str:
        return self.backend.generate([messages], self._params(self.cfg.distill.mass.proposal_max_tokens, 0.7))[0].text


def _episode_rows(episodes: list[Episode], purpose: str, model_id: str) -> list[dict]:
    return [{"episode_id": e.episode_id, "purpose": purpose, "workflow_id": e.workflow_id, "task_id": e.task_id,
             "model_id": model_id, "hops": e.hops, "final_text": e.final, "gen_tokens": e.gen_tokens,
             "final_tokens": e.final_tokens, "success": e.success, "reward": e.reward} for e in episodes]


def _verdict_rows(results: list[PairResult], purpose: str, judge_model: str | None, prefix: str,
                  verified: dict[str, bool | None]) -> list[dict]:
    return [{"verdict_id": f"{prefix}/{i:04d}", "purpose": purpose, "judge": r.judge,
             "judge_model_id": judge_model if r.judge == "self" else None, "task_id": r.task_id,
             "x_episode_id": r.x, "y_episode_id": r.y, "verdict_xy": r.ab[0], "rationale_xy": r.ab[1],
             "raw_xy": r.ab[2], "verdict_yx": r.ba[0], "rationale_yx": r.ba[1], "raw_yx": r.ba[2], "score": r.score,
             "verifier_x": verified.get(r.x), "verifier_y": verified.get(r.y)} for i, r in enumerate(results)]


class MASS(Method):
    """MASS (docs/methods.md, MASS): workflow search, self-judged teacher collection, SFT on the bare task."""

    name = "mass"
    Options = MassOptions
    tables = ("mass_workflows", "mass_episodes", "mass_verdicts", "mass_rankings")

    def __init__(self, cfg):
        super().__init__(cfg)
        if cfg.distill.mass.judge == "oracle" and not getattr(env_class(cfg.env.name), "verifiable", True):
            raise ConfigError(f"distill.mass.judge: 'oracle' judges by the env's verifier, and env {cfg.env.name!r} "
                              "has none (verifiable = False): use distill.mass.judge=self")

    def read(self, store, ctx: DistillContext) -> dict:
        return {"tasks": store.step_tasks(ctx.run_id, ctx.round, "generate"),
                "previous": queries.retained_workflow(store, ctx.run_id, ctx.round)}

    # ---- judging --------------------------------------------------------------------------------------------

    def _judge(self, model: _Model, pairs: list[tuple], verified: dict[str, bool | None]) -> list[PairResult]:
        if self.cfg.distill.mass.judge == "oracle":
            return oracle_pairs(pairs, verified)
        return judge_pairs(pairs, model.ask)

    @staticmethod
    def _pairs(xs: list[Episode], ys: list[Episode], text: dict[str, str]) -> list[tuple]:
        return [(x.episode_id, y.episode_id, x.task_id, text[x.task_id], x.final, y.final) for x, y in zip(xs, ys)]

    # ---- distill --------------------------------------------------------------------------------------------

    def distill(self, ctx: DistillContext, inputs: dict) -> Contribution:
        specs = [TaskSpec.from_row(r) for r in inputs["tasks"]]
        if not specs:
            raise RuntimeError(f"round {ctx.round}: MASS found no tasks of the generate step")
        env = _Env(self.cfg, specs)
        try:
            return self._distill(ctx, inputs, env)
        finally:
            env.close()

    def _distill(self, ctx: DistillContext, inputs: dict, env: _Env) -> Contribution:
        c, cfg = self.cfg.distill.mass, self.cfg
        base = f"{ctx.run_id}/r{ctx.round}/mass"
        model = _Model(cfg, ctx.backend(), ctx.tools, round_seed(cfg, ctx.round, 31))
        text = {p.task_id: p.text for p in env.prompts}
        verified: dict[str, bool | None] = {}
        workflows, episodes, verdicts, rankings, examples = [], [], [], [], []
        all_results: list[PairResult] = []

        def play(w: Workflow, wid: str, prompts: list[TaskPrompt], temperature: float, ids) -> list[Episode]:
            eps = run_workflow(w, wid, prompts, ctx.prefix, model.hops(temperature), ids)
            env.verify(eps)
            verified.update({e.episode_id: e.success for e in eps})
            return eps

        def judged(xs, ys, purpose: str, tag: str) -> list[PairResult]:
            res = self._judge(model, self._pairs(xs, ys, text), verified)
            verdicts.extend(_verdict_rows(res, purpose, ctx.champion, f"{base}/verdict/{tag}", verified))
            all_results.extend(res)
            return res

        # 1. workflow search
        t0 = time.perf_counter()
        search = env.prompts[:c.search_tasks]
        reference = Workflow.reference()
        ref_id = f"{base}/reference"
        teacher_mode = c.teacher
        champion, champion_id, champion_eps = reference, ref_id, None
        history: list[dict] = []
        wf_rows: dict[str, dict] = {}
        if teacher_mode == "workflow":
            ref_eps = play(reference, ref_id, search, 0.0, lambda i, t: f"{ref_id}/search/{i:04d}")
            episodes += _episode_rows(ref_eps, "search", ctx.champion)
            champion_eps = ref_eps
            wf_rows[ref_id] = {"workflow_id": ref_id, "version": -1, "parent_id": None, "spec": reference.to_dict(),
                               "proposer": "reference", "proposal": None, "diff": [], "model_id": ctx.champion,
                               "win_vs_reference": None, "win_vs_champion": None,
                               "verifier_success": self._success(ref_eps), "accepted": True, "retained": False}
            rng = random.Random(round_seed(cfg, ctx.round, 32))
            tried = {reference.to_json()}
            for k in range(c.versions):
                spec, proposer, proposal = self._next_version(k, inputs["previous"], champion, history, search, model,
                                                              rng)
                for _ in range(8):   # a spec already tried this round is mutated again (recorded in `proposal`)
                    if spec.to_json() not in tried:
                        break
                    spec, what = mutate(spec, rng)
                    proposal = f"{proposal or ''} | repeated spec, then {what['op']}: {what['detail']}".lstrip(" |")
                tried.add(spec.to_json())
                wid = f"{base}/v{k}"
                eps = play(spec, wid, search, 0.0, lambda i, t, wid=wid: f"{wid}/search/{i:04d}")
                episodes += _episode_rows(eps, "search", ctx.champion)
                vs_ref = judged(eps, ref_eps, "search", f"v{k}-reference")
                vs_champ = judged(eps, champion_eps, "search", f"v{k}-champion") if champion_id != ref_id else None
                r_ref = mean(r.score for r in vs_ref)
                r_champ = mean(r.score for r in vs_champ) if vs_champ is not None else None
                accepted = r_ref > 0.5 + c.margin and (r_champ is None or r_champ > 0.5 + c.margin)
                diff = spec_diff(champion, spec)
                wf_rows[wid] = {"workflow_id": wid, "version": k, "parent_id": champion_id, "spec": spec.to_dict(),
                                "proposer": proposer, "proposal": proposal, "diff": diff, "model_id": ctx.champion,
                                "win_vs_reference": r_ref, "win_vs_champion": r_champ,
                                "verifier_success": self._success(eps), "accepted": accepted, "retained": False}
                history.append({"name": f"v{k}", "diff": diff, "vs_reference": r_ref,
                                "vs_champion": r_champ if r_champ is not None else r_ref, "accepted": accepted,
                                "rationales": [r.ab[1] for r in vs_ref if r.ab[1]]})
                log.info("round %d MASS search v%d (%s): %.2f vs reference, %s vs champion -> %s", ctx.round, k,
                         proposer, r_ref, num(r_champ, ".2f"), "champion" if accepted else "discarded")
                if accepted:
                    champion, champion_id, champion_eps = spec, wid, eps
            wf_rows[champion_id]["retained"] = True
            workflows = list(wf_rows.values())
        search_s = time.perf_counter() - t0

        # 2. teacher collection
        t1 = time.perf_counter()
        teacher = reference if teacher_mode == "single_agent" else champion
        teacher_id = champion_id if teacher_mode == "workflow" else f"{base}/single-agent"
        if teacher_mode == "single_agent":
            workflows.append({"workflow_id": teacher_id, "version": -1, "parent_id": None, "spec": reference.to_dict(),
                              "proposer": "reference", "proposal": "single-agent control: no search",
                              "diff": [], "model_id": ctx.champion, "win_vs_reference": None, "win_vs_champion": None,
                              "verifier_success": None, "accepted": None, "retained": True})
        collect = teacher_mode == "single_agent" or champion_id != ref_id
        teacher_eps: list[Episode] = []
        if collect:
            tasks = env.prompts[:c.teacher_tasks] if c.teacher_tasks else env.prompts
            repeated = [t for t in tasks for _ in range(c.episodes_per_task)]
            k_eps = c.episodes_per_task   # ids by task index and sample: <base>/teacher/<task>-<k>
            teacher_eps = play(teacher, teacher_id, repeated, c.temperature,
                               lambda i, t: f"{base}/teacher/{i // k_eps:03d}-{i % k_eps:02d}")
            episodes += _episode_rows(teacher_eps, "teacher", ctx.champion)
            by_task: dict[str, list[Episode]] = defaultdict(list)
            for ep in teacher_eps:
                by_task[ep.task_id].append(ep)
            ring = ring_pairs(c.episodes_per_task, c.opponents)
            xs = [eps[i] for eps in by_task.values() for i, _ in ring]
            ys = [eps[j] for eps in by_task.values() for _, j in ring]
            results = judged(xs, ys, "teacher", "teacher")
            games: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
            for r in results:
                games[r.task_id].append((r.x, r.y, r.score))
            message = {p.task_id: p.message for p in env.prompts}
            chosen = []
            for task_id, eps in by_task.items():
                ids = [e.episode_id for e in eps]
                scores = bradley_terry(ids, games[task_id])
                ranked = select_ranked(scores, c.train_top, c.val_next)
                for e in eps:
                    rank, split = ranked[e.episode_id]
                    n_games = sum(e.episode_id in (x, y) for x, y, _ in games[task_id])
                    won = sum(s if x == e.episode_id else 1 - s for x, y, s in games[task_id] if e.episode_id in (x, y))
                    rankings.append({"task_id": task_id, "episode_id": e.episode_id, "games": n_games, "wins": won,
                                     "bt_score": scores[e.episode_id], "rank": rank, "split": split})
                    if split and e.final:
                        chosen.append((rank, task_id, e, split, scores[e.episode_id]))
            budget = c.max_train_tokens
            spent = 0
            for rank, task_id, e, split, score in sorted(chosen, key=lambda x: (x[0], x[1])):
                if split == "train" and budget is not None:
                    if spent + e.final_tokens > budget:
                        continue
                    spent += e.final_tokens
                examples.append({
                    "example_id": f"{e.episode_id}/mass", "method": self.name, "source_traj_id": e.episode_id,
                    "messages": sft_messages(ctx.prefix, message[task_id], e.final), "weight": 1.0,
                    "meta": {"train_from": len(ctx.prefix), "split": split, "workflow_id": teacher_id, "rank": rank,
                             "bt_score": score, "final_tokens": e.final_tokens,
                             **({"tools": ctx.tools} if ctx.tools else {})}})
            kept = {e["source_traj_id"]: e["meta"]["split"] for e in examples}
            for r in rankings:   # a ranked episode the token budget left out is not used
                r["split"] = kept.get(r["episode_id"])
        teacher_s = time.perf_counter() - t1

        model_results = [r for r in all_results if r.judge == "self"]
        agree = agreement(model_results, verified) if env.verifiable and model_results else None
        train_ex = [e for e in examples if e["meta"]["split"] == "train"]
        retained = next((w for w in workflows if w["retained"]), None)
        searched = [w for w in workflows if w["version"] >= 0]
        metrics = {
            "teacher": teacher_mode, "judge": c.judge, "proposer": c.proposer,
            "versions": len(searched), "accepted": sum(bool(w["accepted"]) for w in searched),
            "proposers": dict(sorted(Counter(w["proposer"] for w in searched).items())),
            "retained": retained["workflow_id"].rsplit("/", 1)[1] if retained else None,
            "retained_hops": " -> ".join(retained["spec"]["hops"]) if retained else None,
            "retained_spec": json.dumps(retained["spec"]) if retained else None,
            "retained_win_vs_reference": retained["win_vs_reference"] if retained else None,
            "collected": collect, "teacher_episodes": len(teacher_eps),
            "teacher_success": self._success(teacher_eps),
            "verdicts": len(verdicts),
            "invalid_verdicts": sum((v["verdict_xy"] == "invalid") + (v["verdict_yx"] == "invalid") for v in verdicts),
            "judge_agreement": agree["rate"] if agree else None, "judge_decided": agree["decided"] if agree else None,
            "examples": len(train_ex), "validation_examples": len(examples) - len(train_ex),
            "train_answer_tokens": sum(e["meta"]["final_tokens"] for e in train_ex),
            "model_calls": model.calls, "search_s": round(search_s, 1), "teacher_s": round(teacher_s, 1),
        }
        log.info("round %d MASS: %s", ctx.round, {k: v for k, v in metrics.items() if k != "retained_spec"})
        return Contribution(examples=examples, metrics=metrics,
                            tables={"mass_workflows": workflows, "mass_episodes": episodes, "mass_verdicts": verdicts,
                                    "mass_rankings": rankings})

    @staticmethod
    def _success(eps: list[Episode]) -> float | None:
        scored = [e.success for e in eps if e.success is not None]
        return sum(scored) / len(scored) if scored else None

    def _next_version(self, k: int, previous: dict | None, champion: Workflow, history: list[dict],
                      search: list[TaskPrompt], model: _Model, rng) -> tuple[Workflow, str, str | None]:
        """Version k's spec, who proposed it and what was proposed (raw reply or the mutation applied)."""
        if k == 0:
            if previous is not None:
                return Workflow.from_dict(previous["spec"]), "previous", previous["workflow_id"]
            return SEED_WORKFLOW, "seed", None
        if self.cfg.distill.mass.proposer == "model":
            reply = model.propose(proposal_messages([t.text for t in search], champion, history))
            try:
                return parse_proposal(reply), "model", reply
            except SpecError as err:
                new, what = mutate(champion, rng)
                log.info("MASS: the model's proposal is not a valid spec (%s); the mutation operator proposes instead",
                         err)
                return new, "mutation-after-invalid-proposal", f"{what['op']}: {what['detail']} (model: {err})"
        new, what = mutate(champion, rng)
        return new, "mutation", f"{what['op']}: {what['detail']}"

    # ---- training --------------------------------------------------------------------------------------------

    def training_rows(self, store, run_id: str, round_no: int, examples: list[dict]) -> list[dict]:
        """SFT rows on the bare task prompt and the workflow's answer; validation examples are rows with
        `validation: True` (the trainer keeps the checkpoint with the lowest loss on them, never trains on them)."""
        rows = super().training_rows(store, run_id, round_no, examples)
        for row, e in zip(rows, examples):
            if e["meta"].get("split") == "validation":
                row["validation"] = True
        return rows

    # ---- the candidate against the base (gate step) -----------------------------------------------------------

    def assess(self, ctx: AssessContext, inputs=None) -> Contribution | None:
        c, cfg = self.cfg.distill.mass, self.cfg
        if c.assess_tasks == 0:
            return None
        tasks = ctx.heldout[:c.assess_tasks]
        prefix, tools = prompt_setup(cfg)
        env = _Env(cfg, tasks)
        base = f"{ctx.run_id}/r{ctx.round}/mass/assess"
        try:
            answers = {}
            for tag, path in (("candidate", ctx.candidate_path), ("base", ctx.base_path)):
                model = _Model(cfg, backend_for(cfg, path), tools, cfg.gate.seed)
                eps = run_workflow(Workflow.reference(), None, env.prompts, prefix, model.hops(0.0),
                                   lambda i, t, tag=tag: f"{base}/{tag}/{i:04d}")
                env.verify(eps)
                answers[tag] = eps
            verified = {e.episode_id: e.success for eps in answers.values() for e in eps}
            text = {p.task_id: p.text for p in env.prompts}
            judge = _Model(cfg, backend_for(cfg, ctx.candidate_path), tools, cfg.gate.seed)
            results = judge_pairs(self._pairs(answers["candidate"], answers["base"], text), judge.ask)
        finally:
            env.close()
        cand, base_eps = answers["candidate"], answers["base"]
        self_win = win_rate([r.score for r in results], cfg.gate.confidence)
        metrics = {"assess_n": len(results), "win_vs_base": self_win["rate"], "win_vs_base_low": self_win["ci_low"],
                   "win_vs_base_high": self_win["ci_high"], "wins_vs_base": self_win["wins"],
                   "ties_vs_base": self_win["ties"], "losses_vs_base": self_win["losses"],
                   "candidate_tokens": mean(e.final_tokens for e in cand) if cand else None,
                   "base_tokens": mean(e.final_tokens for e in base_eps) if base_eps else None}
        tokens = metrics["candidate_tokens"]
        metrics["win_per_1k_tokens"] = (1000 * self_win["rate"] / tokens) if tokens and self_win["rate"] is not None \
            else None
        if env.verifiable:
            v_scores = [1.0 if x.success and not y.success else 0.0 if y.success and not x.success else 0.5
                        for x, y in zip(cand, base_eps)]
            v_win = win_rate(v_scores, cfg.gate.confidence)
            agree = agreement(results, verified)
            cs, bs = self._success(cand), self._success(base_eps)
            metrics.update({"verifier_win_vs_base": v_win["rate"], "verifier_win_vs_base_low": v_win["ci_low"],
                            "verifier_win_vs_base_high": v_win["ci_high"],
                            "candidate_success": cs, "base_success": bs,
                            "assess_agreement": agree["rate"], "assess_decided": agree["decided"],
                            "success_per_1k_tokens": 1000 * cs / tokens if tokens and cs is not None else None,
                            "base_success_per_1k_tokens": (1000 * bs / metrics["base_tokens"]
                                                           if metrics["base_tokens"] and bs is not None else None)})
        rows = _episode_rows(cand, "assess", ctx.candidate) + _episode_rows(base_eps, "assess", ctx.base)
        return Contribution(metrics=metrics, tables={
            "mass_episodes": rows,
            "mass_verdicts": _verdict_rows(results, "assess", ctx.candidate, f"{base}/verdict", verified)})

    # ---- reports --------------------------------------------------------------------------------------------

    @classmethod
    def round_metrics(cls, distill_metrics: dict | None, train_metrics: dict) -> dict | None:
        if distill_metrics is None:
            return None
        return {**distill_metrics, "trained_tokens": train_metrics.get("trained_tokens"),
                "validation_loss_best": train_metrics.get("validation_loss_best"),
                "validation_best_epoch": train_metrics.get("validation_best_epoch")}

    @classmethod
    def report_section(cls, rounds: list[dict]) -> list[str]:
        rows = [r for r in rounds if r.get("mass")]
        if not rows:
            return []
        lines = ["MASS per round (teacher: the retained workflow or the single-agent control; versions accepted / "
                 "searched; agreement: the model judge against the verifier on the pairs the verifier decides; "
                 "examples: training (validation) examples and their answer tokens; win vs base: the candidate "
                 "against the base on held-out tasks, judged by the candidate in both orders, ties 1/2, 95% Wilson "
                 "interval, and by the verifier; per 1k tokens: the candidate's win rate (and verifier success) per "
                 "1000 answer tokens):", "",
                 "| round | teacher | retained workflow | versions | judge (agreement) | examples (val) / tokens | "
                 "best val loss | win vs base, self [CI] | win vs base, verifier [CI] | assess agreement | "
                 "answer tokens cand/base | per 1k tokens |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]

        def ci(m: dict, key: str) -> str:
            rate, lo, hi = m.get(key), m.get(f"{key}_low"), m.get(f"{key}_high")
            return f"{rate:.3f} [{lo:.2f}, {hi:.2f}]" if rate is not None and lo is not None else "-"

        for r in rows:
            m = r["mass"]
            workflow = m.get("retained_hops") or "-"
            if m.get("teacher") == "workflow" and not m.get("collected"):
                workflow += " (none beat the reference)"
            lines.append(
                f"| {r['round']} | {m.get('teacher', '-')} | {workflow} | {m.get('accepted', '-')}/"
                f"{m.get('versions', '-')} | {m.get('judge', '-')} ({num(m.get('judge_agreement'), '.2f')}) | "
                f"{m.get('examples', '-')} ({m.get('validation_examples', '-')}) / "
                f"{m.get('train_answer_tokens', '-')} | {num(m.get('validation_loss_best'), '.3f')} | "
                f"{ci(m, 'win_vs_base')} | {ci(m, 'verifier_win_vs_base')} | "
                f"{num(m.get('assess_agreement'), '.2f')} | {num(m.get('candidate_tokens'), '.1f')}/"
                f"{num(m.get('base_tokens'), '.1f')} | {num(m.get('win_per_1k_tokens'), '.1f')}"
                f" ({num(m.get('success_per_1k_tokens'), '.1f')}) |")
        last = rows[-1]["mass"]
        if last.get("retained_spec"):
            lines += ["", f"Retained workflow of round {rows[-1]['round']}:", "", "```json", last["retained_spec"],
                      "```"]
        return lines

