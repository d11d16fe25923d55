// The one kernel interface of ampfuse: plain C++ (no torch headers, so nvcc and the host
// compiler of the emulated CUDA build parse it cheaply), shared by
//   - the backend-neutral op layer (ops/op_layer.cpp), which checks arguments, flattens tensors,
//     fills one argument struct per op, allocates the workspace a table asks for and calls the
//     table of the tensors' backend;
//   - the CPU kernel tables (cpu/kernels/, one per CPU capability: DEFAULT, AVX2, AVX512);
//   - the CUDA kernel table (cuda/*.cu), compiled by nvcc for the GPU, and in the test build also
//     by the host compiler under the emulator (cuemu/) as a table for CPU tensors.
//
// Every pointer an argument struct holds points into the memory of the tensors' device ("device
// pointers"): scalars such as inv_scale, found_inf or lr are read and written by the kernels, never
// by the op layer, so no backend synchronises with the host.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/rules.h"

namespace ampfuse::kernels {

// Element types the kernels read and write.
enum class DType : uint8_t { Half = 0, BFloat16 = 1, Float = 2, Double = 3 };

// A flat run of `numel` elements of `dtype` starting at `data`.
struct TensorRef {
  void* data;
  int64_t numel;
  DType dtype;
};

// Where a call runs, and what the op layer keeps for the kernels between calls.
struct LaunchContext {
  void* stream;   // a cudaStream_t for CUDA tables, null for CPU tables
  int num_sms;    // the device's multiprocessor count (sizes CUDA grids; unused by CPU tables)
  // The workspace passed with this call is persistent memory of this entry of the table (e.g.
  // every unscale_check before it used the same memory): whatever the entry's kernels leave zero
  // (their counters) is zero on entry, the rest is scratch. false: fresh, uninitialised memory
  // that the call initialises itself (a memset).
  bool workspace_zeroed;
  // Makes `bytes` of host data resident in device memory and returns where (a metadata table the
  // kernels read); cached by content, so an unchanged table is not copied again. null: none.
  const void* (*resident)(void* self, const void* host, size_t bytes);
  void* resident_self;
};

// unscale_check_ / unscale_check_norm_ / check_norm_.
struct UnscaleCheckArgs {
  const TensorRef* tensors;
  int64_t num_tensors;
  const float* inv_scale;       // 1 element; or null and:
  const float* scale;           // 1 element; the kernels use float(1 / double(scale)), as torch's
                                // GradScaler computes its inv_scale
  float* found_inf;             // 1 element; set to 1 on a non-finite value, never reset, unless
  bool overwrite_found_inf;     // found_inf := 1 or 0 (no separate zeroing launch)
  float* per_tensor_found_inf;  // num_tensors elements, or null; entry i set to 1 likewise
  bool write_back;              // store the unscaled values (false: read-only check)
  NormKind norm;                // None: total_norm and clip_coef are not written
  bool norm_fp64;               // accumulate the norm in double, total_norm is a double (the list
                                // holds an fp64 tensor); else in float, total_norm is a float
  void* total_norm;             // 1 element: the norm of the unscaled values
  float* clip_coef;             // 1 element: clip_coefficient(norm, max_norm) rounded, or 1
  bool has_max_norm;
  double max_norm;
};

// accumulate_grads_: accumulators[i] += grads[i] (fp32 math), grads zeroed when zero_grads.
struct AccumulateArgs {
  float* const* accumulators;  // fp32, each walked in the same element order as its grad
  const TensorRef* grads;      // fp16/bf16/fp32
  int64_t num_tensors;
  bool zero_grads;
  float* found_inf;            // 1 element; set to 1 on a non-finite grad element
};

// update_scale_: one application of update_scale_rule (ops/rules.h).
struct UpdateScaleArgs {
  float* scale;
  int32_t* growth_tracker;
  const float* found_inf;
  int32_t* hysteresis_left;  // null when params.hysteresis == 1 and not consecutive
  int64_t* stats;            // kNumScaleStats counters, or null
  ScaleRuleParams params;
};

// clip_coef: the clip coefficient of a norm computed elsewhere (e.g. combined across ranks).
struct ClipCoefArgs {
  const void* total_norm;        // 1 element, float or double (norm_fp64)
  bool norm_fp64;
  const float* max_norm_tensor;  // 1 element (clip_coefficient_div), or null and:
  double max_norm;               // (clip_coefficient, in the norm's precision)
  float* clip_coef;              // 1 element
};

// How a fused optimizer call keeps the fp32 master of a low-precision param.
enum class MasterKind : uint8_t {
  None = 0,       // the param is updated directly (fp32 math)
  Float = 1,      // an fp32 master tensor
  Remainder = 2,  // bf16 params only: an int16 tensor holding the low 16 bits, so that (param,
                  // remainder) is the fp32 master bit for bit (ops/rules.h, join_master)
  Stochastic = 3,  // bf16 params only, no master: the update is rounded stochastically into the
                   // param with draws of the hyper-parameters' rounding_seed (ops/rules.h)
};

// One tensor of a fused optimizer call: param, grad, master (per MasterKind, or null), up to
// three state tensors (of the call's state dtype; null when absent) and an fp32 step counter, all
// walked in one element order.
struct OptimTensor {
  void* param;
  const void* grad;
  void* master;
  void* state[3];  // SGD: {momentum}; Adam: {exp_avg, exp_avg_sq, max_exp_avg_sq}
  float* step;
  int64_t numel;
  float* absmax[3];  // 8-bit state (OptimArgs::quantized_state): each state's block absmax
};

// sgd_step_ / adam_step_. A non-zero *found_inf makes the call change nothing at all.
struct OptimArgs {
  const OptimTensor* tensors;
  int64_t num_tensors;
  DType param_dtype;  // Half, BFloat16 or Float
  DType grad_dtype;   // Half, BFloat16 or Float
  MasterKind master;
  DType state_dtype;  // Float or BFloat16 (stored rounded to nearest even; math in fp32)
  // Or every state 8-bit block-scaled (ops/rules.h), each list in its own format: one byte per
  // element and an absmax per block of kQuantBlock elements; a pass dequantizes a block, updates
  // it in fp32 and requantizes it with its new absmax.
  bool quantized_state;
  QuantFormat state_format[3];
  const float* lr_tensor;   // 1 element, or null: the hyper-parameters' lr
  // 1 element, or null: the hyper-parameters' momentum (SGD) / beta1 (Adam)
  const float* momentum_tensor;
  const float* grad_scale;  // grads are divided by it, or null
  const float* found_inf;   // or null
  const float* clip_coef;   // grads are multiplied by it, or null
};

// quantize_blocks_ / dequantize_blocks: a flat fp32 run and its 8-bit block-scaled form (the
// format of ops/rules.h: ceil(numel / kQuantBlock) absmax values, one byte per element).
struct QuantizeArgs {
  const float* values;  // numel elements
  uint8_t* codes;       // numel bytes
  float* absmax;        // one per block
  int64_t numel;
  QuantFormat format;
  bool nonnegative;
};

struct DequantizeArgs {
  const uint8_t* codes;
  const float* absmax;
  float* values;
  int64_t numel;
  QuantFormat format;
};

// A backend's kernels. Each entry returns 0 on success or a backend status that error_string
// describes. Workspace: the op layer passes `*_workspace(...)` bytes of device memory (none when
// 0) to the matching call: persistent memory left zeroed by the previous call when
// ctx.workspace_zeroed, else fresh memory the call initialises itself.
struct KernelTable {
  const char* name;  // "DEFAULT", "AVX2", "AVX512", "cuda", "cuda-emulated"
  size_t (*unscale_check_workspace)(const UnscaleCheckArgs&, const LaunchContext&);
  int (*unscale_check)(const UnscaleCheckArgs&, void* workspace, const LaunchContext&);
  int (*accumulate)(const AccumulateArgs&, const LaunchContext&);
  int (*update_scale)(const UpdateScaleArgs&, const LaunchContext&);
  int (*clip_coef)(const ClipCoefArgs&, const LaunchContext&);
  size_t (*optim_workspace)(const OptimArgs&, const LaunchContext&);
  int (*sgd_step)(const OptimArgs&, const SgdHyper&, void* workspace, const LaunchContext&);
  int (*adam_step)(const OptimArgs&, const AdamHyper&, void* workspace, const LaunchContext&);
  int (*quantize)(const QuantizeArgs&, const LaunchContext&);
  int (*dequantize)(const DequantizeArgs&, const LaunchContext&);
  const char* (*error_string)(int status);
};

}  // namespace ampfuse::kernels
