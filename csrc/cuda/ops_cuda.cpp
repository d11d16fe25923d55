// CUDA implementations of the ampfuse ops: argument checks (shared with the CPU backend), flat
// views, launches on the current stream, and the TORCH_LIBRARY_IMPL(ampfuse, CUDA) block at the
// bottom. Kernels are in the .cu files next to this one; none of them syncs with the host.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

#include "cuda/launch.h"
#include "ops/checks.h"

namespace ampfuse::cuda {
namespace {

using detail::FlatTensor;

DType dtype_of(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return kHalf;
    case c10::kBFloat16: return kBFloat16;
    case c10::kFloat: return kFloat;
    case c10::kDouble: return kDouble;
    default: TORCH_INTERNAL_ASSERT(false, "unsupported dtype reached a CUDA kernel");
  }
}

int num_sms(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= cache.size()) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cache[device];
}

std::tuple<at::Tensor, at::Tensor> unscale_check_impl(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  const c10::cuda::CUDAGuard guard(found_inf.device());
  std::vector<FlatTensor> copies;
  std::vector<TensorRef> refs;
  refs.reserve(tensors.size());
  for (const auto& t : tensors) {
    refs.push_back({detail::flat_data(t, copies), t.numel(), dtype_of(t.scalar_type())});
  }
  at::Tensor total_norm, clip_coef;
  if (norm != NormKind::None) {
    auto opts = found_inf.options();
    total_norm = at::empty({}, opts);
    clip_coef = at::empty({}, opts);
  }
  UnscaleCheckLaunch args{};
  args.tensors = refs.data();
  args.num_tensors = static_cast<int64_t>(refs.size());
  args.inv_scale = inv_scale.const_data_ptr<float>();
  args.found_inf = found_inf.mutable_data_ptr<float>();
  args.per_tensor_found_inf =
      per_tensor_found_inf ? per_tensor_found_inf->mutable_data_ptr<float>() : nullptr;
  args.write_back = write_back;
  args.norm = norm;
  args.total_norm = total_norm.defined() ? total_norm.mutable_data_ptr<float>() : nullptr;
  args.clip_coef = clip_coef.defined() ? clip_coef.mutable_data_ptr<float>() : nullptr;
  args.has_max_norm = max_norm.has_value();
  args.max_norm = max_norm ? static_cast<float>(*max_norm) : 0.0f;
  args.num_sms = num_sms(found_inf.device().index());
  at::Tensor workspace;
  const size_t ws_bytes = unscale_check_workspace_bytes(args);
  if (ws_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(ws_bytes)}, found_inf.options().dtype(at::kByte));
  }
  C10_CUDA_CHECK(launch_unscale_check(args, ws_bytes ? workspace.data_ptr() : nullptr,
                                      c10::cuda::getCurrentCUDAStream()));
  if (write_back) {
    for (const auto& f : copies) f.finish();
  }
  return {total_norm, clip_coef};
}

// unscale_check_: see the contract in csrc/ops/registration.cpp.
//   tensors: fp16/bf16/fp32/fp64 tensors on found_inf's device, any layout; multiplied in place.
//   found_inf: 1-element fp32; set to 1.0 if any element is inf/NaN. The caller zeroes it.
//   inv_scale: 1-element fp32 on the same device.
void unscale_check_cuda(at::TensorList tensors, const at::Tensor& found_inf,
                        const at::Tensor& inv_scale) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/true, NormKind::None,
                     std::nullopt, std::nullopt);
}

// unscale_check_norm_ / check_norm_: unscale_check_ plus the norm (2 or inf) of the unscaled values
// and the clip coefficient, computed on device by the last block of the pass.
std::tuple<at::Tensor, at::Tensor> unscale_check_norm_cuda(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/true,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf);
}

std::tuple<at::Tensor, at::Tensor> check_norm_cuda(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/false,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf);
}

// accumulate_grads_: see the CPU version; one multi-tensor pass on the current stream.
void accumulate_grads_cuda(at::TensorList accumulators, at::TensorList grads,
                           const at::Tensor& found_inf, bool zero_grads) {
  detail::check_accumulate_args(accumulators, grads, found_inf);
  const c10::cuda::CUDAGuard guard(found_inf.device());
  // Accumulator and grad are walked in one element order; the grad is written only to zero it.
  std::vector<detail::FlatRow> copies;
  std::vector<float*> acc_ptrs(grads.size());
  std::vector<TensorRef> grad_refs(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor* row[2] = {&accumulators[i], &grads[i]};
    void* ptrs[2];
    detail::flat_pointers(row, 2, zero_grads ? 0u : 2u, ptrs, copies);
    acc_ptrs[i] = static_cast<float*>(ptrs[0]);
    grad_refs[i] = {ptrs[1], grads[i].numel(), dtype_of(grads[i].scalar_type())};
  }
  AccumulateLaunch args{acc_ptrs.data(), grad_refs.data(), static_cast<int64_t>(grads.size()),
                        zero_grads, found_inf.mutable_data_ptr<float>(),
                        num_sms(found_inf.device().index())};
  C10_CUDA_CHECK(launch_accumulate(args, c10::cuda::getCurrentCUDAStream()));
  for (const auto& r : copies) r.finish();
}

