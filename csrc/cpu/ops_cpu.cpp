// CPU implementations of the ampfuse ops: argument checks, flat views, capability dispatch, and the
// TORCH_LIBRARY_IMPL(ampfuse, CPU) block at the bottom. The math is in csrc/cpu/kernels/.
#include <ATen/ops/empty.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu/kernels/kernels.h"
#include "ops/checks.h"

namespace ampfuse::cpu {

const KernelTable& kernels() {
  static const KernelTable* table = [] {
    const std::string cap = at::get_cpu_capability();
#ifdef AMPFUSE_HAVE_AVX512
    if (cap == "AVX512") return &AVX512::kernel_table();
#endif
#ifdef AMPFUSE_HAVE_AVX2
    if (cap == "AVX2" || cap == "AVX512") return &AVX2::kernel_table();
#endif
    return &DEFAULT::kernel_table();
  }();
  return *table;
}

namespace {

using detail::FlatTensor;

// Shared body of unscale_check_, unscale_check_norm_ and check_norm_.
std::tuple<at::Tensor, at::Tensor> unscale_check_impl(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  std::vector<FlatTensor> copies;
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (const auto& t : tensors) {
    spans.push_back({detail::flat_data(t, copies), t.numel(), t.scalar_type()});
  }
  std::vector<uint8_t> per_tensor(per_tensor_found_inf ? tensors.size() : 0, 0);
  bool any_nonfinite = false;
  float total_norm = 0.0f;
  UnscaleCheckArgs args{spans.data(),
                        static_cast<int64_t>(spans.size()),
                        *inv_scale.const_data_ptr<float>(),
                        write_back,
                        norm,
                        &any_nonfinite,
                        per_tensor_found_inf ? per_tensor.data() : nullptr,
                        &total_norm};
  kernels().unscale_check(args);
  if (write_back) {
    for (const auto& f : copies) f.finish();
  }
  if (any_nonfinite) *found_inf.mutable_data_ptr<float>() = 1.0f;
  if (per_tensor_found_inf) {
    float* flags = per_tensor_found_inf->mutable_data_ptr<float>();
    for (size_t i = 0; i < per_tensor.size(); ++i) {
      if (per_tensor[i]) flags[i] = 1.0f;
    }
  }
  if (norm == NormKind::None) return {};
  const float coef = max_norm ? clip_coefficient(total_norm, static_cast<float>(*max_norm)) : 1.0f;
  auto opts = at::TensorOptions().dtype(at::kFloat).device(found_inf.device());
  at::Tensor norm_t = at::empty({}, opts);
  at::Tensor coef_t = at::empty({}, opts);
  *norm_t.mutable_data_ptr<float>() = total_norm;
  *coef_t.mutable_data_ptr<float>() = coef;
  return {norm_t, coef_t};
}

// unscale_check_: see the contract in csrc/ops/registration.cpp.
//   tensors: fp16/bf16/fp32/fp64 tensors on the CPU, any layout; multiplied in place.
//   found_inf: 1-element fp32; set to 1.0 if any element is inf/NaN. The caller zeroes it.
//   inv_scale: 1-element fp32.
void unscale_check_cpu(at::TensorList tensors, const at::Tensor& found_inf,
                       const at::Tensor& inv_scale) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/true, NormKind::None,
                     std::nullopt, std::nullopt);
}

// unscale_check_norm_ / check_norm_: as unscale_check_, plus the norm (2 or inf) of the unscaled
// values and the clip coefficient. Returns (total_norm, clip_coef) as 0-dim fp32 tensors.
std::tuple<at::Tensor, at::Tensor> unscale_check_norm_cpu(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/true,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf);
}

