// CUDA kernels of the fused optimizers: one multi-tensor pass reads each element's grad, param,
// master (fp32, or the int16 remainder of a bf16 param) and state (fp32 or bf16) once and writes
// param, master and state once. A set found_inf makes every block return before touching memory.
// The per-tensor step counter is advanced by the last block to finish a chunk of that tensor (all
// blocks have read it by then), so no second launch is needed. The update rules are shared with
// the CPU kernels (ops/rules.h).
//
// Supported (param, grad) dtypes: (fp32, fp32), and for fp16/bf16 params grads of the param's
// dtype or fp32 (an accumulator's sums); masters for fp16/bf16 params, remainders or stochastic
// rounding (no master) for bf16 params.
#include <type_traits>

#include "cuda/kernels.cuh"
#include "cuda/multi_tensor_apply.cuh"

namespace ampfuse::cuda {
namespace {

using kernels::MasterKind;
using kernels::OptimArgs;
using kernels::OptimTensor;

struct CudaMath {
  static __device__ __forceinline__ float neg(float x) { return -x; }
  static __device__ __forceinline__ float sqrt(float x) { return sqrtf(x); }
  // NaN-propagating maximum, as torch.maximum.
  static __device__ __forceinline__ float max(float a, float b) {
    return (a != a || b != b) ? a + b : fmaxf(a, b);
  }
  static __device__ __forceinline__ float fma(float a, float b, float c) { return fmaf(a, b, c); }
};

// Scalars the GradScaler hands over (device pointers, read once per block).
struct ScaleArgs {
  const float* lr_tensor;
  const float* momentum_tensor;
  const float* grad_scale;
  const float* found_inf;
  const float* clip_coef;
  unsigned int* counters;  // one per tensor of the call, zero on entry, left zero
};

struct SgdKind {
  using Hyper = SgdHyper;
  using Scalars = SgdScalars;
  static constexpr int kStates = 1;
  // Whether state k is >= 0 (8-bit state: the second-moment form of ops/rules.h).
  static constexpr __device__ bool nonnegative(int) { return false; }
  static __device__ Scalars scalars(const Hyper& h, double lr, float step) {
    return sgd_scalars(h, lr, step);
  }
  static __device__ __forceinline__ float update(float p, float g, float (&st)[kStates],
                                                 const Scalars& s) {
    if (!s.has_momentum) return sgd_update<float, CudaMath>(p, g, nullptr, s);
    if (s.first_step) st[0] = 0.0f;
    return sgd_update<float, CudaMath>(p, g, &st[0], s);
  }
  static __device__ __forceinline__ bool uses_state(const Scalars& s, int k) {
    return s.has_momentum;
  }
};

template <bool kAmsgrad>
struct AdamKind {
  using Hyper = AdamHyper;
  using Scalars = AdamScalars;
  static constexpr int kStates = kAmsgrad ? 3 : 2;
  static constexpr __device__ bool nonnegative(int k) { return k > 0; }  // exp_avg_sq, max_exp_avg_sq
  static __device__ Scalars scalars(const Hyper& h, double lr, float step) {
    return adam_scalars(h, lr, step);
  }
  static __device__ __forceinline__ float update(float p, float g, float (&st)[kStates],
                                                 const Scalars& s) {
    float unused = 0.0f;
    float& vmax = kAmsgrad ? st[kStates - 1] : unused;
    return adam_update<float, CudaMath>(p, g, st[0], st[1], vmax, s);
  }
  static __device__ __forceinline__ bool uses_state(const Scalars&, int) { return true; }
};

// Lists of the metadata: param, grad, master, states..., step.
template <class Kind>
constexpr int kLists = 3 + Kind::kStates + 1;

// Resident blocks per multiprocessor the kernels are compiled for (__launch_bounds__) and grids are
// sized by. Adam's rows (two or three states besides param, grad and master) need more than the 64
// registers that 4 blocks of 256 threads leave (ptxas spilled 4-20 bytes in 21 of its kernels):
// 3 blocks, 80 registers, no spills. SGD keeps 4.
template <class Kind>
constexpr int kOptimBlocksPerSM = Kind::kStates >= 2 ? 3 : kBlocksPerSM;

template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ bool aligned_quad(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T))) == 0;
}

