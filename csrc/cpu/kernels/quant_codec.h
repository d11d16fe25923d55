// The 8-bit block-scaled form on the CPU: quant_encode and quant_decode (ops/rules.h) over a block,
// bit for bit, without the rule's search. Compiled once per capability (see vec_utils.h).
//
// Encoding computes a first guess g of a magnitude's table index by arithmetic, the index at or
// one below the rule's, and corrects it with one comparison: index = g + (a > up_to[g]), where
// up_to[g] is the largest magnitude the rule gives an index <= g (found from quant_encode itself
// when the table is built, so the two agree by construction wherever the guess is in range):
//   E4M3 / E5M2   the fp8 code of a * 448 (57344) truncated: the float's exponent and top mantissa
//                 bits, or for fp8 subnormals the scaled value's integer part
//   dynamic maps  the region r of a: the magnitudes the rule gives an index of decade r's even
//                 split (region 0 also index 0, region 7 the last index, 1), bounded by up_to; a
//                 binade holds at most one region start, so r is the binade's first region plus
//                 one comparison. Then the entry at or below a in the decade's even split, at most
//                 the region's last index: min(base[r] + floor(f), top[r]), f = a * scale[r] +
//                 offset[r], the entries lying at integer f
// The guess is off only near a table entry, where the rule's index is then g or g + 1 either way.
// Between a dynamic map's entries the rule's index is min(base[r] + f rounded to the nearest
// integer, top[r]) except near a midpoint (f within kNearMidpoint of an integer plus 1/2), as
// the rounding errors of f and of the entries are some 1e-5 of a step: the AVX-512 copy takes
// that, and the correction only for a group of 16 that holds a value near a midpoint.
// Decoding is entries[index] * absmax with the sign as a bit. The AVX-512 copy keeps the tables it
// reads for every value in registers (cross-lane permutes instead of gathers; the decode's as
// 16-bit halves, 32 codes a permute); the others are loops the compiler vectorises.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "cpu/kernels/kernels.h"

