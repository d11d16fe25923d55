// The backend-neutral op layer (see op_layer.h): validation, flattening, argument structs,
// workspace, one call of the backend's kernel table, write-back of copies.
#include "ops/op_layer.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops/call_resources.h"
#include "ops/flatten.h"
#include "ops/op_core.h"
#include "ops/validation.h"

namespace ampfuse::ops {
namespace {

using detail::FlatRow;
using detail::FlatTensor;

void check_status(const kernels::KernelTable& table, int status, detail::CallResources& res,
                  const char* op) {
  if (status == 0) return;
  res.failed();
  TORCH_CHECK(false, "ampfuse.", op, ": the ", table.name, " kernel failed: ",
              table.error_string(status));
}

template <typename T>
T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->mutable_data_ptr<T>() : nullptr;
}

template <typename T>
const T* const_ptr_or_null(const std::optional<at::Tensor>& t) {
  return t ? t->const_data_ptr<T>() : nullptr;
}

}  // namespace

namespace core {

OptimDTypes optim_dtypes(const detail::OptimLists& l) {
  // Validated: masters fp32 or int16 (remainders), state lists of one dtype.
  OptimDTypes dt;
  dt.param = detail::kernel_dtype(l.params[0].scalar_type());
  dt.grad = detail::kernel_dtype(l.grads[0].scalar_type());
  if (!l.masters.empty()) {
    dt.master = l.masters[0].scalar_type() == c10::kShort ? kernels::MasterKind::Remainder
                                                          : kernels::MasterKind::Float;
  }
  for (size_t k = 0; k < l.states.size(); ++k) {
    if (l.states[k].empty()) continue;
    const auto f = detail::state_quant_format(l.states[k][0].scalar_type(),
                                              k < l.nonnegative.size() && l.nonnegative[k]);
    if (f) {
      dt.quantized = true;
      dt.formats[k] = *f;
    } else {
      dt.state = detail::kernel_dtype(l.states[k][0].scalar_type());
    }
  }
  return dt;
}

std::tuple<at::Tensor, at::Tensor> unscale_check(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const detail::ScaleArg& scale, bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, bool overwrite_found_inf,
    const char* op) {
  // An fp64 tensor's norm may exceed the float range while every value is finite: with one in the
  // list the norm is accumulated and returned in fp64 (as torch's clip_grad_norm_ does).
  bool norm_fp64 = false;
  for (const auto& t : tensors) norm_fp64 |= t.scalar_type() == c10::kDouble;
  std::vector<FlatTensor> copies;
  std::vector<kernels::TensorRef> refs;
  if (b.table != nullptr) {
    const c10::DeviceGuard guard(found_inf.device());
    refs.reserve(tensors.size());
    for (const auto& t : tensors) {
      refs.push_back({detail::flat_data(t, copies), t.numel(), detail::kernel_dtype(t.scalar_type())});
    }
  }
  auto out = unscale_check_refs(b, refs, norm_fp64, found_inf, scale, write_back, norm, max_norm,
                                per_tensor_found_inf, overwrite_found_inf, op);
  if (write_back) {
    for (const auto& f : copies) f.finish();
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> unscale_check_refs(
    const Backend& b, const std::vector<kernels::TensorRef>& refs, bool norm_fp64,
    const at::Tensor& found_inf, const detail::ScaleArg& scale, bool write_back, NormKind norm,
    std::optional<double> max_norm, const std::optional<at::Tensor>& per_tensor_found_inf,
    bool overwrite_found_inf, const char* op) {
  const c10::Device device = found_inf.device();
  at::Tensor total_norm, clip_coef;
  if (norm != NormKind::None) {
    total_norm = at::empty({}, found_inf.options().dtype(norm_fp64 ? at::kDouble : at::kFloat));
    clip_coef = at::empty({}, found_inf.options());
  }
  if (b.table == nullptr) return {total_norm, clip_coef};  // validation only
  const c10::DeviceGuard guard(device);
  kernels::UnscaleCheckArgs args{};
  args.tensors = refs.data();
  args.num_tensors = static_cast<int64_t>(refs.size());
  (scale.is_inverse ? args.inv_scale : args.scale) = scale.tensor->const_data_ptr<float>();
  args.found_inf = found_inf.mutable_data_ptr<float>();
  args.overwrite_found_inf = overwrite_found_inf;
  args.per_tensor_found_inf = ptr_or_null<float>(per_tensor_found_inf);
  args.write_back = write_back;
  args.norm = norm;
  args.norm_fp64 = norm_fp64;
  args.total_norm = total_norm.defined() ? total_norm.mutable_data_ptr() : nullptr;
  args.clip_coef = clip_coef.defined() ? clip_coef.mutable_data_ptr<float>() : nullptr;
  args.has_max_norm = max_norm.has_value();
  args.max_norm = max_norm.value_or(0.0);
  detail::CallResources res(b, device);
  const kernels::KernelTable& table = b.table();
  void* ws = res.workspace(detail::CallResources::Kind::UnscaleCheck,
                           table.unscale_check_workspace(args, res.ctx()));
  check_status(table, table.unscale_check(args, ws, res.ctx()), res, op);
  return {total_norm, clip_coef};
}

}  // namespace core

namespace {

// The kernel call of a fused optimizer step over prepared rows (pointers of validated tensors).
template <typename Hyper>
void launch_optim(const Backend& b, const kernels::OptimTensor* rows, int64_t n,
                  const core::OptimDTypes& dt, const Hyper& h, const c10::Device& device,
                  int (*kernels::KernelTable::*entry)(const kernels::OptimArgs&, const Hyper&,
                                                      void*, const kernels::LaunchContext&),
                  const detail::HyperTensors& hyper_tensors,
                  const std::optional<at::Tensor>& grad_scale,
                  const std::optional<at::Tensor>& found_inf,
                  const std::optional<at::Tensor>& clip_coef, const char* op) {
  if (n == 0 || b.table == nullptr) return;
  const c10::DeviceGuard guard(device);
  // bf16 params without masters under a rounding seed are rounded stochastically.
  const bool stochastic = h.stochastic_rounding && dt.param == kernels::DType::BFloat16 &&
                          dt.master == kernels::MasterKind::None;
  kernels::OptimArgs args{rows,
                          n,
                          dt.param,
                          dt.grad,
                          stochastic ? kernels::MasterKind::Stochastic : dt.master,
                          dt.state,
                          dt.quantized,
                          {dt.formats[0], dt.formats[1], dt.formats[2]},
                          const_ptr_or_null<float>(hyper_tensors.lr),
                          const_ptr_or_null<float>(hyper_tensors.momentum),
                          const_ptr_or_null<float>(grad_scale),
                          const_ptr_or_null<float>(found_inf),
                          const_ptr_or_null<float>(clip_coef)};
  detail::CallResources res(b, device);
  const kernels::KernelTable& table = b.table();
  void* ws = res.workspace(detail::CallResources::Kind::Optim, table.optim_workspace(args, res.ctx()));
  check_status(table, (table.*entry)(args, h, ws, res.ctx()), res, op);
}

// Shared body of the fused optimizer steps (arguments validated and overlap-checked).
template <typename Hyper>
void optim_step_impl(const Backend& b, const detail::OptimLists& l, const Hyper& h,
                     const c10::Device& device,
                     int (*kernels::KernelTable::*entry)(const kernels::OptimArgs&, const Hyper&,
                                                         void*, const kernels::LaunchContext&),
                     const detail::HyperTensors& hyper_tensors,
                     const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& clip_coef, const char* op) {
  const size_t n = l.params.size();
  if (n == 0 || b.table == nullptr) return;
  std::vector<FlatRow> copies;
  std::vector<kernels::OptimTensor> tensors(n);
  void* row[detail::kRowPointers];
  for (size_t i = 0; i < n; ++i) {
    detail::row_pointers(l, i, row, copies);
    kernels::OptimTensor& o = tensors[i];
    o.param = row[0];
    o.grad = row[1];
    o.master = row[2];
    for (size_t k = 0; k < 3; ++k) o.state[k] = row[3 + k];
    o.step = l.steps[i].mutable_data_ptr<float>();
    o.numel = l.params[i].numel();
    for (size_t k = 0; k < 3; ++k) {
      o.absmax[k] = k < l.absmaxes.size() && !l.absmaxes[k].empty()
                        ? l.absmaxes[k][i].mutable_data_ptr<float>()
                        : nullptr;
    }
  }
  launch_optim(b, tensors.data(), static_cast<int64_t>(n), core::optim_dtypes(l), h, device, entry,
               hyper_tensors, grad_scale, found_inf, clip_coef, op);
  for (const auto& r : copies) r.finish();
}

void check_optim_overlap(const detail::OptimLists& l, const detail::HyperTensors& hyper_tensors,
                         const std::optional<at::Tensor>& grad_scale,
                         const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& clip_coef) {
  detail::OverlapCheck overlap;
  overlap.add(l.params, "params", true);
  overlap.add(l.grads, "grads", false);
  overlap.add(l.masters, "master_params", true);
  for (size_t k = 0; k < l.states.size(); ++k) overlap.add(l.states[k], l.state_names[k], true);
  for (size_t k = 0; k < l.absmaxes.size(); ++k) overlap.add(l.absmaxes[k], l.absmax_names[k], true);
  overlap.add(l.steps, "steps", true);
  overlap.add(hyper_tensors.lr, "lr_tensor", false);
  overlap.add(hyper_tensors.momentum, hyper_tensors.momentum_name, false);
  overlap.add(grad_scale, "grad_scale", false);
  overlap.add(found_inf, "found_inf", false);
  overlap.add(clip_coef, "clip_coef", false);
  overlap.check();
}

std::tuple<at::Tensor, at::Tensor> unscale_check_impl(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const detail::ScaleArg& scale, bool write_back, NormKind norm, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, bool overwrite_found_inf,
    const char* op) {
  detail::OverlapCheck overlap;
  overlap.add(tensors, "tensors", write_back);
  overlap.add(found_inf, "found_inf", true);
  overlap.add(*scale.tensor, scale.name, false);
  overlap.add(per_tensor_found_inf, "per_tensor_found_inf", true);
  overlap.check();
  return core::unscale_check(b, tensors, found_inf, scale, write_back, norm, max_norm,
                             per_tensor_found_inf, overwrite_found_inf, op);
}

}  // namespace

namespace core {

void sgd_step(const Backend& b, const detail::OptimLists& l, const SgdHyper& h,
              const c10::Device& device, const detail::HyperTensors& hyper_tensors,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef) {
  optim_step_impl(b, l, h, device, &kernels::KernelTable::sgd_step, hyper_tensors, grad_scale,
                  found_inf, clip_coef, "sgd_step_");
}

void adam_step(const Backend& b, const detail::OptimLists& l, const AdamHyper& h,
               const c10::Device& device, const detail::HyperTensors& hyper_tensors,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef) {
  optim_step_impl(b, l, h, device, &kernels::KernelTable::adam_step, hyper_tensors, grad_scale,
                  found_inf, clip_coef, "adam_step_");
}

void sgd_rows(const Backend& b, const kernels::OptimTensor* rows, int64_t n,
              const OptimDTypes& dt, const SgdHyper& h, const c10::Device& device,
              const detail::HyperTensors& hyper_tensors,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef) {
  launch_optim(b, rows, n, dt, h, device, &kernels::KernelTable::sgd_step, hyper_tensors, grad_scale,
               found_inf, clip_coef, "sgd_step_");
}

void adam_rows(const Backend& b, const kernels::OptimTensor* rows, int64_t n,
               const OptimDTypes& dt, const AdamHyper& h, const c10::Device& device,
               const detail::HyperTensors& hyper_tensors,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef) {
  launch_optim(b, rows, n, dt, h, device, &kernels::KernelTable::adam_step, hyper_tensors, grad_scale,
               found_inf, clip_coef, "adam_step_");
}

}  // namespace core

void unscale_check(const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& scale, bool overwrite_found_inf) {
  const detail::ScaleArg s = detail::check_unscale_args(tensors, found_inf, inv_scale, scale);
  unscale_check_impl(b, tensors, found_inf, s, /*write_back=*/true, NormKind::None,
                     std::nullopt, std::nullopt, overwrite_found_inf, "unscale_check_");
}

std::tuple<at::Tensor, at::Tensor> unscale_check_norm(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const std::optional<at::Tensor>& inv_scale, double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf) {
  const detail::ScaleArg s = detail::check_unscale_args(tensors, found_inf, inv_scale, scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(b, tensors, found_inf, s, /*write_back=*/true,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf,
                            overwrite_found_inf, "unscale_check_norm_");
}

std::tuple<at::Tensor, at::Tensor> check_norm(
    const Backend& b, at::TensorList tensors, const at::Tensor& found_inf,
    const std::optional<at::Tensor>& inv_scale, double norm_type, std::optional<double> max_norm,
    const std::optional<at::Tensor>& per_tensor_found_inf, const std::optional<at::Tensor>& scale,
    bool overwrite_found_inf) {
  const detail::ScaleArg s = detail::check_unscale_args(tensors, found_inf, inv_scale, scale);
  detail::check_norm_args(norm_type, max_norm, per_tensor_found_inf, tensors.size(),
                          found_inf.device());
  return unscale_check_impl(b, tensors, found_inf, s, /*write_back=*/false,
                            detail::norm_kind(norm_type), max_norm, per_tensor_found_inf,
                            overwrite_found_inf, "check_norm_");
}

void update_scale(const Backend& b, const at::Tensor& scale, const at::Tensor& growth_tracker,
                  const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                  int64_t growth_interval, int64_t hysteresis,
                  const std::optional<at::Tensor>& hysteresis_tracker, bool consecutive_hysteresis,
                  std::optional<double> min_scale, std::optional<double> max_scale,
                  const std::optional<at::Tensor>& stats) {
  const ScaleRuleParams p = detail::check_update_scale_args(
      scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, hysteresis,
      hysteresis_tracker, consecutive_hysteresis, min_scale, max_scale, stats);
  detail::OverlapCheck overlap;
  overlap.add(scale, "scale", true);
  overlap.add(growth_tracker, "growth_tracker", true);
  overlap.add(found_inf, "found_inf", false);
  overlap.add(hysteresis_tracker, "hysteresis_tracker", true);
  overlap.add(stats, "stats", true);
  overlap.check();
  if (b.table == nullptr) return;
  const c10::Device device = scale.device();
  const c10::DeviceGuard guard(device);
  const kernels::UpdateScaleArgs args{scale.mutable_data_ptr<float>(),
                                      growth_tracker.mutable_data_ptr<int32_t>(),
                                      found_inf.const_data_ptr<float>(),
                                      ptr_or_null<int32_t>(hysteresis_tracker),
                                      ptr_or_null<int64_t>(stats),
                                      p};
  detail::CallResources res(b, device);
  const kernels::KernelTable& table = b.table();
  check_status(table, table.update_scale(args, res.ctx()), res, "update_scale_");
}

at::Tensor clip_coef(const Backend& b, const at::Tensor& total_norm, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& max_norm_tensor) {
  detail::check_clip_coef_args(total_norm, max_norm, max_norm_tensor);
  at::Tensor out = at::empty({}, total_norm.options().dtype(at::kFloat));
  if (b.table == nullptr) return out;
  const c10::Device device = total_norm.device();
  const c10::DeviceGuard guard(device);
  kernels::ClipCoefArgs args{};
  args.total_norm = total_norm.const_data_ptr();
  args.norm_fp64 = total_norm.scalar_type() == at::kDouble;
  args.max_norm_tensor = max_norm_tensor ? max_norm_tensor->const_data_ptr<float>() : nullptr;
  args.max_norm = max_norm.value_or(0.0);
  args.clip_coef = out.mutable_data_ptr<float>();
  detail::CallResources res(b, device);
  const kernels::KernelTable& table = b.table();
  check_status(table, table.clip_coef(args, res.ctx()), res, "clip_coef");
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_blocks(const Backend& b, const at::Tensor& values,
                                                   c10::ScalarType dtype, bool nonnegative) {
  const QuantFormat format = detail::check_quantize_args(values, dtype, nonnegative);
  const c10::SymInt blocks = (values.sym_numel() + (kQuantBlock - 1)) / kQuantBlock;
  at::Tensor codes = at::empty_symint(values.sym_sizes(), values.options().dtype(dtype));
  at::Tensor absmax = at::empty_symint({blocks}, values.options());
  if (b.table == nullptr || values.numel() == 0) return {codes, absmax};
  const c10::DeviceGuard guard(values.device());
  const at::Tensor flat = values.contiguous();
  kernels::QuantizeArgs args{};
  args.values = flat.const_data_ptr<float>();
  args.codes = static_cast<uint8_t*>(codes.mutable_data_ptr());
  args.absmax = absmax.mutable_data_ptr<float>();
  args.numel = values.numel();
  args.format = format;
  args.nonnegative = nonnegative;
  detail::CallResources res(b, values.device());
  const kernels::KernelTable& table = b.table();
  check_status(table, table.quantize(args, res.ctx()), res, "quantize_blocks");
  return {codes, absmax};
}

at::Tensor dequantize_blocks(const Backend& b, const at::Tensor& codes, const at::Tensor& absmax,
                             bool nonnegative) {
  const QuantFormat format = detail::check_dequantize_args(codes, absmax, nonnegative);
  at::Tensor values = at::empty_symint(codes.sym_sizes(), codes.options().dtype(at::kFloat));
  if (b.table == nullptr || codes.numel() == 0) return values;
  const c10::DeviceGuard guard(codes.device());
  const at::Tensor flat = codes.contiguous();
  const at::Tensor scales = absmax.contiguous();
  kernels::DequantizeArgs args{};
  args.codes = static_cast<const uint8_t*>(flat.const_data_ptr());
  args.absmax = scales.const_data_ptr<float>();
  args.values = values.mutable_data_ptr<float>();
  args.numel = codes.numel();
  args.format = format;
  detail::CallResources res(b, codes.device());
  const kernels::KernelTable& table = b.table();
  check_status(table, table.dequantize(args, res.ctx()), res, "dequantize_blocks");
  return values;
}

void accumulate_grads(const Backend& b, at::TensorList accumulators, at::TensorList grads,
                      const at::Tensor& found_inf, bool zero_grads) {
  detail::check_accumulate_args(accumulators, grads, found_inf);
  detail::OverlapCheck overlap;
  overlap.add(accumulators, "accumulators", true);
  overlap.add(grads, "grads", zero_grads);
  overlap.add(found_inf, "found_inf", true);
  overlap.check();
  if (b.table == nullptr) return;
  const c10::Device device = found_inf.device();
  const c10::DeviceGuard guard(device);
  // Accumulator and grad are walked in one element order; the grad is written only to zero it.
  std::vector<FlatRow> copies;
  std::vector<float*> acc_ptrs(grads.size());
  std::vector<kernels::TensorRef> grad_refs(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor* row[2] = {&accumulators[i], &grads[i]};
    void* ptrs[2];
    detail::flat_pointers(row, 2, zero_grads ? 0u : 2u, ptrs, copies);
    acc_ptrs[i] = static_cast<float*>(ptrs[0]);
    grad_refs[i] = {ptrs[1], grads[i].numel(), detail::kernel_dtype(grads[i].scalar_type())};
  }
  core::accumulate_rows(b, acc_ptrs.data(), grad_refs.data(), static_cast<int64_t>(grads.size()),
                        zero_grads, found_inf);
  for (const auto& r : copies) r.finish();
}

void core::accumulate_rows(const Backend& b, float* const* accumulators,
                           const kernels::TensorRef* grads, int64_t n, bool zero_grads,
                           const at::Tensor& found_inf) {
  if (b.table == nullptr || n == 0) return;
  const c10::Device device = found_inf.device();
  const c10::DeviceGuard guard(device);
  const kernels::AccumulateArgs args{accumulators, grads, n, zero_grads,
                                     found_inf.mutable_data_ptr<float>()};
  detail::CallResources res(b, device);
  const kernels::KernelTable& table = b.table();
  check_status(table, table.accumulate(args, res.ctx()), res, "accumulate_grads_");
}

void sgd_step(const Backend& b, at::TensorList params, at::TensorList grads,
              at::TensorList master_params, at::TensorList momentum_buffers, at::TensorList steps,
              double lr, const std::optional<at::Tensor>& lr_tensor, double momentum,
              const std::optional<at::Tensor>& momentum_tensor, double dampening, double weight_decay, bool nesterov, bool maximize,
              const std::optional<at::Tensor>& grad_scale,
              const std::optional<at::Tensor>& found_inf,
              const std::optional<at::Tensor>& clip_coef, at::TensorList momentum_absmax,
              std::optional<int64_t> rounding_seed) {
  const detail::OptimLists l{params, grads, master_params, {momentum_buffers},
                             {"momentum_buffers"}, steps, {momentum_absmax},
                             {"momentum_absmax"}, {false}};
  const detail::HyperTensors ht{lr_tensor, momentum_tensor, "momentum_tensor"};
  const c10::Device device =
      detail::check_optim_args(l, ht, grad_scale, found_inf, clip_coef);
  const SgdHyper h{lr, momentum, dampening, weight_decay, nesterov, maximize,
                   rounding_seed.has_value(), rounding_seed.value_or(0)};
  detail::check_sgd_hyper(h, l, momentum_tensor.has_value());
  check_optim_overlap(l, ht, grad_scale, found_inf, clip_coef);
  core::sgd_step(b, l, h, device, ht, grad_scale, found_inf, clip_coef);
}

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
               std::optional<int64_t> rounding_seed) {
  const detail::OptimLists l{params,
                             grads,
                             master_params,
                             {exp_avgs, exp_avg_sqs, max_exp_avg_sqs},
                             {"exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"},
                             steps,
                             {exp_avg_absmax, exp_avg_sq_absmax, max_exp_avg_sq_absmax},
                             {"exp_avg_absmax", "exp_avg_sq_absmax", "max_exp_avg_sq_absmax"},
                             {false, true, true}};
  const detail::HyperTensors ht{lr_tensor, beta1_tensor, "beta1_tensor"};
  const c10::Device device = detail::check_optim_args(l, ht, grad_scale, found_inf, clip_coef);
  const AdamHyper h{lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay,
                    rounding_seed.has_value(), rounding_seed.value_or(0)};
  detail::check_adam_hyper(h, l);
  check_optim_overlap(l, ht, grad_scale, found_inf, clip_coef);
  core::adam_step(b, l, h, device, ht, grad_scale, found_inf, clip_coef);
}

namespace {
const Backend* g_device_backends[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)] = {};
}  // namespace

const Backend* device_backend(c10::DeviceType type) {
  const auto i = static_cast<int>(type);
  return i >= 0 && i < static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)
             ? g_device_backends[i]
             : nullptr;
}

void set_device_backend(c10::DeviceType type, const Backend* backend) {
  g_device_backends[static_cast<int>(type)] = backend;
}

}  // namespace ampfuse::ops
