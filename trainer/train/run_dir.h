// The run directory on disk: checked before the model is built, created and locked by rank 0 for
// the length of train() (docs/checkpoints.md: one trainer per run_dir).
#pragma once
#include <string>

namespace trainer {

struct Config;

// A generated run_name (config.run_name_stem set) is claimed by creating its directory, which
// one process wins: runs started in the same second all found the name free when their configs
// were resolved, and all but one then failed on the run lock. A lost claim takes the next suffix
// (_1, _2, ...); run_dir and a default metrics_file follow. A directory that cannot be created is
// left to run_dir_create to name. Rank 0 calls it before the model is built; the others adopt
// its name.
void run_dir_claim_generated(Config& config);

// Before a training run builds its model (minutes for a large one): run_dir exists as a directory
// or can be created under its nearest existing ancestor; exit 1 naming both otherwise. Creates
// nothing. Not for exports, which only read run_dir.
void run_dir_check_writable(const std::string& run_dir);

// Creates run_dir and its parents; exit 1 naming it and the reason otherwise.
void run_dir_create(const std::string& run_dir);

// An exclusive flock on <run_dir>/.lock, held while the object lives: a second trainer on the same
// run_dir would resume from checkpoints still being written and overwrite the first's checkpoints
// and metrics. The kernel drops the lock when the process dies. The file names the holder (pid
// and host), which a refused trainer quotes (exit 2). On a filesystem without flock (Lustre
// without -o flock, some FUSE mounts) it warns and holds nothing: held() is false.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& run_dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace trainer
