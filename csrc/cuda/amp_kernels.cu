// CUDA kernels for the loss-scaling ops: unscale + inf/NaN check (+ norm, + clip coefficient) in
// one multi-tensor pass, and the one-thread scale update. Contracts: csrc/ops/registration.cpp.
#include <type_traits>

#include "cuda/kernels.cuh"
#include "cuda/multi_tensor_apply.cuh"

namespace ampfuse::cuda {
namespace {

using kernels::AccumulateArgs;
using kernels::ClipCoefArgs;
using kernels::UnscaleCheckArgs;
using kernels::UpdateScaleArgs;

constexpr int kILP = 4;  // independent 16-byte loads in flight per thread

// Math type: fp32 for reduced types and fp32, fp64 for fp64 (as torch's unscale kernel).
template <typename T>
using opmath_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ __forceinline__ opmath_t<T> load_op(T x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return to_float(x);
  }
}

template <typename T>
__device__ __forceinline__ T store_op(opmath_t<T> x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return from_float<T>(x);
  }
}

// Norm accumulation in Acc: float, or double when the list holds an fp64 tensor (an fp64 norm
// may exceed the float range while every value is finite).
template <NormKind kNorm, typename Acc>
__device__ __forceinline__ void accumulate(Acc& acc, Acc v) {
  if constexpr (kNorm == NormKind::L2) {
    acc = fma(v, v, acc);
  } else if constexpr (kNorm == NormKind::Inf) {
    const Acc a = fabs(v);
    acc = (a > acc || a != a) ? a : acc;
  }
}

// One element: check, unscale, accumulate; returns the value to store.
template <typename T, NormKind kNorm, typename Acc>
__device__ __forceinline__ T unscale_one(T x, opmath_t<T> inv, bool scale, bool& bad, Acc& acc) {
  opmath_t<T> v = load_op(x);
  bad |= !isfinite(v);
  if (scale) v = v * inv;
  accumulate<kNorm>(acc, static_cast<Acc>(v));
  return scale ? store_op<T>(v) : x;
}

// Elements [begin, end) of one tensor, processed by the whole block.
template <typename T, NormKind kNorm, typename Acc>
__device__ void unscale_chunk(T* p, int64_t begin, int64_t end, float inv_f, bool store,
                              bool& bad, Acc& acc) {
  using V = Vec16<T>;
  const opmath_t<T> inv = static_cast<opmath_t<T>>(inv_f);
  const bool scale = inv_f != 1.0f;
  const bool write = store && scale;  // x * 1 == x: nothing to write
  if (is_aligned16(p)) {
    // begin is a multiple of kChunkSize, hence of V::kSize; a chunk has < 2^31 vectors.
    V* vp = reinterpret_cast<V*>(p + begin);
    const int nvec = static_cast<int>((end - begin) / V::kSize);
    const int stride = static_cast<int>(blockDim.x);
    int i = threadIdx.x;
    for (; i + (kILP - 1) * stride < nvec; i += kILP * stride) {
      V r[kILP];
#pragma unroll
      for (int u = 0; u < kILP; ++u) r[u] = vp[i + u * stride];
#pragma unroll
      for (int u = 0; u < kILP; ++u) {
#pragma unroll
        for (int k = 0; k < V::kSize; ++k) r[u].v[k] = unscale_one<T, kNorm, Acc>(r[u].v[k], inv, scale, bad, acc);
      }
      if (write) {
#pragma unroll
        for (int u = 0; u < kILP; ++u) vp[i + u * stride] = r[u];
      }
    }
    for (; i < nvec; i += stride) {
      V r = vp[i];
#pragma unroll
      for (int k = 0; k < V::kSize; ++k) r.v[k] = unscale_one<T, kNorm, Acc>(r.v[k], inv, scale, bad, acc);
      if (write) vp[i] = r;
    }
    begin += nvec * V::kSize;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const T y = unscale_one<T, kNorm, Acc>(p[i], inv, scale, bad, acc);
    if (write) p[i] = y;
  }
}

// What one unscale/check pass reads and writes besides the tensors (by value).
template <typename Acc>
struct CheckParams {
  const float* inv_scale;  // or null, and then:
  const float* scale;      // inv = float(1 / double(scale)), torch's GradScaler rule
  float* found_inf;
  bool overwrite_found_inf;  // found_inf := 0 or 1 (the last block writes it); else only set
  float* per_tensor_found_inf;
  bool store;
  Acc* partials;             // one per block of the pass
  unsigned int* counter;     // blocks arrived; the last resets it
  unsigned int* bad;         // a block saw a non-finite value (overwrite_found_inf); reset likewise
  Acc* total_norm;
  float* clip_coef;
  bool has_max_norm;
  double max_norm;
};

