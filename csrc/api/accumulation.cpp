// ampfuse::GradAccumulator for LibTorch: the loop API and the checkpoint archive over the
// engine's AccumulatorWindow (engine/accumulator_window.h), which Python's GradAccumulator holds too.
#include "ampfuse/accumulation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <limits>
#include <string>

#include "ampfuse/optim.h"
#include "api/internals.h"
#include "engine/accumulator_window.h"
#include "engine/scaler_rules.h"

namespace ampfuse {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

}  // namespace

struct GradAccumulator::Window {
  c10::intrusive_ptr<engine::AccumulatorWindow> w;
  // What the plan depends on that the optimizer owns: every group's params, by identity.
  std::vector<const void*> key;
};

GradAccumulator::GradAccumulator(torch::optim::Optimizer& optimizer, GradScaler* scaler,
                                 GradAccumulatorOptions options)
    : optimizer_(optimizer),
      scaler_(scaler != nullptr && scaler->is_enabled() ? scaler : nullptr),
      options_(std::move(options)),
      fused_(dynamic_cast<optim::FusedOptimizer*>(&optimizer) != nullptr),
      window_(std::make_unique<Window>()) {
  TORCH_CHECK(options_.steps() >= 1, "steps must be an integer >= 1, got ", options_.steps(),
              ".");
  if (options_.max_grad_norm().has_value()) {
    const double m = *options_.max_grad_norm();
    TORCH_CHECK(std::isfinite(m) && m > 0, "max_grad_norm must be a positive finite number or "
                "nullopt, got ", m, ".");
  }
  TORCH_CHECK(options_.norm_type() > 0, "norm_type must be a positive number or inf, got ",
              options_.norm_type(), ".");
  window_->w = c10::make_intrusive<engine::AccumulatorWindow>(options_.fp32_accumulation(), /*per_param=*/false);
  window_->w->layout(window_->w->wanted(all_params()));
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

void GradAccumulator::set_lr_scheduler(torch::optim::LRScheduler* scheduler) {
  lr_scheduler_ = scheduler;
}

// ---- the loop --------------------------------------------------------------------------------
bool GradAccumulator::backward(const at::Tensor& loss) {
  TORCH_CHECK(loss.defined(), "GradAccumulator::backward: loss must be a defined tensor.");
  window_ended_ = false;
  if (micro_step_ == 0) {
    if (!has_accumulate_plan()) window_->w->drop_plan();
    window_->w->start(all_params());  // a window starts: buffer what requires grad now
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

bool GradAccumulator::has_accumulate_plan() const {
  if (!window_->w->has_plan()) return false;
  size_t k = 0;
  const auto& key = window_->key;
  for (const auto& group : optimizer_.param_groups()) {
    if (k >= key.size() || key[k++] != reinterpret_cast<const void*>(static_cast<uintptr_t>(group.params().size()))) {
      return false;
    }
    for (const auto& p : group.params()) {
      if (k >= key.size() || key[k++] != p.unsafeGetTensorImpl()) return false;
    }
  }
  return k == key.size();
}

// After a micro-batch's backward: one native call in the steady state (the window's plan).
void GradAccumulator::collect() {
  if (!has_accumulate_plan()) window_->w->drop_plan();
  const bool had = window_->w->has_plan();
  window_->w->collect(all_params(), /*allow_plan=*/true);
  if (!had && window_->w->has_plan()) {
    window_->key.clear();
    for (const auto& group : optimizer_.param_groups()) {
      window_->key.push_back(reinterpret_cast<const void*>(static_cast<uintptr_t>(group.params().size())));
      for (const auto& p : group.params()) window_->key.push_back(p.unsafeGetTensorImpl());
    }
  }
}

// Steps (or skips) the window; whatever happens, the next window starts clean.
void GradAccumulator::end_window(int64_t micro_batches) {
  engine::AccumulatorWindow& w = *window_->w;
  if (!has_accumulate_plan()) w.drop_plan();
  const auto params = all_params();
  const auto& low = w.params();
  auto* fused = fused_ ? static_cast<optim::FusedOptimizer*>(&optimizer_) : nullptr;
  auto reset = [&] {
    if (fused != nullptr) fused->internals().grad_source.reset();
    w.end(params);
    micro_step_ = 0;
    ++windows_;
    window_ended_ = true;
  };
  try {
    {
      at::NoGradGuard no_grad;
      if (micro_batches != options_.steps()) {  // incomplete window: the sums hold sum / steps
        const double factor = static_cast<double>(options_.steps()) / micro_batches;
        w.scale(factor);
        std::vector<at::Tensor> grads;
        for (const auto& p : params) {
          if (w.window_grad(p) == nullptr && p.grad().defined()) grads.push_back(p.grad());
        }
        if (!grads.empty()) at::_foreach_mul_(grads, factor);
      }
      if (!low.empty() && fused == nullptr) {
        // An ordinary optimizer reads .grad(): hand it the fp32 sums, rounded once.
        for (const auto& p : low) {
          const at::Tensor& sum = *w.window_grad(p);
          p.mutable_grad() = sum.defined() ? sum.to(p.scalar_type()) : at::Tensor();
        }
      }
    }
    if (fused != nullptr && !low.empty()) {
      // The fused step reads the fp32 sums, for this step only, from the window (its plan binds
      // as the step plan's source): a param that got no gradient in the window has neither a
      // sum nor a .grad(), so it is not stepped.
      fused->internals().grad_source = window_->w;
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
  } else if (fused_ && !window_->w->params().empty() && !other_grads) {
    // The accumulation kernel already checked every gradient: no check pass at the end.
    GradScaler::PerDevice found;
    for (const auto& d : window_->w->devices()) found.emplace_back(d, window_->w->found_inf(d));
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

// Clipping without a scaler: the fused step takes the coefficient of a 2- or inf-norm; other
// norms clip, with torch's clip_grad_norm_, the gradients the step reads.
void GradAccumulator::clip_unscaled() {
  const double max_norm = *options_.max_grad_norm();
  const double norm_type = options_.norm_type();
  if (fused_ && (norm_type == 2.0 || norm_type == std::numeric_limits<double>::infinity())) {
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
    // (an ampfuse optimizer's step reads the window's sums: those are clipped in place)
    detail::clip_grad_norm_of_step(optimizer_, max_norm, norm_type);
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
  if (micro_step_ == 0) return;
  // the partial sums are in the units of the loss scale they were taken under
  archive.write("sums_scaled", c10::IValue(scaler_ != nullptr && scaler_->is_enabled()));
  const engine::AccumulatorWindow& w = *window_->w;
  for (size_t i = 0; i < w.devices().size(); ++i) {
    archive.write("buffers/" + std::to_string(i), c10::IValue(w.flats()[i].cpu()));
    archive.write("found_inf/" + std::to_string(i), c10::IValue(w.found_inf(w.devices()[i]).cpu()));
  }
  const auto flags = w.flags();
  archive.write("has_grad", c10::IValue(at::tensor(std::vector<int64_t>(flags.begin(), flags.end()), at::kLong)));
  const auto params = all_params();
  archive.write("buffered", c10::IValue(at::tensor(w.indices_of_buffered(params), at::kLong)));
  // The partial sums of the parameters that accumulate in .grad() (fp32 ones).
  for (size_t i = 0; i < params.size(); ++i) {
    if (w.window_grad(params[i]) == nullptr && params[i].grad().defined()) {
      archive.write("grads/" + std::to_string(i), c10::IValue(params[i].grad().cpu()));
    }
  }
}

// Everything is read and checked (the counters here, the partial sums by the window, the scaler's
// entries by the scaler) before anything (optimizer, scaler, sums) is loaded.
void GradAccumulator::load(InputArchive& archive) {
  c10::IValue v;
  auto counters = engine::entry_dict();
  for (const char* key : {"steps", "micro_step", "windows", "skipped_windows_host"}) {
    if (archive.try_read(key, v)) counters.insert(key, v);  // an absent entry is named by the check
  }
  const std::vector<int64_t> checked =
      engine::check_accumulator_counters(counters, options_.steps(), "The checkpoint", "the checkpoint's {}");
  const int64_t micro_step = checked[0], windows = checked[1], skipped = checked[2];
  const auto params = all_params();
  engine::AccumulatorWindow& w = *window_->w;
  if (micro_step != 0) {
    c10::IValue buffered, has_grad;
    archive.try_read("buffered", buffered);
    archive.try_read("has_grad", has_grad);
    auto buffers = engine::entry_dict();
    auto found_infs = engine::entry_dict();
    for (size_t i = 0;; ++i) {
      c10::IValue b, f;
      const bool got_b = archive.try_read("buffers/" + std::to_string(i), b);
      const bool got_f = archive.try_read("found_inf/" + std::to_string(i), f);
      if (!got_b && !got_f) break;
      if (got_b) buffers.insert(std::to_string(i), b);
      if (got_f) found_infs.insert(std::to_string(i), f);
    }
    auto grads = c10::impl::toTypedDict<int64_t, c10::IValue>(
        c10::impl::GenericDict(c10::IntType::get(), c10::AnyType::get()));
    for (size_t i = 0; i < params.size(); ++i) {
      if (archive.try_read("grads/" + std::to_string(i), v)) grads.insert(static_cast<int64_t>(i), v);
    }
    w.check_checkpoint(params, buffered, buffers, found_infs, has_grad.isNone() ? c10::IValue() : has_grad,
                       grads, "the checkpoint's {} entry", /*device_keys=*/false);
    torch::serialize::InputArchive saved_scaler;
    c10::IValue sums_scaled;
    const bool saved_scaled = archive.try_read("sums_scaled", sums_scaled)
                                  ? (sums_scaled.isBool() && sums_scaled.toBool())
                                  : archive.try_read("scaler", saved_scaler);
    engine::check_window_sums_scale(saved_scaled, scaler_ != nullptr && scaler_->is_enabled(), "The checkpoint");
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
  w.load(params, micro_step != 0);
  window_ended_ = false;
}

OutputArchive& operator<<(OutputArchive& archive, const GradAccumulator& accumulator) {
  accumulator.save(archive);
  return archive;
}

InputArchive& operator>>(InputArchive& archive, GradAccumulator& accumulator) {
  accumulator.load(archive);
  return archive;
}

}  // namespace ampfuse