// The master of one element, as MasterKind says where it lives (ops/rules.h).
template <MasterKind MK, typename T>
struct Master {
  using Storage = std::conditional_t<MK == MasterKind::Remainder, int16_t, float>;
  // Whether a master tensor exists (known at compile time: the kinds without one keep no
  // registers for it).
  static constexpr bool kTensor = MK == MasterKind::Float || MK == MasterKind::Remainder;
  // The value the update starts from.
  static __device__ __forceinline__ float load(T param, Storage master) {
    if constexpr (MK == MasterKind::None || MK == MasterKind::Stochastic) {
      return to_float(param);
    } else if constexpr (MK == MasterKind::Float) {
      return synced_master(master, to_float(from_float<T>(master)), to_float(param));
    } else {
      static_assert(std::is_same_v<T, __nv_bfloat16>, "remainders are for bf16 params");
      return join_master(__bfloat16_as_ushort(param), master);
    }
  }
  // The param (and master) of updated value p; element `i` of its tensor, whose param held `old`
  // (stochastic rounding draws with `key`, the rounding_key of the tensor's step).
  static __device__ __forceinline__ T store(float p, Storage& master, uint32_t key, int64_t i, T old) {
    if constexpr (MK == MasterKind::None) {
      return from_float<T>(p);
    } else if constexpr (MK == MasterKind::Stochastic) {
      static_assert(std::is_same_v<T, __nv_bfloat16>, "stochastic rounding is for bf16 params");
      return __ushort_as_bfloat16(round_bf16_stochastic(p, rounding_bits(key, i, __bfloat16_as_ushort(old))));
    } else if constexpr (MK == MasterKind::Float) {
      master = p;
      return from_float<T>(p);
    } else {
      uint16_t bits;
      split_master(p, &bits, &master);
      return __ushort_as_bfloat16(bits);
    }
  }
};

// Elements [begin, end) of one tensor, processed by the whole block. Not inlined: the two kernels
// (metadata by value, metadata in a table) share one copy of each instantiation.
template <typename T, typename G, class Kind, MasterKind MK, typename S>
__device__ AMPFUSE_PASS_BODY void process_chunk(T* param, const G* grad,
                                           typename Master<MK, T>::Storage* master,
                                           S* const* state, int64_t begin, int64_t end,
                                           const typename Kind::Scalars& s, bool divide,
                                           float grad_scale, float clip, uint32_t key) {
  constexpr int NS = Kind::kStates;
  using M = Master<MK, T>;
  using MS = typename M::Storage;
  bool vec = aligned_quad<T>(param) && aligned_quad<G>(grad) &&
             (!M::kTensor || master == nullptr || aligned_quad<MS>(master));
#pragma unroll
  for (int k = 0; k < NS; ++k) vec = vec && (state[k] == nullptr || aligned_quad<S>(state[k]));
  int64_t i0 = begin;
  if (vec) {
    const int64_t nq = (end - begin) / 4;
    for (int64_t q = threadIdx.x; q < nq; q += blockDim.x) {
      const int64_t i = begin + 4 * q;
      float p[4], st[NS][4] = {};  // absent states stay 0 (never stored)
      const Quad<T> pq = *reinterpret_cast<const Quad<T>*>(param + i);
      Quad<MS> mq{};
      if (M::kTensor && master) mq = *reinterpret_cast<const Quad<MS>*>(master + i);
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = M::load(pq.v[e], mq.v[e]);
      const Quad<G> gq = *reinterpret_cast<const Quad<G>*>(grad + i);
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (state[k] != nullptr && Kind::uses_state(s, k)) {
          const Quad<S> sq = *reinterpret_cast<const Quad<S>*>(state[k] + i);
#pragma unroll
          for (int e = 0; e < 4; ++e) st[k][e] = to_float(sq.v[e]);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float ge = to_float(gq.v[e]);
        if (divide) ge = ge / grad_scale;
        if (clip != 1.0f) ge = ge * clip;
        float se[NS];
#pragma unroll
        for (int k = 0; k < NS; ++k) se[k] = st[k][e];
        p[e] = Kind::update(p[e], ge, se, s);
#pragma unroll
        for (int k = 0; k < NS; ++k) st[k][e] = se[k];
      }
      Quad<T> out;
#pragma unroll
      for (int e = 0; e < 4; ++e) out.v[e] = M::store(p[e], mq.v[e], key, i + e, pq.v[e]);
      *reinterpret_cast<Quad<T>*>(param + i) = out;
      if (M::kTensor && master) *reinterpret_cast<Quad<MS>*>(master + i) = mq;
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (state[k] != nullptr && Kind::uses_state(s, k)) {
          Quad<S> sq;
#pragma unroll
          for (int e = 0; e < 4; ++e) sq.v[e] = from_float<S>(st[k][e]);
          *reinterpret_cast<Quad<S>*>(state[k] + i) = sq;
        }
      }
    }
    i0 = begin + 4 * nq;
  }
  for (int64_t i = i0 + threadIdx.x; i < end; i += blockDim.x) {
    MS m = (M::kTensor && master) ? master[i] : MS{};
    const T old = param[i];
    float p = M::load(old, m);
    float g = to_float(grad[i]);
    if (divide) g = g / grad_scale;
    if (clip != 1.0f) g = g * clip;
    float se[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      se[k] = (state[k] != nullptr && Kind::uses_state(s, k)) ? to_float(state[k][i]) : 0.0f;
    }
    p = Kind::update(p, g, se, s);
    param[i] = M::store(p, m, key, i, old);
    if (M::kTensor && master) master[i] = m;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      if (state[k] != nullptr && Kind::uses_state(s, k)) state[k][i] = from_float<S>(se[k]);
    }
  }
}

