// Launcher environment resolution (see env.h).
#include "trainer/dist/env.h"

#include <map>

#include "trainer/util/error.h"

extern char** environ;

namespace trainer {
namespace {

int64_t parse_int(const std::map<std::string, std::string>& env, const std::string& name) {
  try {
    return std::stoll(env.at(name));
  } catch (const std::exception&) {
    throw config_error("environment variable " + name + "='" + env.at(name) + "' is not an integer");
  }
}

}  // namespace

DistEnv dist_env_resolve(const std::vector<std::string>& environment) {
  std::map<std::string, std::string> env;
  for (const auto& e : environment)
    if (const auto eq = e.find('='); eq != std::string::npos) env[e.substr(0, eq)] = e.substr(eq + 1);
  DistEnv d;
  auto take = [&](const char* rank, const char* size, const char* local_rank, const char* local_size, const char* name) {
    if (!env.count(rank) || !env.count(size)) return false;
    d.rank = parse_int(env, rank);
    d.world_size = parse_int(env, size);
    d.local_rank = env.count(local_rank) ? parse_int(env, local_rank) : d.rank;
    d.local_world_size = env.count(local_size) ? parse_int(env, local_size) : d.world_size;
    d.launcher = name;
    return true;
  };
  take("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun") ||
      take("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun-style") ||
      take("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm") ||
      take("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi");
  if (d.world_size < 1 || d.rank < 0 || d.rank >= d.world_size)
    throw config_error("launcher environment (" + d.launcher + ") gives rank " + std::to_string(d.rank) +
                       " of world size " + std::to_string(d.world_size));
  return d;
}

DistEnv dist_env_resolve() {
  std::vector<std::string> environment;
  for (char** e = environ; e && *e; ++e) environment.emplace_back(*e);
  return dist_env_resolve(environment);
}

}  // namespace trainer