namespace ampfuse::cpu {
namespace CPU_CAPABILITY {

// The binade index of a magnitude s in [0, 1]: its biased exponent less this, at least 0.
constexpr int32_t kBinadeBias = 127 - 31;
// How far from a midpoint (in steps of the decade's even split) a dynamic map's rounding is taken
// as exact: some 100 times the rounding errors of f and of the entries.
constexpr float kNearMidpoint = 0x1p-10f;

struct alignas(64) QuantTable {
  float entries[256];  // quant_table_entry, 0 past the format's size
  uint16_t entry_half[2][256];  // the entries' bits: low and high 16 bits
  float up_to[256];    // the largest magnitude in [0, 1] with an index <= g; +inf from the last index
  // dynamic maps, per region r (0: decade 1e-7..1e-6 and index 0, ..., 6: decade 0.1..1, 7: 1)
  float scale[16];
  float offset[16];
  int32_t base[16];  // the index before the region's decade's first entry (region 7: its index)
  int32_t top[16];   // the region's last index
  // per binade b (magnitudes [2^(b-31), 2^(b-30)), b = 0 also all below): the region of its
  // first value, and the start of the next region where that lies in the binade (else +inf)
  int32_t binade_region[32];
  float binade_next[32];
};

// The guess for a magnitude s in [0, 1] (callers clamp; NaN as 0).
inline int32_t quant_guess(const QuantTable& t, QuantFormat f, float s) {
  if (f == QuantFormat::E4M3 || f == QuantFormat::E5M2) {
    const bool e4 = f == QuantFormat::E4M3;
    const float v = s * (e4 ? 448.0f : 57344.0f);
    const bool normal = v >= (e4 ? 0x1p-6f : 0x1p-14f);
    return normal ? static_cast<int32_t>(float_bits(v) >> (e4 ? 20 : 21)) - (e4 ? 960 : 448)
                  : static_cast<int32_t>(v * (e4 ? 512.0f : 65536.0f));
  }
  const int32_t b = std::max(static_cast<int32_t>(float_bits(s) >> 23) - kBinadeBias, 0);
  const int32_t r = t.binade_region[b] + (s >= t.binade_next[b] ? 1 : 0);
  return std::min(t.base[r] + static_cast<int32_t>(s * t.scale[r] + t.offset[r]), t.top[r]);
}

inline const QuantTable& quant_table(QuantFormat f) {
  static const auto tables = [] {
    std::array<QuantTable, 4> t{};
    for (int k = 0; k < 4; ++k) {
      const auto format = static_cast<QuantFormat>(k);
      const int n = quant_table_size(format);
      QuantTable& q = t[k];
      for (int i = 0; i < 256; ++i) {
        q.entries[i] = i < n ? quant_table_entry(format, i) : 0.0f;
        q.entry_half[0][i] = static_cast<uint16_t>(float_bits(q.entries[i]));
        q.entry_half[1][i] = static_cast<uint16_t>(float_bits(q.entries[i]) >> 16);
      }
      // the index quant_encode gives magnitude bits `u` (without the sign bit of a signed map)
      auto index_of = [&](uint32_t u) {
        const int c = quant_encode(bits_float(u), 1.0f, q.entries, format, false);
        return format == QuantFormat::Dynamic8Unsigned ? c : c & 0x7F;
      };
      constexpr uint32_t kOne = 0x3F800000u;
      for (int g = 0; g < 256; ++g) {
        if (g >= n - 1) {
          q.up_to[g] = INFINITY;
          continue;
        }
        if (index_of(kOne) <= g) {
          q.up_to[g] = 1.0f;
          continue;
        }
        uint32_t good = 0, bad = kOne;  // index(good) <= g < index(bad); the index is monotone
        while (bad - good > 1) {
          const uint32_t mid = good + (bad - good) / 2;
          (index_of(mid) <= g ? good : bad) = mid;
        }
        q.up_to[g] = bits_float(good);
      }
      if (format != QuantFormat::Dynamic8Signed && format != QuantFormat::Dynamic8Unsigned) continue;
      const bool sign = format == QuantFormat::Dynamic8Signed;
      float region_start[9];  // the smallest magnitude of region r (r >= 1); +inf at 8
      for (int r = 0, base = 0; r < 8; ++r) {
        const int steps = r == 7 ? 1 : sign ? (r == 6 ? 63 : 1 << r) : 2 << r;
        const double width = 0.9 * std::pow(10.0, r - 6);  // of the decade [0.1 D, D], D = 10^(r-6)
        q.scale[r] = r == 7 ? 0.0f : static_cast<float>(steps / width);
        q.offset[r] = r == 7 ? 0.0f : static_cast<float>(0.5 - steps / 9.0);
        q.base[r] = r == 7 ? n - 1 : base;
        q.top[r] = r == 7 ? n - 1 : base + steps;
        region_start[r] = r == 0 ? 0.0f : bits_float(float_bits(q.up_to[base]) + 1);
        base += steps;
      }
      region_start[8] = INFINITY;
      for (int b = 0; b < 32; ++b) {
        const float lo = b == 0 ? 0.0f : std::ldexp(1.0f, b - 31), hi = std::ldexp(1.0f, b - 30);
        int r = 0;
        while (lo >= region_start[r + 1]) ++r;
        q.binade_region[b] = r;
        const float next = region_start[r + 1];
        q.binade_next[b] = next < hi ? next : INFINITY;
        // (a binade holds at most one region start: the next lies past the binade's end)
        if (next < hi && region_start[r + 2] < hi) std::abort();
      }
    }
    return t;
  }();
  return tables[static_cast<int>(f)];
}

// The largest magnitude's bits of x[0, n) (a magnitude's bits order as its value, and inf's and
// NaN's lie above every finite one's); with `finite_only`, of its finite values. An integer max,
// so the loop vectorises.
template <bool kFiniteOnly>
inline uint32_t max_magnitude_bits(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t e = 0; e < n; ++e) {
    uint32_t b;
    std::memcpy(&b, x + e, sizeof b);
    b &= 0x7FFFFFFFu;
    m = std::max(m, (kFiniteOnly && b >= 0x7F800000u) ? 0u : b);
  }
  return m;
}

// The absmax of each block of x[0, n) (quant_block_absmax of absmax_combine over its values'
// absmax_term): the largest magnitude, and in the rare block that holds an inf or a NaN, the
// largest finite one with the sign bit set.
inline void block_absmax_cpu(const float* x, int64_t n, float* absmax) {
  for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
    const int64_t len = std::min(kQuantBlock, n - b0);
    const uint32_t m = max_magnitude_bits<false>(x + b0, len);
    absmax[b0 / kQuantBlock] = quant_block_absmax(
        bits_float(m < 0x7F800000u ? m : (max_magnitude_bits<true>(x + b0, len) | 0x80000000u)));
  }
}

