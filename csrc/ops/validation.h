// Argument validation of the ops, shared by every backend (ops/op_layer.cpp runs it before
// anything is modified), so that bad input fails with the same message on every backend.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ops/rules.h"

namespace ampfuse::detail {

// The options a scale update takes: growth factor finite and > 1, backoff factor in (0, 1),
// growth interval and hysteresis integers in [1, 2^31 - 1] (the device counters are int32).
// Raises c10::Error naming the option.
void check_update_options(double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis);

// "torch.float16" style name for error messages.
std::string dtype_name(c10::ScalarType t);

bool is_supported_float(c10::ScalarType t);

// A 1-element tensor of dtype `dtype` on `device` (any shape with one element, as torch accepts).
void check_scalar_tensor(const at::Tensor& t, const char* name, c10::ScalarType dtype,
                         const c10::Device& device);

// Every element of `tensors` is a strided floating-point tensor (fp16/bf16/fp32/fp64) on `device`.
void check_float_list(at::TensorList tensors, const char* name, const c10::Device& device);

// The scale an unscale/check op divides by: inv_scale (multiplied by), or scale (the kernels
// use float(1 / double(scale)), as torch's GradScaler computes inv_scale).
struct ScaleArg {
  const at::Tensor* tensor;
  const char* name;  // "inv_scale" or "scale"
  bool is_inverse;
};

// unscale_check_ / unscale_check_norm_ / check_norm_ preconditions: exactly one of inv_scale and
// scale. Returns it.
ScaleArg check_unscale_args(at::TensorList tensors, const at::Tensor& found_inf,
                            const std::optional<at::Tensor>& inv_scale,
                            const std::optional<at::Tensor>& scale);
void check_norm_args(double norm_type, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& per_tensor_found_inf, int64_t num_tensors,
                     const c10::Device& device);

// clip_coef preconditions: total_norm a 1-element float32/float64 tensor; exactly one of max_norm
// (> 0, finite) and max_norm_tensor (a 1-element float32 tensor on total_norm's device).
// quantize_blocks / dequantize_blocks: returns the format of `dtype` (uint8 or fp8 codes).
QuantFormat check_quantize_args(const at::Tensor& values, c10::ScalarType dtype, bool nonnegative);
QuantFormat check_dequantize_args(const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative);

void check_clip_coef_args(const at::Tensor& total_norm, std::optional<double> max_norm,
                          const std::optional<at::Tensor>& max_norm_tensor);

// accumulate_grads_ preconditions.
void check_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                           const at::Tensor& found_inf);

// update_scale_ preconditions; returns the rule parameters.
ScaleRuleParams check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& found_inf, double growth_factor,
                                        double backoff_factor, int64_t growth_interval,
                                        int64_t hysteresis,
                                        const std::optional<at::Tensor>& hysteresis_tracker,
                                        bool consecutive_hysteresis,
                                        std::optional<double> min_scale,
                                        std::optional<double> max_scale,
                                        const std::optional<at::Tensor>& stats);

NormKind norm_kind(double norm_type);

// The lists of one fused optimizer call. `masters`, `state[k]` may be empty lists (absent);
// otherwise they have one tensor per param.
struct OptimLists {
  at::TensorList params;
  at::TensorList grads;
  at::TensorList masters;
  std::vector<at::TensorList> states;  // SGD: {momentum}; Adam: {exp_avg, exp_avg_sq, max_exp_avg_sq}
  std::vector<const char*> state_names;
  at::TensorList steps;
  // 8-bit state: per state list its block absmax list (empty when the state is not 8-bit, or
  // absent), and whether its values are >= 0 (second moments: the unsigned map for torch.uint8).
  std::vector<at::TensorList> absmaxes = {};
  std::vector<const char*> absmax_names = {};
  std::vector<bool> nonnegative = {};
};

// The 8-bit format of a state list of dtype `dtype` (torch.uint8 / float8_e4m3fn / float8_e5m2),
// or nullopt for another dtype.
std::optional<QuantFormat> state_quant_format(c10::ScalarType dtype, bool nonnegative);

// The hyper-parameters a fused step reads on the device (1-element fp32 tensors, or none): the
// lr, and SGD's momentum / Adam's beta1 (named `momentum_name` in messages).
struct HyperTensors {
  std::optional<at::Tensor> lr;
  std::optional<at::Tensor> momentum;
  const char* momentum_name = "momentum_tensor";
};

// Validates the lists of sgd_step_/adam_step_ and the optional scalar tensors. Returns the device.
c10::Device check_optim_args(const OptimLists& l, const HyperTensors& hyper_tensors,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf,
                             const std::optional<at::Tensor>& clip_coef);

// Memory the kernels write must belong to one tensor of the call only: a written tensor with
// internally overlapping elements (an expanded, stride-0 view) or sharing memory with another
// tensor of the call (the same tensor twice, overlapping views) is rejected, naming both, before
// anything runs. Read-only tensors may share memory with each other.
class OverlapCheck {
 public:
  void add(at::TensorList list, const char* name, bool written);
  void add(const at::Tensor& t, const char* name, bool written);
  void add(const std::optional<at::Tensor>& t, const char* name, bool written);
  // Throws on the first conflict.
  void check() const;

 private:
  struct Span {
    uintptr_t begin, end;  // bytes [begin, end) that the tensor's elements lie in
    const at::Tensor* tensor;
    const char* name;
    int64_t index;  // -1 for a single tensor
    bool written;
  };
  std::vector<Span> spans_;
};

// Hyper-parameter checks (torch's rules) and which state lists the configuration requires.
// `momentum_tensor`: the momentum is a device value (> 0 as far as the checks go: buffers needed).
void check_sgd_hyper(const SgdHyper& h, const OptimLists& l, bool momentum_tensor = false);
void check_adam_hyper(const AdamHyper& h, const OptimLists& l);

}  // namespace ampfuse::detail
