#!/usr/bin/env bash
# The gate's KL diagnostic before and after it encoded the shared prompt prefix once and projected only labelled
# positions (bench/diagnostics.py): 24 household conversations of the scripted expert (diagnostics.kl_tasks'
# default), one model, float32, both paths in one process. Writes output-<date>.txt here (~3 min on 2 quiet cores).
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
.venv/bin/python -m bench.diagnostics 2>&1 | grep -v "Loading weights" | tee "bench/results/diagnostics/output-$(date +%F).txt"
