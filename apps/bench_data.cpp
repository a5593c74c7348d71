// bench_data: how fast the data loader produces micro-batches for a config, without a model.
// Usage: build/bench_data configs/base.yml [key=value ...] [--steps N]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "trainer/config/config.h"
#include "trainer/data/data.h"
#include "trainer/util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"bench_data: data loader throughput"};
  std::string config_path;
  std::vector<std::string> overrides;
  int64_t steps = 100;
  app.add_option("config", config_path)->required();
  app.add_option("overrides", overrides);
  app.add_option("--steps", steps, "optimizer steps of micro-batches to produce");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? trainer::kExitOk : trainer::kExitUsage;  // usage errors exit 2 (DESIGN section 11)
  }
  try {
    const trainer::Config c = trainer::config_load(config_path, overrides);
    const auto build_start = std::chrono::steady_clock::now();
    const trainer::DataLoader loader(c, 0);
    const double build = std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count();
    const auto start = std::chrono::steady_clock::now();
    int64_t tokens = 0, checksum = 0;
    for (int64_t s = 0; s < std::min(steps, c.steps); ++s)
      for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
        const auto b = loader.data_loader_next(s, m);
        tokens += b.batch_size * b.seq_len;
        checksum += b.inputs[0];
      }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("loader setup %.3f s; %lld tokens in %.3f s = %.0f tokens/s (checksum %lld)\n", build,
                static_cast<long long>(tokens), seconds, tokens / seconds, static_cast<long long>(checksum));
    return 0;
  } catch (const trainer::Error& e) {
    std::fprintf(stderr, "bench_data: %s\n", e.what());
    return e.exit_code();
  }
}
