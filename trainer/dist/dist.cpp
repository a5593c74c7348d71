// Launcher environment and the c10d communicators, Gloo and NCCL (see dist.h).
#include "trainer/dist/dist.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include <spdlog/spdlog.h>

#if TRAINER_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if TRAINER_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#if TRAINER_WITH_GLOO || TRAINER_WITH_NCCL
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#if TRAINER_WITH_MPI
#include <mpi.h>
#endif

#include "trainer/util/error.h"
#include "trainer/util/torch_compat.h"

namespace trainer {
namespace {

Error dist_error(const std::string& message) { return Error(kExitDistributed, message); }

class FinishedCollective : public PendingCollective {
 public:
  void wait() override {}
};


class LocalCommunicator : public Communicator {
 public:
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  bool is_local() const override { return true; }
  void all_reduce_sum(torch::Tensor&, const std::string&) override {}
  void all_gather(std::vector<torch::Tensor>&, const std::string&) override {}
  void reduce_scatter_sum(std::vector<torch::Tensor>& parts, torch::Tensor& output, const std::string&) override {
    output.copy_(parts.at(0));
  }
  bool has_reduce_scatter() override { return true; }
  void all_to_all(torch::Tensor& output, const torch::Tensor& input, const std::vector<int64_t>&,
                  const std::vector<int64_t>&, const std::string&) override {
    output.copy_(input);
  }
  std::unique_ptr<Communicator> split(const std::vector<int64_t>&, const std::string&) override {
    return std::make_unique<LocalCommunicator>();
  }
  std::string broadcast_string(const std::string&, const std::string& value) override { return value; }
};

#if TRAINER_WITH_GLOO || TRAINER_WITH_NCCL
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Every rank of one launch must have rank 0's world size: ranks that disagree fail inside Gloo's
// address exchange with "enforce fail at .../address.cc: sizeof(impl_) == bytes.size()". Rank 0
// publishes its world size in the store; another rank that differs leaves a note there, which
// rank 0 quotes when its own group cannot form (world_size_note), and exits 2 naming both. (A
// rank 0 with the larger world size waits for clients that never come: the store's timeout
// says so.)
constexpr const char* kWorldSizeKey = "trainer/world_size";
constexpr const char* kWorldSizeNoteKey = "trainer/world_size_disagreement";

void world_size_agree(c10d::Store& store, const DistEnv& env) {
  const std::string mine = std::to_string(env.world_size);
  if (env.rank == 0) return store.set(kWorldSizeKey, std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto bytes = store.get(kWorldSizeKey);
  const std::string rank0(bytes.begin(), bytes.end());
  if (rank0 == mine) return;
  const std::string note =
      "rank " + std::to_string(env.rank) + " was started with world size " + mine + ", rank 0 with " + rank0;
  store.set(kWorldSizeNoteKey, std::vector<uint8_t>(note.begin(), note.end()));
  throw config_error(note + " (" + env.launcher + " launch): every process of one launch needs the same world size");
}

std::string world_size_note(c10d::Store& store) {
  try {
    if (!store.check({kWorldSizeNoteKey})) return "";
    const auto bytes = store.get(kWorldSizeNoteKey);
    return "; " + std::string(bytes.begin(), bytes.end());
  } catch (const std::exception&) {
    return "";
  }
}

// Rank 0 waits for the others at the store; when they never come, the likely cause is a launch
// that started fewer processes than its environment announces: an sbatch script that runs the
// trainer itself (one process) while SLURM_NTASKS counts the allocation's tasks.
// Only said after a failure that took the whole timeout (not, e.g., a port in use).
// `begin`: when the step that failed began (only one that took the whole timeout is a wait for
// ranks); `waiting_since`: when rank 0 began to wait, for the time reported.
std::string rendezvous_hint(const DistEnv& env, std::chrono::milliseconds timeout,
                            std::chrono::steady_clock::time_point begin,
                            std::optional<std::chrono::steady_clock::time_point> waiting_since = std::nullopt) {
  const auto now = std::chrono::steady_clock::now();
  const auto waited = now - waiting_since.value_or(begin);
  if (env.rank != 0 || env.world_size < 2 || now - begin < timeout * 9 / 10) return "";
  // Measured from the start of the wait: the store and then the group each wait up to the
  // timeout, so it can be twice that (docs/distributed.md).
  std::string hint = fmt::format(" (rank 0 waited {:.0f} s for the other {} rank(s) of world size {}, as the {} environment "
                                 "says (collective_timeout_seconds {:g} s); were they started?",
                                 std::chrono::duration<double>(waited).count(), env.world_size - 1, env.world_size,
                                 env.launcher, static_cast<double>(timeout.count()) / 1000);
  if (env.launcher == "slurm") hint += " In an sbatch script, start the trainer with srun: the script itself is one process";
  return hint + ")";
}

// A c10d work in flight; `fail` turns its exception into the caller's trainer::Error. WorkPtr is
// what the group's collectives return (ProcessGroup::Work in LibTorch 1.13, c10d::Work in 2.x).
template <class WorkPtr>
class C10dPending : public PendingCollective {
 public:
  C10dPending(WorkPtr work, std::chrono::milliseconds timeout,
              std::function<Error(const std::string&)> fail, std::vector<std::vector<at::Tensor>> outputs,
              std::vector<at::Tensor> inputs)
      : work_(std::move(work)), timeout_(timeout), fail_(std::move(fail)), outputs_(std::move(outputs)),
        inputs_(std::move(inputs)) {}
  ~C10dPending() override {
    try {
      wait();
    } catch (...) {
    }
  }
  void wait() override {
    if (!work_) return;
    auto work = std::move(work_);
    work_.reset();
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw fail_(first_line(e.what()));
    }
  }

 private:
  WorkPtr work_;
  std::chrono::milliseconds timeout_;
  std::function<Error(const std::string&)> fail_;
  std::vector<std::vector<at::Tensor>> outputs_;  // kept alive until the work is done
  std::vector<at::Tensor> inputs_;
};

// Whether a group's own reduce_scatter sends fewer bytes than an all-reduce of the same parts.
// Gloo's (LibTorch >= 2.8; 1.13 and 2.6 refuse the call) is one all-reduce per rank's part: as
// many bytes as the all-reduce the sharded state falls back to, in R calls instead of one, so it
// is not taken. (With it, LibTorch 2.14's Gloo gave the same losses, norms and weights as one
// process in the sharding tests.)
template <class Group>
constexpr bool kReduceScatterSavesBytes = true;
#if TRAINER_WITH_GLOO
template <>
constexpr bool kReduceScatterSavesBytes<c10d::ProcessGroupGloo> = false;
#endif

// A c10d process group (ProcessGroupGloo or ProcessGroupNCCL) over a TCPStore. Both groups
// share the allreduce/wait interface in LibTorch 1.13 and 2.x, so one template serves both.
template <class Group>
class C10dCommunicator : public Communicator {
 public:
  // A subgroup (split): a new process group of `world` ranks that meet under `store` (a prefix of
  // the parent's store). `global_rank` names this process in messages.
  C10dCommunicator(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world, int64_t global_rank,
                   const std::string& label, torch::Device device, std::chrono::milliseconds timeout)
      : rank_(rank), world_(world), global_rank_(global_rank), label_(label), device_(device), timeout_(timeout),
        store_(std::move(store)) {
    try {
      auto group_options = Group::Options::create();
      group_options->timeout = timeout_;
      configure(*group_options);
      group_ = c10::make_intrusive<Group>(store_, static_cast<int>(rank_), static_cast<int>(world_), group_options);
    } catch (const std::exception& e) {
      throw dist_error(who() + ": creating the process group failed: " + first_line(e.what()));
    }
  }
  // The world group: every rank of the launch, meeting in `store` (tcp_store_open's).
  C10dCommunicator(const DistEnv& env, c10::intrusive_ptr<c10d::Store> store, const std::string& address,
                   const DistOptions& options, std::chrono::steady_clock::time_point waiting_since)
      : rank_(env.rank), world_(env.world_size), global_rank_(env.rank), device_(options.device),
        timeout_(std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000))),
        store_(std::move(store)) {
    const auto begin = std::chrono::steady_clock::now();
    try {
      world_size_agree(*store_, env);
      auto group_options = Group::Options::create();
      group_options->timeout = timeout_;
      configure(*group_options);
      group_ = c10::make_intrusive<Group>(store_, static_cast<int>(rank_), static_cast<int>(world_), group_options);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string note = world_size_note(*store_);
      throw dist_error("rank " + std::to_string(rank_) + ": rendezvous at " + address + " failed: " + first_line(e.what()) +
                       (note.empty() ? rendezvous_hint(env, timeout_, begin, waiting_since) : note));
    }
  }
  ~C10dCommunicator() override { shutdown(); }
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  // A tensor that is not on the group's device (the host-side step statistics under NCCL) makes
  // a round trip through a device copy; the gradient buckets are already there.
  void all_reduce_sum(torch::Tensor& tensor, const std::string& what) override {
    const bool staged = tensor.device() != device_;
    std::vector<at::Tensor> tensors{staged ? tensor.to(device_) : tensor};
    try {
      auto work = group_->allreduce(tensors);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw dist_error(failed("all_reduce", what) + first_line(e.what()));
    }
    if (staged) tensor.copy_(tensors[0]);
    ++collectives_;
    bytes_sent_ += 2.0 * static_cast<double>(world_ - 1) / static_cast<double>(world_) *
                   static_cast<double>(tensor.numel() * tensor.element_size());
  }
  void all_gather(std::vector<torch::Tensor>& parts, const std::string& what) override {
    TORCH_CHECK(static_cast<int64_t>(parts.size()) == world_, "all_gather: one part per rank");
    // c10d gathers into its own flat buffer and copies the parts out after the exchange, so an
    // input that is a view of the output buffer (parts[rank]) is read before it is overwritten.
    std::vector<std::vector<at::Tensor>> outputs{parts};  // handles to the same views: filled in place
    std::vector<at::Tensor> inputs{parts[static_cast<size_t>(rank_)]};
    try {
      auto work = group_->allgather(outputs, inputs);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw dist_error(failed("all_gather", what) + first_line(e.what()));
    }
    ++collectives_;
    bytes_sent_ += static_cast<double>(world_ - 1) * static_cast<double>(parts[0].numel() * parts[0].element_size());
  }
  void reduce_scatter_sum(std::vector<torch::Tensor>& parts, torch::Tensor& output, const std::string& what) override {
    TORCH_CHECK(static_cast<int64_t>(parts.size()) == world_, "reduce_scatter_sum: one part per rank");
    if (!has_reduce_scatter()) return Communicator::reduce_scatter_sum(parts, output, what);
    std::vector<at::Tensor> outputs{output};
    std::vector<std::vector<at::Tensor>> inputs{parts};
    try {
      auto work = group_->reduce_scatter(outputs, inputs);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw dist_error(failed("reduce_scatter", what) + first_line(e.what()));
    }
    ++collectives_;
    bytes_sent_ += static_cast<double>(world_ - 1) * static_cast<double>(parts[0].numel() * parts[0].element_size());
  }
  bool has_reduce_scatter() override {
    if (reduce_scatter_known_) return reduce_scatter_;
    reduce_scatter_known_ = true;
    if (!kReduceScatterSavesBytes<Group>) return reduce_scatter_ = false;
    // A backend without one refuses the call itself ("does not support reduce_scatter"), on every
    // rank alike, before any exchange; a backend that has it runs this one-element probe.
    std::vector<at::Tensor> outputs{torch::zeros({1}, torch::TensorOptions().device(device_))};
    std::vector<std::vector<at::Tensor>> inputs{std::vector<at::Tensor>(static_cast<size_t>(world_), torch::ones({1}, outputs[0].options()))};
    try {
      auto work = group_->reduce_scatter(outputs, inputs);
      work->wait(timeout_);
      reduce_scatter_ = outputs[0].item<double>() == static_cast<double>(world_);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find("does not support") == std::string::npos)
        throw dist_error(who() + ": the reduce_scatter probe failed (a peer rank died or hung): " + first_line(e.what()));
      reduce_scatter_ = false;
    }
    return reduce_scatter_;
  }
  std::unique_ptr<PendingCollective> all_gather_start(std::vector<torch::Tensor>& parts, const std::string& what) override {
    TORCH_CHECK(static_cast<int64_t>(parts.size()) == world_, "all_gather_start: one part per rank");
    std::vector<std::vector<at::Tensor>> outputs{parts};
    std::vector<at::Tensor> inputs{parts[static_cast<size_t>(rank_)]};
    auto fail = [prefix = failed("all_gather", what)](const std::string& reason) { return dist_error(prefix + reason); };
    decltype(group_->allgather(outputs, inputs)) work;
    try {
      work = group_->allgather(outputs, inputs);
    } catch (const std::exception& e) {
      throw fail(first_line(e.what()));
    }
    ++collectives_;
    bytes_sent_ += static_cast<double>(world_ - 1) * static_cast<double>(parts[0].numel() * parts[0].element_size());
    return std::make_unique<C10dPending<decltype(work)>>(std::move(work), timeout_, std::move(fail), std::move(outputs), std::move(inputs));
  }
  void all_to_all(torch::Tensor& output, const torch::Tensor& input, const std::vector<int64_t>& output_splits,
                  const std::vector<int64_t>& input_splits, const std::string& what) override {
    TORCH_CHECK(static_cast<int64_t>(output_splits.size()) == world_ && static_cast<int64_t>(input_splits.size()) == world_,
                "all_to_all: one split per rank");
    // Host tensors under NCCL (the row counts) make a round trip through the device. Gloo (the
    // CPU backend) has no bf16 ("Invalid scalar type"), so bf16 rows (an MoE MTP layer's, whose
    // input is eh_proj's autocast output) travel as fp32 there: exact both ways.
    const auto wire = device_.is_cpu() && input.scalar_type() == at::kBFloat16 ? at::kFloat : input.scalar_type();
    auto out = output.device() == device_ && output.is_contiguous() && output.scalar_type() == wire
                   ? output
                   : output.to(device_, wire).contiguous();
    auto in = input.to(device_, wire).contiguous();
    std::vector<int64_t> out_splits = output_splits, in_splits = input_splits;  // c10d takes them by reference
    try {
      auto work = group_->alltoall_base(out, in, out_splits, in_splits);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw dist_error(failed("all_to_all", what) + first_line(e.what()));
    }
    if (!out.is_same(output)) output.copy_(out);
    ++collectives_;
    const int64_t row_bytes = input.size(0) > 0 ? input.numel() / input.size(0) * in.element_size() : 0;  // on the wire
    bytes_sent_ += static_cast<double>((input.size(0) - input_splits[static_cast<size_t>(rank_)]) * row_bytes);
  }
  std::unique_ptr<Communicator> split(const std::vector<int64_t>& ranks, const std::string& tag) override {
    const auto me = std::find(ranks.begin(), ranks.end(), rank_);
    TORCH_CHECK(me != ranks.end(), "split: this rank is not in the subgroup");
    if (ranks.size() == 1) return std::make_unique<LocalCommunicator>();
    std::string label = tag + " {";
    for (size_t i = 0; i < ranks.size(); ++i) label += (i ? ", " : "") + std::to_string(ranks[i]);
    label += "}";
    auto store = c10::make_intrusive<c10d::PrefixStore>(label, store_);
    return std::make_unique<C10dCommunicator<Group>>(store, me - ranks.begin(), static_cast<int64_t>(ranks.size()),
                                                     global_rank_, label, device_, timeout_);
  }
  Communicator& host_group() override { return host_group_ ? *host_group_ : *this; }
  // Under NCCL: the Gloo group host_group() returns, over the same ranks and store. Every rank
  // calls it once, at start-up.
  void host_group_create();
  std::string broadcast_string(const std::string& key, const std::string& value) override {
    try {
      if (rank_ == 0) store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      const auto bytes = store_->get(key);
      return std::string(bytes.begin(), bytes.end());
    } catch (const std::exception& e) {
      throw dist_error("rank " + std::to_string(rank_) + ": store get of " + key + " failed: " + first_line(e.what()));
    }
  }
  void wait_for_rank0(const std::string& key, const std::string& what) override {
    // Polled with check(), which answers at once: a store wait() that times out throws an error
    // that cannot be told from a lost store.
    const auto begin = std::chrono::steady_clock::now();
    auto warn_at = begin + timeout_;
    auto pause = std::chrono::milliseconds(1);
    try {
      if (rank_ == 0) return store_->set(key, std::vector<uint8_t>{1});
      while (!store_->check({key})) {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::milliseconds(200));
        if (const auto now = std::chrono::steady_clock::now(); now >= warn_at) {
          spdlog::warn("{}: rank 0 is still {} ({:.0f} s; waiting as long as it lives)", who(), what,
                       std::chrono::duration<double>(now - begin).count());
          warn_at = now + timeout_;
        }
      }
    } catch (const std::exception& e) {
      throw dist_error(who() + ": lost rank 0 while it was " + what + " (the rendezvous store it serves is gone: it died): " +
                       first_line(e.what()));
    }
  }

 private:
  // "rank 3 of 4" for the world group; "rank 3 (1 of 2 in expert-parallel group {2, 3})" for a subgroup.
  std::string who() const {
    if (label_.empty()) return "rank " + std::to_string(rank_) + " of " + std::to_string(world_);
    return "rank " + std::to_string(global_rank_) + " (" + std::to_string(rank_) + " of " + std::to_string(world_) +
           " in " + label_ + ")";
  }
  // The start of a failed collective's message; the backend's reason follows it.
  std::string failed(const std::string& collective, const std::string& what) const {
    return who() + ": " + collective + " of " + what + " failed (a peer rank died or hung; timeout " +
           fmt::format("{:g}", timeout_.count() / 1000.0) + " s): ";
  }
  void configure(typename Group::Options& options);
  void shutdown();
  int64_t rank_, world_, global_rank_;
  std::string label_;  // empty for the world group
  torch::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Group> group_;
  bool reduce_scatter_known_ = false, reduce_scatter_ = false;  // has_reduce_scatter(), once probed
  std::unique_ptr<Communicator> host_group_;  // NCCL only: a Gloo group for host tensors
};
#endif

