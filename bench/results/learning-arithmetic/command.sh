#!/usr/bin/env bash
# Issue 22's comparison: ExIt vs GRPO vs GRPO+SRD on arithmetic level2 (the family the headroom survey chose),
# the new defaults (configs/arithmetic-level2.yaml: 32 tasks x 8 rollouts a round, sampled gate 64 tasks x 4
# plays, final test split 100 tasks), 3 seeds x 5 rounds, each seed its own held-out and test tasks. The same
# rollout budget in every arm. GRPO at lr 5e-6, one pass (the pilot at TRL's 1e-6 moved the trained tokens'
# logprobs by +-0.02 and the sampled held-out success by +0.04, p = 0.11, in a round). Resumes.
cd "$(dirname "$0")/../../.."   # the repository root
export PREFECT_HOME=${PREFECT_HOME:-/tmp/cmp-prefect} PREFECT_SERVER_ANALYTICS_ENABLED=false
G="distill.grpo.passes=1,distill.grpo.epsilon_high=0.28,train.learning_rate=5e-6"
exec ${PYTHON:-.venv/bin/python} -m bench.compare --config configs/arithmetic-level2.yaml \
  --arm "exit:distill.methods=[exit]" \
  --arm "grpo:distill.methods=[grpo],$G" \
  --arm "grpo-srd:distill.methods=[grpo,srd],$G,distill.srd.notes_per_group=1,distill.srd.note_max_tokens=64,distill.srd.foresight_max_tokens=48" \
  --seeds 0,1,2 --rounds 5 --heldout-per-seed --out bench/results/learning-arithmetic
