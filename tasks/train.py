"""train: TRL trains a candidate from the champion (or, with train.init base, from the run's base model) on the
training rows every enabled method makes of its examples of the round (SFT rows and privileged-teacher
distillation rows in one loss), plus the replay buffer (train.replay): the examples of earlier rounds of the
`replayable` methods (verified successes, e.g. ExIt's), deduplicated and capped per task. The peak learning rate
is train.learning_rate or, where it is null, the objective's default (1e-6 with policy-gradient rows, else 1e-5).

The candidate's folder gets a model card (README.md: parent, round, methods, examples, training; the gate's
evidence is added after its gate). Training metrics go to `train.report_to` (TensorBoard: event files under
<run_dir>/tensorboard/round-<n>); progress shows as a tqdm bar and a Prefect progress artifact."""

from __future__ import annotations

import json
import shutil
from collections import Counter

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config, ConfigError
from rsiflow.envs.rollout import round_seed
from rsiflow.methods import enabled_methods
from rsiflow.models.card import write_model_card
from rsiflow.tasks.common import StepProgress, open_store, run_dir, utcnow


def candidate_id(cfg: Config, round_no: int) -> str:
    return f"{cfg.run.name}/r{round_no}/candidate"


def distill_terms(methods):
    """The distillation loss terms of the round, one per method that has one (`distill_loss`): that method's
    settings (None: no term; one term: its settings, every distillation row in it; several: by method name, each
    row in its method's term, so SRD and RSIPO train together with their own λ)."""
    terms = {m.name: loss for m in methods if (loss := m.distill_loss()) is not None}
    return None if not terms else next(iter(terms.values())) if len(terms) == 1 else terms


def _policy_loss(methods):
    """The one `policy_loss` setting of the methods that have one; two different ones are a config error (the
    trainer takes one policy-gradient loss)."""
    losses = {m.name: m.policy_loss() for m in methods}
    losses = {name: loss for name, loss in losses.items() if loss is not None}
    if len(set(losses.values())) > 1:
        raise ConfigError(f"distill.methods: {sorted(losses)} each set a policy_loss and they differ ({losses}); "
                          "the trainer takes one: give them the same settings")
    return next(iter(losses.values()), None)


def _replay_key(e: dict) -> tuple:
    """What makes two examples the same for the replay buffer: the task and the conversation's actions (assistant
    messages) with where training starts."""
    return (_task(e), (e["meta"] or {}).get("train_from", 0),
            tuple(m["content"] for m in e["messages"] if m["role"] == "assistant"))


def _task(e: dict) -> str:
    return e.get("task_id") or e["source_traj_id"] or e["example_id"]


def select_replay(current: list[dict], earlier: list[dict], per_task: int | None,
                  dedupe: bool) -> tuple[list[dict], dict[str, int]]:
    """The replayed examples of one method: `earlier` (its examples of earlier rounds, newest round first, each with
    task_id, messages, meta parsed) taken in order, after this round's `current` ones (always kept): with `dedupe`
    one per (task, action sequence) over all of them; at most `per_task` per task (this round's count). Returns
    (replayed, {"dropped_duplicates", "dropped_cap"})."""
    seen = {_replay_key(e) for e in current} if dedupe else set()
    per = Counter(_task(e) for e in current)
    kept, counts = [], {"dropped_duplicates": 0, "dropped_cap": 0}
    for e in earlier:
        key = _replay_key(e)
        if dedupe and key in seen:
            counts["dropped_duplicates"] += 1
            continue
        if per_task is not None and per[_task(e)] >= per_task:
            counts["dropped_cap"] += 1
            continue
        seen.add(key)
        per[_task(e)] += 1
        kept.append(e)
    return kept, counts