#if TRAINER_WITH_GLOO
template <>
void C10dCommunicator<c10d::ProcessGroupGloo>::configure(c10d::ProcessGroupGloo::Options& options) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
    options.devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else
    options.devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
}
template <>
void C10dCommunicator<c10d::ProcessGroupGloo>::shutdown() {}
#endif

#if TRAINER_WITH_NCCL
// Blocking wait makes work->wait() return only when the collective finished and throw when it
// times out, so a dead or hung rank gives exit 5 naming the operation (as with Gloo) instead of
// the watchdog aborting the process. Set TORCH_NCCL_BLOCKING_WAIT=0 to choose the watchdog.
template <>
void C10dCommunicator<c10d::ProcessGroupNCCL>::configure(c10d::ProcessGroupNCCL::Options&) {
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
}
#if TRAINER_WITH_GLOO
template <>
void C10dCommunicator<c10d::ProcessGroupNCCL>::host_group_create() {
  const std::string label = "host group";
  host_group_ = std::make_unique<C10dCommunicator<c10d::ProcessGroupGloo>>(
      c10::make_intrusive<c10d::PrefixStore>(label, store_), rank_, world_, global_rank_, label, torch::Device(torch::kCPU),
      timeout_);
}
#else
template <>
void C10dCommunicator<c10d::ProcessGroupNCCL>::host_group_create() {}  // host values make a round trip through the device
#endif
// NCCL's communicators must be torn down explicitly before the process exits (LibTorch 2.x
// warns otherwise and may hang in its watchdog).
template <>
void C10dCommunicator<c10d::ProcessGroupNCCL>::shutdown() {
  try {
    if (group_) group_->shutdown();
  } catch (const std::exception& e) {
    spdlog::warn("rank {}: NCCL shutdown: {}", rank_, first_line(e.what()));
  }
}
#endif