// The pass over every chunk of a launch (`meta` a TableMeta view) and, with a norm, the last
// block's reduction. Not inlined: shared by the two kernels below.
template <NormKind kNorm, typename Acc>
__device__ AMPFUSE_PASS_BODY void unscale_check_pass(const TableMeta<1>& meta, const CheckParams<Acc>& a) {
  const float inv = a.inv_scale ? *a.inv_scale : static_cast<float>(1.0 / static_cast<double>(*a.scale));
  Acc acc = 0;
  bool any_bad = false;
  const int32_t nchunks = meta.chunk_start[meta.count];
  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int t = find_tensor(meta, c);
    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.numel[t]);
    bool bad = false;
    void* p = meta.ptr[0][t];
    switch (static_cast<DType>(meta.dtype[t])) {
      case DType::Half:
        unscale_chunk<__half, kNorm>(static_cast<__half*>(p), begin, end, inv, a.store, bad, acc);
        break;
      case DType::BFloat16:
        unscale_chunk<__nv_bfloat16, kNorm>(static_cast<__nv_bfloat16*>(p), begin, end, inv,
                                            a.store, bad, acc);
        break;
      case DType::Float:
        unscale_chunk<float, kNorm>(static_cast<float*>(p), begin, end, inv, a.store, bad, acc);
        break;
      default:
        unscale_chunk<double, kNorm>(static_cast<double*>(p), begin, end, inv, a.store, bad, acc);
        break;
    }
    if (bad) {  // benign race: every writer stores 1
      if (!a.overwrite_found_inf) *a.found_inf = 1.0f;
      if (a.per_tensor_found_inf) a.per_tensor_found_inf[meta.index[t]] = 1.0f;
      any_bad = true;
    }
  }

  // With a norm, or to overwrite found_inf, the blocks of the pass meet: the last to arrive
  // reduces the partial norms and writes the results. (Both conditions are uniform over the grid.)
  if (kNorm != NormKind::None || a.overwrite_found_inf) {
    constexpr bool kMax = kNorm == NormKind::Inf;
    AMPFUSE_SHARED(Acc, shared, [kBlockSize / 32]);
    AMPFUSE_SHARED(bool, is_last);
    const bool block_bad = a.overwrite_found_inf && __syncthreads_or(any_bad);
    Acc block_total = 0;
    if constexpr (kNorm != NormKind::None) block_total = block_reduce<kMax>(acc, shared);
    if (threadIdx.x == 0) {
      // Published for the last block (__stcg: through L2), then released by the fence.
      if constexpr (kNorm != NormKind::None) {
        __stcg(a.partials + meta.block_offset + blockIdx.x, block_total);
      }
      if (block_bad) __stcg(a.bad, 1u);
      __threadfence();
      const unsigned int ticket = atomicAdd(a.counter, 1u);
      is_last = ticket == static_cast<unsigned int>(meta.total_blocks - 1);
    }
    __syncthreads();
    if (is_last) {
      // Every block of every launch of this pass has published its partial: reduce them in a
      // fixed order (deterministic for a given grid), bypassing L1.
      __threadfence();
      Acc total = 0;
      if constexpr (kNorm != NormKind::None) {
        Acc v = 0;
        for (int i = threadIdx.x; i < meta.total_blocks; i += blockDim.x) {
          const Acc o = __ldcg(a.partials + i);
          v = kMax ? ((o > v || o != o) ? o : v) : v + o;
        }
        total = block_reduce<kMax>(v, shared);
      }
      if (threadIdx.x == 0) {
        if constexpr (kNorm != NormKind::None) {
          const Acc norm = kMax ? total : sqrt(total);
          *a.total_norm = norm;
          *a.clip_coef = a.has_max_norm ? static_cast<float>(clip_coefficient<Acc>(
                                              norm, static_cast<Acc>(a.max_norm)))
                                        : 1.0f;
        }
        if (a.overwrite_found_inf) {
          *a.found_inf = __ldcg(a.bad) != 0u ? 1.0f : 0.0f;
          *a.bad = 0u;
        }
        *a.counter = 0u;
      }
    }
  }
}

// Resident blocks per multiprocessor the check kernels are compiled for and grids are sized by: an
// L2 norm accumulated in fp64 (an fp64 tensor in the list, a rare case) needs more than the 64
// registers of 4 blocks and the 80 of 3 (ptxas spilled 54-82 bytes at 64, up to 70 at 80): 2
// blocks, 128 registers. The workspace is sized for 4.
template <typename Acc>
constexpr int kCheckBlocksPerSM = sizeof(Acc) == sizeof(double) ? 2 : kBlocksPerSM;

template <NormKind kNorm, typename Acc>
__global__ void __launch_bounds__(kBlockSize, kCheckBlocksPerSM<Acc>)
    unscale_check_kernel(const __grid_constant__ TensorListMeta<1> meta, CheckParams<Acc> a) {
  unscale_check_pass<kNorm, Acc>(view_of(meta), a);
}

