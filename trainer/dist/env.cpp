// Launcher environment resolution (see env.h).
#include "trainer/dist/env.h"

#include <charconv>
#include <limits>
#include <map>

#include "trainer/util/error.h"

extern char** environ;

namespace trainer {
namespace {

using Environment = std::map<std::string, std::string>;

// The whole value as an integer in [low, high] ("0x", "1.5" and "2abc" are not integers).
int64_t parse_int(const Environment& env, const std::string& name, int64_t low, int64_t high) {
  const std::string& text = env.at(name);
  int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size())
    throw config_error("environment variable " + name + "='" + text + "' is not an integer");
  if (value < low || value > high)
    throw config_error("environment variable " + name + "='" + text + "' is not in [" + std::to_string(low) + ", " +
                       std::to_string(high) + "]");
  return value;
}

struct Launcher {
  const char *rank, *size, *local_rank, *local_size, *name;
  bool strict;  // set by the launcher for each process: one of the pair without the other is a mistake
};

// mpirun and torchrun set these per process. Inside a Slurm allocation SLURM_* (and some MPI
// stacks' PMI_*) describe the job step and may sit beside another launcher's variables, so they
// are read last and not cross-checked.
constexpr Launcher kLaunchers[] = {
    {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun", true},
    {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun-style", true},
    {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm", false},
    {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi", false},
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
  // Slurm writes "4(x2)" for 4 tasks on each of 2 nodes: the count per node is the number.
  if (!l.strict && env.count(l.local_size)) env[l.local_size] = env[l.local_size].substr(0, env[l.local_size].find_first_of("(,"));
  d.local_world_size = env.count(l.local_size) ? parse_int(env, l.local_size, 1, d.world_size) : d.world_size;
  d.local_rank = env.count(l.local_rank) ? parse_int(env, l.local_rank, 0, d.local_world_size - 1) : d.rank % d.local_world_size;
  return d;
}

}  // namespace

DistEnv dist_env_resolve(const std::vector<std::string>& environment) {
  Environment env;
  for (const auto& e : environment)
    if (const auto eq = e.find('='); eq != std::string::npos) env[e.substr(0, eq)] = e.substr(eq + 1);
  std::vector<DistEnv> found;  // of the strict launchers, to compare
  DistEnv d;
  bool resolved = false;
  for (const Launcher& l : kLaunchers) {
    const bool has_rank = env.count(l.rank) > 0, has_size = env.count(l.size) > 0;
    if (l.strict && has_rank != has_size)
      throw config_error(std::string("environment variable ") + (has_rank ? l.rank : l.size) + " is set but " +
                         (has_rank ? l.size : l.rank) + " is not: set both (a " + l.name + " launch) or neither");
    if (!has_rank || !has_size) continue;
    if (l.strict) found.push_back(from_launcher(env, l));
    if (!resolved) {
      d = l.strict ? found.back() : from_launcher(env, l);
      resolved = true;
    }
  }
  if (found.size() == 2 && (found[0].rank != found[1].rank || found[0].world_size != found[1].world_size))
    throw config_error("the environment holds two launches: " + found[0].launcher + " says rank " +
                       std::to_string(found[0].rank) + " of " + std::to_string(found[0].world_size) + ", " +
                       found[1].launcher + " says rank " + std::to_string(found[1].rank) + " of " +
                       std::to_string(found[1].world_size) + "; unset one of them");
  // The rendezvous address, where the launcher does not agree on one by itself.
  const bool has_addr = env.count("MASTER_ADDR") > 0, has_port = env.count("MASTER_PORT") > 0;
  if (has_addr != has_port)
    throw config_error(std::string("environment variable ") + (has_addr ? "MASTER_ADDR" : "MASTER_PORT") + " is set but " +
                       (has_addr ? "MASTER_PORT" : "MASTER_ADDR") + " is not: set both or neither");
  if (has_addr) {
    if (env["MASTER_ADDR"].empty()) throw config_error("environment variable MASTER_ADDR is empty");
    d.master_addr = env["MASTER_ADDR"];
    d.master_port = static_cast<int>(parse_int(env, "MASTER_PORT", 1, 65535));
  }
  return d;
}

DistEnv dist_env_resolve() {
  std::vector<std::string> environment;
  for (char** e = environ; e && *e; ++e) environment.emplace_back(*e);
  return dist_env_resolve(environment);
}

}  // namespace trainer
