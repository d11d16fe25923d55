// Scalar rules shared verbatim by the CPU kernels and the CUDA kernels, so that both backends
// follow the same contract (no torch headers: nvcc parses this file).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "include/ampfuse/scale_stat.h"

// Always inlined, as nvcc's __forceinline__: the rules are a few operations each, called per
// element (or per vector) in the kernels' inner loops, where a call would cost more than the rule.
#if defined(__CUDACC__)
#define AMPFUSE_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define AMPFUSE_HOST_DEVICE inline __attribute__((always_inline))
#else
#define AMPFUSE_HOST_DEVICE inline
#endif

namespace ampfuse {

// Norm selector passed to kernels.
enum class NormKind : int { None = 0, L2 = 1, Inf = 2 };

struct ScaleRuleParams {
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis;           // >= 1; 1 == torch's rule
  bool consecutive_hysteresis;  // refill the hysteresis budget after every clean step
  float floor;                  // max(min_scale, FLT_MIN): the scale never goes below it
  float ceiling;                // max_scale (FLT_MAX when unbounded)
};

// Applies one update in place.
//   scale, growth_tracker: the scaler state (fp32, int32).
//   hysteresis_left: remaining overflows tolerated before a backoff; may be null when
//     p.hysteresis == 1 (then the rule is exactly torch's _amp_update_scale_).
//   stats: four int64 counters (see ScaleStat), or null.
// With hysteresis 1 and no bounds this is bit-for-bit torch's rule (backoff and growth computed
// in double and rounded to fp32; growth refused when it would overflow fp32, the tracker still
// reset), except that a backoff never takes the scale below the smallest normal fp32 value.
AMPFUSE_HOST_DEVICE void update_scale_rule(float* scale, int32_t* growth_tracker, float found_inf,
                                           int32_t* hysteresis_left, int64_t* stats,
                                           const ScaleRuleParams& p) {
  float s = *scale;
  if (stats) stats[static_cast<int64_t>(ScaleStat::kUpdates)] += 1;
  if (found_inf != 0.0f) {
    *growth_tracker = 0;
    if (stats) stats[static_cast<int64_t>(ScaleStat::kOverflows)] += 1;
    int32_t left = hysteresis_left ? *hysteresis_left : 1;
    left = left > 0 ? left - 1 : 0;
    if (hysteresis_left) *hysteresis_left = left;
    if (left == 0) {
      float ns = static_cast<float>(static_cast<double>(s) * p.backoff_factor);
      bool clamped = false;
      if (!(ns >= p.floor)) {  // also catches a NaN scale
        ns = p.floor;
        clamped = true;
      }
      if (ns > p.ceiling) ns = p.ceiling;
      *scale = ns;
      if (stats) {
        stats[static_cast<int64_t>(ScaleStat::kBackoffs)] += 1;
        if (clamped) stats[static_cast<int64_t>(ScaleStat::kFloorHits)] += 1;
      }
    }
  } else {
    if (hysteresis_left && p.consecutive_hysteresis) *hysteresis_left = p.hysteresis;
    int32_t successful = *growth_tracker + 1;
    if (successful == p.growth_interval) {
      float ns = static_cast<float>(static_cast<double>(s) * p.growth_factor);
      // Do not grow past fp32 bounds to inf; clamp at the ceiling.
      if (std::isfinite(ns)) *scale = ns > p.ceiling ? (s > p.ceiling ? s : p.ceiling) : ns;
      *growth_tracker = 0;
      if (hysteresis_left) *hysteresis_left = p.hysteresis;
    } else {
      *growth_tracker = successful;
    }
  }
}

// Clip coefficient exactly as torch.nn.utils.clip_grad_norm_ computes it for a float max_norm, in
// the norm's precision F (float, or double for fp64 gradients): clamp((1 / (norm + 1e-6)) *
// max_norm, max=1) (torch's `max_norm / t` is reciprocal-then-multiply), NaN propagating.
template <typename F>
AMPFUSE_HOST_DEVICE F clip_coefficient(F norm, F max_norm) {
  const F coef = (F(1) / (norm + F(1e-6))) * max_norm;
  return coef > F(1) ? F(1) : coef;
}

// The same for a max_norm given as a tensor: torch's `max_norm / (norm + 1e-6)` is then a true
// division. (These two are the only clip-coefficient formulas in ampfuse: the fused check
// kernels, the clip_coef op and every scaler path use them.)
template <typename F>
AMPFUSE_HOST_DEVICE F clip_coefficient_div(F norm, F max_norm) {
  const F coef = max_norm / (norm + F(1e-6));
  return coef > F(1) ? F(1) : coef;
}

// The clip_coef op: the coefficient of a norm already computed (fp32, or fp64 for fp64 gradients)
// for a float max_norm or a max_norm tensor (`max_norm_tensor` non-null), written as fp32.
AMPFUSE_HOST_DEVICE float clip_coefficient_of(const void* total_norm, bool norm_fp64, double max_norm,
                                              const float* max_norm_tensor) {
  if (norm_fp64) {
    const double norm = *static_cast<const double*>(total_norm);
    return static_cast<float>(max_norm_tensor ? clip_coefficient_div<double>(norm, *max_norm_tensor)
                                              : clip_coefficient<double>(norm, max_norm));
  }
  const float norm = *static_cast<const float*>(total_norm);
  return max_norm_tensor ? clip_coefficient_div<float>(norm, *max_norm_tensor)
                         : clip_coefficient<float>(norm, static_cast<float>(max_norm));
}

// Where a step with an fp32 master starts: the master, unless the param no longer holds the master
// rounded to its dtype -- it was edited since the last step (an in-place clamp, a
// model.load_state_dict, a re-initialisation, param.data.copy_(...)); then the edit wins and the
// master restarts from the param. The step itself always leaves param == round(master).
AMPFUSE_HOST_DEVICE float synced_master(float master, float master_rounded, float param) {
  return master_rounded == param ? master : param;
}

// ---- 16-bit master remainders (master_weights="remainder", bf16 params) --------------------------
// The fp32 master M of a bf16 param is kept as the param P (M's upper 16 bits, rounded to nearest
// with ties away from zero) and an int16 remainder R = bits(M) - (bits(P) << 16): (P, R) is M bit
// for bit. (Round-half-even params would need 65537 remainder values for an even P -- the two
// ties -- so the exact split rounds ties away from zero: 1 value in 65536 differs from
// M.to(torch.bfloat16) by one bf16 ulp, and is still a nearest value.)
AMPFUSE_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

AMPFUSE_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// The master of param bits `p` and remainder `r`. Where the pair cannot come from split_master --
// a param edited since the last step to zero, inf or NaN -- the master is the param's value.
AMPFUSE_HOST_DEVICE float join_master(uint16_t p, int16_t r) {
  const uint32_t mag = p & 0x7FFFu;
  if (mag > 0x7F80u || (mag == 0x7F80u && r >= 0) || (mag == 0 && r < 0)) {
    return bits_float(static_cast<uint32_t>(p) << 16);
  }
  return bits_float((static_cast<uint32_t>(p) << 16) + static_cast<uint32_t>(static_cast<int32_t>(r)));
}

// Splits master m into param bits and remainder (join_master's inverse). NaN stays a quiet NaN.
AMPFUSE_HOST_DEVICE void split_master(float m, uint16_t* p, int16_t* r) {
  const uint32_t b = float_bits(m);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
    *p = static_cast<uint16_t>((b >> 16) | 0x0040u);
    *r = 0;
    return;
  }
  const uint32_t hi = (b + 0x8000u) >> 16;  // nearest, ties away from zero
  *p = static_cast<uint16_t>(hi);
  *r = static_cast<int16_t>(static_cast<int32_t>(b - (hi << 16)));
}

