#!/usr/bin/env bash
# Issue 25's check that the gate may play in bfloat16 (`gate.dtype: sampler`): the same held-out tasks played in
# float32 and bfloat16 by the base and by a trained candidate, and the gate's decisions in each (bench/gate_dtype.py).
# 1. arithmetic (configs/learn.yaml, the README's first command): one round trains the candidate (the README's round
#    1: 25 verified answers, promoted), then 192 held-out tasks (four gates of 48), greedy and 4 sampled plays a task;
# 2. household (configs/default.yaml, the default round's gate): the base on 96 tasks, greedy, as that gate plays.
# Output in output-<date>.txt here (JSON beside it). Run it on a quiet machine: ~25 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
OUT=bench/results/gate-dtype PY=${PYTHON:-.venv/bin/python}
tmp=$(mktemp -d /tmp/rsiflow-gate-dtype-XXXX)
trap 'rm -rf "$tmp"' EXIT
export PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false PREFECT_HOME=$tmp/prefect
out=$OUT/output-$(date +%F).txt
{
  echo "== rsiflow run --config configs/learn.yaml, round 1 only (the candidate)"
  "$PY" -m rsiflow.flows.cli run --config configs/learn.yaml --set run.rounds=1 --set gate.test_tasks=0 \
    --set run.store="$tmp/learn.duckdb" --set run.run_dir="$tmp/run" 2>&1 | grep "round 1 gate:\|round 1 train:"
  echo "== $(git rev-parse --short HEAD): python -m bench.gate_dtype (arithmetic, base and round 1's candidate)"
  "$PY" -m bench.gate_dtype --config configs/learn.yaml --candidate "$tmp/run/models/round-1-candidate" \
    --tasks 192 --samples 4 --out "$OUT/arithmetic.json"
  echo "== $(git rev-parse --short HEAD): python -m bench.gate_dtype (household, the default config's base)"
  "$PY" -m bench.gate_dtype --config configs/default.yaml --tasks 96 --out "$OUT/household.json"
} 2>&1 | grep -v "it/s\]\|turn/s\]\|s/turn\]\|Loading weights" | tee "$out"
