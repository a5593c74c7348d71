#!/usr/bin/env bash
# Ling2 pretraining (the RFC's scripts/pretrain_ling2.sh, change 8, for this trainer).
# Architecture: configs/models/ling2.yml, the RFC's hybrid (4 GLA + 1 MLA layers per 5, Ling MoE, MTP;
# docs/model.md). MODEL_NAME=ling-mini-2.0 trains the released Ling 2.0 instead (docs/moe.md).
# Every setting below can be overridden from the environment (${VAR:-default}); anything after
# the script name is passed through to the trainer as key=value overrides (and wins: dataset_path=,
# dataset_type=, eod_id=, pad_id= there are seen by the demo-corpus rule of section 4). TRAINER
# names the binary (default build/trainer, built by scripts/setup.sh when missing, or on GPUs
# build-gpu/trainer, built by scripts/gpu/build.sh; a TRAINER that does not exist is an error,
# never a reason to install anything). HARDWARE (cpu | gpu) defaults to gpu where `nvidia-smi -L`
# lists a GPU on this machine, one per local process. Paths you give (HOSTFILE,
# TRAINER, CONFIG_FILE, DATA_PATH, BASE_OUTPUT_DIR, key=value arguments) are relative to your
# working directory; the defaults are the repository's files. Running again with the same
# RUN_NAME (default <model_name>-<data file name>) resumes that run, even with other settings
# (the trainer warns): give a new RUN_NAME to start over.
#   NPROC=8 scripts/pretrain_ling2.sh                                 # one node, 8 processes
#   HOSTFILE=hosts NPROC=16 scripts/pretrain_ling2.sh steps=1000      # several nodes (mpirun --hostfile)
set -euo pipefail
ROOT=$(CDPATH='' cd -- "$(dirname -- "$(readlink -f -- "$0")")/.." && pwd -P)  # also when run through a link

# ============================================================================
# 1. Tokenizer
# ============================================================================
# The vocabulary is the model file's (157184 for ling2 and ling-mini-2.0); VOCAB_SIZE overrides it.
VOCAB_SIZE=${VOCAB_SIZE:-}
PAD_ID=${PAD_ID:-}         # default -1 (none) for Megatron data, 156892 for synthetic, 257 for the demo corpus (section 4)
EOD_ID=${EOD_ID:-}         # default <|endoftext|> 156892, or 256 for the demo corpus (section 4)
BOS_ID=${BOS_ID:-156891}   # <|startoftext|> (informational: documents are not prefixed)

# ============================================================================
# 2. Output paths and run name
# ============================================================================
BASE_OUTPUT_DIR=${BASE_OUTPUT_DIR:-"$ROOT/runs"}
RUN_NAME=${RUN_NAME:-}     # default <model_name>-<data file name> (section 5): a relaunch after preemption resumes it

# ============================================================================
# 3. Launch: single process, one node x NPROC (mpirun -np), or several nodes (mpirun --hostfile)
# ============================================================================
NPROC=${NPROC:-1}
HOSTFILE=${HOSTFILE:-}
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "pretrain_ling2.sh: NPROC=$NPROC is not a process count (1, 2, ...)" >&2
  exit 2
fi
if [ -n "$HOSTFILE" ] && [ ! -f "$HOSTFILE" ]; then
  echo "pretrain_ling2.sh: HOSTFILE=$HOSTFILE does not exist" >&2
  exit 2
