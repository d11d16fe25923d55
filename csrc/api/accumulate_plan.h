// ampfuse::GradAccumulator's handle on the native micro-batch plan (ops::AccumulatePlan, the
// object Python's GradAccumulator holds), and the optimizer's view of it while a window step
// reads the window's fp32 sums.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <unordered_map>
#include <vector>

namespace ampfuse::ops {
class AccumulatePlan;
}  // namespace ampfuse::ops

namespace ampfuse::detail {

class MicroBatchPlan {
 public:
  // The buffered params (one device) with their fp32 buffers and the device's found_inf; the
  // other fp16/bf16 params (a gradient on one sends the pass the validated way) and the fp32
  // ones (only their dtype is watched). `flags`: the window's has-gradient flags so far.
  MicroBatchPlan(std::vector<at::Tensor> buffered, std::vector<at::Tensor> buffers,
                 at::Tensor found_inf, std::vector<at::Tensor> watched,
                 std::vector<at::Tensor> free, const std::vector<bool>& flags);
  ~MicroBatchPlan();
  MicroBatchPlan(const MicroBatchPlan&) = delete;
  MicroBatchPlan& operator=(const MicroBatchPlan&) = delete;

  // One micro-batch: every buffered param's gradient summed and cleared, and `flags` set for
  // those it took. False when stale (nothing done, `flags` untouched).
  bool collect(std::vector<bool>& flags);
  // Whether the params buffered are still the ones to buffer (see ops::AccumulatePlan).
  bool same_layout() const;
  void set_flags(const std::vector<bool>& flags);

  // For an optimizer's step plan reading the window's sums (ops::StepPlan::bind_source).
  const c10::intrusive_ptr<ops::AccumulatePlan>& native() const;
  // The gradient the window holds for `param`: its fp32 sum, or an undefined tensor when the
  // window has none; nullptr when `param` is not buffered.
  const at::Tensor* window_grad(const at::Tensor& param) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ampfuse::detail
