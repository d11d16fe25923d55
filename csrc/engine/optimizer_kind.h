// An optimizer's kind descriptor: the one internal list of what the engine knows about an
// optimizer (its hyper-parameters: name, type, bounds, the group option each is read from and
// whether it may be a device tensor; its state: keys, the step op's list names, when each exists
// and which dtype option stores it), and the step op it runs. The step plan, the group check,
// both surfaces' optimizers (Python reads it through the optimizer_kind op) take it from here;
// the op layer and the op schema keep their own argument names, the public options and
// constructors theirs.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "ops/kernel_api.h"
#include "ops/op_core.h"
#include "ops/rules.h"
#include "ops/validation.h"

namespace ampfuse::engine {

// How a hyper-parameter is held: a real number, a flag (0 or 1) or an integer seed in [0, 2**53).
enum class HyperType { Real, Flag, Seed };
// The values a real hyper-parameter takes (torch's bounds, the engine's group check).
enum class HyperBound { Any, AtLeastZero, UnitInterval };

struct HyperSpec {
  const char* name;    // the step plan's and the step op's name: "beta1"
  const char* option;  // the group option it is read from ("betas"); "": from the group's
                       // master_weights (stochastic rounding and its seed, common to every kind)
  int element;         // its element of a pair option (betas[1]), else -1
  HyperType type;
  HyperBound bound;
  bool device;         // besides lr, the one value a 1-element device tensor may hold
  double fallback;     // its value when a group lacks the option (a group saved by an older torch);
                       // NaN: every group holds it
};

struct StateSpec {
  const char* key;           // the param state's key: "exp_avg"
  const char* list;          // the step op's list argument: "exp_avgs"
  const char* absmax;        // the step op's block-absmax list: "exp_avg_absmax"
  const char* gate;          // the option it exists with: a nonzero number or true ("" : always)
  const char* dtype_option;  // the option its storage dtype is read from (None: "state_dtype")
  bool nonnegative;          // its values are >= 0 (the unsigned 8-bit map)
};

// A group's hyper-parameters packed for the kernels, once per change of its options.
using PackedHyper = std::variant<SgdHyper, AdamHyper>;

struct OptimizerKind {
  const char* name;             // the kind: "sgd", "adam"
  std::vector<const char*> optimizers;  // the optimizers of the kind: "Adam", "AdamW"
  std::vector<HyperSpec> hyper;
  std::vector<StateSpec> states;
  const char* device_tensor;    // the step op's argument of the device value: "beta1_tensor"
  size_t packed;                // its alternative of PackedHyper

  // The values in `hyper`'s order, packed; the op layer's checks of them and of the lists a
  // bucket steps (`device_value`: the device tensor is given); the step over validated lists or
  // prepared rows.
  PackedHyper pack(const std::vector<double>& values) const;
  void check(const PackedHyper& h, const detail::OptimLists& l, bool device_value) const;
  void step(const ops::Backend& b, const detail::OptimLists& l, const PackedHyper& h,
            const c10::Device& device, const detail::HyperTensors& ht,
            const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
            const std::optional<at::Tensor>& clip_coef) const;
  void step_rows(const ops::Backend& b, const kernels::OptimTensor* rows, int64_t n,
                 const ops::core::OptimDTypes& dtypes, const PackedHyper& h, const c10::Device& device,
                 const detail::HyperTensors& ht, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& clip_coef) const;

  // The step op's lists of one bucket, named as the op names them.
  detail::OptimLists lists(at::TensorList params, at::TensorList grads, at::TensorList masters,
                           const std::vector<at::Tensor> (&states)[3],
                           const std::vector<at::Tensor> (&absmaxes)[3], at::TensorList steps) const;

  // Values by name (each of `hyper`'s names exactly once, flags 0 or 1, the seed an integer) in
  // `hyper`'s order; `who` starts each message ("StepPlan.set_hyper").
  std::vector<double> values_by_name(const c10::Dict<std::string, double>& named, const char* who) const;
  // The values in `hyper`'s order read from a group's options by option name, as both surfaces
  // hold them (numbers, bools, a pair for betas; a device tensor as 0: the step reads it), with
  // stochastic rounding on when `rounding_seed` is given. A required option missing is refused,
  // `who` naming the options ("ampfuse::optim::AdamW").
  std::vector<double> values_of_options(const c10::Dict<std::string, c10::IValue>& options,
                                        std::optional<int64_t> rounding_seed, const std::string& who) const;
  std::vector<std::string> hyper_names() const;
};

// The kind named `name` ("sgd", "adam"); refuses another name.
const OptimizerKind& optimizer_kind(const std::string& name);
// The kind of optimizer `optimizer` ("SGD", "Adam", "AdamW"); refuses another name.
const OptimizerKind& kind_of_optimizer(const std::string& optimizer);

// For Python (the optimizer_kind op): the kind's hyper-parameters as (names, options, elements,
// types "real" / "flag" / "seed", device, fallbacks) and states as (keys, gates, dtype options,
// absmax lists).
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>,
           c10::List<bool>, std::vector<double>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>>
optimizer_kind_op(const std::string& name);

}  // namespace ampfuse::engine
