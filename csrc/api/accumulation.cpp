// ampfuse::GradAccumulator for LibTorch, following python/ampfuse/accumulation.py (without DDP).
#include "ampfuse/accumulation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "ampfuse/optim.h"
#include "api/accumulate_plan.h"
#include "api/internals.h"

namespace ampfuse {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

bool is_low(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

template <typename T>
T& on_device(std::vector<std::pair<c10::Device, T>>& per_device, const c10::Device& device) {
  for (auto& [d, v] : per_device) {
    if (d == device) return v;
  }
  TORCH_INTERNAL_ASSERT(false, "no entry for device ", device);
}

template <typename T>
const T& on_device(const std::vector<std::pair<c10::Device, T>>& per_device,
                   const c10::Device& device) {
  for (const auto& [d, v] : per_device) {
    if (d == device) return v;
  }
  TORCH_INTERNAL_ASSERT(false, "no entry for device ", device);
}

// The elements of `params` per device, devices in order of first appearance: the sizes of the
// flat fp32 buffers (one per device).
std::vector<std::pair<c10::Device, int64_t>> sizes_per_device(
    const std::vector<at::Tensor>& params) {
  std::vector<std::pair<c10::Device, int64_t>> sizes;
  for (const auto& p : params) {
    auto it = std::find_if(sizes.begin(), sizes.end(),
                           [&](const auto& s) { return s.first == p.device(); });
    if (it == sizes.end()) {
      sizes.emplace_back(p.device(), p.numel());
    } else {
      it->second += p.numel();
    }
  }
  return sizes;
}

}  // namespace

// The micro-batch plan and what it depends on (plan_key).
struct GradAccumulator::Plan {
  std::shared_ptr<detail::MicroBatchPlan> plan;  // shared with the optimizer's window step
  std::vector<const void*> key;
};

GradAccumulator::GradAccumulator(torch::optim::Optimizer& optimizer, GradScaler* scaler,
                                 GradAccumulatorOptions options)
    : optimizer_(optimizer),
      scaler_(scaler != nullptr && scaler->is_enabled() ? scaler : nullptr),
      options_(std::move(options)),
      fused_(dynamic_cast<optim::FusedOptimizer*>(&optimizer) != nullptr) {
  TORCH_CHECK(options_.steps() >= 1, "steps must be an integer >= 1, got ", options_.steps(),
              ".");
  if (options_.max_grad_norm().has_value()) {
    const double m = *options_.max_grad_norm();
    TORCH_CHECK(std::isfinite(m) && m > 0, "max_grad_norm must be a positive finite number or "
                "nullopt, got ", m, ".");
    TORCH_CHECK(!(fused_ && scaler_ == nullptr) || options_.norm_type() == 2.0 ||
                    options_.norm_type() == std::numeric_limits<double>::infinity(),
                "norm_type must be 2.0 or inf to clip for an ampfuse optimizer without a "
                "GradScaler, got ", options_.norm_type(), ".");
  }
  layout(wanted_low());
}

GradAccumulator::~GradAccumulator() = default;

// Every param of the optimizer, frozen ones included: a param frozen inside a window still holds
// that window's gradient (stepped once at the window end, then cleared, as zero_grad() would).
std::vector<at::Tensor> GradAccumulator::all_params() const {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) params.push_back(p);
  }
  return params;
}

// The params summed in fp32 buffers: the fp16/bf16 ones that require grad now.
std::vector<at::Tensor> GradAccumulator::wanted_low() const {
  std::vector<at::Tensor> low;
  if (!options_.fp32_accumulation()) return low;
  for (const auto& p : all_params()) {
    if (is_low(p.scalar_type()) && p.requires_grad()) low.push_back(p);
  }
  return low;
}

