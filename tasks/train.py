"""train: TRL trains a candidate from the champion on the training rows every enabled method makes
of its examples of the round (SFT rows and privileged-teacher distillation rows in one loss).

The candidate's folder gets a model card (README.md: parent, round, methods, examples, training; the gate's
evidence is added after its gate). Training metrics go to `train.report_to` (TensorBoard: event files under
<run_dir>/tensorboard/round-<n>); progress shows as a tqdm bar and a Prefect progress artifact."""

from __future__ import annotations

import json
import shutil

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config, ConfigError
from models.card import write_model_card
from tasks.common import StepProgress, open_store, round_seed, run_dir, utcnow
from tasks.methods import enabled_methods


def candidate_id(cfg: Config, round: int) -> str:
    return f"{cfg.run.name}/r{round}/candidate"


def _one_loss(methods, kind: str):
    """The one loss setting (`distill_loss` or `policy_loss`) of the methods that have one; two different ones
    are a config error (the trainer takes one of each)."""
    losses = {m.name: getattr(m, kind)() for m in methods}
    losses = {name: loss for name, loss in losses.items() if loss is not None}
    if len(set(losses.values())) > 1:
        raise ConfigError(f"distill.methods: {sorted(losses)} each set a {kind} and they differ ({losses}); "
                          "the trainer takes one: give them the same settings")
    return next(iter(losses.values()), None)


def _skip(cfg: Config, round: int, started, metrics: dict, why: str) -> dict:
    """Nothing to learn from: a candidate would be a copy of the champion. None is registered, and the gate
    records a 'skip'."""
    with open_store(cfg) as store, store.step(cfg.run.name, round, "train", started):
        pass
    get_run_logger().info("round %d train: skipped, %s", round, why)
    return {**metrics, "skipped": why}


@task(name="train", cache_policy=NONE)
def train_candidate(cfg: Config, round: int) -> dict:
    started = utcnow()
    from tqdm.auto import tqdm

    from models.launch import LaunchError, train_launched, uses_launcher
    from models.trainer import train_candidate as train

    run_id = cfg.run.name
    methods = enabled_methods(cfg)
    rows = []
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        parent_path = store.model_path(champion)
        examples = [{**e, "meta": json.loads(e["meta"] or "{}")} for e in store.examples_dataset(run_id, round)]
        for m in methods:
            rows += m.training_rows(store, run_id, round, [e for e in examples if e["method"] == m.name])
    out_dir = run_dir(cfg) / "models" / f"round-{round}-candidate"
    if out_dir.exists():  # a rerun after a crash: train again from the champion
        shutil.rmtree(out_dir)
    if not rows:
        return _skip(cfg, round, started, {"examples": 0}, "no training examples this round")
    bar = tqdm(desc=f"round {round} train", unit="step", leave=False)
    ui = StepProgress(f"round {round} train: {len(rows)} rows, starting")

    def on_step(step: int, total: int) -> None:
        bar.total = total
        bar.update(step - bar.n)
        ui.update(step, total, f"round {round} train: step {step} of {total} ({len(rows)} rows)", last=step == total)

    job = dict(model_path=parent_path, rows=rows, out_dir=out_dir, seed=round_seed(cfg, round, 1),
               dtype=cfg.model.dtype, distill=_one_loss(methods, "distill_loss"),
               policy=_one_loss(methods, "policy_loss"), trust_remote_code=cfg.model.trust_remote_code,
               log_dir=run_dir(cfg) / "tensorboard" / f"round-{round}", run_name=f"{run_id}-round-{round}")
    try:
        if uses_launcher(cfg.train):  # accelerate launch with train.processes processes (models/launch.py)
            try:
                metrics, used_ids = train_launched(run_dir(cfg) / "launch" / f"round-{round}", cfg.train,
                                                   on_step=on_step, **job)
            except LaunchError:
                shutil.rmtree(out_dir, ignore_errors=True)  # a crashed job's partial checkpoint is not a candidate
                raise
        else:
            metrics, used_ids = train(cfg=cfg.train, on_step=on_step, **job)
    finally:
        bar.close()
    if not used_ids:  # e.g. every GRPO group was uniform: the candidate would be a copy of the champion
        shutil.rmtree(out_dir)
        return _skip(cfg, round, started, metrics, "no row of this round could be trained on")
    cid = candidate_id(cfg, round)
    counts = {m.name: sum(e["method"] == m.name for e in examples) for m in methods}
    write_model_card(out_dir, {
        "model_id": cid, "run": run_id, "round": round, "parent_id": champion, "parent_path": parent_path,
        "methods": [m.name for m in methods], "examples": counts, "trained_rows": len(used_ids),
        "training": {k: metrics.get(k) for k in ("steps", "train_loss", "first_loss", "last_loss")}
        | {"learning_rate": cfg.train.learning_rate, "epochs": cfg.train.epochs, "lora": cfg.train.lora.enabled},
        "gate": None, "created": utcnow().isoformat(timespec="seconds")})
    with open_store(cfg) as store, store.step(run_id, round, "train", started) as tx:
        tx.insert("models", [{"model_id": cid, "parent_id": champion, "path": str(out_dir), "role": "candidate",
                              "train_metrics": metrics}])
        tx.insert("train_inputs", [{"model_id": cid, "example_id": e} for e in used_ids])
    loss = (f"loss {metrics['first_loss']:.3f} -> {metrics['last_loss']:.3f} (mean {metrics['train_loss']:.3f})"
            if metrics.get("first_loss") is not None else "no loss logged")
    get_run_logger().info("round %d train: candidate %s from %s: %d rows (%s), %d steps, %s in %.0f s", round, cid,
                          champion, len(used_ids), ", ".join(f"{m} {n}" for m, n in counts.items()),
                          metrics["steps"], loss, (utcnow() - started).total_seconds())
    return metrics
