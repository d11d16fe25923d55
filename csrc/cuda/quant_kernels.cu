// CUDA kernels of the 8-bit block-scaled form: a flat fp32 run to bytes + one absmax per block
// and back, by the rules of ops/rules.h. One CUDA block of kQuantBlock threads per quantization
// block (grid-stride over the blocks): each thread holds one element, the block reduces their
// magnitudes to the absmax, and every thread encodes its element with it. The format's table is
// computed into shared memory by the block's threads (fill_tables, multi_tensor_apply.cuh).
#include "cuda/kernels.cuh"
#include "cuda/multi_tensor_apply.cuh"

namespace ampfuse::cuda {
namespace {

using kernels::DequantizeArgs;
using kernels::QuantizeArgs;

__global__ void __launch_bounds__(kBlockSize) quantize_kernel(QuantizeArgs a) {
  AMPFUSE_SHARED(float, table, [1][256]);
  AMPFUSE_SHARED(float, partial, [kBlockSize / 32]);
  AMPFUSE_SHARED(float, block_absmax, [1]);
  fill_tables<1>(table, QuantFormats{{a.format, a.format, a.format}});
  const int64_t blocks = (a.numel + kQuantBlock - 1) / kQuantBlock;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t i = b * kQuantBlock + threadIdx.x;
    const float x = i < a.numel ? a.values[i] : 0.0f;
    const float m = block_absmax_reduce(x, i < a.numel, partial);
    if (threadIdx.x == 0) {
      block_absmax[0] = quant_block_absmax(m);
      a.absmax[b] = block_absmax[0];
    }
    __syncthreads();
    if (i < a.numel) a.codes[i] = quant_encode(x, block_absmax[0], table[0], a.format, a.nonnegative);
  }
}

__global__ void __launch_bounds__(kBlockSize) dequantize_kernel(DequantizeArgs a) {
  AMPFUSE_SHARED(float, table, [1][256]);
  fill_tables<1>(table, QuantFormats{{a.format, a.format, a.format}});
  const int64_t blocks = (a.numel + kQuantBlock - 1) / kQuantBlock;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t i = b * kQuantBlock + threadIdx.x;
    if (i < a.numel) a.values[i] = quant_decode(a.codes[i], a.absmax[b], table[0], a.format);
  }
}

int grid_for(int64_t numel, const LaunchContext& ctx) {
  const int64_t blocks = (numel + kQuantBlock - 1) / kQuantBlock;
  return static_cast<int>(std::min<int64_t>(blocks, static_cast<int64_t>(ctx.num_sms) * kBlocksPerSM));
}

int quantize(const QuantizeArgs& a, const LaunchContext& ctx) {
  if (a.numel == 0) return cudaSuccess;
  AMPFUSE_LAUNCH(grid_for(a.numel, ctx), kBlockSize, 0, stream_of(ctx), quantize_kernel)(a);
  return cudaGetLastError();
}

int dequantize(const DequantizeArgs& a, const LaunchContext& ctx) {
  if (a.numel == 0) return cudaSuccess;
  AMPFUSE_LAUNCH(grid_for(a.numel, ctx), kBlockSize, 0, stream_of(ctx), dequantize_kernel)(a);
  return cudaGetLastError();
}

}  // namespace

void fill_quant_kernels(KernelTable& table) {
  table.quantize = &quantize;
  table.dequantize = &dequantize;
}

}  // namespace ampfuse::cuda
