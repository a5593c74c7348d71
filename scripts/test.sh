#!/usr/bin/env bash
# Sets up (if needed), builds and runs every test (ctest). Exit status is the tests' status.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure -j 1 "$@"
