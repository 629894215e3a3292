"""gate: candidate and champion play the same held-out tasks with the same seeds; the config's
promotion rule decides on the paired outcomes (stats/gating.py); the decision and its evidence
are recorded either way, and a Prefect event `rsiflow.gate.<decision>` is emitted. A round that
trained no candidate (no examples) records a 'skip'; the champion stays. Once a trained candidate has
played, each enabled method may assess it (`Method.assess`, e.g. MASS's self-judged win rate against the
base): its rows go into the gate's transaction, its figures into the step's metrics.

With `gate.max_heldout_tasks` the sample grows look by look (n0, 2·n0, ... the maximum) while the
paired test is inconclusive; each look plays only the tasks it adds. The held-out sample is drawn
once at its largest size and every look takes its first n tasks, so a smaller sample is always the
start of a larger one.

The champion's held-out results are reused task by task when the store already has them (it
played them as the previous round's candidate, or as the base in round 1): the same model on the
same task with the same seed. At `gate.temperature: 0` (greedy) a result does not depend on which
batch it was played in; with sampling it does (the backend seeds each batched call).

A stopped gate resumes its plays: after each batch of plays (one model's greedy or sampled plays of the
tasks a look adds) the plays so far are saved to `<run_dir>/partial/`, and the same step run again starts
from them when every setting that decides the plays (tasks, seeds, models' weights files, env, backend,
dtypes) is the same, playing only the batches it had not finished: the same plays an unbroken gate makes.
The file is removed once the step is stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.events import emit_event

from rsiflow.configs.schema import Config
from rsiflow.envs.base import TaskSpec
from rsiflow.envs.rollout import Episode, env_factory, episode_rows
from rsiflow.methods import AssessContext, enabled_methods
from rsiflow.models.backend import backend_for
from rsiflow.stats.gating import Rule, look_sizes, sequential_decision, sign_flip_pvalue
from rsiflow.stats.success import compare, design_sd, detectable_gain, mean_interval, wilson_interval
from rsiflow.tasks.common import open_store, play, utcnow
from rsiflow.tasks.evaluate import success_rows
from rsiflow.tasks.train import candidate_id


def distinct_tasks(env, split: str, n: int, seed: int, exclude: set[str] = frozenset()) -> list[TaskSpec]:
    """`n` tasks of `split` whose specs and task ids all differ and none of which is in `exclude` (specs as
    `spec_key`): the env's sample in order with repeats dropped, drawn larger until n remain (a family with a small
    task space, e.g. one-step sums, repeats questions; a fixed pool cycles; a repeated task would be counted as two
    pieces of evidence). Fewer than n when the split has fewer distinct tasks, with one warning that says how many.
    A sample of n is the start of a sample of more."""
    want, tasks = n, []
    while True:
        drawn = env.sample_tasks(split, want, seed)
        seen, ids, tasks = set(exclude), set(), []
        for t in drawn:
            key = spec_key(t)
            if key not in seen and t.task_id not in ids:
                seen.add(key)
                ids.add(t.task_id)
                tasks.append(t)
                if len(tasks) == n:
                    return tasks
        if len(drawn) < want or want >= 16 * n:   # the split is exhausted, or holds too few distinct tasks
            if len(tasks) < n:
                logging.getLogger(__name__).warning(
                    "%s %s tasks (seed %d): asked for %d distinct tasks, found %d in a sample of %d%s",
                    getattr(env, "name", type(env).__name__), split, seed, n, len(tasks), len(drawn),
                    f" ({len(exclude)} specs excluded)" if exclude else "")
            return tasks
        want *= 2


def spec_key(task: TaskSpec) -> str:
    """What makes two tasks the same task: their type and spec (the task seed aside)."""
    return json.dumps([task.task_type, task.spec], sort_keys=True)


def heldout_tasks(cfg: Config) -> list[TaskSpec]:
    """The held-out sample at its largest size (the last look's), distinct tasks; a look of n tasks plays its
    first n."""
    env = env_factory(cfg)()
    try:
        return distinct_tasks(env, "heldout", look_sizes(cfg.gate.heldout_tasks, cfg.gate.max_heldout_tasks)[-1],
                              cfg.gate.seed)
    finally:
        env.close()


def sample_seed(base: int, round_no: int, role: str) -> int:
    """The seed of a model's sampled held-out plays in a round: candidate and champion differ (independent plays,
    which the sign-flip test's bound needs) and both change every round (a fresh sample, not the one a past
    decision was made on)."""
    return (base * 1_000_003 + round_no * 7919 + {"candidate": 1, "champion": 2, "base": 3}[role]) % (2**31)


def _stored_results(store, run_id: str, model_id: str, task_ids: list[str]) -> dict[str, dict]:
    """This model's newest stored held-out trajectory for each of these tasks it has played."""
    wanted, found = set(task_ids), {}
    for r in store.eval_trajectories(run_id, model_id):
        if r["task_id"] in wanted:
            found.setdefault(r["task_id"], r)
    return found