// ---- stochastic rounding of bf16 params (master_weights="stochastic": no master) -------------
// A bf16 param without a master is written as its fp32 update rounded stochastically: up in
// magnitude with probability (the dropped 16 bits) / 65536, so the rounding is unbiased and small
// updates survive on average instead of vanishing under round-to-nearest. The 16 random bits of an
// element come from a counter-based hash of the call's seed, the param's step count (before the
// update), the element's index in the param's flat element order and the param's bits before the
// update: every backend, thread count and schedule gives the same bits, a resumed run the bits
// of the uninterrupted one, and params with other values or indices independent draws.

// A 32-bit integer mix with full avalanche (the "lowbias32" constants of Wellons' hash prospector).
AMPFUSE_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The key of one param's draws at one step: the seed's 64 bits and the step count's bits.
AMPFUSE_HOST_DEVICE uint32_t rounding_key(int64_t seed, float step) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return mix32(mix32(mix32(static_cast<uint32_t>(s) ^ 0x9E3779B9u) ^ static_cast<uint32_t>(s >> 32)) ^
               float_bits(step));
}

// The 16 random bits of element `index` whose param held bits `param` before the update.
AMPFUSE_HOST_DEVICE uint32_t rounding_bits(uint32_t key, int64_t index, uint16_t param) {
  const uint64_t i = static_cast<uint64_t>(index);
  return mix32(mix32(key ^ static_cast<uint32_t>(i)) ^
               (static_cast<uint32_t>(param) | (static_cast<uint32_t>(i >> 32) << 16))) & 0xFFFFu;
}