// Whether a block's absmax marks it as holding an inf or a NaN (ops/rules.h): its codes are
// encoded and decoded by the rule itself, value by value, outside the vector loops (a call inside
// them would cost their register-held tables on every path).
inline bool marked_block(float absmax) { return sign_bit(absmax); }

[[gnu::cold, gnu::noinline]] inline void encode_marked_cpu(const float* x, int64_t n, float absmax,
                                                           const QuantTable& t, QuantFormat f, bool nonnegative,
                                                           uint8_t* out) {
  for (int64_t e = 0; e < n; ++e) out[e] = quant_encode(x[e], absmax, t.entries, f, nonnegative);
}

[[gnu::cold, gnu::noinline]] inline void decode_marked_cpu(const uint8_t* codes, int64_t n, float absmax,
                                                           const QuantTable& t, QuantFormat f, float* out) {
  for (int64_t e = 0; e < n; ++e) out[e] = quant_decode(codes[e], absmax, t.entries, f);
}

#if defined(CPU_CAPABILITY_AVX512)

// table[idx] for idx in [0, 128), the table held in 8 registers: a two-register permute per 32
// entries picks by the index's low five bits, mask blends by bits 5 and 6.
struct RegTable {
  __m512 r[8];
  explicit RegTable(const float* t) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) r[j] = _mm512_load_ps(t + 16 * j);
  }
  __m512 operator()(__m512i idx) const {
    const __mmask16 bit5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    const __mmask16 bit6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    const __m512 low = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(r[0], idx, r[1]),
                                            _mm512_permutex2var_ps(r[2], idx, r[3]));
    const __m512 high = _mm512_mask_blend_ps(bit5, _mm512_permutex2var_ps(r[4], idx, r[5]),
                                             _mm512_permutex2var_ps(r[6], idx, r[7]));
    return _mm512_mask_blend_ps(bit6, low, high);
  }
};

template <QuantFormat F>
struct Codec16 {
  static constexpr bool kSigned = F != QuantFormat::Dynamic8Unsigned;
  static constexpr bool kFp8 = F == QuantFormat::E4M3 || F == QuantFormat::E5M2;
  const QuantTable& t;
  __m512i binade_region[2], top;
  __m512 binade_next[2], scale, offset_base;  // offset_base: offset + base
  explicit Codec16(const QuantTable& table) : t(table) {
    for (int j = 0; j < 2; ++j) {
      binade_region[j] = _mm512_load_si512(t.binade_region + 16 * j);
      binade_next[j] = _mm512_load_ps(t.binade_next + 16 * j);
    }
    top = _mm512_load_si512(t.top);
    scale = _mm512_load_ps(t.scale);
    offset_base = _mm512_add_ps(_mm512_load_ps(t.offset), _mm512_cvtepi32_ps(_mm512_load_si512(t.base)));
  }

