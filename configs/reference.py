"""The configuration reference (docs/configuration.md), generated from the schema's field descriptions.

    python -m rsiflow.configs.reference            # rewrite docs/configuration.md
    python -m rsiflow.configs.reference --check    # exit 1 if docs/configuration.md is not what the schema says

Every key of the run config, its default and its help text, in the order of the schema: the page a user
reads to find a key, and the one place a new option is documented (its `Field(description=...)`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import BaseModel

from rsiflow.configs.schema import Config, DistillConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

HEADER = """# Configuration reference

One pydantic tree (`configs/schema.py`), loaded from YAML files and overrides (`configs/loader.py`):
`rsiflow run --config base.yaml --config overlay.yaml --set train.learning_rate=1e-5`. Later files and
overrides win key by key. An unknown key, a wrong type or a missing file is an error that names the key
path and the file (or `--set` override) that set it.

This page is generated from the schema's help texts (`python -m rsiflow.configs.reference`); a test fails when it
is out of date.
"""


def config_reference(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key path, default, description) for every field: the README's config reference."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(config_reference(ann, path + "."))
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((path, repr(default), field.description or ""))
    if issubclass(model, DistillConfig):   # each registered method's own section
        for name, section in DistillConfig().sections().items():
            rows.extend(config_reference(type(section), f"{prefix}{name}."))
    return rows


def markdown() -> str:
    lines = [HEADER]
    section = None
    for path, default, description in config_reference(Config):
        top = path.split(".")[0]
        if top != section:
            section = top
            title = Config.model_fields[top].description or ""
            lines += ["", f"## `{top}`", "", title, "", "| key | default | what it does |", "|---|---|---|"]
        text = " ".join(description.split()).replace("|", "\\|")
        lines.append(f"| `{path}` | `{default}` | {text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsiflow.configs.reference", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if the page is out of date instead of writing it")
    args = ap.parse_args(argv)
    text = markdown()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python -m rsiflow.configs.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
