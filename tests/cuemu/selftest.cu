// Self-test of the cuemu shim: CUDA semantics of the primitives the ampfuse kernels use, and the
// errors the emulator must report. Compiled like the project's .cu files (g++ -x c++ -include
// cuemu/cuemu.h). Also uses the project's real block_reduce (multi_tensor_apply.cuh).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/multi_tensor_apply.cuh"

static int g_pass = 0, g_fail = 0;
#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (cond) {                                                   \
      ++g_pass;                                                   \
    } else {                                                      \
      ++g_fail;                                                   \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                   \
      std::printf("\n");                                          \
    }                                                             \
  } while (0)

static std::string diag() { return cuemu_take_diagnostics(); }

// ---- shuffles, lane-level -------------------------------------------------------------------------
__global__ void shfl_kernel(int* down, int* up, int* xr, int* idx, int* down16, int width) {
  const int t = threadIdx.x;
  down[t] = __shfl_down_sync(0xffffffffu, t, 5);
  up[t] = __shfl_up_sync(0xffffffffu, t, 3);
  xr[t] = __shfl_xor_sync(0xffffffffu, t, 9);
  idx[t] = __shfl_sync(0xffffffffu, t, (t * 7) & 31);
  down16[t] = __shfl_down_sync(0xffffffffu, t, 4, width);
}

static void test_shuffles() {
  std::vector<int> d(64), u(64), x(64), i(64), d16(64);
  CUEMU_LAUNCH(1, 64, 0, nullptr, shfl_kernel)(d.data(), u.data(), x.data(), i.data(), d16.data(), 16);
  CHECK(cudaGetLastError() == cudaSuccess, "launch");
  int bad = 0;
  for (int t = 0; t < 64; ++t) {
    const int l = t & 31, w = t & ~31;
    bad += d[t] != (l + 5 < 32 ? t + 5 : t);
    bad += u[t] != (l >= 3 ? t - 3 : t);
    bad += x[t] != w + (l ^ 9);
    bad += i[t] != w + ((t * 7) & 31);
    bad += d16[t] != ((l & 15) + 4 < 16 ? t + 4 : t);
  }
  CHECK(bad == 0, "%d lane results differ from CUDA's shuffle rules", bad);
}

// ---- ballot / any / all / syncthreads_count ------------------------------------------------------
__global__ void vote_kernel(unsigned* ballot, int* any, int* all, int* count) {
  const int t = threadIdx.x;
  ballot[t] = __ballot_sync(0xffffffffu, t % 3 == 0);
  any[t] = __any_sync(0xffffffffu, t == 40);
  all[t] = __all_sync(0xffffffffu, t < 32);
  count[t] = __syncthreads_count(t % 5 == 0);
}

static void test_votes() {
  std::vector<unsigned> b(64);
  std::vector<int> a(64), l(64), c(64);
  CUEMU_LAUNCH(1, 64, 0, nullptr, vote_kernel)(b.data(), a.data(), l.data(), c.data());
  CHECK(cudaGetLastError() == cudaSuccess, "launch");
  int bad = 0;
  for (int t = 0; t < 64; ++t) {
    unsigned want = 0;
    for (int k = 0; k < 32; ++k) want |= ((t & ~31) + k) % 3 == 0 ? 1u << k : 0u;
    bad += b[t] != want;
    bad += a[t] != (t >= 32);
    bad += l[t] != (t < 32);
    bad += c[t] != 13;
  }
  CHECK(bad == 0, "%d vote results wrong", bad);
}

// ---- the project's block_reduce (sum and NaN-propagating max), several blocks ------------------
__global__ void block_reduce_kernel(const float* in, float* sums, float* maxes) {
  __shared__ float shared[ampfuse::cuda::kBlockSize / 32];
  const float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  const float s = ampfuse::cuda::block_reduce<false>(v, shared);
  const float m = ampfuse::cuda::block_reduce<true>(v, shared);
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s;
    maxes[blockIdx.x] = m;
  }
}

