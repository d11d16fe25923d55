// ampfuse::GradScaler: dynamic loss scaling for LibTorch training loops, with the options and
// semantics of the Python ampfuse.GradScaler (itself a drop-in for torch.amp.GradScaler).
//
//   ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
//   scaler.scale(loss).backward();
//   scaler.unscale_and_clip_(optimizer, /*max_norm=*/1.0);  // optional
//   scaler.step(optimizer);
//   scaler.update();
//
// The scale, its growth tracker, the skip flag and the counters are device tensors, created on the
// device of the first loss passed to scale(). With ampfuse's fused optimizers (ampfuse/optim.h)
// nothing in the step synchronises the host: the optimizer receives the scale, the inf flag and
// the clip coefficient as device tensors and its kernel skips the update itself. Any other
// torch::optim::Optimizer is stepped only after reading the inf flag on the host (the one sync
// torch's own scaler also needs).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ampfuse/ops.h"
#include "ampfuse/scale_stat.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace c10 {
struct Event;
}

namespace ampfuse {

namespace engine {
struct ScalerCheckpoint;
}

// Options of GradScaler; the defaults reproduce torch.amp.GradScaler exactly.
struct GradScalerOptions {
  GradScalerOptions() = default;
  // Initial scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  // Multiplier applied after growth_interval consecutive clean steps (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  // Multiplier applied on overflow (in (0, 1)).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Clean steps before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // false makes every method a pass-through (scale() returns its input, step() just steps).
  TORCH_ARG(bool, enabled) = true;
  // Back off only on the hysteresis-th overflow since the budget was last refilled (1: on every
  // overflow). The budget refills when the scale grows, or after every clean step with
  // consecutive_hysteresis.
  TORCH_ARG(int64_t, hysteresis) = 1;
  TORCH_ARG(bool, consecutive_hysteresis) = false;
  // Bounds for the scale (an init_scale or a loaded scale outside them is clamped, with a warning).
  // It never falls below the smallest normal float32 in any case.
  TORCH_ARG(std::optional<double>, min_scale) = std::nullopt;
  TORCH_ARG(std::optional<double>, max_scale) = std::nullopt;
  // When an overflow takes the scale to its floor: "warn" (a warning naming the number of hits),
  // "raise" (a c10::Error) or "ignore". update() looks at the device counters without waiting
  // (a copy to the host that a later update() reads once it has arrived; not during CUDA-graph
  // capture); check_min_scale() waits for them.
  TORCH_ARG(std::string, on_min_scale) = "warn";
};

// Dynamic loss scaling. Not copyable (it tracks optimizers by address); movable.
class GradScaler {
 public:
  using LossClosure = std::function<at::Tensor()>;

  explicit GradScaler(GradScalerOptions options = {});

  // outputs times the current scale. Creates the scale on outputs' device on first use.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(at::TensorList outputs);

  // Divides the gradients of `optimizer` by the scale in place and records whether any is inf/NaN
  // (one fused pass per device, all dtypes together). At most once per optimizer per iteration,
  // before step(). fp16 gradients are refused ("Attempting to unscale FP16 gradients."), as in
  // torch; keep fp32 masters with ampfuse's optimizers and use unscale_and_clip_ or step() alone.
  void unscale_(torch::optim::Optimizer& optimizer);

  // unscale_ + the global gradient norm + clipping to max_norm in one read of the gradients.
  // Returns the total norm of the unscaled gradients (fp32 device tensor; no host sync). With an
  // ampfuse optimizer the gradients are only read: the optimizer applies 1/scale and the clip
  // coefficient in its own pass. With any other optimizer they are unscaled and clipped in place.
  // norm_type 2 and inf are fused; other norms run unscale_ and torch::nn::utils::clip_grad_norm_.
  // Counts as this iteration's unscale_ for `optimizer`.
  at::Tensor unscale_and_clip_(torch::optim::Optimizer& optimizer, double max_norm,
                               double norm_type = 2.0);

  // Steps `optimizer` unless this iteration's gradients held inf/NaN; returns what
  // optimizer.step() returned (an undefined tensor when the step was skipped on the host).
  // ampfuse optimizers are always called and skip on the device (no host sync); other
  // optimizers are called only after one host read of the inf flag. A closure is refused while
  // the scaler is enabled (as in torch).
  at::Tensor step(torch::optim::Optimizer& optimizer, LossClosure closure = nullptr);

  // Updates the scale from this iteration's inf checks (on the device) and resets the
  // per-optimizer states. update(new_scale) sets the scale instead.
  void update();
  void update(double new_scale);
  void update(const at::Tensor& new_scale);

