#!/usr/bin/env bash
# Builds trainer against LibTorch 2.x and runs every test there: Debian 13's libtorch-dev 2.6
# (CPU) in a chroot made with debootstrap. This compiles and runs the 2.x side of
# trainer/util/torch_compat.h (fused attention, the 2.x autocast API, the TCPStore backend
# switch) on machines without a GPU; only the CUDA-specific code is left to scripts/gpu/.
# Needs root (debootstrap, chroot, mounts) and Debian's package mirror. The chroot is kept between
# runs (about 2.5 GB; first run ~3 min to create) and refreshed from the working tree each time.
#   scripts/test_libtorch2.sh [ctest args]      TRAINER_TORCH2_ROOT picks the chroot's folder
set -euo pipefail
cd "$(dirname "$0")/.."
root=${TRAINER_TORCH2_ROOT:-/var/tmp/trainer-trixie}
mirror=${TRAINER_TORCH2_MIRROR:-http://deb.debian.org/debian}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

# The chroot's own packages: the same list as scripts/setup.sh, from Debian 13 (trixie). Catch2
# is the exception: trixie has v3, the tests use v2, which is header-only and copied from the host.
PACKAGES="g++ cmake make ccache pkg-config libtorch-dev libgloo-dev libopenmpi-dev openmpi-bin
  libopenblas0-pthread libyaml-cpp-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libsentencepiece-dev
  fortunes python3 python3-numpy python3-torch"
stamp="$root/.trainer-ready"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PACKAGES" ]; then
  command -v debootstrap > /dev/null || {
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap; }
  [ -d /usr/include/catch2 ] || { echo "test_libtorch2: Catch2 v2 missing on the host (run scripts/setup.sh)" >&2; exit 3; }
  echo "test_libtorch2: creating the Debian 13 chroot in $root" >&2
  [ -x "$root/usr/bin/apt-get" ] ||
    $SUDO debootstrap --variant=minbase trixie "$root" "$mirror" > "$root.debootstrap.log" 2>&1 ||
    { tail -20 "$root.debootstrap.log" >&2; echo "test_libtorch2: debootstrap failed (log $root.debootstrap.log)" >&2; exit 3; }
  $SUDO chroot "$root" sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends $(echo $PACKAGES)" > "$root.apt.log" 2>&1 ||
    { tail -20 "$root.apt.log" >&2; echo "test_libtorch2: apt-get in the chroot failed (log $root.apt.log)" >&2; exit 3; }
  $SUDO mkdir -p "$root/opt/catch2v2/usr/include" "$root/opt/catch2v2/usr/lib/cmake"
  $SUDO cp -r /usr/include/catch2 "$root/opt/catch2v2/usr/include/"
  $SUDO cp -r /usr/lib/cmake/Catch2 "$root/opt/catch2v2/usr/lib/cmake/"
  $SUDO cp /usr/lib/libCatch2*.a "$root/opt/catch2v2/usr/lib/"
  echo "$PACKAGES" | $SUDO tee "$stamp" > /dev/null
fi

# Host name resolution (the rendezvous uses the host name) and the kernel interfaces the tests
# read (/proc for process age and RSS, /dev/shm for Open MPI); unmounted on exit.
$SUDO cp /etc/hosts "$root/etc/hosts"
mounted=()
cleanup() { for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do $SUDO umount "${mounted[i]}" || true; done; }
trap cleanup EXIT
mount_once() {  # type-or-bind source target
  mountpoint -q "$root/$3" && return 0
  $SUDO mkdir -p "$root/$3"
  if [ "$1" = bind ]; then $SUDO mount --bind "$2" "$root/$3"; else $SUDO mount -t "$1" "$2" "$root/$3"; fi
  mounted+=("$root/$3")
}
mount_once proc proc proc
mount_once bind /dev dev
mount_once bind /dev/shm dev/shm

# The working tree (tracked and untracked, not ignored) replaces the chroot's copy; its build
# folder and the corpus are kept, so a second run rebuilds only what changed.
$SUDO mkdir -p "$root/src"
$SUDO find "$root/src" -mindepth 1 -maxdepth 1 ! -name build ! -name data -exec rm -rf {} +
git ls-files -co --exclude-standard -z | $SUDO tar -c --null -T - -f - | $SUDO tar -x -f - -C "$root/src"
$SUDO chroot "$root" env CCACHE_DIR=/var/cache/ccache JOBS="${JOBS:-2}" bash -c '
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