fi
HARDWARE=${HARDWARE:-}
for arg in "$@"; do case "$arg" in hardware=*) HARDWARE=${arg#hardware=} ;; esac; done  # the arguments win
if [ -z "$HARDWARE" ]; then
  # A GPU node trained on its CPUs unless hardware=gpu was passed.
  # Read whole first (grep -q exiting early would kill a long listing with SIGPIPE, which
  # pipefail turns into "no GPU"); bounded, as a broken driver can hang nvidia-smi.
  gpu_list=$(command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi -L 2>/dev/null || true)
  if grep -q '^GPU ' <<<"$gpu_list"; then HARDWARE=gpu; else HARDWARE=cpu; fi
  echo "pretrain_ling2.sh: HARDWARE=$HARDWARE (detected; set HARDWARE=cpu or gpu to choose)" >&2
fi
if [ "$HARDWARE" != cpu ] && [ "$HARDWARE" != gpu ]; then
  echo "pretrain_ling2.sh: HARDWARE=$HARDWARE is neither cpu nor gpu" >&2
  exit 2
fi
MPIRUN_ARGS=${MPIRUN_ARGS:-"--bind-to none"}
if [ "$(id -u)" -eq 0 ]; then MPIRUN_ARGS="$MPIRUN_ARGS --allow-run-as-root"; fi
if [ -n "$HOSTFILE" ]; then
  LAUNCH=(mpirun --hostfile "$HOSTFILE" -np "$NPROC" $MPIRUN_ARGS -x PATH -x LD_LIBRARY_PATH)
elif [ "$NPROC" -gt 1 ]; then
  LAUNCH=(mpirun -np "$NPROC" --oversubscribe $MPIRUN_ARGS)
else
  LAUNCH=()
fi

# ============================================================================
# 4. Dataset (Megatron .bin/.idx). The default is the byte-level demo corpus, whose token ids
#    (bytes, <eod> 256, <pad> 257) are valid in Ling2's vocabulary; point DATA_PATH (or pass
#    dataset_path=) at data made with Ling2's tokenizer for real runs.
# ============================================================================
DATASET_TYPE=${DATASET_TYPE:-megatron}
DEMO_PATH=$(realpath -m -- "$ROOT/data/fortunes_text_document")  # data/ may be a link
DATA_PATH=${DATA_PATH:-"$DEMO_PATH"}
MODEL_NAME=${MODEL_NAME:-ling2}
for arg in "$@"; do  # the arguments come last on the trainer's command line: they are what it reads
  case "$arg" in
    model_name=*) MODEL_NAME=${arg#model_name=} ;;
    dataset_path=*) DATA_PATH=${arg#dataset_path=} ;;
    dataset_type=*) DATASET_TYPE=${arg#dataset_type=} ;;
    eod_id=*) EOD_ID=${arg#eod_id=} ;;
    pad_id=*) PAD_ID=${arg#pad_id=} ;;
  esac
done
# The trainer first: the demo corpus below is made with the preprocess_data beside it (on the CPU
# path setup.sh also installs what prepare_corpus.sh reads, Debian's fortunes; a GPU machine
# without it needs DATA_PATH or DATASET_TYPE=synthetic).
if [ -n "${TRAINER:-}" ]; then
  [ -x "$TRAINER" ] || { echo "pretrain_ling2.sh: TRAINER=$TRAINER is not an executable" >&2; exit 2; }
elif [ "$HARDWARE" = gpu ]; then
  # build/trainer is Debian's CPU-only LibTorch: a GPU run needs the CUDA build.
  TRAINER="$ROOT/build-gpu/trainer"
  [ -x "$TRAINER" ] || { echo "pretrain_ling2.sh: HARDWARE=gpu needs $TRAINER: build it with scripts/gpu/build.sh (README, GPU), or set TRAINER" >&2; exit 2; }
else
  TRAINER="$ROOT/build/trainer"
  [ -x "$TRAINER" ] || "$ROOT/scripts/setup.sh"
fi
if [ "$(realpath -m -- "$DATA_PATH")" = "$DEMO_PATH" ]; then
  EOD_ID=${EOD_ID:-${DEMO_EOD_ID:-256}}
  PAD_ID=${PAD_ID:-${DEMO_PAD_ID:-257}}
  if [ "$DATASET_TYPE" = megatron ] && [ ! -f "$DEMO_PATH.idx" ]; then
    # The tokenizer built beside the trainer where there is one (build-gpu/ on a GPU machine).
    PREPROCESS_DATA=$(dirname -- "$TRAINER")/preprocess_data
    [ -x "$PREPROCESS_DATA" ] || PREPROCESS_DATA="$ROOT/build/preprocess_data"
    PREPROCESS_DATA="$PREPROCESS_DATA" "$ROOT/scripts/prepare_corpus.sh"
  fi
fi
EOD_ID=${EOD_ID:-156892}
# The RFC's script sets PAD_ID=156892 (<|endoftext|>), which is the EOD id: Megatron's GPTDataset
# then drops the pad (it would mask every EOD target), and so does the trainer, with a warning.
# -1 says so without one. Synthetic rows are padded, so they need an id.
if [ "$DATASET_TYPE" = synthetic ]; then PAD_ID=${PAD_ID:-156892}; else PAD_ID=${PAD_ID:--1}; fi
SPLIT=${SPLIT:-"969,30,1"}
DATA_SEED=${DATA_SEED:-1234}
# Documents packed into a row see each other (attention, the GLA state, MTP targets), as in
# Megatron's default; pass reset_attention_mask=true to keep each document alone in every layer
# (the MaxText fork's default; docs/model.md, docs/moe.md).

# ============================================================================
# 5. Training hyperparameters
# ============================================================================
# The data in the default name: a run on other data is a new run, not a resume of the demo's.
DATA_NAME=$(basename -- "${DATA_PATH##* }" | tr -c 'A-Za-z0-9._\n-' '_')
RUN_NAME=${RUN_NAME:-"${MODEL_NAME}-${DATA_NAME}"}
CONFIG_FILE=${CONFIG_FILE:-"$ROOT/configs/base.yml"}
STEPS=${STEPS:-100000}
PER_DEVICE_BATCH_SIZE=${PER_DEVICE_BATCH_SIZE:-2}
GRADIENT_ACCUMULATION_STEPS=${GRADIENT_ACCUMULATION_STEPS:-1}
MAX_TARGET_LENGTH=${MAX_TARGET_LENGTH:-4096}
# RoPE base: ling2.yml uses the fork's 10000. For MODEL_NAME=ling-mini-2.0 the model file's 600000
# is the released config and Ling's 8k/32k scripts; its 4k script uses 10000 (pass
# override_model_config=true rope_max_timescale=10000).
LEARNING_RATE=${LEARNING_RATE:-3e-4}
WARMUP_STEPS_FRACTION=${WARMUP_STEPS_FRACTION:-0.01}
CALCULATE_PER_TOKEN_LOSS=${CALCULATE_PER_TOKEN_LOSS:-false}   # Megatron's normalization
DTYPE=${DTYPE:-bfloat16}
CHECKPOINT_PERIOD=${CHECKPOINT_PERIOD:-1000}

# model_name=hf reads the architecture from load_parameters_path (a Hugging Face directory).
MODEL_FILE="$(dirname "$CONFIG_FILE")/models/${MODEL_NAME}.yml"  # where the trainer looks for it
if [ "$MODEL_NAME" != hf ] && [ ! -f "$MODEL_FILE" ]; then
  echo "pretrain_ling2.sh: $MODEL_FILE does not exist (MODEL_NAME=${MODEL_NAME})" >&2
  exit 2
fi

# Overriding the model file's vocabulary is a deliberate act: only when VOCAB_SIZE is given.
MODEL_OVERRIDES=()
if [ -n "$VOCAB_SIZE" ]; then MODEL_OVERRIDES=(override_model_config=true vocab_size="$VOCAB_SIZE"); fi

# ============================================================================
# 6. Start training
# ============================================================================
set -x
# ${A[@]+"${A[@]}"}: an empty array under set -u on bash < 4.4 too.
exec ${LAUNCH[@]+"${LAUNCH[@]}"} "$TRAINER" "$CONFIG_FILE" \
  model_name="$MODEL_NAME" \
  ${MODEL_OVERRIDES[@]+"${MODEL_OVERRIDES[@]}"} \
  run_name="$RUN_NAME" \
  hardware="$HARDWARE" \
  base_output_directory="$BASE_OUTPUT_DIR" \
  \
  eod_id="$EOD_ID" \
  pad_id="$PAD_ID" \
  \
  dataset_type="$DATASET_TYPE" \
  dataset_path="$DATA_PATH" \
  split="$SPLIT" \
  data_shuffle_seed="$DATA_SEED" \
  \
  steps="$STEPS" \
  per_device_batch_size="$PER_DEVICE_BATCH_SIZE" \
  gradient_accumulation_steps="$GRADIENT_ACCUMULATION_STEPS" \
  max_target_length="$MAX_TARGET_LENGTH" \
  learning_rate="$LEARNING_RATE" \
  warmup_steps_fraction="$WARMUP_STEPS_FRACTION" \
  calculate_per_token_loss="$CALCULATE_PER_TOKEN_LOSS" \
  dtype="$DTYPE" \
  checkpoint_period="$CHECKPOINT_PERIOD" \
  "$@"