  // The current scale as a number (a host read); init_scale before the first scale(), 1.0 when
  // disabled.
  double get_scale() const;
  // The scale tensor itself (1 element, fp32, on its device); undefined before the first scale().
  at::Tensor get_scale_async() const;
  // The growth tracker as a number (a host read).
  int64_t get_growth_tracker() const;

  double get_growth_factor() const;
  void set_growth_factor(double growth_factor);
  double get_backoff_factor() const;
  void set_backoff_factor(double backoff_factor);
  int64_t get_growth_interval() const;
  void set_growth_interval(int64_t growth_interval);
  bool is_enabled() const;
  const GradScalerOptions& options() const;

  // Reports the floor hits the device counters hold now, as on_min_scale says (a host sync).
  void check_min_scale();

  // Device flag set by the last update(): > 0 if that iteration's steps were skipped. nullopt
  // before the first update().
  const std::optional<at::Tensor>& last_found_inf() const;
  // Device counters, int64[kNumScaleStats] indexed by ScaleStat (zeros on the CPU before the
  // first scale()).
  at::Tensor stats() const;

  // Checkpointing: torch's entries (scale, growth_factor, backoff_factor, growth_interval,
  // _growth_tracker) plus the ampfuse options, the hysteresis budget and the counters. A disabled
  // scaler writes nothing. Reads device values (host syncs).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  // load() that checks the whole checkpoint, then runs `before_apply` (e.g. loading the
  // optimizer saved beside it), then applies it: when the check or `before_apply` throws, the
  // scaler is unchanged.
  void load(torch::serialize::InputArchive& archive, const std::function<void()>& before_apply);

  // The hand-off with code that checks the gradients itself (GradAccumulator's accumulation
  // kernel checks every sum it writes), as Python's record_inf_check:
  using PerDevice = std::vector<std::pair<c10::Device, at::Tensor>>;
  // An inf check of an ampfuse optimizer's still-scaled gradients made elsewhere stands in for
  // this iteration's unscale_ of `optimizer` (its found_inf per device: 0-dim fp32 tensors).
  void record_inf_check(torch::optim::Optimizer& optimizer, PerDevice found_inf_per_device);
  // The inf flags recorded for `optimizer` this iteration (empty before its unscale_ or step).
  const PerDevice& found_inf_per_device(torch::optim::Optimizer& optimizer);
  // Forgets this iteration's records (stages, inf flags) without updating the scale, after a
  // step that failed part-way.
  void discard_iteration();

  GradScaler(const GradScaler&) = delete;
  GradScaler& operator=(const GradScaler&) = delete;
  GradScaler(GradScaler&&) = default;
  GradScaler& operator=(GradScaler&&) = default;

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    PerDevice found_inf_per_device;
    bool grads_still_scaled = false;  // unscale_and_clip_ / external check for a fused optimizer
    std::optional<at::Tensor> clip_coef;
  };

  void lazy_init(const c10::Device& device);
  // Floor detection: whether update() may look at the counters now, a copy of them on its way to
  // the host, and the report of the copies that arrived (all of them when `blocking`).
  bool may_poll() const;
  void post_stats_copy();
  void poll_min_scale(bool blocking);
  engine::ScalerCheckpoint check_checkpoint(torch::serialize::InputArchive& archive) const;
  void apply_checkpoint(const engine::ScalerCheckpoint& checkpoint);
  // `scale` within [min_scale, max_scale] (a warning when it was not).
  double clamped(double scale, const char* what) const;
  void check_scale_initialised(const char* funcname) const;
  OptimizerState& check_unscale_stage(torch::optim::Optimizer& optimizer, const char* funcname);
  PerDevice unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale,
                          const at::Tensor& found_inf, bool allow_fp16);
  at::Tensor inv_scale() const;

  GradScalerOptions options_;
  double init_scale_;
  int64_t init_growth_tracker_ = 0;
  int64_t init_hysteresis_tracker_;
  std::vector<int64_t> init_stats_;
  at::Tensor scale_;               // fp32, 0-dim
  at::Tensor growth_tracker_;      // int32, 0-dim
  at::Tensor hysteresis_tracker_;  // int32, 0-dim
  at::Tensor stats_;               // int64[kNumScaleStats]
  std::optional<at::Tensor> last_found_inf_;
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_states_;
  struct PendingStats {
    at::Tensor host;                     // the counters, or their copy on its way to the host
    std::shared_ptr<c10::Event> copied;  // recorded after the copy (none: already on the host)
  };
  std::vector<PendingStats> pending_stats_;
  int64_t floor_hits_seen_ = 0;
};

// torch::save(scaler, path) / torch::load(scaler, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler);

}  // namespace ampfuse
