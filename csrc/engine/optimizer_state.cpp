#include "engine/optimizer_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>

#include "engine/master_forms.h"
#include "engine/step_checks.h"
#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_slots(const char* op, size_t params, size_t slots, int64_t num_states) {
  TORCH_CHECK(num_states >= 0 && slots == params * static_cast<size_t>(kStateSlotsBeforeStates + num_states), op,
              ": ", params, " params with ", num_states, " states need ",
              params * static_cast<size_t>(kStateSlotsBeforeStates + std::max<int64_t>(num_states, 0)),
              " slots, got ", slots, ".");
}

c10::List<std::optional<at::Tensor>> as_list(std::vector<std::optional<at::Tensor>>& out) {
  c10::List<std::optional<at::Tensor>> result;
  result.reserve(out.size());
  for (auto& t : out) result.push_back(std::move(t));
  return result;
}

}  // namespace

std::string master_kind(const at::Tensor& param, const std::string& master_weights) {
  TORCH_CHECK(master_weights == "true" || master_weights == "auto" || master_weights == "false" ||
                  master_weights == "remainder",
              "master_weights must be 'true', 'auto', 'false' or 'remainder', got '", master_weights, "'.");
  const auto t = param.scalar_type();
  if (master_weights == "false" || (t != at::kHalf && t != at::kBFloat16)) return "none";
  return master_weights == "remainder" && t == at::kBFloat16 ? "remainder" : "float";
}

c10::List<std::optional<at::Tensor>> optimizer_state_(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    int64_t num_states, at::ScalarType state_dtype, const std::string& master_weights,
    const c10::List<bool>& create, const c10::List<bool>& reconcile, bool restart_on_create) {
  check_slots("optimizer_state_", params.size(), slots.size(), num_states);
  const int64_t width = kStateSlotsBeforeStates + num_states;
  const auto n = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(create.size()) == n && static_cast<int64_t>(reconcile.size()) == n,
              "optimizer_state_: ", n, " params need as many create and reconcile flags, got ", create.size(),
              " and ", reconcile.size(), ".");
  TORCH_CHECK(state_dtype == at::kFloat || state_dtype == at::kBFloat16,
              "optimizer_state_: state_dtype must be torch.float32 or torch.bfloat16, got ",
              detail::dtype_name(state_dtype), ".");
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
  for (int64_t k = 0; k < num_states; ++k) {  // each state in turn
    for (int64_t i = 0; i < n; ++i) {
      auto& t = slot(i, kStateSlotsBeforeStates + k);
      const at::Tensor& p = params[i];
      if (present(t)) {
        if (t->scalar_type() != state_dtype) t = t->to(state_dtype);
      } else if (create[i]) {
        t = at::zeros_like(p, p.options().dtype(state_dtype), at::MemoryFormat::Preserve);
        if (restart_on_create) slot(i, 0)->zero_();
      }
    }
  }
  return as_list(out);
}

c10::List<std::optional<at::Tensor>> optimizer_state_saved(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    int64_t num_states) {
  check_slots("optimizer_state_saved", params.size(), slots.size(), num_states);
  const int64_t width = kStateSlotsBeforeStates + num_states;
  at::NoGradGuard no_grad;
  std::vector<std::optional<at::Tensor>> out(slots.begin(), slots.end());
  for (size_t i = 0; i < params.size(); ++i) {
    auto* slot = &out[i * width];
    if (present(slot[2])) {
      slot[1] = join_master(params[i], *slot[2]);
      slot[2] = std::nullopt;
    }
    for (int64_t k = kStateSlotsBeforeStates; k < width; ++k) {
      if (present(slot[k]) && slot[k]->scalar_type() != at::kFloat) slot[k] = slot[k]->to(at::kFloat);
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
  const int64_t width = kStateSlotsBeforeStates + num_states;
  std::vector<std::optional<at::Tensor>> out(slots.begin(), slots.end());
  auto name_of = [&](int64_t k) -> std::string {
    return k == 0 ? "step" : k == 1 ? "master_param" : k == 2 ? "master_remainder" : state_names[k - kStateSlotsBeforeStates];
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
    }
    TORCH_CHECK_VALUE(!present(slot[2]), where(2), ": checkpoints hold masters as fp32 master_param.");
    for (int64_t k = 1; k < width; ++k) {
      if (!present(slot[k])) continue;
      const at::Tensor& t = *slot[k];
      TORCH_CHECK_VALUE(t.sizes() == p.sizes(), where(k), " has shape ", shape_repr(t),
                        " but the parameter has shape ", shape_repr(p), ".");
      TORCH_CHECK_VALUE(t.is_floating_point(), where(k), " must be a floating-point tensor, got ",
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
    for (int64_t k = 1; k < width; ++k) {
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
