#!/usr/bin/env bash
# Issue 22's check on the default env: the arm that learned best on arithmetic level 2 (ExIt, with the replay
# buffer, the sampled paired-test gate and a final test split no decision reads), on household with the recipe
# of configs/household-learn.yaml, 3 seeds x 5 rounds, each seed its own held-out and test tasks. Resumes:
# run it again after a stop and it continues from the last completed step of the same checkout (its store); a
# fresh checkout keeps only finished runs (records/), so give a seed (~2.5-3 hours on 2 cores) a session of its
# own: `SEEDS=0 bash command.sh`, then SEEDS=1, then SEEDS=2.
cd "$(dirname "$0")/../../.."   # the repository root
export PREFECT_HOME=${PREFECT_HOME:-/tmp/cmp-prefect} PREFECT_SERVER_ANALYTICS_ENABLED=false
exec ${PYTHON:-.venv/bin/python} -m bench.compare --config configs/household-learn.yaml \
  --arm "exit:distill.methods=[exit]" \
  --seeds "${SEEDS:-0,1,2}" --rounds 5 --heldout-per-seed --out bench/results/learning-household