def replay_buffer(store, cfg: Config, methods, round_no: int,
                  examples: list[dict]) -> tuple[dict[str, list[dict]], dict]:
    """train.replay: each enabled `replayable` method's examples of earlier rounds that join this round's `examples`
    (by method name), and the counts {"selected", "dropped_duplicates", "dropped_cap"}. Off (rounds 0): none."""
    r = cfg.train.replay
    counts = {"selected": 0, "dropped_duplicates": 0, "dropped_cap": 0}
    if r.rounds == 0:
        return {}, counts
    run_id = cfg.run.name
    first = None if r.rounds is None else round_no - r.rounds
    tasks = store.example_task_ids(run_id, round_no)
    out = {}
    for m in methods:
        if not m.replayable:
            continue
        current = [{**e, "task_id": tasks.get(e["example_id"])} for e in examples if e["method"] == m.name]
        kept, c = select_replay(current, store.examples_before(run_id, round_no, m.name, first), r.per_task, r.dedupe)
        out[m.name] = kept
        counts["selected"] += len(kept)
        counts["dropped_duplicates"] += c["dropped_duplicates"]
        counts["dropped_cap"] += c["dropped_cap"]
    return out, counts


def _replay_metrics(counts: dict, replay_round: dict[str, int], used_ids: list[str]) -> dict:
    """The train metrics' `replay`: replayed examples trained on (`examples`) and the rounds they came from, the
    ones selected for the buffer, what dedupe and the per-task cap dropped, and `buffer_examples`: rows trained
    in all (this round's and replayed)."""
    used = [e for e in used_ids if e in replay_round]
    return {"examples": len(used), "rounds": sorted({replay_round[e] for e in used}), "selected": counts["selected"],
            "dropped_duplicates": counts["dropped_duplicates"], "dropped_cap": counts["dropped_cap"],
            "buffer_examples": len(used_ids)}


def _skip(cfg: Config, round_no: int, started, metrics: dict, why: str) -> dict:
    """Nothing to learn from: a candidate would be a copy of the champion. None is registered, and the gate
    records a 'skip'."""
    with open_store(cfg) as store, store.step(cfg.run.name, round_no, "train", started) as tx:
        tx.metrics({"skipped": why})   # the gate's record of the skip names it
    get_run_logger().info("round %d train: skipped, %s", round_no, why)
    return {**metrics, "skipped": why}