static void test_block_reduce() {
  const int B = 5, T = ampfuse::cuda::kBlockSize;
  std::vector<float> in(B * T), s(B), m(B);
  for (int i = 0; i < B * T; ++i) in[i] = static_cast<float>((i * 37) % 101) - 50.0f;
  in[3 * T + 77] = NAN;  // block 3: max must be NaN
  CUEMU_LAUNCH(B, T, 0, nullptr, block_reduce_kernel)(in.data(), s.data(), m.data());
  CHECK(cudaGetLastError() == cudaSuccess, "launch");
  for (int b = 0; b < B; ++b) {
    double ws = 0;
    float wm = -INFINITY;
    for (int t = 0; t < T; ++t) {
      ws += in[b * T + t];
      wm = std::max(wm, in[b * T + t]);
    }
    if (b == 3) {
      CHECK(std::isnan(m[b]), "block %d max %g, want NaN", b, m[b]);
      CHECK(std::isnan(s[b]), "block %d sum %g, want NaN", b, s[b]);
    } else {
      CHECK(s[b] == static_cast<float>(ws), "block %d sum %g want %g", b, s[b], ws);
      CHECK(m[b] == wm, "block %d max %g want %g", b, m[b], wm);
    }
  }
}

// ---- shared memory is per block, barriers order it -----------------------------------------------
__global__ void shared_kernel(int* out) {
  __shared__ int s[128];
  s[threadIdx.x] = blockIdx.x * 1000 + threadIdx.x;
  __syncthreads();
  out[blockIdx.x * 128 + threadIdx.x] = s[127 - threadIdx.x];
}

// Missing barrier: the result depends on the order threads run in.
__global__ void racy_kernel(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x;
  out[threadIdx.x] = s[(threadIdx.x + 1) & 63];  // no __syncthreads: a race
  __syncthreads();
}

static void test_shared_and_race() {
  std::vector<int> out(3 * 128);
  cuemu_configure("random", "random", 7, 2);
  CUEMU_LAUNCH(3, 128, 0, nullptr, shared_kernel)(out.data());
  CHECK(cudaGetLastError() == cudaSuccess, "launch");
  int bad = 0;
  for (int b = 0; b < 3; ++b)
    for (int t = 0; t < 128; ++t) bad += out[b * 128 + t] != b * 1000 + 127 - t;
  CHECK(bad == 0, "%d shared-memory values wrong (blocks on 2 workers, random orders)", bad);

  std::vector<int> fwd(64, -1), rev(64, -1);
  cuemu_configure("forward", "forward", 1, 1);
  CUEMU_LAUNCH(1, 64, 0, nullptr, racy_kernel)(fwd.data());
  cuemu_configure("forward", "reverse", 1, 1);
  CUEMU_LAUNCH(1, 64, 0, nullptr, racy_kernel)(rev.data());
  cuemu_configure("forward", "forward", 1, 1);
  CHECK(fwd != rev, "a missing __syncthreads should change results between thread orders");
  diag();
}

// ---- atomics and the last-block-done pattern ------------------------------------------------------
__global__ void last_block_kernel(unsigned* counter, float* partials, float* total, unsigned* inc) {
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = static_cast<float>(blockIdx.x + 1);
    __threadfence();
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  atomicInc(inc, 9u);  // wraps to 0 after 9
  __syncthreads();
  if (is_last && threadIdx.x == 0) {
    float s = 0;
    for (unsigned i = 0; i < gridDim.x; ++i) s += __ldcg(partials + i);
    *total = s;
    *counter = 0;
  }
}

