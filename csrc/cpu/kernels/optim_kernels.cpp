// CPU kernels of the fused optimizers (compiled once per CPU capability; see kernels.h).
//
// One pass per call: every element of every tensor is read once (grad, param or fp32 master,
// state) and written once (param, master, state). The math is in fp32 on float vectors; a
// tensor's last elements that do not fill a vector go through the same code with partial loads
// and stores (the kernels are compiled with -ffp-contract=off: no silent FMA).
#include "cpu/kernels/quant_codec.h"
#include "cpu/kernels/vec_utils.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

// The per-vector helpers below are always inlined into the one loop of each instantiation (GCC's
// size heuristics otherwise leave some of them as calls taking vectors through memory).
#define AMPFUSE_CPU_INLINE inline __attribute__((always_inline))

namespace ampfuse::cpu {
namespace CPU_CAPABILITY {
namespace {

using kernels::DType;
using kernels::KernelTable;
using kernels::LaunchContext;
using kernels::MasterKind;
using kernels::OptimArgs;

// The scalars of one call, read once from their (host) tensors.
struct CallScalars {
  double lr;
  float grad_scale;  // grads are divided by it when `divide`
  bool divide;
  float clip;        // and multiplied by it
  int64_t rounding_seed;  // MasterKind::Stochastic: the draws' seed
};

// nullopt: the step is skipped (found_inf set), nothing may change.
template <typename Hyper>
bool call_scalars(const OptimArgs& a, const Hyper& h, CallScalars& out) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return false;
  out.lr = a.lr_tensor ? static_cast<double>(*a.lr_tensor) : h.lr;
  out.grad_scale = a.grad_scale ? *a.grad_scale : 1.0f;
  out.divide = out.grad_scale != 1.0f;
  out.clip = a.clip_coef ? *a.clip_coef : 1.0f;
  out.rounding_seed = h.rounding_seed;
  return true;
}

// neg/sqrt/max/fma for the shared update rules (ops/rules.h), on float vectors (every element,
// a tensor's last ones included, goes through the vector code).
struct CpuMath {
  static AMPFUSE_CPU_INLINE FVec neg(const FVec& x) { return x.neg(); }
  static AMPFUSE_CPU_INLINE FVec sqrt(const FVec& x) { return x.sqrt(); }
  // NaN-propagating maximum, as torch.maximum.
  static AMPFUSE_CPU_INLINE FVec max(const FVec& a, const FVec& b) { return at::vec::maximum(a, b); }
  // Fused where the build has FMA, two roundings otherwise (at::vec::fmadd).
  static AMPFUSE_CPU_INLINE FVec fma(const FVec& a, const FVec& b, const FVec& c) { return at::vec::fmadd(a, b, c); }
};

// Two float vectors' worth of elements of T (half/bf16 widen to fp32). `n` < kLanes: only the
// first n elements are read (the rest of the lanes are zero) or written: masked loads and stores
// where the instruction set has them (a tensor's last elements that do not fill a vector).
template <typename T>
struct Pair {
  static constexpr int64_t kLanes = 2 * FVec::size();
  static AMPFUSE_CPU_INLINE void load(const T* p, FVec& a, FVec& b, int64_t n = kLanes) {
    constexpr int64_t H = FVec::size();
    if constexpr (std::is_same_v<T, float>) {
      if (n == kLanes) {
        a = FVec::loadu(p);
        b = FVec::loadu(p + H);
      } else {
        a = FVec::loadu(p, std::min(n, H));
        b = FVec::loadu(p + H, std::max<int64_t>(n - H, 0));
      }
    } else {
      static_assert(Vectorized<T>::size() == 2 * FVec::size());
      const auto v = n == kLanes ? Vectorized<T>::loadu(p) : Vectorized<T>::loadu(p, n);
      std::tie(a, b) = at::vec::convert_to_float<T>(v);
    }
  }
  static AMPFUSE_CPU_INLINE void store(T* p, const FVec& a, const FVec& b, int64_t n = kLanes) {
    constexpr int64_t H = FVec::size();
    if constexpr (std::is_same_v<T, float>) {
      if (n == kLanes) {
        a.store(p);
        b.store(p + H);
      } else {
        a.store(p, std::min(n, H));
        b.store(p + H, std::max<int64_t>(n - H, 0));
      }
    } else {
      const auto v = at::vec::convert_from_float<T>(a, b);
      if (n == kLanes) {
        v.store(p);
      } else {
        v.store(p, static_cast<int>(n));
      }
    }
  }
};

// Gradient as the optimizer sees it: unscaled (divided by the scale, as torch's fused optimizers
// do) and clipped.
template <typename V>
AMPFUSE_CPU_INLINE V prepare_grad(V g, float grad_scale, bool divide, float clip) {
  if (divide) g = g / V(grad_scale);
  if (clip != 1.0f) g = g * V(clip);
  return g;
}

// synced_master (ops/rules.h) on two float vectors: the masters, where the params still hold them
// rounded to T; the params where they were edited. NaN lanes compare unequal and take the param.
template <typename T>
AMPFUSE_CPU_INLINE void synced_master_vec(const float* master, FVec& p0, FVec& p1, int64_t n) {
  FVec m0, m1;
  Pair<float>::load(master, m0, m1, n);
  FVec r0 = m0, r1 = m1;
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(r0, r1) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(m0, m1));
  }
  p0 = FVec::blendv(m0, p0, r0 != p0);
  p1 = FVec::blendv(m1, p1, r1 != p1);
}