// The bf16 bits of `x` rounded stochastically with random bits `r` (< 65536): the magnitude is
// rounded up when r + (x's low 16 bits) carries. inf stays inf, NaN a quiet NaN; a finite value
// past the largest bf16 may round to inf, as round-to-nearest does there.
AMPFUSE_HOST_DEVICE uint16_t round_bf16_stochastic(float x, uint32_t r) {
  const uint32_t b = float_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x0040u);
  return static_cast<uint16_t>((b + r) >> 16);
}

// ---- 8-bit block-scaled state --------------------------------------------------------------
//
// A state tensor in 8 bits is cut, in its flat element order, into blocks of kQuantBlock elements
// (the last one may be shorter); each block keeps one fp32 absmax (the largest magnitude of its
// finite values; 0, with zero bytes for them, when it is below fp32's normal range: there a
// decoded value would lose bits, so a decode-encode round trip would change codes, and such values
// are far below what changes a step) and one byte per element. A byte decodes as
// table[index] * absmax, with the format's table of magnitudes normalised to [0, 1] (its largest
// finite entry is exactly 1, so a block's largest finite value decodes to exactly its absmax).
// A block that holds an inf or a NaN is marked: its absmax is stored negated (-0 when it is 0),
// and in it index 1 is inf (with the sign bit: -inf) and one code is NaN (0x80 in the signed
// formats, index 2 in Dynamic8Unsigned), so each non-finite value stays itself and the others
// keep their precision, as in an fp32 state; a finite value whose index would be a mark's takes
// the nearest other index (0 or the next one up; the next one up for a positive second moment).
// The formats:
//   Dynamic8Signed   torch.uint8, sign bit + a 7-bit index into 128 magnitudes (0, then seven
//                    decades 1e-7..1 with 1, 2, 4, 8, 16, 32 and 63 linear steps, then 1): for
//                    values of either sign (first moments, momentum)
//   Dynamic8Unsigned torch.uint8, an 8-bit index into 256 magnitudes (0, seven decades with 2, 4,
//                    ..., 128 steps, then 1): for values >= 0 (second moments), twice the
//                    resolution
//   E4M3 / E5M2      torch.float8_e4m3fn / torch.float8_e5m2: the byte is the fp8 value of
//                    value / absmax * 448 (57344), i.e. the fp8 number scaled per block
// The dynamic tables follow the construction of Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization" (2022): in each decade, the midpoints of an even split of [0.1, 1]. Encoding
// picks the nearest entry (ties: the even index). With `nonnegative` (second moments), negative
// values encode as 0 and a positive value never encodes as 0 (the smallest positive entry
// instead), so a moment that the update divides by never becomes exactly 0.
enum class QuantFormat : uint8_t { Dynamic8Signed = 0, Dynamic8Unsigned = 1, E4M3 = 2, E5M2 = 3 };

constexpr int64_t kQuantBlock = 256;

// Entries in the format's table (a power of two); the index is the byte's low 7 bits for the
// signed formats, the whole byte for Dynamic8Unsigned.
AMPFUSE_HOST_DEVICE int quant_table_size(QuantFormat f) {
  return f == QuantFormat::Dynamic8Unsigned ? 256 : 128;
}

