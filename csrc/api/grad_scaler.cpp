// ampfuse::GradScaler for LibTorch: the state machine of torch.amp.GradScaler (same messages) on
// top of the unscale_check_/check_norm_/update_scale_ ops, as python/ampfuse/grad_scaler.py.
#include "ampfuse/grad_scaler.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "ampfuse/optim.h"
#include "api/internals.h"
#include "engine/scaler_rules.h"

#ifdef AMPFUSE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace ampfuse {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// Whether work queued now on `device` is being captured into a CUDA graph (then nothing may wait
// for or read back the device).
bool capturing(const c10::Device& device) {
#ifdef AMPFUSE_WITH_CUDA
  if (device.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &status));
    return status != cudaStreamCaptureStatusNone;
  }
#endif
  (void)device;
  return false;
}

optim::FusedOptimizer* as_fused(torch::optim::Optimizer& optimizer) {
  return dynamic_cast<optim::FusedOptimizer*>(&optimizer);
}

// One tensor per device: `t` itself on its own device, a copy elsewhere (torch's
// _MultiDeviceReplicator).
class Replicator {
 public:
  explicit Replicator(at::Tensor master) : master_(std::move(master)) {}
  const at::Tensor& get(const c10::Device& device) {
    if (device == master_.device()) return master_;
    for (auto& [d, t] : copies_) {
      if (d == device) return t;
    }
    copies_.emplace_back(device, master_.to(device, /*non_blocking=*/true, /*copy=*/true));
    return copies_.back().second;
  }

 private:
  at::Tensor master_;
  std::vector<std::pair<c10::Device, at::Tensor>> copies_;
};

using DeviceGrads = std::vector<std::pair<c10::Device, std::vector<at::Tensor>>>;

std::vector<at::Tensor>& grads_on(DeviceGrads& per_device, const c10::Device& device) {
  for (auto& [d, v] : per_device) {
    if (d == device) return v;
  }
  per_device.emplace_back(device, std::vector<at::Tensor>{});
  return per_device.back().second;
}

// The gradients the optimizer will read, per device: fp32 accumulation buffers of a fused
// ampfuse optimizer as they are; .grad() checked (fp16 refused unless allow_fp16) and, if sparse,
// its (coalesced, for fp16) values.
DeviceGrads grads_per_device(torch::optim::Optimizer& optimizer, bool allow_fp16) {
  DeviceGrads per_device;
  auto* fused = as_fused(optimizer);
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      at::Tensor grad = fused != nullptr ? fused->grad_of(param) : param.grad();
      if (!grad.defined()) continue;
      if (!grad.is_same(param.grad())) {  // an fp32 accumulation buffer
        grads_on(per_device, grad.device()).push_back(grad);
        continue;
      }
      TORCH_CHECK(allow_fp16 || grad.scalar_type() != at::kHalf,
                  "Attempting to unscale FP16 gradients.");
      at::Tensor to_unscale = grad;
      if (grad.is_sparse()) {
        // As torch: check the coalesced values of fp16 sparse grads (coalescing sums
        // duplicates, which may overflow).
        if (grad.scalar_type() == at::kHalf) param.mutable_grad() = grad.coalesce();
        to_unscale = param.grad()._values();
      }
      grads_on(per_device, to_unscale.device()).push_back(to_unscale);
    }
  }
  return per_device;
}

std::vector<at::Tensor> all_params(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) params.push_back(p);
  }
  return params;
}

// Clears an optimizer's step scaling when the step returns or throws.
struct ScalingGuard {
  optim::FusedOptimizer* optimizer;
  ~ScalingGuard() { optimizer->clear_step_scaling(); }
};

}  // namespace

double detail::clip_grad_norm_of_step(torch::optim::Optimizer& optimizer, double max_norm, double norm_type) {
  auto* fused = as_fused(optimizer);
  std::vector<at::Tensor> holders;  // what clip_grad_norm_ reads: each one's grad()
  for (const auto& p : all_params(optimizer)) {
    const at::Tensor g = fused != nullptr ? fused->grad_of(p) : p.grad();
    if (!g.defined()) continue;
    if (g.is_same(p.grad())) {
      holders.push_back(p);
      continue;
    }
    at::Tensor holder = g.detach();  // an alias of the buffer, with the buffer as its grad
    holder.mutable_grad() = g;
    holders.push_back(std::move(holder));
  }
  return torch::nn::utils::clip_grad_norm_(holders, max_norm, norm_type);
}

