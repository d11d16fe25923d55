// ampfuse::GradAccumulator: gradient accumulation that is correct under loss scaling, for
// LibTorch training loops (the C++ counterpart of ampfuse.GradAccumulator).
//
//   ampfuse::GradAccumulator acc(optimizer, &scaler,
//                                ampfuse::GradAccumulatorOptions(4).max_grad_norm(1.0));
//   for (auto& batch : loader) {
//     auto loss = loss_fn(model->forward(batch.data), batch.target);
//     if (acc.backward(loss)) { /* a window ended: the optimizer stepped or skipped */ }
//   }
//   acc.flush();  // steps an incomplete last window with the right scale
//
// Guarantees: the loss scale is constant inside a window (the scaler updates only at window
// ends); an overflow in any micro-batch skips the whole window, backs the scale off once and
// resets the sums; fp16/bf16 gradients are summed in fp32 (one fused kernel per micro-batch adds
// them into fp32 buffers, zeroes .grad() and checks for inf/NaN in the same pass). With an ampfuse
// optimizer the fused step reads those buffers directly and the accumulation kernel's inf check
// replaces the scaler's (no extra pass); with any other optimizer the sums are written back into
// .grad() once per window. fp32 parameters accumulate in .grad() as usual. An LR scheduler, if
// attached, advances only on windows that stepped (one host read of the skip flag per window).
// Not provided in C++: DistributedDataParallel integration (LibTorch has no DDP module).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ampfuse/grad_scaler.h"
#include "ampfuse/ops.h"

namespace torch::optim {
class Optimizer;
class LRScheduler;
}  // namespace torch::optim
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace ampfuse {

struct GradAccumulatorOptions {
  GradAccumulatorOptions(int64_t steps = 1) : steps_(steps) {}  // NOLINT: implicit
  // Micro-batches per optimizer step (>= 1).
  TORCH_ARG(int64_t, steps) = 1;
  // Clip the global gradient norm at each step (nullopt: no clipping).
  TORCH_ARG(std::optional<double>, max_grad_norm) = std::nullopt;
  // Norm used for clipping: 2 and inf are fused.
  TORCH_ARG(double, norm_type) = 2.0;
  // Sum fp16/bf16 gradients in fp32 buffers.
  TORCH_ARG(bool, fp32_accumulation) = true;
};

class GradAccumulator {
 public:
  // `scaler` may be null (bf16/fp32 training without loss scaling); a disabled scaler counts as
  // none. The optimizer, scaler and scheduler must outlive the accumulator.
  GradAccumulator(torch::optim::Optimizer& optimizer, GradScaler* scaler,
                  GradAccumulatorOptions options = {});
  ~GradAccumulator();
  GradAccumulator(const GradAccumulator&) = delete;
  GradAccumulator& operator=(const GradAccumulator&) = delete;

  // One micro-batch: backpropagates loss / steps (times the loss scale), adds the fp16/bf16
  // gradients into the fp32 buffers, and at the end of a window unscales (+ clips), steps and
  // updates the scale. Returns true when this micro-batch closed a window.
  bool backward(const at::Tensor& loss);

  // Steps an incomplete window now (e.g. at the end of an epoch), scaling the update as the mean
  // over the micro-batches it holds. Returns whether there was anything to step.
  bool flush();

  // Advance `scheduler` once per window that stepped (nullptr: none).
  void set_lr_scheduler(torch::optim::LRScheduler* scheduler);

  int64_t steps() const;
  // Micro-batches in the current window.
  int64_t micro_step() const;
  // Windows completed (stepped or skipped).
  int64_t windows() const;
  // Windows known on the host to have been skipped (counted when a scheduler is attached).
  int64_t skipped_windows_host() const;
  // True right after the micro-batch (or flush) that closed a window.
  bool window_ended() const;
  // Device flag of the last window (> 0: skipped); nullopt without a scaler or before the first
  // window.
  const std::optional<at::Tensor>& last_window_skipped() const;

  // Whether the next micro-batch's pass can go through the native plan (the same object as
  // Python's GradAccumulator, csrc/engine/step_plan.h): built by the first pass that went the
  // validated way, it sums every gradient in one native call while the params and the layout
  // stay as they were.
  bool has_accumulate_plan() const;

  // Counters, the optimizer's and the scaler's state, and the partial fp32 sums when saved inside
  // a window.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  std::vector<at::Tensor> all_params() const;
  void collect();
  void end_window(int64_t micro_batches);
  std::optional<at::Tensor> step_window();
  void clip_unscaled();

  torch::optim::Optimizer& optimizer_;
  GradScaler* scaler_;
  GradAccumulatorOptions options_;
  torch::optim::LRScheduler* lr_scheduler_ = nullptr;
  bool fused_;
  int64_t micro_step_ = 0;
  int64_t windows_ = 0;
  int64_t skipped_windows_host_ = 0;
  bool window_ended_ = false;
  std::optional<at::Tensor> last_window_skipped_;
  // The buffers, flags and micro-batch plan (the engine's AccumulatorWindow) and the optimizer's
  // params its plan was built for (csrc/api/accumulation.cpp).
  struct Window;
  std::unique_ptr<Window> window_;
};

// torch::save(accumulator, path) / torch::load(accumulator, path).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradAccumulator& accumulator);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradAccumulator& accumulator);

}  // namespace ampfuse
