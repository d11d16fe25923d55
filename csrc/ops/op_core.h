// The op bodies without their argument checks, for callers that validated the arguments once and
// keep them valid (the persistent step plan, engine/step_plan.h), and the backend of each device
// type, for callers that run kernels without going through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "ops/kernel_api.h"
#include "ops/op_layer.h"
#include "ops/validation.h"

namespace ampfuse::ops {

// The backend that runs tensors of `type` (registered by csrc/cpu and csrc/cuda at load time);
// null when ampfuse has no kernels for it.
const Backend* device_backend(c10::DeviceType type);

namespace core {

// unscale_check_ / unscale_check_norm_ / check_norm_ with validated, overlap-checked arguments.
std::tuple<at::Tensor, at::Tensor> unscale_check(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const detail::ScaleArg& scale, bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, bool overwrite_found_inf,
    const char* op);
// The same over references to dense tensors (each walked in memory order), their norm in fp64
// when `norm_fp64` (one of them is fp64).
std::tuple<at::Tensor, at::Tensor> unscale_check_refs(
    const Backend& b, const std::vector<kernels::TensorRef>& refs, bool norm_fp64,
    const at::Tensor& found_inf, const detail::ScaleArg& scale, bool write_back, NormKind norm,
    std::optional<double> max_norm, const std::optional<at::Tensor>& per_tensor_found_inf,
    bool overwrite_found_inf, const char* op);

// The kernel dtypes of a fused optimizer call.
struct OptimDTypes {
  kernels::DType param = kernels::DType::Float;
  kernels::DType grad = kernels::DType::Float;
  kernels::MasterKind master = kernels::MasterKind::None;
  kernels::DType state = kernels::DType::Float;
  bool quantized = false;  // 8-bit state lists, each of its format
  QuantFormat formats[3] = {QuantFormat::Dynamic8Signed, QuantFormat::Dynamic8Signed,
                            QuantFormat::Dynamic8Signed};
};
OptimDTypes optim_dtypes(const detail::OptimLists& l);

// sgd_step_ / adam_step_ over prepared rows: the data pointers of validated tensors whose
// elements lie flat in one element order (each row's tensors non-overlapping and dense, with the
// param's strides).
void sgd_rows(const Backend& b, const kernels::OptimTensor* rows, int64_t n,
              const OptimDTypes& dt, const SgdHyper& h, const c10::Device& device,
              const detail::HyperTensors& hyper_tensors,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef);
void adam_rows(const Backend& b, const kernels::OptimTensor* rows, int64_t n,
               const OptimDTypes& dt, const AdamHyper& h, const c10::Device& device,
               const detail::HyperTensors& hyper_tensors,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef);

// accumulate_grads_ over prepared rows (each accumulator and its grad flat in one element order),
// on found_inf's device.
void accumulate_rows(const Backend& b, float* const* accumulators,
                     const kernels::TensorRef* grads, int64_t n, bool zero_grads,
                     const at::Tensor& found_inf);

// sgd_step_ / adam_step_ with validated, overlap-checked lists on `device`.
void sgd_step(const Backend& b, const detail::OptimLists& l, const SgdHyper& h,
              const c10::Device& device, const detail::HyperTensors& hyper_tensors,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef);
void adam_step(const Backend& b, const detail::OptimLists& l, const AdamHyper& h,
               const c10::Device& device, const detail::HyperTensors& hyper_tensors,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef);

}  // namespace core
}  // namespace ampfuse::ops