namespace {

void check_bounds(const std::optional<double>& min_scale, const std::optional<double>& max_scale) {
  engine::check_scale_bounds(engine::optional_value(min_scale), engine::optional_value(max_scale));
}

}  // namespace

double GradScaler::clamped(double scale, const char* what) const {
  const double lo = options_.min_scale().value_or(-std::numeric_limits<double>::infinity());
  const double hi = options_.max_scale().value_or(std::numeric_limits<double>::infinity());
  if (scale >= lo && scale <= hi) return scale;
  const double c = std::min(std::max(scale, lo), hi);
  TORCH_WARN("GradScaler: ", what, " ", scale, " is outside [min_scale, max_scale] = [", lo, ", ",
             hi, "]; using ", c, ".");
  return c;
}

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)),
      init_scale_(options_.init_scale()),
      init_hysteresis_tracker_(options_.hysteresis()),
      init_stats_(kNumScaleStats, 0) {
  TORCH_CHECK(options_.hysteresis() >= 1, "hysteresis must be an integer >= 1, got ",
              options_.hysteresis(), ".");
  check_bounds(options_.min_scale(), options_.max_scale());
  engine::check_on_min_scale(c10::IValue(options_.on_min_scale()));
  if (options_.enabled()) {
    TORCH_CHECK(options_.growth_factor() > 1.0, "The growth factor must be > 1.0.");
    TORCH_CHECK(options_.backoff_factor() < 1.0, "The backoff factor must be < 1.0.");
    // what update() would refuse after a step, refused now
    engine::check_init_scale(options_.init_scale());
    engine::check_update_options(options_.growth_factor(), options_.backoff_factor(), options_.growth_interval(),
                                 options_.hysteresis());
    init_scale_ = clamped(init_scale_, "init_scale");
  }
}

// ---- lazily created device state --------------------------------------------------------------
void GradScaler::lazy_init(const c10::Device& device) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(device);
  scale_ = at::full({}, init_scale_, f32);
  growth_tracker_ = at::full({}, init_growth_tracker_, i32);
  hysteresis_tracker_ = at::full({}, init_hysteresis_tracker_, i32);
  stats_ = at::tensor(init_stats_, at::TensorOptions().dtype(at::kLong)).to(device);
}

void GradScaler::check_scale_initialised(const char* funcname) const {
  static const char* fix =
      "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the "
      "iteration.";
  TORCH_CHECK(scale_.defined(), "Attempted ", funcname, " but _scale is None.  ", fix);
  TORCH_CHECK(growth_tracker_.defined(), "Attempted ", funcname,
              " but _growth_tracker is None.  ", fix);
}

at::Tensor GradScaler::inv_scale() const {
  // As torch: the reciprocal in fp64, rounded to fp32.
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat);
}

// ---- scale ----------------------------------------------------------------------------------------
at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  TORCH_CHECK(outputs.defined(), "scale: outputs must be a defined tensor.");
  if (!scale_.defined()) lazy_init(outputs.device());
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(at::TensorList outputs) {
  std::vector<at::Tensor> scaled;
  scaled.reserve(outputs.size());
  for (const auto& t : outputs) scaled.push_back(scale(t));
  return scaled;
}

// ---- unscale --------------------------------------------------------------------------------------
GradScaler::PerDevice GradScaler::unscale_grads(torch::optim::Optimizer& optimizer,
                                                const at::Tensor& inv_scale,
                                                const at::Tensor& found_inf, bool allow_fp16) {
  // An ampfuse optimizer's step plan, when current, makes the pass itself: one native call. The
  // two callers: unscale_() (inv_scale(), fp16 refused) and the check before a fused step
  // (allow_fp16, an inv_scale of exactly 1: read only). The plan divides by the scale it is
  // given (float(1 / double(scale)), the same value as inv_scale()).
  auto* fused = as_fused(optimizer);
  if (fused != nullptr) {
    const bool check_only = allow_fp16;
    at::NoGradGuard no_grad;
    if (auto out = detail::plan_check(*fused, check_only ? inv_scale : scale_, !check_only, false, 2.0,
                                     std::nullopt, allow_fp16)) {
      PerDevice found;
      for (auto& f : *out) found.emplace_back(f.device(), f);
      return found;
    }
  }
  Replicator inv(inv_scale);
  Replicator fi(found_inf);
  DeviceGrads per_device = grads_per_device(optimizer, allow_fp16);
  PerDevice found;
  at::NoGradGuard no_grad;
  for (auto& [device, grads] : per_device) {
    unscale_check_(grads, fi.get(device), inv.get(device));
    found.emplace_back(device, fi.get(device));
  }
  return found;
}

