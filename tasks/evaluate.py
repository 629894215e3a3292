"""evaluate: verifier outcomes of this round's rollouts, grouped; the champion's train-split success."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rsiflow.configs.schema import Config
from rsiflow.stats.groups import group_counts, group_stats
from rsiflow.stats.success import wilson_interval
from rsiflow.tasks.common import open_store, utcnow


def success_rows(rows: list[dict], model_id: str, split: str, env: str, confidence: float, prefix: str) -> list[dict]:
    """One evaluations row per task type plus one for all types ('*')."""
    by_type: dict[str, list[dict]] = {"*": rows}
    for r in rows:
        by_type.setdefault(r["task_type"], []).append(r)
    out = []
    for ttype, rs in sorted(by_type.items()):
        n, s = len(rs), sum(bool(r["success"]) for r in rs)
        lo, hi = wilson_interval(s, n, confidence)
        tokens = sum(int(r["gen_tokens"] or 0) for r in rs)
        out.append({"eval_id": f"{prefix}/{ttype}", "model_id": model_id, "split": split, "env": env,
                    "task_type": ttype, "n": n, "successes": s, "success_rate": s / n if n else 0.0,
                    "ci_low": lo, "ci_high": hi, "tokens_per_success": tokens / s if s else None})
    return out


@task(name="evaluate", cache_policy=NONE)
def evaluate_rollouts(cfg: Config, round_no: int) -> dict:
    started = utcnow()
    run_id = cfg.run.name
    with open_store(cfg) as store:
        rows = store.step_trajectories(run_id, round_no, "generate")
        if not rows:
            raise RuntimeError(f"round {round_no} of run {run_id!r} has no generated trajectories to evaluate")
        counts = group_counts(group_stats(rows))
        evals = success_rows(rows, rows[0]["model_id"], "train", cfg.env.name, cfg.gate.confidence,
                             f"{run_id}/r{round_no}/evaluate")
        with store.step(run_id, round_no, "evaluate", started) as tx:
            tx.insert("evaluations", evals)
    total = next(e for e in evals if e["task_type"] == "*")
    get_run_logger().info(
        "round %d evaluate: %d groups: %d all-fail, %d all-pass, %d mixed; champion's train success %d/%d "
        "[%.2f, %.2f]", round_no, counts["groups"], counts["all_fail"], counts["all_pass"], counts["mixed"],
        total["successes"], total["n"], total["ci_low"], total["ci_high"])
    return counts
