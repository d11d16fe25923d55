// Helpers for the per-capability CPU kernels. Everything here lives in the CPU_CAPABILITY
// namespace: this header is compiled once per capability with different instruction sets, and
// inline code shared between those copies could be merged by the linker across them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/kernels/kernels.h"


namespace ampfuse::cpu {
namespace CPU_CAPABILITY {

using at::vec::Vectorized;
using FVec = Vectorized<float>;

// One unit of parallel work: elements [begin, end) of tensor `tensor`.
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Splits tensors (given by their element counts) into chunks of at most kChunkElements.
template <typename NumelFn>
std::vector<Chunk> make_chunks(int64_t num_tensors, NumelFn numel) {
  std::vector<Chunk> chunks;
  for (int64_t t = 0; t < num_tensors; ++t) {
    const int64_t n = numel(t);
    for (int64_t b = 0; b < n; b += kChunkElements) {
      chunks.push_back({t, b, std::min(n, b + kChunkElements)});
    }
  }
  return chunks;
}

// Runs fn(chunk_index) over all chunks in one parallel region.
template <typename Fn>
void parallel_chunks(const std::vector<Chunk>& chunks, const Fn& fn) {
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) fn(c);
  });
}

// Software prefetch for walks over many small tensors. A tensor's data is one short stream per
// list (param, grad, master, states), each of a few pages; the hardware prefetchers need several
// accesses to find a stream and stop at page ends, so without help every stream of every small
// tensor starts with a run of misses. The kernels request memory kAheadElements ahead of the
// element they work on, past the end of a chunk into the following ones (the next chunk of a
// thread's range is the next in the list).
constexpr int64_t kAheadElements = 512;

// Always inlined: a prefetch has no side effects the compiler can see, so a helper function
// holding nothing but prefetches is found to be const, and a call to it is deleted as dead.
template <int64_t kBytes>
inline __attribute__((always_inline)) void prefetch_bytes(const void* p) {
  for (int64_t off = 0; off < kBytes; off += 64) {
    __builtin_prefetch(static_cast<const char*>(p) + off);
  }
}

// Where the element kAheadElements past element i of chunk c lies when the chunks are walked in
// order: (chunk, element), or chunk -1 past the last chunk (or more than 64 chunks ahead: tensors
// of under 8 elements are not requested).
inline std::pair<int64_t, int64_t> ahead_of(const std::vector<Chunk>& chunks, int64_t c, int64_t i) {
  const auto n = static_cast<int64_t>(chunks.size());
  int64_t j = i + kAheadElements;
  for (int64_t k = c; k < n && k < c + 64; ++k) {
    if (j < chunks[k].end) return {k, j};
    if (k + 1 < n) j = chunks[k + 1].begin + (j - chunks[k].end);
  }
  return {-1, 0};
}

// Loads/stores kLanes elements of T as float vectors (reduced types widen to fp32).
template <typename T>
struct FloatLanes;

// The `n` overloads read the first n < kLanes elements (the other lanes are zero) or write them:
// masked loads and stores where the instruction set has them (a tensor's last elements).
template <>
struct FloatLanes<float> {
  static constexpr int kVecs = 1;
  static constexpr int64_t kLanes = FVec::size();
  static void load(const float* p, FVec* v) { v[0] = FVec::loadu(p); }
  static void store(float* p, const FVec* v) { v[0].store(p); }
  static void load(const float* p, FVec* v, int64_t n) { v[0] = FVec::loadu(p, n); }
  static void store(float* p, const FVec* v, int64_t n) { v[0].store(p, n); }
};

template <typename R>
struct ReducedFloatLanes {
  static constexpr int kVecs = 2;
  static constexpr int64_t kLanes = Vectorized<R>::size();
  static void load(const R* p, FVec* v) { widen(Vectorized<R>::loadu(p), v); }
  static void store(R* p, const FVec* v) { at::vec::convert_from_float<R>(v[0], v[1]).store(p); }
  static void load(const R* p, FVec* v, int64_t n) { widen(Vectorized<R>::loadu(p, n), v); }
  static void store(R* p, const FVec* v, int64_t n) {
    at::vec::convert_from_float<R>(v[0], v[1]).store(p, static_cast<int>(n));
  }

