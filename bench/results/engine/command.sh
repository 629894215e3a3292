#!/usr/bin/env bash
# The rollout engine against this machine's limits, quiet, both cores (bench/engine.py): 16 household episodes x 6
# turns in float32 and with bfloat16 sampling, then 48 episodes at the default decoding batch (16) and at 48.
# Each run prints prefill and decoding apart, each against its own roof. Writes output-<date>.txt here (~12 min).
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
out=bench/results/engine/output-$(date +%F-%H%M).txt
{
  for args in "--dtype float32" "--dtype bfloat16" "--episodes 48 --batch 16" "--episodes 48 --batch 48"; do
    echo "== python -m bench.engine --kv-reuse --no-baseline $args"
    # shellcheck disable=SC2086
    .venv/bin/python -m bench.engine --kv-reuse --no-baseline $args
  done
} 2>&1 | grep -v "Loading weights\|Warning" | tee "$out"
