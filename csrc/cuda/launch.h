// Interface between the CUDA dispatcher glue (csrc/cuda/ops_cuda.cpp, which may include torch) and
// the CUDA kernels (*.cu, which include no torch headers so that nvcc stays fast). The glue checks
// arguments and flattens tensors; launchers only launch, on the stream they are given, and return
// the launch status for the glue to check.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ops/rules.h"

namespace ampfuse::cuda {

enum DType : uint8_t { kHalf = 0, kBFloat16 = 1, kFloat = 2, kDouble = 3 };

// A flat run of `numel` elements of `dtype` starting at `data`.
struct TensorRef {
  void* data;
  int64_t numel;
  DType dtype;
};

struct UnscaleCheckLaunch {
  const TensorRef* tensors;
  int64_t num_tensors;
  const float* inv_scale;        // device, 1 element
  float* found_inf;              // device, 1 element; set to 1 on a non-finite value
  float* per_tensor_found_inf;   // device, num_tensors elements, or null
  bool write_back;               // store the unscaled values
  NormKind norm;                 // None: no norm outputs, no workspace
  float* total_norm;             // device, 1 element (norm != None)
  float* clip_coef;              // device, 1 element (norm != None)
  bool has_max_norm;
  float max_norm;
  int num_sms;                   // of the current device; sizes the grid
};

// Device workspace launch_unscale_check needs (0 when norm == None). Uninitialised memory is
// fine: the launcher initialises what it must on the stream.
size_t unscale_check_workspace_bytes(const UnscaleCheckLaunch& args);
cudaError_t launch_unscale_check(const UnscaleCheckLaunch& args, void* workspace,
                                 cudaStream_t stream);

struct AccumulateLaunch {
  float* const* accumulators;  // fp32, flat
  const TensorRef* grads;      // fp16/bf16/fp32, flat, same element order
  int64_t num_tensors;
  bool zero_grads;
  float* found_inf;            // device; set to 1 on a non-finite grad element
  int num_sms;
};
cudaError_t launch_accumulate(const AccumulateLaunch& args, cudaStream_t stream);

// One thread applies update_scale_rule (ops/rules.h) to device state.
cudaError_t launch_update_scale(float* scale, int32_t* growth_tracker, const float* found_inf,
                                int32_t* hysteresis_left, int64_t* stats,
                                const ScaleRuleParams& params, cudaStream_t stream);

// One fused optimizer call. Per tensor: param, grad, master (or null), up to three fp32 state
// tensors (null when absent) and an fp32 step counter, all flat with one element order.
struct OptimTensor {
  void* param;
  const void* grad;
  float* master;
  float* state[3];
  float* step;
  int64_t numel;
};

struct OptimLaunch {
  const OptimTensor* tensors;
  int64_t num_tensors;
  DType param_dtype;  // kHalf, kBFloat16 or kFloat
  DType grad_dtype;
  const float* lr_tensor;   // device, or null: hyper.lr
  const float* grad_scale;  // device, or null
  const float* found_inf;   // device, or null
  const float* clip_coef;   // device, or null
  int num_sms;
};

// Device workspace for one optimizer launch sequence (per-tensor arrival counters that let the
// last block of each tensor advance its step counter). Zeroed by the launcher on the stream.
size_t optim_workspace_bytes(const OptimLaunch& args);
cudaError_t launch_sgd_step(const OptimLaunch& args, const SgdHyper& hyper, void* workspace,
                            cudaStream_t stream);
cudaError_t launch_adam_step(const OptimLaunch& args, const AdamHyper& hyper, void* workspace,
                             cudaStream_t stream);

}  // namespace ampfuse::cuda