#if TRAINER_WITH_GLOO || TRAINER_WITH_NCCL
// Where the ranks meet: rank 0 serves a TCPStore, the others connect to it.
struct Rendezvous {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string address;  // "host:port", for messages and the start-up line
  // When rank 0 began to wait for the others (after MASTER_ADDR resolved): the world group's
  // failure reports the whole wait. (LibTorch 1.13's store gives up waiting for workers without
  // an error, and the group then waits a second timeout.)
  std::chrono::steady_clock::time_point waiting_since = std::chrono::steady_clock::now();
};

// Ends this process, exit 5 with `message`, unless disarmed (destroyed) within `deadline`. For a
// wait c10d gives no deadline of its own. Only before training: nothing is lost.
class StartupWatchdog {
 public:
  StartupWatchdog(std::chrono::milliseconds deadline, std::string message)
      : thread_([this, deadline, message = std::move(message)] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (disarmed_.wait_for(lock, deadline, [this] { return done_; })) return;
          spdlog::error("{}", message);
          spdlog::default_logger()->flush();
          ::_exit(kExitDistributed);
        }) {}
  ~StartupWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    disarmed_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable disarmed_;
  bool done_ = false;
  std::thread thread_;  // last: it starts once the members above exist
};

// The TCPStore at host:port. Rank 0 serves it; with port 0 it binds a free port (store->getPort()
// says which) and keeps it, so no other process can take the port between its choice and its use.
//
// A client retries its connect for `timeout` (LibTorch 2.x: a second round after a backoff of up
// to a minute), but once connected it reads the store's answers with no deadline: when
// MASTER_PORT belongs to a program that accepts connections and never answers (another service,
// a stale process), it used to wait forever. The watchdog fires only after the client's own
// attempts would all have ended (2 x timeout + 60 s), so it never cuts a slow but live rendezvous.
c10::intrusive_ptr<c10d::TCPStore> tcp_store_open(const std::string& host, int port, const DistEnv& env,
                                                  bool wait_for_workers, std::chrono::milliseconds timeout) {
  std::optional<StartupWatchdog> watchdog;
  if (env.rank != 0) {
    const auto deadline = 2 * timeout + std::chrono::seconds(60);
    watchdog.emplace(deadline, fmt::format("rank {}: rendezvous at {}:{}: no answer from rank 0's store in {:g} s "
                                           "(2 x collective_timeout_seconds + 60 s), though connecting gives up sooner: "
                                           "a program that is not rank 0's store accepts connections there; is "
                                           "MASTER_PORT right, and is another program listening on it?",
                                           env.rank, host, port, static_cast<double>(deadline.count()) / 1000));
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = env.rank == 0;
  options.numWorkers = static_cast<int>(env.world_size);
  options.waitWorkers = wait_for_workers;
  options.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    const bool no_libuv = std::string(e.what()).find("without libuv support") != std::string::npos;
    if (!no_libuv || !compat::tcp_store_use_classic_backend(options)) throw;
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  }
}