// (Re)builds the fp32 buffers for `low` (one flat buffer per device, each param's buffer a view
// into it), keeping the partial sums and has-gradient flags of the params it keeps. Decided again
// at every window start, and widened inside a window when a param without a buffer gets a
// gradient (a layer unfrozen mid-training is summed in fp32 too).
void GradAccumulator::layout(const std::vector<at::Tensor>& low) {
  bool same = low.size() == low_.size();
  for (size_t k = 0; same && k < low.size(); ++k) same = low[k].is_same(low_[k]);
  if (same) return;
  const auto sizes = sizes_per_device(low);
  std::vector<std::pair<c10::Device, at::Tensor>> flat;
  for (const auto& [device, numel] : sizes) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    flat.emplace_back(device, at::zeros({numel}, f32));
    bool has_flag = false;
    for (const auto& [d, f] : found_inf_) has_flag |= d == device;
    if (!has_flag) found_inf_.emplace_back(device, at::zeros({}, f32));
  }
  std::vector<std::pair<c10::Device, int64_t>> offsets;
  for (const auto& [device, numel] : sizes) offsets.emplace_back(device, 0);
  std::unordered_map<const c10::TensorImpl*, size_t> old;
  for (size_t k = 0; k < low_.size(); ++k) old.emplace(low_[k].unsafeGetTensorImpl(), k);
  std::vector<at::Tensor> buffers;
  std::vector<bool> has_grad;
  at::NoGradGuard no_grad;
  for (const auto& p : low) {
    int64_t& offset = on_device(offsets, p.device());
    at::Tensor view = on_device(flat, p.device()).slice(0, offset, offset + p.numel()).view(p.sizes());
    offset += p.numel();
    bool had = false;
    const auto it = old.find(p.unsafeGetTensorImpl());
    if (it != old.end()) {
      view.copy_(buffers_[it->second]);
      had = has_grad_[it->second];
    }
    buffers.push_back(view);
    has_grad.push_back(had);
  }
  low_ = low;
  buffers_ = std::move(buffers);
  has_grad_ = std::move(has_grad);
  flat_ = std::move(flat);
  plan_.reset();  // built for the old buffers
}

void GradAccumulator::set_lr_scheduler(torch::optim::LRScheduler* scheduler) {
  lr_scheduler_ = scheduler;
}

// ---- the loop --------------------------------------------------------------------------------
bool GradAccumulator::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined(), "GradAccumulator::backward: loss must be a defined tensor.");
  window_ended_ = false;
  if (micro_step_ == 0) {
    // A window starts: buffer what requires grad now (the plan tells without a pass over the
    // params whether that is what is buffered already).
    if (!(has_accumulate_plan() && plan_->plan->same_layout())) layout(wanted_low());
  }
  at::Tensor scaled = loss / options_.steps();
  if (scaler_ != nullptr) scaled = scaler_->scale(scaled);
  scaled.backward();
  collect();
  ++micro_step_;
  if (micro_step_ == options_.steps()) end_window(options_.steps());
  return window_ended_;
}

bool GradAccumulator::flush() {
  window_ended_ = false;
  if (micro_step_ == 0) return false;
  end_window(micro_step_);
  return true;
}

// ---- the micro-batch plan ---------------------------------------------------------------------------
// What the plan depends on that the optimizer owns: every group's params, by identity.
std::vector<const void*> GradAccumulator::plan_key() const {
  std::vector<const void*> key;
  for (const auto& group : optimizer_.param_groups()) {
    key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(group.params().size())));
    for (const auto& p : group.params()) key.push_back(p.unsafeGetTensorImpl());
  }
  return key;
}

bool GradAccumulator::has_accumulate_plan() const {
  return plan_ != nullptr && plan_key() == plan_->key;
}

// After a pass that went the validated way: the plan of the buffered params (one device, plain
// tensors), watching the other fp16/bf16 params (a gradient on one widens the layout) and the
// fp32 ones' dtypes.
void GradAccumulator::build_plan() {
  plan_.reset();
  if (low_.empty()) return;
  const c10::Device device = low_[0].device();
  for (const auto& p : low_) {
    if (p.device() != device || p.key_set().has(c10::DispatchKey::Python)) return;
  }
  std::unordered_set<const c10::TensorImpl*> buffered;
  for (const auto& p : low_) buffered.insert(p.unsafeGetTensorImpl());
  std::vector<at::Tensor> watched, free;
  for (const auto& p : all_params()) {
    if (!is_low(p.scalar_type())) {
      free.push_back(p);
    } else if (buffered.count(p.unsafeGetTensorImpl()) == 0) {
      watched.push_back(p);
    }
  }
  auto plan = std::make_shared<Plan>();
  plan->plan = std::make_shared<detail::MicroBatchPlan>(low_, buffers_, on_device(found_inf_, device),
                                                        std::move(watched), std::move(free),
                                                        has_grad_);
  plan->key = plan_key();
  plan_ = std::move(plan);
}

