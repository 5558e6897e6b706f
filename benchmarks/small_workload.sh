#!/usr/bin/env bash
# The `small` workload on one GPU, end to end: pretrain the policy and a 4-layer draft model with
# its tokenizer, train in-domain and out-of-domain EAGLE-3 heads on its own rollouts, time
# speculative vs autoregressive rollouts, the speculative cost model on Qwen3 shapes, and GRPO with
# and without speculation.
#   RESULTS=benchmarks/results/<campaign> bash benchmarks/small_workload.sh [stage ...]
# Stages (default: all, in this order): pretrain draft_model draft draft_ood verify spec cost grpo decode8b;
# check (the GPU-only attention paths against the CPU-tested ones), cost_small (needs pretrain),
# profile (needs pretrain and draft) and attention only when named.
# Intermediate checkpoints live under runs/ (not committed). Environment knobs: DRAFT_STEPS,
# OOD_STEPS, GRPO_STEPS, SPEC_LEVELS (the long-answer levels of the speculative benchmark),
# PROFILE_BATCH (64: where a decode step is launch-bound; 256: GRPO's first stage), PRETRAIN_ARGS
# and GRPO_ARGS (extra dotted.key=value overrides).
set -euo pipefail
RESULTS=${RESULTS:-benchmarks/results}
DRAFT_STEPS=${DRAFT_STEPS:-1000}
OOD_STEPS=${OOD_STEPS:-$DRAFT_STEPS}
GRPO_STEPS=${GRPO_STEPS:-200}
SPEC_LEVELS=${SPEC_LEVELS:-6 7}
PROFILE_BATCH=${PROFILE_BATCH:-64}
read -r -a pretrain_args <<< "${PRETRAIN_ARGS:-}"
read -r -a grpo_args <<< "${GRPO_ARGS:-}"
mkdir -p "$RESULTS" runs
jaxspec() { python3 -m jaxspec.cli "$@"; }
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(pretrain draft_model draft draft_ood verify spec cost grpo decode8b)
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    pretrain)  # flash attention over packed rows, unless this GPU's cuDNN disagrees with XLA on them
      check=0; python3 -m tests.gpu.check_cudnn_segments || check=$?
      case $check in
        0) attention=() ;;
        3) attention=(train.attention=xla train.remat=true) ;;
        *) echo "tests/gpu/check_cudnn_segments.py failed to run (exit $check)" >&2; exit 1 ;;
      esac
      jaxspec pretrain --config configs/pretrain_small.yaml --run-dir runs/small train.progress=false "${attention[@]}" "${pretrain_args[@]}" 2>&1 \
        | tee "$RESULTS/pretrain_small.log" ;;
    draft_model)  # the same problems with the policy's tokenizer (written when its pretraining starts)
      jaxspec pretrain --config configs/pretrain_draft_model_small.yaml --run-dir runs/draft-model-small train.progress=false \
        2>&1 | tee "$RESULTS/pretrain_draft_model_small.log" ;;
    draft)
      jaxspec draft train --config configs/head_small.yaml --run-dir runs/draft-small \
        train.steps="$DRAFT_STEPS" 2>&1 | tee "$RESULTS/draft_small.log" ;;
    draft_ood)  # short level-1 arithmetic only; evaluated on the full in-domain mix
      jaxspec draft train --config configs/head_small.yaml --run-dir runs/draft-small-ood \
        train.steps="$OOD_STEPS" 'data.levels=[1]' 'data.kinds=[arithmetic]' 2>&1 \
        | tee "$RESULTS/draft_small_ood.log" ;;
    check)
      python3 -m tests.gpu.check_attention 2>&1 | tee "$RESULTS/gpu_attention_check.log" ;;
    verify)
      jaxspec bench verify --out "$RESULTS/verify.json" 2>&1 | tee "$RESULTS/verify.log" ;;
    spec)
      drafts=(); [ -d runs/draft-small-ood/draft ] && drafts=(--draft-ood runs/draft-small-ood/draft)
      [ -d runs/draft-model-small/policy ] && drafts+=(--draft-model runs/draft-model-small/policy --draft-model-k 2 3)
      # shellcheck disable=SC2086
      jaxspec bench spec --policy runs/small/policy --draft runs/draft-small/draft "${drafts[@]}" \
        --levels $SPEC_LEVELS --new 1024 --batch 64 --k 1 2 3 4 5 7 --stochastic \
        --out "$RESULTS/spec_small.json" 2>&1 | tee "$RESULTS/spec_small.log"
      # shellcheck disable=SC2086
      jaxspec bench spec --policy runs/small/policy --draft runs/draft-small/draft \
        --levels $SPEC_LEVELS --new 1024 --batch 256 --k 3 5 --trees 2,4,8 \
        --out "$RESULTS/spec_small_256.json" 2>&1 | tee "$RESULTS/spec_small_256.log" ;;
    cost_small)  # the pieces of one speculative step on the small policy's shapes (vs its in-loop step time)
      jaxspec bench spec-cost --model runs/small/policy/config.json --batch 64 256 --nodes 4 --draft-vocab 512 \
        --out "$RESULTS/spec_cost_small.json" 2>&1 | tee "$RESULTS/spec_cost_small.log" ;;
    profile)  # device time and kernel launches of a loop iteration by phase, autoregressive vs speculative
      jaxspec bench profile --policy runs/small/policy --draft runs/draft-small/draft --batch "$PROFILE_BATCH" \
        --new 512 --k 3 --out "$RESULTS/profile_small_$PROFILE_BATCH.json" 2>&1 \
        | tee "$RESULTS/profile_small_$PROFILE_BATCH.log" ;;
    attention)  # the ragged cache-attention kernel vs dense attention, by cache fill (random weights)
      jaxspec bench attention --model configs/models/small-policy.json configs/models/qwen3-8b.json --batch 64 256 \
        --tokens 1 4 --max-len 2048 --fill 0.25 0.5 1.0 --out "$RESULTS/attention_h100.json" 2>&1 \
        | tee "$RESULTS/attention_h100.log" ;;
    cost)
      accept=(); [ -f "$RESULTS/spec_small.json" ] && accept=(--acceptance "$RESULTS/spec_small.json")
      jaxspec bench spec-cost --model configs/models/qwen3-1.7b.json configs/models/qwen3-8b.json \
        "${accept[@]}" --out "$RESULTS/spec_cost.json" 2>&1 | tee "$RESULTS/spec_cost.log" ;;
    grpo)  # the same run four times: autoregressive, EAGLE-3 with online adaptation, frozen head (k=3),
           # frozen head drafting 3 / 5 / 7 tokens at 256 / 128 / 64 rows
      common=(train.steps="$GRPO_STEPS" train.checkpoint_every=1000 train.progress=false "${grpo_args[@]}")
      jaxspec train --config configs/grpo_small.yaml --run-dir runs/grpo-ar "${common[@]}" spec.method=none \
        draft.online=false 2>&1 | tee "$RESULTS/grpo_small_ar.log"
      jaxspec train --config configs/grpo_small.yaml --run-dir runs/grpo-spec "${common[@]}" 2>&1 \
        | tee "$RESULTS/grpo_small_spec.log"
      jaxspec train --config configs/grpo_small.yaml --run-dir runs/grpo-frozen "${common[@]}" draft.online=false \
        2>&1 | tee "$RESULTS/grpo_small_frozen.log"
      jaxspec train --config configs/grpo_small.yaml --run-dir runs/grpo-frozen-stages "${common[@]}" draft.online=false \
        spec.num_draft_tokens=7 'spec.stage_draft_tokens=[3,5,7]' 2>&1 | tee "$RESULTS/grpo_small_frozen_stages.log"
      python3 benchmarks/grpo_compare.py --out "$RESULTS/grpo_small.json" --plot "$RESULTS/grpo_small.png" \
        ar=runs/grpo-ar spec=runs/grpo-spec frozen=runs/grpo-frozen frozen_stages=runs/grpo-frozen-stages 2>&1 \
        | tee "$RESULTS/grpo_small.log" ;;
    decode8b)
      jaxspec bench decode --model configs/models/qwen3-8b.json --batch 128 256 --peer none \
        --out "$RESULTS/decode_qwen3-8b_256.json" 2>&1 | tee "$RESULTS/decode_qwen3-8b_256.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
