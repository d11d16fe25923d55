#include "engine/optimizer_state.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "engine/master_forms.h"
#include "engine/step_checks.h"
#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_slots(const char* op, size_t params, size_t slots, int64_t num_states) {
  TORCH_CHECK(num_states >= 0 && slots == params * static_cast<size_t>(state_width(num_states)), op, ": ",
              params, " params with ", num_states, " states need ",
              params * static_cast<size_t>(state_width(std::max<int64_t>(num_states, 0))), " slots, got ", slots,
              ".");
}

c10::List<std::optional<at::Tensor>> as_list(std::vector<std::optional<at::Tensor>>& out) {
  c10::List<std::optional<at::Tensor>> result;
  result.reserve(out.size());
  for (auto& t : out) result.push_back(std::move(t));
  return result;
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& values, at::ScalarType dtype, bool nonnegative) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampfuse::quantize_blocks", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, at::ScalarType, bool)>();
  return op.call(values, dtype, nonnegative);
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampfuse::dequantize_blocks", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(codes, absmax, nonnegative);
}

// State slot `value` with its absmax slot `absmax` as fp32 values (an 8-bit state dequantized).
at::Tensor values_of(const at::Tensor& value, const std::optional<at::Tensor>& absmax, bool nonnegative,
                     const std::string& what) {
  if (!quantized_state_dtype(value.scalar_type())) return value.to(at::kFloat);
  TORCH_CHECK_VALUE(present(absmax), what, " is ", detail::dtype_name(value.scalar_type()),
                    " codes without its block absmax.");
  return dequantize(value.contiguous(), *absmax, nonnegative);
}

}  // namespace

bool state_nonnegative(const std::string& name) { return name == "exp_avg_sq" || name == "max_exp_avg_sq"; }

bool quantized_state_dtype(at::ScalarType dtype) {
  return dtype == at::kByte || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2;
}

