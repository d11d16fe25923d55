// The backend-neutral op layer: one implementation of every ampfuse op over a kernel table.
//
// Each op validates its arguments (ops/validation.h; nothing is modified before that is done),
// flattens its tensors (ops/flatten.h), fills the op's argument struct (ops/kernel_api.h),
// allocates the workspace the table asks for on the tensors' device, calls the table of the
// tensors' backend and writes copies of non-dense tensors back. A backend (csrc/cpu, csrc/cuda)
// is only a kernel table plus a launch context, registered with register_kernels<> in its
// TORCH_LIBRARY_IMPL block.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops/kernel_api.h"

namespace ampfuse::ops {

struct Backend {
  // The table to run (may be chosen at load time, e.g. the CPU capability); null for a backend
  // that only validates (Meta: shape and dtype propagation for torch.compile and FakeTensor,
  // with the same checks and messages as every other backend).
  const kernels::KernelTable& (*table)();
  // Stream and size of the device the call runs on (called with that device current); the op
  // layer fills the rest of the context (ops/call_resources.h).
  kernels::LaunchContext (*context)(const c10::Device& device);
  // Whether the context's stream is being captured into a CUDA graph (null: never).
  bool (*capturing)(const kernels::LaunchContext& ctx);
};

void unscale_check(const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& scale, bool overwrite_found_inf);

std::tuple<at::Tensor, at::Tensor> unscale_check_norm(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const std::optional<at::Tensor>& inv_scale, double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf);

std::tuple<at::Tensor, at::Tensor> check_norm(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const std::optional<at::Tensor>& inv_scale, double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf);

void update_scale(const Backend& b, const at::Tensor& scale, const at::Tensor& growth_tracker,
                  const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                  int64_t growth_interval, int64_t hysteresis,
                  const std::optional<at::Tensor>& hysteresis_tracker, bool consecutive_hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale,
                  const std::optional<at::Tensor>& stats);

at::Tensor clip_coef(const Backend& b, const at::Tensor& total_norm, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& max_norm_tensor);

void accumulate_grads(const Backend& b, at::TensorList accumulators, at::TensorList grads,
                      const at::Tensor& found_inf, bool zero_grads);

std::tuple<at::Tensor, at::Tensor> quantize_blocks(const Backend& b, const at::Tensor& values,
                                                   c10::ScalarType dtype, bool nonnegative);

at::Tensor dequantize_blocks(const Backend& b, const at::Tensor& codes, const at::Tensor& absmax,
                             bool nonnegative);

void sgd_step(const Backend& b, at::TensorList params, at::TensorList grads,
              at::TensorList master_params, at::TensorList momentum_buffers, at::TensorList steps,
              double lr, const std::optional<at::Tensor>& lr_tensor, double momentum,
              const std::optional<at::Tensor>& momentum_tensor, double dampening,
              double weight_decay, bool nesterov, bool maximize,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef, at::TensorList momentum_absmax,
              std::optional<int64_t> rounding_seed);

void adam_step(const Backend& b, at::TensorList params, at::TensorList grads,
               at::TensorList master_params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
               const std::optional<at::Tensor>& lr_tensor, double beta1,
               const std::optional<at::Tensor>& beta1_tensor, double beta2, double eps,
               double weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef, at::TensorList exp_avg_absmax,
               at::TensorList exp_avg_sq_absmax, at::TensorList max_exp_avg_sq_absmax,
               std::optional<int64_t> rounding_seed);

// Registers every op of the schema block (ops/registration.cpp) for one dispatch key, running on
// backend B. Used once per key in each backend's TORCH_LIBRARY_IMPL block.
template <const Backend& B>
void register_kernels(torch::Library& m) {
  m.impl("unscale_check_", [](at::TensorList tensors, const at::Tensor& found_inf,
                              const std::optional<at::Tensor>& inv_scale,
                              const std::optional<at::Tensor>& scale, bool overwrite_found_inf) {
    unscale_check(B, tensors, found_inf, inv_scale, scale, overwrite_found_inf);
  });
  m.impl("unscale_check_norm_",
         [](at::TensorList tensors, const at::Tensor& found_inf,
            const std::optional<at::Tensor>& inv_scale, double norm_type,
            std::optional<double> max_norm, const std::optional<at::Tensor>& per_tensor_found_inf,
            const std::optional<at::Tensor>& scale, bool overwrite_found_inf) {
           return unscale_check_norm(B, tensors, found_inf, inv_scale, norm_type, max_norm,
                                     per_tensor_found_inf, scale, overwrite_found_inf);
         });
  m.impl("check_norm_",
         [](at::TensorList tensors, const at::Tensor& found_inf,
            const std::optional<at::Tensor>& inv_scale, double norm_type,
            std::optional<double> max_norm, const std::optional<at::Tensor>& per_tensor_found_inf,
            const std::optional<at::Tensor>& scale, bool overwrite_found_inf) {
           return check_norm(B, tensors, found_inf, inv_scale, norm_type, max_norm,
                             per_tensor_found_inf, scale, overwrite_found_inf);
         });
  m.impl("update_scale_",
         [](const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
            double growth_factor, double backoff_factor, int64_t growth_interval,
            int64_t hysteresis, const std::optional<at::Tensor>& hysteresis_tracker,
            bool consecutive_hysteresis, std::optional<double> min_scale,
            std::optional<double> max_scale, const std::optional<at::Tensor>& stats) {
           update_scale(B, scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                        growth_interval, hysteresis, hysteresis_tracker, consecutive_hysteresis,
                        min_scale, max_scale, stats);
         });
  m.impl("clip_coef", [](const at::Tensor& total_norm, std::optional<double> max_norm,
                         const std::optional<at::Tensor>& max_norm_tensor) {
    return clip_coef(B, total_norm, max_norm, max_norm_tensor);
  });
  m.impl("accumulate_grads_", [](at::TensorList accumulators, at::TensorList grads,
                                 const at::Tensor& found_inf, bool zero_grads) {
    accumulate_grads(B, accumulators, grads, found_inf, zero_grads);
  });
  m.impl("quantize_blocks", [](const at::Tensor& values, c10::ScalarType dtype, bool nonnegative) {
    return quantize_blocks(B, values, dtype, nonnegative);
  });
  m.impl("dequantize_blocks", [](const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative) {
    return dequantize_blocks(B, codes, absmax, nonnegative);
  });
  m.impl("sgd_step_",
         [](at::TensorList params, at::TensorList grads, at::TensorList master_params,
            at::TensorList momentum_buffers, at::TensorList steps, double lr,
            const std::optional<at::Tensor>& lr_tensor, double momentum,
            const std::optional<at::Tensor>& momentum_tensor, double dampening,
            double weight_decay, bool nesterov, bool maximize,
            const std::optional<at::Tensor>& grad_scale,
            const std::optional<at::Tensor>& found_inf,
            const std::optional<at::Tensor>& clip_coef,
            std::optional<at::TensorList> momentum_absmax, std::optional<int64_t> rounding_seed) {
           sgd_step(B, params, grads, master_params, momentum_buffers, steps, lr, lr_tensor,
                    momentum, momentum_tensor, dampening, weight_decay, nesterov, maximize, grad_scale, found_inf,
                    clip_coef, momentum_absmax.value_or(at::TensorList()), rounding_seed);
         });
  m.impl("adam_step_",
         [](at::TensorList params, at::TensorList grads, at::TensorList master_params,
            at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
            at::TensorList steps, double lr, const std::optional<at::Tensor>& lr_tensor,
            double beta1, const std::optional<at::Tensor>& beta1_tensor, double beta2, double eps,
            double weight_decay, bool amsgrad,
            bool maximize, bool decoupled_weight_decay,
            const std::optional<at::Tensor>& grad_scale,
            const std::optional<at::Tensor>& found_inf,
            const std::optional<at::Tensor>& clip_coef,
            std::optional<at::TensorList> exp_avg_absmax,
            std::optional<at::TensorList> exp_avg_sq_absmax,
            std::optional<at::TensorList> max_exp_avg_sq_absmax,
            std::optional<int64_t> rounding_seed) {
           adam_step(B, params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                     steps, lr, lr_tensor, beta1, beta1_tensor, beta2, eps, weight_decay, amsgrad, maximize,
                     decoupled_weight_decay, grad_scale, found_inf, clip_coef,
                     exp_avg_absmax.value_or(at::TensorList()),
                     exp_avg_sq_absmax.value_or(at::TensorList()),
                     max_exp_avg_sq_absmax.value_or(at::TensorList()), rounding_seed);
         });
}

// The backend that step plans use for tensors of `type` (ops/op_core.h).
void set_device_backend(c10::DeviceType type, const Backend* backend);

// A device backend's whole registration, the same for every device that runs kernels (CPU, CUDA,
// the emulated CUDA device): every op for the key of `type`, and the backend for step plans.
template <const Backend& B>
void register_device(torch::Library& m, c10::DeviceType type) {
  register_kernels<B>(m);
  set_device_backend(type, &B);
}

}  // namespace ampfuse::ops