// Under mpirun without MASTER_ADDR: rank 0 opens the store on a free port of its host and tells
// the others host and port through MPI (the only use of MPI; it is finalized right after).
Rendezvous rendezvous_via_mpi(const DistEnv& env, std::chrono::milliseconds timeout) {
#if TRAINER_WITH_MPI
  // MPI's calls have no deadline: a rank that never comes (stuck before its rendezvous, say on a
  // config file that blocks) held the others in the broadcast or MPI_Finalize for ever.
  const auto deadline = 2 * timeout + std::chrono::seconds(60);
  std::optional<StartupWatchdog> watchdog;
  watchdog.emplace(deadline, fmt::format("rank {}: the MPI bootstrap of the rendezvous (rank 0 telling the others its "
                                         "store's address) did not finish in {:g} s (2 x collective_timeout_seconds + "
                                         "60 s): one of the {} ranks did not reach it (stuck before its rendezvous, or "
                                         "not started?)",
                                         env.rank, static_cast<double>(deadline.count()) / 1000, env.world_size));
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(nullptr, nullptr);
  char buffer[1024] = {0};  // "host port", or "!" and why rank 0 has no store
  Rendezvous meeting;
  if (env.rank == 0) {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    try {
      meeting.store = tcp_store_open(host, 0, env, /*wait_for_workers=*/false, timeout);
      std::snprintf(buffer, sizeof buffer, "%s %d", host, static_cast<int>(meeting.store->getPort()));
    } catch (const std::exception& e) {
      std::snprintf(buffer, sizeof buffer, "!%s: %s", host, first_line(e.what()).c_str());
    }
  }
  MPI_Bcast(buffer, sizeof buffer, MPI_CHAR, 0, MPI_COMM_WORLD);  // the others must hear a failure too
  MPI_Finalize();
  watchdog.reset();
  const std::string text(buffer);
  if (text.rfind('!', 0) == 0)
    throw dist_error((env.rank == 0 ? std::string("rank 0") : "rank " + std::to_string(env.rank) + ": rank 0") +
                     " could not open the rendezvous store on " + text.substr(1));
  const auto space = text.find(' ');
  meeting.address = text.substr(0, space) + ":" + text.substr(space + 1);
  if (env.rank == 0) return meeting;
  try {
    meeting.store = tcp_store_open(text.substr(0, space), std::stoi(text.substr(space + 1)), env, false, timeout);
  } catch (const std::exception& e) {
    throw dist_error("rank " + std::to_string(env.rank) + ": rendezvous at " + meeting.address + " (rank 0's, told by MPI) failed: " +
                     first_line(e.what()));
  }
  return meeting;
#else
  (void)env;
  (void)timeout;
  throw dist_error("launched by mpirun but built without MPI: set MASTER_ADDR and MASTER_PORT");
#endif
}

