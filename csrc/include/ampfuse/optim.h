// ampfuse::optim::SGD, Adam, AdamW: torch::optim::Optimizer subclasses whose step is one fused
// kernel pass per (param group, device, dtype) -- the same sgd_step_/adam_step_ ops the Python
// ampfuse.optim optimizers call.
//
// What the pass does: reads each gradient once (still scaled if a GradScaler says so: it is
// divided by the scale and multiplied by the clip coefficient in registers); if the scaler's
// found_inf is set it changes nothing at all (params, masters, state and step counters stay
// bitwise unchanged, decided on the device); otherwise it updates the fp32 master weight and fp32
// state and writes the fp16/bf16 param rounded to nearest. fp32 params need no master.
//
// Options mirror torch::optim::SGDOptions / AdamOptions / AdamWOptions (same setters and
// defaults, SGD's lr defaulting to 1e-3 as in Python) plus maximize, master_weights and the
// precision options of the Python optimizers: master_remainders (bf16 params keep an int16
// remainder that with the param is the fp32 master bit for bit -- Python's
// master_weights="remainder"), stochastic_rounding with rounding_seed (bf16 params keep no master
// and are rounded stochastically -- Python's master_weights="stochastic") and state_dtype (fp32,
// bf16 or 8-bit block-scaled state; fp32 math). Per-param state,
// as in Python: step (fp32 0-dim tensor on the param's device), momentum_buffer or exp_avg /
// exp_avg_sq / max_exp_avg_sq (of state_dtype), master_param (fp32) or master_remainder (int16).
// save()/load() go through torch::serialize archives (torch::save/torch::load work): state is
// saved as fp32 and a remainder as the fp32 master_param it stands for, so a checkpoint does not
// depend on the precision options; a checkpoint of torch's own C++ SGD/Adam/AdamW loads too.
//
// SGD, Adam and AdamW are one class template, Fused<Policy>, over a policy per optimizer (its
// options, per-param state and kernel call). Each options type lists its fields once (fields()):
// serialisation, comparison and param-group merging are generic over that list.
//
// Not fused / not supported: sparse gradients, complex or fp64 params, tensor learning rates.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace ampfuse::detail {
struct OptimizerInternals;
struct OptimizerPlan;
}  // namespace ampfuse::detail

#include "ampfuse/ops.h"

namespace ampfuse::optim {

struct SGDOptions : public torch::optim::OptimizerCloneableOptions<SGDOptions> {
  SGDOptions(double lr = 1e-3);  // NOLINT: implicit, as torch's
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;
  TORCH_ARG(bool, maximize) = false;
  // fp32 master weights for fp16/bf16 params (false: update them directly, fp32 math).
  TORCH_ARG(bool, master_weights) = true;
  // With master_weights: bf16 params keep an int16 remainder instead of an fp32 master.
  TORCH_ARG(bool, master_remainders) = false;
  // With master_weights: bf16 params keep no master; each step's update is rounded into the param
  // stochastically (unbiased), with reproducible draws of rounding_seed (Python's
  // master_weights="stochastic"). Excludes master_remainders.
  TORCH_ARG(bool, stochastic_rounding) = false;
  TORCH_ARG(int64_t, rounding_seed) = 0;
  // Storage of the momentum buffer: at::kFloat, at::kBFloat16 (rounded to nearest even), or
  // 8-bit block-scaled: at::kByte (a dynamic map), at::kFloat8_e4m3fn or at::kFloat8_e5m2 (for
  // params of 4,096 elements or more; smaller ones keep fp32).
  TORCH_ARG(c10::ScalarType, state_dtype) = at::kFloat;

 public:
  // f(name, member) for every option: what serialize, operator== and group merging iterate over.
  template <class Self, class F>
  static void fields(Self& self, F&& f) {
    f("lr", self.lr_);
    f("momentum", self.momentum_);
    f("dampening", self.dampening_);
    f("weight_decay", self.weight_decay_);
    f("nesterov", self.nesterov_);
    f("maximize", self.maximize_);
    f("master_weights", self.master_weights_);
    f("master_remainders", self.master_remainders_);
    f("stochastic_rounding", self.stochastic_rounding_);
    f("rounding_seed", self.rounding_seed_);
    f("state_dtype", self.state_dtype_);
  }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const SGDOptions& lhs, const SGDOptions& rhs);
  double get_lr() const override;
  void set_lr(const double lr) override;
};