// ---- masters -----------------------------------------------------------------------------------

// join_master / split_master (ops/rules.h) on float vectors, bit for bit the same results (the
// emulated CUDA kernels, which use rules.h, are compared with these bitwise). The bf16 param and
// the int16 remainder are widened by the bf16 -> fp32 conversion, which is an exact 16-bit shift
// for every bit pattern: h = bits(param) << 16, q = bits(remainder) << 16.
using IVec = Vectorized<int32_t>;

AMPFUSE_CPU_INLINE FVec join_vec(const FVec& h, const FVec& q) {
  const IVec H = at::vec::cast<int32_t>(h);
  const IVec R = at::vec::cast<int32_t>(q) >> IVec(16);  // the remainder, sign-extended
  const IVec mag = H & IVec(0x7FFF0000);
  const IVec inf(0x7F800000), zero(0);
  // a pair no split produces (an edited zero/inf/NaN param): the param's value
  const IVec plain = (mag > inf) | ((mag == inf) & (R >= zero)) | ((mag == zero) & (R < zero));
  return at::vec::cast<float>(IVec::blendv(H + R, H, plain));
}

// The param bits (low 16 bits of each lane of *p) and remainders (of *r) of masters m.
AMPFUSE_CPU_INLINE void split_vec(const FVec& m, IVec& p, IVec& r) {
  const IVec b = at::vec::cast<int32_t>(m);
  const IVec nan = (b & IVec(0x7FFFFFFF)) > IVec(0x7F800000);
  const IVec hi = (b + IVec(0x8000)) >> IVec(16);  // nearest, ties away (low 16 bits exact)
  const IVec rem = b - (hi << IVec(16));
  p = IVec::blendv(hi, (b >> IVec(16)) | IVec(0x0040), nan);  // NaN stays a quiet NaN
  r = IVec::blendv(rem, IVec(0), nan);
}

// Stores the low 16 bits of each lane of a and b (the first n of 2 * FVec::size() values): one
// truncating narrow per vector (compilers turn the portable loop into per-element extracts).
template <typename U>
AMPFUSE_CPU_INLINE void store_low16(U* out, const IVec& a, const IVec& b, int64_t n) {
  constexpr int64_t N = 2 * FVec::size();
#if defined(CPU_CAPABILITY_AVX512)
  if (n == N) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(a));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm512_cvtepi32_epi16(b));
  } else {
    const auto mask = [](int64_t k) {
      return static_cast<__mmask16>(k >= 16 ? 0xFFFF : k <= 0 ? 0 : (1u << k) - 1);
    };
    _mm512_mask_cvtepi32_storeu_epi16(out, mask(n), a);
    _mm512_mask_cvtepi32_storeu_epi16(out + 16, mask(n - 16), b);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(a, low), _mm256_and_si256(b, low)), 0xD8);
  if (n == N) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  } else {
    alignas(32) uint16_t buf[N];
    _mm256_store_si256(reinterpret_cast<__m256i*>(buf), packed);
    std::memcpy(out, buf, static_cast<size_t>(n) * sizeof(uint16_t));
  }
#else
  int32_t buf[N];
  a.store(buf);
  b.store(buf + FVec::size());
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<U>(static_cast<uint16_t>(buf[e]));
#endif
}

// The draws of stochastic rounding in one row of a tensor: the key of its step (rounding_key,
// ops/rules.h) and the index in the tensor of the row's first element.
struct Rounding {
  uint32_t key;
  int64_t base;
};