bool state_dtype_named(const std::string& name) {
  for (const auto t : {at::kFloat, at::kBFloat16, at::kByte, at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    if (name == detail::dtype_name(t)) return true;
  }
  return false;
}

at::ScalarType stored_state_dtype(const at::Tensor& param, at::ScalarType requested, const std::string& what) {
  TORCH_CHECK_VALUE(requested == at::kFloat || requested == at::kBFloat16 || quantized_state_dtype(requested), what,
                    " must be ", kStateDtypeChoices, ", got ", detail::dtype_name(requested), ".");
  return quantized_state_dtype(requested) && param.sym_numel() < kQuantMinNumel ? at::kFloat : requested;
}

std::string master_kind(const at::Tensor& param, const std::string& master_weights) {
  TORCH_CHECK(master_weights == "true" || master_weights == "auto" || master_weights == "false" ||
                  master_weights == "remainder" || master_weights == "stochastic",
              "master_weights must be 'true', 'auto', 'false', 'remainder' or 'stochastic', got '", master_weights,
              "'.");
  const auto t = param.scalar_type();
  if (master_weights == "false" || (t != at::kHalf && t != at::kBFloat16)) return "none";
  // stochastic rounding keeps no master for bf16 params (the step rounds into the param itself)
  if (master_weights == "stochastic" && t == at::kBFloat16) return "none";
  return master_weights == "remainder" && t == at::kBFloat16 ? "remainder" : "float";
}

c10::List<std::optional<at::Tensor>> optimizer_state_(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names, const std::vector<at::ScalarType>& state_dtypes,
    const std::string& master_weights, const c10::List<bool>& create, const c10::List<bool>& reconcile,
    bool restart_on_create) {
  const auto num_states = static_cast<int64_t>(state_names.size());
  check_slots("optimizer_state_", params.size(), slots.size(), num_states);
  const int64_t width = state_width(num_states);
  const auto n = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(create.size()) == n && static_cast<int64_t>(reconcile.size()) == n,
              "optimizer_state_: ", n, " params need as many create and reconcile flags, got ", create.size(),
              " and ", reconcile.size(), ".");
  TORCH_CHECK(static_cast<int64_t>(state_dtypes.size()) == num_states, "optimizer_state_: ", num_states,
              " states need as many state dtypes, got ", state_dtypes.size(), ".");
  for (const auto dtype : state_dtypes) {
    if (n > 0) stored_state_dtype(params[0], dtype, "state_dtype");  // a dtype it can keep
  }
  at::NoGradGuard no_grad;
  std::vector<std::optional<at::Tensor>> out(slots.begin(), slots.end());
  auto slot = [&](int64_t i, int64_t k) -> std::optional<at::Tensor>& { return out[i * width + k]; };
  for (int64_t i = 0; i < n; ++i) {  // every step counter
    auto& step = slot(i, 0);
    const at::Tensor& p = params[i];
    if (!present(step)) {
      if (create[i]) step = at::zeros({}, p.options().dtype(at::kFloat));
    } else if (step->scalar_type() != at::kFloat || step->device() != p.device() || step->dim() != 0) {
      step = step->to(p.device(), at::kFloat).reshape({}).clone();
    }
  }
  for (int64_t i = 0; i < n; ++i) {  // every master
    auto& master = slot(i, 1);
    auto& remainder = slot(i, 2);
    if (!create[i] && !present(master) && !present(remainder)) continue;
    const std::string kind = master_kind(params[i], master_weights);
    const std::vector<at::Tensor> m = convert_master_(params[i], master, remainder, kind, reconcile[i]);
    master = kind == "float" ? std::optional<at::Tensor>(m[0]) : std::nullopt;
    remainder = kind == "remainder" ? std::optional<at::Tensor>(m[0]) : std::nullopt;
  }
  for (int64_t k = 0; k < num_states; ++k) {  // each state in turn (codes, then their absmax)
    const bool nonnegative = state_nonnegative(state_names[k]);
    for (int64_t i = 0; i < n; ++i) {
      auto& t = slot(i, kStateSlotsBeforeStates + k);
      auto& absmax = slot(i, kStateSlotsBeforeStates + num_states + k);
      const at::Tensor& p = params[i];
      const at::ScalarType dtype = stored_state_dtype(p, state_dtypes[k], "state_dtype");
      const bool quantized = quantized_state_dtype(dtype);
      if (present(t)) {
        if (t->scalar_type() == dtype && (!quantized || present(absmax))) {
          if (!quantized) absmax = std::nullopt;
          continue;
        }
        const at::Tensor values = values_of(*t, absmax, nonnegative, c10::str("state '", state_names[k], "'"));
        if (quantized) {
          std::tie(t, absmax) = quantize(values.contiguous(), dtype, nonnegative);
        } else {
          t = values.to(dtype);
          absmax = std::nullopt;
        }
      } else if (create[i]) {
        if (quantized) {  // through the op, so that a DTensor's blocks are its local shard's
          std::tie(t, absmax) = quantize(
              at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Contiguous), dtype, nonnegative);
        } else {
          t = at::zeros_like(p, p.options().dtype(dtype), at::MemoryFormat::Preserve);
        }
        if (restart_on_create) slot(i, 0)->zero_();
      }
      if (!quantized) absmax = std::nullopt;
    }
  }
  return as_list(out);
}

c10::List<std::optional<at::Tensor>> optimizer_state_saved(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names) {
  const auto num_states = static_cast<int64_t>(state_names.size());
  check_slots("optimizer_state_saved", params.size(), slots.size(), num_states);
  const int64_t width = state_width(num_states);
  at::NoGradGuard no_grad;
  std::vector<std::optional<at::Tensor>> out(slots.begin(), slots.end());
  for (size_t i = 0; i < params.size(); ++i) {
    auto* slot = &out[i * width];
    if (present(slot[2])) {
      slot[1] = join_master(params[i], *slot[2]);
      slot[2] = std::nullopt;
    }
    for (int64_t k = 0; k < num_states; ++k) {
      auto& t = slot[kStateSlotsBeforeStates + k];
      auto& absmax = slot[kStateSlotsBeforeStates + num_states + k];
      if (present(t) && t->scalar_type() != at::kFloat) {
        t = values_of(*t, absmax, state_nonnegative(state_names[k]), c10::str("state '", state_names[k], "'"));
      }
      absmax = std::nullopt;
    }
  }
  return as_list(out);
}