template <NormKind kNorm, typename Acc>
__global__ void __launch_bounds__(kBlockSize, kCheckBlocksPerSM<Acc>)
    unscale_check_table_kernel(const __grid_constant__ TableMeta<1> meta, CheckParams<Acc> a) {
  unscale_check_pass<kNorm, Acc>(meta, a);
}

// accumulator += float(grad); grad = 0 (when zero); flags sums that are not finite (an inf/NaN
// grad, or finite grads whose fp32 sum overflowed). 16-byte accesses on the grad side (4 or 8
// elements) when both sides are aligned.
template <typename G>
__device__ void accumulate_chunk(float* acc, G* grad, int64_t begin, int64_t end, bool zero,
                                 bool& bad) {
  using V = Vec16<G>;
  constexpr int K = V::kSize;
  struct alignas(16) F4 {
    float v[4];
  };
  if (is_aligned16(grad) && is_aligned16(acc)) {
    const int nvec = static_cast<int>((end - begin) / K);
    V* gv = reinterpret_cast<V*>(grad + begin);
    F4* av = reinterpret_cast<F4*>(acc + begin);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      V g = gv[i];
      F4 a[K / 4];
#pragma unroll
      for (int k = 0; k < K / 4; ++k) a[k] = av[i * (K / 4) + k];
#pragma unroll
      for (int e = 0; e < K; ++e) {
        const float sum = a[e / 4].v[e % 4] + to_float(g.v[e]);
        bad |= !isfinite(sum);
        a[e / 4].v[e % 4] = sum;
      }
#pragma unroll
      for (int k = 0; k < K / 4; ++k) av[i * (K / 4) + k] = a[k];
      if (zero) {
#pragma unroll
        for (int e = 0; e < K; ++e) g.v[e] = from_float<G>(0.0f);
        gv[i] = g;
      }
    }
    begin += static_cast<int64_t>(nvec) * K;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float sum = acc[i] + to_float(grad[i]);
    bad |= !isfinite(sum);
    acc[i] = sum;
    if (zero) grad[i] = from_float<G>(0.0f);
  }
}

template <typename Meta>
__global__ void __launch_bounds__(kBlockSize, kBlocksPerSM)
    accumulate_kernel(const __grid_constant__ Meta meta, bool zero, float* found_inf) {
  const int32_t nchunks = meta.chunk_start[meta.count];
  bool bad = false;
  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int t = find_tensor(meta, c);
    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.numel[t]);
    float* acc = static_cast<float*>(meta.ptr[0][t]);
    void* g = meta.ptr[1][t];
    switch (static_cast<DType>(meta.dtype[t])) {
      case DType::Half: accumulate_chunk(acc, static_cast<__half*>(g), begin, end, zero, bad); break;
      case DType::BFloat16:
        accumulate_chunk(acc, static_cast<__nv_bfloat16*>(g), begin, end, zero, bad);
        break;
      default: accumulate_chunk(acc, static_cast<float*>(g), begin, end, zero, bad); break;
    }
  }
  if (bad) *found_inf = 1.0f;  // benign race: every writer stores 1
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, const float* found_inf,
                                    int32_t* hysteresis_left, int64_t* stats,
                                    ScaleRuleParams params) {
  update_scale_rule(scale, growth_tracker, *found_inf, hysteresis_left, stats, params);
}

__global__ void clip_coef_kernel(ClipCoefArgs a) {
  *a.clip_coef = clip_coefficient_of(a.total_norm, a.norm_fp64, a.max_norm, a.max_norm_tensor);
}

constexpr size_t kCounterBytes = 16;  // the arrival counter and the bad-block flag

// Workspace: the counters (zeroed on the stream here when fresh; the last block leaves them zero)
// and one partial norm per block of every launch of the pass.
size_t unscale_check_workspace(const UnscaleCheckArgs& a, const LaunchContext& ctx) {
  if (a.norm == NormKind::None) return a.overwrite_found_inf ? kCounterBytes : 0;
  const int64_t max_grid = static_cast<int64_t>(ctx.num_sms) * kBlocksPerSM;
  const size_t acc = a.norm_fp64 ? sizeof(double) : sizeof(float);
  return kCounterBytes + acc * static_cast<size_t>(pass_launches<1>(a.num_tensors) * max_grid);
}

