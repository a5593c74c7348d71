// The memory plan (DESIGN section 10): what one rank will hold at its peak, from the config alone
// (no tensor allocated), and the check of that plan against what the machine offers. Plain C++:
// `--dry-run` prints it for a 70B config on a laptop, and the Trainer checks it before the first
// parameter is allocated. The accounting is derived in memory_plan.cpp and docs/memory.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

// Which attention core the build runs (model_detail::causal_attention): what it keeps for backward.
enum class AttentionCore {
  block_causal,  // LibTorch 1.13: the model's block-causal kernel (probabilities of the computed blocks)
  sdpa,          // LibTorch >= 2.0: scaled_dot_product_attention, fused for plain causal rows
};

// What the plan needs to know besides the config.
struct MemoryPlanContext {
  int64_t world_size = 1;        // data-parallel ranks (for the optimizer-state shard)
  int64_t local_world_size = 1;  // ranks sharing this machine's host memory
  bool cuda = false;             // the plan is of device memory (no runtime line, no OpenBLAS)
  AttentionCore attention = AttentionCore::block_causal;
  bool native_gqa = false;       // SDPA reads k and v unrepeated (compat::native_gqa_attention)
  bool cpu_bf16_fp32_sums = false;  // bf16 GEMMs as fp32 GEMMs of bf16 operands (cpu_bf16_gemm, compat)
  std::string assumed_build;        // non-empty when the plan is for another build than this one (says which)
};

struct MemoryPlanItem {
  std::string name;
  double bytes = 0;
  std::string detail;  // how it was computed, for the printed plan
};

struct MemoryPlan {
  std::vector<MemoryPlanItem> items;  // in print order; their sum is total_bytes
  double total_bytes = 0;
  double activation_bytes = 0;   // activations saved for backward, one micro-batch (one of the items)
  double model_state_bytes = 0;  // weights, gradients, optimizer state, ZeRO-1 buffer (items too)
};

MemoryPlan memory_plan(const Config& config, const MemoryPlanContext& context);

// The plan as aligned lines: "  weights (fp32 flat buffer)   1.53 GiB  (P = 411.0M x 4 B)".
std::string memory_plan_format(const MemoryPlan& plan);

// What this machine offers each of the `ranks_on_host` processes on it (CPU): the smallest of
// MemAvailable and the cgroup's limit minus its usage (shared by the ranks: divided among them)
// and RLIMIT_AS / RLIMIT_DATA minus what this process already maps (each process has its own);
// `source` names the one that bound. `resident_bytes` is what the process holds already (VmRSS).
struct HostMemory {
  double available_bytes = 0;
  std::string source;
  double resident_bytes = 0;
};
HostMemory host_memory_available(int64_t ranks_on_host = 1);

// Overrides that would make the plan fit in `available_bytes` (per rank), as "key=value ..."
// strings, smallest change first: a smaller per_device_batch_size with gradient_accumulation_steps
// raised to keep the global batch, ZeRO-1 or ZeRO-3 over the data-parallel ranks, full
// recomputation, a tiled head, bf16 activations, synchronous saves. Empty when none does.
std::vector<std::string> memory_plan_suggestions(const Config& config, const MemoryPlanContext& context,
                                                 double available_bytes, double already_resident_bytes);

// "12.3 GiB" / "512.0 MiB".
std::string memory_bytes_text(double bytes);

}  // namespace trainer
