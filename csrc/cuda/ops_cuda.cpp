// The CUDA backend: the CUDA kernel table (csrc/cuda/*.cu) launched on the current stream of the
// tensors' device, and the TORCH_LIBRARY_IMPL blocks. None of the kernels syncs with the host.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "cuda/kernels.cuh"
#include "ops/op_core.h"
#include "ops/op_layer.h"

namespace ampfuse::cuda {
namespace {

int num_sms(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= cache.size()) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

// For tests (0: no limit): size grids as if the device had at most this many multiprocessors, so
// that the kernel-level suite runs grids smaller than the chunk count on a real GPU as well.
std::atomic<int> g_sms_limit{0};

LaunchContext context(const c10::Device& device) {
  LaunchContext ctx{};
  ctx.stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const int limit = g_sms_limit.load(std::memory_order_relaxed);
  ctx.num_sms = limit > 0 ? std::min(limit, num_sms(device.index())) : num_sms(device.index());
  return ctx;
}

bool capturing(const LaunchContext& ctx) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(ctx.stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

constexpr ops::Backend kBackend{&kernel_table, &context, &capturing};

}  // namespace
}  // namespace ampfuse::cuda

// For tests: see g_sms_limit. Returns the previous limit.
extern "C" __attribute__((visibility("default"))) int ampfuse_limit_cuda_sms(int limit) {
  return ampfuse::cuda::g_sms_limit.exchange(limit > 0 ? limit : 0);
}

TORCH_LIBRARY_IMPL(ampfuse, CUDA, m) {
  ampfuse::ops::register_device<ampfuse::cuda::kBackend>(m, c10::DeviceType::CUDA);
}

// Sparse tensors reach the same entry points, whose validation rejects them with a clear message.
TORCH_LIBRARY_IMPL(ampfuse, SparseCUDA, m) {
  ampfuse::ops::register_kernels<ampfuse::cuda::kBackend>(m);
}
