#!/usr/bin/env bash
# Builds trainer against LibTorch 2.x and runs every test there: Debian 13's libtorch-dev 2.6
# (CPU) in a chroot made with debootstrap (TRAINER_TORCH2_SUITE=sid: unstable's, the newest
# LibTorch Debian has, 2.14 on 2026-12-07; not part of scripts/test.sh, since unstable moves).
# This compiles and runs the 2.x side of trainer/util/torch_compat.h (fused attention, the 2.x
# autocast API, the TCPStore backend switch, the allocator interface) on machines without a GPU;
# only the CUDA-specific code is left to scripts/gpu/. Needs root (debootstrap, chroot, mounts;
# re-runs itself with sudo) and Debian's package mirror. The chroot is kept between runs (about 3 GB; the first run takes ~13 minutes in CI,
# 3 of them for the chroot) and refreshed from the working tree each time.
#   scripts/test_libtorch2.sh [ctest args]      TRAINER_TORCH2_ROOT picks the chroot's folder
#   TRAINER_TORCH2_SUITE=sid scripts/test_libtorch2.sh -R checkpoint       (own chroot, /var/tmp/trainer-sid)
# TRAINER_SKIP_TORCH2=1 skips it, loudly (for machines without root or mirror access).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${TRAINER_SKIP_TORCH2:-0}" = 1 ]; then
  echo "test_libtorch2: SKIPPED (TRAINER_SKIP_TORCH2=1): the LibTorch 2.x suite did not run" >&2
  exit 0
fi
[ "$(id -u)" -eq 0 ] ||
  exec sudo --preserve-env=JOBS,TRAINER_TORCH2_ROOT,TRAINER_TORCH2_MIRROR,TRAINER_TORCH2_SUITE "$0" "$@"
suite=${TRAINER_TORCH2_SUITE:-trixie}
case $suite in
  trixie | sid) ;;
  *) echo "test_libtorch2: TRAINER_TORCH2_SUITE=$suite: trixie (the default) or sid" >&2; exit 2 ;;
esac
root=${TRAINER_TORCH2_ROOT:-/var/tmp/trainer-$suite}
mirror=${TRAINER_TORCH2_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$(dirname "$root")"
exec 9> "$root.lock"
flock -n 9 || { echo "test_libtorch2: another run holds $root.lock" >&2; exit 3; }

# The chroot's own packages: the same list as scripts/setup.sh, from Debian 13 (trixie) or
# unstable. Catch2 is the exception: both have v3, the tests use v2, whose header and CMake
# files (and its small static library) are copied from the host.
PACKAGES="g++ cmake make ccache pkg-config libtorch-dev libgloo-dev libopenmpi-dev openmpi-bin
  libopenblas0-pthread libyaml-cpp-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libsentencepiece-dev
  fortunes python3 python3-numpy python3-torch"
# unstable's sentencepiece_processor.h includes Abseil's headers without depending on them.
[ "$suite" = sid ] && PACKAGES="$PACKAGES libabsl-dev"
stamp="$root/.trainer-ready"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PACKAGES" ]; then
  command -v debootstrap > /dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
  [ -d /usr/include/catch2 ] || { echo "test_libtorch2: Catch2 v2 missing on the host (run scripts/setup.sh)" >&2; exit 3; }
  echo "test_libtorch2: creating the Debian $suite chroot in $root" >&2
  # debootstrap removes $root/debootstrap/ when it succeeds: its presence means an interrupted run.
  if [ ! -x "$root/usr/bin/apt-get" ] || [ -d "$root/debootstrap" ]; then
    debootstrap --variant=minbase "$suite" "$root" "$mirror" > "$root.debootstrap.log" 2>&1 ||
      { tail -20 "$root.debootstrap.log" >&2; echo "test_libtorch2: debootstrap failed (log $root.debootstrap.log)" >&2; exit 3; }
  fi
  # Valid-Until is not checked (signatures are): a mirror snapshot's unstable Release file
  # expires within days, and an expired one only means no newer packages than the snapshot's.
  apt="apt-get -o Acquire::Check-Valid-Until=false"
  chroot "$root" sh -c "$apt update -qq && DEBIAN_FRONTEND=noninteractive $apt install -y -qq \
    --no-install-recommends $(echo $PACKAGES)" > "$root.apt.log" 2>&1 ||
    { tail -20 "$root.apt.log" >&2; echo "test_libtorch2: apt-get in the chroot failed (log $root.apt.log)" >&2; exit 3; }
  mkdir -p "$root/opt/catch2v2/usr/include" "$root/opt/catch2v2/usr/lib/cmake"
  cp -r /usr/include/catch2 "$root/opt/catch2v2/usr/include/"
  cp -r /usr/lib/cmake/Catch2 "$root/opt/catch2v2/usr/lib/cmake/"
  cp /usr/lib/libCatch2*.a "$root/opt/catch2v2/usr/lib/"
  echo "$PACKAGES" > "$stamp"
fi

# Host name resolution (the rendezvous uses the host name) and the kernel interfaces the tests
# read (/proc for process age and RSS, /dev/shm for Open MPI). Every mount under $root, also one
# left by an interrupted run, is undone on exit (lazily if busy), so deleting $root never reaches
# the host's /dev.
cp /etc/hosts "$root/etc/hosts"
mounts=(proc dev dev/shm)
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    mountpoint -q "$root/${mounts[i]}" && { umount "$root/${mounts[i]}" 2> /dev/null || umount -l "$root/${mounts[i]}"; }
  done
  if findmnt -R "$root" > /dev/null 2>&1; then
    echo "test_libtorch2: WARNING: still mounted under $root (do not delete it before unmounting):" >&2
    findmnt -R "$root" >&2
  fi
}
trap cleanup EXIT
mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
mountpoint -q "$root/dev" || mount --bind /dev "$root/dev"
mountpoint -q "$root/dev/shm" || mount --bind /dev/shm "$root/dev/shm"

# The working tree (tracked and untracked, not ignored; deleted files are skipped with a warning)
# replaces the chroot's copy; its build folder and the corpus are kept, so a second run rebuilds
# only what changed.
mkdir -p "$root/src"
find "$root/src" -mindepth 1 -maxdepth 1 ! -name build ! -name data -exec rm -rf {} +
git -c safe.directory="$PWD" ls-files -co --exclude-standard -z |
  tar -c --null --ignore-failed-read -T - -f - | tar -x -f - -C "$root/src"
chroot "$root" env CCACHE_DIR=/var/cache/ccache JOBS="${JOBS:-2}" bash -c '
  set -euo pipefail
  cd /src
  echo "test_libtorch2: $(dpkg-query -W -f="libtorch-dev \${Version}, " libtorch-dev)$(g++ --version | head -1)" >&2
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=/opt/catch2v2/usr > build.cmake.log 2>&1 ||
    { cat build.cmake.log >&2; exit 1; }
  rm -f build.cmake.log
  cmake --build build -j "$JOBS"
  scripts/prepare_corpus.sh
  cd build
  ctest --output-on-failure -j 1 "$@"' test_libtorch2 "$@"