// Entry `i` of the format's table, in [0, 1] (ascending); fp8 bytes that are not finite numbers
// give inf/NaN, as fp8 decodes them. Computed in double and rounded once.
AMPFUSE_HOST_DEVICE float quant_table_entry(QuantFormat f, int i) {
  if (f == QuantFormat::E4M3 || f == QuantFormat::E5M2) {
    const bool e4 = f == QuantFormat::E4M3;
    const int mbits = e4 ? 3 : 2, bias = e4 ? 7 : 15;
    const int e = i >> mbits, m = i & ((1 << mbits) - 1);
    if (e4 && i == 0x7F) return NAN;
    if (!e4 && e == 31) return m == 0 ? INFINITY : NAN;
    const double frac = static_cast<double>(m) / static_cast<double>(1 << mbits);
    const double v = e == 0 ? ldexp(frac, 1 - bias) : ldexp(1.0 + frac, e - bias);
    return static_cast<float>(v / (e4 ? 448.0 : 57344.0));
  }
  const int n = quant_table_size(f);
  if (i <= 0) return 0.0f;
  if (i >= n - 1) return 1.0f;
  // decades 1e-7..1e-6, ..., 0.1..1 with `steps(d)` entries each, from the smallest
  const bool sign = f == QuantFormat::Dynamic8Signed;
  int k = i - 1;
  for (int d = 0; d < 7; ++d) {
    const int steps = sign ? (d == 6 ? 63 : 1 << d) : 2 << d;
    if (k < steps) {
      // (a select chain, not an array: a GPU keeps an indexed local array in stack memory)
      const double decade = d == 0   ? 1e-6
                            : d == 1 ? 1e-5
                            : d == 2 ? 1e-4
                            : d == 3 ? 1e-3
                            : d == 4 ? 1e-2
                            : d == 5 ? 1e-1
                                     : 1e0;
      return static_cast<float>(decade * (0.1 + 0.9 * (2 * k + 1) / (2 * steps)));
    }
    k -= steps;
  }
  return 1.0f;
}

// The term of value `x` in its block's absmax: its magnitude, or -0 (no magnitude, the sign bit
// as the block's mark) for an inf or a NaN.
AMPFUSE_HOST_DEVICE float absmax_term(float x) {
  return (float_bits(x) & 0x7FFFFFFFu) < 0x7F800000u ? fabsf(x) : -0.0f;
}

// Whether `x` has its sign bit set (a marked block's absmax; -0 too).
AMPFUSE_HOST_DEVICE bool sign_bit(float x) { return (float_bits(x) >> 31) != 0; }

// Two absmax terms (or combinations) combined: the larger magnitude, negative when either is.
AMPFUSE_HOST_DEVICE float absmax_combine(float a, float b) {
  const float m = fmaxf(fabsf(a), fabsf(b));
  return (sign_bit(a) || sign_bit(b)) ? -m : m;
}

// The magnitude an encoding looks up: |x| / absmax (0 for a negative second moment, and in a
// block stored as zeros).
AMPFUSE_HOST_DEVICE float quant_magnitude(float x, float absmax, bool nonnegative) {
  return ((x < 0.0f && nonnegative) || absmax == 0.0f) ? 0.0f : fabsf(x) / absmax;
}

// The byte of `x` whose magnitude `a` (quant_magnitude) has `first` as the first table index
// with an entry >= a: the nearest entry (ties: the even index), 0 for a zero or NaN magnitude,
// the floor for a positive second moment, and the sign bit.
AMPFUSE_HOST_DEVICE uint8_t quant_encode_at(float x, float a, int first, const float* table,
                                            QuantFormat f, bool nonnegative) {
  // (in selects rather than branches: which way a value rounds is data, not predictable)
  const int prev = first > 0 ? first - 1 : 0;
  const float below = a - table[prev], above = table[first] - a;
  const bool down = first > 0 && (below < above || (below == above && (prev & 1) == 0));
  int idx = first - (down ? 1 : 0);
  idx = a > 0.0f ? idx : 0;  // 0 and NaN
  idx = (nonnegative && idx == 0 && a > 0.0f) ? 1 : idx;
  const bool sign = f != QuantFormat::Dynamic8Unsigned;
  return static_cast<uint8_t>(idx | ((sign && x < 0.0f && idx != 0) ? 0x80 : 0));
}

// The code that marks NaN in a marked block, and the first index a finite value takes there above 0.
AMPFUSE_HOST_DEVICE int quant_nan_mark(QuantFormat f) { return f == QuantFormat::Dynamic8Unsigned ? 2 : 0x80; }
AMPFUSE_HOST_DEVICE int quant_first_unmarked(QuantFormat f) { return f == QuantFormat::Dynamic8Unsigned ? 3 : 2; }