// After a block's pass over a chunk of tensor t: the last block to finish a chunk of t advances
// its step (every block of t has read the old value before arriving here).
template <typename Meta>
__device__ __forceinline__ void chunk_done(const Meta& meta, const ScaleArgs& sa, int t, float* step) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned int* counter = sa.counters + meta.index[t];
    const unsigned int chunks_of_t =
        static_cast<unsigned int>(meta.chunk_start[t + 1] - meta.chunk_start[t]);
    if (atomicAdd(counter, 1u) == chunks_of_t - 1) {
      *step = *step + 1.0f;
      *counter = 0u;
    }
  }
}

// How a pass prepares each grad: divided by the scale, multiplied by the clip coefficient.
struct GradPrep {
  float grad_scale;
  bool divide;
  float clip;
  __device__ __forceinline__ float operator()(float g) const {
    if (divide) g = g / grad_scale;
    if (clip != 1.0f) g = g * clip;
    return g;
  }
};

// The grid-stride walk every optimizer pass shares: nothing at all when found_inf is set; else
// for each chunk of the launch body(t, begin, end, scalars of the tensor's step, grad prep, the
// stochastic rounding key of the step), then chunk_done. `meta` is a TableMeta view (of a table
// in device memory, or of the by-value metadata); the step is the last list.
template <class Kind, int N, typename Body>
__device__ __forceinline__ void for_each_chunk(const TableMeta<N>& meta, const ScaleArgs& sa,
                                               const typename Kind::Hyper& given, const Body& body) {
  if (sa.found_inf != nullptr && *sa.found_inf != 0.0f) return;  // skipped: touch nothing
  const typename Kind::Hyper hyper = with_momentum(given, sa.momentum_tensor);
  const double lr = sa.lr_tensor ? static_cast<double>(*sa.lr_tensor) : hyper.lr;
  const float grad_scale = sa.grad_scale ? *sa.grad_scale : 1.0f;
  const GradPrep prep{grad_scale, sa.grad_scale != nullptr && grad_scale != 1.0f,
                      sa.clip_coef ? *sa.clip_coef : 1.0f};
  const int32_t nchunks = meta.chunk_start[meta.count];
  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int t = find_tensor(meta, c);
    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.numel[t]);
    float* step = static_cast<float*>(meta.ptr[N - 1][t]);
    // __ldcg: the step is read through L2, where the tensor's last block advances it (after the
    // fence and ticket of chunk_done, which order this read before that write).
    const float step_before = __ldcg(step);
    body(t, begin, end, Kind::scalars(hyper, lr, step_before), prep,
         hyper.stochastic_rounding ? rounding_key(hyper.rounding_seed, step_before) : 0u);
    chunk_done(meta, sa, t, step);
  }
}

