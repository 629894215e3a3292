"""Model cards: the README.md rsiflow writes into every checkpoint folder it makes, so a folder opened on its own
(or loaded with `from_pretrained`) says where it came from.

The facts live in the card's YAML front matter under `rsiflow:` (read them back with `read_model_card`, with
`yaml`, or with `huggingface_hub.ModelCard.load(folder).data.rsiflow`); the text below it renders them for a
person. A candidate's card is written when it is trained and updated with the gate's evidence after its gate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CARD = "README.md"


def render_model_card(facts: dict[str, Any]) -> str:
    """The card's text: front matter (library, tags, the facts under `rsiflow`) and a table of the facts."""
    tags = ["rsiflow", *(f"rsiflow-{m}" for m in facts.get("methods", []))]
    front = yaml.safe_dump({"library_name": "transformers", "tags": tags, "rsiflow": facts}, sort_keys=False,
                           allow_unicode=True)
    title = facts.get("model_id") or facts.get("name") or "rsiflow checkpoint"
    lines = ["---", front.rstrip(), "---", "", f"# {title}", ""]
    if facts.get("parent_id"):
        lines += [f"A candidate trained by rsiflow in round {facts['round']} of run `{facts['run']}` from "
                  f"`{facts['parent_id']}`.", ""]
    elif facts.get("source"):
        lines += [facts["source"], ""]
    rows = []
    if facts.get("parent_id"):
        rows.append(("parent", f"`{facts['parent_id']}` (`{facts.get('parent_path', '?')}`)"))
    if facts.get("methods"):
        rows.append(("methods", ", ".join(facts["methods"])))
    if facts.get("examples"):
        rows.append(("training examples", ", ".join(f"{m} {n}" for m, n in facts["examples"].items())
                     + (f"; {facts['trained_rows']} rows trained on" if "trained_rows" in facts else "")))
    if facts.get("training"):
        rows.append(("training", _training(facts["training"])))
    if facts.get("parent_id"):
        rows.append(("gate", _gate(facts.get("gate"))))
    if facts.get("created"):
        rows.append(("written", f"{facts['created']} UTC"))
    if rows:
        lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]
    if facts.get("model_id") and facts.get("run"):
        lines += ["Its lineage in the run's store (DuckDB):", "", "```sql",
                  f"SELECT * FROM models WHERE model_id = '{facts['model_id']}';",
                  f"SELECT * FROM gate_decisions WHERE candidate_id = '{facts['model_id']}';", "```", ""]
    return "\n".join(lines)


def _training(t: dict) -> str:
    out = f"{t.get('steps', 0)} steps"
    if t.get("first_loss") is not None and t.get("last_loss") is not None:
        out += f", loss {t['first_loss']:.3f} → {t['last_loss']:.3f}"
    if t.get("train_loss") is not None:
        out += f" (mean {t['train_loss']:.3f})"
    if t.get("learning_rate") is not None:
        out += f", lr {t['learning_rate']:g}"
    if t.get("epochs") is not None:
        out += f", {t['epochs']:g} epoch(s)"
    if t.get("lora"):
        out += ", LoRA (merged)"
    return out


def _gate(g: dict | None) -> str:
    if not g:
        return "not gated yet"
    out = f"**{g['decision']}** in round {g['round']} (rule {g['rule']})"
    if g.get("candidate") is not None:
        out += (f": candidate {g['candidate']} vs champion {g['champion']} on the same {g['n']} held-out tasks, "
                f"{g['wins']} wins, {g['losses']} losses")
        if g.get("p_value") is not None:
            out += f", p = {g['p_value']:.3g}"
    return out


def write_model_card(folder: str | Path, facts: dict[str, Any]) -> Path:
    """Write `folder`/README.md from `facts` (replacing any card there); return its path."""
    path = Path(folder) / CARD
    path.write_text(render_model_card(facts))
    return path


def read_model_card(folder: str | Path) -> dict[str, Any]:
    """The `rsiflow` facts of `folder`'s card ({} if it has no card rsiflow wrote)."""
    path = Path(folder) / CARD
    if not path.is_file():
        return {}
    text = path.read_text()
    if not text.startswith("---\n"):
        return {}
    front = yaml.safe_load(text[4:text.index("\n---", 4)]) or {}
    return front.get("rsiflow") or {}


def update_model_card(folder: str | Path, **facts: Any) -> Path:
    """Set some facts of `folder`'s card (e.g. `gate=...`) and write it again."""
    return write_model_card(folder, {**read_model_card(folder), **facts})