def gate_event(run_id: str, round_no: int, decision: str, candidate: str | None, champion: str,
               new_champion: str, payload: dict) -> dict:
    """The keyword arguments of `emit_event` for one gate decision: the event `rsiflow.gate.<decision>`
    about the resource `rsiflow.run.<run>`, the models as related resources, the figures as payload."""
    related = [{"prefect.resource.id": f"rsiflow.model.{mid}", "prefect.resource.role": role,
                "prefect.resource.name": mid}
               for mid, role in ((candidate, "candidate"), (champion, "champion")) if mid is not None]
    return {"event": f"rsiflow.gate.{decision}",
            "resource": {"prefect.resource.id": f"rsiflow.run.{run_id}", "prefect.resource.name": run_id},
            "related": related,
            "payload": {"run": run_id, "round": round_no, "decision": decision, "candidate_id": candidate,
                        "champion_id": champion, "new_champion_id": new_champion, **payload}}


def emit_gate_event(event: dict, logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Send the event, best-effort: the decision is already stored, so a failure to send is logged
    with its cause and never fails the step."""
    try:
        emit_event(**event)
    except Exception as error:  # any failure to notify must leave the recorded decision standing
        logger.warning("could not emit the Prefect event %s: %s: %s", event["event"], type(error).__name__, error)


def _sampled_rows(per_task: list[dict], model_id: str, split: str, env: str, confidence: float,
                  prefix: str) -> list[dict]:
    """evaluations rows of sampled plays, one per task type plus '*': n = plays, the interval that of the mean of
    per-task rates (the plays of one task are not independent)."""
    by_type: dict[str, list[dict]] = {"*": per_task}
    for r in per_task:
        by_type.setdefault(r["task_type"], []).append(r)
    out = []
    for ttype, rs in sorted(by_type.items()):
        plays, s = sum(r["plays"] for r in rs), sum(r["successes"] for r in rs)
        lo, hi = mean_interval([r["successes"] / r["plays"] for r in rs], confidence)
        tokens = sum(r["gen_tokens"] for r in rs)
        out.append({"eval_id": f"{prefix}/{ttype}", "model_id": model_id, "split": split, "env": env,
                    "task_type": ttype, "n": plays, "successes": s, "success_rate": s / plays if plays else 0.0,
                    "ci_low": lo, "ci_high": hi, "tokens_per_success": tokens / s if s else None})
    return out


class HeldoutPlays:
    """Each model's outcomes on the first n tasks of a sample, played on demand: one greedy play per task
    (at gate.temperature, seed `greedy_seed`; a model's stored greedy results can be given to reuse) and, with
    `samples` k > 0, k sampled plays per task at the training policy's temperature (seed per model, fresh)."""

    def __init__(self, cfg: Config, tasks: list[TaskSpec], paths: dict[str, str], tags: dict[str, str],
                 prefix: str, greedy_seed: int, sample_seeds: dict[str, int], samples: int, desc: str,
                 checkpoint: Path | None = None):
        self.cfg, self.tasks, self.paths, self.tags, self.prefix = cfg, tasks, paths, tags, prefix
        self.greedy_seed, self.sample_seeds, self.samples, self.desc = greedy_seed, sample_seeds, samples, desc
        self.greedy: dict[str, dict[int, dict]] = {m: {} for m in paths}
        self.sampled: dict[str, dict[int, dict]] = {m: {} for m in paths}
        self.played: dict[str, list[Episode]] = {m: [] for m in paths}
        self.played_sampled: dict[str, list[Episode]] = {m: [] for m in paths}
        self.checkpoint, self.resumed = checkpoint, 0
        if checkpoint is not None:
            self._resume()

    def _key(self) -> str:
        """What decides these plays: a saved checkpoint is used only when this is unchanged."""
        def weights(path: str) -> list:
            p = Path(path)
            files = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) if p.is_dir() else []
            return [path] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]

        cfg = self.cfg
        settings = {"prefix": self.prefix, "tasks": [t.task_id for t in self.tasks], "greedy_seed": self.greedy_seed,
                    "sample_seeds": self.sample_seeds, "samples": self.samples, "tags": self.tags,
                    "models": {m: weights(p) for m, p in self.paths.items()}, "env": cfg.env.model_dump(),
                    "backend": cfg.backend.model_dump(), "gate_temperature": cfg.gate.temperature,
                    "dtypes": [cfg.model.dtype, cfg.gate.dtype]}
        return hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()

    def _resume(self) -> None:
        log = logging.getLogger(__name__)
        if not self.checkpoint.exists():
            return
        try:
            with open(self.checkpoint, "rb") as f:
                saved = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError) as err:
            log.warning("%s: saved held-out plays not readable (%s: %s); playing them from the start",
                        self.checkpoint, type(err).__name__, err)
            return
        if not isinstance(saved, dict) or saved.get("key") != self._key():
            log.warning("%s: saved held-out plays were made with other settings (tasks, seeds, weights, env, backend "
                        "or dtypes); playing them from the start", self.checkpoint)
            return
        for name in ("greedy", "sampled", "played", "played_sampled"):
            for m, v in saved[name].items():
                if m in self.paths:
                    getattr(self, name)[m] = v
        self.resumed = sum(len(v) + len(self.played_sampled[m]) for m, v in self.played.items())

    def _save(self) -> None:
        if self.checkpoint is None:
            return
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump({"key": self._key(), "greedy": self.greedy, "sampled": self.sampled,
                         "played": self.played, "played_sampled": self.played_sampled}, f)
        os.replace(tmp, self.checkpoint)

    def discard_checkpoint(self) -> None:
        """Remove the saved plays (call once what they were for is stored)."""
        if self.checkpoint is not None:
            self.checkpoint.unlink(missing_ok=True)

    def play_first(self, n: int) -> None:
        for mid in self.paths:
            missing = [i for i in range(n) if i not in self.greedy[mid]]
            sampled_missing = [i for i in range(n) if i not in self.sampled[mid]] if self.samples else []
            if not missing and not sampled_missing:
                continue
            backend = backend_for(self.cfg, self.paths[mid], evaluation=True)
            tag = self.tags[mid]
            if missing:
                episodes = [Episode(traj_id=f"{self.prefix}/{tag}/{i:04d}", task=self.tasks[i],
                                    group_id=f"{self.cfg.run.name}/eval/{self.tasks[i].task_id}", sample_idx=0)
                            for i in missing]
                play(self.cfg, backend, episodes, self.cfg.gate.temperature, self.greedy_seed,
                     f"{self.desc}: {tag} ({len(missing)} of {n} tasks)")
                self.played[mid] += episodes
                for i, e in zip(missing, episodes):
                    self.greedy[mid][i] = {"success": e.success, "gen_tokens": e.gen_tokens,
                                           "task_type": e.task.task_type, "traj_id": e.traj_id,
                                           "actions": [t.action_text for t in e.turns],
                                           "messages": e.messages, "n_prefix": e.n_prefix}
                self._save()
            if sampled_missing:
                k = self.samples
                episodes = [Episode(traj_id=f"{self.prefix}/{tag}/sampled/{i:04d}-{j:02d}", task=self.tasks[i],
                                    group_id=f"{self.prefix}/{tag}/sampled/{self.tasks[i].task_id}", sample_idx=j)
                            for i in sampled_missing for j in range(k)]
                play(self.cfg, backend, episodes, self.cfg.backend.temperature, self.sample_seeds[mid],
                     f"{self.desc}: {tag} sampled ({len(sampled_missing)} of {n} tasks x {k})")
                self.played_sampled[mid] += episodes
                for a, i in enumerate(sampled_missing):
                    eps = episodes[a * k:(a + 1) * k]
                    self.sampled[mid][i] = {"successes": sum(bool(e.success) for e in eps), "plays": k,
                                            "gen_tokens": sum(e.gen_tokens for e in eps),
                                            "task_type": self.tasks[i].task_type}
                self._save()

    def outcomes(self, metric: str, a: str, b: str, n: int) -> tuple[list, list]:
        """(a's, b's) outcomes on the first n tasks: greedy successes, or sampled success counts."""
        self.play_first(n)
        if metric == "sampled":
            return ([self.sampled[a][i]["successes"] for i in range(n)],
                    [self.sampled[b][i]["successes"] for i in range(n)])
        return [bool(self.greedy[a][i]["success"]) for i in range(n)], [bool(self.greedy[b][i]["success"])
                                                                         for i in range(n)]

    def rows(self, n: int, split: str, step_prefix: str) -> dict[str, list[dict]]:
        """The trajectories, turns and evaluations rows of what was played (evaluations over the first n tasks)."""
        out: dict[str, list[dict]] = {"trajectories": [], "turns": [], "evaluations": []}
        env, conf = self.cfg.env.name, self.cfg.gate.confidence
        for mid in self.paths:
            tag = self.tags[mid]
            for episodes, purpose in ((self.played[mid], split_purpose(split)),
                                      (self.played_sampled[mid], split_purpose(split) + "_sampled")):
                if episodes:
                    trajs, turns = episode_rows(episodes, mid, purpose)
                    out["trajectories"] += trajs
                    out["turns"] += turns
            if self.played[mid]:
                out["evaluations"] += success_rows([self.greedy[mid][i] for i in range(n)], mid, split, env, conf,
                                                   f"{step_prefix}/{tag}")
            if self.samples and self.played_sampled[mid]:
                out["evaluations"] += _sampled_rows([self.sampled[mid][i] for i in range(n)], mid,
                                                    f"{split}:sampled", env, conf, f"{step_prefix}/{tag}/sampled")
        return out

    def summary(self, mid: str, n: int) -> dict:
        """A model's figures on the first n tasks: greedy (and sampled) success with intervals, per task type."""
        g = [self.greedy[mid][i] for i in range(n)]
        out = {"greedy": _rate_summary([int(bool(r["success"])) for r in g], 1, [r["task_type"] for r in g],
                                       self.cfg.gate.confidence)}
        if self.samples and all(i in self.sampled[mid] for i in range(n)):
            s = [self.sampled[mid][i] for i in range(n)]
            out["sampled"] = _rate_summary([r["successes"] for r in s], self.samples, [r["task_type"] for r in s],
                                           self.cfg.gate.confidence)
        return out


