#!/usr/bin/env bash
# A default household round (configs/default.yaml, its first round) before and after issue 25's performance work,
# on one quiet machine in one invocation: the code of $OLD (default 62a44c2, where the issue's figures were taken)
# against this checkout (its defaults: packed Linear layers; since 2026-12-07 rollouts in bfloat16 where the CPU runs
# it natively, `backend.hf.dtype: auto`, the gate still in float32, and the shared prefix attended apart in the bf16
# rollouts), this checkout without the last (`backend.hf.shared_prefix_attention=false`) and with float32 rollouts
# (`backend.hf.dtype=float32`), interleaved and each set twice: this machine's speed drifts by 10-20% within an
# hour, so compare within a pair. (Earlier outputs ran other variants: packed_linears=false, sampler=nucleus, bf16
# rollouts and gate; see git history.) Each `python -m bench.round` prints where its round's wall time went; all of
# it goes to output-<date>-<HHMM>.txt here. The old code runs from a temporary export with a copy of this
# checkout's .venv (its editable install re-pointed), removed at the end (~2.3 GB while it runs). Run it on a quiet
# machine: ~30 minutes.
#
# SEED=S runs every round with `--set run.seed=S` (default: the config's seed), and ONLY_DEFAULT=1 runs the old code
# and this checkout's default only: a round that draws a success trains and gates a candidate (several times the
# work), so an equal-work comparison needs a seed on which neither code's first round draws one (see
# docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the repository root
ROOT=$PWD OLD=${OLD:-62a44c2}
SEED_SET=() && [ -n "${SEED:-}" ] && SEED_SET=(--set "run.seed=$SEED")
out=bench/results/round/output-$(date +%F-%H%M)${SEED:+-seed$SEED}.txt
tmp=$(mktemp -d /tmp/rsiflow-round-XXXX)
trap 'rm -rf "$tmp"' EXIT
git archive "$OLD" | tar -x -C "$tmp" && cp -a .venv "$tmp/.venv"
sed -i "s|$ROOT|$tmp|g" "$tmp"/.venv/lib/python*/site-packages/__editable___rsiflow_*_finder.py
export PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
{
  for pass in 1 2; do
    echo "== pass $pass: $OLD: python -m bench.round (configs/default.yaml) ${SEED_SET[*]}"
    (cd "$tmp" && PREFECT_HOME="$tmp/prefect-old" .venv/bin/python -m bench.round "${SEED_SET[@]}")
    echo "== pass $pass: $(git rev-parse --short HEAD): python -m bench.round ${SEED_SET[*]}"
    PREFECT_HOME="$tmp/prefect-new" .venv/bin/python -m bench.round "${SEED_SET[@]}"
    [ -n "${ONLY_DEFAULT:-}" ] && continue
    echo "== pass $pass: $(git rev-parse --short HEAD): python -m bench.round ${SEED_SET[*]} --set backend.hf.shared_prefix_attention=false"
    PREFECT_HOME="$tmp/prefect-nospa" .venv/bin/python -m bench.round "${SEED_SET[@]}" \
      --set backend.hf.shared_prefix_attention=false
    echo "== pass $pass: $(git rev-parse --short HEAD): python -m bench.round ${SEED_SET[*]} --set backend.hf.dtype=float32"
    PREFECT_HOME="$tmp/prefect-fp32" .venv/bin/python -m bench.round "${SEED_SET[@]}" --set backend.hf.dtype=float32
  done
} 2>&1 | grep -v "it/s\]\|turn/s\]\|s/turn\]\|Loading weights" | tee "$out"
