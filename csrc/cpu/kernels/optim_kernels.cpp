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

// ---- the pass --------------------------------------------------------------------------------

// Runs update(p, g, k, i) over one chunk of one tensor: p is the fp32 param (master or widened
// param), g the prepared grad; `state(k)` gives the tensor's state pointers. Stores the param
// (rounded to its dtype) and master.
template <typename T, typename G, typename Fn>
void optim_chunk(const OptimArgs& a, int64_t t, int64_t begin, int64_t end, const Fn& fn) {
  T* param = static_cast<T*>(a.params[t]);
  const G* grad = static_cast<const G*>(a.grads[t]);
  float* master = a.masters ? a.masters[t] : nullptr;
  const bool divide = a.grad_scale != 1.0f;
  int64_t i = begin;
  for (; i + Pair<T>::kLanes <= end; i += Pair<T>::kLanes) {
    FVec p0, p1, g0, g1;
    if (master) {
      Pair<float>::load(master + i, p0, p1);
    } else {
      Pair<T>::load(param + i, p0, p1);
    }
    Pair<G>::load(grad + i, g0, g1);
    g0 = prepare_grad(g0, a.grad_scale, divide, a.clip_coef);
    g1 = prepare_grad(g1, a.grad_scale, divide, a.clip_coef);
    p0 = fn(p0, g0, t, i);
    p1 = fn(p1, g1, t, i + FVec::size());
    if (master) Pair<float>::store(master + i, p0, p1);
    Pair<T>::store(param + i, p0, p1);
  }
  for (; i < end; ++i) {
    float p = master ? master[i] : static_cast<float>(param[i]);
    float g = prepare_grad(static_cast<float>(grad[i]), a.grad_scale, divide, a.clip_coef);
    p = fn(p, g, t, i);
    if (master) master[i] = p;
    param[i] = static_cast<T>(p);
  }
}

template <typename Fn>
void dispatch_chunk(const OptimArgs& a, int64_t t, int64_t begin, int64_t end, const Fn& fn) {
  auto with_grad = [&](auto param_tag) {
    using T = decltype(param_tag);
    switch (a.grad_dtype) {
      case c10::kHalf: return optim_chunk<T, c10::Half>(a, t, begin, end, fn);
      case c10::kBFloat16: return optim_chunk<T, c10::BFloat16>(a, t, begin, end, fn);
      default: return optim_chunk<T, float>(a, t, begin, end, fn);
    }
  };
  switch (a.param_dtype) {
    case c10::kHalf: return with_grad(c10::Half{});
    case c10::kBFloat16: return with_grad(c10::BFloat16{});
    default: return with_grad(float{});
  }
}

template <typename Fn>
void optim_pass(const OptimArgs& a, const Fn& fn) {
  const auto chunks = make_chunks(a.num_tensors, [&](int64_t t) { return a.numels[t]; });
  parallel_chunks(chunks, [&](int64_t c) {
    dispatch_chunk(a, chunks[c].tensor, chunks[c].begin, chunks[c].end, fn);
  });
  for (int64_t t = 0; t < a.num_tensors; ++t) *a.steps[t] += 1.0f;
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

void sgd_step(const OptimArgs& a, const SgdHyper& h) {
  std::vector<SgdScalars> scalars(a.num_tensors);
  for (int64_t t = 0; t < a.num_tensors; ++t) scalars[t] = sgd_scalars(h, a.lr, *a.steps[t]);
  optim_pass(a, [&](auto p, auto g, int64_t t, int64_t i) {
    using V = decltype(p);
    const SgdScalars& s = scalars[t];
    if (!s.has_momentum) return sgd_update<V, CpuMath>(p, g, nullptr, s);
    V buf = s.first_step ? V(0.0f) : load_state<V>(a.state0[t], i);
    p = sgd_update<V, CpuMath>(p, g, &buf, s);
    store_state<V>(a.state0[t], i, buf);
    return p;
  });
}

void adam_step(const OptimArgs& a, const AdamHyper& h) {
  std::vector<AdamScalars> scalars(a.num_tensors);
  for (int64_t t = 0; t < a.num_tensors; ++t) scalars[t] = adam_scalars(h, a.lr, *a.steps[t]);
  optim_pass(a, [&](auto p, auto g, int64_t t, int64_t i) {
    using V = decltype(p);
    V m = load_state<V>(a.state0[t], i);
    V v = load_state<V>(a.state1[t], i);
    V vm = h.amsgrad ? load_state<V>(a.state2[t], i) : V(0.0f);
    p = adam_update<V, CpuMath>(p, g, m, v, vm, scalars[t]);
    store_state<V>(a.state0[t], i, m);
    store_state<V>(a.state1[t], i, v);
    if (h.amsgrad) store_state<V>(a.state2[t], i, vm);
    return p;
  });
}

}  // namespace

void fill_optim_kernels(KernelTable& table) {
  table.sgd_step = &sgd_step;
  table.adam_step = &adam_step;
}

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
