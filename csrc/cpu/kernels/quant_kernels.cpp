// CPU kernels of the 8-bit block-scaled form (compiled once per CPU capability; see kernels.h):
// a flat fp32 run to bytes + one absmax per block and back, by the rules of ops/rules.h. One
// parallel pass over whole blocks; each block's absmax is its own reduction, so the results do
// not depend on the thread count.
#include "cpu/kernels/vec_utils.h"

#include <algorithm>
#include <array>

namespace ampfuse::cpu {
namespace CPU_CAPABILITY {
namespace {

using kernels::DequantizeArgs;
using kernels::KernelTable;
using kernels::LaunchContext;
using kernels::QuantizeArgs;

// Blocks per parallel work item: kChunkElements elements, as the other passes.
constexpr int64_t kBlocksPerItem = kChunkElements / kQuantBlock;

template <typename Fn>
void parallel_blocks(int64_t numel, const Fn& fn) {
  const int64_t blocks = (numel + kQuantBlock - 1) / kQuantBlock;
  at::parallel_for(0, blocks, kBlocksPerItem, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t begin = k * kQuantBlock;
      fn(k, begin, std::min(numel, begin + kQuantBlock));
    }
  });
}

int quantize(const QuantizeArgs& a, const LaunchContext&) {
  const QuantTable& table = quant_table(a.format);
  parallel_blocks(a.numel, [&](int64_t k, int64_t begin, int64_t end) {
    float m = 0.0f;
    for (int64_t i = begin; i < end; ++i) m = absmax_combine(m, std::fabs(a.values[i]));
    const float absmax = quant_block_absmax(m);
    a.absmax[k] = absmax;
    for (int64_t i = begin; i < end; ++i) {
      a.codes[i] = quant_encode_cpu(a.values[i], absmax, table, a.format, a.nonnegative);
    }
  });
  return 0;
}

int dequantize(const DequantizeArgs& a, const LaunchContext&) {
  const float* table = quant_table(a.format).entries;
  parallel_blocks(a.numel, [&](int64_t k, int64_t begin, int64_t end) {
    const float absmax = a.absmax[k];
    for (int64_t i = begin; i < end; ++i) a.values[i] = quant_decode(a.codes[i], absmax, table, a.format);
  });
  return 0;
}

}  // namespace

void fill_quant_kernels(KernelTable& table) {
  table.quantize = &quantize;
  table.dequantize = &dequantize;
}

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