GradScaler::OptimizerState& GradScaler::check_unscale_stage(torch::optim::Optimizer& optimizer,
                                                            const char* funcname) {
  check_scale_initialised(funcname);
  auto& state = per_optimizer_states_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != Stage::kStepped, "unscale_() is being called after step().");
  return state;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  auto& state = check_unscale_stage(optimizer, "unscale_");
  const at::Tensor found_inf = at::zeros({}, scale_.options());
  state.found_inf_per_device = unscale_grads(optimizer, inv_scale(), found_inf, false);
  state.stage = Stage::kUnscaled;
}

at::Tensor GradScaler::unscale_and_clip_(torch::optim::Optimizer& optimizer, double max_norm,
                                         double norm_type) {
  if (!options_.enabled()) {
    return at::tensor(detail::clip_grad_norm_of_step(optimizer, max_norm, norm_type));
  }
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0,
              "max_norm must be a positive finite number, got ", max_norm, ".");
  if (!(norm_type == 2.0 || norm_type == std::numeric_limits<double>::infinity())) {
    unscale_(optimizer);
    return at::tensor(detail::clip_grad_norm_of_step(optimizer, max_norm, norm_type));
  }
  auto* fused = as_fused(optimizer);
  auto& state = check_unscale_stage(optimizer, "unscale_and_clip_");
  for (const auto& p : all_params(optimizer)) {
    TORCH_CHECK(!(p.grad().defined() && p.grad().is_sparse()),
                "unscale_and_clip_ does not support sparse gradients; use unscale_() and "
                "torch::nn::utils::clip_grad_norm_().");
  }
  if (fused != nullptr) {
    // Through the optimizer's step plan when current: read only, the optimizer's step applies
    // 1/scale and the clip coefficient.
    at::NoGradGuard no_grad;
    if (auto out = detail::plan_check(*fused, scale_, false, true, norm_type, max_norm, /*allow_fp16=*/true)) {
      const bool single = out->size() == 3;  // one device: the plan computed the clip coefficient
      PerDevice found;
      std::vector<at::Tensor> norms;
      for (size_t k = 0; k < out->size(); k += 3) {
        found.emplace_back((*out)[k].device(), (*out)[k]);
        norms.push_back((*out)[k + 1].to(scale_.device()));
      }
      at::Tensor total_norm = single ? (*out)[1] : at::linalg_vector_norm(at::stack(norms), norm_type);
      state.clip_coef = single ? (*out)[2] : clip_coef(total_norm, max_norm);
      state.grads_still_scaled = true;
      state.found_inf_per_device = std::move(found);
      state.stage = Stage::kUnscaled;
      return total_norm;
    }
  }
  DeviceGrads per_device = grads_per_device(optimizer, /*allow_fp16=*/fused != nullptr);
  const at::Tensor inv = inv_scale();
  const at::Tensor found_inf = at::zeros({}, scale_.options());
  Replicator per_device_inv(inv);
  Replicator per_device_found_inf(found_inf);
  const bool single = per_device.size() <= 1;
  std::vector<at::Tensor> norms;
  at::Tensor coef;
  at::Tensor total_norm;
  PerDevice found;
  {
    at::NoGradGuard no_grad;
    for (auto& [device, grads] : per_device) {
      auto [norm, c] = check_norm_(grads, per_device_found_inf.get(device),
                                   per_device_inv.get(device), norm_type,
                                   single ? std::optional<double>(max_norm) : std::nullopt);
      norms.push_back(norm);
      coef = c;
      found.emplace_back(device, per_device_found_inf.get(device));
    }
    if (per_device.empty()) {
      total_norm = at::zeros({}, scale_.options());
      coef = at::ones({}, scale_.options());
    } else if (single) {
      total_norm = norms[0];
    } else {
      std::vector<at::Tensor> on_scale_device;
      for (const auto& n : norms) on_scale_device.push_back(n.to(scale_.device()));
      total_norm = at::linalg_vector_norm(at::stack(on_scale_device), norm_type);
      coef = clip_coef(total_norm, max_norm);  // the fused ops' rule (ops/rules.h)
    }
    if (fused != nullptr) {
      state.clip_coef = coef;
      state.grads_still_scaled = true;
    } else {
      Replicator factor((inv * coef.to(inv.device())).reshape({1}));
      for (auto& [device, grads] : per_device) {
        // found_inf is already final: setting it again is idempotent.
        unscale_check_(grads, per_device_found_inf.get(device), factor.get(device));
      }
    }
  }
  state.found_inf_per_device = std::move(found);
  state.stage = Stage::kUnscaled;
  return total_norm;
}

