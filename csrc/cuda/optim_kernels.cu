// CUDA kernels of the fused optimizers: one multi-tensor pass reads each element's grad, param or
// fp32 master and state once and writes param, master and state once. A set found_inf makes every
// block return before touching memory. The per-tensor step counter is advanced by the last block
// to finish a chunk of that tensor (all blocks have read it by then), so no second launch is
// needed. The update rules are shared with the CPU kernels (ops/rules.h).
#include <type_traits>

#include "cuda/kernels.cuh"
#include "cuda/multi_tensor_apply.cuh"

namespace ampfuse::cuda {
namespace {

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
  const float* grad_scale;
  const float* found_inf;
  const float* clip_coef;
  unsigned int* counters;  // one per tensor of the call, zero on entry, left zero
};

struct SgdKind {
  using Hyper = SgdHyper;
  using Scalars = SgdScalars;
  static constexpr int kStates = 1;
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

template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ bool aligned_quad(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T))) == 0;
}

// The value the update starts from for a param with an fp32 master (ops/rules.h).
template <typename T>
__device__ __forceinline__ float start_value(float master, T param) {
  return synced_master(master, to_float(from_float<T>(master)), to_float(param));
}

template <typename T, typename G, class Kind>
__device__ __forceinline__ void process_chunk(T* param, const G* grad, float* master,
                                              float* (&state)[Kind::kStates], int64_t begin,
                                              int64_t end, const typename Kind::Scalars& s,
                                              bool divide, float grad_scale, float clip) {
  constexpr int NS = Kind::kStates;
  bool vec = aligned_quad<T>(param) && aligned_quad<G>(grad) &&
             (master == nullptr || aligned_quad<float>(master));
#pragma unroll
  for (int k = 0; k < NS; ++k) vec = vec && (state[k] == nullptr || aligned_quad<float>(state[k]));
  int64_t i0 = begin;
  if (vec) {
    const int64_t nq = (end - begin) / 4;
    for (int64_t q = threadIdx.x; q < nq; q += blockDim.x) {
      const int64_t i = begin + 4 * q;
      float p[4], st[NS][4] = {};  // absent states stay 0 (never stored)
      const Quad<T> pq = *reinterpret_cast<const Quad<T>*>(param + i);
      if (master) {
        const Quad<float> mq = *reinterpret_cast<const Quad<float>*>(master + i);
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = start_value<T>(mq.v[e], pq.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = to_float(pq.v[e]);
      }
      const Quad<G> gq = *reinterpret_cast<const Quad<G>*>(grad + i);
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (state[k] != nullptr && Kind::uses_state(s, k)) {
          const Quad<float> sq = *reinterpret_cast<const Quad<float>*>(state[k] + i);
#pragma unroll
          for (int e = 0; e < 4; ++e) st[k][e] = sq.v[e];
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
      for (int e = 0; e < 4; ++e) out.v[e] = from_float<T>(p[e]);
      *reinterpret_cast<Quad<T>*>(param + i) = out;
      if (master) {
        Quad<float> mq;
#pragma unroll
        for (int e = 0; e < 4; ++e) mq.v[e] = p[e];
        *reinterpret_cast<Quad<float>*>(master + i) = mq;
      }
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (state[k] != nullptr && Kind::uses_state(s, k)) {
          Quad<float> sq;
#pragma unroll
          for (int e = 0; e < 4; ++e) sq.v[e] = st[k][e];
          *reinterpret_cast<Quad<float>*>(state[k] + i) = sq;
        }
      }
    }
    i0 = begin + 4 * nq;
  }
  for (int64_t i = i0 + threadIdx.x; i < end; i += blockDim.x) {
    float p = master ? start_value<T>(master[i], param[i]) : to_float(param[i]);
    float g = to_float(grad[i]);
    if (divide) g = g / grad_scale;
    if (clip != 1.0f) g = g * clip;
    float se[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) se[k] = (state[k] != nullptr && Kind::uses_state(s, k)) ? state[k][i] : 0.0f;
    p = Kind::update(p, g, se, s);
    param[i] = from_float<T>(p);
    if (master) master[i] = p;
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      if (state[k] != nullptr && Kind::uses_state(s, k)) state[k][i] = se[k];
    }
  }
}