// Where the fp32 value an update starts from comes from, and where it goes (kernels::MasterKind):
// the param itself (rounded to nearest, or stochastically), an fp32 master (synced_master), or the
// param and an int16 remainder (join_master / split_master, ops/rules.h).
template <MasterKind MK, typename T>
struct Master {
  using Storage = std::conditional_t<MK == MasterKind::Remainder, int16_t, float>;
  static constexpr bool kHasTensor = MK == MasterKind::Float || MK == MasterKind::Remainder;

  static AMPFUSE_CPU_INLINE void load(const T* param, const Storage* master, int64_t i, int64_t n,
                                      FVec& p0, FVec& p1) {
    if constexpr (MK == MasterKind::Remainder) {
      FVec h0, h1, q0, q1;
      Pair<T>::load(param + i, h0, h1, n);
      Pair<c10::BFloat16>::load(reinterpret_cast<const c10::BFloat16*>(master + i), q0, q1, n);
      p0 = join_vec(h0, q0);
      p1 = join_vec(h1, q1);
    } else {
      Pair<T>::load(param + i, p0, p1, n);
      if constexpr (MK == MasterKind::Float) synced_master_vec<T>(master + i, p0, p1, n);
    }
  }
  static AMPFUSE_CPU_INLINE void store(T* param, Storage* master, int64_t i, int64_t n,
                                       const FVec& p0, const FVec& p1, const Rounding& rnd) {
    if constexpr (MK == MasterKind::Stochastic) {
      // The shared rule per lane (a loop the compiler vectorises): each element's draw reads the
      // param's bits before they are overwritten.
      static_assert(std::is_same_v<T, c10::BFloat16>, "stochastic rounding is for bf16 params");
      constexpr int64_t H = FVec::size();
      alignas(64) float v[2 * H];
      p0.store(v);
      p1.store(v + H);
      auto* out = reinterpret_cast<uint16_t*>(param + i);
      const int64_t at = rnd.base + i;
      for (int64_t e = 0; e < n; ++e) {
        out[e] = round_bf16_stochastic(v[e], rounding_bits(rnd.key, at + e, out[e]));
      }
    } else if constexpr (MK == MasterKind::Remainder) {
      IVec a0, a1, b0, b1;
      split_vec(p0, a0, b0);
      split_vec(p1, a1, b1);
      store_low16(reinterpret_cast<uint16_t*>(param + i), a0, a1, n);
      store_low16(master + i, b0, b1, n);
    } else {
      if constexpr (MK == MasterKind::Float) Pair<float>::store(master + i, p0, p1, n);
      Pair<T>::store(param + i, p0, p1, n);
    }
  }
};

// ---- the optimizers ------------------------------------------------------------------------------

// The update of one optimizer on float vectors V, with its state in `st`.
struct SgdKind {
  using Hyper = SgdHyper;
  using Scalars = SgdScalars;
  static constexpr int kStates = 1;
  // Whether state k is >= 0 (8-bit state: the second-moment form of ops/rules.h).
  static constexpr bool nonnegative(int) { return false; }
  static Scalars scalars(const Hyper& h, double lr, float step) { return sgd_scalars(h, lr, step); }
  // Which states are read (the rest start at 0) and written.
  static bool reads_state(const Scalars& s) { return s.has_momentum && !s.first_step; }
  static bool writes_state(const Scalars& s) { return s.has_momentum; }
  template <typename V>
  static AMPFUSE_CPU_INLINE V update(V p, V g, V (&st)[kStates], const Scalars& s) {
    return sgd_update<V, CpuMath>(p, g, s.has_momentum ? &st[0] : nullptr, s);
  }
};

template <bool kAmsgrad>
struct AdamKind {
  using Hyper = AdamHyper;
  using Scalars = AdamScalars;
  static constexpr int kStates = kAmsgrad ? 3 : 2;
  static constexpr bool nonnegative(int k) { return k > 0; }  // exp_avg_sq, max_exp_avg_sq
  static Scalars scalars(const Hyper& h, double lr, float step) { return adam_scalars(h, lr, step); }
  static bool reads_state(const Scalars&) { return true; }
  static bool writes_state(const Scalars&) { return true; }
  template <typename V>
  static AMPFUSE_CPU_INLINE V update(V p, V g, V (&st)[kStates], const Scalars& s) {
    V unused(0.0f);
    V& vmax = kAmsgrad ? st[kStates - 1] : unused;
    return adam_update<V, CpuMath>(p, g, st[0], st[1], vmax, s);
  }
};

