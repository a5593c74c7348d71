#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: build/trainer configs/base.yml [key=value ...].
# Example: scripts/run.sh steps=100 gradient_accumulation_steps=4
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x build/trainer ] || [ -n "${REBUILD:-}" ]; then
  scripts/setup.sh
fi
exec build/trainer configs/base.yml "$@"