// After a micro-batch's backward. In the steady state one native call (the plan): it checks every
// gradient itself, and anything it was not built for (a gradient on a param it does not buffer,
// an odd layout, a sparse gradient) sends the pass the validated way, which names the problem or
// rebuilds the plan.
void GradAccumulator::collect() {
  if (has_accumulate_plan() && plan_->plan->collect(has_grad_)) return;
  plan_.reset();
  collect_validated();
  build_plan();
}

// The validated way: fp16/bf16 grads into the fp32 buffers (one fused pass per device, checking
// the sums for inf/NaN on the way), then .grad() undefined: a param that gets no gradient in the
// window is not stepped.
void GradAccumulator::collect_validated() {
  if (options_.fp32_accumulation()) {
    // A param without a buffer that got a gradient (unfrozen inside the window): widen the
    // layout, so that it is summed in fp32 from this micro-batch on.
    std::vector<at::Tensor> low = low_;
    std::unordered_set<const c10::TensorImpl*> buffered;
    for (const auto& q : low_) buffered.insert(q.unsafeGetTensorImpl());
    for (const auto& p : all_params()) {
      if (is_low(p.scalar_type()) && p.grad().defined() &&
          buffered.count(p.unsafeGetTensorImpl()) == 0) {
        low.push_back(p);
      }
    }
    if (low.size() != low_.size()) layout(low);
  }
  if (low_.empty()) return;
  std::vector<size_t> taken;
  std::vector<std::pair<c10::Device, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>>>
      per_device;
  for (size_t k = 0; k < low_.size(); ++k) {
    const at::Tensor g = low_[k].grad();
    if (!g.defined()) continue;
    TORCH_CHECK(!g.is_sparse(), "GradAccumulator does not support sparse gradients.");
    taken.push_back(k);
    bool found = false;
    for (auto& [d, lists] : per_device) {
      if (d == g.device()) {
        lists.first.push_back(buffers_[k]);
        lists.second.push_back(g);
        found = true;
      }
    }
    if (!found) per_device.push_back({g.device(), {{buffers_[k]}, {g}}});
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [device, lists] : per_device) {
      accumulate_grads_(lists.first, lists.second, on_device(found_inf_, device),
                        /*zero_grads=*/false);
    }
  }
  for (size_t k : taken) {
    has_grad_[k] = true;
    low_[k].mutable_grad() = at::Tensor();
  }
}

// Steps (or skips) the window; whatever happens, the next window starts clean.
void GradAccumulator::end_window(int64_t micro_batches) {
  std::unordered_set<const c10::TensorImpl*> buffered;
  for (const auto& p : low_) buffered.insert(p.unsafeGetTensorImpl());
  const auto params = all_params();
  auto* fused = fused_ ? static_cast<optim::FusedOptimizer*>(&optimizer_) : nullptr;
  // The fused step reads the sums from the accumulator's plan when there is one (the optimizer's
  // step plan binds it), else from grad buffers set per param.
  const bool sourced = fused != nullptr && !low_.empty() && has_accumulate_plan();
  auto reset = [&] {
    if (fused != nullptr) {
      fused->internals().grad_source.reset();
      if (!sourced) {
        for (const auto& p : low_) fused->remove_grad_buffer(p);
      }
    }
    at::NoGradGuard no_grad;
    for (auto& [d, f] : flat_) f.zero_();
    for (auto& [d, f] : found_inf_) f.zero_();
    for (const auto& p : params) p.mutable_grad() = at::Tensor();
    has_grad_.assign(low_.size(), false);
    if (plan_ != nullptr) plan_->plan->set_flags(has_grad_);
    micro_step_ = 0;
    ++windows_;
    window_ended_ = true;
  };
  try {
    {
      at::NoGradGuard no_grad;
      if (micro_batches != options_.steps()) {  // incomplete window: the sums hold sum / steps
        std::vector<at::Tensor> tensors;
        for (const auto& [d, f] : flat_) tensors.push_back(f);
        for (const auto& p : params) {
          if (buffered.count(p.unsafeGetTensorImpl()) == 0 && p.grad().defined()) {
            tensors.push_back(p.grad());
          }
        }
        if (!tensors.empty()) {
          at::_foreach_mul_(tensors, static_cast<double>(options_.steps()) / micro_batches);
        }
      }
      if (!low_.empty() && fused == nullptr) {
        // An ordinary optimizer reads .grad(): hand it the fp32 sums, rounded once.
        for (size_t k = 0; k < low_.size(); ++k) {
          low_[k].mutable_grad() =
              has_grad_[k] ? buffers_[k].to(low_[k].scalar_type()) : at::Tensor();
        }
      }
    }
    if (sourced) {
      // The fused step reads the fp32 sums, for this step only, from the plan: a param that got
      // no gradient in the window has neither a sum nor a .grad(), so it is not stepped.
      fused->internals().grad_source = plan_->plan;
    } else if (fused != nullptr) {
      // The same through grad buffers.
      for (size_t k = 0; k < low_.size(); ++k) {
        if (has_grad_[k]) fused->set_grad_buffer(low_[k], buffers_[k]);
      }
    }
    last_window_skipped_ = step_window();
  } catch (...) {
    // A failed step must not leave the scaler's iteration half-recorded, nor this window open.
    if (scaler_ != nullptr) scaler_->discard_iteration();
    reset();
    throw;
  }
  reset();
}