// ---- the pass ------------------------------------------------------------------------------------

// One vector's worth (n <= Pair<T>::kLanes elements from index i) of the update: param (through
// its master), grad (prepared), state of dtype S (fp32 math, stored rounded to nearest even)
// updated by Kind. The lanes are independent: a partial vector's elements get the same results
// as in a full one.
template <class Kind, typename T, typename G, MasterKind MK, typename S>
AMPFUSE_CPU_INLINE void optim_lanes(T* __restrict param, const G* __restrict grad,
                                    typename Master<MK, T>::Storage* __restrict master,
                                    S* const* state, int64_t i, int64_t n, const CallScalars& cs,
                                    const typename Kind::Scalars& s, bool read, bool write,
                                    const Rounding& rnd) {
  constexpr int NS = Kind::kStates;
  using M = Master<MK, T>;
  FVec p0, p1, g0, g1;
  M::load(param, master, i, n, p0, p1);
  Pair<G>::load(grad + i, g0, g1, n);
  g0 = prepare_grad(g0, cs.grad_scale, cs.divide, cs.clip);
  g1 = prepare_grad(g1, cs.grad_scale, cs.divide, cs.clip);
  FVec st0[NS], st1[NS];
  for (int k = 0; k < NS; ++k) {
    st0[k] = FVec(0.0f);
    st1[k] = FVec(0.0f);
    if (read) Pair<S>::load(state[k] + i, st0[k], st1[k], n);
  }
  p0 = Kind::update(p0, g0, st0, s);
  p1 = Kind::update(p1, g1, st1, s);
  M::store(param, master, i, n, p0, p1, rnd);
  if (write) {
    for (int k = 0; k < NS; ++k) Pair<S>::store(state[k] + i, st0[k], st1[k], n);
  }
}

template <class Kind, typename T, typename G, MasterKind MK, typename S>
AMPFUSE_CPU_INLINE void prefetch_row(const kernels::OptimTensor& o, int64_t j) {
  constexpr int64_t L = Pair<T>::kLanes;
  prefetch_bytes<L * sizeof(T)>(static_cast<const T*>(o.param) + j);
  prefetch_bytes<L * sizeof(G)>(static_cast<const G*>(o.grad) + j);
  if constexpr (Master<MK, T>::kHasTensor) {
    prefetch_bytes<L * sizeof(typename Master<MK, T>::Storage)>(
        static_cast<const typename Master<MK, T>::Storage*>(o.master) + j);
  }
  for (int k = 0; k < Kind::kStates; ++k) {
    if (o.state[k] != nullptr) prefetch_bytes<L * sizeof(S)>(static_cast<const S*>(o.state[k]) + j);
  }
}

// Chunk c: elements [begin, end) of its tensor. The last elements of a tensor that do not fill a
// vector go through the same vector code with partial loads and stores (a scalar tail per tensor,
// and then zero-padded copies, were the largest per-tensor costs of the kernel on small tensors).
template <class Kind, typename T, typename G, MasterKind MK, typename S>
void optim_chunk(const OptimArgs& a, const CallScalars& cs, const typename Kind::Scalars& s,
                 const std::vector<Chunk>& chunks, int64_t c) {
  const int64_t t = chunks[c].tensor, begin = chunks[c].begin, end = chunks[c].end;
  constexpr int NS = Kind::kStates;
  constexpr int64_t L = Pair<T>::kLanes;
  static_assert(Pair<G>::kLanes == L && Pair<S>::kLanes == L);
  using Storage = typename Master<MK, T>::Storage;
  const kernels::OptimTensor& o = a.tensors[t];
  // Every list is its own memory (the op layer checked): restrict lets the compiler keep values in
  // registers across the 16-bit stores of param and remainder.
  T* __restrict param = static_cast<T*>(o.param);
  const G* __restrict grad = static_cast<const G*>(o.grad);
  auto* __restrict master = static_cast<Storage*>(o.master);
  S* state[NS];
  for (int k = 0; k < NS; ++k) state[k] = static_cast<S*>(o.state[k]);
  const bool read = Kind::reads_state(s);
  const bool write = Kind::writes_state(s);
  const Rounding rnd{MK == MasterKind::Stochastic ? rounding_key(cs.rounding_seed, *o.step) : 0u, 0};
  int64_t i = begin;
  for (; i + L <= end; i += L) {
    if (i + kAheadElements < end) {
      // Inside a long tensor the hardware prefetchers keep up. The remainder kernel is bound by
      // its arithmetic there, and the requests only took issue slots from it (0.79x the speed of
      // the fp32-master step at 10M params with them, 0.89x without).
      if constexpr (MK != MasterKind::Remainder) prefetch_row<Kind, T, G, MK, S>(o, i + kAheadElements);
    } else {
      const auto [ac, aj] = ahead_of(chunks, c, i);
      if (ac >= 0) {
        const kernels::OptimTensor& next = a.tensors[chunks[ac].tensor];
        prefetch_row<Kind, T, G, MK, S>(next, aj);
        // The first look-ahead position in a chunk lies up to a row past its start, in steps
        // that do not meet it: its first lines are requested too.
        if (aj - chunks[ac].begin < L) prefetch_row<Kind, T, G, MK, S>(next, chunks[ac].begin);
      }
    }
    optim_lanes<Kind, T, G, MK, S>(param, grad, master, state, i, L, cs, s, read, write, rnd);
  }
  if (i < end) optim_lanes<Kind, T, G, MK, S>(param, grad, master, state, i, end - i, cs, s, read, write, rnd);
}