// An option of Derived's options type: as TORCH_ARG, but the setter returns Derived& (chained
// setters keep the type) for options a base template declares.
#define AMPFUSE_OPTION(T, name)                    \
 public:                                           \
  Derived& name(const T& value) {                  \
    name##_ = value;                               \
    return static_cast<Derived&>(*this);           \
  }                                                \
  const T& name() const noexcept { return name##_; } \
  T& name() noexcept { return name##_; }           \
                                                   \
 private:                                          \
  T name##_

// Adam's and AdamW's options, declared once: AdamW's weight_decay defaults to 1e-2 (torch's).
template <class Derived>
struct AdamOptionsBase : public torch::optim::OptimizerCloneableOptions<Derived> {
  using betas_t = std::tuple<double, double>;
  AMPFUSE_OPTION(double, lr);
  AMPFUSE_OPTION(betas_t, betas) = std::make_tuple(0.9, 0.999);
  AMPFUSE_OPTION(double, eps) = 1e-8;
  AMPFUSE_OPTION(double, weight_decay);
  AMPFUSE_OPTION(bool, amsgrad) = false;
  AMPFUSE_OPTION(bool, maximize) = false;
  AMPFUSE_OPTION(bool, master_weights) = true;
  AMPFUSE_OPTION(bool, master_remainders) = false;
  AMPFUSE_OPTION(bool, stochastic_rounding) = false;  // as SGDOptions::stochastic_rounding
  AMPFUSE_OPTION(int64_t, rounding_seed) = 0;
  // Storage of exp_avg / exp_avg_sq / max_exp_avg_sq: as SGDOptions::state_dtype.
  AMPFUSE_OPTION(c10::ScalarType, state_dtype) = at::kFloat;
  // Storage of exp_avg_sq / max_exp_avg_sq when it differs from state_dtype (both 8-bit);
  // at::ScalarType::Undefined: state_dtype.
  AMPFUSE_OPTION(c10::ScalarType, exp_avg_sq_dtype) = at::ScalarType::Undefined;

 public:
  template <class Self, class F>
  static void fields(Self& self, F&& f) {
    f("lr", self.lr_);
    f("betas", self.betas_);
    f("eps", self.eps_);
    f("weight_decay", self.weight_decay_);
    f("amsgrad", self.amsgrad_);
    f("maximize", self.maximize_);
    f("master_weights", self.master_weights_);
    f("master_remainders", self.master_remainders_);
    f("stochastic_rounding", self.stochastic_rounding_);
    f("rounding_seed", self.rounding_seed_);
    f("state_dtype", self.state_dtype_);
    f("exp_avg_sq_dtype", self.exp_avg_sq_dtype_);
  }
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }

 protected:
  AdamOptionsBase(double lr, double weight_decay) : lr_(lr), weight_decay_(weight_decay) {}
};
#undef AMPFUSE_OPTION

struct AdamOptions : public AdamOptionsBase<AdamOptions> {
  AdamOptions(double lr = 1e-3) : AdamOptionsBase(lr, 0.0) {}  // NOLINT: implicit, as torch's
};
struct AdamWOptions : public AdamOptionsBase<AdamWOptions> {
  AdamWOptions(double lr = 1e-3) : AdamOptionsBase(lr, 1e-2) {}  // NOLINT
};
extern template struct AdamOptionsBase<AdamOptions>;
extern template struct AdamOptionsBase<AdamWOptions>;
bool operator==(const AdamOptions& lhs, const AdamOptions& rhs);
bool operator==(const AdamWOptions& lhs, const AdamWOptions& rhs);

struct SGDParamState : public torch::optim::OptimizerCloneableParamState<SGDParamState> {
  TORCH_ARG(at::Tensor, step);              // fp32 0-dim; 0 until the first step actually taken
  TORCH_ARG(at::Tensor, momentum_buffer);   // state_dtype; initialised by the first step taken
  TORCH_ARG(at::Tensor, master_param);      // fp32
  TORCH_ARG(at::Tensor, master_remainder);  // int16 (master_remainders, bf16 params)
  TORCH_ARG(at::Tensor, momentum_buffer_absmax);  // fp32 block scales of an 8-bit buffer

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

struct AdamParamState : public torch::optim::OptimizerCloneableParamState<AdamParamState> {
  TORCH_ARG(at::Tensor, step);
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, max_exp_avg_sq);  // amsgrad only
  TORCH_ARG(at::Tensor, master_param);
  TORCH_ARG(at::Tensor, master_remainder);
  // fp32 block scales of 8-bit exp_avg / exp_avg_sq / max_exp_avg_sq
  TORCH_ARG(at::Tensor, exp_avg_absmax);
  TORCH_ARG(at::Tensor, exp_avg_sq_absmax);
  TORCH_ARG(at::Tensor, max_exp_avg_sq_absmax);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};
using AdamWParamState = AdamParamState;

// The fp32 master of bf16 `param` and int16 `remainder`, and the inverse split (as Python's
// ampfuse.optim.join_master / split_master; csrc/ops/rules.h has the kernels' versions).
at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder);
std::tuple<at::Tensor, at::Tensor> split_master(const at::Tensor& master);

