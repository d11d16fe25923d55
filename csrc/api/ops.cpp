// C++ entry points for the ampfuse ops: typed dispatcher calls, so C++ callers reach exactly the
// kernels Python reaches through torch.ops.ampfuse.
#include "ampfuse/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace ampfuse {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

}  // namespace

void unscale_check_(at::TensorList tensors, const at::Tensor& found_inf,
                    const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& scale, bool overwrite_found_inf) {
  static auto handle =
      op<void(at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, bool)>("ampfuse::unscale_check_");
  handle.call(tensors, found_inf, inv_scale, scale, overwrite_found_inf);
}

using NormSig = std::tuple<at::Tensor, at::Tensor>(
    at::TensorList, const at::Tensor&, const std::optional<at::Tensor>&, double,
    std::optional<double>, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    bool);

std::tuple<at::Tensor, at::Tensor> unscale_check_norm_(
    at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf) {
  static auto handle = op<NormSig>("ampfuse::unscale_check_norm_");
  return handle.call(tensors, found_inf, inv_scale, norm_type, max_norm, per_tensor_found_inf,
                     scale, overwrite_found_inf);
}

std::tuple<at::Tensor, at::Tensor> check_norm_(
    at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf) {
  static auto handle = op<NormSig>("ampfuse::check_norm_");
  return handle.call(tensors, found_inf, inv_scale, norm_type, max_norm, per_tensor_found_inf,
                     scale, overwrite_found_inf);
}

at::Tensor clip_coef(const at::Tensor& total_norm, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& max_norm_tensor) {
  static auto handle =
      op<at::Tensor(const at::Tensor&, std::optional<double>, const std::optional<at::Tensor>&)>(
          "ampfuse::clip_coef");
  return handle.call(total_norm, max_norm, max_norm_tensor);
}

std::tuple<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& values, c10::ScalarType dtype,
                                                   bool nonnegative) {
  static auto handle = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, c10::ScalarType, bool)>(
      "ampfuse::quantize_blocks");
  return handle.call(values, dtype, nonnegative);
}

at::Tensor dequantize_blocks(const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative) {
  static auto handle = op<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>("ampfuse::dequantize_blocks");
  return handle.call(codes, absmax, nonnegative);
}

void accumulate_grads_(at::TensorList accumulators, at::TensorList grads,
                       const at::Tensor& found_inf, bool zero_grads) {
  static auto handle = op<void(at::TensorList, at::TensorList, const at::Tensor&, bool)>(
      "ampfuse::accumulate_grads_");
  handle.call(accumulators, grads, found_inf, zero_grads);
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker,
                   const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                   int64_t growth_interval, const UpdateScaleOptions& o) {
  static auto handle =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, int64_t,
              int64_t, const std::optional<at::Tensor>&, bool, std::optional<double>,
              std::optional<double>, const std::optional<at::Tensor>&)>("ampfuse::update_scale_");
  handle.call(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval,
              o.hysteresis, o.hysteresis_tracker, o.consecutive_hysteresis, o.min_scale,
              o.max_scale, o.stats);
}

void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
               at::TensorList momentum_buffers, at::TensorList steps, const SgdStepOptions& o,
               const StepScaling& sc, at::TensorList momentum_absmax) {
  using Opt = const std::optional<at::Tensor>&;
  static auto handle =
      op<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
              double, Opt, double, Opt, double, double, bool, bool, Opt, Opt, Opt,
              std::optional<at::TensorList>, std::optional<int64_t>)>("ampfuse::sgd_step_");
  handle.call(params, grads, master_params, momentum_buffers, steps, o.lr, o.lr_tensor,
              o.momentum, o.momentum_tensor, o.dampening, o.weight_decay, o.nesterov, o.maximize, sc.grad_scale,
              sc.found_inf, sc.clip_coef, momentum_absmax, o.rounding_seed);
}

void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList max_exp_avg_sqs, at::TensorList steps, const AdamStepOptions& o,
                const StepScaling& sc, const AdamStateAbsmax& absmax) {
  using Opt = const std::optional<at::Tensor>&;
  using L = at::TensorList;
  using OL = std::optional<at::TensorList>;
  static auto handle =
      op<void(L, L, L, L, L, L, L, double, Opt, double, Opt, double, double, double, bool, bool, bool,
              Opt, Opt, Opt, OL, OL, OL, std::optional<int64_t>)>("ampfuse::adam_step_");
  handle.call(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, o.lr,
              o.lr_tensor, o.beta1, o.beta1_tensor, o.beta2, o.eps, o.weight_decay, o.amsgrad, o.maximize,
              o.decoupled_weight_decay, sc.grad_scale, sc.found_inf, sc.clip_coef, absmax.exp_avg,
              absmax.exp_avg_sq, absmax.max_exp_avg_sq, o.rounding_seed);
}

}  // namespace ampfuse
