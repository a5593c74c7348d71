#!/usr/bin/env bash
# Builds trainer on a CUDA machine against the PyTorch wheel's LibTorch (no package registry
# needed): LibTorch from `torch.utils.cmake_prefix_path`, NCCL's header and library from the
# wheel's nvidia-nccl package (else NCCL is left out, with a message), everything else from .gpu-deps/ (scripts/gpu/prepare_deps.sh).
# Output: build-gpu/{trainer,trainer_tests,preprocess_data,merge_datasets}. SentencePiece is left out (byte
# tokenizer only), as are Gloo and MPI unless their headers are found.
#   scripts/gpu/build.sh [extra cmake args]      PYTHON (default python3) picks the interpreter
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
deps=$PWD/.gpu-deps
[ -d "$deps/usr" ] || { echo "build.sh: $deps missing: run scripts/gpu/prepare_deps.sh on a Debian machine and carry it" >&2; exit 2; }
torch_prefix=$($PYTHON -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
site=$($PYTHON -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
nccl_header=$(find "$site/nvidia" -name nccl.h 2>/dev/null | head -1)
nccl_library=$(find "$site/nvidia" -name 'libnccl.so*' 2>/dev/null | head -1)
echo "torch $($PYTHON -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)') at $torch_prefix"
echo "NCCL: ${nccl_header:-no nccl.h} ${nccl_library:-no libnccl}"
# Headers of the wheel's CUDA packages (cuBLAS, NVTX, ...) as a fallback behind the toolkit's own.
extra_flags=""
for dir in $(find "$site/nvidia" -maxdepth 3 -type d -name include 2>/dev/null); do extra_flags+=" -idirafter $dir"; done
nccl_args=(-DTRAINER_WITH_NCCL=OFF)
[ -n "$nccl_header" ] && [ -n "$nccl_library" ] &&
  nccl_args=(-DTRAINER_WITH_NCCL=ON -DNCCL_INCLUDE_DIR="$(dirname "$nccl_header")" -DNCCL_LIBRARY="$nccl_library")
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps/usr" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCUDAToolkit_ROOT="$(dirname "$(dirname "$nvcc")")" \
  -DCMAKE_CXX_FLAGS="$extra_flags" -DTRAINER_WITH_SENTENCEPIECE=OFF -DTRAINER_ALLOW_NO_GLOO=ON \
  "${nccl_args[@]}" "$@"
cmake --build build-gpu -j "$(nproc)" --target trainer trainer_tests preprocess_data merge_datasets -- -k