// The byte of `x` in a marked block, given `c`, its byte by the unmarked rule, and `a`, its
// magnitude (quant_magnitude): the marks for inf and NaN, a finite value off the marks.
AMPFUSE_HOST_DEVICE uint8_t quant_encode_marked(float x, uint8_t c, float a, const float* table, QuantFormat f,
                                                bool nonnegative) {
  const bool sign = f != QuantFormat::Dynamic8Unsigned;
  if (x != x) return static_cast<uint8_t>(quant_nan_mark(f));
  if (fabsf(x) == INFINITY) {  // (before the zero test: a block of absmax 0 gives inf a magnitude of 0)
    return static_cast<uint8_t>((x < 0.0f && nonnegative) ? 0 : (sign && x < 0.0f) ? 0x81 : 1);
  }
  if (a == 0.0f) return c;  // 0, a negative second moment
  const int idx = sign ? (c & 0x7F) : c, up = quant_first_unmarked(f);
  if (idx == 0 || idx >= up) return c;
  const bool down = !nonnegative && a - table[0] < table[up] - a;
  return static_cast<uint8_t>(down ? 0 : (c & (sign ? 0x80 : 0)) | up);
}

// The byte of `x` in a block of absmax `absmax` (a block whose absmax is 0 stores zero bytes for
// its finite values), given the format's table: the first index is found by binary search
// (entries past the finite ones are inf/NaN, never < a).
AMPFUSE_HOST_DEVICE uint8_t quant_encode(float x, float absmax, const float* table, QuantFormat f,
                                         bool nonnegative) {
  const float a = quant_magnitude(x, fabsf(absmax), nonnegative);
  int lo = 0;
  for (int step = quant_table_size(f) >> 1; step > 0; step >>= 1) {
    if (table[lo + step - 1] < a) lo += step;
  }
  const uint8_t c = quant_encode_at(x, a, lo, table, f, nonnegative);
  return sign_bit(absmax) ? quant_encode_marked(x, c, a, table, f, nonnegative) : c;
}

// The value of byte `c` in a block of absmax `absmax`.
AMPFUSE_HOST_DEVICE float quant_decode(uint8_t c, float absmax, const float* table, QuantFormat f) {
  const bool sign = f != QuantFormat::Dynamic8Unsigned;
  const int idx = sign ? (c & 0x7F) : c;
  if (sign_bit(absmax)) {  // a marked block
    if (c == quant_nan_mark(f)) return NAN;
    if (idx == 1) return (sign && (c & 0x80)) ? -INFINITY : INFINITY;
  }
  const float v = table[idx] * fabsf(absmax);
  return (sign && (c & 0x80)) ? -v : v;
}

// The absmax a block stores for `m`, the absmax_combine of its values' absmax_term: 0 below fp32's
// normal range (the finite values are stored as zeros), negated in a marked block.
AMPFUSE_HOST_DEVICE float quant_block_absmax(float m) {
  const float finite = fabsf(m) < 0x1p-126f ? 0.0f : fabsf(m);
  return sign_bit(m) ? -finite : finite;
}

// Hyper-parameters of the fused optimizers (the step-dependent factors are derived per tensor from
// its own step counter, in double precision as torch's for-loop Adam computes them).
struct SgdHyper {
  double lr;  // used when no lr tensor is given
  double momentum;
  double dampening;
  double weight_decay;
  bool nesterov;
  bool maximize;
  // bf16 params without a master: rounded stochastically with draws of this seed (above).
  bool stochastic_rounding = false;
  int64_t rounding_seed = 0;
};

struct AdamHyper {
  double lr;  // used when no lr tensor is given
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool amsgrad;
  bool maximize;
  bool decoupled_weight_decay;  // AdamW
  // bf16 params without a master: rounded stochastically with draws of this seed (above).
  bool stochastic_rounding = false;
  int64_t rounding_seed = 0;
};

// Per-tensor scalars of one Adam step, from the step number the update produces (>= 1).
struct AdamStepScalars {
  float step_size;        // lr / (1 - beta1^step)
  float bias_corr2_sqrt;  // sqrt(1 - beta2^step)
  float decay;            // 1 - lr * weight_decay (decoupled), else 1
};

AMPFUSE_HOST_DEVICE AdamStepScalars adam_step_scalars(const AdamHyper& h, double lr, double step) {
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  AdamStepScalars s;
  s.step_size = static_cast<float>(lr / bc1);
  s.bias_corr2_sqrt = static_cast<float>(sqrt(bc2));
  s.decay = h.decoupled_weight_decay ? static_cast<float>(1.0 - lr * h.weight_decay) : 1.0f;
  return s;
}

