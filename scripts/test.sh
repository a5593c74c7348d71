#!/usr/bin/env bash
# Sets up (if needed), builds and runs every test (ctest) twice: against Debian 12's LibTorch 1.13
# (build/), then against LibTorch 2.6 in a Debian 13 chroot (scripts/test_libtorch2.sh), so both
# sides of trainer/util/torch_compat.h are compiled and tested. Exit status is the tests' status.
#   scripts/test.sh [ctest args]       e.g. -R checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
(cd build && ctest --output-on-failure -j 1 "$@")
scripts/test_libtorch2.sh "$@"
