// Launcher environment and the Gloo communicator (see dist.h).
#include "trainer/dist/dist.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include <spdlog/spdlog.h>

#if TRAINER_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#if TRAINER_WITH_MPI
#include <mpi.h>
#endif

#include "trainer/util/error.h"


namespace trainer {
namespace {

Error dist_error(const std::string& message) { return Error(kExitDistributed, message); }

class LocalCommunicator : public Communicator {
 public:
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  void all_reduce_sum(torch::Tensor&, const std::string&) override {}
  std::string broadcast_string(const std::string&, const std::string& value) override { return value; }
};

#if TRAINER_WITH_GLOO
class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(const DistEnv& env, const std::string& host, int port, double timeout_seconds)
      : rank_(env.rank), world_(env.world_size), timeout_(std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000))) {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(port);
    options.isServer = env.rank == 0;
    options.numWorkers = static_cast<int>(env.world_size);
    options.waitWorkers = true;
    options.timeout = timeout_;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(host, options);
      auto pg_options = c10d::ProcessGroupGloo::Options::create();
      pg_options->timeout = timeout_;
      if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
        pg_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      else
        pg_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, static_cast<int>(rank_), static_cast<int>(world_), pg_options);
    } catch (const std::exception& e) {
      throw dist_error("rank " + std::to_string(rank_) + ": rendezvous at " + host + ":" + std::to_string(port) +
                       " failed: " + first_line(e.what()));
    }
  }
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  void all_reduce_sum(torch::Tensor& tensor, const std::string& what) override {
    std::vector<at::Tensor> tensors{tensor};
    try {
      auto work = group_->allreduce(tensors);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw dist_error("rank " + std::to_string(rank_) + " of " + std::to_string(world_) + ": all_reduce of " + what +
                       " failed (a peer rank died or hung; timeout " + std::to_string(timeout_.count() / 1000) +
                       " s): " + first_line(e.what()));
    }
    ++collectives_;
  }
  std::string broadcast_string(const std::string& key, const std::string& value) override {
    try {
      if (rank_ == 0) store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      const auto bytes = store_->get(key);
      return std::string(bytes.begin(), bytes.end());
    } catch (const std::exception& e) {
      throw dist_error("rank " + std::to_string(rank_) + ": store get of " + key + " failed: " + first_line(e.what()));
    }
  }

 private:
  static std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }
  int64_t rank_, world_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
};
#endif

// Under mpirun without MASTER_ADDR: rank 0 picks its hostname and a free port and tells the
// others through MPI (the only use of MPI).
std::pair<std::string, int> rendezvous_via_mpi(const DistEnv& env) {
#if TRAINER_WITH_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) MPI_Init(nullptr, nullptr);
  char buffer[300] = {0};
  if (env.rank == 0) {
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = 0;
    bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t len = sizeof addr;
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    const int port = ntohs(addr.sin_port);
    close(fd);
    std::snprintf(buffer, sizeof buffer, "%s %d", host, port);
  }
  MPI_Bcast(buffer, sizeof buffer, MPI_CHAR, 0, MPI_COMM_WORLD);
  MPI_Finalize();  // MPI's job is done; collectives go through Gloo
  const std::string text(buffer);
  const auto space = text.find(' ');
  return {text.substr(0, space), std::stoi(text.substr(space + 1))};
#else
  (void)env;
  throw dist_error("launched by mpirun but built without MPI: set MASTER_ADDR and MASTER_PORT");
#endif
}

}  // namespace

std::unique_ptr<Communicator> dist_init(const DistEnv& env, double timeout_seconds) {
  if (env.world_size == 1) return std::make_unique<LocalCommunicator>();
#if TRAINER_WITH_GLOO
  std::string host;
  int port = 0;
  if (std::getenv("MASTER_ADDR") && std::getenv("MASTER_PORT")) {
    host = std::getenv("MASTER_ADDR");
    port = std::atoi(std::getenv("MASTER_PORT"));
  } else if (env.launcher == "mpirun") {
    std::tie(host, port) = rendezvous_via_mpi(env);
  } else {
    throw dist_error("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) + " (" + env.launcher +
                     "): set MASTER_ADDR and MASTER_PORT (only mpirun agrees on them by itself)");
  }
  auto comm = std::make_unique<GlooCommunicator>(env, host, port, timeout_seconds);
  auto probe = torch::ones({1}, torch::kFloat64);
  comm->all_reduce_sum(probe, "the preflight check");
  if (probe.item<double>() != static_cast<double>(env.world_size))
    throw dist_error("preflight all_reduce returned " + std::to_string(probe.item<double>()) + ", expected " +
                     std::to_string(env.world_size));
  spdlog::info("data parallel: rank {} of {} (local rank {} of {}), launched by {}, rendezvous {}:{}, Gloo", env.rank,
               env.world_size, env.local_rank, env.local_world_size, env.launcher, host, port);
  return comm;
#else
  throw dist_error("world size " + std::to_string(env.world_size) + " but this build has no Gloo (c10d) support");
#endif
}

}  // namespace trainer
