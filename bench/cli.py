"""Command-line options the model benches share: which model, and where its embedded checkpoint is unpacked."""

from __future__ import annotations

import argparse
from pathlib import Path

from rsiflow.models.loading import resolve_base_model


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """--model (a Hub-style id, a folder or `embedded:<name>`) and --cache (where an embedded model is unpacked)."""
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--cache", default="~/.cache/rsiflow")


def model_path(args: argparse.Namespace) -> Path:
    """The checkpoint folder --model names (an embedded model unpacked under --cache first)."""
    return resolve_base_model(args.model, Path(args.cache).expanduser())
