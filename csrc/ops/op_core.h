// The op bodies without their argument checks, for callers that validated the arguments once and
// keep them valid (the persistent step plan, ops/step_plan.h), and the backend of each device
// type, for callers that run kernels without going through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "ops/op_layer.h"
#include "ops/validation.h"

namespace ampfuse::ops {

// The backend that runs tensors of `type` (registered by csrc/cpu and csrc/cuda at load time);
// null when ampfuse has no kernels for it.
const Backend* device_backend(c10::DeviceType type);
void set_device_backend(c10::DeviceType type, const Backend* backend);

namespace core {

// unscale_check_ / unscale_check_norm_ / check_norm_ with validated, overlap-checked arguments.
std::tuple<at::Tensor, at::Tensor> unscale_check(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const detail::ScaleArg& scale, bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, bool overwrite_found_inf,
    const char* op);

// sgd_step_ / adam_step_ with validated, overlap-checked lists on `device`.
void sgd_step(const Backend& b, const detail::OptimLists& l, const SgdHyper& h,
              const c10::Device& device, const std::optional<at::Tensor>& lr_tensor,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef);
void adam_step(const Backend& b, const detail::OptimLists& l, const AdamHyper& h,
               const c10::Device& device, const std::optional<at::Tensor>& lr_tensor,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef);

}  // namespace core
}  // namespace ampfuse::ops
