// CPU kernels for the loss-scaling ops (compiled once per CPU capability; see kernels.h).
#include "cpu/kernels/vec_utils.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace ampfuse::cpu {
namespace CPU_CAPABILITY {
namespace {

using kernels::AccumulateArgs;
using kernels::ClipCoefArgs;
using kernels::DType;
using kernels::KernelTable;
using kernels::LaunchContext;
using kernels::TensorRef;
using kernels::UnscaleCheckArgs;
using kernels::UpdateScaleArgs;

// Result of one chunk of unscale_check: whether a non-finite value was seen, and the chunk's
// partial norm (sum of squares, or max |x|) of the unscaled values.
struct ChunkResult {
  bool nonfinite;
  double partial;
};

// Unscales elements [0, n) of `data` (a reduced type or fp32): math in fp32, matching torch's CPU
// kernel bit for bit. The last elements that do not fill a vector go through the same code with
// partial loads and stores: the lanes past n are zero, finite, and add nothing to the norm.
// ahead(i): requests the memory kAheadElements past element i (see vec_utils.h).
template <typename T, NormKind norm, bool scale, bool store, typename Ahead>
ChunkResult unscale_span(T* data, int64_t n, float inv, const Ahead& ahead) {
  using L = FloatLanes<T>;
  const FVec vinv(inv);
  FVec bad(0.0f);
  FVec acc0(0.0f), acc1(0.0f);
  auto lanes = [&](FVec (&v)[L::kVecs]) __attribute__((always_inline)) {
    for (int k = 0; k < L::kVecs; ++k) bad = bad | nonfinite_bits(v[k]);
    if constexpr (scale) {
      for (int k = 0; k < L::kVecs; ++k) v[k] = v[k] * vinv;
    }
    if constexpr (norm == NormKind::L2) {
      acc0 = at::vec::fmadd(v[0], v[0], acc0);
      if constexpr (L::kVecs == 2) acc1 = at::vec::fmadd(v[1], v[1], acc1);
    } else if constexpr (norm == NormKind::Inf) {
      acc0 = at::vec::maximum(acc0, v[0].abs());
      if constexpr (L::kVecs == 2) acc1 = at::vec::maximum(acc1, v[1].abs());
    }
  };
  int64_t i = 0;
  for (; i + L::kLanes <= n; i += L::kLanes) {
    if ((i & (64 / static_cast<int64_t>(sizeof(T)) - 1)) == 0) ahead(i);  // once per cache line
    FVec v[L::kVecs];
    L::load(data + i, v);
    lanes(v);
    if constexpr (scale && store) L::store(data + i, v);
  }
  if (i < n) {
    FVec v[L::kVecs];
    L::load(data + i, v, n - i);
    lanes(v);
    if constexpr (scale && store) L::store(data + i, v, n - i);
  }
  ChunkResult r{any_lane_nonzero(bad), 0.0f};
  if constexpr (norm == NormKind::L2) {
    r.partial = at::vec::vec_reduce_all<float>(
        [](const FVec& a, const FVec& b) { return a + b; }, acc0 + acc1);
  } else if constexpr (norm == NormKind::Inf) {
    r.partial = at::vec::vec_reduce_all<float>(
        [](const FVec& a, const FVec& b) { return at::vec::maximum(a, b); },
        at::vec::maximum(acc0, acc1));
  }
  return r;
}

// fp64 tensors: math in double like torch (x * double(inv)); the norm accumulates in fp32.
ChunkResult unscale_span_double(double* data, int64_t n, float inv, bool store, NormKind norm) {
  using DVec = Vectorized<double>;
  const bool scale = inv != 1.0f;
  const DVec vinv(static_cast<double>(inv));
  DVec bad(0.0);
  int64_t i = 0;
  float part = 0.0f;
  for (; i + DVec::size() <= n; i += DVec::size()) {
    DVec v = DVec::loadu(data + i);
    bad = bad | nonfinite_bits(v);
    if (scale) {
      v = v * vinv;
      if (store) v.store(data + i);
    }
    if (norm != NormKind::None) {
      double buf[DVec::size()];
      v.store(buf);
      for (int k = 0; k < DVec::size(); ++k) {
        const float f = static_cast<float>(buf[k]);
        if (norm == NormKind::L2) {
          part += f * f;
        } else {
          const float a = std::abs(f);
          part = (a > part || a != a) ? a : part;
        }
      }
    }
  }
  ChunkResult r{any_lane_nonzero(bad), 0.0f};
  for (; i < n; ++i) {
    double v = data[i];
    if (!std::isfinite(v)) r.nonfinite = true;
    if (scale) {
      v = v * static_cast<double>(inv);
      if (store) data[i] = v;
    }
    const float f = static_cast<float>(v);
    if (norm == NormKind::L2) {
      part += f * f;
    } else if (norm == NormKind::Inf) {
      const float a = std::abs(f);
      part = (a > part || a != a) ? a : part;
    }
  }
  r.partial = part;
  return r;
}

// The norm in double (the list holds an fp64 tensor, whose norm may exceed the float range while
// every value is finite): the values are unscaled exactly as above (fp32 math for reduced types
// and fp32, double for fp64), only the accumulation is wider. Rare, so scalar.
template <typename T, NormKind norm>
ChunkResult unscale_span_wide(T* data, int64_t n, float inv, bool scale, bool store) {
  using Op = std::conditional_t<std::is_same_v<T, double>, double, float>;
  ChunkResult r{false, 0.0};
  for (int64_t i = 0; i < n; ++i) {
    Op v = static_cast<Op>(data[i]);
    if (!std::isfinite(v)) r.nonfinite = true;
    if (scale) {
      v = v * static_cast<Op>(inv);
      if (store) data[i] = static_cast<T>(v);
    }
    const double d = static_cast<double>(v);
    if constexpr (norm == NormKind::L2) {
      r.partial = std::fma(d, d, r.partial);
    } else if constexpr (norm == NormKind::Inf) {
      const double a = std::abs(d);
      r.partial = (a > r.partial || a != a) ? a : r.partial;
    }
  }
  return r;
}

template <NormKind norm>
ChunkResult unscale_chunk_wide(const TensorRef& s, int64_t begin, int64_t end, float inv,
                               bool scale, bool store) {
  const int64_t n = end - begin;
  switch (s.dtype) {
    case DType::Float:
      return unscale_span_wide<float, norm>(static_cast<float*>(s.data) + begin, n, inv, scale, store);
    case DType::Half:
      return unscale_span_wide<c10::Half, norm>(static_cast<c10::Half*>(s.data) + begin, n, inv, scale, store);
    case DType::BFloat16:
      return unscale_span_wide<c10::BFloat16, norm>(static_cast<c10::BFloat16*>(s.data) + begin, n, inv, scale, store);
    case DType::Double:
      return unscale_span_wide<double, norm>(static_cast<double*>(s.data) + begin, n, inv, scale, store);
  }
  return {false, 0.0};
}

template <NormKind norm, bool scale, bool store, typename Ahead>
ChunkResult unscale_chunk(const TensorRef& s, int64_t begin, int64_t end, float inv,
                          const Ahead& ahead) {
  const int64_t n = end - begin;
  switch (s.dtype) {
    case DType::Float:
      return unscale_span<float, norm, scale, store>(static_cast<float*>(s.data) + begin, n, inv,
                                                     ahead);
    case DType::Half:
      return unscale_span<c10::Half, norm, scale, store>(static_cast<c10::Half*>(s.data) + begin,
                                                         n, inv, ahead);
    case DType::BFloat16:
      return unscale_span<c10::BFloat16, norm, scale, store>(
          static_cast<c10::BFloat16*>(s.data) + begin, n, inv, ahead);
    case DType::Double:
      return unscale_span_double(static_cast<double*>(s.data) + begin, n, inv, store, norm);
  }
  return {false, 0.0};  // unreachable: dtypes are validated by the op layer
}

int64_t element_size(DType d) {
  return d == DType::Double ? 8 : d == DType::Float ? 4 : 2;
}

template <NormKind norm, bool scale, bool store>
void unscale_all(const UnscaleCheckArgs& a, float inv, const std::vector<Chunk>& chunks,
                 std::vector<ChunkResult>& results) {
  parallel_chunks(chunks, [&](int64_t c) {
    const Chunk& ch = chunks[c];
    // one cache line per vector of any dtype (inlined: see prefetch_bytes), into the chunks that
    // follow: inside a chunk the hardware prefetchers keep up, and the requests only took issue
    // slots (fp32, 10M elements in GPT-2 shapes: 0.96x torch's unscale with them, 0.98x without;
    // medians of 300 per-round ratios)
    auto ahead = [&](int64_t i) __attribute__((always_inline)) {
      if (ch.begin + i + kAheadElements < ch.end) return;
      const auto [ac, aj] = ahead_of(chunks, c, ch.begin + i);
      if (ac < 0) return;
      const TensorRef& r = a.tensors[chunks[ac].tensor];
      prefetch_bytes<64>(static_cast<const char*>(r.data) + aj * element_size(r.dtype));
    };
    results[c] = a.norm_fp64 ? unscale_chunk_wide<norm>(a.tensors[ch.tensor], ch.begin, ch.end,
                                                        inv, scale, store)
                             : unscale_chunk<norm, scale, store>(a.tensors[ch.tensor], ch.begin,
                                                                 ch.end, inv, ahead);
  });
}

template <NormKind norm>
void unscale_all(const UnscaleCheckArgs& a, float inv, const std::vector<Chunk>& chunks,
                 std::vector<ChunkResult>& results) {
  if (inv == 1.0f) {
    unscale_all<norm, false, false>(a, inv, chunks, results);  // x * 1 == x: nothing to store
  } else if (a.write_back) {
    unscale_all<norm, true, true>(a, inv, chunks, results);
  } else {
    unscale_all<norm, true, false>(a, inv, chunks, results);
  }
}

int unscale_check(const UnscaleCheckArgs& a, void* /*workspace*/, const LaunchContext&) {
  const float inv = a.inv_scale ? *a.inv_scale : static_cast<float>(1.0 / static_cast<double>(*a.scale));
  const auto chunks = make_chunks(a.num_tensors, [&](int64_t t) { return a.tensors[t].numel; });
  std::vector<ChunkResult> results(chunks.size());
  switch (a.norm) {
    case NormKind::None: unscale_all<NormKind::None>(a, inv, chunks, results); break;
    case NormKind::L2: unscale_all<NormKind::L2>(a, inv, chunks, results); break;
    case NormKind::Inf: unscale_all<NormKind::Inf>(a, inv, chunks, results); break;
  }
  // Reduce in chunk order: the result does not depend on the number of threads.
  double sum = 0.0;
  double mx = 0.0;
  bool any_bad = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const ChunkResult& r = results[c];
    if (r.nonfinite) {
      any_bad = true;
      if (a.per_tensor_found_inf) a.per_tensor_found_inf[chunks[c].tensor] = 1.0f;
    }
    sum += r.partial;
    mx = (r.partial > mx || r.partial != r.partial) ? r.partial : mx;
  }
  if (a.overwrite_found_inf) {
    *a.found_inf = any_bad ? 1.0f : 0.0f;
  } else if (any_bad) {
    *a.found_inf = 1.0f;
  }
  if (a.norm == NormKind::None) return 0;
  if (a.norm_fp64) {
    const double norm = a.norm == NormKind::L2 ? std::sqrt(sum) : mx;
    *static_cast<double*>(a.total_norm) = norm;
    *a.clip_coef = a.has_max_norm ? static_cast<float>(clip_coefficient(norm, a.max_norm)) : 1.0f;
  } else {
    const float norm = a.norm == NormKind::L2 ? static_cast<float>(std::sqrt(sum))
                                              : static_cast<float>(mx);
    *static_cast<float*>(a.total_norm) = norm;
    *a.clip_coef =
        a.has_max_norm ? clip_coefficient(norm, static_cast<float>(a.max_norm)) : 1.0f;
  }
  return 0;
}

// accumulators[t][i] += float(grads[t][i]); grads[t][i] = 0; one pass, fp32 math. Flags a sum that
// is not finite (an inf/NaN grad, or finite grads whose fp32 sum overflowed).
template <typename G>
bool accumulate_span(float* acc, G* grad, int64_t n, bool zero) {
  using L = FloatLanes<G>;
  FVec bad(0.0f);
  // `count` elements from i (a whole vector, or a tensor's last elements with partial loads and
  // stores: the lanes past them are zero).
  auto lanes = [&](int64_t i, int64_t count) __attribute__((always_inline)) {
    FVec g[L::kVecs];
    const bool whole = count == L::kLanes;
    if (whole) {
      L::load(grad + i, g);
    } else {
      L::load(grad + i, g, count);
    }
    for (int k = 0; k < L::kVecs; ++k) {
      const int64_t at = i + k * FVec::size();
      const int64_t m = std::clamp<int64_t>(count - k * FVec::size(), 0, FVec::size());
      const FVec sum = (whole ? FVec::loadu(acc + at) : FVec::loadu(acc + at, m)) + g[k];
      bad = bad | nonfinite_bits(sum);
      if (whole) {
        sum.store(acc + at);
      } else {
        sum.store(acc + at, m);
      }
    }
    if (zero) {
      FVec z[L::kVecs];
      for (int k = 0; k < L::kVecs; ++k) z[k] = FVec(0.0f);
      if (whole) {
        L::store(grad + i, z);
      } else {
        L::store(grad + i, z, count);
      }
    }
  };
  int64_t i = 0;
  for (; i + L::kLanes <= n; i += L::kLanes) lanes(i, L::kLanes);
  if (i < n) lanes(i, n - i);
  return any_lane_nonzero(bad);
}

int accumulate(const AccumulateArgs& a, const LaunchContext&) {
  const auto chunks = make_chunks(a.num_tensors, [&](int64_t t) { return a.grads[t].numel; });
  std::vector<uint8_t> bad(chunks.size(), 0);
  parallel_chunks(chunks, [&](int64_t c) {
    const Chunk& ch = chunks[c];
    float* acc = a.accumulators[ch.tensor] + ch.begin;
    void* g = a.grads[ch.tensor].data;
    const int64_t n = ch.end - ch.begin;
    switch (a.grads[ch.tensor].dtype) {
      case DType::Half: bad[c] = accumulate_span(acc, static_cast<c10::Half*>(g) + ch.begin, n, a.zero_grads); break;
      case DType::BFloat16: bad[c] = accumulate_span(acc, static_cast<c10::BFloat16*>(g) + ch.begin, n, a.zero_grads); break;
      default: bad[c] = accumulate_span(acc, static_cast<float*>(g) + ch.begin, n, a.zero_grads); break;
    }
  });
  for (uint8_t b : bad) {
    if (b) *a.found_inf = 1.0f;
  }
  return 0;
}

int update_scale(const UpdateScaleArgs& a, const LaunchContext&) {
  update_scale_rule(a.scale, a.growth_tracker, *a.found_inf, a.hysteresis_left, a.stats, a.params);
  return 0;
}

int clip_coef(const ClipCoefArgs& a, const LaunchContext&) {
  *a.clip_coef = clip_coefficient_of(a.total_norm, a.norm_fp64, a.max_norm, a.max_norm_tensor);
  return 0;
}

size_t no_workspace_unscale(const UnscaleCheckArgs&, const LaunchContext&) { return 0; }

const char* error_string(int status) {
  return status == 0 ? "no error" : "CPU kernel error";
}

}  // namespace

int parallel_threads_used() {
  std::vector<Chunk> chunks(256, Chunk{0, 0, 0});
  std::vector<int> thread_of(chunks.size(), -1);
  parallel_chunks(chunks, [&](int64_t c) {
    volatile double x = 0;  // a little work per chunk so that every thread gets some
    for (int i = 0; i < 20000; ++i) x = x + i;
    thread_of[c] = at::get_thread_num();
  });
  std::sort(thread_of.begin(), thread_of.end());
  return static_cast<int>(std::unique(thread_of.begin(), thread_of.end()) - thread_of.begin());
}

void fill_optim_kernels(KernelTable& table);  // optim_kernels.cpp
void fill_quant_kernels(KernelTable& table);  // quant_kernels.cpp

const KernelTable& kernel_table() {
  static const KernelTable table = [] {
    KernelTable t{};
    t.name = C10_STRINGIZE(CPU_CAPABILITY);
    t.unscale_check_workspace = &no_workspace_unscale;
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

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