template <typename Acc>
int launch_unscale_check(const UnscaleCheckArgs& a, const std::vector<HostTensor<1>>& tensors,
                         void* workspace, const LaunchContext& ctx) {
  const cudaStream_t stream = stream_of(ctx);
  CheckParams<Acc> p{};
  p.inv_scale = a.inv_scale;
  p.scale = a.scale;
  p.found_inf = a.found_inf;
  p.overwrite_found_inf = a.overwrite_found_inf;
  p.per_tensor_found_inf = a.per_tensor_found_inf;
  p.store = a.write_back;
  if (workspace != nullptr) {
    p.counter = static_cast<unsigned int*>(workspace);
    p.bad = p.counter + 1;
    p.partials = reinterpret_cast<Acc*>(static_cast<char*>(workspace) + kCounterBytes);
  }
  p.total_norm = static_cast<Acc*>(a.total_norm);
  p.clip_coef = a.clip_coef;
  p.has_max_norm = a.has_max_norm;
  p.max_norm = a.max_norm;
  constexpr int kPerSM = kCheckBlocksPerSM<Acc>;
  return multi_tensor_apply<1>(tensors, ctx.num_sms * kPerSM, ctx, [&](const auto& meta, int grid) {
    constexpr bool kInline = std::is_same_v<std::decay_t<decltype(meta)>, TensorListMeta<1>>;
    auto go = [&](auto norm_tag) {
      constexpr NormKind kNorm = decltype(norm_tag)::value;
      if constexpr (kInline) {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, unscale_check_kernel<kNorm, Acc>)(meta, p);
      } else {
        AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, unscale_check_table_kernel<kNorm, Acc>)(meta, p);
      }
    };
    switch (a.norm) {
      case NormKind::None: go(std::integral_constant<NormKind, NormKind::None>{}); break;
      case NormKind::L2: go(std::integral_constant<NormKind, NormKind::L2>{}); break;
      case NormKind::Inf: go(std::integral_constant<NormKind, NormKind::Inf>{}); break;
    }
  });
}

int unscale_check(const UnscaleCheckArgs& a, void* workspace, const LaunchContext& ctx) {
  std::vector<HostTensor<1>> tensors(a.num_tensors);
  for (int64_t i = 0; i < a.num_tensors; ++i) {
    tensors[i] = {{a.tensors[i].data}, a.tensors[i].numel, static_cast<int32_t>(i),
                  static_cast<uint8_t>(a.tensors[i].dtype)};
  }
  if ((a.norm != NormKind::None || a.overwrite_found_inf) && !ctx.workspace_zeroed) {
    const cudaError_t err = cudaMemsetAsync(workspace, 0, kCounterBytes, stream_of(ctx));
    if (err != cudaSuccess) return err;
  }
  // Without a norm only the double instantiation would differ in nothing: use float.
  return a.norm_fp64 && a.norm != NormKind::None
             ? launch_unscale_check<double>(a, tensors, workspace, ctx)
             : launch_unscale_check<float>(a, tensors, workspace, ctx);
}

int accumulate(const AccumulateArgs& a, const LaunchContext& ctx) {
  if (a.num_tensors == 0) return cudaSuccess;
  const cudaStream_t stream = stream_of(ctx);
  std::vector<HostTensor<2>> tensors(a.num_tensors);
  for (int64_t i = 0; i < a.num_tensors; ++i) {
    tensors[i] = {{a.accumulators[i], a.grads[i].data}, a.grads[i].numel, static_cast<int32_t>(i),
                  static_cast<uint8_t>(a.grads[i].dtype)};
  }
  return multi_tensor_apply<2>(tensors, ctx.num_sms * kBlocksPerSM, ctx,
                               [&](const auto& meta, int grid) {
                                 using Meta = std::decay_t<decltype(meta)>;
                                 AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, accumulate_kernel<Meta>)(
                                     meta, a.zero_grads, a.found_inf);
                               });
}

int update_scale(const UpdateScaleArgs& a, const LaunchContext& ctx) {
  AMPFUSE_LAUNCH(1, 1, 0, stream_of(ctx), update_scale_kernel)(
      a.scale, a.growth_tracker, a.found_inf, a.hysteresis_left, a.stats, a.params);
  return cudaGetLastError();
}

int clip_coef(const ClipCoefArgs& a, const LaunchContext& ctx) {
  AMPFUSE_LAUNCH(1, 1, 0, stream_of(ctx), clip_coef_kernel)(a);
  return cudaGetLastError();
}

const char* error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

}  // namespace

const KernelTable& kernel_table() {
  static const KernelTable table = [] {
    KernelTable t{};
#if defined(CUEMU)
    t.name = "cuda-emulated";
#else
    t.name = "cuda";
#endif
    t.unscale_check_workspace = &unscale_check_workspace;
    t.unscale_check = &unscale_check;
    t.accumulate = &accumulate;
    t.update_scale = &update_scale;
    t.clip_coef = &clip_coef;
    t.error_string = &error_string;
    fill_optim_kernels(t);
    fill_quant_kernels(t);
    return t;
  }();
  return table;
}

}  // namespace ampfuse::cuda
