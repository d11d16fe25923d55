// CPU kernels of the fused optimizers (compiled once per CPU capability; see kernels.h).
//
// One pass per call: every element of every tensor is read once (grad, param or fp32 master,
// state) and written once (param, master, state). The math is in fp32, written once as a template
// over the lane type so that the vectorised body and the scalar tail compute exactly the same
// thing (the kernels are compiled with -ffp-contract=off: no silent FMA in either).
#include "cpu/kernels/vec_utils.h"

#include <cmath>

namespace ampfuse::cpu {
namespace CPU_CAPABILITY {
namespace {

using kernels::DType;
using kernels::KernelTable;
using kernels::LaunchContext;
using kernels::OptimArgs;

// The scalars of one call, read once from their (host) tensors.
struct CallScalars {
  double lr;
  float grad_scale;  // grads are divided by it when `divide`
  bool divide;
  float clip;        // and multiplied by it
};

// nullopt: the step is skipped (found_inf set), nothing may change.
template <typename Hyper>
bool call_scalars(const OptimArgs& a, const Hyper& h, CallScalars& out) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return false;
  out.lr = a.lr_tensor ? static_cast<double>(*a.lr_tensor) : h.lr;
  out.grad_scale = a.grad_scale ? *a.grad_scale : 1.0f;
  out.divide = out.grad_scale != 1.0f;
  out.clip = a.clip_coef ? *a.clip_coef : 1.0f;
  return true;
}

// neg/sqrt/max for the shared update rules (ops/rules.h), per lane type.
struct CpuMath {
  static float neg(float x) { return -x; }
  static FVec neg(const FVec& x) { return x.neg(); }
  static float sqrt(float x) { return std::sqrt(x); }
  static FVec sqrt(const FVec& x) { return x.sqrt(); }
  // NaN-propagating maximum, as torch.maximum.
  static float max(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
  static FVec max(const FVec& a, const FVec& b) { return at::vec::maximum(a, b); }
  // Fused where the build has FMA (as at::vec::fmadd), two roundings otherwise: the scalar tail
  // must round exactly as the vector body.
  static float fma(float a, float b, float c) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
  }
  static FVec fma(const FVec& a, const FVec& b, const FVec& c) { return at::vec::fmadd(a, b, c); }
};

// Two float vectors' worth of elements of T (half/bf16 widen to fp32).
template <typename T>
struct Pair {
  static constexpr int64_t kLanes = 2 * FVec::size();
  static void load(const T* p, FVec& a, FVec& b) {
    if constexpr (std::is_same_v<T, float>) {
      a = FVec::loadu(p);
      b = FVec::loadu(p + FVec::size());
    } else {
      static_assert(Vectorized<T>::size() == 2 * FVec::size());
      std::tie(a, b) = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
    }
  }
  static void store(T* p, const FVec& a, const FVec& b) {
    if constexpr (std::is_same_v<T, float>) {
      a.store(p);
      b.store(p + FVec::size());
    } else {
      at::vec::convert_from_float<T>(a, b).store(p);
    }
  }
};

// Gradient as the optimizer sees it: unscaled (divided by the scale, as torch's fused optimizers
// do) and clipped.
template <typename V>
inline V prepare_grad(V g, float grad_scale, bool divide, float clip) {
  if (divide) g = g / V(grad_scale);
  if (clip != 1.0f) g = g * V(clip);
  return g;
}

// synced_master (ops/rules.h) on two float vectors: the masters, where the params still hold them
// rounded to T; the params where they were edited. NaN lanes compare unequal and take the param.
template <typename T>
inline void synced_master_vec(const float* master, FVec& p0, FVec& p1) {
  FVec m0, m1;
  Pair<float>::load(master, m0, m1);
  FVec r0 = m0, r1 = m1;
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(r0, r1) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(m0, m1));
  }
  p0 = FVec::blendv(m0, p0, r0 != p0);
  p1 = FVec::blendv(m1, p1, r1 != p1);
}

// ---- the pass --------------------------------------------------------------------------------

// Runs update(p, g, k, i) over one chunk of one tensor: p is the fp32 param (master or widened
// param), g the prepared grad; `state(k)` gives the tensor's state pointers. Stores the param
// (rounded to its dtype) and master.
template <typename T, typename G, typename Fn>
void optim_chunk(const OptimArgs& a, const CallScalars& cs, int64_t t, int64_t begin, int64_t end,
                 const Fn& fn) {
  T* param = static_cast<T*>(a.tensors[t].param);
  const G* grad = static_cast<const G*>(a.tensors[t].grad);
  float* master = a.tensors[t].master;
  int64_t i = begin;
  for (; i + Pair<T>::kLanes <= end; i += Pair<T>::kLanes) {
    FVec p0, p1, g0, g1;
    Pair<T>::load(param + i, p0, p1);
    if (master) synced_master_vec<T>(master + i, p0, p1);
    Pair<G>::load(grad + i, g0, g1);
    g0 = prepare_grad(g0, cs.grad_scale, cs.divide, cs.clip);
    g1 = prepare_grad(g1, cs.grad_scale, cs.divide, cs.clip);
    p0 = fn(p0, g0, t, i);
    p1 = fn(p1, g1, t, i + FVec::size());
    if (master) Pair<float>::store(master + i, p0, p1);
    Pair<T>::store(param + i, p0, p1);
  }
  for (; i < end; ++i) {
    float p = static_cast<float>(param[i]);
    if (master) p = synced_master(master[i], static_cast<float>(static_cast<T>(master[i])), p);
    float g = prepare_grad(static_cast<float>(grad[i]), cs.grad_scale, cs.divide, cs.clip);
    p = fn(p, g, t, i);
    if (master) master[i] = p;
    param[i] = static_cast<T>(p);
  }
}

