#!/usr/bin/env bash
# Installs the Debian 12 packages trainer needs (idempotent) and configures + builds into build/.
# Usage: scripts/setup.sh            (Release build of trainer and the tests)
#        BUILD_TYPE=Debug scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ccache pkg-config git  # git: test_libtorch2.sh copies the tracked files
  libtorch-dev            # LibTorch 1.13 (CPU), with c10d/Gloo
  libgloo-dev             # Gloo headers for c10d's ProcessGroupGloo
  libopenmpi-dev openmpi-bin  # mpirun launch and rendezvous
  libopenblas0-pthread    # without it LibTorch falls back to reference BLAS (~10x slower)
  libyaml-cpp-dev libspdlog-dev libcli11-dev nlohmann-json3-dev catch2
  libsentencepiece-dev    # preprocess_data --tokenizer-type sentencepiece
  fortunes                # the default training corpus (scripts/prepare_corpus.sh)
  python3 python3-numpy   # corpus conversion; test fixtures were generated with numpy
  python3-torch           # the PyTorch peer arm (scripts/bench/peer.py), a parity test
  python3-matplotlib      # scripts/plot_metrics.py
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

source scripts/build_lock.sh
build_lock
JOBS=${JOBS:-2}
cmake -S . -B build -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" > build.cmake.log 2>&1 \
  || { cat build.cmake.log >&2; exit 1; }
rm -f build.cmake.log
cmake --build build -j "$JOBS"
scripts/prepare_corpus.sh
