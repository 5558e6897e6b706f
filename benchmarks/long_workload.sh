#!/usr/bin/env bash
# The long-answer workload (configs/pretrain_long.yaml, the `tally` task) on one GPU, end to end: pretrain
# the policy, train its EAGLE-3 head on the policy's own T=1 rollouts, then time speculative vs
# autoregressive rollouts on RL-shaped batches of long, heavy-tailed answers.
#   RESULTS=benchmarks/results/<campaign> bash benchmarks/long_workload.sh [stage ...]
# Stages (default: pretrain head spec, in this order); check (the GPU check of the verification
# kernels and rollouts, `tests/gpu/check_spec.py`, under CHECK_DEADLINE seconds: on its own, before
# any training, since beside one the two run out of the card's memory), stats (the data alone, on the CPU), engines
# (the slot engine against the staged one in the same memory, suffix and hybrid drafts too), floor
# (speculation with a useless draft, fixed and adaptive depths, batch 512 to 1), grpo (a few
# steps of configs/grpo_long.yaml per rollout method, their phases compared) and knob (the entropy
# knob's curve: a policy and head per data.tally.variation, their entropy and acceptance at k=1..7,
# `benchmarks/knob_curve.py`) when named.
# Intermediate checkpoints live under runs/ (not committed). Environment knobs:
#   CHECK_DEADLINE (420: seconds for the check stage; the whole check takes ~350-450 s on one H100),
#   PRETRAIN_STEPS (2000), PRETRAIN_MAX_LEN (30720: the packed row width; a shorter row drops the
#   problems whose answer does not fit, so the policy never sees the longest answers),
#   PRETRAIN_BATCH (rows per step; default keeps ~61k tokens a step), PRETRAIN_PROBLEMS (the problems
#   generated and tokenized: by default those the steps read, steps x batch x max_len / 2000 (a packed
#   row holds ~one problem per 2000 of its tokens) with 10% to spare, at most the config's
#   data.num_train; the data's preparation is ~6 s per 1000 problems on one core), HEAD_STEPS (1000),
#   SPEC_BATCH (256), SPEC_SAMPLES (8: GRPO's group size), SPEC_NEW (8192), SPEC_K ("3 7": the
#   k=7 chain's acceptance per position gives the acceptance length at every k <= 7), PRETRAIN_ARGS
#   and HEAD_ARGS (extra dotted.key=value overrides); engines: ENGINE_CALLS (2: the memory both engines
#   get is SPEC_BATCH / ENGINE_CALLS dense rows), ENGINE_SLOTS ("SPEC_BATCH": slot counts, one run
#   each), ENGINE_ARGS ("--suffix": more `bench spec` options, e.g. "--stage-k 3,5,7 --stage-trees 3,16:1,2,5
#   --staged-ar-only"); floor:
#   FLOOR_NEW (1024: max_new_tokens), FLOOR_BATCH ("512 64 1": batch sizes, largest first, where
#   speculation costs most); grpo: GRPO_RUNS ("ar frozen": autoregressive, EAGLE-3 with the frozen
#   head, online: adapted, deep: the frozen head drafting 3 / 5 / 7 tokens as the decoding rows fall
#   (spec.stage_draft_tokens), so that the long tail drafts deeper, deeptree: trees of 3 branches a
#   level (at most 16 nodes) 2 / 3 / 5 levels deep as the rows fall (such a tree accepted 3.77 tokens
#   a step against a k=7 chain's 3.12 in lease LL; its verification rows matter less the fewer rows
#   run), suffix: the group-suffix drafter,
#   hybrid: the frozen head's and the suffix drafter's branches in one tree), GRPO_STEPS (5; the
#   comparison takes medians after the first step, of the steps that compiled nothing), GRPO_SLOTS
#   (128: rollout.slots, "null" for the staged engine), GRPO_ARGS (more overrides); knob:
#   KNOB_VALUES ("0.5 0.7 0.9": variations, one policy and head each), KNOB_NEW (2048: max_new_tokens).
set -euo pipefail
RESULTS=${RESULTS:-benchmarks/results}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-2000}
PRETRAIN_MAX_LEN=${PRETRAIN_MAX_LEN:-30720}
PRETRAIN_BATCH=${PRETRAIN_BATCH:-$((61440 / PRETRAIN_MAX_LEN))}
config_problems=$(python3 -c 'import yaml; print(yaml.safe_load(open("configs/pretrain_long.yaml"))["data"]["num_train"])')
PRETRAIN_PROBLEMS=${PRETRAIN_PROBLEMS:-$(( PRETRAIN_STEPS * PRETRAIN_BATCH * PRETRAIN_MAX_LEN * 11 / 20000 ))}
[ "$PRETRAIN_PROBLEMS" -le "$config_problems" ] || PRETRAIN_PROBLEMS=$config_problems
HEAD_STEPS=${HEAD_STEPS:-1000}
CHECK_DEADLINE=${CHECK_DEADLINE:-420}
SPEC_BATCH=${SPEC_BATCH:-256}
SPEC_SAMPLES=${SPEC_SAMPLES:-8}
SPEC_NEW=${SPEC_NEW:-8192}
SPEC_K=${SPEC_K:-3 7}
read -r -a pretrain_args <<< "${PRETRAIN_ARGS:-}"
read -r -a head_args <<< "${HEAD_ARGS:-}"
FLOOR_NEW=${FLOOR_NEW:-1024}
FLOOR_BATCH=${FLOOR_BATCH:-512 64 1}
ENGINE_CALLS=${ENGINE_CALLS:-2}
ENGINE_SLOTS=${ENGINE_SLOTS:-$SPEC_BATCH}
read -r -a engine_args <<< "${ENGINE_ARGS---suffix}"  # set and empty: no more options
GRPO_RUNS=${GRPO_RUNS:-ar frozen}
GRPO_STEPS=${GRPO_STEPS:-5}
GRPO_SLOTS=${GRPO_SLOTS:-128}
read -r -a grpo_args <<< "${GRPO_ARGS:-}"
KNOB_VALUES=${KNOB_VALUES:-0.5 0.7 0.9}
KNOB_NEW=${KNOB_NEW:-2048}
mkdir -p "$RESULTS" runs
jaxspec() { python3 -m jaxspec.cli "$@"; }
# pretrain RUN_DIR LOG [OVERRIDE ...]: the tally policy, with flash attention over packed rows unless
# this GPU's cuDNN disagrees with XLA on them (checked once per invocation): where the layout selected
# for long rows (cuDNN's packed layout on Hopper) disagrees, the segment mask if that agrees, else
# XLA's attention (whose [rows, heads, T, T] scores need far more memory)
attention=()
attention_checked=0
pretrain() {
  local run_dir=$1 log=$2 check=0
  shift 2
  if [ "$attention_checked" = 0 ]; then
    python3 -m tests.gpu.check_cudnn_segments || check=$?
    case $check in
      0) ;;
      3)
        if JAXSPEC_PACKED_ATTENTION=mask python3 -m tests.gpu.check_cudnn_segments; then
          export JAXSPEC_PACKED_ATTENTION=mask
        else
          attention=(train.attention=xla train.remat=true)
        fi ;;
      *) echo "tests/gpu/check_cudnn_segments.py failed to run (exit $check)" >&2; exit 1 ;;
    esac
    attention_checked=1
  fi
  jaxspec pretrain --config configs/pretrain_long.yaml --run-dir "$run_dir" train.progress=false \
    train.steps="$PRETRAIN_STEPS" data.max_len="$PRETRAIN_MAX_LEN" train.batch_size="$PRETRAIN_BATCH" \
    data.num_train="$PRETRAIN_PROBLEMS" data.num_eval=0 "${attention[@]}" "${pretrain_args[@]}" "$@" 2>&1 | tee "$log"
}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(pretrain head spec)
for stage in "${stages[@]}"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    check)  # every row printed as it finishes, so a cut check still shows what passed
      # the stages after it run whatever it finds: its exit is reported, not fatal
      check_status=0
      python3 -u -m tests.gpu.check_spec --jobs 8 --deadline "$CHECK_DEADLINE" --out "$RESULTS/gpu_check.json" 2>&1 \
        | tee "$RESULTS/gpu_check.log" || check_status=$?
      echo "check_spec exit $check_status (0: every case agrees, 1: a mismatch, 3: cases cut by the deadline)" ;;
    stats)  # the length law and phrasing entropy of the data itself
      jaxspec data stats --config configs/pretrain_long.yaml --num 2000 --json "$RESULTS/long_data_stats.json" 2>&1 \
        | tee "$RESULTS/long_data_stats.log" ;;
    pretrain)
      pretrain runs/long "$RESULTS/pretrain_long.log" ;;
    head)
      jaxspec draft train --config configs/head_long.yaml --run-dir runs/draft-long \
        train.steps="$HEAD_STEPS" train.progress=false "${head_args[@]}" 2>&1 | tee "$RESULTS/draft_long.log" ;;
    knob)
      # a policy and head per variation, trained as the pretrain and head stages train theirs; the same
      # prompts for all (the questions do not depend on the variation, only the worked solutions do)
      points=()
      for v in $KNOB_VALUES; do
        echo "--- variation $v: policy $(date -u +%H:%M:%S)"
        pretrain "runs/long-v$v" "$RESULTS/pretrain_long_v$v.log" data.tally.variation="$v"
        echo "--- variation $v: head $(date -u +%H:%M:%S)"
        jaxspec draft train --config configs/head_long.yaml --run-dir "runs/draft-long-v$v" policy="runs/long-v$v/policy" \
          data.tally.variation="$v" train.steps="$HEAD_STEPS" train.progress=false "${head_args[@]}" 2>&1 \
          | tee "$RESULTS/draft_long_v$v.log"
        echo "--- variation $v: acceptance $(date -u +%H:%M:%S)"
        jaxspec bench spec --policy "runs/long-v$v/policy" --draft "runs/draft-long-v$v/draft" \
          --data-config configs/pretrain_long.yaml --batch "$SPEC_BATCH" --samples "$SPEC_SAMPLES" --new "$KNOB_NEW" \
          --k 7 --no-ngram --out "$RESULTS/spec_long_v$v.json" 2>&1 | tee "$RESULTS/spec_long_v$v.log"
        points+=("$RESULTS/spec_long_v$v.json")
      done
      python3 benchmarks/knob_curve.py "${points[@]}" --out "$RESULTS/knob_curve.json" --plot "$RESULTS/knob_curve.png" \
        2>&1 | tee "$RESULTS/knob_curve.log" ;;
    spec)
      # shellcheck disable=SC2086
      jaxspec bench spec --policy runs/long/policy --draft runs/draft-long/draft --data-config configs/pretrain_long.yaml \
        --batch "$SPEC_BATCH" --samples "$SPEC_SAMPLES" --new "$SPEC_NEW" --k $SPEC_K --trees \
        --out "$RESULTS/spec_long.json" 2>&1 | tee "$RESULTS/spec_long.log" ;;
    engines)
      # The staged engine holds SPEC_BATCH / ENGINE_CALLS dense rows of SPEC_NEW tokens at a time (that
      # many calls, one after another); the slot engine gets the same bytes as pages (16 positions
      # each) for each slot count of ENGINE_SLOTS.
      rows=$((SPEC_BATCH / ENGINE_CALLS))
      pages=$(( rows * (SPEC_NEW + 256) / 16 ))
      # shellcheck disable=SC2086
      jaxspec bench spec --policy runs/long/policy --draft runs/draft-long/draft --data-config configs/pretrain_long.yaml \
        --batch "$SPEC_BATCH" --samples "$SPEC_SAMPLES" --new "$SPEC_NEW" --k 3 --trees --no-ngram \
        --sub-batch "$rows" --kv-pages "$pages" --slots $ENGINE_SLOTS "${engine_args[@]}" \
        --out "$RESULTS/spec_long_engines_c$ENGINE_CALLS.json" 2>&1 | tee "$RESULTS/spec_long_engines_c$ENGINE_CALLS.log" ;;
    floor)
      # speculation's floor: a trained and a random (useless) head, fixed and adaptive depths, batch 1
      # to 512, against AR of the same batch
      # shellcheck disable=SC2086
      jaxspec bench spec --policy runs/long/policy --draft runs/draft-long/draft --data-config configs/pretrain_long.yaml \
        --batch $FLOOR_BATCH --samples 1 --new "$FLOOR_NEW" --k 3 --trees --no-ngram --random-draft --adaptive \
        --out "$RESULTS/spec_long_floor.json" 2>&1 | tee "$RESULTS/spec_long_floor.log" ;;
    grpo)
      # the same prompts and keys for every run: only how rollouts are generated differs
      compared=()
      for run in $GRPO_RUNS; do
        case "$run" in
          ar) method=(spec.method=none draft.online=false) ;;
          frozen) method=(draft.online=false) ;;
          online) method=() ;;
          deep) method=(draft.online=false spec.num_draft_tokens=7 "spec.stage_draft_tokens=[3,5,7]") ;;
          deeptree) method=(draft.online=false spec.num_draft_tokens=5 spec.tree_width=3 spec.tree_budget=16
            "spec.stage_draft_tokens=[2,3,5]") ;;
          suffix) method=(spec.method=suffix spec.draft=null draft.online=false) ;;
          hybrid) method=(draft.online=false spec.suffix_branches=true) ;;
          *) echo "unknown GRPO run $run (ar, frozen, online, deep, deeptree, suffix, hybrid)" >&2; exit 2 ;;
        esac
        rm -rf "runs/grpo-long-$run"
        # every group is trained on: the short-trained policy answers ~1% of these problems right, so
        # filtering the groups of equal rewards would leave the update nothing to time
        jaxspec train --config configs/grpo_long.yaml --run-dir "runs/grpo-long-$run" train.progress=false \
          train.steps="$GRPO_STEPS" train.checkpoint_every=1000 eval.every=0 rollout.slots="$GRPO_SLOTS" \
          loss.filter_groups=false \
          "${method[@]}" "${grpo_args[@]}" 2>&1 | tee "$RESULTS/grpo_long_$run.log"
        cp "runs/grpo-long-$run/metrics.jsonl" "$RESULTS/grpo_long_$run.jsonl"
        compared+=("$run=runs/grpo-long-$run")
      done
      python3 benchmarks/grpo_compare.py --warmup 1 --out "$RESULTS/grpo_long.json" "${compared[@]}" 2>&1 \
        | tee "$RESULTS/grpo_long_compare.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