 private:
  static void widen(const Vectorized<R>& x, FVec* v) {
    auto [a, b] = at::vec::convert_to_float<R>(x);
    v[0] = a;
    v[1] = b;
  }
};
template <>
struct FloatLanes<c10::Half> : ReducedFloatLanes<c10::Half> {};
template <>
struct FloatLanes<c10::BFloat16> : ReducedFloatLanes<c10::BFloat16> {};

// Lanes are +0.0 for finite inputs and NaN otherwise: or-accumulate (x - x) and test at the end.
template <typename V>
inline V nonfinite_bits(const V& x) {
  return x - x;
}

template <typename V>
inline bool any_lane_nonzero(const V& v) {
  using S = typename V::value_type;
  S buf[V::size()];
  v.store(buf);
  for (int i = 0; i < V::size(); ++i) {
    if (buf[i] != S(0) || buf[i] != buf[i]) return true;
  }
  return false;
}

// An 8-bit state format's table (ops/rules.h) and, for the encoding, the first index with an
// entry >= a by a's leading 16 bits (sign, exponent, 7 mantissa bits): no two entries share such
// a bucket (the tables' relative spacing is above 2^-7), so the first index of `a` is its
// bucket's plus one where the entry there is still < a. Replaces the binary search's eight
// dependent, unpredictable branches with two loads. Magnitudes below the first bucket lie below
// every positive entry of every format.
// A format's table for the CPU loops: the entries (decoding), and for encoding, per bucket of
// magnitudes a in [0, 1] (the top kBucketBits of a's float bits, from 2^-33; smaller magnitudes
// fall in bucket 0, 1.0 and NaN in the last), the index quant_encode gives the bucket's smallest
// value and the largest value that still gets it: the index is monotone in a, and every bucket
// holds at most one point where it steps up (checked when the table is built), so
// index(a) = low[b] + (a > up_after[b]). Both come from quant_encode (ops/rules.h), the rule the
// CUDA kernels use, so the two agree bit for bit; the loop is two lookups per value.
struct QuantTable {
  static constexpr int kBucketShift = 16;  // buckets of 2^-7 relative width
  static constexpr uint32_t kFirstBucket = 0x2F000000u >> kBucketShift;  // 2^-33
  static constexpr int32_t kBuckets = (0x3F800000u >> kBucketShift) - kFirstBucket + 1;  // up to 1.0
  float entries[256];
  int32_t low[kBuckets];
  float up_after[kBuckets];
};

inline const QuantTable& quant_table(QuantFormat f) {
  static const auto tables = [] {
    std::array<QuantTable, 4> t{};
    for (int k = 0; k < 4; ++k) {
      const auto format = static_cast<QuantFormat>(k);
      const int n = quant_table_size(format);
      QuantTable& q = t[k];
      for (int i = 0; i < 256; ++i) q.entries[i] = i < n ? quant_table_entry(format, i) : 0.0f;
      // the index quant_encode gives magnitude bits `u` (without the sign bit of a signed map)
      auto index_of = [&](uint32_t u) {
        const int c = quant_encode(bits_float(u), 1.0f, q.entries, format, false);
        return format == QuantFormat::Dynamic8Unsigned ? c : c & 0x7F;
      };
      for (int32_t b = 0; b < QuantTable::kBuckets; ++b) {
        const uint32_t first = b == 0 ? 1u : (static_cast<uint32_t>(b) + QuantTable::kFirstBucket) << QuantTable::kBucketShift;
        const uint32_t last = b == QuantTable::kBuckets - 1 ? 0x3F800000u
                                                            : ((static_cast<uint32_t>(b) + QuantTable::kFirstBucket + 1) << QuantTable::kBucketShift) - 1;
        const int lo = index_of(first), hi = index_of(last);
        TORCH_CHECK(hi - lo <= 1, "ampfuse: an 8-bit encoding bucket holds more than one step of format ", k, ".");
        q.low[b] = lo;
        if (hi == lo) {
          q.up_after[b] = bits_float(last);
          continue;
        }
        uint32_t good = first, bad = last;  // index(good) == lo, index(bad) == hi
        while (bad - good > 1) {
          const uint32_t mid = good + (bad - good) / 2;
          (index_of(mid) == lo ? good : bad) = mid;
        }
        q.up_after[b] = bits_float(good);
      }
    }
    return t;
  }();
  return tables[static_cast<int>(f)];
}

