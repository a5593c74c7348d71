#!/usr/bin/env bash
# Compiles, without a GPU, the code that no CPU build compiles, so that a session lent a GPU does
# not spend its device time on compile errors. Syntax only (g++ -fsyntax-only: no link, no run):
#   1. trainer/train/device.cpp and trainer/dist/dist.cpp with TRAINER_WITH_CUDA and
#      TRAINER_WITH_NCCL against Debian 13's CUDA LibTorch (libtorch-cuda-dev 2.6, CUDA 12.4 and
#      NCCL headers from contrib/non-free);
#   2. every translation unit (library, apps, tests) against the newest LibTorch Debian has
#      (unstable's libtorch-dev: 2.14 when this was written), which compiles torch_compat.h's
#      branches for LibTorch >= 2.8 (at::_grouped_mm, at::rms_norm), in C++20 where CMake would.
# It runs in the Debian 13 chroot of scripts/test_libtorch2.sh (run that once first) and needs
# Debian's mirror; the first run downloads about 1.1 GB of packages, unpacked (not installed) under
# $root/opt/compile-check/ and kept. About 5 minutes on 2 cores after that.
#   scripts/gpu/compile_check.sh            JOBS, TRAINER_TORCH2_ROOT as scripts/test_libtorch2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "$(id -u)" -eq 0 ] || exec sudo --preserve-env=JOBS,TRAINER_TORCH2_ROOT,TRAINER_TORCH2_MIRROR "$0" "$@"
root=${TRAINER_TORCH2_ROOT:-/var/tmp/trainer-trixie}
mirror=${TRAINER_TORCH2_MIRROR:-http://deb.debian.org/debian}
jobs=${JOBS:-2}
[ -x "$root/usr/bin/g++" ] && [ -f "$root/.trainer-ready" ] ||
  { echo "compile_check: no Debian 13 chroot at $root: run scripts/test_libtorch2.sh first" >&2; exit 3; }
exec 9> "$root.lock"
flock -n 9 || { echo "compile_check: another run holds $root.lock" >&2; exit 3; }

work=/opt/compile-check  # inside the chroot
mkdir -p "$root$work/debs" "$root$work/lists/partial"
# Package lists of their own (the chroot's apt state is left as it is): contrib and non-free for
# the CUDA packages, unstable for the newest LibTorch; main for the CUDA C++ libraries.
cat > "$root$work/sources.list" << EOF
deb $mirror trixie main contrib non-free
deb $mirror sid main
EOF
# Valid-Until is not checked (signatures are): a mirror snapshot's unstable Release file expires
# within days, and an expired list only means no newer packages than the snapshot's.
apt_opts="-o Dir::Etc::sourcelist=$work/sources.list -o Dir::Etc::sourceparts=- -o Dir::State::Lists=$work/lists"
apt_opts="$apt_opts -o Acquire::Check-Valid-Until=false"
fetch() {  # fetch DIR PACKAGE=VERSION...: download (once) and unpack into DIR
  local dir=$1
  shift
  [ -f "$root$dir/.ready" ] && [ "$(cat "$root$dir/.ready")" = "$*" ] && return 0
  rm -rf "$root$dir" && mkdir -p "$root$dir"
  for package in "$@"; do
    rm -f "$root$work/debs/${package%%=*}"_*.deb  # an older version's
    chroot "$root" sh -c "cd $work/debs && apt-get -qq $apt_opts download '$package' 2> /dev/null && dpkg -x ${package%%=*}_*.deb $dir" ||
      { echo "compile_check: downloading or unpacking $package failed" >&2; exit 3; }
  done
  echo "$*" > "$root$dir/.ready"
}
chroot "$root" sh -c "apt-get -qq $apt_opts update" > /dev/null 2>&1 ||
  { echo "compile_check: apt-get update against $mirror failed" >&2; exit 3; }
version_of() { chroot "$root" sh -c "apt-cache $apt_opts policy $1" | awk '/Candidate:/ {print $2}'; }
cuda_torch=$(version_of libtorch-cuda-dev)
newest_torch=$(chroot "$root" sh -c "apt-cache $apt_opts madison libtorch-dev" | awk '{print $3}' | sort -V | tail -1)
echo "compile_check: libtorch-cuda-dev $cuda_torch (CUDA), libtorch-dev $newest_torch (newest)" >&2
fetch $work/cuda "libtorch-cuda-dev=$cuda_torch" "nvidia-cuda-dev=$(version_of nvidia-cuda-dev)" \
  "libnccl-dev=$(version_of libnccl-dev)" "libcu++-dev=$(version_of libcu++-dev)" \
  "libcub-dev=$(version_of libcub-dev)" "libthrust-dev=$(version_of libthrust-dev)"
fetch $work/newest "libtorch-dev=$newest_torch"

rm -rf "$root$work/src" && mkdir -p "$root$work/src"
cp -r trainer apps tests "$root$work/src/"
# The version macros moved (LibTorch 2.14: torch/headeronly/version.h, not torch/csrc/api/...).
minor=$(grep -rhs '^#define TORCH_VERSION_MINOR ' "$root$work/newest/usr/include/torch" | awk '{print $3; exit}')
[ -n "$minor" ] || { echo "compile_check: no TORCH_VERSION_MINOR under $work/newest/usr/include/torch" >&2; exit 3; }
standard=gnu++17
[ "${minor:-0}" -ge 12 ] && standard=gnu++20  # as CMakeLists.txt: LibTorch >= 2.12 needs C++20
cat > "$root$work/check_one.sh" << 'EOF'
#!/bin/sh
# check_one.sh PREFIX STANDARD EXTRA_FLAGS FILE: one translation unit, syntax only.
prefix=$1 standard=$2 extra=$3 file=$4
pch="-include trainer/util/torch_pch.h"  # as CMake: the PCH first, except where it skips it
case $file in
  tests/test_main.cpp | tests/test_config.cpp | tests/test_metrics.cpp | tests/rename_then_sigterm.cpp | \
    trainer/dist/dist.cpp | trainer/train/device.cpp) pch="" ;;