std::tuple<at::Tensor, at::Tensor> check_norm_cpu(
    at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
    double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf) {
  detail::check_unscale_args(tensors, found_inf, inv_scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(tensors, found_inf, inv_scale, /*write_back=*/false,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf);
}

// accumulate_grads_: see the contract in csrc/ops/registration.cpp.
//   accumulators: fp32, any layout; += grads. grads: fp16/bf16/fp32; zeroed when zero_grads.
//   found_inf: set to 1.0 if a grad element is inf/NaN (the caller zeroes it once per window).
void accumulate_grads_cpu(at::TensorList accumulators, at::TensorList grads,
                          const at::Tensor& found_inf, bool zero_grads) {
  detail::check_accumulate_args(accumulators, grads, found_inf);
  // Accumulator and grad are walked in one element order; the grad is written only to zero it.
  std::vector<detail::FlatRow> copies;
  std::vector<Span> acc_spans(grads.size()), grad_spans(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor* row[2] = {&accumulators[i], &grads[i]};
    void* ptrs[2];
    detail::flat_pointers(row, 2, zero_grads ? 0u : 2u, ptrs, copies);
    acc_spans[i] = {ptrs[0], grads[i].numel(), c10::kFloat};
    grad_spans[i] = {ptrs[1], grads[i].numel(), grads[i].scalar_type()};
  }
  bool any_nonfinite = false;
  kernels().accumulate({acc_spans.data(), grad_spans.data(), static_cast<int64_t>(grads.size()),
                        zero_grads, &any_nonfinite});
  for (const auto& r : copies) r.finish();
  if (any_nonfinite) *found_inf.mutable_data_ptr<float>() = 1.0f;
}

// update_scale_: one application of the scale rule (csrc/ops/rules.h) to CPU state tensors.
void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                      int64_t growth_interval, int64_t hysteresis,
                      const std::optional<at::Tensor>& hysteresis_tracker,
                      bool consecutive_hysteresis, std::optional<double> min_scale,
                      std::optional<double> max_scale, const std::optional<at::Tensor>& stats) {
  const ScaleRuleParams p = detail::check_update_scale_args(
      scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
      hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale, stats);
  update_scale_rule(scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
                    *found_inf.const_data_ptr<float>(),
                    hysteresis_tracker ? hysteresis_tracker->mutable_data_ptr<int32_t>() : nullptr,
                    stats ? stats->mutable_data_ptr<int64_t>() : nullptr, p);
}

// Shared body of the fused optimizer steps on CPU: skip on found_inf, flatten, run, write back.
template <typename Hyper>
void optim_step_cpu(const detail::OptimLists& l, const Hyper& h,
                    void (*kernel)(const OptimArgs&, const Hyper&),
                    const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf,
                    const std::optional<at::Tensor>& clip_coef) {
  if (found_inf && *found_inf->const_data_ptr<float>() != 0.0f) return;  // skipped step
  const size_t n = l.params.size();
  if (n == 0) return;
  std::vector<detail::FlatRow> copies;
  const bool has_master = !l.masters.empty();
  std::vector<void*> params(n);
  std::vector<const void*> grads(n);
  std::vector<float*> masters(has_master ? n : 0);
  std::vector<std::vector<float*>> states(l.states.size(), std::vector<float*>(n, nullptr));
  std::vector<float*> steps(n);
  std::vector<int64_t> numels(n);
  void* row[detail::kRowPointers];
  for (size_t i = 0; i < n; ++i) {
    detail::row_pointers(l, i, row, copies);
    params[i] = row[0];
    grads[i] = row[1];
    if (has_master) masters[i] = static_cast<float*>(row[2]);
    for (size_t k = 0; k < l.states.size(); ++k) states[k][i] = static_cast<float*>(row[3 + k]);
    steps[i] = l.steps[i].mutable_data_ptr<float>();
    numels[i] = l.params[i].numel();
  }
  auto state_ptrs = [&](size_t k) -> float* const* {
    return k < l.states.size() && !l.states[k].empty() ? states[k].data() : nullptr;
  };
  OptimArgs args{static_cast<int64_t>(n),
                 params.data(),
                 grads.data(),
                 has_master ? masters.data() : nullptr,
                 state_ptrs(0),
                 state_ptrs(1),
                 state_ptrs(2),
                 steps.data(),
                 numels.data(),
                 l.params[0].scalar_type(),
                 l.grads[0].scalar_type(),
                 lr_tensor ? static_cast<double>(*lr_tensor->const_data_ptr<float>()) : h.lr,
                 grad_scale ? *grad_scale->const_data_ptr<float>() : 1.0f,
                 clip_coef ? *clip_coef->const_data_ptr<float>() : 1.0f};
  kernel(args, h);
  for (const auto& r : copies) r.finish();
}

