"""train: TRL trains a candidate from the champion on the round's examples (SFT rows, plus the
privileged-teacher distillation pairs of SRD in the same loss)."""

from __future__ import annotations

import json
import shutil

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config
from tasks.common import fetch_dicts, model_path, open_store, round_seed, run_dir, utcnow


def _distill_loss(cfg: Config):
    from models.distill import DistillLoss

    c = cfg.distill.srd
    return DistillLoss(loss_weight=c.loss_weight, divergence=c.divergence, beta=c.beta, top_k=c.top_k,
                       is_clip=c.is_clip, ema_rate=c.ema_rate)


def candidate_id(cfg: Config, round: int) -> str:
    return f"{cfg.run.name}/r{round}/candidate"


@task(name="train", cache_policy=NONE)
def train_candidate(cfg: Config, round: int) -> dict:
    started = utcnow()
    from tqdm.auto import tqdm

    from models.sft import train_sft

    run_id = cfg.run.name
    with open_store(cfg) as store:
        champion = store.champion(run_id)
        parent_path = model_path(store, champion)
        rows = [{**r, "train_from": json.loads(r["meta"] or "{}").get("train_from", 0)}
                for r in store.examples_dataset(run_id, round)]
        pairs = {f["foresight_id"]: f for f in fetch_dicts(
            store, "SELECT foresight_id, student_messages, teacher_messages, train_from, completion_ids, sampling_logprobs"
            " FROM foresight WHERE run_id = ? AND round = ? AND step = 'distill'", [run_id, round])}
    examples = [r for r in rows if r["method"] != "srd"]
    distill_examples = []
    for r in rows:
        if r["method"] == "srd":
            f = pairs[json.loads(r["meta"])["foresight_id"]]
            distill_examples.append({
                "example_id": r["example_id"], "weight": r["weight"], "train_from": f["train_from"],
                "student": json.loads(f["student_messages"]), "teacher": json.loads(f["teacher_messages"]),
                "completion_ids": f["completion_ids"], "sampling_logprobs": f["sampling_logprobs"]})
    out_dir = run_dir(cfg) / "models" / f"round-{round}-candidate"
    if out_dir.exists():  # a rerun after a crash: train again from the champion
        shutil.rmtree(out_dir)
    if not examples and not distill_examples:
        # Nothing to learn from: a candidate would be a copy of the champion. None is trained or
        # registered, and the gate records a 'skip'.
        with open_store(cfg) as store, store.step(run_id, round, "train", started):
            pass
        metrics = {"examples": 0, "skipped": "no training examples this round"}
        get_run_logger().info("round %d train: skipped, no training examples", round)
        return metrics
    bar = tqdm(desc=f"round {round} train", unit="step", leave=False)

    def on_step(step: int, total: int) -> None:
        bar.total = total
        bar.update(step - bar.n)

    try:
        metrics, used_ids = train_sft(parent_path, examples, out_dir, cfg.train, seed=round_seed(cfg, round, 1),
                                      dtype=cfg.model.dtype, on_step=on_step, distill_examples=distill_examples,
                                      distill=_distill_loss(cfg) if distill_examples else None)
    finally:
        bar.close()
    cid = candidate_id(cfg, round)
    with open_store(cfg) as store, store.step(run_id, round, "train", started) as tx:
        tx.insert("models", [{"model_id": cid, "parent_id": champion, "path": str(out_dir), "role": "candidate",
                              "train_metrics": metrics}])
        tx.insert("train_inputs", [{"model_id": cid, "example_id": e} for e in used_ids])
    get_run_logger().info("round %d train: %s", round, metrics)
    return metrics
