#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: build/trainer configs/base.yml [key=value ...].
# It runs from the repository root (base.yml's data/ and runs/ are there), so relative paths in
# the arguments are relative to the root too.
# Example: scripts/run.sh steps=100 gradient_accumulation_steps=4
set -euo pipefail
cd -- "$(dirname -- "$(readlink -f -- "$0")")/.."  # also when run through a link
source scripts/build_lock.sh
build_lock  # released before training: the build and the corpus wait for a running test.sh
if [ ! -x build/trainer ]; then
  scripts/setup.sh 9>&-
elif ! build_log=$(cmake --build build -j 2 --target trainer preprocess_data 2>&1 9>&-); then  # after a git pull: not the previous build
  echo "$build_log" >&2
  exit 1
fi
# The default corpus, when the run reads it (a built tree whose data/ was deleted exited 3). The
# trainer's own precedence: base.yml, then the arguments, then M_<KEY> variables.
dataset_type=megatron dataset_path=data/fortunes_text_document reads_data=true
for arg in "$@"; do
  case "$arg" in
    dataset_type=*) dataset_type=${arg#dataset_type=} ;;
    dataset_path=*) dataset_path=${arg#dataset_path=} ;;
    -h | --help | --version | --print-config | --dry-run) reads_data=false ;;
  esac
done
dataset_type=${M_DATASET_TYPE:-$dataset_type}
dataset_path=${M_DATASET_PATH:-$dataset_path}
if [ "$reads_data" = true ] && [ "$dataset_type" != synthetic ] && [ "$dataset_path" = data/fortunes_text_document ] &&
  [ ! -f data/fortunes_text_document.idx ]; then
  scripts/prepare_corpus.sh 9>&-  # runs build/preprocess_data: under the lock too
fi
build_unlock
exec build/trainer configs/base.yml "$@"
