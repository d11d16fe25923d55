// Who keeps a param's master, once for both surfaces (Python holds one MasterKeeper per optimizer
// as torch.classes.ampfuse.MasterKeeper; a C++ FusedOptimizer holds one in its internals).
//
// A fp16/bf16 param's fp32 master (or bf16 remainder) belongs to one optimizer. A second ampfuse
// optimizer may take a param over with its own master (a new optimizer replacing an old one):
// the first one then loses it, and its step of that param with a master is refused, naming the
// param and both optimizers, until its sync_masters_from_params() takes the param back. (Two
// masters of one param stepped in turn each take the other's updates for edits and restart from
// the param at every step, which trains as if there were no masters.)
//
// It also restarts a master whose param was replaced (`p.data = new`, `p.set_(new)`,
// `p.set_data(new)`, which `torch::load(module, ...)` does): the param's memory moved while the
// optimizer kept the same master tensor, so the whole master starts again from the new value.
// (The step's own edit check goes element by element: it keeps the old master wherever the new
// value rounds to what the old master rounds to.) A master that was itself replaced (a loaded
// checkpoint) is the one to keep.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <atomic>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/step_plan.h"

namespace ampfuse::engine {

class MasterKeeper : public torch::CustomClassHolder {
 public:
  // `optimizer`: the optimizer's class name ("AdamW"), for messages.
  explicit MasterKeeper(std::string optimizer);
  ~MasterKeeper() override;

  // Before a step modifies anything. `stepping`: the params this step steps with a master (an
  // fp32 master or a remainder; named by `naming` with groups[k] / indices[k], as
  // step_checks.h's param_name); `kept`: every param whose master this optimizer holds or is
  // about to create (`stepping` included). Refuses a param of `stepping` another keeper took
  // since this one last stepped it, before anything changes; then every param of `stepping` is
  // this keeper's (a keeper it was taken from expires its held plan and must claim again).
  void claim(const std::vector<at::Tensor>& stepping, const std::vector<int64_t>& groups,
             const std::vector<int64_t>& indices, const std::string& naming,
             const std::vector<at::Tensor>& kept);
  // Whether the next step must claim before it runs (a param was taken from this keeper since
  // its last claim, or the masters were synced from the params).
  bool needs_claim() const;

  // masters[i]: params[i]'s master, an fp32 master or an int16 remainder (told by its dtype).
  // A param whose memory moved since the last call that saw it with this very master tensor
  // restarts its master from it (master = param, remainder = 0). Records every param's memory.
  // Tensor subclasses without storage (DTensor) are skipped.
  void restart_replaced(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters);

  // Every master restarts from its param now (as above), and the params taken from this keeper
  // are its own again: the next step claims them back.
  void sync_from_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters);

  // The plan of the optimizer's steps (held weakly): expired (it then reports stale, so the owner
  // goes the validated way, which claims) when a param is taken from this keeper. None: no plan.
  void hold_plan(const std::optional<c10::intrusive_ptr<StepPlan>>& plan);

  const std::string& optimizer() const { return optimizer_; }

  // When the last owner lets go (the registry's weak references may keep the object).
  void release_resources() override;

 private:
  using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Seen {
    WeakTensor param;
    const void* data = nullptr;
    WeakTensor master;
  };
  bool keeps(const c10::TensorImpl* p) const;
  void lose(const c10::TensorImpl* p, const WeakTensor& param);
  void expire_plan();

  std::string optimizer_;
  // The params whose masters this keeper holds (as of its last claim) and those another keeper
  // took from it since (both guarded by the registry's mutex), and each param's memory when its
  // master was last seen.
  std::unordered_map<const c10::TensorImpl*, WeakTensor> kept_, taken_;
  std::unordered_map<const c10::TensorImpl*, Seen> seen_;
  size_t seen_swept_at_ = 64;
  std::atomic<bool> needs_claim_{false};
  c10::weak_intrusive_ptr<StepPlan> plan_{c10::intrusive_ptr<StepPlan>()};  // registry's mutex
};

}  // namespace ampfuse::engine