// What ampfuse's optimizers share: parameter checks, param groups with their own options, the
// scaling hand-off with GradScaler and the fp32 gradient buffers of GradAccumulator.
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  // Runs the closure (with grad enabled) if given, then the fused step (without grad).
  at::Tensor step(LossClosure closure = nullptr) override = 0;

  // Adds a param group. Its options (of this optimizer's options type) are merged with the
  // defaults as torch does for its own optimizers: fields left at their default-constructed
  // value inherit the optimizer's defaults. (torch::optim::Optimizer::add_param_group, which
  // this hides, would drop a custom optimizer's group options.)
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  // Scaling for the next step() calls until cleared: grads divided by grad_scale and multiplied
  // by clip_coef, nothing changed when found_inf != 0. Set by GradScaler::step around its call.
  void set_step_scaling(StepScaling scaling);
  void clear_step_scaling();
  const std::optional<StepScaling>& step_scaling() const;

  // An fp32 buffer the step reads instead of param.grad() (GradAccumulator's fp32 sums).
  void set_grad_buffer(const at::Tensor& param, at::Tensor buffer);
  void remove_grad_buffer(const at::Tensor& param);
  // The gradient the next step reads for `param`: its buffer if set, else (while a
  // GradAccumulator's window step runs) the window's fp32 sum of a param it buffers, else
  // param.grad().
  at::Tensor grad_of(const at::Tensor& param) const;

  // Every check of a step (parameters and gradients), before anything is modified. step() runs
  // it; exposed for callers that want to fail early.
  void validate();

  // Restarts every fp32 master (or bf16 remainder) from its param now. The step does this by
  // itself for a param edited or replaced since the last step; call this to have the masters
  // (and a checkpoint saved now) follow such edits before the next step. It also takes back the
  // params another ampfuse optimizer took over with its own master: a param's master belongs to
  // one optimizer, and the step of one whose param was taken since it last stepped it is
  // refused (naming the param and both optimizers) until this is called.
  void sync_masters_from_params();

  // The found_inf flag the last step() was given (GradScaler's, through step_scaling()): a
  // 1-element device tensor, non-zero when that step changed nothing; reading it is the caller's
  // host sync, if any. nullopt before the first step and after a step given no flag.
  std::optional<at::Tensor> last_step_skipped() const;

  // The persistent step plan (the same native object as Python's, csrc/engine/step_plan.h): built by
  // a step that went the validated way, used by the following steps while the param groups, the
  // state and the structural options stay as they were, no grad buffer is set and the gradients
  // come from where they came from then (.grad, or a GradAccumulator window's fp32 sums); per
  // step it checks the gradients and the params' data itself. False when no plan is current.
  bool has_step_plan() const;

  // The hand-off between the library's own objects (GradScaler's pass through the step plan,
  // GradAccumulator's window sums): an opaque handle outside the library.
  detail::OptimizerInternals& internals() const;

  ~FusedOptimizer() override;

 protected:
  explicit FusedOptimizer(std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  // The options a new group gets from its own (user) options and the defaults; checks them.
  virtual std::unique_ptr<torch::optim::OptimizerOptions> merge_group_options(
      const torch::optim::OptimizerOptions& user) const = 0;
  // Checks the hyper-parameters of one group's options.
  virtual void check_options(const torch::optim::OptimizerOptions& options) const = 0;
  // The state tensors `param` has now, by their state_dict names.
  virtual std::vector<std::pair<const char*, at::Tensor>> state_tensors(const at::Tensor& param) const = 0;
  void check_params(size_t group_index);

  // What the optimizer's step plan depends on that the optimizer owns (param groups, state
  // objects and tensors, structural options), as identities; and every group's hyper-parameters,
  // checked, into the plan.
  virtual std::vector<const void*> plan_key() const = 0;
  virtual void set_plan_hyper(detail::OptimizerPlan& plan) const = 0;
  // A step through the current plan (true), or nothing done (false: no plan, or stale).
  bool step_with_plan();

 private:
  std::unique_ptr<detail::OptimizerInternals> internals_;
};

// The optimizers' policies (defined in csrc/api/optim.cpp): Options, State, and how a bucket of
// tensors is stepped.
struct SgdPolicy;
struct AdamPolicy;
struct AdamWPolicy;

template <class Policy>
struct PolicyTypes;
template <>
struct PolicyTypes<SgdPolicy> {
  using Options = SGDOptions;
  using State = SGDParamState;
};
template <>
struct PolicyTypes<AdamPolicy> {
  using Options = AdamOptions;
  using State = AdamParamState;
};
template <>
struct PolicyTypes<AdamWPolicy> {
  using Options = AdamWOptions;
  using State = AdamParamState;
};

// One fused optimizer: SGD, Adam and AdamW below.
template <class Policy>
class Fused : public FusedOptimizer {
 public:
  using Options = typename PolicyTypes<Policy>::Options;
  using State = typename PolicyTypes<Policy>::State;

  explicit Fused(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 Options defaults = {});
  explicit Fused(std::vector<at::Tensor> params, Options defaults = {});

  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  std::unique_ptr<torch::optim::OptimizerOptions> merge_group_options(
      const torch::optim::OptimizerOptions& user) const override;
  void check_options(const torch::optim::OptimizerOptions& options) const override;
  std::vector<std::pair<const char*, at::Tensor>> state_tensors(const at::Tensor& param) const override;
  std::vector<const void*> plan_key() const override;
  void set_plan_hyper(detail::OptimizerPlan& plan) const override;
};

extern template class Fused<SgdPolicy>;
extern template class Fused<AdamPolicy>;
extern template class Fused<AdamWPolicy>;

using SGD = Fused<SgdPolicy>;
using Adam = Fused<AdamPolicy>;
using AdamW = Fused<AdamWPolicy>;

}  // namespace ampfuse::optim