c10::List<std::optional<at::Tensor>> optimizer_state_loaded(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names, const std::vector<int64_t>& groups,
    const std::vector<int64_t>& indices, const std::string& naming, bool restart_on_create) {
  const auto num_states = static_cast<int64_t>(state_names.size());
  check_slots("optimizer_state_loaded", params.size(), slots.size(), num_states);
  TORCH_CHECK(groups.size() == params.size() && indices.size() == params.size(),
              "optimizer_state_loaded: ", params.size(), " params need as many groups and indices, got ",
              groups.size(), " and ", indices.size(), ".");
  const int64_t width = state_width(num_states);
  const int64_t values_end = kStateSlotsBeforeStates + num_states;  // the slots after are absmaxes
  std::vector<std::optional<at::Tensor>> out(slots.begin(), slots.end());
  auto name_of = [&](int64_t k) -> std::string {
    if (k < kStateSlotsBeforeStates) return k == 0 ? "step" : k == 1 ? "master_param" : "master_remainder";
    return k < values_end ? state_names[k - kStateSlotsBeforeStates]
                          : state_names[k - values_end] + "_absmax";
  };
  for (size_t i = 0; i < params.size(); ++i) {  // every check first
    const at::Tensor& p = params[i];
    const auto* slot = &out[i * width];
    auto where = [&](int64_t k) {
      return c10::str("state '", name_of(k), "' of ", param_name(naming, groups[i], indices[i]));
    };
    if (present(slot[0])) {
      TORCH_CHECK_VALUE(slot[0]->numel() == 1, where(0), " must have one element, got shape ",
                        shape_repr(*slot[0]), ".");
      if (!slot[0]->is_meta()) {  // a count of steps: a NaN or negative one would make every param NaN
        const double step = slot[0]->detach().to(at::kCPU, at::kDouble).item<double>();
        TORCH_CHECK_VALUE(std::isfinite(step) && step >= 0, where(0), " must be a finite count >= 0, got ",
                          step, ".");
      }
    }
    TORCH_CHECK_VALUE(!present(slot[2]), where(2), ": checkpoints hold masters as fp32 master_param.");
    for (int64_t k = values_end; k < width; ++k) {
      TORCH_CHECK_VALUE(!present(slot[k]), where(k), ": checkpoints hold 8-bit state as its fp32 values.");
    }
    for (int64_t k = 1; k < values_end; ++k) {
      if (!present(slot[k])) continue;
      const at::Tensor& t = *slot[k];
      TORCH_CHECK_VALUE(t.sizes() == p.sizes(), where(k), " has shape ", shape_repr(t),
                        " but the parameter has shape ", shape_repr(p), ".");
      TORCH_CHECK_VALUE(t.is_floating_point() && !quantized_state_dtype(t.scalar_type()), where(k),
                        " must be a floating-point tensor of values (float32, bfloat16, float16 or float64), got ",
                        detail::dtype_name(t.scalar_type()), ".");
    }
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    auto* slot = &out[i * width];
    const auto fp32 = p.options().dtype(at::kFloat);
    if (present(slot[0])) {
      slot[0] = slot[0]->detach().to(fp32, /*non_blocking=*/false, /*copy=*/true).reshape({});
    } else {
      const bool counted = restart_on_create && num_states > 0 && present(slot[kStateSlotsBeforeStates]);
      slot[0] = at::full({}, counted ? 1.0 : 0.0, fp32);
    }
    for (int64_t k = 1; k < values_end; ++k) {
      if (present(slot[k])) slot[k] = slot[k]->detach().to(fp32, /*non_blocking=*/false, /*copy=*/true);
    }
  }
  return as_list(out);
}

}  // namespace ampfuse::engine

// Decomposed for every device and tensor subclass into the torch ops and master-form ops it calls.
TORCH_LIBRARY_IMPL(ampfuse, CompositeImplicitAutograd, m) {
  m.impl("optimizer_state_", &ampfuse::engine::optimizer_state_);
  m.impl("optimizer_state_saved", &ampfuse::engine::optimizer_state_saved);
  m.impl("optimizer_state_loaded", &ampfuse::engine::optimizer_state_loaded);
}
