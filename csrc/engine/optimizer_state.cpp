#include "engine/optimizer_state.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "engine/master_forms.h"
#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

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
  const int64_t width = kStateSlotsBeforeStates + num_states;
  const auto n = static_cast<int64_t>(params.size());
  TORCH_CHECK(num_states >= 0 && static_cast<int64_t>(slots.size()) == n * width &&
                  static_cast<int64_t>(create.size()) == n && static_cast<int64_t>(reconcile.size()) == n,
              "optimizer_state_: ", n, " params need ", n * width, " slots and ", n,
              " create and reconcile flags, got ", slots.size(), ", ", create.size(), " and ", reconcile.size(), ".");
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
  c10::List<std::optional<at::Tensor>> result;
  result.reserve(out.size());
  for (auto& t : out) result.push_back(std::move(t));
  return result;
}

}  // namespace ampfuse::engine

// Decomposed for every device and tensor subclass into the torch ops and master-form ops it calls.
TORCH_LIBRARY_IMPL(ampfuse, CompositeImplicitAutograd, m) {
  m.impl("optimizer_state_", &ampfuse::engine::optimizer_state_);
}