// unscale (+ clip), step, update; returns the device skip flag (nullopt without a scaler).
std::optional<at::Tensor> GradAccumulator::step_window() {
  if (scaler_ == nullptr) {
    if (options_.max_grad_norm().has_value()) clip_unscaled();
    optimizer_.step();
    if (fused_) static_cast<optim::FusedOptimizer&>(optimizer_).clear_step_scaling();
    if (lr_scheduler_ != nullptr) lr_scheduler_->step();
    return std::nullopt;
  }
  bool other_grads = false;  // a .grad() the accumulation kernel did not check (fp32 params)
  for (const auto& p : all_params()) other_grads |= p.grad().defined();
  if (options_.max_grad_norm().has_value()) {
    scaler_->unscale_and_clip_(optimizer_, *options_.max_grad_norm(), options_.norm_type());
  } else if (fused_ && !low_.empty() && !other_grads) {
    // The accumulation kernel already checked every gradient: no check pass at the end.
    GradScaler::PerDevice found;
    for (const auto& [d, f] : found_inf_) found.emplace_back(d, f);
    scaler_->record_inf_check(optimizer_, std::move(found));
  }
  scaler_->step(optimizer_);
  std::optional<at::Tensor> flag;
  const at::Tensor scale = scaler_->get_scale_async();
  for (const auto& [d, f] : scaler_->found_inf_per_device(optimizer_)) {
    at::Tensor moved = f.to(scale.device(), /*non_blocking=*/true);
    // A fresh tensor: the accumulator's own found_inf buffers are reset after the window.
    flag = flag.has_value() ? *flag + moved : moved.clone();
  }
  scaler_->update();
  if (lr_scheduler_ != nullptr) {
    // One host read per window (the flag of a step that has just been queued).
    if (flag.has_value() && flag->item<double>() != 0.0) {
      ++skipped_windows_host_;
    } else {
      lr_scheduler_->step();
    }
  }
  return flag;
}

// Clipping without a scaler: the fused step takes the coefficient; others clip .grad().
void GradAccumulator::clip_unscaled() {
  const double max_norm = *options_.max_grad_norm();
  if (fused_) {
    auto& fused = static_cast<optim::FusedOptimizer&>(optimizer_);
    std::vector<at::Tensor> grads;
    for (const auto& p : all_params()) {
      at::Tensor g = fused.grad_of(p);
      if (g.defined()) grads.push_back(g);
    }
    if (grads.empty()) return;
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(grads[0].device());
    at::NoGradGuard no_grad;
    auto [norm, coef] = check_norm_(grads, at::zeros({1}, f32), at::ones({1}, f32),
                                    options_.norm_type(), max_norm);
    StepScaling scaling;
    scaling.clip_coef = coef;
    fused.set_step_scaling(std::move(scaling));
  } else {
    std::vector<at::Tensor> params;
    for (const auto& p : all_params()) {
      if (p.grad().defined()) params.push_back(p);
    }
    torch::nn::utils::clip_grad_norm_(params, max_norm, options_.norm_type());
  }
}

// ---- accessors --------------------------------------------------------------------------------
int64_t GradAccumulator::steps() const { return options_.steps(); }
int64_t GradAccumulator::micro_step() const { return micro_step_; }
int64_t GradAccumulator::windows() const { return windows_; }
int64_t GradAccumulator::skipped_windows_host() const { return skipped_windows_host_; }
bool GradAccumulator::window_ended() const { return window_ended_; }
const std::optional<at::Tensor>& GradAccumulator::last_window_skipped() const {
  return last_window_skipped_;
}

