#!/usr/bin/env bash
# GRPO vs GRPO + X-Tree bonus on arithmetic levels 1-3 (a base that succeeds about half the time: the bonus should
# vanish in mixed groups, lambda_g = lambda0 * (1 - win rate)). The settings of bench/results/grpo-arithmetic's GRPO
# arm (8 tasks x 4 rollouts a round, 24 held-out tasks), 3 seeds x 3 rounds. Two processes, one per arm
# (OMP_NUM_THREADS=1 each), merged at the end. Resumes: run it again and complete (arm, seed) runs are skipped.
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${REPO:-$HERE/../../..}"
COMMON=(--config configs/arithmetic.yaml --seeds 0,1,2 --rounds 3
  --set "env.kwargs={levels: [level1, level2, level3], max_steps: 2}"
  --set generate.tasks_per_round=8 --set gate.heldout_tasks=24)
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
OUT=${OUT:-bench/results/xtree-arithmetic}
PY=${PY:-.venv/bin/python}
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-xa-prefect-a $PY -m bench.compare "${COMMON[@]}" \
  --arm "grpo:distill.methods=[grpo],$GRPO" --out "$OUT-grpo" &
PREFECT_HOME=/tmp/cmp-xa-prefect-b $PY -m bench.compare "${COMMON[@]}" \
  --arm "grpo-xtree:distill.methods=[xtree,grpo],distill.xtree.bonus=true,$GRPO" --out "$OUT-xtree" &
wait
$PY -m bench.compare --out "$OUT" --report-only --merge "$OUT-grpo" --merge "$OUT-xtree" \
  --arm grpo --arm grpo-xtree --seeds 0,1,2
