#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: build/trainer configs/base.yml [key=value ...].
# It runs from the repository root (base.yml's data/ and runs/ are there), so relative paths in
# the arguments are relative to the root too.
# Example: scripts/run.sh steps=100 gradient_accumulation_steps=4
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x build/trainer ] || [ -n "${REBUILD:-}" ]; then
  scripts/setup.sh
fi
# The default corpus, when the run reads it (a built tree whose data/ was deleted exited 3).
default_corpus=true
for arg in "$@"; do
  case "$arg" in dataset_path=* | dataset_type=*) default_corpus=false ;; esac
done
if [ "$default_corpus" = true ] && [ ! -f data/fortunes_text_document.idx ]; then scripts/prepare_corpus.sh; fi
exec build/trainer configs/base.yml "$@"
