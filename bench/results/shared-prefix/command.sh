#!/usr/bin/env bash
# `backend.hf.shared_prefix_attention` (the prefix all rows of a batch share attended once, outside the rows'
# caches) measured three ways, on a quiet machine (~20 minutes):
# 0. one layer's attention, prefix in every row against apart (python -m bench.shared_prefix), twice:
#    layer-<date>.txt;
# 1. the bf16 rollout engine (a default round's 48 household episodes x 6 turns, nucleus sampler) without and with
#    it, interleaved, twice: engine-<date>.txt;
# 2. float32 greedy plays of 96 held-out household tasks as the gate plays them, without and with it (forced on:
#    `auto` leaves it off in float32): do the greedy actions change, and what does it save there?
#    gate-float32-<date>.txt and gate-float32.json.
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
OUT=bench/results/shared-prefix
export PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
{
  echo "== $(git rev-parse --short HEAD): python -m bench.shared_prefix (twice, quiet)"
  .venv/bin/python -m bench.shared_prefix && .venv/bin/python -m bench.shared_prefix
} | tee "$OUT/layer-$(date +%F).txt"
for pass in 1 2; do
  for mode in off on; do
    echo "== pass $pass shared-prefix-attention $mode"
    .venv/bin/python -m bench.engine --kv-reuse --no-baseline --episodes 48 --dtype bfloat16 --sampler nucleus \
      --shared-prefix-attention $mode 2>&1 | grep -v 'it/s\]\|Loading'
  done
done | tee "$OUT/engine-$(date +%F).txt"
tmp=$(mktemp -d /tmp/rsiflow-spa-XXXX)
trap 'rm -rf "$tmp"' EXIT
{
  echo "== $(git rev-parse --short HEAD): python -m bench.gate_dtype --config configs/default.yaml --tasks 96 --key backend.hf.shared_prefix_attention --values false,true --set backend.hf.dtype=float32"
  PREFECT_HOME="$tmp/prefect" .venv/bin/python -m bench.gate_dtype --config configs/default.yaml --tasks 96 \
    --key backend.hf.shared_prefix_attention --values false,true --set backend.hf.dtype=float32 \
    --out "$OUT/gate-float32.json"
} 2>&1 | grep -v "it/s\]\|turn/s\]\|s/turn\]\|Loading weights" | tee "$OUT/gate-float32-$(date +%F).txt"