// ---- the optimizer update rules, shared by the CPU kernels (V = at::vec::Vectorized<float> or
// float) and the CUDA kernels (V = float). M supplies neg/sqrt/max for V. The order of operations
// follows torch's for-loop SGD/Adam implementations; every value is fp32.

struct SgdScalars {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, maximize, has_momentum;
  bool first_step;  // momentum buffer := grad (torch clones the first grad)
};

template <typename V, typename M>
AMPFUSE_HOST_DEVICE V sgd_update(V p, V g, V* buf, const SgdScalars& s) {
  if (s.maximize) g = M::neg(g);
  // torch's add(x, alpha=a) is fma(x, a, self) in its vectorised kernels; mirror it.
  if (s.weight_decay != 0.0f) g = M::fma(p, V(s.weight_decay), g);
  if (s.has_momentum) {
    const V b = s.first_step ? g : M::fma(g, V(s.one_minus_dampening), (*buf) * V(s.momentum));
    *buf = b;
    g = s.nesterov ? M::fma(b, V(s.momentum), g) : b;
  }
  return M::fma(g, V(-s.lr), p);
}

struct AdamScalars {
  AdamStepScalars step;
  float beta1_weight;  // 1 - beta1: exp_avg.lerp_(grad, beta1_weight)
  float beta2, one_minus_beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;
};

template <typename V, typename M>
AMPFUSE_HOST_DEVICE V adam_update(V p, V g, V& m, V& v, V& vmax, const AdamScalars& s) {
  if (s.maximize) g = M::neg(g);
  if (s.decoupled) {
    p = p * V(s.step.decay);
  } else if (s.weight_decay != 0.0f) {
    g = M::fma(p, V(s.weight_decay), g);
  }
  // exp_avg.lerp_(grad, 1 - beta1): torch's two-sided lerp, fma(coeff, end - start, base).
  const bool small = s.beta1_weight < 0.5f;
  m = M::fma(V(small ? s.beta1_weight : s.beta1_weight - 1.0f), g - m, small ? m : g);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  // (torch's addcmul kernel computes self + (value * t1) * t2 with one fused multiply-add)
  v = M::fma(V(s.one_minus_beta2) * g, g, v * V(s.beta2));
  V src = v;
  if (s.amsgrad) {
    vmax = M::max(vmax, v);
    src = vmax;
  }
  // denom = (sqrt / bias_correction2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, -step_size)
  const V denom = M::sqrt(src) / V(s.step.bias_corr2_sqrt) + V(s.eps);
  return p + V(-s.step.step_size) * m / denom;
}

// The hyper-parameters with the momentum (SGD) or beta1 (Adam) a device value gives, when one
// does (read once per call, as the lr tensor).
AMPFUSE_HOST_DEVICE SgdHyper with_momentum(SgdHyper h, const float* momentum) {
  if (momentum != nullptr) h.momentum = static_cast<double>(*momentum);
  return h;
}
AMPFUSE_HOST_DEVICE AdamHyper with_momentum(AdamHyper h, const float* beta1) {
  if (beta1 != nullptr) h.beta1 = static_cast<double>(*beta1);
  return h;
}

AMPFUSE_HOST_DEVICE SgdScalars sgd_scalars(const SgdHyper& h, double lr, float step_before) {
  return SgdScalars{static_cast<float>(lr),
                    static_cast<float>(h.momentum),
                    static_cast<float>(1.0 - h.dampening),
                    static_cast<float>(h.weight_decay),
                    h.nesterov,
                    h.maximize,
                    h.momentum != 0.0,
                    step_before == 0.0f};
}

AMPFUSE_HOST_DEVICE AdamScalars adam_scalars(const AdamHyper& h, double lr, float step_before) {
  return AdamScalars{adam_step_scalars(h, lr, static_cast<double>(step_before) + 1.0),
                     static_cast<float>(1.0 - h.beta1),
                     static_cast<float>(h.beta2),
                     static_cast<float>(1.0 - h.beta2),
                     static_cast<float>(h.eps),
                     static_cast<float>(h.weight_decay),
                     h.amsgrad,
                     h.maximize,
                     h.decoupled_weight_decay};
}

}  // namespace ampfuse
