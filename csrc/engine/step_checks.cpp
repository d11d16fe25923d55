#include "engine/step_checks.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

bool is_supported(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

std::pair<intptr_t, intptr_t> span(const at::Tensor& t) {
  int64_t lo = 0, hi = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t extent = (t.size(d) - 1) * t.stride(d);
    (extent < 0 ? lo : hi) += extent;
  }
  const auto base = reinterpret_cast<intptr_t>(t.const_data_ptr());
  const auto item = static_cast<intptr_t>(t.element_size());
  return {base + lo * item, base + (hi + 1) * item};
}

}  // namespace

std::string shape_repr(const at::Tensor& t) {
  std::string out = "(";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + (t.dim() == 1 ? ",)" : ")");
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.device() != b.device() || !a.has_storage() || !b.has_storage() || a.is_meta() || b.is_meta()) return false;
  // a fake tensor (a trace, whose sizes may be symbolic) has no data: nothing to compare
  const void* sa = a.storage().data();
  if (sa == nullptr || sa != b.storage().data()) return false;
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

std::string param_name(const std::string& naming, int64_t group, int64_t index) {
  std::string out = naming;
  for (const auto& [key, value] : {std::pair{std::string("{g}"), group}, std::pair{std::string("{i}"), index}}) {
    const auto at = out.find(key);
    if (at != std::string::npos) out.replace(at, key.size(), std::to_string(value));
  }
  return out;
}

void check_step_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& state, const std::vector<int64_t>& state_owner,
                      const std::vector<std::string>& state_keys, const std::vector<int64_t>& groups,
                      const std::vector<int64_t>& indices, const std::string& naming) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && groups.size() == n && indices.size() == n,
              "step_grads_check: params, grads, groups and indices must have one length.");
  TORCH_CHECK(state_owner.size() == state.size() && state_keys.size() == state.size(),
              "step_grads_check: state, state_owner and state_keys must have one length.");
  std::vector<std::vector<size_t>> owned(n);
  for (size_t j = 0; j < state.size(); ++j) {
    TORCH_CHECK(state_owner[j] >= 0 && state_owner[j] < static_cast<int64_t>(n),
                "step_grads_check: state_owner[", j, "] is not an index into params.");
    owned[static_cast<size_t>(state_owner[j])].push_back(j);
  }
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    auto where = [&] { return param_name(naming, groups[k], indices[k]); };
    TORCH_CHECK(!g.is_sparse(), where(), " has a sparse gradient; ampfuse optimizers do not support sparse "
                "gradients (use torch.optim.SparseAdam).");
    TORCH_CHECK(is_supported(g.scalar_type()), where(), " has a gradient of dtype ",
                detail::dtype_name(g.scalar_type()), "; expected torch.float16, torch.bfloat16 or torch.float32.");
    TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat, where(), " has dtype ",
                detail::dtype_name(p.scalar_type()), " but its gradient has dtype ", detail::dtype_name(g.scalar_type()),
                "; a gradient must have its param's dtype or be torch.float32 (e.g. an accumulator's fp32 sum).");
    TORCH_CHECK(g.sizes() == p.sizes(), where(), " has a gradient of shape ", shape_repr(g),
                " but the parameter has shape ", shape_repr(p), ".");
    TORCH_CHECK(g.device() == p.device(), where(), " is on ", p.device(), " but its gradient is on ", g.device(), ".");
    TORCH_CHECK(!overlaps(g, p), "the gradient of ", where(), " shares memory with the parameter; the step "
                "writes the parameter while it reads the gradient. Pass a separate tensor (e.g. a clone).");
    for (size_t j : owned[k]) {
      TORCH_CHECK(!overlaps(g, state[j]), "the gradient of ", where(), " shares memory with its optimizer state '",
                  state_keys[j], "'; the step writes the state while it reads the gradient. Pass a separate "
                  "tensor (e.g. a clone).");
    }
  }
}

}  // namespace ampfuse::engine

// No tensor is written: one kernel for every device, Meta (fake tensors) included.
TORCH_LIBRARY_IMPL(ampfuse, CompositeExplicitAutograd, m) {
  m.impl("step_grads_check", &ampfuse::engine::check_step_grads);
}