void GradScaler::record_inf_check(torch::optim::Optimizer& optimizer,
                                  PerDevice found_inf_per_device) {
  TORCH_CHECK(as_fused(optimizer) != nullptr,
              "An external inf check can only stand in for the check of an ampfuse optimizer.");
  for (const auto& [device, t] : found_inf_per_device) {
    TORCH_CHECK_VALUE(t.defined() && t.numel() == 1 && t.scalar_type() == at::kFloat, "found_inf for ", device,
                      " must be a 1-element float32 tensor, got ",
                      t.defined() ? c10::str(t.scalar_type(), " of shape ", t.sizes()) : std::string("undefined"),
                      ".");
  }
  auto& state = check_unscale_stage(optimizer, "unscale_");
  state.found_inf_per_device = std::move(found_inf_per_device);
  state.grads_still_scaled = true;
  state.clip_coef.reset();
  state.stage = Stage::kUnscaled;
}

const GradScaler::PerDevice& GradScaler::found_inf_per_device(torch::optim::Optimizer& optimizer) {
  return per_optimizer_states_[&optimizer].found_inf_per_device;
}

void GradScaler::discard_iteration() { per_optimizer_states_.clear(); }

// ---- step -------------------------------------------------------------------------------------------
at::Tensor GradScaler::step(torch::optim::Optimizer& optimizer, LossClosure closure) {
  if (!options_.enabled()) return optimizer.step(std::move(closure));
  TORCH_CHECK(!closure, "Closure use is not currently supported if GradScaler is enabled.");
  check_scale_initialised("step");
  auto& state = per_optimizer_states_[&optimizer];
  TORCH_CHECK(state.stage != Stage::kStepped,
              "step() has already been called since the last update().");

  if (auto* fused = as_fused(optimizer)) {
    // The optimizer divides by the scale (unless unscale_() already did), applies the clip
    // coefficient and skips on found_inf, all on the device.
    if (state.stage == Stage::kReady) {
      // Check only: an inv_scale of exactly 1 writes nothing.
      const at::Tensor one = at::ones({}, scale_.options());
      const at::Tensor found_inf = at::zeros({}, scale_.options());
      state.found_inf_per_device = unscale_grads(optimizer, one, found_inf, true);
    }
    TORCH_CHECK(!state.found_inf_per_device.empty(),
                "No inf checks were recorded for this optimizer.");
    at::Tensor found_inf;
    for (const auto& [device, t] : state.found_inf_per_device) {
      at::Tensor moved = t.to(scale_.device(), /*non_blocking=*/true);
      found_inf = found_inf.defined() ? found_inf + moved : moved;
    }
    StepScaling scaling;
    scaling.found_inf = found_inf;
    if (state.stage == Stage::kReady || state.grads_still_scaled) scaling.grad_scale = scale_;
    scaling.clip_coef = state.clip_coef;
    at::Tensor retval;
    {
      fused->set_step_scaling(std::move(scaling));
      ScalingGuard guard{fused};
      retval = optimizer.step();
    }
    state.stage = Stage::kStepped;
    return retval;
  }

  if (state.stage == Stage::kReady) unscale_(optimizer);
  TORCH_CHECK(!state.found_inf_per_device.empty(),
              "No inf checks were recorded for this optimizer.");
  // torch::optim optimizers cannot skip on the device: one host read, as in torch.
  double found = 0.0;
  for (const auto& [device, t] : state.found_inf_per_device) found += t.item<double>();
  at::Tensor retval;
  if (found == 0.0) retval = optimizer.step();
  state.stage = Stage::kStepped;
  return retval;
}