// ---- checkpoints --------------------------------------------------------------------------------
// Inside a window the checkpoint also holds the partial sums: the flat fp32 buffers (one per
// device, in the order of the params listed under "buffered", indices into every param of the
// optimizer), their inf/NaN flags, which buffered params got a gradient, and the .grad() of the
// other params (under "grads/<index>", same indices).
void GradAccumulator::save(OutputArchive& archive) const {
  archive.write("steps", c10::IValue(options_.steps()));
  archive.write("micro_step", c10::IValue(micro_step_));
  archive.write("windows", c10::IValue(windows_));
  archive.write("skipped_windows_host", c10::IValue(skipped_windows_host_));
  OutputArchive optimizer_archive(archive.compilation_unit());
  optimizer_.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  if (scaler_ != nullptr) {
    OutputArchive scaler_archive(archive.compilation_unit());
    scaler_->save(scaler_archive);
    archive.write("scaler", scaler_archive);
  }
  if (micro_step_ != 0) {
    for (size_t i = 0; i < flat_.size(); ++i) {
      archive.write("buffers/" + std::to_string(i), c10::IValue(flat_[i].second.cpu()));
      archive.write("found_inf/" + std::to_string(i),
                    c10::IValue(on_device(found_inf_, flat_[i].first).cpu()));
    }
    std::vector<int64_t> has_grad(has_grad_.begin(), has_grad_.end());
    archive.write("has_grad", c10::IValue(at::tensor(has_grad, at::kLong)));
    const auto params = all_params();
    std::unordered_map<const c10::TensorImpl*, int64_t> index;
    for (size_t i = 0; i < params.size(); ++i) {
      index.emplace(params[i].unsafeGetTensorImpl(), static_cast<int64_t>(i));
    }
    std::vector<int64_t> buffered_index;
    for (const auto& p : low_) buffered_index.push_back(index.at(p.unsafeGetTensorImpl()));
    archive.write("buffered", c10::IValue(at::tensor(buffered_index, at::kLong)));
    // The partial sums of the parameters that accumulate in .grad() (fp32 ones).
    std::unordered_set<const c10::TensorImpl*> buffered;
    for (const auto& p : low_) buffered.insert(p.unsafeGetTensorImpl());
    for (size_t i = 0; i < params.size(); ++i) {
      if (buffered.count(params[i].unsafeGetTensorImpl()) == 0 && params[i].grad().defined()) {
        archive.write("grads/" + std::to_string(i), c10::IValue(params[i].grad().cpu()));
      }
    }
  }
}

