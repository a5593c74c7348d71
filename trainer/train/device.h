// The compute device of this process: which one (one CUDA device per local rank), its name, its
// known dense peak TFLOP/s for perf/mfu, and the CUDA caching allocator's peaks. The interface
// is the same in every build; the CUDA calls exist only where LibTorch has CUDA (device.cpp).
#pragma once
#include <string>

#include <torch/torch.h>
#include <torch/version.h>

#include "trainer/config/config.h"

namespace trainer {

// hardware=cpu: the CPU. hardware=gpu: CUDA device local_rank % device_count, made current (NCCL
// and the caching allocator use the current device). Exit 2 when no CUDA device is visible.
torch::Device device_select(const Config& config, int64_t local_rank);

// "NVIDIA H200", or "cpu".
std::string device_name(const torch::Device& device);

// Dense peak TFLOP/s of a known GPU for a compute dtype ("bfloat16" or "float32"), from the
// vendor's datasheets (SXM/PCIe parts told apart by name); 0 when the device is not known.
double device_known_peak_tflops(const std::string& name, const std::string& dtype);

struct DeviceMemoryPeaks {
  double allocated_bytes = 0;  // peak bytes handed to tensors since start
  double reserved_bytes = 0;   // peak bytes the caching allocator held from cudaMalloc
};
// CUDA devices only (a host-side query, no device sync); zeros on the CPU.
DeviceMemoryPeaks device_memory_peaks(const torch::Device& device);
// CUDA's synchronization debug mode (c10::cuda::warning_state) at "error" (on) or off: while on,
// any operation that makes the host wait for the device (a device->host copy, .item(), a stream
// synchronize) throws. A no-op on the CPU. For debug_cuda_sync_check.
void device_sync_errors_set(const torch::Device& device, bool on);
// Whether that mode is on (false on the CPU).
bool device_sync_errors_get(const torch::Device& device);
// Waits until the device has finished the work queued on it (cudaDeviceSynchronize; the runtime
// call, which the sync debug mode does not see); a no-op on the CPU.
void device_synchronize(const torch::Device& device);
// Free memory of the current CUDA device (cudaMemGetInfo: what other processes and the CUDA
// context left); -1 on the CPU.
double device_free_memory_bytes(const torch::Device& device);

// Makes glibc's malloc keep freed host memory for reuse instead of returning it to the OS: a
// fixed 32 MiB mmap threshold (the dynamic one's ceiling, without its warm-up), no trimming of
// the heap top, and 64 MiB of padding per heap extension. The step's temporaries (activations,
// gradients of MiBs each, every micro-batch) otherwise come back as fresh pages, each page
// faulted in and zeroed by the kernel: measured 1.7x (dense) and 2.8x (MoE) slower steps on the
// CPU (docs/benchmarks.md, "Host memory reuse"), for a peak RSS 1-9% higher (freed blocks that
// do not fit the next request stay in the heap). The Trainer calls it when keep_freed_host_memory
// is true (the default).
void host_memory_keep_freed();

// Makes LibTorch's CPU allocations of 32 MiB and more (glibc maps each afresh) ask the kernel for
// transparent huge pages (madvise MADV_HUGEPAGE before the first touch; honoured where
// /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always"). Such a buffer then
// faults in 2 MiB at a time instead of 4 KiB: the flat parameter, gradient and AdamW buffers,
// checkpoint snapshots, a large vocabulary's logits. On this project's CI VMs (paravirtualized,
// ~15 us per fault) faulting in a 104M model's five parameter-sized buffers took 6 s, 0.5-0.9 s
// advised (docs/benchmarks.md, "Host huge pages"). The Trainer calls it before building the model
// when host_huge_pages is true (the default).
void host_memory_huge_pages();

// LibTorch CPU allocations, counted by a wrapper around the CPU allocator that
// host_allocations_watch installs (`available` is false until then; the Trainer watches on CPU
// devices). `watched` counts allocations of exactly the watched size (the flat gradient buffer's
// bytes; a later call only changes that size), so a gradient-sized temporary in the step cannot
// hide.
struct HostAllocationCounts {
  bool available = false;
  int64_t allocations = 0;  // since the watch started
  int64_t watched = 0;      // of them, exactly watch_bytes long
};
void host_allocations_watch(size_t watch_bytes);
HostAllocationCounts host_allocations();

}  // namespace trainer
