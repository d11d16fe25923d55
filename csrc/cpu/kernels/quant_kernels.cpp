// CPU kernels of the 8-bit block-scaled form (compiled once per CPU capability; see kernels.h):
// a flat fp32 run to bytes + one absmax per block and back, by the rules of ops/rules.h. One
// parallel pass over whole blocks; each block's absmax is its own reduction, so the results do
// not depend on the thread count.
#include "cpu/kernels/quant_codec.h"
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

// fn(first block, first element, end element) per work item of whole blocks.
template <typename Fn>
void parallel_blocks(int64_t numel, const Fn& fn) {
  const int64_t blocks = (numel + kQuantBlock - 1) / kQuantBlock;
  at::parallel_for(0, blocks, kBlocksPerItem, [&](int64_t b, int64_t e) {
    fn(b, b * kQuantBlock, std::min(numel, e * kQuantBlock));
  });
}

int quantize(const QuantizeArgs& a, const LaunchContext&) {
  const QuantTable& table = quant_table(a.format);
  parallel_blocks(a.numel, [&](int64_t k, int64_t begin, int64_t end) {
    block_absmax_cpu(a.values + begin, end - begin, a.absmax + k);
    encode_blocks_cpu(a.values + begin, end - begin, a.absmax + k, table, a.format, a.nonnegative,
                      a.codes + begin);
  });
  return 0;
}

int dequantize(const DequantizeArgs& a, const LaunchContext&) {
  const QuantTable& table = quant_table(a.format);
  parallel_blocks(a.numel, [&](int64_t k, int64_t begin, int64_t end) {
    decode_blocks_cpu(a.codes + begin, end - begin, a.absmax + k, table, a.format, a.values + begin);
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
