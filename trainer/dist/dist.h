// Public face of dist/: the launch environment (env.h) and a communicator for data parallelism:
// c10d ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) over a TCPStore (docs/distributed.md).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer/dist/env.h"

namespace trainer {

// A collective started without waiting (Communicator::all_gather_start). wait() finishes it, with
// the same timeout and errors as the blocking call; the destructor of an unfinished one waits too.
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  virtual void wait() = 0;
};

// Collectives of one data-parallel group. With one process every call is a no-op. Every
// collective waits at most `timeout_seconds`; a failure or timeout throws trainer::Error with
// exit code 5 naming the operation and this rank.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // In-place sum over ranks (a tensor on the host or on this rank's device).
  virtual void all_reduce_sum(torch::Tensor& tensor, const std::string& what) = 0;
  // all_reduce_sum of a 1-D tensor in buckets of `bucket` elements, one after another; bucket i
  // is named "<what> at element <first + i bucket>" (`first`: where the tensor starts in the
  // buffer the caller names).
  void all_reduce_sum_in_buckets(const torch::Tensor& tensor, int64_t bucket, const std::string& what, int64_t first = 0);
  // In-place all-gather: `parts` are world_size() equal-sized tensors on this rank's device;
  // parts[rank()] holds this rank's data on entry, and every part holds its rank's data on return.
  // The parts may be views of one buffer (the ZeRO-1 parameter arena), so nothing is copied twice.
  virtual void all_gather(std::vector<torch::Tensor>& parts, const std::string& what) = 0;
  // all_gather started, not finished: the parts must stay untouched until wait() returns. Ranks
  // start their collectives in the same order (the prefetch of the next decoder layer's weights).
  virtual std::unique_ptr<PendingCollective> all_gather_start(std::vector<torch::Tensor>& parts, const std::string& what);
  // Sum over ranks of world_size() equal-sized `parts` (on this rank's device), part r landing in
  // rank r's `output`. Where !has_reduce_scatter() it is emulated: the parts are all-reduced
  // together and this rank's copied out (twice the bytes; for tests of the callers' path).
  virtual void reduce_scatter_sum(std::vector<torch::Tensor>& parts, torch::Tensor& output, const std::string& what);
  // Whether the backend has a reduce-scatter: NCCL; Gloo (LibTorch 1.13 and 2.6) has
  // none. Decided by the first call, a collective of one element per rank (every member calls it).
  virtual bool has_reduce_scatter() = 0;
  // All-to-all of rows (expert parallelism): input rows [sum(input_splits[<d]), + input_splits[d])
  // go to rank d; output (sum(output_splits) rows, allocated by the caller) receives
  // output_splits[s] rows from rank s, in rank order. Row width and dtype must agree on all ranks.
  virtual void all_to_all(torch::Tensor& output, const torch::Tensor& input, const std::vector<int64_t>& output_splits,
                          const std::vector<int64_t>& input_splits, const std::string& what) = 0;
  // The communicator of a subgroup: `ranks` are ranks of this group, ascending, this rank among
  // them. Every member calls it with the same ranks and tag, which must be unique among this
  // group's subgroups. A subgroup of one rank is local (its collectives are copies or no-ops).
  virtual std::unique_ptr<Communicator> split(const std::vector<int64_t>& ranks, const std::string& tag) = 0;
  // Rank 0's string on every rank (through the rendezvous store).
  virtual std::string broadcast_string(const std::string& key, const std::string& value) = 0;
  // After work only rank 0 does, which may outlast any collective timeout (writing an unsharded
  // checkpoint, waiting for the previous one), every rank calls it with the same key: rank 0 sets
  // the key in the rendezvous store, the others wait for it as long as rank 0 lives (it serves
  // the store), with a warning each collective timeout. Exit 5 when the store goes away.
  virtual void wait_for_rank0(const std::string& /*key*/, const std::string& /*what*/) {}
  // True for the one-process stand-in without a process group (collectives are skipped).
  virtual bool is_local() const { return false; }
  // The communicator for values the host already holds (a step's token count, the stop vote):
  // this one where its backend takes host tensors (Gloo, the local stand-in); under NCCL, which
  // takes device tensors only, a Gloo group over the same ranks, so summing them never waits for
  // the device. Its collectives and bytes are its own (not counted in this one's).
  virtual Communicator& host_group() { return *this; }
  int64_t collectives() const { return collectives_; }  // collectives so far
  // Bytes this rank sent in them, as ring algorithms move data: an all-reduce of n bytes sends
  // 2 (R-1)/R n, an all-gather of R parts of n bytes sends n, an all-to-all the rows that
  // leave this rank.
  double bytes_sent() const { return bytes_sent_; }

 protected:
  int64_t collectives_ = 0;
  double bytes_sent_ = 0;
};

struct DistOptions {
  double timeout_seconds = 300;  // collective_timeout_seconds
  std::string backend = "auto";  // dist_backend: auto | gloo | nccl
  torch::Device device = torch::Device(torch::kCPU);  // this rank's compute device
};

// How many ranks report `mine` (one all-reduce; 0/1 without a process group): lets every rank
// stop together on a condition only some of them see.
int64_t ranks_reporting(bool mine, Communicator& comm, const std::string& what);

// Runs `work`, which may fail on some ranks only (rank 0's files), and makes a failure there every
// rank's: one all-reduce of the ranks' exit codes. The failing rank rethrows its own error; the
// others throw its exit code, naming it ("rank 0 failed <what> (exit code 1; its log says why)"),
// at once, instead of waiting out collective_timeout_seconds in their next collective and
// exiting 5 (a torchrun-style launch has no mpirun to take them down).
void ranks_share_failure(Communicator& comm, const std::string& what, const std::function<void()>& work);

// "auto" -> "nccl" for a CUDA device, "gloo" otherwise; a named backend is kept.
std::string dist_backend_resolve(const std::string& requested, const torch::Device& device);

// world_size 1 with backend auto: a no-op communicator. Otherwise rendezvous (MASTER_ADDR/
// MASTER_PORT, agreed through MPI under mpirun, or a local port for one process), a Gloo or
// NCCL process group, and a preflight all-reduce.
std::unique_ptr<Communicator> dist_init(const DistEnv& env, const DistOptions& options);

}  // namespace trainer