// ---- update -----------------------------------------------------------------------------------------
void GradScaler::update() {
  if (!options_.enabled()) return;
  check_scale_initialised("update");
  std::vector<at::Tensor> found_infs;
  for (const auto& [opt, state] : per_optimizer_states_) {
    for (const auto& [device, t] : state.found_inf_per_device) {
      found_infs.push_back(t.to(scale_.device(), /*non_blocking=*/true));
    }
  }
  TORCH_CHECK(!found_infs.empty(), "No inf checks were recorded prior to update.");
  // A fresh tensor: a recorded flag may be a buffer its owner resets (GradAccumulator's), and
  // last_found_inf() must keep this iteration's value.
  at::Tensor combined = found_infs[0].clone();
  for (size_t i = 1; i < found_infs.size(); ++i) combined.add_(found_infs[i]);
  if (!hysteresis_tracker_.defined() || !stats_.defined()) lazy_init(scale_.device());

  UpdateScaleOptions o;
  o.hysteresis = options_.hysteresis();
  o.hysteresis_tracker = hysteresis_tracker_;
  o.consecutive_hysteresis = options_.consecutive_hysteresis();
  o.min_scale = options_.min_scale();
  o.max_scale = options_.max_scale();
  o.stats = stats_;
  update_scale_(scale_, growth_tracker_, combined, options_.growth_factor(),
                options_.backoff_factor(), options_.growth_interval(), o);
  last_found_inf_ = combined;
  per_optimizer_states_.clear();
  if (options_.on_min_scale() != "ignore" && may_poll()) {
    poll_min_scale(/*blocking=*/false);
    if (pending_stats_.empty()) post_stats_copy();  // at most one copy in flight
  }
}

// ---- floor detection --------------------------------------------------------------------------
bool GradScaler::may_poll() const { return stats_.defined() && !capturing(stats_.device()); }

void GradScaler::post_stats_copy() {
  if (stats_.device().is_cpu()) {  // nothing to copy or wait for: read the counters
    pending_stats_.push_back({stats_, nullptr});
    poll_min_scale(/*blocking=*/false);
    return;
  }
  const c10::Device device = stats_.device();
  at::Tensor host = at::empty({kNumScaleStats}, at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda()));
  host.copy_(stats_, /*non_blocking=*/device.is_cuda());
  auto copied = std::make_shared<c10::Event>(device.type());
  copied->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  pending_stats_.push_back({std::move(host), std::move(copied)});
}

void GradScaler::poll_min_scale(bool blocking) {
  while (!pending_stats_.empty()) {
    PendingStats& next = pending_stats_.front();
    if (next.copied && !blocking && !next.copied->query()) break;
    if (next.copied && blocking) next.copied->synchronize();
    const int64_t hits = next.host[static_cast<int64_t>(ScaleStat::kFloorHits)].item<int64_t>();
    pending_stats_.erase(pending_stats_.begin());
    if (hits <= floor_hits_seen_) continue;
    const int64_t fresh = hits - floor_hits_seen_;
    floor_hits_seen_ = hits;
    const double floor = options_.min_scale().value_or(0.0) > 0.0 ? *options_.min_scale()
                                                                   : std::numeric_limits<float>::min();
    const std::string message = engine::floor_hit_message(fresh, floor);
    TORCH_CHECK(options_.on_min_scale() != "raise", message);
    TORCH_WARN(message);
  }
}

void GradScaler::check_min_scale() {
  if (!options_.enabled() || !stats_.defined() || options_.on_min_scale() == "ignore") return;
  if (pending_stats_.empty()) post_stats_copy();
  poll_min_scale(/*blocking=*/true);
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  check_scale_initialised("update");
  scale_.fill_(clamped(new_scale, "new_scale"));
  per_optimizer_states_.clear();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!options_.enabled()) return;
  check_scale_initialised("update");
  static const char* reason =
      "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor "
      "with requires_grad=False.";
  TORCH_CHECK(new_scale.defined() && new_scale.device().type() == scale_.device().type(), reason);
  TORCH_CHECK(new_scale.numel() == 1, reason);
  TORCH_CHECK(!new_scale.requires_grad(), reason);
  scale_.copy_(new_scale.reshape({}));
  if (options_.min_scale().has_value() || options_.max_scale().has_value()) {
    scale_.clamp_(options_.min_scale(), options_.max_scale());
  }
  per_optimizer_states_.clear();
}

// ---- accessors ----------------------------------------------------------------------------------
double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

at::Tensor GradScaler::get_scale_async() const { return scale_; }