// MASTER_ADDR must resolve before the store can be reached. A name the resolver does not know
// yet is waited for: on Kubernetes the master's DNS record appears only once its pod is ready, and
// workers start first. Still unknown after collective_timeout_seconds, it is named (exit 2: a
// typo, most likely) instead of being reported as a connection timeout; a resolver that could not
// answer in that time (EAI_AGAIN) is exit 5.
void master_addr_wait(const DistEnv& env, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(50);
  for (bool logged = false;; logged = true) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int status = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
    if (found) freeaddrinfo(found);
    if (status == 0 || (status != EAI_NONAME && status != EAI_AGAIN)) return;  // other errors: the store's to report
    const std::string what = "rank " + std::to_string(env.rank) + ": MASTER_ADDR=" + env.master_addr;
    if (std::chrono::steady_clock::now() >= deadline) {
      const std::string waited = " after " + fmt::format("{:g}", timeout.count() / 1000.0) + " s (collective_timeout_seconds): ";
      if (status == EAI_NONAME)
        throw config_error(what + " is not a host name or address this machine resolves" + waited + gai_strerror(status));
      throw dist_error(what + " could not be resolved" + waited + gai_strerror(status));
    }
    if (!logged) spdlog::info("{} does not resolve yet ({}); waiting for it", what, gai_strerror(status));
    std::this_thread::sleep_until(std::min(std::chrono::steady_clock::now() + pause, deadline));
    pause = std::min(2 * pause, std::chrono::milliseconds(1000));
  }
}

