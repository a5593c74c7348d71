// Launcher environment resolution (see env.h).
#include "trainer/dist/env.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>

#include <spdlog/spdlog.h>

#include "trainer/util/error.h"

extern char** environ;

namespace trainer {
namespace {

using Environment = std::map<std::string, std::string>;

// The whole value as an integer in [low, high] ("0x", "1.5" and "2abc" are not integers; spaces
// around it and a leading '+' are allowed, as stoll allowed them).
int64_t parse_int(const Environment& env, const std::string& name, int64_t low, int64_t high) {
  const std::string& text = env.at(name);
  const size_t first = text.find_first_not_of(' '), last = text.find_last_not_of(' ');
  std::string digits = first == std::string::npos ? "" : text.substr(first, last - first + 1);
  if (!digits.empty() && digits[0] == '+') digits.erase(0, 1);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size())
    throw config_error("environment variable " + name + "='" + text + "' is not an integer");
  if (value < low || value > high)
    throw config_error("environment variable " + name + "='" + text + "' is not in [" + std::to_string(low) + ", " +
                       std::to_string(high) + "]");
  return value;
}

struct Launcher {
  const char *rank, *size, *local_rank, *local_size, *name;
  bool per_process;  // mpirun and torchrun set every variable for each process they start
};

// Read in this order; the first with both rank and size wins. PMI_* comes before SLURM_*: an MPI
// started with Slurm's bootstrap carries the bootstrap step's SLURM_* (one task per node) beside
// its own correct PMI_*, and srun --mpi=pmi2 sets both consistently.
constexpr Launcher kLaunchers[] = {
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun", true},
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun-style", true},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi", false},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm", false},
};

// c10d takes ranks and sizes as int.
constexpr int64_t kMaxRanks = std::numeric_limits<int32_t>::max();

DistEnv from_launcher(Environment env, const Launcher& l) {
  DistEnv d;
  d.launcher = l.name;
  d.world_size = parse_int(env, l.size, 1, kMaxRanks);
  d.rank = parse_int(env, l.rank, 0, kMaxRanks);
  if (d.rank >= d.world_size)
    throw config_error("launcher environment (" + d.launcher + ") gives rank " + std::to_string(d.rank) +
                       " of world size " + std::to_string(d.world_size));
  const bool has_local_size = env.count(l.local_size) > 0, has_local_rank = env.count(l.local_rank) > 0;
  if (l.per_process) {
    d.local_world_size = has_local_size ? parse_int(env, l.local_size, 1, d.world_size) : d.world_size;
    d.local_rank = has_local_rank ? parse_int(env, l.local_rank, 0, d.local_world_size - 1) : d.rank % d.local_world_size;
    return d;
  }
  // Slurm's and PMI's counts describe the allocation's nodes, which need not match this step
  // (srun -n1 inside an allocation of 8 per node; "1,2(x3)" for uneven nodes, "4(x2)" for 4 on
  // each of 2): the first node's count, then bounded by what this step can hold.
  if (has_local_size) env[l.local_size] = env[l.local_size].substr(0, env[l.local_size].find_first_of("(,"));
  const int64_t local_size = has_local_size ? parse_int(env, l.local_size, 1, kMaxRanks) : d.world_size;
  const int64_t local_rank = has_local_rank ? parse_int(env, l.local_rank, 0, kMaxRanks) : d.rank % local_size;
  d.local_world_size = std::min(std::max(local_size, local_rank + 1), d.world_size);
  d.local_rank = std::min(local_rank, d.local_world_size - 1);
  return d;
}

}  // namespace

DistEnv dist_env_resolve(const std::vector<std::string>& environment) {
  Environment env;
  for (const auto& e : environment)
    if (const auto eq = e.find('='); eq != std::string::npos) env[e.substr(0, eq)] = e.substr(eq + 1);
  const auto has_pair = [&](const Launcher& l) { return env.count(l.rank) > 0 && env.count(l.size) > 0; };
  const Launcher* chosen = nullptr;
  for (const Launcher& l : kLaunchers)
    if (!chosen && has_pair(l)) chosen = &l;
  DistEnv d;
  if (chosen) {
    d = from_launcher(env, *chosen);
  } else {
    // Half of mpirun's or torchrun's pair and no launcher at all: a launch gone wrong, which
    // used to run as a single process. (Beside a complete launcher, e.g. an sbatch script's
    // exported WORLD_SIZE under srun, a half pair is not read.)
    for (const Launcher& l : kLaunchers)
      if (l.per_process && (env.count(l.rank) > 0 || env.count(l.size) > 0))
        throw config_error(std::string("environment variable ") + (env.count(l.rank) ? l.rank : l.size) + " is set but " +
                           (env.count(l.rank) ? l.size : l.rank) + " is not: set both (a " + l.name + " launch) or neither");
  }
  // Another per-process launcher's complete pair that says otherwise (mpirun inside a job that
  // exports RANK/WORLD_SIZE for itself): the first wins, as always, but not silently.
  for (const Launcher& l : kLaunchers)
    if (chosen && &l != chosen && l.per_process && has_pair(l) &&
        (env[l.rank] != std::to_string(d.rank) || env[l.size] != std::to_string(d.world_size)))
      spdlog::warn("the environment also holds {}={} {}={} ({}), which differ from {}'s rank {} of {}: using {}'s",
                   l.rank, env[l.rank], l.size, env[l.size], l.name, d.launcher, d.rank, d.world_size, d.launcher);
  // The rendezvous address. Both set: checked and used. One alone is an error only where it
  // would be needed (several ranks and a launcher that does not agree on one by itself).
  const bool has_addr = env.count("MASTER_ADDR") > 0, has_port = env.count("MASTER_PORT") > 0;
  if (has_addr && has_port) {
    if (env["MASTER_ADDR"].empty()) throw config_error("environment variable MASTER_ADDR is empty");
    d.master_addr = env["MASTER_ADDR"];
    d.master_port = static_cast<int>(parse_int(env, "MASTER_PORT", 1, 65535));
  } else if ((has_addr || has_port) && d.world_size > 1 && d.launcher != "mpirun") {
    throw config_error(std::string("environment variable ") + (has_addr ? "MASTER_ADDR" : "MASTER_PORT") + " is set but " +
                       (has_addr ? "MASTER_PORT" : "MASTER_ADDR") + " is not: set both");
  }
  return d;
}

DistEnv dist_env_resolve() {
  std::vector<std::string> environment;
  for (char** e = environ; e && *e; ++e) environment.emplace_back(*e);
  return dist_env_resolve(environment);
}

}  // namespace trainer