// sgd_step_: see the contract in csrc/ops/registration.cpp.
//   params: fp16/bf16/fp32 (one dtype), updated in place (rounded from the fp32 result).
//   grads: fp16/bf16/fp32 (one dtype), read only. master_params: fp32 or empty.
//   momentum_buffers: fp32, one per param when momentum != 0. steps: fp32 counters, +1 each.
//   found_inf: when non-zero nothing is modified. Caller zeroes it.
void sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList master_params,
                  at::TensorList momentum_buffers, at::TensorList steps, double lr,
                  const std::optional<at::Tensor>& lr_tensor, double momentum, double dampening,
                  double weight_decay, bool nesterov, bool maximize,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& clip_coef) {
  detail::OptimLists l{params, grads, master_params, {momentum_buffers}, {"momentum_buffers"}, steps};
  detail::check_optim_args(l, lr_tensor, grad_scale, found_inf, clip_coef);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize};
  detail::check_sgd_hyper(h, l);
  optim_step_cpu(l, h, kernels().sgd_step, lr_tensor, grad_scale, found_inf, clip_coef);
}

// adam_step_: as sgd_step_, with exp_avgs/exp_avg_sqs (and max_exp_avg_sqs for amsgrad) fp32.
void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList master_params,
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
  detail::check_optim_args(l, lr_tensor, grad_scale, found_inf, clip_coef);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay};
  detail::check_adam_hyper(h, l);
  optim_step_cpu(l, h, kernels().adam_step, lr_tensor, grad_scale, found_inf, clip_coef);
}

}  // namespace
}  // namespace ampfuse::cpu

// Diagnostics for tests and bug reports (read from Python through ctypes).
extern "C" __attribute__((visibility("default"))) const char* ampfuse_cpu_capability() {
  return ampfuse::cpu::kernels().capability;
}
extern "C" __attribute__((visibility("default"))) int ampfuse_cpu_parallel_threads_used() {
  return ampfuse::cpu::kernels().parallel_threads_used();
}

TORCH_LIBRARY_IMPL(ampfuse, CPU, m) {
  m.impl("unscale_check_", &ampfuse::cpu::unscale_check_cpu);
  m.impl("unscale_check_norm_", &ampfuse::cpu::unscale_check_norm_cpu);
  m.impl("check_norm_", &ampfuse::cpu::check_norm_cpu);
  m.impl("update_scale_", &ampfuse::cpu::update_scale_cpu);
  m.impl("accumulate_grads_", &ampfuse::cpu::accumulate_grads_cpu);
  m.impl("sgd_step_", &ampfuse::cpu::sgd_step_cpu);
  m.impl("adam_step_", &ampfuse::cpu::adam_step_cpu);
}

// Sparse tensors are rejected with a clear message by the shared argument checks (GradScaler passes
// a sparse gradient's coalesced values() instead, as torch's does).
TORCH_LIBRARY_IMPL(ampfuse, SparseCPU, m) {
  m.impl("unscale_check_", &ampfuse::cpu::unscale_check_cpu);
  m.impl("unscale_check_norm_", &ampfuse::cpu::unscale_check_norm_cpu);
  m.impl("check_norm_", &ampfuse::cpu::check_norm_cpu);
}
