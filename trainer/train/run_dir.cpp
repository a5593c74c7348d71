// The run directory: the writability check before the model is built, its creation, and the
// lock that keeps a second trainer off it (see run_dir.h).
#include "trainer/train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "trainer/config/config.h"
#include "trainer/util/error.h"

namespace trainer {
namespace fs = std::filesystem;

void run_dir_check_writable(const std::string& run_dir) {
  fs::path existing = fs::absolute(run_dir);
  std::error_code ec;
  while (!fs::exists(existing, ec) && existing.has_parent_path() && existing != existing.parent_path())
    existing = existing.parent_path();
  const bool is_dir = fs::is_directory(existing, ec);
  if (!is_dir || ::access(existing.c_str(), W_OK | X_OK) != 0)
    throw config_error("cannot write the run directory " + run_dir + " (base_output_directory/run_name): " +
                                  existing.string() + (is_dir ? " is not writable" : " is not a directory"));
}

void run_dir_claim_generated(Config& c) {
  if (c.run_name_stem.empty()) return;
  const std::string default_metrics = (fs::path(c.run_dir) / "metrics.jsonl").string();
  std::error_code ec;
  if (!c.base_output_directory.empty()) fs::create_directories(c.base_output_directory, ec);
  for (int n = 1; !fs::create_directory(c.run_dir, ec); ++n) {  // false: it exists (another run's)
    if (ec || n > 100000) return;
    c.run_name = c.run_name_stem + "_" + std::to_string(n);
    c.run_dir = (fs::path(c.base_output_directory) / c.run_name).string();
  }
  if (c.metrics_file == default_metrics) c.metrics_file = (fs::path(c.run_dir) / "metrics.jsonl").string();
}

void run_dir_create(const std::string& run_dir) {
  try {
    fs::create_directories(run_dir);
  } catch (const fs::filesystem_error& e) {
    throw Error(kExitFailure, "cannot create the run directory " + run_dir + " (base_output_directory/run_name): " +
                                  e.code().message());
  }
}

RunDirLock::RunDirLock(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(kExitFailure, "cannot open the run directory's lock file " + path + ": " + std::strerror(errno));
  const bool held_elsewhere = ::flock(fd_, LOCK_EX | LOCK_NB) != 0;
  if (held_elsewhere && errno != EWOULDBLOCK) {
    spdlog::warn("cannot lock {} ({}): nothing stops a second trainer on this run_dir, and what interrupted "
                 "checkpoint saves left in it is not deleted", path, std::strerror(errno));
    ::close(fd_);
    fd_ = -1;
    return;
  }
  if (held_elsewhere) {
    char holder[256] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "unknown";
    while (!who.empty() && who.back() == '\n') who.pop_back();
    throw config_error("run_dir " + run_dir + " is in use by another trainer (" + who + "; lock file " + path +
                       "): wait for it to end, or choose another run_name");
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = "pid " + std::to_string(::getpid()) + " on " + host + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0) { /* the lock holds without the note */ }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace trainer
