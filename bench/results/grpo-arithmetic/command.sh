#!/usr/bin/env bash
# ExIt vs GRPO vs GRPO+SRD on arithmetic levels 1-3 (issue 10): 3 seeds x 3 rounds, same rollout budget.
# Resumes: run it again and complete (arm, seed) runs are skipped.
cd "$(dirname "$0")/../../.."   # the repository root
export PREFECT_HOME=${PREFECT_HOME:-/tmp/cmp-prefect} PREFECT_SERVER_ANALYTICS_ENABLED=false
exec .venv/bin/python -m bench.compare --config configs/arithmetic.yaml \
  --arm "exit:distill.methods=[exit]" \
  --arm "grpo:distill.methods=[grpo],distill.grpo.passes=2,distill.grpo.epsilon_high=0.28" \
  --arm "grpo-srd:distill.methods=[grpo,srd],distill.grpo.passes=2,distill.grpo.epsilon_high=0.28,distill.srd.notes_per_group=1,distill.srd.note_max_tokens=64,distill.srd.foresight_max_tokens=48" \
  --set "env.kwargs={levels: [level1, level2, level3], max_steps: 2}" \
  --set generate.tasks_per_round=8 --set gate.heldout_tasks=24 \
  --seeds 0,1,2 --rounds 3 --out bench/results/grpo-arithmetic
