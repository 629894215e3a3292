#!/usr/bin/env bash
# Issue 22's check on the default env: the arm that learned best on arithmetic level 2 (ExIt, with the replay
# buffer, the sampled paired-test gate and a final test split no decision reads), on household with the recipe
# of configs/household-learn.yaml, 3 seeds x 5 rounds, each seed its own held-out and test tasks. Resumes:
# run it again after a stop and it continues from the last completed step of the same checkout (its store). On a
# fresh checkout it continues from the last round a pack holds (--pack: <out>/packs/<run>.duckdb.gz, rewritten as
# each round completes; commit them): the round that was in progress starts again.
#
# PARALLEL=1 SEEDS=1,2 bash command.sh: the seeds at once, each on one thread (run.threads=1) in its own folder
# part-s<seed>/ (DuckDB takes one writer a store), then merged into this folder's store and report. Two one-thread
# runs on the 2 cores finish about 1.6x sooner than the same runs one after another on both cores; run it again
# after a stop, as above. THREADS=2 (with PARALLEL=1) gives each seed that many threads instead, e.g. for the last
# seed left running: on this machine the model's logits, sampled tokens and gradients are bit-identical at 1 and 2
# threads (checked 2026-12-06), so a seed's figures do not depend on it.
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
export PREFECT_SERVER_ANALYTICS_ENABLED=false
PY=${PYTHON:-.venv/bin/python} OUT=bench/results/learning-household
common=(--config configs/household-learn.yaml --arm "exit:distill.methods=[exit]" --rounds 5 --heldout-per-seed --pack)
if [[ ${PARALLEL:-0} == 1 ]]; then
  seeds=(${SEEDS//,/ }) merge=() pids=()
  for s in "${seeds[@]}"; do
    PREFECT_HOME=/tmp/cmp-prefect-s$s "$PY" -m bench.compare "${common[@]}" --seeds "$s" --set run.threads="${THREADS:-1}" \
      --out "$OUT/part-s$s" > "/tmp/learning-household-s$s.out" 2>&1 &
    pids+=($!) merge+=(--merge "$OUT/part-s$s")
  done
  trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' INT TERM
  status=0
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  ((status == 0)) || { echo "a seed's run stopped early: its log is in $OUT/part-s<seed>/logs; run again to resume"; exit 1; }
  exec "$PY" -m bench.compare "${common[@]}" --seeds 0,1,2 --out "$OUT" --report-only "${merge[@]}"
fi
export PREFECT_HOME=${PREFECT_HOME:-/tmp/cmp-prefect}
exec "$PY" -m bench.compare "${common[@]}" --seeds "${SEEDS:-0,1,2}" --out "$OUT"