// The store every rank of this launch meets in: at MASTER_ADDR:MASTER_PORT when they are set,
// else on a free port (one process on loopback; under mpirun on rank 0's host).
Rendezvous rendezvous_open(const DistEnv& env, std::chrono::milliseconds timeout) {
  auto begin = std::chrono::steady_clock::now();
  std::string address = env.master_addr + ":" + std::to_string(env.master_port);
  try {
    if (!env.master_addr.empty()) {
      master_addr_wait(env, timeout);
      begin = std::chrono::steady_clock::now();
      return {tcp_store_open(env.master_addr, env.master_port, env, /*wait_for_workers=*/true, timeout), address, begin};
    }
    if (env.world_size == 1) {
      address = "127.0.0.1:0";
      auto store = tcp_store_open("127.0.0.1", 0, env, false, timeout);
      address = "127.0.0.1:" + std::to_string(store->getPort());
      return {store, address};
    }
    if (env.launcher == "mpirun") return rendezvous_via_mpi(env, timeout);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw dist_error("rank " + std::to_string(env.rank) + ": rendezvous at " + address + " failed: " + first_line(e.what()) +
                     rendezvous_hint(env, timeout, begin));
  }
  throw dist_error("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + " (" + env.launcher +
                   "): set MASTER_ADDR and MASTER_PORT (only mpirun agrees on them by itself)");
}
#endif

}  // namespace

