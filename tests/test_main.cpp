// Catch2 main for trainer_tests, in its own translation unit so test files rebuild quickly. Before
// any test runs it makes the process independent of the caller: the launcher and config variables
// a trainer reads (M_*, RANK, WORLD_SIZE, LOCAL_RANK, OMPI_*, PMI_*, SLURM_*, MASTER_*) are removed,
// so in-process Trainers and every child trainer see a clean environment. Each test process gets
// its own temporary root (test_root()), removed when all its tests passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "test_support.h"

extern char** environ;

int main(int argc, char** argv) {
  std::vector<std::string> names;
  for (char** entry = environ; *entry; ++entry) {
    const std::string variable(*entry);
    const std::string name = variable.substr(0, variable.find('='));
    if (trainer::testing::is_launcher_or_config_variable(name)) names.push_back(name);
  }
  for (const auto& name : names) unsetenv(name.c_str());
  Catch::Session session;
  if (const int usage = session.applyCommandLine(argc, argv); usage != 0) return usage;
  const int failed = session.run();  // with a --list option: the number listed, not failures
  const auto& options = session.configData();
  const bool listing = options.listTests || options.listTestNamesOnly || options.listTags || options.listReporters;
  if (trainer::testing::test_root_created()) {
    const std::string& root = trainer::testing::test_root();
    if (failed == 0 || listing || std::filesystem::is_empty(root))
      std::filesystem::remove_all(root);
    else
      std::fprintf(stderr, "test files kept in %s\n", trainer::testing::test_root().c_str());
  }
  return failed;
}
