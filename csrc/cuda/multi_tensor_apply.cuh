// ampfuse's multi-tensor apply: process a list of tensors in one kernel launch whatever their number
// and sizes.
//
// - Tensor metadata (pointers for N lists, int64 element counts, chunk offsets) is passed by value
//   as a __grid_constant__ kernel parameter (TensorListMeta, up to kMax tensors in the 32 KB
//   kernel-parameter space of CUDA >= 12.1): no host-to-device copy, safe under CUDA-graph capture.
//   More tensors than that go into a table in device memory (TableMeta) that the op layer keeps
//   resident, cached by content (LaunchContext::resident): one launch for any number of tensors,
//   re-uploaded only when a pointer changes. Without a resident table the list is split into
//   launches of kMax tensors.
// - Each tensor is cut into chunks of kChunkSize elements; a fixed-size grid walks all chunks of the
//   launch with a grid-stride loop, finding a chunk's tensor by binary search over the offsets.
// - Kernels use 16-byte vector accesses when every list's pointer is 16-byte aligned, and a
//   bounds-checked scalar path otherwise and for the tail.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda/kernels.cuh"

namespace ampfuse::cuda {

constexpr int64_t kChunkSize = 32768;  // elements per chunk (a multiple of every vector width)
constexpr int kBlockSize = 256;
constexpr int kBlocksPerSM = 4;
// CUDA >= 12.1 on Volta+ accepts 32764 bytes of kernel parameters; keep a margin for the
// functor's own arguments.
constexpr int kMetaBytes = 30000;

template <int N>
constexpr int max_tensors_per_launch() {
  // ptr[N] + numel + chunk_start + index + dtype
  return (kMetaBytes - 64) / (8 * N + 8 + 4 + 4 + 1);
}

template <int N>
struct TensorListMeta {
  static constexpr int kMax = max_tensors_per_launch<N>();
  void* ptr[N][kMax];
  int64_t numel[kMax];
  int32_t chunk_start[kMax + 1];  // chunk_start[count] == chunks in this launch
  int32_t index[kMax];            // position of the tensor in the caller's list
  uint8_t dtype[kMax];
  int32_t count;
  int32_t block_offset;  // blocks of all previous launches of the same pass
  int32_t total_blocks;  // blocks of all launches of the pass
};

// The same metadata in device memory (a table laid out by build_table below), for any count.
// meta.ptr[l][t], meta.numel[t], ... read as for TensorListMeta.
template <int N>
struct TableMeta {
  struct Rows {
    void* const* base;  // [N][stride]
    int32_t stride;
    __host__ __device__ void* const* operator[](int l) const { return base + l * stride; }
  };
  Rows ptr;
  const int64_t* numel;        // [count]
  const int32_t* chunk_start;  // [count + 1]
  const int32_t* index;        // [count]
  const uint8_t* dtype;        // [count]
  int32_t count;
  int32_t block_offset;  // blocks of all previous launches of the same pass (0 for a resident table)
  int32_t total_blocks;
};

// A TableMeta reading a by-value TensorListMeta in place: a kernel taking either runs one pass body.
template <int N>
__device__ __forceinline__ TableMeta<N> view_of(const TensorListMeta<N>& meta) {
  TableMeta<N> view;
  view.ptr = {&meta.ptr[0][0], TensorListMeta<N>::kMax};
  view.numel = meta.numel;
  view.chunk_start = meta.chunk_start;
  view.index = meta.index;
  view.dtype = meta.dtype;
  view.count = meta.count;
  view.block_offset = meta.block_offset;
  view.total_blocks = meta.total_blocks;
  return view;
}

// Host-side description of one tensor (N lists).
template <int N>
struct HostTensor {
  void* ptr[N];
  int64_t numel;
  int32_t index;
  uint8_t dtype;
};

// The tensor holding chunk `c` (binary search over the chunk offsets).
template <typename Meta>
__device__ __forceinline__ int find_tensor(const Meta& meta, int32_t c) {
  int lo = 0, hi = meta.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta.chunk_start[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ bool is_aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Element conversions (round to nearest even on the way down).
template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 16 bytes of T.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// Chunks of a tensor: an empty tensor still gets one (empty) chunk, so that per-tensor work done
// once per tensor (e.g. advancing an optimizer step counter) happens for it too.
inline int64_t chunks_of(int64_t numel) {
  return numel == 0 ? 1 : (numel + kChunkSize - 1) / kChunkSize;
}

// Launches of one pass over `tensors`: `launch(meta, grid)` is called with a TensorListMeta<N> (by
// value) when the tensors fit one, else with a TableMeta<N> (one launch, the table made resident
// through ctx.resident), else (no resident tables) with one TensorListMeta<N> per kMax tensors.
// Each grid has at most max_grid blocks and at least one, so every launch takes part in
// cross-block reductions. Returns the first launch error.
template <int N, typename LaunchFn>
cudaError_t multi_tensor_apply(const std::vector<HostTensor<N>>& tensors, int max_grid,
                               const LaunchContext& ctx, LaunchFn&& launch) {
  using Meta = TensorListMeta<N>;
  const int64_t count = static_cast<int64_t>(tensors.size());
  auto grid_for = [&](int64_t chunks) {
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(chunks, max_grid)));
  };
  // The resident table, when more tensors than fit in one launch's parameters.
  const unsigned char* dev = nullptr;
  size_t off_numel = 0, off_start = 0, off_index = 0, off_dtype = 0;
  if (count > Meta::kMax && ctx.resident != nullptr) {
    // One launch, the metadata in a resident device table: [ptr N x count][numel][chunk_start
    // count+1][index][dtype], each array 8-byte aligned.
    auto align8 = [](size_t n) { return (n + 7) / 8 * 8; };
    off_numel = align8(sizeof(void*) * N * count);
    off_start = off_numel + align8(sizeof(int64_t) * count);
    off_index = off_start + align8(sizeof(int32_t) * (count + 1));
    off_dtype = off_index + align8(sizeof(int32_t) * count);
    const size_t bytes = off_dtype + align8(count);
    std::vector<unsigned char> host(bytes, 0);
    auto* ptrs = reinterpret_cast<void**>(host.data());
    auto* numel = reinterpret_cast<int64_t*>(host.data() + off_numel);
    auto* start = reinterpret_cast<int32_t*>(host.data() + off_start);
    auto* index = reinterpret_cast<int32_t*>(host.data() + off_index);
    auto* dtype = reinterpret_cast<uint8_t*>(host.data() + off_dtype);
    int32_t chunk = 0;
    for (int64_t j = 0; j < count; ++j) {
      const HostTensor<N>& t = tensors[j];
      for (int l = 0; l < N; ++l) ptrs[l * count + j] = t.ptr[l];
      numel[j] = t.numel;
      start[j] = chunk;
      index[j] = t.index;
      dtype[j] = t.dtype;
      chunk += static_cast<int32_t>(chunks_of(t.numel));
    }
    start[count] = chunk;
    // null: not resident and not uploadable now (during a CUDA-graph capture): split below.
    dev = static_cast<const unsigned char*>(ctx.resident(ctx.resident_self, host.data(), bytes));
  }
  if (dev != nullptr) {
    TableMeta<N> meta;
    meta.ptr = {reinterpret_cast<void* const*>(dev), static_cast<int32_t>(count)};
    meta.numel = reinterpret_cast<const int64_t*>(dev + off_numel);
    meta.chunk_start = reinterpret_cast<const int32_t*>(dev + off_start);
    meta.index = reinterpret_cast<const int32_t*>(dev + off_index);
    meta.dtype = dev + off_dtype;
    meta.count = static_cast<int32_t>(count);
    meta.block_offset = 0;
    int64_t chunks = 0;
    for (const HostTensor<N>& t : tensors) chunks += chunks_of(t.numel);
    meta.total_blocks = grid_for(chunks);
    launch(meta, meta.total_blocks);
    return cudaGetLastError();
  }

  struct Batch {
    size_t begin, end;
    int64_t chunks;
  };
  std::vector<Batch> batches;
  size_t b = 0;
  do {
    Batch batch{b, std::min(tensors.size(), b + static_cast<size_t>(Meta::kMax)), 0};
    for (size_t i = batch.begin; i < batch.end; ++i) {
      batch.chunks += chunks_of(tensors[i].numel);
    }
    batches.push_back(batch);
    b = batch.end;
  } while (b < tensors.size());

  int32_t total_blocks = 0;
  std::vector<int> grids;
  for (const Batch& batch : batches) {
    grids.push_back(grid_for(batch.chunks));
    total_blocks += grids.back();
  }

  int32_t block_offset = 0;
  for (size_t k = 0; k < batches.size(); ++k) {
    Meta meta;
    meta.count = static_cast<int32_t>(batches[k].end - batches[k].begin);
    int32_t chunk = 0;
    for (int32_t j = 0; j < meta.count; ++j) {
      const HostTensor<N>& t = tensors[batches[k].begin + j];
      for (int l = 0; l < N; ++l) meta.ptr[l][j] = t.ptr[l];
      meta.numel[j] = t.numel;
      meta.index[j] = t.index;
      meta.dtype[j] = t.dtype;
      meta.chunk_start[j] = chunk;
      chunk += static_cast<int32_t>(chunks_of(t.numel));
    }
    meta.chunk_start[meta.count] = chunk;
    meta.block_offset = block_offset;
    meta.total_blocks = total_blocks;
    launch(meta, grids[k]);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    block_offset += grids[k];
  }
  return cudaSuccess;
}

// The most launches a pass over `count` tensors takes (sizes per-block scratch such as norm
// partials): one with a resident table, but without one (e.g. not uploadable during a CUDA-graph
// capture) one per kMax tensors.
template <int N>
int64_t pass_launches(int64_t count) {
  const int64_t cap = TensorListMeta<N>::kMax;
  return count == 0 ? 1 : (count + cap - 1) / cap;
}

// Deterministic block-wide reduction by `combine` of one value per thread; the result is valid in
// thread 0. `shared` holds kBlockSize / 32 values; `identity` fills the missing warps' slots.
template <typename T, class Combine>
__device__ __forceinline__ T block_reduce_by(T v, T* shared, T identity, Combine combine) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (kBlockSize / 32) ? shared[lane] : identity;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = combine(v, __shfl_down_sync(0xffffffffu, v, off));
  }
  __syncthreads();
  return v;
}

