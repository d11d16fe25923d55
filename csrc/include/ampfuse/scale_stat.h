// The counters of the loss scale rule, by their index in the int64 `stats` tensor that
// update_scale_ writes and GradScaler keeps. Defined here only: the kernels' rule
// (csrc/ops/rules.h), the C++ API and Python's ampfuse.ops.ScaleStat (through the op
// scale_stat_names) all read this list. Plain C++: the CUDA kernels include it too.
#pragma once

#include <cstdint>

namespace ampfuse {

enum class ScaleStat : int64_t {
  kUpdates = 0,    // update_scale_ calls (GradScaler: update() calls that ran the scale rule)
  kOverflows = 1,  // of those, calls that saw found_inf != 0 (iterations whose steps were skipped)
  kBackoffs = 2,   // overflows that reduced the scale (hysteresis exhausted)
  kFloorHits = 3,  // backoffs clamped at the floor (min_scale, or the smallest normal float)
};
inline constexpr int64_t kNumScaleStats = 4;

// Python's names for them (ampfuse.ops.ScaleStat), in index order.
inline constexpr const char* kScaleStatNames[kNumScaleStats] = {"UPDATES", "OVERFLOWS",
                                                                "BACKOFFS", "FLOOR_HITS"};

}  // namespace ampfuse
