#!/usr/bin/env bash
# A default household round (configs/default.yaml, its first round) before and after issue 25's performance work,
# on one quiet machine in one invocation: the code of $OLD (default 62a44c2, where the issue's figures were taken)
# against this checkout (its defaults: packed Linear layers), this checkout with PyTorch's own Linear layers
# (`backend.hf.packed_linears: false`), and with `backend.hf.sampler: nucleus`. (Until 2026-12-06 09:57 the last two
# runs were bf16 rollouts, and bf16 rollouts with the gate in bf16: see git history and the outputs of those dates.)
# Each `python -m bench.round` prints where its round's wall time went; all of it goes to output-<date>.txt here.
# The old code runs from a temporary export with a copy of this checkout's .venv (its editable install re-pointed),
# removed at the end (~2.3 GB while it runs). Run it on a quiet machine: ~15-20 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
ROOT=$PWD OLD=${OLD:-62a44c2}
out=bench/results/round/output-$(date +%F-%H%M).txt
tmp=$(mktemp -d /tmp/rsiflow-round-XXXX)
trap 'rm -rf "$tmp"' EXIT
git archive "$OLD" | tar -x -C "$tmp" && cp -a .venv "$tmp/.venv"
sed -i "s|$ROOT|$tmp|g" "$tmp"/.venv/lib/python*/site-packages/__editable___rsiflow_*_finder.py
export PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
{
  echo "== $OLD: python -m bench.round (configs/default.yaml)"
  (cd "$tmp" && PREFECT_HOME="$tmp/prefect-old" .venv/bin/python -m bench.round)
  echo "== $(git rev-parse --short HEAD): python -m bench.round"
  PREFECT_HOME="$tmp/prefect-new" .venv/bin/python -m bench.round
  echo "== $(git rev-parse --short HEAD): python -m bench.round --set backend.hf.packed_linears=false"
  PREFECT_HOME="$tmp/prefect-unpacked" .venv/bin/python -m bench.round --set backend.hf.packed_linears=false
  echo "== $(git rev-parse --short HEAD): python -m bench.round --set backend.hf.sampler=nucleus"
  PREFECT_HOME="$tmp/prefect-nucleus" .venv/bin/python -m bench.round --set backend.hf.sampler=nucleus
} 2>&1 | grep -v "it/s\]\|turn/s\]\|s/turn\]\|Loading weights" | tee "$out"
