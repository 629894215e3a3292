#!/usr/bin/env bash
# One seed of the two GRPO arms in its own process and out folder (merged by command.sh's last line with
# --merge "$OUT-grpo-s<seed>"); the same settings as command.sh.
SEED=$1
cd "${REPO:-$(dirname "$0")/../../..}"
COMMON=(--config configs/default.yaml --seeds "$SEED" --rounds 3 --set generate.tasks_per_round=8
  --set generate.group_size=4 --set env.max_turns=6 --set gate.heldout_tasks=16 --set train.epochs=2)
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
OUT=${OUT:-bench/results/xtree-household}
PY=${PY:-.venv/bin/python}
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-xtree-prefect-s$SEED exec $PY -m bench.compare "${COMMON[@]}" \
  --arm "grpo:distill.methods=[grpo],$GRPO" \
  --arm "grpo-xtree:distill.methods=[xtree,grpo],distill.xtree.bonus=true,$GRPO" --out "$OUT-grpo-s$SEED"