template <typename T, typename G, class Kind, MasterKind MK, typename S>
__device__ AMPFUSE_PASS_BODY void optim_pass(const TableMeta<kLists<Kind>>& meta, const ScaleArgs& sa,
                                        const typename Kind::Hyper& hyper) {
  constexpr int NS = Kind::kStates;
  using MS = typename Master<MK, T>::Storage;
  for_each_chunk<Kind>(meta, sa, hyper, [&](int t, int64_t begin, int64_t end,
                                            const typename Kind::Scalars& s, const GradPrep& prep,
                                            uint32_t key) {
    S* state[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) state[k] = static_cast<S*>(meta.ptr[3 + k][t]);
    process_chunk<T, G, Kind, MK, S>(static_cast<T*>(meta.ptr[0][t]),
                                     static_cast<const G*>(meta.ptr[1][t]),
                                     static_cast<MS*>(meta.ptr[2][t]), state, begin, end, s,
                                     prep.divide, prep.grad_scale, prep.clip, key);
  });
}

template <typename T, typename G, class Kind, MasterKind MK, typename S>
__global__ void __launch_bounds__(kBlockSize, kOptimBlocksPerSM<Kind>)
    optim_kernel(const __grid_constant__ TensorListMeta<kLists<Kind>> meta, ScaleArgs sa,
                 typename Kind::Hyper hyper) {
  optim_pass<T, G, Kind, MK, S>(view_of(meta), sa, hyper);
}

template <typename T, typename G, class Kind, MasterKind MK, typename S>
__global__ void __launch_bounds__(kBlockSize, kOptimBlocksPerSM<Kind>)
    optim_table_kernel(const __grid_constant__ TableMeta<kLists<Kind>> meta, ScaleArgs sa,
                       typename Kind::Hyper hyper) {
  optim_pass<T, G, Kind, MK, S>(meta, sa, hyper);
}

// ---- 8-bit state (OptimArgs::quantized_state) -----------------------------------------------
// Lists: param, grad, master, the states' codes, their absmax, step. A chunk (a multiple of
// kQuantBlock elements but at a tensor's end) is walked one quantization block at a time, one
// element per thread: dequantize each state, update in fp32, write param and master, then per
// state reduce the block's new absmax and requantize (ops/rules.h).
template <class Kind>
constexpr int kQuantLists = 3 + 2 * Kind::kStates + 1;

static_assert(kChunkSize % kQuantBlock == 0, "quantization blocks never straddle chunks");

template <typename T, typename G, class Kind, MasterKind MK>
__device__ AMPFUSE_PASS_BODY void optim_quant_pass(const TableMeta<kQuantLists<Kind>>& meta,
                                                   const ScaleArgs& sa, const typename Kind::Hyper& hyper,
                                                   QuantFormats formats) {
  constexpr int NS = Kind::kStates;
  using M = Master<MK, T>;
  using MS = typename M::Storage;
  AMPFUSE_SHARED(float, tables, [NS][256]);
  AMPFUSE_SHARED(float, partial, [kBlockSize / 32]);
  AMPFUSE_SHARED(float, block_absmax, [1]);
  fill_tables<NS>(tables, formats);
  for_each_chunk<Kind>(meta, sa, hyper, [&](int t, int64_t begin, int64_t end,
                                            const typename Kind::Scalars& s, const GradPrep& prep,
                                            uint32_t key) {
    T* param = static_cast<T*>(meta.ptr[0][t]);
    const G* grad = static_cast<const G*>(meta.ptr[1][t]);
    MS* master = static_cast<MS*>(meta.ptr[2][t]);
    for (int64_t b0 = begin; b0 < end; b0 += kQuantBlock) {
      const int64_t i = b0 + threadIdx.x;
      const int64_t block = b0 / kQuantBlock;
      const bool live = i < end;
      float se[NS];
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        const auto* codes = static_cast<const uint8_t*>(meta.ptr[3 + k][t]);
        const float* absmax = static_cast<const float*>(meta.ptr[3 + NS + k][t]);
        se[k] = (live && Kind::uses_state(s, k)) ? quant_decode(codes[i], absmax[block], tables[k], formats.f[k]) : 0.0f;
      }
      if (live) {
        MS m = (M::kTensor && master) ? master[i] : MS{};
        const T old = param[i];
        const float p = Kind::update(M::load(old, m), prep(to_float(grad[i])), se, s);
        param[i] = M::store(p, m, key, i, old);
        if (M::kTensor && master) master[i] = m;
      }
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (!Kind::uses_state(s, k)) continue;  // uniform over the block
        const float mag = block_absmax_reduce(se[k], live, partial);
        float* absmax = static_cast<float*>(meta.ptr[3 + NS + k][t]);
        if (threadIdx.x == 0) {
          block_absmax[0] = quant_block_absmax(mag);
          absmax[block] = block_absmax[0];
        }
        __syncthreads();
        if (live) {
          static_cast<uint8_t*>(meta.ptr[3 + k][t])[i] =
              quant_encode(se[k], block_absmax[0], tables[k], formats.f[k], Kind::nonnegative(k));
        }
      }
    }
  });
}

