"""Per-round metrics read back from the store, rendered as a markdown table and a PNG plot.

Everything here is recomputed from the store, so a resumed run reports the same as one that
never stopped.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from methods.groups import group_counts, group_stats
from stores.store import Store
from tasks.common import fetch_dicts


def _heldout(store: Store, run_id: str, model_id: str | None) -> dict | None:
    if model_id is None:
        return None
    rows = fetch_dicts(store, "SELECT success_rate, ci_low, ci_high, n, successes, tokens_per_success FROM evaluations"
                       " WHERE run_id = ? AND model_id = ? AND split = 'heldout' AND task_type = '*'"
                       " ORDER BY round DESC LIMIT 1", [run_id, model_id])
    return rows[0] if rows else None


def _srd_metrics(store: Store, run_id: str, round: int, train_metrics: dict) -> dict | None:
    """SRD's per-round figures: notes written (usable), their writer and length, groups that produced
    a teacher/student pair, foresight samples and length, action-channel pairs, the distillation loss."""
    notes = fetch_dicts(store, "SELECT count(*) AS notes, count(*) FILTER (WHERE usable) AS usable,"
                        " avg(n_tokens) AS note_tokens, string_agg(DISTINCT writer, ',') AS writer FROM notes"
                        " WHERE run_id = ? AND round = ?", [run_id, round])[0]
    if not notes["notes"]:
        return None
    fs = fetch_dicts(store, "SELECT count(DISTINCT group_id) AS groups_with_signal,"
                     " count(*) FILTER (WHERE channel <> 'action') AS foresight,"
                     " avg(n_tokens) FILTER (WHERE channel <> 'action') AS foresight_tokens,"
                     " count(*) FILTER (WHERE channel = 'action') AS action_pairs FROM foresight"
                     " WHERE run_id = ? AND round = ?", [run_id, round])[0]
    return {**notes, **fs, "distill_loss": train_metrics.get("distill_loss_mean"),
            "distill_examples": train_metrics.get("distill_examples"),
            "misaligned": train_metrics.get("distill_misaligned")}


def round_rows(store: Store, run_id: str) -> list[dict]:
    """One dict per round that has a gate decision: what a person wants to see per round."""
    out = []
    decisions = fetch_dicts(store, "SELECT round, candidate_id, champion_id, decision, new_champion_id, evidence"
                            " FROM gate_decisions WHERE run_id = ? ORDER BY round", [run_id])
    for d in decisions:
        r = d["round"]
        gen = fetch_dicts(store, "SELECT group_id, reward, success, gen_tokens FROM trajectories"
                          " WHERE run_id = ? AND round = ? AND step = 'generate'", [run_id, r])
        counts = group_counts(group_stats(gen)) if gen else {}
        projected = store.con.execute(
            "SELECT avg(CASE WHEN raw_text IS NULL THEN 0 ELSE 1 END) FROM turns"
            " WHERE run_id = ? AND round = ? AND step = 'generate'", [run_id, r]).fetchall()[0][0]
        n_ex = store.con.execute("SELECT count(*) FROM examples WHERE run_id = ? AND round = ?", [run_id, r]).fetchall()[0][0]
        train = store.con.execute("SELECT train_metrics FROM models WHERE model_id = ?",
                                  [d["candidate_id"]]).fetchall() if d["candidate_id"] else []
        tm = json.loads(train[0][0]) if train and train[0][0] else {}
        timing = fetch_dicts(store, "SELECT step, epoch(finished_at - started_at) AS s FROM steps"
                             " WHERE run_id = ? AND round = ? AND status = 'completed'", [run_id, r])
        out.append({
            "round": r,
            "srd": _srd_metrics(store, run_id, r, tm),
            "train_success": sum(bool(g["success"]) for g in gen) / len(gen) if gen else None,
            **{k: counts.get(k) for k in ("all_fail", "all_pass", "mixed")},
            "projected": projected,
            "examples": n_ex,
            "train_loss": tm.get("train_loss"),
            "champion_before": d["champion_id"],
            "champion_heldout": _heldout(store, run_id, d["champion_id"]),
            "candidate_heldout": _heldout(store, run_id, d["candidate_id"]),
            "decision": d["decision"],
            "champion_after": d["new_champion_id"],
            "step_seconds": {t["step"]: round(float(t["s"]), 1) for t in timing},
        })
    return out


def _fmt(h: dict | None) -> str:
    if not h:
        return "-"
    return f"{h['success_rate']:.3f} [{h['ci_low']:.3f}, {h['ci_high']:.3f}] ({h['successes']}/{h['n']})"


def heldout_series(rows: list[dict]) -> list[tuple[str, dict | None]]:
    """Held-out success of the serving model: the base, then the champion after each round."""
    if not rows:
        return []
    series = [("base", rows[0]["champion_heldout"])]
    for r in rows:
        after = r["candidate_heldout"] if r["decision"] == "promote" else r["champion_heldout"]
        series.append((f"round {r['round']}", after))
    return series


def markdown_table(run_id: str, rows: list[dict]) -> str:
    lines = [f"# rsiflow run `{run_id}`", "",
             "| round | train success | groups fail/pass/mixed | projected actions | examples | train loss | "
             "champion held-out | candidate held-out | decision | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    srd_rows = [r for r in rows if r.get("srd")]
    for r in rows:
        loss = f"{r['train_loss']:.3f}" if r["train_loss"] is not None else "-"
        ts = f"{r['train_success']:.3f}" if r["train_success"] is not None else "-"
        secs = sum(r["step_seconds"].values())
        proj = f"{r['projected']:.2f}" if r["projected"] is not None else "-"
        lines.append(f"| {r['round']} | {ts} | {r['all_fail']}/{r['all_pass']}/{r['mixed']} | {proj} | {r['examples']} | {loss} | "
                     f"{_fmt(r['champion_heldout'])} | {_fmt(r['candidate_heldout'])} | {r['decision']} | {secs:.0f} |")
    if srd_rows:
        lines += ["", "SRD per round (notes: written / usable, by which writer; signal: groups that produced a "
                  "teacher/student pair; D: mean distillation loss over training steps):", "",
                  "| round | notes (usable) | writer | note tokens | groups with signal | foresight (tokens) | "
                  "action pairs | D |", "|---|---|---|---|---|---|---|---|"]
        for r in srd_rows:
            m = r["srd"]
            d = f"{m['distill_loss']:.4f}" if m.get("distill_loss") is not None else "-"
            nt = f"{m['note_tokens']:.0f}" if m.get("note_tokens") is not None else "-"
            ft = f"{m['foresight_tokens']:.0f}" if m.get("foresight_tokens") is not None else "-"
            lines.append(f"| {r['round']} | {m['notes']} ({m['usable']}) | {m['writer']} | {nt} | "
                         f"{m['groups_with_signal']} | {m['foresight']} ({ft}) | {m['action_pairs']} | {d} |")
    lines += ["", "projected actions: share of generated actions that were not admissible and were replaced by the "
              "closest admissible one (`env.project_actions`).", "",
              "Held-out success of the serving model (95% Wilson interval):", ""]
    for label, h in heldout_series(rows):
        lines.append(f"- {label}: {_fmt(h)}")
    return "\n".join(lines) + "\n"


def plot_png(run_id: str, rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(label, h) for label, h in heldout_series(rows) if h]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if series:
        xs = list(range(len(series)))
        ys = [h["success_rate"] for _, h in series]
        lo = [y - h["ci_low"] for y, (_, h) in zip(ys, series)]
        hi = [h["ci_high"] - y for y, (_, h) in zip(ys, series)]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label="serving model (champion)")
        cand = [(i + 1, r["candidate_heldout"]["success_rate"]) for i, r in enumerate(rows) if r["candidate_heldout"]]
        if cand:
            ax.scatter([c[0] for c in cand], [c[1] for c in cand], marker="x", color="grey", label="candidate")
        ax.set_xticks(xs, [label for label, _ in series])
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out success")
    ax.set_title(f"rsiflow run {run_id}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(store: Store, run_id: str, folder: Path) -> tuple[Path, Path, str]:
    """Write report.md and heldout.png into `folder`; return their paths and the markdown."""
    rows = round_rows(store, run_id)
    md = markdown_table(run_id, rows)
    folder.mkdir(parents=True, exist_ok=True)
    md_path = folder / "report.md"
    md_path.write_text(md)
    png = plot_png(run_id, rows, folder / "heldout.png")
    return md_path, png, md


def png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
