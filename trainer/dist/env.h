// The launch environment (plain C++): rank, local rank and world size from any launcher.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct DistEnv {
  int64_t rank = 0, local_rank = 0, world_size = 1, local_world_size = 1;
  std::string launcher = "single process";  // "mpirun", "slurm", "pmi", "torchrun-style"
  std::string master_addr;  // MASTER_ADDR, "" when unset (then mpirun agrees on one, or a local port)
  int master_port = 0;      // MASTER_PORT, 1..65535 when set
};

// Resolves the launch environment ("NAME=value" strings) in one place: OMPI_COMM_WORLD_*,
// RANK / WORLD_SIZE / LOCAL_RANK, PMI_*, or SLURM_* (the first complete pair wins), and
// MASTER_ADDR / MASTER_PORT. Throws trainer::Error (exit 2) naming the variable on nonsense: a
// value that is not wholly an integer or is out of range, half of mpirun's or torchrun's pair
// with no launcher set, an address without a port where one is needed.
DistEnv dist_env_resolve(const std::vector<std::string>& environment);
DistEnv dist_env_resolve();  // from the process environment

}  // namespace trainer
