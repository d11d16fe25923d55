#include "engine/hyper_checks.h"

#include <c10/util/Exception.h>

#include <optional>

#include "engine/optimizer_kind.h"
#include "engine/optimizer_state.h"
#include "engine/scaler_rules.h"
#include "engine/step_checks.h"

namespace ampfuse::engine {
namespace {

// How the surface names an option of the group, and an element of one (betas[1]).
struct Namer {
  const std::string& group;
  bool python;
  std::string operator()(const std::string& key) const {
    return python ? group + "['" + key + "']" : group + ": " + key;
  }
  std::string operator()(const std::string& key, int64_t k) const {
    return (*this)(key) + "[" + std::to_string(k) + "]";
  }
};

double number_option(const c10::IValue& v, const std::string& name) {
  TORCH_CHECK_VALUE(is_number(v), name, " must be a number, got ", repr(v), ".");
  return number(v);
}

// A number, or a 1-element tensor whose value the step reads on the device (nullopt: not checked
// here, as a tensor lr).
std::optional<double> number_or_tensor_option(const c10::IValue& v, const std::string& name) {
  if (v.isTensor()) {
    TORCH_CHECK_VALUE(v.toTensor().numel() == 1, name, " must be a number or a 1-element tensor, got shape ",
                      shape_repr(v.toTensor()), ".");
    return std::nullopt;
  }
  TORCH_CHECK_VALUE(is_number(v), name, " must be a number or a 1-element tensor, got ", repr(v), ".");
  return number(v);
}

void check_at_least_zero(double value, const std::string& name) {
  TORCH_CHECK_VALUE(value >= 0.0, name, " must be >= 0, got ", repr(value), ".");
}

void check_unit_interval(double value, const std::string& name) {
  TORCH_CHECK_VALUE(value >= 0.0 && value < 1.0, name, " must be in [0, 1), got ", repr(value), ".");
}

}  // namespace

void check_group_hyper(const std::string& optimizer, const c10::Dict<std::string, c10::IValue>& values,
                       const std::string& group, bool python_naming) {
  const Namer name{group, python_naming};
  const OptimizerKind& kind = kind_of_optimizer(optimizer);

  // Each option present is checked (the C++ surface passes them all; Python's add_param_group
  // only the state dtype), in the order the Python surface always checked them.
  const auto has = [&](const char* key) { return values.contains(key); };
  for (const char* key : {"state_dtype", "exp_avg_sq_dtype"}) {  // the second: None (as the first)
    if (!has(key)) continue;
    const c10::IValue& v = values.at(key);
    if (v.isNone() && std::string(key) == "exp_avg_sq_dtype") continue;
    const std::string dtype = v.isString() ? v.toStringRef() : repr(v);
    TORCH_CHECK_VALUE(state_dtype_named(dtype), name(key), " must be ", kStateDtypeChoices,
                      std::string(key) == "exp_avg_sq_dtype" ? " or None" : "", ", got ", dtype, ".");
  }
  if (has("exp_avg_sq_dtype") && !values.at("exp_avg_sq_dtype").isNone()) {
    // one kernel path per step: every state list 8-bit (each in its own format), or one dtype
    const auto named = [&](const char* key) {
      const c10::IValue& v = values.at(key);
      return v.isString() ? v.toStringRef() : repr(v);
    };
    const std::string first = has("state_dtype") ? named("state_dtype") : "torch.float32";
    const std::string second = named("exp_avg_sq_dtype");
    const auto wide = [](const std::string& d) { return d == "torch.float32" || d == "torch.bfloat16"; };
    TORCH_CHECK_VALUE(first == second || (!wide(first) && !wide(second)), name("exp_avg_sq_dtype"), " (", second,
                      ") may differ from ", name("state_dtype"), " (", first,
                      ") only when both are 8-bit dtypes; leave it None for one state dtype.");
  }
  if (has("rounding_seed")) {
    const c10::IValue& seed = values.at("rounding_seed");
    TORCH_CHECK_VALUE(seed.isInt() && seed.toInt() >= 0 && seed.toInt() < (int64_t{1} << 53), name("rounding_seed"),
                      " must be an integer in [0, 2**53), got ", repr(seed), ".");
  }
  // The kind's real hyper-parameters, each present checked: a number in its bounds, or (where the
  // step reads it on the device: lr, SGD's momentum, Adam's beta1) a 1-element tensor.
  std::optional<double> device_momentum;  // the kind's device value when a number (nullopt: a tensor)
  for (const HyperSpec& h : kind.hyper) {
    if (h.type != HyperType::Real || !has(h.option)) continue;
    c10::IValue v = values.at(h.option);
    if (h.element >= 0) {
      const bool pair = (v.isTuple() && v.toTupleRef().elements().size() == 2) ||
                        (v.isList() && v.toListRef().size() == 2);
      TORCH_CHECK_VALUE(pair, name(h.option), " must be a pair of numbers, got ", repr(v), ".");
      v = v.isTuple() ? v.toTupleRef().elements()[h.element] : v.toListRef()[h.element];
    }
    const std::string label = h.element >= 0 ? name(h.option, h.element) : name(h.option);
    const std::optional<double> x = h.device ? number_or_tensor_option(v, label) : number_option(v, label);
    if (h.device && std::string(h.name) != "lr") device_momentum = x;
    if (!x) continue;
    if (h.bound == HyperBound::AtLeastZero) check_at_least_zero(*x, label);
    if (h.bound == HyperBound::UnitInterval) check_unit_interval(*x, label);
  }
  // SGD's nesterov: a momentum (a tensor counts as > 0) and no dampening.
  if (has("nesterov") && has("momentum") && has("dampening")) {
    TORCH_CHECK_VALUE(!values.at("nesterov").toBool() ||
                          (device_momentum.value_or(1.0) > 0.0 && number(values.at("dampening")) == 0.0),
                      group, ": nesterov momentum requires a momentum > 0 and zero dampening.");
  }
}

}  // namespace ampfuse::engine
