"""Per-round metrics read back from the store, rendered as a markdown table and a PNG plot.

Everything here is recomputed from the store, so a resumed run reports the same as one that
never stopped.
"""

from __future__ import annotations

import base64
from pathlib import Path

from rsiflow.methods import Method, method_classes
from rsiflow.stats.groups import group_counts, group_stats
from rsiflow.stores.store import Store
from rsiflow.tasks.common import STEPS


def round_rows(store: Store, run_id: str, methods: dict[str, type[Method]] | None = None) -> list[dict]:
    """One dict per round that has a gate decision: what a person wants to see per round. Each method
    that ran in the round adds its figures under its name (`Method.round_metrics`, and its `assess`ment of the
    candidate from the gate step). `methods`: the classes by name (methods.method_classes(cfg), so that a method
    of the user's own is found; default: the registered ones); a name that is neither, e.g. a plugin the config
    no longer names, shows its figures as stored (the base Method's) and no report section."""
    methods = method_classes() if methods is None else methods
    out = []
    for d in store.promotion_history(run_id):
        r = d["round"]
        gen = store.step_trajectories(run_id, r, "generate")
        counts = group_counts(group_stats(gen)) if gen else {}
        tm = store.train_metrics(d["candidate_id"])
        per_method = {}
        for name, figures in (store.step_metrics(run_id, r, "distill") or {}).items():
            per_method[name] = methods.get(name, Method).round_metrics(figures, tm)
        gate_metrics = dict(store.step_metrics(run_id, r, "gate") or {})
        diagnostics = gate_metrics.pop("diagnostics", None)
        for name, figures in gate_metrics.items():   # Method.assess
            per_method[name] = {**(per_method.get(name) or {}), **figures}
        ev = d["evidence"] or {}
        heldout = ev.get("heldout") or {}
        out.append({
            "round": r,
            **per_method,
            "methods": list(per_method),
            "train_success": sum(bool(g["success"]) for g in gen) / len(gen) if gen else None,
            **{k: counts.get(k) for k in ("all_fail", "all_pass", "mixed")},
            "projected": store.projected_share(run_id, r),
            "examples": store.count_examples(run_id, r),
            "train_loss": tm.get("train_loss"),
            "champion_before": d["champion_id"],
            "champion_heldout": store.latest_heldout(run_id, d["champion_id"]),
            "candidate_heldout": store.latest_heldout(run_id, d["candidate_id"]),
            "decision": d["decision"],
            "rule": d["rule"],
            **{k: ev.get(k) for k in ("wins", "losses", "p_value", "metric", "detectable_gain")},
            "champion_sampled": _sampled(heldout.get("champion")),
            "candidate_sampled": _sampled(heldout.get("candidate")),
            "heldout_by_type": {role: {m: f["by_type"] for m, f in figures.items()}
                                for role, figures in heldout.items()},
            "paired": ev.get("paired"),
            "diagnostics": diagnostics,
            "logprob_change": tm.get("logprob_change"),
            "learning_rate": tm.get("learning_rate"),
            "replay": tm.get("replay"),
            "champion_after": d["new_champion_id"],
            "step_seconds": {step: round(s, 1) for step, s in store.step_seconds(run_id, r).items() if step in STEPS},
        })
    return out


def _sampled(figures: dict | None) -> dict | None:
    """A model's sampled held-out figures of one gate (`HeldoutPlays.summary`) in `latest_heldout`'s shape."""
    s = (figures or {}).get("sampled")
    if not s:
        return None
    return {"success_rate": s["rate"], "ci_low": s["ci"][0], "ci_high": s["ci"][1], "n": s["plays"],
            "successes": s["successes"], "tasks": s["n"]}


def _fmt(h: dict | None) -> str:
    if not h:
        return "-"
    return f"{h['success_rate']:.3f} [{h['ci_low']:.3f}, {h['ci_high']:.3f}] ({h['successes']}/{h['n']})"


def heldout_series(rows: list[dict], metric: str = "greedy") -> list[tuple[str, dict | None]]:
    """Held-out success of the serving model: the base, then the champion after each round. `metric` sampled:
    the sampled plays, each measured by the round's own gate (fresh plays every round)."""
    if not rows:
        return []
    key = "heldout" if metric == "greedy" else "sampled"
    series = [("base", rows[0][f"champion_{key}"])]
    for r in rows:
        after = r[f"candidate_{key}"] if r["decision"] == "promote" else r[f"champion_{key}"]
        series.append((f"round {r['round']}", after))
    return series


