// Helpers shared by the tests: configs from the repository's configs/, running the binary.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer::testing {

inline std::string source_path(const std::string& relative) {
  return std::string(TRAINER_SOURCE_DIR) + "/" + relative;
}

// configs/base.yml + the test-tiny model + overrides; the process environment is ignored.
inline Config tiny_config(std::vector<std::string> overrides = {}) {
  std::vector<std::string> all = {"model_name=test-tiny", "max_target_length=16", "run_name=test",
                                  "base_output_directory=" + std::string("/tmp/trainer-tests")};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return config_load(source_path("configs/base.yml"), all, {});
}

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `build/trainer <args>` through the shell, with `env` prepended (e.g. "M_STEPS=3").
inline CommandResult run_trainer(const std::string& args, const std::string& env = "") {
  const std::string command =
      env + " " + TRAINER_BINARY + " " + source_path("configs/base.yml") + " " + args + " 2>&1";
  CommandResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return result;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
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