template <typename T, typename G, class Kind, MasterKind MK>
__global__ void __launch_bounds__(kBlockSize, kOptimBlocksPerSM<Kind>)
    optim_quant_kernel(const __grid_constant__ TensorListMeta<kQuantLists<Kind>> meta, ScaleArgs sa,
                       typename Kind::Hyper hyper, QuantFormats formats) {
  optim_quant_pass<T, G, Kind, MK>(view_of(meta), sa, hyper, formats);
}

template <typename T, typename G, class Kind, MasterKind MK>
__global__ void __launch_bounds__(kBlockSize, kOptimBlocksPerSM<Kind>)
    optim_quant_table_kernel(const __grid_constant__ TableMeta<kQuantLists<Kind>> meta, ScaleArgs sa,
                             typename Kind::Hyper hyper, QuantFormats formats) {
  optim_quant_pass<T, G, Kind, MK>(meta, sa, hyper, formats);
}

// Workspace: one arrival counter per tensor of the call. Fresh workspace is zeroed on the stream
// here; a persistent one (ctx.workspace_zeroed) is left zero by the last block of each tensor.
size_t optim_workspace(const OptimArgs& a, const LaunchContext&) {
  return sizeof(unsigned int) * static_cast<size_t>(a.num_tensors > 0 ? a.num_tensors : 1);
}

// The metadata rows of a call (param, grad, master, states[, absmax], step) and its arrival
// counters (fresh workspace zeroed here), then `launch(tensors, scale args)`.
template <class Kind, int N, typename Launch>
int launch_rows(const OptimArgs& a, void* workspace, const LaunchContext& ctx, const Launch& launch) {
  constexpr int NS = Kind::kStates;
  std::vector<HostTensor<N>> tensors;
  tensors.reserve(a.num_tensors);
  for (int64_t i = 0; i < a.num_tensors; ++i) {
    const OptimTensor& o = a.tensors[i];
    HostTensor<N> h{};
    h.ptr[0] = o.param;
    h.ptr[1] = const_cast<void*>(o.grad);
    h.ptr[2] = o.master;
    for (int k = 0; k < NS; ++k) h.ptr[3 + k] = o.state[k];
    if constexpr (N == kQuantLists<Kind>) {
      for (int k = 0; k < NS; ++k) h.ptr[3 + NS + k] = o.absmax[k];
    }
    h.ptr[N - 1] = o.step;
    h.numel = o.numel;
    h.index = static_cast<int32_t>(i);
    h.dtype = 0;
    tensors.push_back(h);
  }
  if (!ctx.workspace_zeroed) {
    const cudaError_t err = cudaMemsetAsync(workspace, 0, optim_workspace(a, ctx), stream_of(ctx));
    if (err != cudaSuccess) return err;
  }
  const ScaleArgs sa{a.lr_tensor, a.momentum_tensor, a.grad_scale, a.found_inf, a.clip_coef,
                     static_cast<unsigned int*>(workspace)};
  return launch(tensors, sa);
}

template <class Kind, typename T, typename G, MasterKind MK, typename S>
int launch_optim(const OptimArgs& a, const typename Kind::Hyper& hyper, void* workspace,
                 const LaunchContext& ctx) {
  constexpr int N = kLists<Kind>;
  const cudaStream_t stream = stream_of(ctx);
  constexpr int kPerSM = kOptimBlocksPerSM<Kind>;
  return launch_rows<Kind, N>(a, workspace, ctx, [&](const auto& tensors, const ScaleArgs& sa) {
    return multi_tensor_apply<N>(tensors, ctx.num_sms * kPerSM, ctx, [&](const auto& meta, int grid) {
      if constexpr (std::is_same_v<std::decay_t<decltype(meta)>, TensorListMeta<N>>) {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, optim_kernel<T, G, Kind, MK, S>)(meta, sa, hyper);
      } else {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, optim_table_kernel<T, G, Kind, MK, S>)(meta, sa, hyper);
      }
    });
  });
}

