#!/usr/bin/env bash
# Both arms from the same weights and samples: the trainer (checkpoint 0 = its initial weights)
# and scripts/bench/peer.py (plain PyTorch) must give the same loss for the first steps.
# Usage: scripts/bench/peer_parity.sh [key=value ...]   (run by the test suite, which sets
# TRAINER to the binary under test; default build/trainer)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d /tmp/trainer-peer-XXXX)
trap 'rm -rf "$out"' EXIT
"${TRAINER:-build/trainer}" configs/base.yml steps=6 save_checkpoint_on_start=true base_output_directory="$out" run_name=parity \
  log_period=1000 num_threads=1 "$@" > "$out/trainer.log" 2>&1 || { cat "$out/trainer.log"; exit 1; }
/usr/bin/python3 scripts/bench/peer.py "$out/parity" --threads 1 --check-steps 6 --tolerance 1e-5