def partial_path(cfg: Config, round_no: int, step: str) -> Path:
    """Where a step's held-out plays are saved while it runs (`HeldoutPlays`' checkpoint)."""
    return cfg.run_dir / "partial" / f"{cfg.run.name}-r{round_no}-{step}.pkl"


def split_purpose(split: str) -> str:
    """The trajectories' purpose for a split's plays: 'eval' for held-out (the greedy ones the gate reuses),
    'test' for the final test split."""
    return {"heldout": "eval", "test": "test"}[split]


def _rate_summary(successes: list[int], k: int, types: list[str], confidence: float) -> dict:
    """Success rate over tasks (each k plays) with its interval, overall and per task type."""
    def one(xs: list[int]) -> dict:
        n = len(xs)
        lo, hi = (wilson_interval(sum(xs), n, confidence) if k == 1
                  else mean_interval([x / k for x in xs], confidence))
        return {"n": n, "plays": n * k, "successes": sum(xs), "rate": sum(xs) / (n * k) if n else None,
                "ci": [lo, hi]}
    by_type: dict[str, list[int]] = {}
    for x, t in zip(successes, types):
        by_type.setdefault(t, []).append(x)
    return {**one(successes), "by_type": {t: one(xs) for t, xs in sorted(by_type.items())}}


