// Helpers shared by the tests: configs from the repository's configs/, running the binary.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer/config/config.h"
#include "trainer/model/model.h"

namespace trainer::testing {

// The variables a trainer reads from its environment (config overrides and launchers); the test
// main removes them so no test depends on the caller's shell.
inline bool is_launcher_or_config_variable(const std::string& name) {
  for (const char* prefix : {"M_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MASTER_"})
    if (name.rfind(prefix, 0) == 0) return true;
  for (const char* exact : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"})
    if (name == exact) return true;
  return false;
}

namespace detail {
inline bool& test_root_flag() {
  static bool created = false;
  return created;
}
}  // namespace detail

// This test process's own temporary folder (/tmp/trainer-tests-XXXXXX, made on first use): no
// two tests, and no two suites on one machine, share a path or a data cache.
inline const std::string& test_root() {
  static const std::string root = [] {
    std::string path = "/tmp/trainer-tests-XXXXXX";
    if (!mkdtemp(path.data())) throw std::runtime_error("mkdtemp " + path + " failed");
    detail::test_root_flag() = true;
    return path;
  }();
  return root;
}
inline bool test_root_created() { return detail::test_root_flag(); }

inline std::string source_path(const std::string& relative) {
  return std::string(TRAINER_SOURCE_DIR) + "/" + relative;
}

// Modules are built undrawn (model.h: model_build draws); a test that builds one directly draws
// its weights here, from the global generator.
inline void draw_weights(torch::nn::Module& module, double std) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) p.normal_(0.0, std);
}

// Restores the CPU row loops (cpu_row_kernels_set, on by default) when a test that switched them ends.
struct CpuRowKernelsRestore {
  ~CpuRowKernelsRestore() { cpu_row_kernels_set(true); }
};

// configs/base.yml + the test-tiny model + overrides; the process environment is ignored.
inline Config tiny_config(std::vector<std::string> overrides = {}) {
  std::vector<std::string> all = {"model_name=test-tiny", "max_target_length=16", "run_name=test",
                                  "dataset_type=synthetic", "pad_id=0", "data_shuffle_seed=0",
                                  "base_output_directory=" + test_root()};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return config_load(source_path("configs/base.yml"), all, {});
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Tests run on synthetic data unless they name a dataset_type (base.yml's default is the corpus).
constexpr const char* kSyntheticData = "dataset_type=synthetic pad_id=0 data_shuffle_seed=0";

// Runs a shell command line and waits for it: its exit code (-1 if it did not exit) and its
// stdout and stderr together.
inline CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// Runs `build/trainer <args>` through the shell, with `env` prepended (e.g. "M_STEPS=3").
inline CommandResult run_trainer(const std::string& args, const std::string& env = "") {
  const std::string data = args.find("dataset_type=") == std::string::npos ? kSyntheticData : "";
  return run_command(env + " " + TRAINER_BINARY + " " + source_path("configs/base.yml") + " " + data + " " + args);
}

inline std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The number after "name": in one metrics.jsonl line (NaN/Infinity included); throws if absent.
inline double json_metric(const std::string& line, const std::string& name) {
  const std::string key = "\"" + name + "\": ";
  const auto at = line.find(key);
  if (at == std::string::npos) throw std::runtime_error("metric " + name + " not in: " + line);
  return std::strtod(line.c_str() + at + key.size(), nullptr);
}

}  // namespace trainer::testing

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iterator>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

namespace trainer::testing {

// Starts `build/trainer configs/base.yml <args...>` in the background, output to `log_path`.
inline pid_t spawn_trainer(const std::vector<std::string>& args, const std::string& log_path) {
  std::filesystem::create_directories(std::filesystem::path(log_path).parent_path());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<std::string> all = {TRAINER_BINARY, source_path("configs/base.yml"), "dataset_type=synthetic", "pad_id=0",
                                    "data_shuffle_seed=0"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for `pid`; returns its exit code, or 128 + signal if it was killed.
inline int wait_exit_code(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Owns the processes a test starts: whatever path the test leaves by (a failed REQUIRE, an
// exception), the ones not yet waited for are killed and reaped, so no trainer outlives its test.
class ChildProcesses {
 public:
  ChildProcesses() = default;
  ChildProcesses(const ChildProcesses&) = delete;
  ChildProcesses& operator=(const ChildProcesses&) = delete;
  ~ChildProcesses() {
    // First: mpirun killed by SIGKILL cannot end its ranks. Only a process still running the same
    // command line: the pid of one that exited may belong to another process by now.
    for (const auto& [pid, command] : grandchildren_)
      if (!command.empty() && command_line_of(pid) == command) kill(pid, SIGKILL);
    for (pid_t pid : running_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
  }
  pid_t add(pid_t pid) {
    running_.push_back(pid);
    return pid;
  }
  // A descendant that is not our child (a rank under mpirun): killed at the end if a check failed
  // before it exited.
  void kill_at_end(pid_t pid) { grandchildren_.emplace_back(pid, command_line_of(pid)); }
  int wait(pid_t pid) {  // exit code, or 128 + signal
    running_.erase(std::remove(running_.begin(), running_.end(), pid), running_.end());
    return wait_exit_code(pid);
  }
  // As wait, but nullopt if `pid` is still running after `seconds` (it is killed at the end).
  std::optional<int> wait_for(pid_t pid, double seconds) {
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    running_.erase(std::remove(running_.begin(), running_.end(), pid), running_.end());
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

 private:
  std::vector<pid_t> running_;
  std::vector<std::pair<pid_t, std::string>> grandchildren_;

  static std::string command_line_of(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
};

// Polls `done` every 20 ms for at most `seconds`; returns whether it became true. For waiting on
// an observable event (a log line, a file, a metrics line), never for a fixed time.
template <typename Predicate>
bool wait_until(Predicate done, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace trainer::testing
