#!/usr/bin/env bash
# RSIPO with the template skill writer (skills from canonical actions, no ids: the named stand-in for small models)
# on arithmetic levels 1-3, the same settings as ../rsipo-arithmetic/command.sh, merged with that comparison's two
# arms (GRPO, GRPO + RSIPO with the policy writer) into one table. As run: session of 2026-12-02, code 969d529 (the
# other two arms: 4821f21; the changes between are refactors with the same training rows). Resumes: run it again.
# The merge reads ../rsipo-arithmetic/compare.duckdb (stores are not committed: run that command.sh first).
cd "${REPO:-$(dirname "$0")/../../..}"
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/rsipo-arithmetic-template}
GRPO="distill.grpo.passes=2,distill.grpo.epsilon_high=0.28"
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1
PREFECT_HOME=/tmp/cmp-rsipo-prefect-t $PY -m bench.compare --config configs/arithmetic.yaml \
  --arm "grpo-rsipo-template:distill.methods=[grpo,rsipo],generate.tasks_per_round=4,distill.rsipo.replays=2,distill.rsipo.library_candidates=1,distill.rsipo.skill_writer=template,$GRPO" \
  --set "env.kwargs={levels: [level1, level2, level3], max_steps: 2}" --set generate.group_size=4 \
  --set gate.heldout_tasks=24 --set distill.rsipo.assess_tasks=24 --seeds 0,1,2 --rounds 3 --out "$OUT-runs"
$PY -m bench.compare --report-only --merge "${OUT_A:-bench/results/rsipo-arithmetic}" --merge "$OUT-runs" \
  --arm grpo --arm grpo-rsipo --arm grpo-rsipo-template --seeds 0,1,2 --out "$OUT"