template <typename T, typename G, class Kind>
__global__ void __launch_bounds__(kBlockSize, kBlocksPerSM)
    optim_kernel(const __grid_constant__ TensorListMeta<kLists<Kind>> meta, ScaleArgs sa,
                 typename Kind::Hyper hyper) {
  constexpr int NS = Kind::kStates;
  constexpr int kStep = kLists<Kind> - 1;
  if (sa.found_inf != nullptr && *sa.found_inf != 0.0f) return;  // skipped: touch nothing
  const double lr = sa.lr_tensor ? static_cast<double>(*sa.lr_tensor) : hyper.lr;
  const float grad_scale = sa.grad_scale ? *sa.grad_scale : 1.0f;
  const bool divide = sa.grad_scale != nullptr && grad_scale != 1.0f;
  const float clip = sa.clip_coef ? *sa.clip_coef : 1.0f;
  const int32_t nchunks = meta.chunk_start[meta.count];
  for (int32_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const int t = find_tensor(meta, c);
    const int64_t begin = static_cast<int64_t>(c - meta.chunk_start[t]) * kChunkSize;
    const int64_t end = min(begin + kChunkSize, meta.numel[t]);
    float* step = static_cast<float*>(meta.ptr[kStep][t]);
    const typename Kind::Scalars s = Kind::scalars(hyper, lr, *step);
    float* state[NS];
#pragma unroll
    for (int k = 0; k < NS; ++k) state[k] = static_cast<float*>(meta.ptr[3 + k][t]);
    process_chunk<T, G, Kind>(static_cast<T*>(meta.ptr[0][t]), static_cast<const G*>(meta.ptr[1][t]),
                              static_cast<float*>(meta.ptr[2][t]), state, begin, end, s, divide,
                              grad_scale, clip);
    // The last block to finish a chunk of tensor t advances its step (every block of t has read
    // the old value before arriving here).
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
}

// Workspace: one arrival counter per tensor of the call (zeroed on the stream here; the last block
// of each tensor leaves its counter zero).
size_t optim_workspace(const OptimArgs& a, const LaunchContext&) {
  return sizeof(unsigned int) * static_cast<size_t>(a.num_tensors > 0 ? a.num_tensors : 1);
}

template <class Kind>
int launch_optim(const OptimArgs& a, const typename Kind::Hyper& hyper, void* workspace,
                 const LaunchContext& ctx) {
  constexpr int N = kLists<Kind>;
  constexpr int NS = Kind::kStates;
  if (a.num_tensors == 0) return cudaSuccess;
  const cudaStream_t stream = stream_of(ctx);
  std::vector<HostTensor<N>> tensors;
  tensors.reserve(a.num_tensors);
  for (int64_t i = 0; i < a.num_tensors; ++i) {
    const OptimTensor& o = a.tensors[i];
    HostTensor<N> h{};
    h.ptr[0] = o.param;
    h.ptr[1] = const_cast<void*>(o.grad);
    h.ptr[2] = o.master;
    for (int k = 0; k < NS; ++k) h.ptr[3 + k] = o.state[k];
    h.ptr[N - 1] = o.step;
    h.numel = o.numel;
    h.index = static_cast<int32_t>(i);
    h.dtype = 0;
    tensors.push_back(h);
  }
  cudaError_t err = cudaMemsetAsync(workspace, 0, optim_workspace(a, ctx), stream);
  if (err != cudaSuccess) return err;
  ScaleArgs sa{a.lr_tensor, a.grad_scale, a.found_inf, a.clip_coef,
               static_cast<unsigned int*>(workspace)};
  const int max_grid = ctx.num_sms * kBlocksPerSM;
  auto launch = [&](auto param_tag, auto grad_tag) {
    using T = decltype(param_tag);
    using G = decltype(grad_tag);
    return multi_tensor_apply<N>(tensors, max_grid, [&](const TensorListMeta<N>& meta, int grid) {
      AMPFUSE_LAUNCH(grid, kBlockSize, 0, stream, optim_kernel<T, G, Kind>)(meta, sa, hyper);
    });
  };
  auto with_grad = [&](auto param_tag) {
    switch (a.grad_dtype) {
      case DType::Half: return launch(param_tag, __half{});
      case DType::BFloat16: return launch(param_tag, __nv_bfloat16{});
      default: return launch(param_tag, float{});
    }
  };
  switch (a.param_dtype) {
    case DType::Half: return with_grad(__half{});
    case DType::BFloat16: return with_grad(__nv_bfloat16{});
    default: return with_grad(float{});
  }
}

int sgd_step(const OptimArgs& a, const SgdHyper& hyper, void* workspace, const LaunchContext& ctx) {
  return launch_optim<SgdKind>(a, hyper, workspace, ctx);
}

int adam_step(const OptimArgs& a, const AdamHyper& hyper, void* workspace,
              const LaunchContext& ctx) {
  if (hyper.amsgrad) return launch_optim<AdamKind<true>>(a, hyper, workspace, ctx);
  return launch_optim<AdamKind<false>>(a, hyper, workspace, ctx);
}

}  // namespace

void fill_optim_kernels(KernelTable& table) {
  table.optim_workspace = &optim_workspace;
  table.sgd_step = &sgd_step;
  table.adam_step = &adam_step;
}

}  // namespace ampfuse::cuda