template <class Kind, typename T, typename G, MasterKind MK>
int launch_optim_quantized(const OptimArgs& a, const typename Kind::Hyper& hyper, void* workspace,
                           const LaunchContext& ctx) {
  constexpr int N = kQuantLists<Kind>;
  const cudaStream_t stream = stream_of(ctx);
  constexpr int kPerSM = kOptimBlocksPerSM<Kind>;
  const QuantFormats formats{{a.state_format[0], a.state_format[1], a.state_format[2]}};
  return launch_rows<Kind, N>(a, workspace, ctx, [&](const auto& tensors, const ScaleArgs& sa) {
    return multi_tensor_apply<N>(tensors, ctx.num_sms * kPerSM, ctx, [&](const auto& meta, int grid) {
      if constexpr (std::is_same_v<std::decay_t<decltype(meta)>, TensorListMeta<N>>) {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, optim_quant_kernel<T, G, Kind, MK>)(meta, sa, hyper, formats);
      } else {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, optim_quant_table_kernel<T, G, Kind, MK>)(meta, sa, hyper, formats);
      }
    });
  });
}

// The supported combinations (see the file comment), state dtype last.
template <class Kind, typename T, typename G, MasterKind MK>
int with_state(const OptimArgs& a, const typename Kind::Hyper& h, void* ws, const LaunchContext& ctx) {
  if (a.quantized_state) return launch_optim_quantized<Kind, T, G, MK>(a, h, ws, ctx);
  if (a.state_dtype == DType::BFloat16) return launch_optim<Kind, T, G, MK, __nv_bfloat16>(a, h, ws, ctx);
  return launch_optim<Kind, T, G, MK, float>(a, h, ws, ctx);
}

template <class Kind, typename T, typename G>
int with_master(const OptimArgs& a, const typename Kind::Hyper& h, void* ws, const LaunchContext& ctx) {
  if constexpr (std::is_same_v<T, float>) {
    return with_state<Kind, T, G, MasterKind::None>(a, h, ws, ctx);
  } else {
    if (a.master == MasterKind::Float) return with_state<Kind, T, G, MasterKind::Float>(a, h, ws, ctx);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (a.master == MasterKind::Remainder) {
        return with_state<Kind, T, G, MasterKind::Remainder>(a, h, ws, ctx);
      }
      if (a.master == MasterKind::Stochastic) {
        return with_state<Kind, T, G, MasterKind::Stochastic>(a, h, ws, ctx);
      }
    }
    return with_state<Kind, T, G, MasterKind::None>(a, h, ws, ctx);
  }
}

template <class Kind, typename T>
int with_grad(const OptimArgs& a, const typename Kind::Hyper& h, void* ws, const LaunchContext& ctx) {
  if constexpr (std::is_same_v<T, float>) {
    return with_master<Kind, T, float>(a, h, ws, ctx);
  } else {
    if (a.grad_dtype == DType::Float) return with_master<Kind, T, float>(a, h, ws, ctx);
    return with_master<Kind, T, T>(a, h, ws, ctx);
  }
}

template <class Kind>
int launch_kind(const OptimArgs& a, const typename Kind::Hyper& h, void* ws, const LaunchContext& ctx) {
  if (a.num_tensors == 0) return cudaSuccess;
  switch (a.param_dtype) {
    case DType::Half: return with_grad<Kind, __half>(a, h, ws, ctx);
    case DType::BFloat16: return with_grad<Kind, __nv_bfloat16>(a, h, ws, ctx);
    default: return with_grad<Kind, float>(a, h, ws, ctx);
  }
}

int sgd_step(const OptimArgs& a, const SgdHyper& hyper, void* workspace, const LaunchContext& ctx) {
  return launch_kind<SgdKind>(a, hyper, workspace, ctx);
}

int adam_step(const OptimArgs& a, const AdamHyper& hyper, void* workspace,
              const LaunchContext& ctx) {
  if (hyper.amsgrad) return launch_kind<AdamKind<true>>(a, hyper, workspace, ctx);
  return launch_kind<AdamKind<false>>(a, hyper, workspace, ctx);
}

}  // namespace

void fill_optim_kernels(KernelTable& table) {
  table.optim_workspace = &optim_workspace;
  table.sgd_step = &sgd_step;
  table.adam_step = &adam_step;
}

}  // namespace ampfuse::cuda
