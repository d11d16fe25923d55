// GradAccumulator's window, once for both surfaces: which params are summed in fp32 buffers, the
// buffers' layout, a micro-batch's collect (the native plan in the steady state, the validated
// pass otherwise), the window's end, and the partial sums a mid-window checkpoint holds.
// Python holds one through torch.classes.ampfuse.AccumulatorWindow (registration.cpp), the C++
// GradAccumulator directly; each keeps only its loop API, its distributed wrappers and its
// checkpoint format.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/step_plan.h"

namespace ampfuse::engine {

// The counters of a GradAccumulator checkpoint (entries "steps", "micro_step", "windows" and,
// optionally, "skipped_windows_host"), checked against this accumulator's `steps`: returns
// {micro_step, windows, skipped_windows_host (0 when absent)}. `source` names the checkpoint in the
// steps message ("state_dict", "The checkpoint"); `naming` has "{}" where an entry's name goes
// ("the state dict's {}"). Raises c10::ValueError.
std::vector<int64_t> check_accumulator_counters(const c10::Dict<std::string, c10::IValue>& entries, int64_t steps,
                                                const std::string& source, const std::string& naming);

// A mid-window checkpoint's partial sums are in the units of the loss scale they were taken under:
// `saved_scaled` (taken with an enabled scaler) must equal `scaled` (this accumulator has one).
// `source` names the checkpoint ("the state dict", "The checkpoint"). Raises c10::ValueError.
void check_window_sums_scale(bool saved_scaled, bool scaled, const std::string& source);

class AccumulatorWindow : public torch::CustomClassHolder {
 public:
  // fp32_accumulation: fp16/bf16 params that require grad are summed in fp32 buffers (else none
  // is, and every gradient sums in its .grad). per_param: one buffer per param, shaped like it
  // (FSDP2: a DTensor over the local shard); else one flat buffer per device, each param's buffer
  // a view into it.
  AccumulatorWindow(bool fp32_accumulation, bool per_param);

  // ---- layout -------------------------------------------------------------------------------
  // The params to buffer among `params` (every param of the optimizer): the fp16/bf16 ones that
  // require grad now.
  std::vector<at::Tensor> wanted(const std::vector<at::Tensor>& params) const;
  // (Re)builds the buffers for `low`, keeping the partial sums and has-gradient flags of the
  // params it keeps. Drops the plan when the layout changes.
  void layout(const std::vector<at::Tensor>& low);
  // A window starts: buffer what requires grad now (the plan tells without a pass over the
  // params whether that is what is buffered already).
  void start(const std::vector<at::Tensor>& params);
  // Whether the plan tells that the params buffered are those start() would buffer (false
  // without a plan).
  bool plan_says_same_layout() const;

  // ---- a micro-batch ------------------------------------------------------------------------
  // After its backward: every buffered param's gradient summed into its buffer (fp32, inf/NaN
  // into its device's found_inf) and its .grad cleared. Through the plan when there is one and
  // it was built for these gradients; otherwise the validated pass (a param without a buffer
  // that got a gradient widens the layout first; sparse gradients are refused), after which a
  // plan is built if `allow_plan` and the buffers are plain tensors on one device.
  void collect(const std::vector<at::Tensor>& params, bool allow_plan);
  // The steady state's collect alone: false (nothing done) without a plan or when it is stale.
  bool collect_planned();
  // The owner saw the optimizer's params change (or runs traced): the plan is not used again.
  void drop_plan();
  bool has_plan() const { return plan_.defined(); }
  // Which plan the window holds: a new number for every plan built, 0 without one.
  int64_t plan_id() const { return plan_.defined() ? plan_id_ : 0; }
  // Whether no param of the optimizer has a .grad (told by the plan; false without one).
  bool plan_says_no_grads() const;

  // ---- the window's end ---------------------------------------------------------------------
  // The sums times `factor` (an incomplete window: the sums hold sum / steps).
  void scale(double factor);
  // The next window starts clean: sums and found_inf zero, no flag set, no .grad on `params`
  // (every param of the optimizer; none: those the plan was built for).
  void end(const std::optional<std::vector<at::Tensor>>& params);

