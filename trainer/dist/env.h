// The launch environment (plain C++): rank, local rank and world size from any launcher.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct DistEnv {
  int64_t rank = 0, local_rank = 0, world_size = 1, local_world_size = 1;
  std::string launcher = "single process";  // "mpirun", "slurm", "pmi", "torchrun-style"
};

// Resolves the launch environment ("NAME=value" strings) in one place: OMPI_COMM_WORLD_*,
// RANK / WORLD_SIZE / LOCAL_RANK, SLURM_*, or PMI_*. Throws trainer::Error (exit 2) on nonsense.
DistEnv dist_env_resolve(const std::vector<std::string>& environment);
DistEnv dist_env_resolve();  // from the process environment

}  // namespace trainer