// update_scale_: one thread applies the scale rule (csrc/ops/rules.h) on the current stream.
void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis,
                       const std::optional<at::Tensor>& hysteresis_tracker,
                       bool consecutive_hysteresis, std::optional<double> min_scale,
                       std::optional<double> max_scale, const std::optional<at::Tensor>& stats) {
  const ScaleRuleParams p = detail::check_update_scale_args(
      scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
      hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale, stats);
  const c10::cuda::CUDAGuard guard(scale.device());
  C10_CUDA_CHECK(launch_update_scale(
      scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
      found_inf.const_data_ptr<float>(),
      hysteresis_tracker ? hysteresis_tracker->mutable_data_ptr<int32_t>() : nullptr,
      stats ? stats->mutable_data_ptr<int64_t>() : nullptr, p,
      c10::cuda::getCurrentCUDAStream()));
}

// Shared body of the fused optimizer steps on CUDA: flatten, launch on the current stream (the
// kernel itself skips on found_inf: no host read), write back copies.
template <typename Hyper>
void optim_step_cuda(const detail::OptimLists& l, const Hyper& h, c10::Device device,
                     cudaError_t (*launch)(const OptimLaunch&, const Hyper&, void*, cudaStream_t),
                     const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& clip_coef) {
  const size_t n = l.params.size();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  std::vector<detail::FlatRow> copies;
  std::vector<OptimTensor> tensors(n);
  void* row[detail::kRowPointers];
  for (size_t i = 0; i < n; ++i) {
    detail::row_pointers(l, i, row, copies);
    OptimTensor& o = tensors[i];
    o.param = row[0];
    o.grad = row[1];
    o.master = static_cast<float*>(row[2]);
    for (size_t k = 0; k < 3; ++k) o.state[k] = static_cast<float*>(row[3 + k]);
    o.step = l.steps[i].mutable_data_ptr<float>();
    o.numel = l.params[i].numel();
  }
  auto ptr = [](const std::optional<at::Tensor>& t) -> const float* {
    return t ? t->const_data_ptr<float>() : nullptr;
  };
  OptimLaunch args{tensors.data(),      static_cast<int64_t>(n),
                   dtype_of(l.params[0].scalar_type()), dtype_of(l.grads[0].scalar_type()),
                   ptr(lr_tensor),      ptr(grad_scale),
                   ptr(found_inf),      ptr(clip_coef),
                   num_sms(device.index())};
  at::Tensor workspace = at::empty({static_cast<int64_t>(optim_workspace_bytes(args))},
                                   l.params[0].options().dtype(at::kByte));
  C10_CUDA_CHECK(launch(args, h, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  for (const auto& r : copies) r.finish();
}

// sgd_step_ / adam_step_: see the contracts in csrc/ops/registration.cpp and the CPU versions.
void sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                   at::TensorList momentum_buffers, at::TensorList steps, double lr,
                   const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize,
                   const std::optional<at::Tensor>& grad_scale,
                   const std::optional<at::Tensor>& found_inf,
                   const std::optional<at::Tensor>& clip_coef) {
  detail::OptimLists l{params, grads, master_params, {momentum_buffers}, {"momentum_buffers"}, steps};
  const c10::Device device = detail::check_optim_args(l, lr_tensor, grad_scale, found_inf, clip_coef);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize};
  detail::check_sgd_hyper(h, l);
  optim_step_cuda(l, h, device, &launch_sgd_step, lr_tensor, grad_scale, found_inf, clip_coef);
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                    at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    at::TensorList max_exp_avg_sqs, at::TensorList steps, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize,
                    bool decoupled_weight_decay, const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& clip_coef) {
  detail::OptimLists l{params, grads, master_params,
                       {exp_avgs, exp_avg_sqs, max_exp_avg_sqs},
                       {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"}, steps};
  const c10::Device device = detail::check_optim_args(l, lr_tensor, grad_scale, found_inf, clip_coef);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay};
  detail::check_adam_hyper(h, l);
  optim_step_cuda(l, h, device, &launch_adam_step, lr_tensor, grad_scale, found_inf, clip_coef);
}

}  // namespace
}  // namespace ampfuse::cuda

TORCH_LIBRARY_IMPL(ampfuse, CUDA, m) {
  m.impl("unscale_check_", &ampfuse::cuda::unscale_check_cuda);
  m.impl("unscale_check_norm_", &ampfuse::cuda::unscale_check_norm_cuda);
  m.impl("check_norm_", &ampfuse::cuda::check_norm_cuda);
  m.impl("update_scale_", &ampfuse::cuda::update_scale_cuda);
  m.impl("accumulate_grads_", &ampfuse::cuda::accumulate_grads_cuda);
  m.impl("sgd_step_", &ampfuse::cuda::sgd_step_cuda);
  m.impl("adam_step_", &ampfuse::cuda::adam_step_cuda);
}

// Sparse tensors are rejected with a clear message by the shared argument checks (GradScaler passes
// a sparse gradient's coalesced values() instead, as torch's does).
TORCH_LIBRARY_IMPL(ampfuse, SparseCUDA, m) {
  m.impl("unscale_check_", &ampfuse::cuda::unscale_check_cuda);
  m.impl("unscale_check_norm_", &ampfuse::cuda::unscale_check_norm_cuda);
  m.impl("check_norm_", &ampfuse::cuda::check_norm_cuda);
}