esac
if out=$(g++ -std=$standard -fsyntax-only -Wall $pch $extra -D_GLIBCXX_USE_CXX11_ABI=1 -DFMT_SHARED \
  -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -DSPDLOG_SHARED_LIB -DTRAINER_VERSION='"0"' -DUSE_DISTRIBUTED \
  -DUSE_C10D_GLOO -DTRAINER_WITH_GLOO=1 -DTRAINER_SOURCE_DIR='"/"' -DTRAINER_BINARY='"t"' -DPREPROCESS_BINARY='"p"' \
  -DMERGE_BINARY='"m"' -DBENCH_DATA_BINARY='"b"' -DRENAME_THEN_SIGTERM_LIBRARY='"r"' -I. \
  -isystem $prefix/usr/include -isystem $prefix/usr/include/torch/csrc/api/include \
  -isystem /usr/lib/x86_64-linux-gnu/openmpi/include -isystem /opt/catch2v2/usr/include "$file" 2>&1); then
  echo "ok     $file"
else
  echo "FAILED $file"
  echo "$out" | grep -E "error" | head -20
  exit 1
fi
EOF
chmod +x "$root$work/check_one.sh"

status=0
echo "== CUDA and NCCL paths against libtorch-cuda-dev $cuda_torch" >&2
chroot "$root" sh -c "cd $work/src && printf '%s\n' trainer/train/device.cpp trainer/dist/dist.cpp |
  xargs -P $jobs -I{} $work/check_one.sh $work/cuda gnu++17 '-DTRAINER_WITH_CUDA=1 -DTRAINER_WITH_NCCL=1 -DUSE_C10D_NCCL' {}" ||
  status=1
echo "== every translation unit against libtorch-dev $newest_torch (2.$minor, $standard)" >&2
chroot "$root" sh -c "cd $work/src && ls trainer/*/*.cpp apps/*.cpp tests/*.cpp |
  xargs -P $jobs -I{} $work/check_one.sh $work/newest $standard '' {}" || status=1
[ $status = 0 ] && echo "compile_check: every file compiled" >&2 || echo "compile_check: FAILED (above)" >&2
exit $status