  // the fp8 guess (quant_guess)
  static __m512i fp8_guess(__m512 s) {
    constexpr bool e4 = F == QuantFormat::E4M3;
    const __m512 v = _mm512_mul_ps(s, _mm512_set1_ps(e4 ? 448.0f : 57344.0f));
    const __mmask16 normal = _mm512_cmp_ps_mask(v, _mm512_set1_ps(e4 ? 0x1p-6f : 0x1p-14f), _CMP_GE_OQ);
    const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(e4 ? 512.0f : 65536.0f)));
    const __m512i nor = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(v), e4 ? 20 : 21),
                                         _mm512_set1_epi32(e4 ? 960 : 448));
    return _mm512_mask_mov_epi32(sub, normal, nor);
  }

  // a dynamic map's index of magnitudes s in [0, 1] (see the top of the file): the rounding,
  // corrected through up_to where a value lies near a midpoint (`a` the unclamped magnitudes)
  __m512i dynamic_index(__m512 s, __m512 a) const {
    // (s's biased exponent lies in [0, 127], in the low half of its lane: a saturating 16-bit
    // subtraction is the max with 0)
    const __m512i b = _mm512_subs_epu16(_mm512_srli_epi32(_mm512_castps_si512(s), 23),
                                        _mm512_set1_epi32(kBinadeBias));
    const __m512i r0 = _mm512_permutex2var_epi32(binade_region[0], b, binade_region[1]);
    const __m512 next = _mm512_permutex2var_ps(binade_next[0], b, binade_next[1]);
    const __m512i r = _mm512_mask_add_epi32(r0, _mm512_cmp_ps_mask(s, next, _CMP_GE_OQ), r0, _mm512_set1_epi32(1));
    // base[r] + f (its error some 1e-5 of a step, fused or not): the index is its nearest
    // integer, and a value near a midpoint is one whose distance to it is near 1/2
    const __m512 fb = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(r, scale), _mm512_permutexvar_ps(r, offset_base));
    const __m512i last = _mm512_permutexvar_epi32(r, top);
    const __m512i idx = _mm512_min_epi32(_mm512_cvt_roundps_epi32(fb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), last);
    const __m512 off = _mm512_abs_ps(_mm512_reduce_ps(fb, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __mmask16 near = _mm512_cmp_ps_mask(off, _mm512_set1_ps(0.5f - kNearMidpoint), _CMP_GT_OQ);
    if (near == 0) return idx;
    // (rare: a gather of the guesses' corrections; base[r] + floor(f) as f lies near a midpoint)
    const __m512i g = _mm512_min_epi32(_mm512_cvttps_epi32(fb), last);
    const __mmask16 up = _mm512_cmp_ps_mask(a, _mm512_mask_i32gather_ps(a, near, g, t.up_to, 4), _CMP_GT_OQ);
    return _mm512_mask_mov_epi32(idx, near, _mm512_mask_add_epi32(g, up, g, _mm512_set1_epi32(1)));
  }

  // the codes of x (16 values) in a block of absmax `absmax`, as 32-bit lanes (`up_to` read by
  // the fp8 formats)
  template <bool kNonnegative>
  __m512i encode(__m512 x, __m512 absmax, const RegTable& up_to) const {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
    // (0 in a block stored as zeros: its absmax is 0)
    __m512 a = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(absmax, zero, _CMP_NEQ_UQ), _mm512_abs_ps(x), absmax);
    if constexpr (kNonnegative) a = _mm512_mask_mov_ps(a, negative, zero);
    const __mmask16 positive = _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ);  // not 0, not NaN
    const __m512 s = _mm512_min_ps(_mm512_max_ps(a, zero), _mm512_set1_ps(1.0f));  // NaN: 0
    __m512i idx;
    if constexpr (kFp8) {
      const __m512i g = fp8_guess(s);
      const __mmask16 up = _mm512_cmp_ps_mask(a, up_to(g), _CMP_GT_OQ);
      idx = _mm512_maskz_mov_epi32(positive, _mm512_mask_add_epi32(g, up, g, _mm512_set1_epi32(1)));
    } else {
      // (index 0 up to up_to[0], which the even split of region 0 does not give)
      const __mmask16 above = _mm512_cmp_ps_mask(a, _mm512_set1_ps(t.up_to[0]), _CMP_GT_OQ);
      idx = _mm512_maskz_mov_epi32(above, dynamic_index(s, a));
    }
    if constexpr (kNonnegative) idx = _mm512_mask_max_epi32(idx, positive, idx, _mm512_set1_epi32(1));
    if constexpr (kSigned) {
      const __mmask16 set = negative & _mm512_test_epi32_mask(idx, idx);
      idx = _mm512_mask_or_epi32(idx, set, idx, _mm512_set1_epi32(0x80));
    }
    return idx;
  }
};

