#!/usr/bin/env bash
# Sets up (if needed), builds and runs every test (ctest) twice: against Debian 12's LibTorch 1.13
# (build/), then against LibTorch 2.6 in a Debian 13 chroot (scripts/test_libtorch2.sh), so both
# sides of trainer/util/torch_compat.h are compiled and tested. Exit status is the tests' status.
#   scripts/test.sh [ctest args]       e.g. -R checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
# build/ is locked for the whole run (scripts/build_lock.sh): a run.sh or another test.sh waits.
source scripts/build_lock.sh
build_lock
# The timeouts below are sized for a Release build (a caller's BUILD_TYPE=Debug would not fit them).
BUILD_TYPE=Release scripts/setup.sh 9>&-
# Every test has its own timeout (CMakeLists.txt); the suite has a budget on top (the 1.13 suite
# takes ~16 minutes here at -j 1: 917 s of test time on 2026-12-06), so nothing can hold CI until
# its 90-minute limit. A pattern that matches no test fails (--no-tests=error).
(cd build && timeout --kill-after=30 "${TRAINER_SUITE_BUDGET_SECONDS:-1500}" ctest --output-on-failure --no-tests=error -j 1 "$@" 9>&-) ||
  { rc=$?; [ $rc -eq 124 ] && echo "test.sh: the suite ran past its budget of ${TRAINER_SUITE_BUDGET_SECONDS:-1500} s" >&2; exit $rc; }
scripts/test_libtorch2.sh "$@" 9>&-