// Everything is read and checked before anything (optimizer, scaler, sums) is loaded.
void GradAccumulator::load(InputArchive& archive) {
  c10::IValue v;
  archive.read("steps", v);
  TORCH_CHECK(v.isInt() && v.toInt() == options_.steps(), "The checkpoint was saved with steps=",
              v, ", this accumulator has steps=", options_.steps(), ".");
  archive.read("micro_step", v);
  TORCH_CHECK(v.isInt(), "micro_step in the checkpoint must be an integer, got ", v, ".");
  const int64_t micro_step = v.toInt();
  TORCH_CHECK(micro_step >= 0 && micro_step < options_.steps(),
              "micro_step in the checkpoint must be in [0, steps), got ", micro_step, ".");
  archive.read("windows", v);
  TORCH_CHECK(v.isInt() && v.toInt() >= 0, "windows in the checkpoint must be an integer >= 0, got ",
              v, ".");
  const int64_t windows = v.toInt();
  int64_t skipped = skipped_windows_host_;
  if (archive.try_read("skipped_windows_host", v)) {
    TORCH_CHECK(v.isInt() && v.toInt() >= 0,
                "skipped_windows_host in the checkpoint must be an integer >= 0, got ", v, ".");
    skipped = v.toInt();
  }
  const auto params = all_params();
  // The params the saved buffers hold: at a window boundary, the ones this accumulator buffers
  // now (the sums are zero); inside a window, those the checkpoint lists under "buffered".
  std::vector<at::Tensor> low = micro_step == 0 ? wanted_low() : low_;
  if (micro_step != 0) {
    TORCH_CHECK_VALUE(archive.try_read("buffered", v),
                      "buffered in the checkpoint is missing: a mid-window checkpoint lists the params its "
                      "buffers hold (the indices of their parameters).");
    TORCH_CHECK(v.isTensor() && v.toTensor().dim() == 1 && !v.toTensor().is_floating_point(),
                "buffered in the checkpoint must be a 1-d integer tensor.");
    const at::Tensor idx = v.toTensor().to(at::kLong).contiguous();
    std::unordered_set<int64_t> seen;
    low.clear();
    for (int64_t k = 0; k < idx.numel(); ++k) {
      const int64_t i = idx.data_ptr<int64_t>()[k];
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params.size()) &&
                      is_low(params[i].scalar_type()) && seen.insert(i).second,
                  "buffered in the checkpoint must list distinct indices of fp16/bf16 parameters "
                  "of this accumulator's optimizer, got ", i, ".");
      low.push_back(params[i]);
    }
  }
  // The flat buffers' sizes per device, in the order layout() gives them.
  const auto sizes = sizes_per_device(low);
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> found_infs;
  std::vector<bool> has_grad(low.size(), false);
  std::unordered_map<const c10::TensorImpl*, at::Tensor> grads;
  if (micro_step != 0) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      archive.read("buffers/" + std::to_string(i), v);
      TORCH_CHECK(v.isTensor() && v.toTensor().scalar_type() == at::kFloat &&
                      v.toTensor().sizes() == at::IntArrayRef{sizes[i].second},
                  "buffers/", i, " in the checkpoint must be a float32 tensor of shape [",
                  sizes[i].second, "].");
      buffers.push_back(v.toTensor());
      archive.read("found_inf/" + std::to_string(i), v);
      TORCH_CHECK(v.isTensor() && v.toTensor().numel() == 1, "found_inf/", i,
                  " in the checkpoint must be a 1-element tensor.");
      found_infs.push_back(v.toTensor());
    }
    archive.read("has_grad", v);
    TORCH_CHECK(v.isTensor(), "has_grad in the checkpoint must be a tensor.");
    const at::Tensor h = v.toTensor().to(at::kLong).contiguous();
    TORCH_CHECK(h.numel() == static_cast<int64_t>(low.size()), "has_grad in the checkpoint has ",
                h.numel(), " entries but this accumulator buffers ", low.size(), " parameters.");
    for (size_t k = 0; k < low.size(); ++k) has_grad[k] = h.data_ptr<int64_t>()[k] != 0;
    std::unordered_set<const c10::TensorImpl*> buffered;
    for (const auto& p : low) buffered.insert(p.unsafeGetTensorImpl());
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (buffered.count(p.unsafeGetTensorImpl()) != 0) continue;
      if (!archive.try_read("grads/" + std::to_string(i), v)) continue;
      TORCH_CHECK(v.isTensor() && v.toTensor().sizes() == p.sizes(), "grads/", i,
                  " in the checkpoint must be a tensor of shape ", p.sizes(), ".");
      grads.emplace(p.unsafeGetTensorImpl(), v.toTensor());
    }
  }
  torch::serialize::InputArchive optimizer_archive, scaler_archive;
  archive.read("optimizer", optimizer_archive);
  if (scaler_ != nullptr && archive.try_read("scaler", scaler_archive)) {
    // the scaler's entries are checked before the optimizer changes
    scaler_->load(scaler_archive, [&] { optimizer_.load(optimizer_archive); });
  } else {
    optimizer_.load(optimizer_archive);
  }
  micro_step_ = micro_step;
  windows_ = windows;
  skipped_windows_host_ = skipped;
  layout(low);
  at::NoGradGuard no_grad;
  for (auto& [d, f] : found_inf_) f.zero_();
  for (size_t i = 0; i < flat_.size(); ++i) {
    if (micro_step != 0) {
      flat_[i].second.copy_(buffers[i]);
      on_device(found_inf_, flat_[i].first).copy_(found_infs[i].reshape({}));
    } else {
      flat_[i].second.zero_();
    }
  }
  std::unordered_set<const c10::TensorImpl*> buffered;
  for (const auto& p : low_) buffered.insert(p.unsafeGetTensorImpl());
  for (const auto& p : params) {
    if (buffered.count(p.unsafeGetTensorImpl()) != 0) continue;
    const auto it = grads.find(p.unsafeGetTensorImpl());
    p.mutable_grad() =
        it != grads.end() ? it->second.to(p.device(), p.scalar_type()) : at::Tensor();
  }
  has_grad_ = has_grad;
  plan_.reset();
  window_ended_ = false;
}

}  // namespace ampfuse