template <typename Fn>
void dispatch_chunk(const OptimArgs& a, const CallScalars& cs, int64_t t, int64_t begin,
                    int64_t end, const Fn& fn) {
  auto with_grad = [&](auto param_tag) {
    using T = decltype(param_tag);
    switch (a.grad_dtype) {
      case DType::Half: return optim_chunk<T, c10::Half>(a, cs, t, begin, end, fn);
      case DType::BFloat16: return optim_chunk<T, c10::BFloat16>(a, cs, t, begin, end, fn);
      default: return optim_chunk<T, float>(a, cs, t, begin, end, fn);
    }
  };
  switch (a.param_dtype) {
    case DType::Half: return with_grad(c10::Half{});
    case DType::BFloat16: return with_grad(c10::BFloat16{});
    default: return with_grad(float{});
  }
}

// One parallel pass over every chunk of every tensor, then each step counter advanced by one.
template <typename Fn>
void optim_pass(const OptimArgs& a, const CallScalars& cs, const Fn& fn) {
  const auto chunks = make_chunks(a.num_tensors, [&](int64_t t) { return a.tensors[t].numel; });
  parallel_chunks(chunks, [&](int64_t c) {
    dispatch_chunk(a, cs, chunks[c].tensor, chunks[c].begin, chunks[c].end, fn);
  });
  for (int64_t t = 0; t < a.num_tensors; ++t) *a.tensors[t].step += 1.0f;
}

// Lane helpers: a state element or vector at index i of tensor t.
template <typename V>
inline V load_state(const float* p, int64_t i) {
  if constexpr (std::is_same_v<V, float>) {
    return p[i];
  } else {
    return FVec::loadu(p + i);
  }
}
template <typename V>
inline void store_state(float* p, int64_t i, const V& v) {
  if constexpr (std::is_same_v<V, float>) {
    p[i] = v;
  } else {
    v.store(p + i);
  }
}

int sgd_step(const OptimArgs& a, const SgdHyper& h, void*, const LaunchContext&) {
  CallScalars cs;
  if (!call_scalars(a, h, cs)) return 0;  // skipped step
  std::vector<SgdScalars> scalars(a.num_tensors);
  for (int64_t t = 0; t < a.num_tensors; ++t) scalars[t] = sgd_scalars(h, cs.lr, *a.tensors[t].step);
  optim_pass(a, cs, [&](auto p, auto g, int64_t t, int64_t i) {
    using V = decltype(p);
    const SgdScalars& s = scalars[t];
    if (!s.has_momentum) return sgd_update<V, CpuMath>(p, g, nullptr, s);
    float* mom = a.tensors[t].state[0];
    V buf = s.first_step ? V(0.0f) : load_state<V>(mom, i);
    p = sgd_update<V, CpuMath>(p, g, &buf, s);
    store_state<V>(mom, i, buf);
    return p;
  });
  return 0;
}

int adam_step(const OptimArgs& a, const AdamHyper& h, void*, const LaunchContext&) {
  CallScalars cs;
  if (!call_scalars(a, h, cs)) return 0;  // skipped step
  std::vector<AdamScalars> scalars(a.num_tensors);
  for (int64_t t = 0; t < a.num_tensors; ++t) scalars[t] = adam_scalars(h, cs.lr, *a.tensors[t].step);
  optim_pass(a, cs, [&](auto p, auto g, int64_t t, int64_t i) {
    using V = decltype(p);
    float* const* st = a.tensors[t].state;
    V m = load_state<V>(st[0], i);
    V v = load_state<V>(st[1], i);
    V vm = h.amsgrad ? load_state<V>(st[2], i) : V(0.0f);
    p = adam_update<V, CpuMath>(p, g, m, v, vm, scalars[t]);
    store_state<V>(st[0], i, m);
    store_state<V>(st[1], i, v);
    if (h.amsgrad) store_state<V>(st[2], i, vm);
    return p;
  });
  return 0;
}

size_t no_workspace(const OptimArgs&, const LaunchContext&) { return 0; }

}  // namespace

void fill_optim_kernels(KernelTable& table) {
  table.optim_workspace = &no_workspace;
  table.sgd_step = &sgd_step;
  table.adam_step = &adam_step;
}

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