static void test_last_block() {
  const char* orders[] = {"forward", "reverse", "random"};
  for (int workers = 1; workers <= 2; ++workers) {
    for (const char* o : orders) {
      cuemu_configure(o, "random", 11, workers);
      unsigned counter = 0, inc = 0;
      std::vector<float> partials(37);
      float total = -1;
      CUEMU_LAUNCH(37, 64, 0, nullptr, last_block_kernel)(&counter, partials.data(), &total, &inc);
      CHECK(cudaGetLastError() == cudaSuccess, "launch");
      CHECK(total == 37.0f * 38.0f / 2.0f && counter == 0, "order %s workers %d: total %g counter %u",
            o, workers, total, counter);
      CHECK(inc == (37u * 64u) % 10u, "atomicInc wrap: %u", inc);
    }
  }
  cuemu_configure("forward", "forward", 1, 1);
}

// ---- errors the emulator must report --------------------------------------------------------------
__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    out[threadIdx.x] = 1;
    __syncthreads();
  }
}
__global__ void exited_barrier_kernel(int* out, int n) {
  if (static_cast<int>(threadIdx.x) >= n) return;  // classic bug: early exit before a barrier
  out[threadIdx.x] = 1;
  __syncthreads();
}
__global__ void partial_warp_shfl_kernel(float* out) {
  float v = threadIdx.x;
  if ((threadIdx.x & 31) < 16) v += __shfl_down_sync(0xffffffffu, v, 1);  // mask names lanes 16..31
  out[threadIdx.x] = v;
}
__global__ void inactive_source_kernel(float* out) {
  float v = threadIdx.x;
  if ((threadIdx.x & 31) < 16) v += __shfl_down_sync(0x0000ffffu, v, 8);  // lanes 8..15 read 16..23
  out[threadIdx.x] = v;
}
__global__ void deadlock_kernel(int* out) {
  if (threadIdx.x == 0) {
    out[0] = __shfl_sync(0x3u, 1, 0);  // lane 1 never calls it
  } else {
    __syncthreads();
  }
}

static void expect_error(const char* what, const char* needle) {
  const cudaError_t e = cudaGetLastError();
  const std::string d = diag();
  CHECK(e == cudaErrorLaunchFailure, "%s: cudaGetLastError() = %d, want cudaErrorLaunchFailure", what, e);
  CHECK(d.find(needle) != std::string::npos, "%s: diagnostic lacks '%s': %s", what, needle, d.c_str());
}

static void test_errors() {
  std::printf("expected below: five kernel errors reported by the emulator\n");
  std::fflush(stdout);
  std::vector<int> out(256);
  std::vector<float> fout(64);
  CUEMU_LAUNCH(1, 64, 0, nullptr, divergent_barrier_kernel)(out.data());
  expect_error("divergent barrier", "divergent __syncthreads");
  CUEMU_LAUNCH(1, 64, 0, nullptr, exited_barrier_kernel)(out.data(), 40);
  expect_error("exited threads at barrier", "have exited");
  CUEMU_LAUNCH(1, 64, 0, nullptr, partial_warp_shfl_kernel)(fout.data());
  expect_error("partial warp in full-mask shuffle", "exited");
  CUEMU_LAUNCH(1, 64, 0, nullptr, inactive_source_kernel)(fout.data());
  expect_error("source lane outside mask", "not in the mask");
  CUEMU_LAUNCH(1, 64, 0, nullptr, deadlock_kernel)(out.data());
  expect_error("deadlock", "deadlock");
  // launch configuration errors, as a GPU reports them
  CUEMU_LAUNCH(1, 2048, 0, nullptr, shared_kernel)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "block of 2048 threads accepted");
  CUEMU_LAUNCH(0, 64, 0, nullptr, shared_kernel)(out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "empty grid accepted");
  // after errors, a good launch works again
  CUEMU_LAUNCH(1, 128, 0, nullptr, shared_kernel)(out.data());
  CHECK(cudaGetLastError() == cudaSuccess && out[0] == 127, "recovery after errors");
}

int main() {
  test_shuffles();
  test_votes();
  test_block_reduce();
  test_shared_and_race();
  test_last_block();
  test_errors();
  unsigned long long l, b, s;
  cuemu_stats(&l, &b, &s);
  std::printf("launches %llu, blocks %llu, fiber switches %llu\n", l, b, s);
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail == 0 ? 0 : 1;
}