// The lanes of the 16 from element e that lie before n.
inline __mmask16 lanes_from(int64_t e, int64_t n) {
  return e + 16 <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - e)) - 1);
}

template <QuantFormat F, bool kNonnegative>
void encode_blocks_as(const float* x, int64_t n, const float* absmax, const QuantTable& t, uint8_t* out) {
  const Codec16<F> codec(t);
  const RegTable up_to(t.up_to);  // (read by the fp8 formats, whose indices have 7 bits)
  // 64 values a store: their codes packed (codes lie in [0, 255], so the saturations keep them)
  // and put back in order, each 128-bit lane having packed 4 codes of each 16
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  int64_t e = 0;
  for (; e + 64 <= n; e += 64) {
    __m512i c[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 m = _mm512_set1_ps(absmax[(e + 16 * j) / kQuantBlock]);
      c[j] = codec.template encode<kNonnegative>(_mm512_loadu_ps(x + e + 16 * j), m, up_to);
    }
    const __m512i bytes =
        _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
    _mm512_storeu_si512(out + e, _mm512_permutexvar_epi32(order, bytes));
  }
  for (; e < n; e += 16) {
    const __mmask16 k = lanes_from(e, n);
    const __m512 m = _mm512_set1_ps(absmax[e / kQuantBlock]);
    const __m512i c = codec.template encode<kNonnegative>(_mm512_maskz_loadu_ps(k, x + e), m, up_to);
    _mm512_mask_cvtepi32_storeu_epi8(out + e, k, c);
  }
}

// The entries' bits as two 16-bit halves (low, high), each a table of 64 words per register
// pair: a decode reads 32 codes at once with word permutes, then interleaves the halves.
template <QuantFormat F>
void decode_blocks_as(const uint8_t* codes, int64_t n, const float* absmax, const QuantTable& t, float* out) {
  constexpr bool kSigned = F != QuantFormat::Dynamic8Unsigned;
  constexpr int kRegs = kSigned ? 4 : 8;  // per half: a signed code's magnitude index has 7 bits
  __m512i half[2][kRegs];
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < kRegs; ++j) half[h][j] = _mm512_load_si512(t.entry_half[h] + 32 * j);
  }
  // float i of the 32 is words (low[i], high[i])
  const __m512i first = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                          0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                          0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t e = 0; e < n; e += 32) {
    const __mmask32 k = e + 32 <= n ? ~__mmask32(0) : (__mmask32(1) << (n - e)) - 1;
    const __m256i bytes = _mm256_maskz_loadu_epi8(k, codes + e);
    const __m512i c = _mm512_cvtepu8_epi16(bytes);
    // (the permutes read an index's low 6 bits; bits 6 and 7 pick the register pair)
    const __mmask32 bit6 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(64));
    const __mmask32 bit7 = kSigned ? 0 : _mm512_test_epi16_mask(c, _mm512_set1_epi16(128));
    __m512i w[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i* r = half[h];
      w[h] = _mm512_mask_blend_epi16(bit6, _mm512_permutex2var_epi16(r[0], c, r[1]),
                                     _mm512_permutex2var_epi16(r[2], c, r[3]));
      if constexpr (!kSigned) {
        const __m512i upper = _mm512_mask_blend_epi16(bit6, _mm512_permutex2var_epi16(r[4], c, r[5]),
                                                      _mm512_permutex2var_epi16(r[6], c, r[7]));
        w[h] = _mm512_mask_blend_epi16(bit7, w[h], upper);
      }
    }
    static_assert(kQuantBlock % 32 == 0, "the 32 codes of a step share their block");
    const __m512 m = _mm512_set1_ps(absmax[e / kQuantBlock]);
    __m512 v0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_permutex2var_epi16(w[0], first, w[1])), m);
    __m512 v1 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_permutex2var_epi16(w[0], second, w[1])), m);
    if constexpr (kSigned) {
      const __mmask32 negative = _mm256_movepi8_mask(bytes);
      const __m512 sign = _mm512_set1_ps(-0.0f);
      v0 = _mm512_mask_xor_ps(v0, __mmask16(negative), v0, sign);
      v1 = _mm512_mask_xor_ps(v1, __mmask16(negative >> 16), v1, sign);
    }
    _mm512_mask_storeu_ps(out + e, __mmask16(k), v0);
    _mm512_mask_storeu_ps(out + e + 16, __mmask16(k >> 16), v1);
  }
}

