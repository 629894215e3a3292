#!/usr/bin/env bash
# backend.hf.packed_linears on and off, greedy and seeded sampled, 16 household episodes x 6 turns (SmolLM2-135M,
# float32, both cores): python -m bench.packed. Run it on a quiet machine (~2.5 minutes).
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/python -m bench.packed "$@" 2>&1 | grep -v "Loading weights" | tee "bench/results/packed/output-$(date +%F).txt"
