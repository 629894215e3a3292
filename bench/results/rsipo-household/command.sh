#!/usr/bin/env bash
# GRPO vs GRPO + RSIPO (issue 13), SmolLM2-135M, 3 seeds x 3 rounds, on household and on arithmetic levels 1-3 (a
# family where the base is not ~0: 36/72 = 0.500 held-out in bench/results/grpo-arithmetic).
#
# Same rollout budget, replays counted: the GRPO arm plays 8 tasks x 4 rollouts = 32 episodes a round; the RSIPO arm
# plays 4 tasks x 4 rollouts = 16 (same group size, so GRPO's group statistics are alike) plus M = 2 replays per skill
# tested, at most 2 skills per task (the new one and one library match of its type): at most 4 x 2 x 2 = 16 replays,
# so at most 32 episodes a round (round 1 has no library yet: 24). The table's "train success" counts the generate
# step's episodes only; the column rsipo.replays gives the replays of each round, rsipo.library_size the active
# library skills after it, rsipo.mean_shrunk_gain the mean shrunk gain of its tests, rsipo.library_mean_shrunk_gain
# that of the library's active skills; rsipo.assess_bare / rsipo.assess_with_skill the candidate's held-out successes
# without and with the library's best skill in its prompt (on rsipo.assess_tasks tasks; the gate decides bare).
#
# Two processes (one per family, OMP_NUM_THREADS=1 each on the 2-core CPU), each comparing its two arms. Resumes:
# run it again and complete (arm, seed) runs are skipped. Expected wall time on a quiet 2-core machine: 3-4 h
# (household ~450-550 s a round, arithmetic ~250-400 s a round, 18 rounds per family).
cd "${REPO:-$(dirname "$0")/../../..}"
PY=${PY:-.venv/bin/python}
OUT_H=${OUT_H:-bench/results/rsipo-household}
OUT_A=${OUT_A:-bench/results/rsipo-arithmetic}
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
ARMS=(--arm "grpo:distill.methods=[grpo],generate.tasks_per_round=8,$GRPO"
      --arm "grpo-rsipo:distill.methods=[grpo,rsipo],generate.tasks_per_round=4,distill.rsipo.replays=2,distill.rsipo.library_candidates=1,$GRPO")
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-rsipo-prefect-h $PY -m bench.compare --config configs/default.yaml "${ARMS[@]}" \
  --set generate.group_size=4 --set env.max_turns=6 --set gate.heldout_tasks=16 --set train.epochs=2 \
  --set distill.rsipo.assess_tasks=16 \
  --seeds 0,1,2 --rounds 3 --out "$OUT_H" &
PREFECT_HOME=/tmp/cmp-rsipo-prefect-a $PY -m bench.compare --config configs/arithmetic.yaml "${ARMS[@]}" \
  --set "env.kwargs={levels: [level1, level2, level3], max_steps: 2}" --set generate.group_size=4 \
  --set gate.heldout_tasks=24 --set distill.rsipo.assess_tasks=24 --seeds 0,1,2 --rounds 3 --out "$OUT_A" &
wait
