"""deploy: the registry's champion serves the next round; the round's candidate card gets its gate evidence;
retention deletes expired rejected checkpoints; the round is closed and reported.

Reports: report.md and heldout.png in the run's report folder, and Prefect artifacts keyed by run (so the UI's
Artifacts page keeps their history): `rsiflow-<run>-rounds`, a table with one row per round whose description
is the held-out history of the serving model; `rsiflow-<run>-plot`, the plot embedded in markdown (an image
artifact prints its whole data URI under the picture); `rsiflow-<run>`, the full markdown report.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config
from rsiflow.methods import method_classes
from rsiflow.models.card import update_model_card
from rsiflow.tasks.common import open_store, redeploy_backend, run_dir, serving_champion, utcnow
from rsiflow.tasks.report import heldout_line, history_markdown, png_data_uri, round_rows, round_table, write_report
from rsiflow.tasks.train import candidate_id


def gate_facts(decision: dict) -> dict:
    """What a model card says about a gate decision (a `promotion_history` row)."""
    ev = decision["evidence"] or {}
    facts = {"round": decision["round"], "decision": decision["decision"], "rule": decision["rule"]}
    if "wins" in ev:
        facts.update(n=ev["n"], wins=ev["wins"], losses=ev["losses"], p_value=ev.get("p_value"),
                     candidate=f"{ev['candidate_successes']}/{ev['n']}",
                     champion=f"{ev['champion_successes']}/{ev['n']}", champion_id=decision["champion_id"])
    return facts


def expire_checkpoints(cfg: Config, round_no: int, expired: list[dict]) -> tuple[list[dict], list[str]]:
    """Delete the folders of `expired` checkpoints (`Store.expired_checkpoints`) that lie under the run's models
    folder. Returns their `deleted_checkpoints` rows (a folder already gone, after a rerun, is recorded too) and
    the paths left alone because they are elsewhere (e.g. written under an earlier run.run_dir)."""
    models = (run_dir(cfg) / "models").resolve()
    rows, elsewhere = [], []
    for m in expired:
        path = Path(m["path"]).resolve()
        if models not in path.parents:
            elsewhere.append(str(path))
            continue
        size = None
        if path.exists():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            shutil.rmtree(path)
        rows.append({"model_id": m["model_id"], "run_id": cfg.run.name, "round": round_no, "path": str(path),
                     "bytes": size, "deleted_at": utcnow(),
                     "reason": f"rejected in round {m['round']}; train.keep_candidates={cfg.train.keep_candidates}"})
    return rows, elsewhere


@task(name="deploy", cache_policy=NONE)
def redeploy(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    champion, path = serving_champion(cfg)
    cid = candidate_id(cfg, round_no)
    with open_store(cfg) as store:
        before = store.promotion_history(run_id)
        served = [d for d in before if d["round"] == round_no]
        previous = served[-1]["champion_id"] if served else champion
        previous_path = store.model_path(previous)
        candidate_path = store.model_path(cid) if store.has_model(cid) else None
        expired = store.expired_checkpoints(run_id, cfg.train.keep_candidates)
    record = redeploy_backend(cfg, previous_path, path)
    if candidate_path and served and Path(candidate_path, "README.md").is_file():
        update_model_card(candidate_path, gate=gate_facts(served[-1]))
    deleted, elsewhere = expire_checkpoints(cfg, round_no, expired)
    for path in elsewhere:
        get_run_logger().warning("retention: %s is not under this run's models folder; not deleting it", path)
    with open_store(cfg) as store:
        methods = method_classes(cfg)
        rows = round_rows(store, run_id, methods)
        this = {r["round"]: r for r in rows}.get(round_no, {})
        with store.step(run_id, round_no, "deploy", started) as tx:
            tx.insert("deleted_checkpoints", deleted)
            tx.metrics({"redeploy": record, "deleted_checkpoints": [d["model_id"] for d in deleted]})
            store.finish_round(run_id, round_no, champion, {**this, "redeploy": record})
        md_path, png, md = write_report(store, run_id, run_dir(cfg) / "report", rows, methods)
    key = re.sub(r"[^a-z0-9-]", "-", f"rsiflow-{run_id}".lower())
    history = heldout_line(rows)
    create_table_artifact(round_table(rows), key=f"{key}-rounds",
                          description=f"**rsiflow run `{run_id}`**, held-out success of the serving model "
                                      f"(95% Wilson interval): {history}")
    create_markdown_artifact(f"![held-out success per round]({png_data_uri(png)})\n\n`{png}`\n", key=f"{key}-plot",
                             description=f"rsiflow run {run_id}: held-out success per round")
    create_markdown_artifact(md, key=key, description=f"rsiflow run {run_id}: metrics per round")
    create_markdown_artifact(history_markdown(run_id, rows), key=f"{key}-history",
                             description=f"rsiflow run {run_id}: every round's decision and serving model")
    freed = sum(d["bytes"] or 0 for d in deleted) / 1e6
    get_run_logger().info("round %d deploy: %s serves from now on (%s: %s); held-out: %s; retention deleted %d "
                          "rejected checkpoint(s), %.1f MB; report %s", round_no, champion, record.get("kind"),
                          record.get("action"), history, len(deleted), freed, md_path)
    return {"champion": champion, "path": path, "report": str(md_path), "plot": str(png),
            "deleted_checkpoints": [d["model_id"] for d in deleted]}
