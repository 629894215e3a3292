#!/usr/bin/env bash
# MASS vs the single-agent control on arithmetic levels 1-3 (issue 14): SmolLM2-135M, 3 seeds x 2 cycles, from
# configs/mass.yaml. Both arms search nothing different but the teacher: `mass` trains on the best-ranked answers of
# its retained multi-agent workflow (none when no version beats the bare task), `single` on the best-ranked bare
# answers, ranked by the same self-judge and tournament; both under the same answer-token budget (max_train_tokens),
# so the single-agent student gets as many training tokens as it can fill up to the multi-agent one's maximum.
# Per round the table gets every rounds.metrics.mass figure: win rate vs the base (self-judged and by the verifier,
# with intervals), judge-verifier agreement, tokens, score per 1k tokens, trained answer tokens.
# Two processes (one per arm, OMP_NUM_THREADS=1 each on the 2-core CPU), merged at the end. Resumes: run it again.
# Expected wall time (an estimate from the call counts, not measured: the one real-model check so far ran on a
# machine at load 7-9 and decoded 0.9 tok/s): ~8 min per cycle per process on 2 quiet cores -> 3 seeds x 2 cycles
# ~ 50 min per arm, both arms in parallel ~ 1-1.5 h; several times that on a shared machine.
cd "${REPO:-$(dirname "$0")/../../..}"
COMMON=(--config configs/mass.yaml --seeds 0,1,2 --rounds 2 --set distill.mass.max_train_tokens=200 --set distill.mass.train_top=2)
OUT=${OUT:-bench/results/mass-arithmetic}
PY=${PY:-.venv/bin/python}
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-mass-prefect-a $PY -m bench.compare "${COMMON[@]}" \
  --arm "mass:distill.mass.teacher=workflow" --out "$OUT-mass" &
PREFECT_HOME=/tmp/cmp-mass-prefect-b $PY -m bench.compare "${COMMON[@]}" \
  --arm "single:distill.mass.teacher=single_agent" --out "$OUT-single" &
wait
$PY -m bench.compare --out "$OUT" --report-only --merge "$OUT-mass" --merge "$OUT-single" \
  --arm mass --arm single --seeds 0,1,2