def _pct(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def markdown_table(run_id: str, rows: list[dict], methods: dict[str, type[Method]] | None = None) -> str:
    """The run report in markdown; `methods` as round_rows."""
    methods = method_classes() if methods is None else methods
    sampled = any(r.get("champion_sampled") for r in rows)
    lines = [f"# rsiflow run `{run_id}`", "",
             "| round | train success | groups fail/pass/mixed | projected actions | examples | train loss | "
             "champion held-out | candidate held-out | "
             + ("champion sampled | candidate sampled | " if sampled else "")
             + "decision | serving model | detectable gain | seconds |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if sampled else "") + "---|---|---|---|"]
    for r in rows:
        loss = f"{r['train_loss']:.3f}" if r["train_loss"] is not None else "-"
        ts = f"{r['train_success']:.3f}" if r["train_success"] is not None else "-"
        secs = sum(r["step_seconds"].values())
        proj = f"{r['projected']:.2f}" if r["projected"] is not None else "-"
        decision = r["decision"] + (f" ({r['metric']}, p {r['p_value']:.2g})" if r.get("p_value") is not None else "")
        gain = f"+{r['detectable_gain']:.3f}" if r.get("detectable_gain") is not None else "-"
        cells = (f"{_fmt(r['champion_sampled'])} | {_fmt(r['candidate_sampled'])} | " if sampled else "")
        lines.append(f"| {r['round']} | {ts} | {r['all_fail']}/{r['all_pass']}/{r['mixed']} | {proj} | "
                     f"{r['examples']} | {loss} | "
                     f"{_fmt(r['champion_heldout'])} | {_fmt(r['candidate_heldout'])} | {cells}{decision} | "
                     f"`{r['champion_after']}` | {gain} | {secs:.0f} |")
    lines += diagnostics_section(rows) + type_section(rows)
    for name in dict.fromkeys(m for r in rows for m in r.get("methods", [])):
        section = methods.get(name, Method).report_section(rows)
        if section:
            lines += ["", *section]
    lines += ["", "projected actions: share of generated actions that were not admissible and were replaced by the "
              "closest admissible one (`env.project_actions`). detectable gain: the smallest true gain the gate's "
              "paired test detects with 80% power at its size and level (from the spread of the round's per-task "
              "differences).", "",
              "Held-out success of the serving model (95% interval):", ""]
    for label, h in heldout_series(rows):
        lines.append(f"- {label}: {_fmt(h)}")
    if sampled:
        lines += ["", "Sampled (the training policy's temperature; a promoted candidate's figure is the one its "
                  "gate decided on: see the final test split for an unselected one):", ""]
        for label, h in heldout_series(rows, "sampled"):
            lines.append(f"- {label}: {_fmt(h)}")
    return "\n".join(lines) + "\n"


def diagnostics_section(rows: list[dict]) -> list[str]:
    """The learning diagnostics per round (tasks/diagnostics.py and the trainer's logprob change)."""
    have = [r for r in rows if r.get("diagnostics") or r.get("logprob_change")]
    if not have:
        return []
    lines = ["", "Learning diagnostics (candidate vs champion; never read by the gate):", "",
             "| round | lr | own train tasks sampled: cand / champ (p) | own train tasks greedy: cand / champ | "
             "Δ logprob trained tokens (+ / -) | KL(cand ‖ champ) per token | held-out greedy answers changed |",
             "|---|---|---|---|---|---|---|"]
    for r in have:
        d, lp = r.get("diagnostics") or {}, r.get("logprob_change") or {}
        tt, kl, ch = d.get("train_tasks") or {}, d.get("kl") or {}, d.get("heldout_changed") or {}
        own = (f"{_pct(tt.get('candidate_sampled'))} / {_pct(tt.get('champion_sampled'))} "
               f"(p {tt['sampled_p_value']:.2g})" if tt else "-")
        greedy = f"{_pct(tt.get('candidate_greedy'))} / {_pct(tt.get('champion_greedy'))}" if tt else "-"
        delta = " / ".join(f"{lp[k]['delta']:+.3f} ({lp[k]['rows']} rows)" if k in lp else "-"
                           for k in ("positive", "negative"))
        kls = f"{kl['mean']:.4f}" if kl.get("mean") is not None else "-"
        changed = f"{ch['changed']}/{ch['tasks']}" if ch else "-"
        lr = f"{r['learning_rate']:.0e}" if r.get("learning_rate") else "-"
        lines.append(f"| {r['round']} | {lr} | {own} | {greedy} | {delta} | {kls} | {changed} |")
    return lines


def type_section(rows: list[dict]) -> list[str]:
    """Held-out success per task type, per round: champion and candidate, greedy (and sampled)."""
    have = [r for r in rows if r.get("heldout_by_type")]
    if not have:
        return []
    types = sorted({t for r in have for figures in r["heldout_by_type"].values() for by in figures.values()
                    for t in by})
    if len(types) < 2:
        return []
    lines = ["", "Held-out success per task type (champion → candidate; greedy, then sampled where played):", "",
             "| round | " + " | ".join(types) + " |", "|---|" + "---|" * len(types)]
    for r in have:
        cells = []
        for t in types:
            parts = []
            for metric in ("greedy", "sampled"):
                champ = ((r["heldout_by_type"].get("champion") or {}).get(metric) or {}).get(t)
                cand = ((r["heldout_by_type"].get("candidate") or {}).get(metric) or {}).get(t)
                if champ:
                    parts.append(_pct(champ["rate"]) + (f" → {_pct(cand['rate'])}" if cand else ""))
            cells.append("; ".join(parts) or "-")
        lines.append(f"| {r['round']} | " + " | ".join(cells) + " |")
    return lines


def _short(h: dict | None) -> str:
    """'k/n [lo, hi]', or '' for no figure."""
    return f"{h['successes']}/{h['n']} [{h['ci_low']:.2f}, {h['ci_high']:.2f}]" if h else ""


def heldout_line(rows: list[dict], most: int = 8) -> str:
    """The held-out success of the serving model round after round, in one line (the first and the last
    `most` - 1 entries when there are more): 'base 0/24 [0.00, 0.14] → round 1 1/24 [0.01, 0.20] → ...'."""
    series = [f"{label} {_short(h) or '-'}" for label, h in heldout_series(rows)]
    if len(series) > most:
        series = [series[0], "…", *series[-(most - 1):]]
    return " → ".join(series)


NONE = "n/a"   # an empty cell of the Prefect table artifact (the UI renders a lone "-" as a list bullet)


def round_table(rows: list[dict]) -> list[dict]:
    """One row per round for the Prefect table artifact: held-out success with its interval, the decision with
    its paired evidence, the model that serves after the round, examples and wall time; short cells so the table
    fits the UI."""
    table = []
    for r in rows:
        paired = NONE if r.get("wins") is None else f"{r['wins']} / {r['losses']}"
        if r.get("p_value") is not None:
            paired += f" (p {r['p_value']:.2g})"
        table.append({"round": r["round"], "champion held-out": _short(r["champion_heldout"]) or NONE,
                      "candidate held-out": _short(r["candidate_heldout"]) or NONE,
                      "decision": f"{r['decision']} ({r['rule']})", "serving model": r["champion_after"] or NONE,
                      "wins / losses": paired, "examples": r["examples"],
                      "wall time": f"{sum(r['step_seconds'].values()):.0f} s"})
    return table


def history_markdown(run_id: str, rows: list[dict]) -> str:
    """The run's whole history, one line per round (never trimmed): decision, serving model, held-out success of
    the serving model. The run-level artifact, beside the per-round table."""
    if not rows:
        return f"# rsiflow run `{run_id}`: no round yet\n"
    series = dict(heldout_series(rows))
    lines = [f"# rsiflow run `{run_id}`: every round", "",
             f"- base `{rows[0]['champion_before']}`: held-out {_short(series['base']) or NONE}"]
    for r in rows:
        p = f", p {r['p_value']:.2g}" if r.get("p_value") is not None else ""
        served = _short(series[f"round {r['round']}"]) or NONE
        lines.append(f"- round {r['round']}: {r['decision']} ({r['rule']}{p}); `{r['champion_after']}` serves; "
                     f"held-out {served}")
    return "\n".join(lines) + "\n"


def promotion_points(rows: list[dict], series: list[tuple[str, dict]]) -> list[tuple[int, float]]:
    """(x, held-out success) of the plot's points where a round promoted its candidate."""
    promoted = {f"round {r['round']}" for r in rows if r["decision"] == "promote"}
    return [(x, h["success_rate"]) for x, (label, h) in enumerate(series) if label in promoted]


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
        marks = promotion_points(rows, series)
        if marks:
            ax.scatter([m[0] for m in marks], [m[1] for m in marks], marker="*", s=180, color="tab:green", zorder=3,
                       label="promoted: a new champion serves")
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


def write_report(store: Store, run_id: str, folder: Path, rows: list[dict] | None = None,
                 methods: dict[str, type[Method]] | None = None) -> tuple[Path, Path, str]:
    """Write report.md and heldout.png into `folder` (from `rows`, default: `round_rows` read now); return
    their paths and the markdown. `methods`: as round_rows."""
    rows = round_rows(store, run_id, methods) if rows is None else rows
    md = markdown_table(run_id, rows, methods)
    folder.mkdir(parents=True, exist_ok=True)
    md_path = folder / "report.md"
    md_path.write_text(md)
    png = plot_png(run_id, rows, folder / "heldout.png")
    return md_path, png, md


def png_data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
