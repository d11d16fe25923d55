// ampfuse ops as C++ functions. Each call goes through the torch dispatcher, so C++ and Python
// callers reach the same registered CPU/CUDA kernels (see csrc/ops/registration.cpp for the
// schemas and the contracts).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace ampfuse {

// Registers nothing by itself (registration is static), but referencing it keeps libampfuse
// linked into an application even under --as-needed. Returns true.
bool ensure_registered();

namespace detail {
inline const bool kOpsRegistered = ::ampfuse::ensure_registered();
}  // namespace detail

// Version of torch that libampfuse was built against, e.g. "2.14.1".
const char* built_with_torch_version();

// Multiplies every tensor in place by inv_scale and sets found_inf to 1.0 if any element is inf or
// NaN (found_inf is never reset). Drop-in for at::_amp_foreach_non_finite_check_and_unscale_.
// Instead of inv_scale, `scale` (see unscale_check_norm_); overwrite_found_inf: found_inf := 0 or 1.
void unscale_check_(at::TensorList tensors, const at::Tensor& found_inf,
                    const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& scale = std::nullopt,
                    bool overwrite_found_inf = false);

// unscale_check_ plus, in the same pass, the global norm of the unscaled values (norm_type 2 or
// inf; fp32 accumulation, fp64 when the list holds an fp64 tensor) and the clip coefficient
// min(1, max_norm / (norm + 1e-6)) (1 when max_norm is not given). Optionally records per-tensor
// non-finite flags. Pass either inv_scale or scale (then the kernel multiplies by
// float(1 / double(scale)), torch's GradScaler rule, with no separate reciprocal launch).
// overwrite_found_inf: found_inf := 0 or 1 (it need not be zeroed first) instead of only set.
// Returns (total_norm, clip_coef), 0-dim tensors on the tensors' device.
std::tuple<at::Tensor, at::Tensor> unscale_check_norm_(
    at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
    double norm_type = 2.0, std::optional<double> max_norm = std::nullopt,
    const std::optional<at::Tensor>& per_tensor_found_inf = std::nullopt,
    const std::optional<at::Tensor>& scale = std::nullopt, bool overwrite_found_inf = false);

// Read-only variant of unscale_check_norm_: the tensors are not written.
std::tuple<at::Tensor, at::Tensor> check_norm_(
    at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
    double norm_type = 2.0, std::optional<double> max_norm = std::nullopt,
    const std::optional<at::Tensor>& per_tensor_found_inf = std::nullopt,
    const std::optional<at::Tensor>& scale = std::nullopt, bool overwrite_found_inf = false);

// The clip coefficient of `total_norm` (e.g. a norm combined across devices or ranks) by the rule
// of the fused check ops: min(1, max_norm / (total_norm + 1e-6)), reciprocal-then-multiply for a
// float max_norm, a true division for a tensor one (as torch.nn.utils.clip_grad_norm_). Exactly
// one of max_norm and max_norm_tensor. A 0-dim float32 tensor on total_norm's device.
at::Tensor clip_coef(const at::Tensor& total_norm, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& max_norm_tensor = std::nullopt);

// The 8-bit block-scaled form of fp32 `values` (optimizer state): blocks of 256 values in their
// flat order, one fp32 absmax per block and one byte per value, of `dtype` torch.uint8 (the
// dynamic map; unsigned when nonnegative) or torch.float8_e4m3fn / torch.float8_e5m2 (the fp8 value
// of value / absmax scaled to the format's range). nonnegative (second moments): negative values
// encode as 0, positive ones never as 0. Returns (codes of values' shape, absmax of
// ceil(numel / 256) values).
std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& values, c10::ScalarType dtype,
                                                   bool nonnegative = false);
// The fp32 values of quantize_blocks' output (`nonnegative` as it was quantized with).
at::Tensor dequantize_blocks(const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative = false);

// accumulators[i] (fp32) += grads[i] (fp16/bf16/fp32) in one pass; grads are zeroed in the same
// pass when zero_grads, and found_inf is set to 1 if any sum is inf/NaN (an inf/NaN grad, or an
// fp32 overflow).
void accumulate_grads_(at::TensorList accumulators, at::TensorList grads,
                       const at::Tensor& found_inf, bool zero_grads = true);

// Options of update_scale_ beyond torch's rule.
struct UpdateScaleOptions {
  int64_t hysteresis = 1;                         // back off only on the N-th overflow
  std::optional<at::Tensor> hysteresis_tracker;   // int32 1-element, required if hysteresis > 1
  bool consecutive_hysteresis = false;            // refill the budget after every clean step
  std::optional<double> min_scale;                // floor (the scale never goes below FLT_MIN)
  std::optional<double> max_scale;                // ceiling
  std::optional<at::Tensor> stats;                // int64[4]: updates, overflows, backoffs, floor hits
};

// Updates scale and growth_tracker in place on their device (no host sync). With default options,
// bit-for-bit at::_amp_update_scale_ except that the scale never falls below FLT_MIN.
void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                   int64_t growth_interval, const UpdateScaleOptions& options = {});

// Tensors a GradScaler hands to a fused optimizer step (all optional, 1-element fp32, on the
// params' device): grads are divided by grad_scale and multiplied by clip_coef, and a non-zero
// found_inf turns the step into a no-op (params, masters, state and steps bitwise unchanged).
struct StepScaling {
  std::optional<at::Tensor> grad_scale;
  std::optional<at::Tensor> found_inf;
  std::optional<at::Tensor> clip_coef;
};

struct SgdStepOptions {
  double lr = 1e-3;
  std::optional<at::Tensor> lr_tensor;  // overrides lr (CUDA-graph capturable schedules)
  double momentum = 0.0;
  std::optional<at::Tensor> momentum_tensor;  // overrides momentum (and means momentum buffers)
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
  // Given: bf16 params without masters are rounded stochastically with draws of this seed.
  std::optional<int64_t> rounding_seed;
};

// Fused torch.optim.SGD step over one list (one dtype per list; master_params and
// momentum_buffers may be empty). See csrc/ops/registration.cpp for the contract. 8-bit
// momentum buffers (quantize_blocks' codes) come with their block absmax list, else {}.
void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
               at::TensorList momentum_buffers, at::TensorList steps,
               const SgdStepOptions& options, const StepScaling& scaling = {},
               at::TensorList momentum_absmax = {});

struct AdamStepOptions {
  double lr = 1e-3;
  std::optional<at::Tensor> lr_tensor;
  double beta1 = 0.9;
  std::optional<at::Tensor> beta1_tensor;  // overrides beta1
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  // true: AdamW
  // Given: bf16 params without masters are rounded stochastically with draws of this seed.
  std::optional<int64_t> rounding_seed;
};

// Fused torch.optim.Adam / AdamW step over one list. 8-bit state: every state list codes, each
// with its block absmax list (the second moments in quantize_blocks' nonnegative form).
struct AdamStateAbsmax {
  at::TensorList exp_avg;
  at::TensorList exp_avg_sq;
  at::TensorList max_exp_avg_sq;
};
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList steps,
                const AdamStepOptions& options, const StepScaling& scaling = {},
                const AdamStateAbsmax& absmax = {});

}  // namespace ampfuse
