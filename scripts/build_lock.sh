# Sourced by the scripts that build into build/ or run what it holds (setup.sh, run.sh, test.sh):
# one of them at a time per checkout. A second one waits, saying so, for the first: two builds
# overwrite each other's objects, and a rebuild under a running test suite replaces the binaries
# it runs. The lock (flock on build/.lock, fd 9) is held by the calling shell until it exits or
# calls build_unlock; TRAINER_BUILD_LOCK_HELD tells a child script (setup.sh under test.sh) that
# its parent holds it. Commands the holder starts should not inherit fd 9 (`9>&-`), or a process
# they leave behind would hold the lock after them.
build_lock() {
  [ -n "${TRAINER_BUILD_LOCK_HELD:-}" ] && return 0
  mkdir -p build
  exec 9> build/.lock
  if ! flock -n 9; then
    echo "$(basename "$0"): another scripts/ command is building or testing in build/; waiting for it to finish" >&2
    flock 9
  fi
  export TRAINER_BUILD_LOCK_HELD=1
}

build_unlock() {
  exec 9>&-
  unset TRAINER_BUILD_LOCK_HELD
}
