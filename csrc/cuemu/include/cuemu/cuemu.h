// cuemu: ampfuse's CUDA emulator. It runs the unchanged kernels of csrc/cuda/*.cu on the CPU, so
// that the test suites exercise the CUDA kernel code on machines without a GPU.
//
// The test build compiles the .cu files as host C++ with this header force-included
// (-include cuemu/cuemu.h); it must come before any CUDA header: crt/host_defines.h keeps keyword
// definitions that already exist, which is how __shared__ gets per-block storage here. Only the
// CUDA runtime's host declarations and the fp16/bf16 headers of the toolkit are used; the runtime
// calls the launchers make are implemented in runtime.cpp on host memory.
//
// Execution model
//   * A launch runs its grid block by block (CUEMU_BLOCK_ORDER, CUEMU_WORKERS); each block's
//     threads are user-level fibers on ONE OS thread, switched only at __syncthreads and warp
//     collectives (__shfl_*_sync, __ballot_sync, __syncwarp, ...), so code between two sync points
//     runs thread after thread (CUEMU_THREAD_ORDER).
//   * __shared__ is `static thread_local`: one instance per OS thread, i.e. per running block.
//     Declared through CUEMU_SHARED (the kernels' AMPFUSE_SHARED), it is filled with 0xFF bytes
//     (NaN, -1, an invalid bool) each time a block first reaches the declaration, as a GPU hands a
//     block whatever the previous one left: a read of a slot no thread of the block wrote shows.
//   * Barriers and warp collectives are identified by their dynamic call site: the source line
//     and the chain of return addresses on the thread's fiber stack (kernels are compiled with
//     frame pointers), so a barrier inside a helper reached from two branches is divergent.
//   * Release fences: __stcg/__ldcg (the accesses other blocks' code relies on) count as unfenced
//     until the thread's next __threadfence(); an atomic by a thread with unfenced accesses is
//     reported (the release fence before a last-block ticket is missing).
//   * Warp size 32; collectives compute their results when the last lane named in the mask
//     arrives; a lane outside the mask, a source lane outside the mask, lanes at different call
//     sites, a barrier reached from different sites or with exited threads, and deadlocks are
//     reported as kernel errors (cudaErrorLaunchFailure from cudaGetLastError / sync calls).
//   * "Device" pointers are host pointers; cudaMalloc/cudaMemsetAsync/... work on host memory.
#pragma once

#if defined(__CUDACC__)
#error "cuemu.h is for host compilers; do not use it under nvcc"
#endif

#define CUEMU 1

// ---- CUDA keywords (defined before crt/host_defines.h, which keeps existing definitions) ------
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __constant__
#define __managed__
#define __grid_constant__
#define __launch_bounds__(...)

#include <cuda_runtime.h>  // host API declarations, vector types, dim3 (no device code on host)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#if !defined(__forceinline__)
#define __forceinline__ inline __attribute__((always_inline))
#endif

// ---- built-in variables -------------------------------------------------------------------------
// This thread's __stcg/__ldcg accesses since its last __threadfence (saved and restored per fiber).
extern __thread unsigned cuemu_unfenced;

// Set by the scheduler before it resumes a fiber (a block never leaves its OS thread).
extern __thread uint3 threadIdx;
extern __thread uint3 blockIdx;
extern __thread uint3 blockDim;
extern __thread uint3 gridDim;
inline constexpr int warpSize = 32;

