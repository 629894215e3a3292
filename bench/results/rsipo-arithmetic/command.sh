#!/usr/bin/env bash
# The arithmetic half of ../rsipo-household/command.sh on its own (same arms and settings; see the comments there):
# GRPO vs GRPO + RSIPO on arithmetic levels 1-3, SmolLM2-135M, 3 seeds x 3 rounds, the replays counted in the budget.
# As run (session of 2026-12-02, code 4821f21): 5,485 s on a shared 2-core machine. Resumes: run it again.
cd "${REPO:-$(dirname "$0")/../../..}"
PY=${PY:-.venv/bin/python}
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-rsipo-prefect-a $PY -m bench.compare --config configs/arithmetic.yaml \
  --arm "grpo:distill.methods=[grpo],generate.tasks_per_round=8,$GRPO" \
  --arm "grpo-rsipo:distill.methods=[grpo,rsipo],generate.tasks_per_round=4,distill.rsipo.replays=2,distill.rsipo.library_candidates=1,$GRPO" \
  --set "env.kwargs={levels: [level1, level2, level3], max_steps: 2}" --set generate.group_size=4 \
  --set gate.heldout_tasks=24 --set distill.rsipo.assess_tasks=24 --seeds 0,1,2 --rounds 3 \
  --out "${OUT_A:-bench/results/rsipo-arithmetic}"