@task(name="train", cache_policy=NONE)
def train_round(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    from tqdm.auto import tqdm

    from rsiflow.models import threads
    from rsiflow.models.launch import LaunchError, train_launched, uses_launcher
    from rsiflow.models.trainer import train_candidate as train

    run_id = cfg.run.name
    methods = enabled_methods(cfg)
    rows = []
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        parent = champion
        if cfg.train.init == "base":
            parent = store.base_model(run_id)
            if parent is None:
                raise LookupError(f"train.init is base but run {run_id!r} has no base model in the store")
        parent_path = store.model_path(parent)
        base = store.base_model(run_id)   # the β-KL reference of distill.grpo.reference base (ignored otherwise)
        reference_path = store.model_path(base) if base is not None else None
        examples = [{**e, "meta": json.loads(e["meta"] or "{}")} for e in store.examples_dataset(run_id, round_no)]
        replayed, replay_counts = replay_buffer(store, cfg, methods, round_no, examples)
        for m in methods:
            mine = [e for e in examples if e["method"] == m.name] + replayed.get(m.name, [])
            rows += [{**r, "term": m.name} if r.get("kind") == "distill" else r
                     for r in m.training_rows(store, run_id, round_no, mine)]
    replay_round = {e["example_id"]: e["round"] for es in replayed.values() for e in es}
    out_dir = run_dir(cfg) / "models" / f"round-{round_no}-candidate"
    if out_dir.exists():  # a rerun after a crash: train again from the parent
        shutil.rmtree(out_dir)
    if not rows:
        return _skip(cfg, round_no, started,
                     {"examples": 0, "replay": _replay_metrics(replay_counts, replay_round, [])},
                     "no training examples this round")
    lr = cfg.train.resolved_learning_rate(policy_gradient=any(r.get("kind") == "pg" for r in rows))
    train_cfg = cfg.train.model_copy(update={"learning_rate": lr})
    bar = tqdm(desc=f"round {round_no} train", unit="step", leave=False)
    ui = StepProgress(f"round {round_no} train: {len(rows)} rows, starting")

    def on_step(step: int, total: int) -> None:
        bar.total = total
        bar.update(step - bar.n)
        ui.update(step, total, f"round {round_no} train: step {step} of {total} ({len(rows)} rows)", last=step == total)

    job = dict(model_path=parent_path, rows=rows, out_dir=out_dir, seed=round_seed(cfg, round_no, 1),
               dtype=cfg.model.dtype, distill=distill_terms(methods),
               policy=_policy_loss(methods), trust_remote_code=cfg.model.trust_remote_code,
               log_dir=run_dir(cfg) / "tensorboard" / f"round-{round_no}", run_name=f"{run_id}-round-{round_no}",
               reference_path=reference_path)
    try:
        if uses_launcher(cfg.train):  # accelerate launch with train.processes processes (models/launch.py)
            try:
                metrics, used_ids = train_launched(run_dir(cfg) / "launch" / f"round-{round_no}", train_cfg,
                                                   on_step=on_step, **job)
            except LaunchError:
                shutil.rmtree(out_dir, ignore_errors=True)  # a crashed job's partial checkpoint is not a candidate
                raise
        else:
            threads.configure(cfg.run.threads)
            metrics, used_ids = train(cfg=train_cfg, on_step=on_step, **job)
    finally:
        bar.close()
    metrics = {**metrics, "learning_rate": lr, "init": cfg.train.init,
               "replay": _replay_metrics(replay_counts, replay_round, used_ids)}
    if not used_ids:  # e.g. every GRPO group was uniform: the candidate would be a copy of the champion
        shutil.rmtree(out_dir)
        zero = sum(r.get("kind") == "pg" and not r.get("advantage") for r in rows)
        why = (f"all {len(rows)} rows have advantage 0 (uniform groups: no policy gradient)" if zero == len(rows)
               else f"none of the {len(rows)} rows could be trained on")
        return _skip(cfg, round_no, started, metrics, why)
    cid = candidate_id(cfg, round_no)
    counts = {m.name: sum(e["method"] == m.name for e in examples) for m in methods}
    write_model_card(out_dir, {
        "model_id": cid, "run": run_id, "round": round_no, "parent_id": parent, "parent_path": parent_path,
        "init": cfg.train.init, "champion": champion,
        "methods": [m.name for m in methods], "examples": counts, "replay": metrics["replay"],
        "trained_rows": len(used_ids),
        "training": {k: metrics.get(k) for k in ("steps", "train_loss", "first_loss", "last_loss")}
        | {"learning_rate": lr, "warmup_ratio": cfg.train.warmup_ratio, "lr_scheduler": cfg.train.lr_scheduler,
           "epochs": cfg.train.epochs, "lora": cfg.train.lora.enabled},
        "gate": None, "created": utcnow().isoformat(timespec="seconds")})
    with open_store(cfg) as store, store.step(run_id, round_no, "train", started) as tx:
        tx.insert("models", [{"model_id": cid, "parent_id": parent, "path": str(out_dir), "role": "candidate",
                              "train_metrics": metrics}])
        tx.insert("train_inputs", [{"model_id": cid, "example_id": e} for e in used_ids])
    loss = (f"loss {metrics['first_loss']:.3f} -> {metrics['last_loss']:.3f} (mean {metrics['train_loss']:.3f})"
            if metrics.get("first_loss") is not None else "no loss logged")
    get_run_logger().info("round %d train: candidate %s from %s: %d rows (%s; %d replayed), lr %g, %d steps, %s in "
                          "%.0f s", round_no, cid, parent, len(used_ids),
                          ", ".join(f"{m} {n}" for m, n in counts.items()), metrics["replay"]["examples"], lr,
                          metrics["steps"], loss, (utcnow() - started).total_seconds())
    return metrics