void Communicator::all_reduce_sum_in_buckets(const torch::Tensor& tensor, int64_t bucket, const std::string& what,
                                             int64_t first) {
  for (int64_t offset = 0; offset < tensor.numel(); offset += bucket) {
    auto view = tensor.narrow(0, offset, std::min(bucket, tensor.numel() - offset));
    all_reduce_sum(view, what + " at element " + std::to_string(first + offset));
  }
}

int64_t ranks_reporting(bool mine, Communicator& comm, const std::string& what) {
  if (comm.is_local()) return mine ? 1 : 0;
  auto count = torch::tensor({mine ? 1.0 : 0.0}, torch::kFloat64);
  comm.all_reduce_sum(count, what);
  return static_cast<int64_t>(count.item<double>());
}

void ranks_share_failure(Communicator& comm, const std::string& what, const std::function<void()>& work) {
  if (comm.is_local()) return work();
  std::exception_ptr failure;
  double code = 0;
  try {
    work();
  } catch (const Error& e) {
    failure = std::current_exception();
    code = e.exit_code();
  } catch (...) {
    failure = std::current_exception();
    code = kExitFailure;
  }
  std::vector<double> codes(static_cast<size_t>(comm.world_size()), 0.0);
  codes[static_cast<size_t>(comm.rank())] = code;
  auto reduced = torch::tensor(codes, torch::kFloat64);
  try {
    comm.all_reduce_sum(reduced, "the outcome of " + what);
  } catch (const Error&) {
    if (failure) std::rethrow_exception(failure);  // this rank's own error says more than a dead peer
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  for (int64_t r = 0; r < comm.world_size(); ++r)
    if (const auto other = static_cast<int>(reduced[r].item<double>()); other != 0)
      throw Error(static_cast<ExitCode>(other), "rank " + std::to_string(r) + " failed " + what + " (exit code " +
                                                    std::to_string(other) + "; its log says why)");
}

void Communicator::reduce_scatter_sum(std::vector<torch::Tensor>& parts, torch::Tensor& output, const std::string& what) {
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == world_size(), "reduce_scatter_sum: one part per rank");
  auto all = torch::cat(parts);
  all_reduce_sum(all, what + " (reduce-scatter emulated by an all-reduce)");
  output.copy_(all.narrow(0, rank() * output.numel(), output.numel()));
}

