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

}  // namespace CPU_CAPABILITY
}  // namespace ampfuse::cpu