namespace cuemu {

// ---- runtime entry points (cuemu_runtime.cpp) ---------------------------------------------------
using EntryFn = void (*)(void*);
void run_grid(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, EntryFn entry, void* arg,
              const char* kernel_name);
// kind 0: count, 1: and, 2: or, 3: plain barrier. `site` is "file:line".
int syncthreads_op(int pred, int kind, const char* site);
enum CollOp : int { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp };
// One warp collective: publishes `bits` (or predicate) and returns the lane's result bits.
uint64_t warp_collective(CollOp op, unsigned mask, uint64_t bits, int arg, int width,
                         const char* site);
void report_error(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// Called by every thread that reaches a CUEMU_SHARED declaration: the first of each block fills
// the variable with 0xFF bytes.
void block_shared(void* p, size_t bytes);
// An atomic (`what`) by a thread whose __stcg/__ldcg accesses were not followed by a __threadfence.
void unfenced_atomic(const char* what);

// ---- launch -------------------------------------------------------------------------------------
// Total parameter bytes as nvcc lays them out (each parameter at its alignment).
template <class... P>
constexpr size_t param_bytes() {
  size_t off = 0;
  ((off = (off + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return off;
}

template <class P, class A>
P implicit_convert(A&& a) {  // copy-initialisation: the conversions a call would allow
  return std::forward<A>(a);
}

template <class... P>
struct KernelCall {
  void (*fn)(P...);
  std::tuple<std::decay_t<P>...> params;  // converted once, as CUDA fills the parameter space
  // Each thread gets its own by-value copies of the parameters, as a call would.
  static void entry(void* self) {
    auto* k = static_cast<KernelCall*>(self);
    std::apply(k->fn, k->params);
  }
};

struct LaunchConfig {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;

  template <class... P>
  struct Bound {
    const LaunchConfig& cfg;
    void (*fn)(P...);
    const char* name;
    template <class... A>
    void operator()(A&&... args) const {
      static_assert(sizeof...(A) == sizeof...(P), "wrong number of kernel arguments");
      // CUDA >= 12.1 on Volta+ accepts 32764 bytes of parameters; nvcc rejects more.
      static_assert(param_bytes<std::decay_t<P>...>() <= 32764,
                    "kernel parameters exceed 32764 bytes");
      KernelCall<P...> call{fn, {implicit_convert<std::decay_t<P>>(std::forward<A>(args))...}};
      run_grid(cfg.grid, cfg.block, cfg.smem, cfg.stream, &KernelCall<P...>::entry, &call, name);
    }
  };
  template <class... P>
  Bound<P...> kernel(void (*fn)(P...), const char* name = "kernel") const {
    return Bound<P...>{*this, fn, name};
  }
};

inline LaunchConfig launch_config(dim3 grid, dim3 block, size_t smem = 0,
                                  cudaStream_t stream = nullptr) {
  return LaunchConfig{grid, block, smem, stream};
}

template <class T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type > 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace cuemu

// `CUEMU_LAUNCH(grid, block, smem, stream, kernel...)(args...)`: the emulator's spelling of
// `kernel<<<grid, block, smem, stream>>>(args...)`.
#define CUEMU_LAUNCH(grid, block, smem, stream, ...) \
  ::cuemu::launch_config(grid, block, smem, stream).kernel(__VA_ARGS__, #__VA_ARGS__)

// `CUEMU_SHARED(float, slots, [8]);`: the emulator's spelling of `__shared__ float slots[8];`,
// poisoned per block (see above). A plain `__shared__` variable works too, unpoisoned.
#define CUEMU_SHARED(type, name, ...)       \
  static thread_local type name __VA_ARGS__; \
  ::cuemu::block_shared(&name, sizeof(name))

// ---- synchronisation and warp collectives -------------------------------------------------------
// Function-like macros, so that every call site passes its own source location: the emulator
// checks that all threads of a barrier / all lanes of a collective wait at the same site (the host
// compiler may merge identical calls, so return addresses would not tell sites apart). The
// runtime call is external, hence a compiler barrier.
#define CUEMU_XSTR_(x) #x
#define CUEMU_XSTR(x) CUEMU_XSTR_(x)
#define CUEMU_SITE (__FILE__ ":" CUEMU_XSTR(__LINE__))

#define __syncthreads() ::cuemu::syncthreads_op(0, 3, CUEMU_SITE)
#define __syncthreads_count(p) ::cuemu::syncthreads_op((p), 0, CUEMU_SITE)
#define __syncthreads_and(p) ::cuemu::syncthreads_op((p), 1, CUEMU_SITE)
#define __syncthreads_or(p) ::cuemu::syncthreads_op((p), 2, CUEMU_SITE)
#define __syncwarp(...) ::cuemu::syncwarp(CUEMU_SITE, ##__VA_ARGS__)
#define __shfl_sync(...) ::cuemu::shfl<::cuemu::kShflIdx>(CUEMU_SITE, __VA_ARGS__)
#define __shfl_up_sync(...) ::cuemu::shfl<::cuemu::kShflUp>(CUEMU_SITE, __VA_ARGS__)
#define __shfl_down_sync(...) ::cuemu::shfl<::cuemu::kShflDown>(CUEMU_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cuemu::shfl<::cuemu::kShflXor>(CUEMU_SITE, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
  static_cast<unsigned>(::cuemu::warp_collective(::cuemu::kBallot, (mask), (pred) != 0, 0, 32, CUEMU_SITE))
#define __any_sync(mask, pred) \
  static_cast<int>(::cuemu::warp_collective(::cuemu::kAny, (mask), (pred) != 0, 0, 32, CUEMU_SITE))
#define __all_sync(mask, pred) \
  static_cast<int>(::cuemu::warp_collective(::cuemu::kAll, (mask), (pred) != 0, 0, 32, CUEMU_SITE))

namespace cuemu {
template <int OP, class T>
inline T shfl(const char* site, unsigned mask, T var, int a, int width = warpSize) {
  return from_bits<T>(warp_collective(static_cast<CollOp>(OP), mask, to_bits(var), a, width, site));
}
inline void syncwarp(const char* site, unsigned mask = 0xffffffffu) {
  warp_collective(kSyncWarp, mask, 0, 0, 32, site);
}
}  // namespace cuemu

inline void __threadfence() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  cuemu_unfenced = 0;
}
// Block scope: orders nothing for other blocks, so it releases no __stcg/__ldcg access.
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __threadfence(); }
inline unsigned __activemask() { return 0xffffffffu; }  // fibers run converged code only
inline unsigned __lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1u; }

// ---- atomics (device scope, relaxed, as CUDA's atomic* functions) -------------------------------
// Each checks for unfenced __stcg/__ldcg accesses of the calling thread first (see above).
#define CUEMU_FENCED(what) (cuemu_unfenced ? ::cuemu::unfenced_atomic(what) : void())
#define CUEMU_ATOMIC_INT(T)                                                                        \
  inline T atomicAdd(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicAdd");                                                                    \
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);                                            \
  }                                                                                               \
  inline T atomicSub(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicSub");                                                                    \
    return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED);                                            \
  }                                                                                               \
  inline T atomicAnd(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicAnd");                                                                    \
    return __atomic_fetch_and(p, v, __ATOMIC_RELAXED);                                            \
  }                                                                                               \
  inline T atomicOr(T* p, T v) {                                                                  \
    CUEMU_FENCED("atomicOr");                                                                     \
    return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);                                             \
  }                                                                                               \
  inline T atomicXor(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicXor");                                                                    \
    return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED);                                            \
  }                                                                                               \
  inline T atomicExch(T* p, T v) {                                                                \
    CUEMU_FENCED("atomicExch");                                                                   \
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);                                           \
  }                                                                                               \
  inline T atomicCAS(T* p, T cmp, T v) {                                                          \
    CUEMU_FENCED("atomicCAS");                                                                    \
    __atomic_compare_exchange_n(p, &cmp, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);           \
    return cmp;                                                                                   \
  }                                                                                               \
  inline T atomicMax(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicMax");                                                                    \
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                 \
    while (old < v &&                                                                             \
           !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {  \
    }                                                                                             \
    return old;                                                                                   \
  }                                                                                               \
  inline T atomicMin(T* p, T v) {                                                                 \
    CUEMU_FENCED("atomicMin");                                                                    \
    T old = __atomic_load_n(p, __ATOMIC_RELAXED);                                                 \
    while (old > v &&                                                                             \
           !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {  \
    }                                                                                             \
    return old;                                                                                   \
  }
CUEMU_ATOMIC_INT(int)
CUEMU_ATOMIC_INT(unsigned int)
CUEMU_ATOMIC_INT(unsigned long long)
CUEMU_ATOMIC_INT(long long)
#undef CUEMU_ATOMIC_INT

// ((old >= val) ? 0 : (old + 1)) and (((old == 0) || (old > val)) ? val : (old - 1)).
inline unsigned int atomicInc(unsigned int* p, unsigned int val) {
  CUEMU_FENCED("atomicInc");
  unsigned int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, old >= val ? 0u : old + 1u, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
  return old;
}
inline unsigned int atomicDec(unsigned int* p, unsigned int val) {
  CUEMU_FENCED("atomicDec");
  unsigned int old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, (old == 0u || old > val) ? val : old - 1u, true,
                                      __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <class F>
inline F cuemu_atomic_float_rmw(F* p, F v, int op) {  // op 0: add, 1: max, 2: min, 3: exch
  CUEMU_FENCED(op == 0 ? "atomicAdd" : op == 1 ? "atomicMax" : op == 2 ? "atomicMin" : "atomicExch");
  using U = std::conditional_t<sizeof(F) == 4, uint32_t, uint64_t>;
  U* u = reinterpret_cast<U*>(p);
  U old_bits = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    F old;
    std::memcpy(&old, &old_bits, sizeof(F));
    F nv = op == 0 ? old + v : op == 1 ? (old < v ? v : old) : op == 2 ? (v < old ? v : old) : v;
    U new_bits;
    std::memcpy(&new_bits, &nv, sizeof(F));
    if (__atomic_compare_exchange_n(u, &old_bits, new_bits, true, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED)) {
      return old;
    }
  }
}
inline float atomicAdd(float* p, float v) { return cuemu_atomic_float_rmw(p, v, 0); }
inline double atomicAdd(double* p, double v) { return cuemu_atomic_float_rmw(p, v, 0); }
inline float atomicMax(float* p, float v) { return cuemu_atomic_float_rmw(p, v, 1); }
inline float atomicMin(float* p, float v) { return cuemu_atomic_float_rmw(p, v, 2); }
inline float atomicExch(float* p, float v) { return cuemu_atomic_float_rmw(p, v, 3); }

// ---- cache-hinted loads/stores: plain accesses on the host --------------------------------------
// __ldcg/__stcg (cached in L2 only: how blocks read and publish data for other blocks) count as
// unfenced accesses until the thread's next __threadfence().
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) {
  ++cuemu_unfenced;
  return *p;
}
template <class T> inline T __ldca(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline T __ldcv(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) {
  ++cuemu_unfenced;
  *p = v;
}
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwb(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ---- device math that host headers lack ---------------------------------------------------------
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;

#define CUEMU_MINMAX(R, A, B)                        \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
CUEMU_MINMAX(int, int, int)
CUEMU_MINMAX(unsigned int, unsigned int, unsigned int)
CUEMU_MINMAX(unsigned int, int, unsigned int)
CUEMU_MINMAX(unsigned int, unsigned int, int)
CUEMU_MINMAX(long, long, long)
CUEMU_MINMAX(unsigned long, unsigned long, unsigned long)
CUEMU_MINMAX(unsigned long, long, unsigned long)
CUEMU_MINMAX(unsigned long, unsigned long, long)
CUEMU_MINMAX(long long, long long, long long)
CUEMU_MINMAX(unsigned long long, unsigned long long, unsigned long long)
CUEMU_MINMAX(unsigned long long, long long, unsigned long long)
CUEMU_MINMAX(unsigned long long, unsigned long long, long long)
#undef CUEMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
// Explicitly rounded ops: volatile stops the host compiler from contracting them into an FMA.
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}

// ---- emulator controls and diagnostics, for tests -----------------------------------------------
extern "C" {
// Kernel errors (divergent barrier, bad collective, deadlock) recorded since the last call,
// as text; empty when none. The returned pointer is valid until the next call.
const char* cuemu_take_diagnostics(void);
// Overrides the environment (CUEMU_BLOCK_ORDER, CUEMU_THREAD_ORDER, CUEMU_SEED, CUEMU_WORKERS).
// order: "forward", "reverse" or "random".
void cuemu_configure(const char* block_order, const char* thread_order, unsigned long long seed,
                     int workers);
// Counters since start: launches, blocks, fiber switches.
void cuemu_stats(unsigned long long* launches, unsigned long long* blocks,
                 unsigned long long* switches);
}