int64_t GradScaler::get_growth_tracker() const {
  if (!options_.enabled()) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

double GradScaler::get_growth_factor() const { return options_.growth_factor(); }
void GradScaler::set_growth_factor(double growth_factor) {
  TORCH_CHECK(growth_factor > 1.0, "The growth factor must be > 1.0.");
  engine::check_update_options(growth_factor, options_.backoff_factor(), options_.growth_interval(),
                               options_.hysteresis());
  options_.growth_factor(growth_factor);
}
double GradScaler::get_backoff_factor() const { return options_.backoff_factor(); }
void GradScaler::set_backoff_factor(double backoff_factor) {
  TORCH_CHECK(backoff_factor < 1.0, "The backoff factor must be < 1.0.");
  engine::check_update_options(options_.growth_factor(), backoff_factor, options_.growth_interval(),
                               options_.hysteresis());
  options_.backoff_factor(backoff_factor);
}
int64_t GradScaler::get_growth_interval() const { return options_.growth_interval(); }
void GradScaler::set_growth_interval(int64_t growth_interval) {
  engine::check_update_options(options_.growth_factor(), options_.backoff_factor(), growth_interval,
                               options_.hysteresis());
  options_.growth_interval(growth_interval);
}
bool GradScaler::is_enabled() const { return options_.enabled(); }
const GradScalerOptions& GradScaler::options() const { return options_; }
const std::optional<at::Tensor>& GradScaler::last_found_inf() const { return last_found_inf_; }

at::Tensor GradScaler::stats() const {
  if (stats_.defined()) return stats_;
  return at::tensor(init_stats_, at::TensorOptions().dtype(at::kLong));
}

// ---- checkpoints ----------------------------------------------------------------------------------
void GradScaler::save(OutputArchive& archive) const {
  if (!options_.enabled()) return;
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("_growth_tracker", c10::IValue(get_growth_tracker()));
  archive.write("hysteresis", c10::IValue(options_.hysteresis()));
  archive.write("consecutive_hysteresis", c10::IValue(options_.consecutive_hysteresis()));
  archive.write("min_scale", c10::IValue(options_.min_scale()));
  archive.write("max_scale", c10::IValue(options_.max_scale()));
  archive.write("_hysteresis_tracker",
                c10::IValue(hysteresis_tracker_.defined() ? hysteresis_tracker_.item<int64_t>()
                                                          : init_hysteresis_tracker_));
  archive.write("stats", c10::IValue(stats().to(at::kCPU)));
}

engine::ScalerCheckpoint GradScaler::check_checkpoint(InputArchive& archive) const {
  auto entries = engine::entry_dict();
  for (const auto& key : archive.keys()) {
    c10::IValue v;
    if (archive.try_read(key, v)) entries.insert(key, std::move(v));
  }
  engine::ScalerCheckpoint current;
  current.hysteresis = options_.hysteresis();
  current.consecutive_hysteresis = options_.consecutive_hysteresis();
  current.min_scale = options_.min_scale();
  current.max_scale = options_.max_scale();
  current.stats = init_stats_;
  return engine::check_scaler_checkpoint(entries, current, "the checkpoint");
}

void GradScaler::apply_checkpoint(const engine::ScalerCheckpoint& c) {
  options_.growth_factor(c.growth_factor)
      .backoff_factor(c.backoff_factor)
      .growth_interval(c.growth_interval)
      .hysteresis(c.hysteresis)
      .consecutive_hysteresis(c.consecutive_hysteresis)
      .min_scale(c.min_scale)
      .max_scale(c.max_scale);
  init_scale_ = clamped(c.scale, "the loaded scale");
  init_growth_tracker_ = c.growth_tracker;
  init_hysteresis_tracker_ = c.hysteresis_tracker;
  init_stats_ = c.stats;
  floor_hits_seen_ = c.stats[static_cast<size_t>(ScaleStat::kFloorHits)];  // reported before the save
  pending_stats_.clear();
  if (scale_.defined()) scale_.fill_(init_scale_);
  if (growth_tracker_.defined()) growth_tracker_.fill_(c.growth_tracker);
  if (hysteresis_tracker_.defined()) hysteresis_tracker_.fill_(c.hysteresis_tracker);
  if (stats_.defined()) stats_.copy_(at::tensor(c.stats, at::TensorOptions().dtype(at::kLong)));
}

void GradScaler::load(InputArchive& archive) { load(archive, [] {}); }

void GradScaler::load(InputArchive& archive, const std::function<void()>& before_apply) {
  if (!options_.enabled()) {
    before_apply();
    return;
  }
  const engine::ScalerCheckpoint checkpoint = check_checkpoint(archive);
  before_apply();
  apply_checkpoint(checkpoint);
}

OutputArchive& operator<<(OutputArchive& archive, const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

InputArchive& operator>>(InputArchive& archive, GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace ampfuse
