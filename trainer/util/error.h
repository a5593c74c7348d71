// Error types that carry the process exit code documented in docs/config.md (DESIGN section 11).
#pragma once
#include <stdexcept>
#include <string>

namespace trainer {

enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,
  kExitUsage = 2,      // usage or configuration error
  kExitData = 3,       // input data error
  kExitNumerical = 4,  // NaN/Inf abort
  kExitDistributed = 5,
};

// Thrown for every anticipated failure; main() prints what() and exits with exit_code.
class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ExitCode exit_code() const { return code_; }

 private:
  ExitCode code_;
};

inline Error config_error(const std::string& message) { return Error(kExitUsage, message); }

}  // namespace trainer