def paired_figures(ev, alpha: float) -> dict:
    """The paired comparison's figures for the report: difference, interval, wins/losses, the exact one-sided
    p-value (sign test, or sign-flip with k plays) and the gain detectable with 80% power at this size (from the
    observed spread of the per-task differences; from independent plays at the champion's rate when they do not
    spread)."""
    p = sign_flip_pvalue(ev.diffs)
    if ev.paired_sd > 0:
        sd, basis = ev.paired_sd, "observed"
    else:
        sd, basis = design_sd(min(max(ev.champion_rate, 0.05), 0.95), ev.samples), "design"
    return {"n": ev.n, "samples": ev.samples, "candidate_rate": ev.candidate_rate, "champion_rate": ev.champion_rate,
            "candidate_ci": list(ev.candidate_ci), "champion_ci": list(ev.champion_ci),
            "paired_diff": ev.paired_diff, "paired_diff_ci": list(ev.paired_diff_ci), "wins": ev.wins,
            "losses": ev.losses, "p_value": p, "detectable_gain": detectable_gain(sd, ev.n, alpha),
            "detectable_gain_basis": basis}


@task(name="gate", cache_policy=NONE)
def gate_candidate(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    g = cfg.gate
    sizes = look_sizes(g.heldout_tasks, g.max_heldout_tasks)
    tasks = heldout_tasks(cfg)
    if len(tasks) < sizes[-1]:
        raise ValueError(f"gate.heldout_tasks: the env's held-out split has {len(tasks)} distinct tasks, fewer than "
                         f"the {sizes[-1]} the gate needs; lower gate.heldout_tasks (or gate.max_heldout_tasks)")
    cid = candidate_id(cfg, round_no)
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        trained = store.has_model(cid)
        why_not = (store.step_metrics(run_id, round_no, "train") or {}).get("skipped") or "no training examples"
        paths = {m: store.model_path(m) for m in ((cid, champion) if trained else (champion,))}
        stored = _stored_results(store, run_id, champion, [t.task_id for t in tasks])
        stored_actions = store.trajectory_actions([r["traj_id"] for r in stored.values()])
        base = store.base_model(run_id)
        base_path = store.model_path(base)

    tag = {cid: "candidate", champion: "champion"}
    plays = HeldoutPlays(cfg, tasks, paths, tag, f"{run_id}/r{round_no}/gate", g.seed,
                         {m: sample_seed(g.seed, round_no, tag[m]) for m in paths}, g.samples, f"round {round_no} gate",
                         checkpoint=partial_path(cfg, round_no, "gate"))
    if plays.resumed:
        get_run_logger().info("round %d gate: resuming from %d plays saved by a stopped attempt", round_no,
                              plays.resumed)
    # the champion's greedy results on the same tasks and seed, reused where the store has them
    plays.greedy[champion].update({i: {**stored[t.task_id], "task_type": t.task_type,
                                       "actions": stored_actions.get(stored[t.task_id]["traj_id"], [])}
                                   for i, t in enumerate(tasks) if t.task_id in stored})
    samples = g.samples if g.metric == "sampled" else 1

    def outcomes(n: int) -> tuple[list, list]:
        return plays.outcomes(g.metric, cid, champion, n)

    metrics: dict = {}
    if trained:
        result = sequential_decision(outcomes, sizes, Rule(g.rule, g.alpha, g.margin, g.confidence), samples)
        ev, decision, n = result.evidence, result.decision, result.evidence.n
        level = g.alpha / len(sizes)
        evidence = {**{k: v for k, v in result.to_dict().items() if k != "diffs"}, "alpha": g.alpha,
                    "margin": g.margin, "look_sizes": sizes, "metric": g.metric,
                    "candidate_trajectories": [plays.greedy[cid][i]["traj_id"] for i in range(n)]}
        plays.play_first(n)
        paired = {"greedy": paired_figures(compare(*plays.outcomes("greedy", cid, champion, n), g.rule,
                                                   g.confidence), level)}
        if g.samples:
            paired["sampled"] = paired_figures(compare(*plays.outcomes("sampled", cid, champion, n), g.rule,
                                                       g.confidence, g.samples), level)
        evidence.update(paired=paired, detectable_gain=paired[g.metric]["detectable_gain"])
        summary = {"decision": decision, "metric": g.metric, "candidate": ev.candidate_rate,
                   "champion": ev.champion_rate, "candidate_ci": ev.candidate_ci, "champion_ci": ev.champion_ci,
                   "n": n, "samples": ev.samples, "wins": ev.wins, "losses": ev.losses,
                   "p_value": evidence.get("p_value"), "looks": len(result.looks),
                   "detectable_gain": evidence["detectable_gain"]}
        line = result.describe() + f"; detectable gain at 80% power: {evidence['detectable_gain']:.3f}"
    else:
        decision, n = "skip", sizes[0]
        plays.play_first(n)
        successes = sum(bool(plays.greedy[champion][i]["success"]) for i in range(n))
        evidence = {"reason": f"{why_not}: no candidate was trained",
                    "n": n, "champion_successes": successes, "champion_rate": successes / n, "metric": g.metric}
        summary = {"decision": decision, "champion": evidence["champion_rate"], "n": n}
        line = f"no candidate ({why_not}) -> skip; champion {successes}/{n}"
    figures = {m: plays.summary(m, n) for m in paths}
    evidence.update(task_ids=[t.task_id for t in tasks[:n]], champion_results_reused=not plays.played[champion],
                    champion_tasks_reused=n - len(plays.played[champion]),
                    champion_trajectories=[plays.greedy[champion][i]["traj_id"] for i in range(n)],
                    heldout={tag[m]: f for m, f in figures.items()})
    if "sampled" in figures[champion]:
        s = figures[champion]["sampled"]
        line += f"; champion sampled {s['successes']}/{s['plays']} = {s['rate']:.3f}"
        if trained:
            c = figures[cid]["sampled"]
            line += f", candidate sampled {c['successes']}/{c['plays']} = {c['rate']:.3f}"
    new_champion = cid if decision == "promote" else champion
    # each enabled method's own assessment of the candidate (e.g. MASS: win rate against the base, self-judged)
    assessed = {}
    if trained:
        actx = AssessContext(cfg=cfg, round=round_no, candidate=cid, candidate_path=paths[cid], champion=champion,
                             champion_path=paths[champion], base=base, base_path=base_path, heldout=tasks, play=play)
        methods = enabled_methods(cfg)
        with open_store(cfg) as store:
            reads = {m.name: m.assess_read(store, actx) for m in methods}
        assessed = {m.name: (m, c) for m in methods if (c := m.assess(actx, reads[m.name])) is not None}
        if cfg.diagnostics.enabled:
            from rsiflow.tasks.diagnostics import learning_diagnostics

            metrics["diagnostics"] = learning_diagnostics(cfg, round_no, cid, paths[cid], champion, paths[champion],
                                                          plays, n)

    rows = plays.rows(n, "heldout", f"{run_id}/r{round_no}/gate")
    with open_store(cfg) as store, store.step(run_id, round_no, "gate", started) as tx:
        tx.insert("tasks", [t.to_row() for t in tasks[:n]])
        for table in ("trajectories", "turns", "evaluations"):
            tx.insert(table, rows[table])
        tx.insert("gate_decisions", [{"candidate_id": cid if trained else None, "champion_id": champion,
                                      "decision": decision, "rule": g.rule, "evidence": evidence,
                                      "new_champion_id": new_champion}])
        if trained:
            tx.set_model_role(cid, "champion" if decision == "promote" else "rejected")
        for name, (m, c) in assessed.items():
            unknown = set(c.tables) - set(m.tables)
            if unknown:
                raise ValueError(f"method {name!r} assessed into tables it does not declare in `tables`: "
                                 f"{sorted(unknown)}")
            for table, trows in c.tables.items():
                tx.insert(table, trows)
        if assessed or metrics:
            tx.metrics({**{name: c.metrics for name, (_, c) in assessed.items()}, **metrics})
    plays.discard_checkpoint()
    logger = get_run_logger()
    logger.info("round %d gate: %s", round_no, line)
    emit_gate_event(gate_event(run_id, round_no, decision, cid if trained else None, champion, new_champion,
                               {"rule": g.rule, **summary}), logger)
    return summary