#else

// Branch-free, 32-bit lanes throughout (the bytes narrowed after), so that the compiler
// vectorises the loops (table reads become gathers).
template <QuantFormat F, bool kNonnegative>
void encode_block_as(const float* __restrict x, int64_t n, float absmax, const QuantTable& __restrict t,
                     uint8_t* __restrict out) {
  constexpr bool kSigned = F != QuantFormat::Dynamic8Unsigned;
  int32_t code[kQuantBlock];
  for (int64_t e = 0; e < n; ++e) {
    const float v = x[e];
    const float q = absmax == 0.0f ? 0.0f : std::fabs(v) / absmax;  // 0: a block stored as zeros
    const float a = (kNonnegative && v < 0.0f) ? 0.0f : q;
    const bool positive = a > 0.0f;  // not 0, not NaN
    const float s = positive ? std::min(a, 1.0f) : 0.0f;
    const int32_t g = quant_guess(t, F, s);
    int32_t idx = positive ? g + static_cast<int32_t>(a > t.up_to[g]) : 0;
    idx = (kNonnegative && idx == 0 && positive) ? 1 : idx;
    code[e] = idx | ((kSigned && v < 0.0f && idx != 0) ? 0x80 : 0);
  }
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<uint8_t>(code[e]);
}

template <QuantFormat F, bool kNonnegative>
void encode_blocks_as(const float* x, int64_t n, const float* absmax, const QuantTable& t, uint8_t* out) {
  for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
    encode_block_as<F, kNonnegative>(x + b0, std::min(kQuantBlock, n - b0), absmax[b0 / kQuantBlock], t,
                                     out + b0);
  }
}

// (a gather per value; the sign applied as a bit)
template <QuantFormat F>
void decode_blocks_as(const uint8_t* codes, int64_t n, const float* absmax, const QuantTable& t, float* out) {
  constexpr bool kSigned = F != QuantFormat::Dynamic8Unsigned;
  for (int64_t e = 0; e < n; ++e) {
    const uint32_t c = codes[e];
    const float v = t.entries[kSigned ? (c & 0x7Fu) : c] * absmax[e / kQuantBlock];
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    b ^= kSigned ? (c & 0x80u) << 24 : 0u;
    std::memcpy(out + e, &b, sizeof b);
  }
}

#endif

