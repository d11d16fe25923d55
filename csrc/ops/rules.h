// Scalar rules shared verbatim by the CPU kernels and the CUDA kernels, so that both backends
// follow the same contract (no torch headers: nvcc parses this file).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define AMPFUSE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define AMPFUSE_HOST_DEVICE inline
#endif

namespace ampfuse {

// Norm selector passed to kernels.
enum class NormKind : int { None = 0, L2 = 1, Inf = 2 };

// Layout of the optional int64 `stats` tensor written by update_scale_.
enum ScaleStat : int {
  kStatUpdates = 0,    // number of update_scale_ calls
  kStatOverflows = 1,  // calls that saw found_inf != 0 (skipped optimizer steps)
  kStatBackoffs = 2,   // overflows that actually reduced the scale (hysteresis exhausted)
  kStatFloorHits = 3,  // backoffs that were clamped at the floor (min_scale or FLT_MIN)
  kNumScaleStats = 4,
};

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
  if (stats) stats[kStatUpdates] += 1;
  if (found_inf != 0.0f) {
    *growth_tracker = 0;
    if (stats) stats[kStatOverflows] += 1;
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
        stats[kStatBackoffs] += 1;
        if (clamped) stats[kStatFloorHits] += 1;
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

// Clip coefficient exactly as torch.nn.utils.clip_grad_norm_ computes it in fp32:
// clamp(max_norm * (1 / (norm + 1e-6)), max=1), NaN propagating.
AMPFUSE_HOST_DEVICE float clip_coefficient(float norm, float max_norm) {
  float coef = (1.0f / (norm + 1e-6f)) * max_norm;
  return coef > 1.0f ? 1.0f : coef;
}

}  // namespace ampfuse