std::unique_ptr<PendingCollective> Communicator::all_gather_start(std::vector<torch::Tensor>& parts,
                                                                 const std::string& what) {
  all_gather(parts, what);
  return std::make_unique<FinishedCollective>();
}

std::string dist_backend_resolve(const std::string& requested, const torch::Device& device) {
  if (requested != "auto") return requested;
  return device.is_cuda() ? "nccl" : "gloo";
}

std::unique_ptr<Communicator> dist_init(const DistEnv& env, const DistOptions& options) {
  // One process needs no group, unless a backend was named explicitly (which exercises it).
  if (env.world_size == 1 && options.backend == "auto") return std::make_unique<LocalCommunicator>();
  const std::string backend = dist_backend_resolve(options.backend, options.device);
  if (backend == "nccl" && !options.device.is_cuda())
    throw config_error("dist_backend=nccl needs hardware=gpu (NCCL reduces CUDA tensors only)");
  // A backend this build lacks is refused before the rendezvous, which would wait for every rank.
#if !TRAINER_WITH_GLOO
  if (backend == "gloo")
    throw config_error("world size " + std::to_string(env.world_size) +
                       " with dist_backend=gloo, but this build has no Gloo (c10d) support");
#endif
#if !TRAINER_WITH_NCCL
  if (backend != "gloo")
    throw config_error("world size " + std::to_string(env.world_size) +
                       " with dist_backend=nccl, but this build has no NCCL (build with scripts/gpu/build.sh)");
#endif
#if TRAINER_WITH_GLOO || TRAINER_WITH_NCCL
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  const Rendezvous meeting = rendezvous_open(env, timeout);
  const std::string address = meeting.address;  // where the ranks met
#else
  const std::string address;
#endif
  std::unique_ptr<Communicator> comm;
#if TRAINER_WITH_GLOO
  if (backend == "gloo") comm = std::make_unique<C10dCommunicator<c10d::ProcessGroupGloo>>(env, meeting.store, address, options,
                                                                                          meeting.waiting_since);
#endif
#if TRAINER_WITH_NCCL
  if (backend != "gloo") {
    auto nccl = std::make_unique<C10dCommunicator<c10d::ProcessGroupNCCL>>(env, meeting.store, address, options,
                                                                                meeting.waiting_since);
    nccl->host_group_create();
    if (env.rank == 0)
      spdlog::info("NCCL: the host's step values (token count, stop and failure votes) go {}",
                   &nccl->host_group() != nccl.get() ? "over a Gloo host group (no device read)"
                                                     : "through the device (no Gloo in this build: one host read per step)");
    comm = std::move(nccl);
  }
#endif
  auto probe = torch::ones({1}, torch::TensorOptions().dtype(torch::kFloat64).device(options.device));
  comm->all_reduce_sum(probe, "the preflight check");
  const double sum = probe.item<double>();
  if (sum != static_cast<double>(env.world_size))
    throw dist_error("preflight all_reduce returned " + std::to_string(sum) + ", expected " +
                     std::to_string(env.world_size));
  spdlog::info("data parallel: rank {} of {} (local rank {} of {}), launched by {}, rendezvous {}, {} on {}", env.rank,
               env.world_size, env.local_rank, env.local_world_size, env.launcher, address, backend == "gloo" ? "Gloo" : "NCCL",
               options.device.str());
  return comm;
}

}  // namespace trainer
