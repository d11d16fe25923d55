// What the library's own objects hand each other about an ampfuse optimizer: its internals,
// which FusedOptimizer::internals() gives as an opaque handle (this header is not installed).
// GradScaler runs its gradient pass through the optimizer's step plan; GradAccumulator hands over
// its window, whose fp32 sums a window step reads.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ampfuse/optim.h"
#include "engine/accumulator_window.h"
#include "engine/master_keeper.h"

namespace ampfuse::detail {

struct OptimizerPlan;  // the persistent step plan and what it was built for (api/optim.cpp)

// One bucket of a validated step, as the step plan takes it (group index, params, masters, state
// lists, step counters, whether the gradients are fp32 for low-precision params).
struct StepPlanBucket {
  size_t group = 0;
  std::vector<at::Tensor> params, masters, steps;
  std::array<std::vector<at::Tensor>, 3> states, absmaxes;
  bool fp32_grads = false;
};

struct OptimizerInternals {
  // Scaling for the next steps (GradScaler::step sets it around its call).
  std::optional<StepScaling> scaling;
  // Params whose fp32 master was loaded: the next step brings their params to round-half-even.
  std::unordered_set<const c10::TensorImpl*> reconcile;
  // fp32 buffers a step reads instead of param.grad() (set_grad_buffer).
  std::unordered_map<const c10::TensorImpl*, at::Tensor> grad_buffers;
  // Each param's dtype when it joined (a model converted since is named).
  std::unordered_map<const c10::TensorImpl*, c10::ScalarType> param_dtypes;
  std::shared_ptr<OptimizerPlan> plan;
  // GradAccumulator's window step: the gradients are the window's sums (the step plan binds the
  // window's micro-batch plan as its gradients' source), set around the step.
  c10::intrusive_ptr<engine::AccumulatorWindow> grad_source;
  // Param groups added through FusedOptimizer::add_param_group (whose options it merged and
  // checked): one added another way (torch::optim::Optimizer::add_param_group through a base
  // reference, which gives a custom optimizer's group the defaults) is refused at the next step.
  size_t groups_added = 0;
  // Who keeps each param's master (claims, the restart of a replaced param's master).
  c10::intrusive_ptr<engine::MasterKeeper> keeper;
  // The found_inf the last step was given (last_step_skipped()).
  std::optional<at::Tensor> last_found_inf;
};

// GradScaler's pass over the gradients the next step of `opt` reads, through its current step
// plan (one look at the optimizer's params): per device [found_inf] or [found_inf, total_norm,
// clip_coef] (see engine/step_plan.h; clip_coef with `max_norm` on one device only); nullopt when
// no plan is current, it saw a change, or it reads fp16 gradients and `allow_fp16` is false (the
// caller then goes the validated way), as Python's FusedOptimizer.scaler_check.
std::optional<std::vector<at::Tensor>> plan_check(optim::FusedOptimizer& opt,
                                                  const at::Tensor& scale, bool write,
                                                  bool with_norm, double norm_type,
                                                  std::optional<double> max_norm, bool allow_fp16);

// torch::nn::utils::clip_grad_norm_ over the gradients the next step of `optimizer` reads (an
// ampfuse optimizer's grad_of: a window's fp32 sums where the accumulator holds them), in place;
// returns the total norm (api/grad_scaler.cpp).
double clip_grad_norm_of_step(torch::optim::Optimizer& optimizer, double max_norm, double norm_type);

}  // namespace ampfuse::detail
