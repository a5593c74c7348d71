// Device selection, names, known peaks and allocator statistics (see device.h). Built without
// the shared PCH: only this file sees TRAINER_WITH_CUDA and the CUDA headers (the runtime API
// and c10's allocator, not ATen's CUDA context, which would need cuBLAS's headers).
#include "trainer/train/device.h"

#include <malloc.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <limits>

#include <c10/core/CPUAllocator.h>

#if TRAINER_WITH_CUDA
#include <cuda_runtime_api.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "trainer/util/error.h"
#include "trainer/util/torch_compat.h"

namespace trainer {

void host_memory_keep_freed() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  mallopt(M_TOP_PAD, 64 << 20);
}

namespace {

// Counts LibTorch's CPU allocations, and those of exactly watch_bytes. The watched size can
// change: LibTorch keeps the first allocator installed for the life of the process, and a later
// Trainer in the same process (the tests) watches its own gradient size.
class CountingCpuAllocator final : public compat::ForwardingAllocator {
 public:
  CountingCpuAllocator(c10::Allocator* base, size_t watch_bytes) : ForwardingAllocator(base), watch_bytes_(watch_bytes) {}
  HostAllocationCounts counts() const { return {true, allocations_.load(), watched_.load()}; }
  void watch(size_t watch_bytes) { watch_bytes_.store(watch_bytes); }

 private:
  void on_allocate(size_t n, void* /*data*/) const override {
    allocations_.fetch_add(1, std::memory_order_relaxed);
    if (n == watch_bytes_.load(std::memory_order_relaxed)) watched_.fetch_add(1, std::memory_order_relaxed);
  }
  std::atomic<size_t> watch_bytes_;
  mutable std::atomic<int64_t> allocations_{0}, watched_{0};
};
CountingCpuAllocator* g_counting_allocator = nullptr;  // installed once, never freed (LibTorch keeps it)

// Advises every block of 32 MiB or more to use transparent huge pages before anyone touches it:
// the pages fully inside the block, from its first 4 KiB boundary to its last. glibc serves such
// blocks from a fresh mmap (32 MiB is the ceiling of its mmap threshold) and unmaps them when
// freed, so each is advised once, untouched. Smaller blocks come from the heap, where they are
// reused: advising those too made the steady small step 1.26x slower (docs/benchmarks.md; probably
// khugepaged collapsing reused heap pages on the shared cores). madvise's result is ignored: where
// THP is off the block keeps 4 KiB pages.
class HugePageCpuAllocator final : public compat::ForwardingAllocator {
 public:
  using ForwardingAllocator::ForwardingAllocator;

 private:
  void on_allocate(size_t n, void* data) const override {
    constexpr uintptr_t kAdvisedBytes = 32 << 20, kPage = 4096;
    if (n < kAdvisedBytes || data == nullptr) return;
    const auto begin = (reinterpret_cast<uintptr_t>(data) + kPage - 1) & ~(kPage - 1);
    const auto end = (reinterpret_cast<uintptr_t>(data) + n) & ~(kPage - 1);
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
};
HugePageCpuAllocator* g_huge_page_allocator = nullptr;  // installed once, never freed

}  // namespace

void host_memory_huge_pages() {
  if (g_huge_page_allocator) return;
  g_huge_page_allocator = new HugePageCpuAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(g_huge_page_allocator, /*priority=*/100);
}

void host_allocations_watch(size_t watch_bytes) {
  if (g_counting_allocator) {
    g_counting_allocator->watch(watch_bytes);
    return;
  }
  g_counting_allocator = new CountingCpuAllocator(c10::GetCPUAllocator(), watch_bytes);
  c10::SetCPUAllocator(g_counting_allocator, /*priority=*/100);
}

HostAllocationCounts host_allocations() {
  return g_counting_allocator ? g_counting_allocator->counts() : HostAllocationCounts{};
}

torch::Device device_select(const Config& config, int64_t local_rank) {
  if (config.hardware != "gpu") return torch::Device(torch::kCPU);
  if (!torch::cuda::is_available())
    throw config_error("hardware=gpu, but this build of trainer (LibTorch " TORCH_VERSION
                       ") sees no CUDA device; build with scripts/gpu/build.sh on a CUDA machine");
  const auto count = static_cast<int64_t>(torch::cuda::device_count());
  const auto index = static_cast<c10::DeviceIndex>(local_rank % count);
#if TRAINER_WITH_CUDA
  c10::cuda::set_device(index);
#endif
  return torch::Device(torch::kCUDA, index);
}

std::string device_name(const torch::Device& device) {
#if TRAINER_WITH_CUDA
  cudaDeviceProp properties{};
  if (device.is_cuda() && cudaGetDeviceProperties(&properties, device.index()) == cudaSuccess) return properties.name;
#endif
  return device.str();
}

double device_known_peak_tflops(const std::string& name, const std::string& dtype) {
  // Dense (no sparsity) datasheet peaks in TFLOP/s: {name fragment, bf16 tensor core, fp32 CUDA
  // core}. fp32 matmuls run without TF32 (LibTorch's default), so the fp32 peak is the plain one.
  // More specific fragments come first (H100 PCIe/NVL before the SXM part's "H100").
  struct Peak {
    const char* fragment;
    double bf16, fp32;
  };
  static const Peak peaks[] = {
      {"H200", 989.4, 66.9},     {"H100 PCIe", 756.5, 51.2}, {"H100 NVL", 835.5, 60.0},
      {"H100", 989.4, 66.9},     {"A100", 312.0, 19.5},
  };
  for (const auto& p : peaks)
    if (name.find(p.fragment) != std::string::npos) return dtype == "bfloat16" ? p.bf16 : p.fp32;
  return 0.0;
}

void device_sync_errors_set(const torch::Device& device, bool on) {
#if TRAINER_WITH_CUDA
  if (device.is_cuda())
    c10::cuda::warning_state().set_sync_debug_mode(on ? c10::cuda::SyncDebugMode::L_ERROR : c10::cuda::SyncDebugMode::L_DISABLED);
#else
  (void)device, (void)on;
#endif
}

bool device_sync_errors_get(const torch::Device& device) {
#if TRAINER_WITH_CUDA
  return device.is_cuda() && c10::cuda::warning_state().get_sync_debug_mode() == c10::cuda::SyncDebugMode::L_ERROR;
#else
  (void)device;
  return false;
#endif
}

void device_synchronize(const torch::Device& device) {
#if TRAINER_WITH_CUDA
  if (device.is_cuda()) {
    const cudaError_t status = cudaDeviceSynchronize();
    if (status != cudaSuccess)
      throw std::runtime_error(std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(status));
  }
#else
  (void)device;
#endif
}

double device_free_memory_bytes(const torch::Device& device) {
#if TRAINER_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  if (device.is_cuda() && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) return static_cast<double>(free_bytes);
#else
  (void)device;
#endif
  return -1;
}

DeviceMemoryPeaks device_memory_peaks(const torch::Device& device) {
  DeviceMemoryPeaks peaks;
#if TRAINER_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    peaks.allocated_bytes = static_cast<double>(stats.allocated_bytes[0].peak);  // [0]: aggregate pool
    peaks.reserved_bytes = static_cast<double>(stats.reserved_bytes[0].peak);
  }
#else
  (void)device;
#endif
  return peaks;
}

}  // namespace trainer
