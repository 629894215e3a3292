#!/usr/bin/env bash
# GRPO vs GRPO + X-Tree bonus vs ExIt + X-Tree token weights (vs ExIt), household, SmolLM2-135M, 3 seeds x 3 rounds,
# same rollout budget (8 tasks x 4 rollouts x <= 6 turns a round), 16 held-out tasks. Three processes (OMP_NUM_THREADS=1
# each; on the 2-core CPU two at a time is the most it pays to run): the ExIt pair, the GRPO pair's seeds 0-1, and its
# seed 2 (grpo-seed.sh), merged at the end. Resumes: run it again and complete (arm, seed) runs are skipped.
# As run (sessions of 2026-12-01/02, code d9778e2): the same commands, the GRPO pair's seed 2 split off when resuming.
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "${REPO:-$HERE/../../..}"
COMMON=(--config configs/default.yaml --rounds 3 --set generate.tasks_per_round=8
  --set generate.group_size=4 --set env.max_turns=6 --set gate.heldout_tasks=16 --set train.epochs=2)
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
OUT=${OUT:-bench/results/xtree-household}
PY=${PY:-.venv/bin/python}
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-xtree-prefect-a $PY -m bench.compare "${COMMON[@]}" --seeds 0,1 \
  --arm "grpo:distill.methods=[grpo],$GRPO" \
  --arm "grpo-xtree:distill.methods=[xtree,grpo],distill.xtree.bonus=true,$GRPO" --out "$OUT-grpo" &
PREFECT_HOME=/tmp/cmp-xtree-prefect-b $PY -m bench.compare "${COMMON[@]}" --seeds 0,1,2 \
  --arm "exit-xtree:distill.methods=[xtree,exit],distill.xtree.token_weights=true" \
  --arm "exit:distill.methods=[exit]" --out "$OUT-exit" &
wait
OUT=$OUT PY=$PY bash "$HERE/grpo-seed.sh" 2
$PY -m bench.compare --out "$OUT" --report-only --merge "$OUT-grpo" --merge "$OUT-grpo-s2" --merge "$OUT-exit" \
  --arm grpo --arm grpo-xtree --arm exit-xtree --arm exit --seeds 0,1,2
