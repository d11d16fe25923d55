// The kind descriptors (see optimizer_kind.h).
#include "engine/optimizer_kind.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace ampfuse::engine {
namespace {

using T = HyperType;
using B = HyperBound;

// A hyper-parameter every group holds (no fallback): a group without it is refused, naming it.
constexpr double R = std::numeric_limits<double>::quiet_NaN();

// Every kind ends with these: bf16 params without a master rounded stochastically, with draws
// of the seed (both from the group's master_weights and rounding_seed, as each surface holds them).
constexpr HyperSpec kStochastic{"stochastic_rounding", "", -1, T::Flag, B::Any, false, 0.0};
constexpr HyperSpec kSeed{"rounding_seed", "", -1, T::Seed, B::Any, false, 0.0};

const OptimizerKind kSgd{
    "sgd",
    {"SGD"},
    {{"lr", "lr", -1, T::Real, B::AtLeastZero, true, R},
     {"momentum", "momentum", -1, T::Real, B::AtLeastZero, true, R},
     {"dampening", "dampening", -1, T::Real, B::Any, false, R},
     {"weight_decay", "weight_decay", -1, T::Real, B::AtLeastZero, false, R},
     {"nesterov", "nesterov", -1, T::Flag, B::Any, false, R},
     {"maximize", "maximize", -1, T::Flag, B::Any, false, R},
     kStochastic,
     kSeed},
    {{"momentum_buffer", "momentum_buffers", "momentum_absmax", "momentum", "state_dtype", false}},
    "momentum_tensor",
    0};

const OptimizerKind kAdam{
    "adam",
    {"Adam", "AdamW"},
    {{"lr", "lr", -1, T::Real, B::AtLeastZero, true, R},
     {"beta1", "betas", 0, T::Real, B::UnitInterval, true, R},
     {"beta2", "betas", 1, T::Real, B::UnitInterval, false, R},
     {"eps", "eps", -1, T::Real, B::AtLeastZero, false, R},
     {"weight_decay", "weight_decay", -1, T::Real, B::AtLeastZero, false, R},
     {"amsgrad", "amsgrad", -1, T::Flag, B::Any, false, R},
     {"maximize", "maximize", -1, T::Flag, B::Any, false, R},
     {"decoupled_weight_decay", "decoupled_weight_decay", -1, T::Flag, B::Any, false, 0.0},
     kStochastic,
     kSeed},
    {{"exp_avg", "exp_avgs", "exp_avg_absmax", "", "state_dtype", false},
     {"exp_avg_sq", "exp_avg_sqs", "exp_avg_sq_absmax", "", "exp_avg_sq_dtype", true},
     {"max_exp_avg_sq", "max_exp_avg_sqs", "max_exp_avg_sq_absmax", "amsgrad", "exp_avg_sq_dtype", true}},
    "beta1_tensor",
    1};

const OptimizerKind* const kKinds[] = {&kSgd, &kAdam};

std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string kind_names() {
  std::string out;
  for (const auto* k : kKinds) out += std::string(out.empty() ? "'" : ", '") + k->name + "'";
  return out;
}

}  // namespace

const OptimizerKind& optimizer_kind(const std::string& name) {
  for (const auto* k : kKinds) {
    if (name == k->name) return *k;
  }
  TORCH_CHECK_VALUE(false, "unknown optimizer kind '", name, "'; the kinds are ", kind_names(), ".");
}

const OptimizerKind& kind_of_optimizer(const std::string& optimizer) {
  for (const auto* k : kKinds) {
    for (const char* o : k->optimizers) {
      if (optimizer == o) return *k;
    }
  }
  TORCH_CHECK(false, "unknown optimizer '", optimizer, "'.");
}

std::vector<std::string> OptimizerKind::hyper_names() const {
  std::vector<std::string> out;
  for (const auto& h : hyper) out.emplace_back(h.name);
  return out;
}

std::vector<double> OptimizerKind::values_by_name(const c10::Dict<std::string, double>& named,
                                                  const char* who) const {
  const auto names = hyper_names();
  for (const auto& entry : named) {
    TORCH_CHECK(std::find(names.begin(), names.end(), entry.key()) != names.end(), who,
                ": unknown hyper-parameter '", entry.key(), "'; a ", name, " plan takes ", listed(names), ".");
  }
  std::vector<double> v;
  v.reserve(hyper.size());
  for (const auto& h : hyper) {
    auto it = named.find(h.name);
    TORCH_CHECK(it != named.end(), who, ": hyper-parameter '", h.name, "' is missing; a ", name, " plan takes ",
                listed(names), ".");
    const double x = it->value();
    TORCH_CHECK(h.type != T::Flag || x == 0.0 || x == 1.0, who, ": '", h.name, "' is a flag (0 or 1), got ", x, ".");
    // the seed, an integer a double holds exactly
    TORCH_CHECK(h.type != T::Seed || (x == std::floor(x) && std::fabs(x) <= 9007199254740992.0), who, ": '", h.name,
                "' is an integer of at most 2**53 in magnitude, got ", x, ".");
    v.push_back(x);
  }
  return v;
}

