#!/usr/bin/env bash
# The `small` workload on one GPU, end to end: pretrain the policy, train in-domain and
# out-of-domain EAGLE-3 heads on its own rollouts, then time speculative vs autoregressive
# rollouts and the tree-verification kernel. Results (JSON + logs) go to $RESULTS.
#   RESULTS=benchmarks bash benchmarks/small_workload.sh [stage ...]
# Stages: pretrain draft draft_ood verify spec (default: all, in that order). Intermediate
# checkpoints live under runs/ (not committed).
set -euo pipefail
RESULTS=${RESULTS:-benchmarks}
DRAFT_STEPS=${DRAFT_STEPS:-400}
mkdir -p "$RESULTS" runs
jaxspec() { python3 -m jaxspec.cli "$@"; }
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(pretrain draft draft_ood verify spec)
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    pretrain)
      jaxspec pretrain --config configs/small.yaml --run-dir runs/small train.progress=false 2>&1 \
        | tee "$RESULTS/pretrain_small.log" ;;
    draft)
      jaxspec draft train --config configs/draft_small.yaml --run-dir runs/draft-small \
        train.steps="$DRAFT_STEPS" 2>&1 | tee "$RESULTS/draft_small.log" ;;
    draft_ood)
      jaxspec draft train --config configs/draft_small.yaml --run-dir runs/draft-small-ood \
        train.steps="$DRAFT_STEPS" 'data.levels=[1]' 'data.kinds=[arithmetic]' 2>&1 \
        | tee "$RESULTS/draft_small_ood.log" ;;
    verify)
      jaxspec bench verify --out "$RESULTS/verify.json" 2>&1 | tee "$RESULTS/verify.log" ;;
    spec)
      ood=(); [ -d runs/draft-small-ood/draft ] && ood=(--draft-ood runs/draft-small-ood/draft)
      jaxspec bench spec --policy runs/small/policy --draft runs/draft-small/draft "${ood[@]}" \
        --out "$RESULTS/spec_small.json" 2>&1 | tee "$RESULTS/spec_small.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