// 8-bit state (OptimArgs::quantized_state): chunk c a group of blocks at a time. Each state's
// blocks are dequantized into an fp32 staging row, the vector update above runs over the staging
// rows as fp32 state, and each block is requantized with its new absmax (ops/rules.h). Chunks
// start at multiples of kChunkElements, a multiple of the group, so blocks never straddle chunks;
// a group's rows (kGroupElements floats per state) stay in the L1 cache, and the codec's tables
// are loaded once per group.
constexpr int64_t kGroupElements = 8 * kQuantBlock;
static_assert(kChunkElements % kGroupElements == 0);

template <class Kind, typename T, typename G, MasterKind MK>
void optim_chunk_quantized(const OptimArgs& a, const CallScalars& cs, const typename Kind::Scalars& s,
                           const std::vector<Chunk>& chunks, int64_t c) {
  const int64_t t = chunks[c].tensor, begin = chunks[c].begin, end = chunks[c].end;
  constexpr int NS = Kind::kStates;
  constexpr int64_t L = Pair<T>::kLanes;
  static_assert(kQuantBlock % L == 0);
  using Storage = typename Master<MK, T>::Storage;
  const kernels::OptimTensor& o = a.tensors[t];
  T* param = static_cast<T*>(o.param);
  const G* grad = static_cast<const G*>(o.grad);
  auto* master = static_cast<Storage*>(o.master);
  alignas(64) float staging[NS][kGroupElements];
  float* rows[NS];
  const QuantTable* table[NS];
  for (int k = 0; k < NS; ++k) {
    rows[k] = staging[k];
    table[k] = &quant_table(a.state_format[k]);
  }
  const bool read = Kind::reads_state(s);
  const bool write = Kind::writes_state(s);
  const uint32_t key = MK == MasterKind::Stochastic ? rounding_key(cs.rounding_seed, *o.step) : 0u;
  for (int64_t b0 = begin; b0 < end; b0 += kGroupElements) {
    const int64_t n = std::min<int64_t>(kGroupElements, end - b0);
    const int64_t block = b0 / kQuantBlock;
    if (read) {
      for (int k = 0; k < NS; ++k) {
        decode_blocks_cpu(static_cast<const uint8_t*>(o.state[k]) + b0, n, o.absmax[k] + block, *table[k],
                          a.state_format[k], staging[k]);
      }
    }
    T* p = param + b0;
    const G* g = grad + b0;
    Storage* m = master != nullptr ? master + b0 : nullptr;
    const Rounding rnd{key, b0};
    int64_t i = 0;
    for (; i + L <= n; i += L) optim_lanes<Kind, T, G, MK, float>(p, g, m, rows, i, L, cs, s, read, write, rnd);
    if (i < n) optim_lanes<Kind, T, G, MK, float>(p, g, m, rows, i, n - i, cs, s, read, write, rnd);
    if (!write) continue;
    for (int k = 0; k < NS; ++k) {
      block_absmax_cpu(staging[k], n, o.absmax[k] + block);
      encode_blocks_cpu(staging[k], n, o.absmax[k] + block, *table[k], a.state_format[k], Kind::nonnegative(k),
                        static_cast<uint8_t*>(o.state[k]) + b0);
    }
  }
}

