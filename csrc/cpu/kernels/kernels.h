// Interface between the CPU dispatcher glue (csrc/cpu/ops_cpu.cpp) and the CPU kernels, which are
// compiled once per CPU capability (DEFAULT, AVX2, AVX512) into namespaces of those names. The
// glue validates arguments and prepares flat tensors; kernels only compute.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "ops/rules.h"

namespace ampfuse::cpu {

// Elements per parallel work item: every pass flattens its tensor list into chunks of at most
// this many elements and runs one at::parallel_for over all of them.
constexpr int64_t kChunkElements = 16384;

// A flat run of `numel` elements of `dtype` starting at `data`.
struct Span {
  void* data;
  int64_t numel;
  c10::ScalarType dtype;
};

struct UnscaleCheckArgs {
  const Span* tensors;
  int64_t num_tensors;
  float inv_scale;
  bool write_back;  // store the unscaled values (skipped when inv_scale == 1: x * 1 == x)
  NormKind norm;
  // Outputs.
  bool* any_nonfinite;             // set to true if any element is inf/NaN (never reset)
  uint8_t* per_tensor_nonfinite;   // optional, num_tensors entries, set to 1 where found
  float* total_norm;               // written when norm != None (norm of the unscaled values)
};

struct AccumulateArgs {
  const Span* accumulators;  // fp32
  const Span* grads;         // fp16/bf16/fp32, same numel as the accumulator
  int64_t num_tensors;
  bool zero_grads;
  bool* any_nonfinite;       // set to true if a grad element is inf/NaN
};

// One fused optimizer call on CPU tensors (all flat, one element order per row). found_inf has
// already been checked by the caller (a set flag means the kernel is not called at all).
struct OptimArgs {
  int64_t num_tensors;
  void* const* params;        // param dtype
  const void* const* grads;   // grad dtype
  float* const* masters;      // null when the params are updated directly
  float* const* state0;       // SGD: momentum buffers (null if momentum == 0); Adam: exp_avg
  float* const* state1;       // Adam: exp_avg_sq
  float* const* state2;       // Adam: max_exp_avg_sq (amsgrad) or null
  float* const* steps;        // one counter per tensor, incremented by the kernel
  const int64_t* numels;
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
  double lr;                  // resolved by the caller (float or tensor lr)
  float grad_scale;           // gradients are divided by it (1: unscaled)
  float clip_coef;            // and multiplied by it (1: no clipping)
};

struct KernelTable {
  const char* capability;
  // Diagnostics: how many distinct threads one parallel pass of this build used (proves the
  // kernels were compiled with OpenMP rather than silently serial).
  int (*parallel_threads_used)();
  void (*unscale_check)(const UnscaleCheckArgs&);
  void (*accumulate)(const AccumulateArgs&);
  void (*sgd_step)(const OptimArgs&, const SgdHyper&);
  void (*adam_step)(const OptimArgs&, const AdamHyper&);
};

#define AMPFUSE_DECLARE_CPU_TABLE(cap) \
  namespace cap {                      \
  const KernelTable& kernel_table();   \
  }
AMPFUSE_DECLARE_CPU_TABLE(DEFAULT)
AMPFUSE_DECLARE_CPU_TABLE(AVX2)
AMPFUSE_DECLARE_CPU_TABLE(AVX512)
#undef AMPFUSE_DECLARE_CPU_TABLE

// The table for the capability torch itself runs with (honours ATEN_CPU_CAPABILITY).
const KernelTable& kernels();

}  // namespace ampfuse::cpu