// The block absmax of x[0, n) (quant_block_absmax of the largest magnitude; NaN if any is NaN):
// the largest magnitude's bits, as a magnitude's bits order as its value and a NaN's lie above
// inf's. An integer max, so the loop vectorises.
inline float block_absmax_cpu(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t e = 0; e < n; ++e) {
    uint32_t b;
    std::memcpy(&b, x + e, sizeof b);
    m = std::max(m, b & 0x7FFFFFFFu);
  }
  return quant_block_absmax(bits_float(m));
}

// quant_decode (ops/rules.h) of n bytes of a block, written as a loop the compiler vectorises
// (a gather per value; the sign applied as a bit).
template <bool kSigned>
void decode_block_as(const uint8_t* codes, int64_t n, float absmax, const float* entries, float* out) {
  for (int64_t e = 0; e < n; ++e) {
    const uint32_t c = codes[e];
    const float v = entries[kSigned ? (c & 0x7Fu) : c] * absmax;
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    b ^= kSigned ? (c & 0x80u) << 24 : 0u;
    std::memcpy(out + e, &b, sizeof b);
  }
}

inline void decode_block_cpu(const uint8_t* codes, int64_t n, float absmax, const QuantTable& t, QuantFormat f,
                             float* out) {
  if (f == QuantFormat::Dynamic8Unsigned) return decode_block_as<false>(codes, n, absmax, t.entries, out);
  decode_block_as<true>(codes, n, absmax, t.entries, out);
}

// quant_encode (ops/rules.h) of n values of a block of absmax `absmax`, by the bucket table:
// branch-free, 32-bit lanes throughout (the bytes narrowed after), so that GCC vectorises it.
template <bool kSigned, bool kNonnegative>
void encode_block_as(const float* __restrict x, int64_t n, float absmax, const QuantTable& __restrict t,
                     uint8_t* __restrict out) {
  int32_t code[kQuantBlock];
  n = std::min<int64_t>(n, kQuantBlock);
  for (int64_t e = 0; e < n; ++e) {
    const float v = x[e];
    const float q = std::fabs(v) / absmax;
    const float a = (kNonnegative && v < 0.0f) ? 0.0f : q;
    uint32_t bits;
    std::memcpy(&bits, &a, sizeof bits);
    const int32_t b = std::min(std::max(static_cast<int32_t>(bits >> QuantTable::kBucketShift) -
                                            static_cast<int32_t>(QuantTable::kFirstBucket), 0),
                               QuantTable::kBuckets - 1);
    const bool positive = a > 0.0f;  // not 0, not NaN
    int32_t idx = positive ? t.low[b] + static_cast<int32_t>(a > t.up_after[b]) : 0;
    idx = (kNonnegative && idx == 0 && positive) ? 1 : idx;
    code[e] = idx | ((kSigned && v < 0.0f && idx != 0) ? 0x80 : 0);
  }
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<uint8_t>(code[e]);
}

inline void encode_block_cpu(const float* x, int64_t n, float absmax, const QuantTable& t, QuantFormat f,
                             bool nonnegative, uint8_t* out) {
  if (f == QuantFormat::Dynamic8Unsigned) {
    return nonnegative ? encode_block_as<false, true>(x, n, absmax, t, out)
                       : encode_block_as<false, false>(x, n, absmax, t, out);
  }
  return nonnegative ? encode_block_as<true, true>(x, n, absmax, t, out)
                     : encode_block_as<true, false>(x, n, absmax, t, out);
}

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