// One parallel pass over every chunk of every tensor (the combination of dtypes chosen once per
// call), then each step counter advanced by one.
template <class Kind, typename T, typename G, MasterKind MK, typename S>
void optim_pass(const OptimArgs& a, const CallScalars& cs,
                const std::vector<typename Kind::Scalars>& scalars) {
  const auto chunks = make_chunks(a.num_tensors, [&](int64_t t) { return a.tensors[t].numel; });
  parallel_chunks(chunks, [&](int64_t c) {
    if (a.quantized_state) {
      optim_chunk_quantized<Kind, T, G, MK>(a, cs, scalars[chunks[c].tensor], chunks, c);
    } else {
      optim_chunk<Kind, T, G, MK, S>(a, cs, scalars[chunks[c].tensor], chunks, c);
    }
  });
  for (int64_t t = 0; t < a.num_tensors; ++t) *a.tensors[t].step += 1.0f;
}

// The combinations the op layer admits: (param, grad) (fp32, fp32), (fp16/bf16, same or fp32);
// masters None or Float, Remainder and Stochastic for bf16; state fp32 or bf16.
template <class Kind, typename T, typename G, MasterKind MK>
void with_state(const OptimArgs& a, const CallScalars& cs, const std::vector<typename Kind::Scalars>& sc) {
  if (a.state_dtype == DType::BFloat16 && !a.quantized_state) {
    return optim_pass<Kind, T, G, MK, c10::BFloat16>(a, cs, sc);
  }
  return optim_pass<Kind, T, G, MK, float>(a, cs, sc);
}

template <class Kind, typename T, typename G>
void with_master(const OptimArgs& a, const CallScalars& cs, const std::vector<typename Kind::Scalars>& sc) {
  if constexpr (!std::is_same_v<T, float>) {
    if (a.master == MasterKind::Float) return with_state<Kind, T, G, MasterKind::Float>(a, cs, sc);
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (a.master == MasterKind::Remainder) {
        return with_state<Kind, T, G, MasterKind::Remainder>(a, cs, sc);
      }
      if (a.master == MasterKind::Stochastic) {
        return with_state<Kind, T, G, MasterKind::Stochastic>(a, cs, sc);
      }
    }
  }
  return with_state<Kind, T, G, MasterKind::None>(a, cs, sc);
}

template <class Kind, typename T>
void with_grad(const OptimArgs& a, const CallScalars& cs, const std::vector<typename Kind::Scalars>& sc) {
  if constexpr (!std::is_same_v<T, float>) {
    if (a.grad_dtype != DType::Float) return with_master<Kind, T, T>(a, cs, sc);
  }
  return with_master<Kind, T, float>(a, cs, sc);
}

template <class Kind>
int run_kind(const OptimArgs& a, const typename Kind::Hyper& hyper) {
  CallScalars cs;
  if (!call_scalars(a, hyper, cs)) return 0;  // skipped step: nothing changes
  const typename Kind::Hyper h = with_momentum(hyper, a.momentum_tensor);
  // Per tensor its scalars (bias corrections: two pow per step count). The step counters are
  // one small allocation each, requested a few tensors ahead; tensors usually share one count,
  // whose scalars are computed once.
  std::vector<typename Kind::Scalars> sc(a.num_tensors);
  for (int64_t t = 0; t < a.num_tensors; ++t) {
    if (t + 8 < a.num_tensors) __builtin_prefetch(a.tensors[t + 8].step);
    const float step = *a.tensors[t].step;
    if (t > 0 && step == *a.tensors[t - 1].step) {
      sc[t] = sc[t - 1];
    } else {
      sc[t] = Kind::scalars(h, cs.lr, step);
    }
  }
  switch (a.param_dtype) {
    case DType::Half: with_grad<Kind, c10::Half>(a, cs, sc); break;
    case DType::BFloat16: with_grad<Kind, c10::BFloat16>(a, cs, sc); break;
    default: with_grad<Kind, float>(a, cs, sc); break;
  }
  return 0;
}

int sgd_step(const OptimArgs& a, const SgdHyper& h, void*, const LaunchContext&) {
  return run_kind<SgdKind>(a, h);
}

int adam_step(const OptimArgs& a, const AdamHyper& h, void*, const LaunchContext&) {
  return h.amsgrad ? run_kind<AdamKind<true>>(a, h) : run_kind<AdamKind<false>>(a, h);
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