// Sum or max (NaN-propagating) of one value per thread (float or double), as block_reduce_by.
template <bool kMax, typename T>
__device__ __forceinline__ T block_reduce(T v, T* shared) {
  return block_reduce_by(v, shared, T(0), [](T a, T o) { return kMax ? ((o > a || o != o) ? o : a) : a + o; });
}

// absmax_combine over a quantization block's values' absmax_term (a thread past the end gives 0),
// valid in thread 0: what quant_block_absmax turns into the block's absmax.
__device__ __forceinline__ float block_absmax_reduce(float x, bool live, float* shared) {
  return block_reduce_by(live ? absmax_term(x) : 0.0f, shared, 0.0f,
                         [](float a, float b) { return absmax_combine(a, b); });
}

// ---- 8-bit block-scaled state (ops/rules.h) ----------------------------------------------------

static_assert(kBlockSize == kQuantBlock, "one thread per element of a quantization block");

// One entry of a format's table (a call under the emulator: the entry's early returns must not
// give the barrier after it a different call path per thread, which the host compiler's tail
// duplication of an inlined body would).
static __device__ AMPFUSE_PASS_BODY float quant_table_entry_of(QuantFormat f, int i) {
  return quant_table_entry(f, i);
}

// The formats of a call's state lists, by value (a pointer to a kernel parameter would give the
// kernel a stack frame).
struct QuantFormats {
  QuantFormat f[3];
};

// The tables of NT formats in shared memory: every thread computes one entry of each (those past
// a format's size are never read), then the block synchronises.
template <int NT>
__device__ __forceinline__ void fill_tables(float (*tables)[256], QuantFormats formats) {
#pragma unroll
  for (int k = 0; k < NT; ++k) {
    tables[k][threadIdx.x] = quant_table_entry_of(formats.f[k], static_cast<int>(threadIdx.x));
  }
  __syncthreads();
}

}  // namespace ampfuse::cuda
