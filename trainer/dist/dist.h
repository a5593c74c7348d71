// Public face of dist/: the launch environment (env.h) and a
// communicator for data parallelism: c10d ProcessGroupGloo over a TCPStore (docs/distributed.md).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer/dist/env.h"

namespace trainer {

// Collectives of one data-parallel group. With one process every call is a no-op. Every
// collective waits at most `timeout_seconds`; a failure or timeout throws trainer::Error with
// exit code 5 naming the operation and this rank.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // In-place sum over ranks of a CPU tensor.
  virtual void all_reduce_sum(torch::Tensor& tensor, const std::string& what) = 0;
  // Rank 0's string on every rank (through the rendezvous store).
  virtual std::string broadcast_string(const std::string& key, const std::string& value) = 0;
  int64_t collectives() const { return collectives_; }  // all-reduces so far

 protected:
  int64_t collectives_ = 0;
};

// world_size 1: a no-op communicator. Otherwise rendezvous (MASTER_ADDR/MASTER_PORT, or agreed
// through MPI under mpirun), a Gloo process group, and a preflight all-reduce.
std::unique_ptr<Communicator> dist_init(const DistEnv& env, double timeout_seconds);

}  // namespace trainer
