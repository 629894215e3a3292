#!/usr/bin/env bash
# Positive control (issue 22): arithmetic level2 with the few-shot turns off, where most of the base model's
# failures are format (sampled success 0.05 vs 0.22 with them). ExIt must move it in a round or two; if it
# does not, the loop has a bug whatever the methods do. 1 seed x 2 rounds. Resumes.
cd "$(dirname "$0")/../../.."   # the repository root
export PREFECT_HOME=${PREFECT_HOME:-/tmp/cmp-prefect} PREFECT_SERVER_ANALYTICS_ENABLED=false
exec ${PYTHON:-.venv/bin/python} -m bench.compare --config configs/arithmetic-level2.yaml \
  --arm "exit-no-few-shot:distill.methods=[exit],env.few_shot=false" \
  --set gate.test_tasks=100 --seeds 0 --rounds 2 --heldout-per-seed --out bench/results/learning-format-control