// quant_encode of a run of unmarked blocks (x[0, n) from a block's start, block b of absmax
// absmax[b]).
inline void encode_blocks_unmarked(const float* x, int64_t n, const float* absmax, const QuantTable& t,
                                   QuantFormat f, bool nonnegative, uint8_t* out) {
  using Q = QuantFormat;
  switch (f) {
    case Q::Dynamic8Signed:
      return nonnegative ? encode_blocks_as<Q::Dynamic8Signed, true>(x, n, absmax, t, out)
                         : encode_blocks_as<Q::Dynamic8Signed, false>(x, n, absmax, t, out);
    case Q::Dynamic8Unsigned:
      return nonnegative ? encode_blocks_as<Q::Dynamic8Unsigned, true>(x, n, absmax, t, out)
                         : encode_blocks_as<Q::Dynamic8Unsigned, false>(x, n, absmax, t, out);
    case Q::E4M3:
      return nonnegative ? encode_blocks_as<Q::E4M3, true>(x, n, absmax, t, out)
                         : encode_blocks_as<Q::E4M3, false>(x, n, absmax, t, out);
    case Q::E5M2:
      return nonnegative ? encode_blocks_as<Q::E5M2, true>(x, n, absmax, t, out)
                         : encode_blocks_as<Q::E5M2, false>(x, n, absmax, t, out);
  }
}

// quant_decode of the codes of a run of unmarked blocks, as encode_blocks_unmarked.
inline void decode_blocks_unmarked(const uint8_t* codes, int64_t n, const float* absmax, const QuantTable& t,
                                   QuantFormat f, float* out) {
  using Q = QuantFormat;
  switch (f) {
    case Q::Dynamic8Signed: return decode_blocks_as<Q::Dynamic8Signed>(codes, n, absmax, t, out);
    case Q::Dynamic8Unsigned: return decode_blocks_as<Q::Dynamic8Unsigned>(codes, n, absmax, t, out);
    case Q::E4M3: return decode_blocks_as<Q::E4M3>(codes, n, absmax, t, out);
    case Q::E5M2: return decode_blocks_as<Q::E5M2>(codes, n, absmax, t, out);
  }
}

// fn(first element, elements) over the runs of unmarked blocks of a run of blocks, and
// marked(first element, elements, absmax) over each marked block.
template <class Unmarked, class Marked>
void split_at_marks(int64_t n, const float* absmax, const Unmarked& unmarked, const Marked& marked) {
  int64_t run = 0;
  for (int64_t b0 = 0; b0 < n; b0 += kQuantBlock) {
    const float m = absmax[b0 / kQuantBlock];
    if (!marked_block(m)) continue;
    if (b0 > run) unmarked(run, b0 - run);
    marked(b0, std::min(kQuantBlock, n - b0), m);
    run = b0 + kQuantBlock;
  }
  if (run < n) unmarked(run, n - run);
}

// quant_encode (ops/rules.h) of x[0, n), a run of blocks from a block's start, block b of absmax
// absmax[b]: the vector code over unmarked blocks, the rule itself over marked ones.
inline void encode_blocks_cpu(const float* x, int64_t n, const float* absmax, const QuantTable& t,
                              QuantFormat f, bool nonnegative, uint8_t* out) {
  split_at_marks(
      n, absmax,
      [&](int64_t e, int64_t len) {
        encode_blocks_unmarked(x + e, len, absmax + e / kQuantBlock, t, f, nonnegative, out + e);
      },
      [&](int64_t e, int64_t len, float m) { encode_marked_cpu(x + e, len, m, t, f, nonnegative, out + e); });
}

// quant_decode (ops/rules.h) of the codes of a run of blocks, as encode_blocks_cpu.
inline void decode_blocks_cpu(const uint8_t* codes, int64_t n, const float* absmax, const QuantTable& t,
                              QuantFormat f, float* out) {
  split_at_marks(
      n, absmax,
      [&](int64_t e, int64_t len) { decode_blocks_unmarked(codes + e, len, absmax + e / kQuantBlock, t, f, out + e); },
      [&](int64_t e, int64_t len, float m) { decode_marked_cpu(codes + e, len, m, t, f, out + e); });
}

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
