"""train: TRL trains a candidate from the champion on the round's examples."""

from __future__ import annotations

import json
import shutil

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from configs.schema import Config
from tasks.common import model_path, open_store, round_seed, run_dir, utcnow


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
        examples = [{**r, "train_from": json.loads(r["meta"] or "{}").get("train_from", 0)}
                    for r in store.examples_dataset(run_id, round)]
    out_dir = run_dir(cfg) / "models" / f"round-{round}-candidate"
    if out_dir.exists():  # a rerun after a crash: train again from the champion
        shutil.rmtree(out_dir)
    if not examples:
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
                                      dtype=cfg.model.dtype, on_step=on_step)
    finally:
        bar.close()
    cid = candidate_id(cfg, round)
    with open_store(cfg) as store, store.step(run_id, round, "train", started) as tx:
        tx.insert("models", [{"model_id": cid, "parent_id": champion, "path": str(out_dir), "role": "candidate",
                              "train_metrics": metrics}])
        tx.insert("train_inputs", [{"model_id": cid, "example_id": e} for e in used_ids])
    get_run_logger().info("round %d train: %s", round, metrics)
    return metrics