  // ---- what the window holds ----------------------------------------------------------------
  const std::vector<at::Tensor>& params() const { return low_; }
  const std::vector<at::Tensor>& buffers() const { return buffers_; }
  // Per buffered param, whether its buffer holds a gradient this window.
  std::vector<bool> flags() const;
  void set_flags(const std::vector<bool>& flags);
  // The devices of the flat buffers (in the order of the params), each one's flat buffer
  // (undefined with per_param) and found_inf (0-dim fp32).
  const std::vector<c10::Device>& devices() const { return devices_; }
  const std::vector<at::Tensor>& flats() const { return flats_; }
  const at::Tensor& found_inf(const c10::Device& device) const;
  // The gradient a window step reads for `param`: its sum, or an undefined tensor when the window
  // has none; nullptr when `param` is not buffered.
  const at::Tensor* window_grad(const at::Tensor& param) const;
  // The plan a step plan binds as its gradients' source (undefined without one).
  const c10::intrusive_ptr<AccumulatePlan>& plan() const { return plan_; }

  // ---- checkpoints --------------------------------------------------------------------------
  // A mid-window checkpoint's entries, checked against `params` (every param of the optimizer)
  // before the caller changes anything: `buffered` (indices of the fp16/bf16 params the buffers
  // hold, in order), per device of those params a float32 flat buffer of their total size and a
  // 1-element found_inf (keyed by the device's name when `device_keys`, else by its place),
  // `has_grad` (one flag per buffered param) and the partial sums of the other params (`grads`,
  // by index, each of its param's shape). `naming` has "{}" where an entry's name goes. Raises
  // c10::ValueError naming the entry; on success the checked values wait for load().
  void check_checkpoint(const std::vector<at::Tensor>& params, const c10::IValue& buffered,
                        const c10::Dict<std::string, c10::IValue>& buffers,
                        const c10::Dict<std::string, c10::IValue>& found_infs, const c10::IValue& has_grad,
                        const c10::Dict<int64_t, c10::IValue>& grads, const std::string& naming,
                        bool device_keys);
  // Loads what check_checkpoint() accepted (mid_window), or starts a clean window at a
  // boundary: the params wanted now buffered, zero sums. Either way the other params' .grad is
  // the checkpoint's partial sum or None.
  void load(const std::vector<at::Tensor>& params, bool mid_window);

  // For Python (torch.classes): lists and flags as TorchScript types.
  c10::List<bool> flags_list() const;
  void set_flags_list(const c10::List<bool>& flags);
  std::vector<std::string> device_names() const;
  std::vector<at::Tensor> found_infs() const;
  std::vector<int64_t> indices_of_buffered(const std::vector<at::Tensor>& params) const;

 private:
  void collect_validated(const std::vector<at::Tensor>& params);
  void build_plan(const std::vector<at::Tensor>& params);
  at::Tensor& found_inf_of(const c10::Device& device);

  bool fp32_accumulation_;
  bool per_param_;
  std::vector<at::Tensor> low_, buffers_;
  std::vector<uint8_t> flags_;  // while a plan runs, the plan holds them
  std::vector<c10::Device> devices_;
  std::vector<at::Tensor> flats_;
  std::vector<std::pair<c10::Device, at::Tensor>> found_inf_;  // every device seen, kept
  std::unordered_map<const c10::TensorImpl*, size_t> index_;  // buffered param -> its place
  c10::intrusive_ptr<AccumulatePlan> plan_;
  int64_t plan_id_ = 0;
  struct Pending {
    std::vector<at::Tensor> low, flats, found_infs;
    std::vector<uint8_t> flags;
    std::unordered_map<const c10::TensorImpl*, at::Tensor> grads;
  };
  std::optional<Pending> pending_;
};

}  // namespace ampfuse::engine
