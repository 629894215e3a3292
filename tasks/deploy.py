"""deploy: the registry's champion serves the next round; the round is closed and reported."""

from __future__ import annotations

import re

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.cache_policies import NONE

from configs.schema import Config
from tasks.common import backend_for, open_store, run_dir, serving_champion, utcnow
from tasks.report import png_data_uri, round_rows, write_report


@task(name="deploy", cache_policy=NONE)
def redeploy(cfg: Config, round: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    champion, path = serving_champion(cfg)
    with open_store(cfg) as store:
        before = store.promotion_history(run_id)
        served = [d for d in before if d["round"] == round]
        previous = served[-1]["champion_id"] if served else champion
        previous_path = store.model_path(previous)
    # Redeploy: the backend that served this round's champion serves the new one from now on.
    record = backend_for(cfg, previous_path).serve(path)
    with open_store(cfg) as store:
        rows = {r["round"]: r for r in round_rows(store, run_id)}
        with store.step(run_id, round, "deploy", started) as tx:
            tx.metrics({"redeploy": record})
            store.finish_round(run_id, round, champion, {**rows.get(round, {}), "redeploy": record})
        md_path, png, md = write_report(store, run_id, run_dir(cfg) / "report")
    key = re.sub(r"[^a-z0-9-]", "-", f"rsiflow-{run_id}".lower())
    create_markdown_artifact(md, key=key, description=f"rsiflow run {run_id}: metrics per round")
    create_image_artifact(png_data_uri(png), key=f"{key}-plot", description=f"held-out success per round ({png})")
    get_run_logger().info("round %d deploy: champion %s (%s); report %s", round, champion, path, md_path)
    return {"champion": champion, "path": path, "report": str(md_path), "plot": str(png)}