std::vector<double> OptimizerKind::values_of_options(const c10::Dict<std::string, c10::IValue>& options,
                                                     std::optional<int64_t> rounding_seed,
                                                     const std::string& who) const {
  std::vector<double> out;
  out.reserve(hyper.size());
  for (const HyperSpec& h : hyper) {
    if (*h.option == '\0') {  // from the master options
      out.push_back(h.type == T::Seed ? static_cast<double>(rounding_seed.value_or(0))
                                      : static_cast<double>(rounding_seed.has_value()));
      continue;
    }
    auto it = options.find(h.option);
    if (it == options.end()) {
      TORCH_CHECK(!std::isnan(h.fallback), who, ": the options have no '", h.option, "'.");
      out.push_back(h.fallback);
      continue;
    }
    c10::IValue v = it->value();
    if (h.element >= 0) v = v.isTuple() ? v.toTupleRef().elements()[h.element] : v.toListRef()[h.element];
    out.push_back(v.isTensor() ? 0.0 : v.isBool() ? static_cast<double>(v.toBool())
                                 : v.isInt()  ? static_cast<double>(v.toInt())
                                              : v.toDouble());
  }
  return out;
}

PackedHyper OptimizerKind::pack(const std::vector<double>& v) const {
  TORCH_CHECK(v.size() == hyper.size(), "OptimizerKind.pack: a ", name, " kind takes ", hyper.size(),
              " values, got ", v.size(), ".");
  const auto flag = [&](size_t k) { return v[k] != 0.0; };
  const auto seed = [&](size_t k) { return static_cast<int64_t>(v[k]); };
  if (packed == 0) {
    return SgdHyper{v[0], v[1], v[2], v[3], flag(4), flag(5), flag(6), seed(7)};
  }
  return AdamHyper{v[0], v[1], v[2], v[3], v[4], flag(5), flag(6), flag(7), flag(8), seed(9)};
}

void OptimizerKind::check(const PackedHyper& h, const detail::OptimLists& l, bool device_value) const {
  if (const auto* s = std::get_if<SgdHyper>(&h)) {
    detail::check_sgd_hyper(*s, l, device_value);
  } else {
    detail::check_adam_hyper(std::get<AdamHyper>(h), l);
  }
}

void OptimizerKind::step(const ops::Backend& b, const detail::OptimLists& l, const PackedHyper& h,
                         const c10::Device& device, const detail::HyperTensors& ht,
                         const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                         const std::optional<at::Tensor>& clip_coef) const {
  if (const auto* s = std::get_if<SgdHyper>(&h)) {
    ops::core::sgd_step(b, l, *s, device, ht, grad_scale, found_inf, clip_coef);
  } else {
    ops::core::adam_step(b, l, std::get<AdamHyper>(h), device, ht, grad_scale, found_inf, clip_coef);
  }
}

void OptimizerKind::step_rows(const ops::Backend& b, const kernels::OptimTensor* rows, int64_t n,
                              const ops::core::OptimDTypes& dtypes, const PackedHyper& h, const c10::Device& device,
                              const detail::HyperTensors& ht, const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf,
                              const std::optional<at::Tensor>& clip_coef) const {
  if (const auto* s = std::get_if<SgdHyper>(&h)) {
    ops::core::sgd_rows(b, rows, n, dtypes, *s, device, ht, grad_scale, found_inf, clip_coef);
  } else {
    ops::core::adam_rows(b, rows, n, dtypes, std::get<AdamHyper>(h), device, ht, grad_scale, found_inf, clip_coef);
  }
}

detail::OptimLists OptimizerKind::lists(at::TensorList params, at::TensorList grads, at::TensorList masters,
                                        const std::vector<at::Tensor> (&st)[3],
                                        const std::vector<at::Tensor> (&absmaxes)[3],
                                        at::TensorList steps) const {
  // Three state lists whatever the kind (the kernels' rows hold three), unnamed past the kind's.
  std::vector<const char*> names(3, ""), absmax_names(3, "");
  std::vector<bool> nonnegative(3, false);
  for (size_t k = 0; k < states.size(); ++k) {
    names[k] = states[k].list;
    absmax_names[k] = states[k].absmax;
    nonnegative[k] = states[k].nonnegative;
  }
  return detail::OptimLists{params,
                            grads,
                            masters,
                            {st[0], st[1], st[2]},
                            std::move(names),
                            steps,
                            {absmaxes[0], absmaxes[1], absmaxes[2]},
                            std::move(absmax_names),
                            std::move(nonnegative)};
}

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>,
           c10::List<bool>, std::vector<double>, std::vector<std::string>, std::vector<std::string>,
           std::vector<std::string>, std::vector<std::string>>
optimizer_kind_op(const std::string& name) {
  const OptimizerKind& k = optimizer_kind(name);
  std::vector<std::string> names, options, types, keys, gates, dtype_options, absmax;
  std::vector<int64_t> elements;
  c10::List<bool> device;
  std::vector<double> fallbacks;
  for (const auto& h : k.hyper) {
    names.emplace_back(h.name);
    options.emplace_back(h.option);
    elements.push_back(h.element);
    types.emplace_back(h.type == T::Real ? "real" : h.type == T::Flag ? "flag" : "seed");
    device.push_back(h.device);
    fallbacks.push_back(h.fallback);
  }
  for (const auto& s : k.states) {
    keys.emplace_back(s.key);
    gates.emplace_back(s.gate);
    dtype_options.emplace_back(s.dtype_option);
    absmax.emplace_back(s.absmax);
  }
  return {names, options, elements, types, device, fallbacks, keys, gates, dtype_options, absmax};
}

}  // namespace ampfuse::engine
