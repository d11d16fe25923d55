// ampfuse::optim::SGD / Adam / AdamW for LibTorch: buckets of (device, param dtype, grad dtype,
// master) handed to the sgd_step_/adam_step_ ops, exactly as python/ampfuse/optim.py does.
#include "ampfuse/optim.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <system_error>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "api/internals.h"
#include "engine/hyper_checks.h"
#include "engine/master_forms.h"
#include "engine/optimizer_state.h"
#include "engine/scaler_rules.h"
#include "engine/step_checks.h"
#include "engine/step_plan.h"
#include "ops/validation.h"

namespace ampfuse::optim {
namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;
using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

bool is_low(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
bool is_supported(c10::ScalarType t) { return is_low(t) || t == at::kFloat; }

std::string where(size_t group, size_t index) {
  return c10::str("param_groups()[", group, "].params()[", index, "]");
}

// ---- options: serialisation helpers (keys absent from an archive keep their current value, so
// a checkpoint of torch's own optimizer, which lacks maximize/master_weights, loads) ----------
template <typename T>
void read_if_present(InputArchive& archive, const char* key, T& value) {
  c10::IValue v;
  if (archive.try_read(key, v)) value = v.to<T>();
}

// ---- per-parameter state ------------------------------------------------------------------------
void write_tensor(OutputArchive& archive, const char* key, const at::Tensor& t) {
  if (t.defined()) archive.write(key, c10::IValue(t));
}

at::Tensor read_tensor(InputArchive& archive, const char* key) {
  c10::IValue v;
  if (!archive.try_read(key, v) || v.isNone()) return {};
  TORCH_CHECK(v.isTensor(), "optimizer state entry '", key, "' must be a tensor, got ",
              v.tagKind(), ".");
  return v.toTensor();
}

// torch's C++ Adam/AdamW store `step` as an int; ampfuse stores an fp32 tensor.
at::Tensor read_step(InputArchive& archive) {
  c10::IValue v;
  if (!archive.try_read("step", v) || v.isNone()) return {};
  if (v.isInt()) return at::full({}, static_cast<float>(v.toInt()), at::kFloat);
  if (v.isDouble()) return at::full({}, static_cast<float>(v.toDouble()), at::kFloat);
  TORCH_CHECK(v.isTensor(), "optimizer state entry 'step' must be a tensor or a number, got ",
              v.tagKind(), ".");
  return v.toTensor();
}

enum class MasterKind { None, Float, Remainder };

// Whether bf16 params of a group with options o are rounded stochastically (no master).
template <typename O>
bool stochastic(const O& o) {
  return o.master_weights() && !o.master_remainders() && o.stochastic_rounding();
}

template <typename O>
std::string master_weights_of(const O& o) {
  if (!o.master_weights()) return "false";
  return o.master_remainders() ? "remainder" : (o.stochastic_rounding() ? "stochastic" : "true");
}

template <typename State>
MasterKind master_kind_of(const State& s) {
  return s.master_param().defined() ? MasterKind::Float
                                    : (s.master_remainder().defined() ? MasterKind::Remainder : MasterKind::None);
}

// ---- buckets ------------------------------------------------------------------------------------
struct Bucket {
  c10::Device device;
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
  MasterKind master;
  c10::ScalarType state_dtype;  // of the first state (a small param's 8-bit state is fp32)
  std::vector<at::Tensor> params, grads, masters, steps;
  std::array<std::vector<at::Tensor>, 3> states, absmaxes;
};

Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, const at::Tensor& g,
                   MasterKind master, c10::ScalarType state_dtype) {
  for (auto& b : buckets) {
    if (b.device == p.device() && b.param_dtype == p.scalar_type() &&
        b.grad_dtype == g.scalar_type() && b.master == master && b.state_dtype == state_dtype) {
      return b;
    }
  }
  buckets.push_back(Bucket{p.device(), p.scalar_type(), g.scalar_type(), master, state_dtype, {}, {}, {}, {}, {}, {}});
  return buckets.back();
}

std::optional<at::Tensor> scalar_on(const std::optional<at::Tensor>& t, const c10::Device& d) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  at::Tensor s = t->reshape({});
  if (s.device() != d || s.scalar_type() != at::kFloat) {
    s = s.to(d, at::kFloat, /*non_blocking=*/true);
  }
  return s;
}

StepScaling scaling_on(const std::optional<StepScaling>& scaling, const c10::Device& d) {
  StepScaling out;
  if (scaling.has_value()) {
    out.grad_scale = scalar_on(scaling->grad_scale, d);
    out.found_inf = scalar_on(scaling->found_inf, d);
    out.clip_coef = scalar_on(scaling->clip_coef, d);
  }
  return out;
}

// ---- a param's state as the engine's slots (engine/optimizer_state.h) ----------------------------
// The names of the first `num` states of P.
template <typename P>
std::vector<std::string> state_names_of(int num) {
  return std::vector<std::string>(P::kStateNames.begin(), P::kStateNames.begin() + num);
}

template <typename P>
void push_slots(c10::List<std::optional<at::Tensor>>& slots, typename P::State& s, int num) {
  auto given = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  slots.push_back(given(s.step()));
  slots.push_back(given(s.master_param()));
  slots.push_back(given(s.master_remainder()));
  for (int k = 0; k < num; ++k) slots.push_back(given(P::state(s, k)));
  for (int k = 0; k < num; ++k) slots.push_back(given(P::absmax(s, k)));
}

// The slots of the i-th param of `out` (each param num states wide) written into s.
template <typename P>
void take_slots(typename P::State& s, const c10::List<std::optional<at::Tensor>>& out, size_t i, int num) {
  const size_t width = engine::state_width(num);
  auto slot_at = [&](size_t k) { return out.get(i * width + k).value_or(at::Tensor()); };
  s.step(slot_at(0));
  s.master_param(slot_at(1));
  s.master_remainder(slot_at(2));
  for (int k = 0; k < num; ++k) P::state(s, k) = slot_at(engine::kStateSlotsBeforeStates + k);
  for (int k = 0; k < num; ++k) P::absmax(s, k) = slot_at(engine::kStateSlotsBeforeStates + num + k);
}

// ---- generic step over a policy ----------------------------------------------------------------
// The state of the params of a group brought to its options by the engine (optimizer_state_):
// created where create[i] (a param that steps now), else only what it has converted.
template <typename P>
void bring_state(torch::optim::Optimizer& opt, const std::vector<at::Tensor>& params,
                 const std::vector<bool>& create, const typename P::Options& o,
                 std::unordered_set<const c10::TensorImpl*>& reconcile) {
  using State = typename P::State;
  auto& states = opt.state();
  const int num = P::num_states(o);
  std::vector<at::Tensor> ps;
  std::vector<State*> owners;
  c10::List<bool> creates, reconciles;
  c10::List<std::optional<at::Tensor>> slots;
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = states.find(params[i].unsafeGetTensorImpl());
    if (it == states.end()) {
      if (!create[i]) continue;
      it = states.emplace(params[i].unsafeGetTensorImpl(), std::make_unique<State>()).first;
    }
    auto& s = static_cast<State&>(*it->second);
    ps.push_back(params[i].detach());
    owners.push_back(&s);
    creates.push_back(create[i]);
    reconciles.push_back(reconcile.erase(params[i].unsafeGetTensorImpl()) != 0);
    push_slots<P>(slots, s, num);
  }
  if (ps.empty()) return;
  const auto out = engine::optimizer_state_(ps, slots, state_names_of<P>(num), P::state_dtypes(o, num), master_weights_of(o),
                                            creates, reconciles, P::kRestartOnCreate);
  for (size_t i = 0; i < owners.size(); ++i) take_slots<P>(*owners[i], out, i, num);
}

// The master keeper's claim before a validated step modifies anything: the params it steps with
// a master (by the group's master_weights), and those whose master it holds.
template <typename P>
void claim_masters(FusedOptimizer& opt, engine::MasterKeeper& keeper) {
  std::vector<at::Tensor> stepping, kept;
  std::vector<int64_t> groups, indices;
  auto& states = opt.state();
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& group = opt.param_groups()[gi];
    const std::string mw = master_weights_of(static_cast<const typename P::Options&>(group.options()));
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      if (engine::master_kind(p, mw) == "none") continue;
      if (opt.grad_of(p).defined()) {
        stepping.push_back(p);
        groups.push_back(static_cast<int64_t>(gi));
        indices.push_back(static_cast<int64_t>(i));
        continue;
      }
      auto it = states.find(p.unsafeGetTensorImpl());
      if (it == states.end()) continue;
      const auto& s = static_cast<const typename P::State&>(*it->second);
      if (s.master_param().defined() || s.master_remainder().defined()) kept.push_back(p);
    }
  }
  keeper.claim(stepping, groups, indices, "param_groups()[{g}].params()[{i}]", kept);
}

// The validated step: every check, state created, one op call per bucket. Reports the buckets
// it ran and the params it left idle, for the step plan.
template <typename P>
void fused_step(FusedOptimizer& opt, std::vector<detail::StepPlanBucket>& ran,
                std::vector<at::Tensor>& idle, std::unordered_set<const c10::TensorImpl*>& reconcile) {
  opt.validate();
  auto& keeper = *opt.internals().keeper;
  claim_masters<P>(opt, keeper);
  size_t gi = 0;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const typename P::Options&>(group.options());
    std::vector<at::Tensor> grads;
    std::vector<bool> stepped;
    for (const auto& p : group.params()) {
      grads.push_back(opt.grad_of(p));
      stepped.push_back(grads.back().defined());
    }
    bring_state<P>(opt, group.params(), stepped, o, reconcile);
    std::vector<Bucket> buckets;
    for (size_t i = 0; i < group.params().size(); ++i) {
      const at::Tensor& p = group.params()[i];
      const at::Tensor& g = grads[i];
      if (!g.defined()) {
        idle.push_back(p);
        continue;
      }
      auto& s = static_cast<typename P::State&>(*opt.state().at(p.unsafeGetTensorImpl()));
      const MasterKind kind = master_kind_of(s);
      const int num = P::num_states(o);
      Bucket& b = bucket_for(buckets, p, g, kind, num > 0 ? P::state(s, 0).scalar_type() : at::kFloat);
      b.params.push_back(p);
      b.grads.push_back(g);
      b.steps.push_back(s.step());
      if (kind == MasterKind::Float) b.masters.push_back(s.master_param());
      if (kind == MasterKind::Remainder) b.masters.push_back(s.master_remainder());
      for (int k = 0; k < num; ++k) b.states[k].push_back(P::state(s, k));
      for (int k = 0; k < num; ++k) {
        if (P::absmax(s, k).defined()) b.absmaxes[k].push_back(P::absmax(s, k));
      }
    }
    for (auto& b : buckets) {
      // a param replaced since its master was last seen restarts the master
      if (!b.masters.empty()) keeper.restart_replaced(b.params, b.masters);
      P::run(o, b, scaling_on(opt.step_scaling(), b.device));
      ran.push_back(detail::StepPlanBucket{gi, b.params, b.masters, b.steps, b.states, b.absmaxes,
                                           b.grad_dtype == at::kFloat && b.param_dtype != at::kFloat});
    }
    ++gi;
  }
}

// What a step plan depends on that the optimizer owns: per group its params, structural options
// and each param's state object and tensors (by identity).
template <typename P>
std::vector<const void*> plan_key_of(const torch::optim::Optimizer& opt) {
  std::vector<const void*> key;
  auto as_key = [](int64_t v) { return reinterpret_cast<const void*>(static_cast<intptr_t>(v)); };
  const auto& states = const_cast<torch::optim::Optimizer&>(opt).state();
  key.push_back(as_key(static_cast<int64_t>(opt.param_groups().size())));
  for (const auto& group : opt.param_groups()) {
    const auto& o = static_cast<const typename P::Options&>(group.options());
    key.push_back(as_key(static_cast<int64_t>(group.params().size())));
    key.push_back(as_key(P::num_states(o)));
    key.push_back(as_key(o.master_weights() ? (o.master_remainders() ? 2 : (o.stochastic_rounding() ? 3 : 1)) : 0));
    for (const auto dtype : P::state_dtypes(o, P::num_states(o))) key.push_back(as_key(static_cast<int64_t>(dtype)));
    for (const auto& p : group.params()) {
      key.push_back(p.unsafeGetTensorImpl());
      auto it = states.find(p.unsafeGetTensorImpl());
      if (it == states.end()) {
        key.push_back(nullptr);
        continue;
      }
      auto& s = static_cast<typename P::State&>(*it->second);
      key.push_back(&s);
      key.push_back(s.step().unsafeGetTensorImpl());
      key.push_back(s.master_param().unsafeGetTensorImpl());
      key.push_back(s.master_remainder().unsafeGetTensorImpl());
      for (int k = 0; k < static_cast<int>(P::kStateNames.size()); ++k) {
        key.push_back(P::state(s, k).unsafeGetTensorImpl());
        key.push_back(P::absmax(s, k).unsafeGetTensorImpl());
      }
    }
  }
  return key;
}

// save(): torch's archive layout, with every state tensor as fp32 and a remainder as the fp32
// master_param it stands for (the live state is not changed).
template <typename P>
void fused_save(const torch::optim::Optimizer& opt, OutputArchive& archive) {
  using State = typename P::State;
  constexpr int kNum = static_cast<int>(P::kStateNames.size());
  auto& live = const_cast<torch::optim::Optimizer&>(opt).state();
  std::vector<at::Tensor> ps;
  std::vector<void*> keys;
  std::vector<std::unique_ptr<State>> copies;
  c10::List<std::optional<at::Tensor>> slots;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      auto it = live.find(p.unsafeGetTensorImpl());
      if (it == live.end()) continue;
      ps.push_back(p.detach());
      keys.push_back(p.unsafeGetTensorImpl());
      copies.push_back(std::make_unique<State>(static_cast<const State&>(*it->second)));
      push_slots<P>(slots, *copies.back(), kNum);
    }
  }
  const auto out = engine::optimizer_state_saved(ps, slots, state_names_of<P>(kNum));
  std::remove_reference_t<decltype(live)> saved;
  for (size_t i = 0; i < ps.size(); ++i) {
    take_slots<P>(*copies[i], out, i, kNum);
    saved.emplace(keys[i], std::move(copies[i]));
  }
  std::swap(live, saved);
  try {
    torch::optim::serialize<State, typename P::Options>(archive, opt);
  } catch (...) {
    std::swap(live, saved);
    throw;
  }
  std::swap(live, saved);
}

// Loads a checkpoint written by save() (or by torch's matching C++ optimizer). Everything is
// read and checked before the optimizer changes.
template <typename P>
void fused_load(torch::optim::Optimizer& opt, InputArchive& archive,
                std::unordered_set<const c10::TensorImpl*>& reconcile) {
  using State = typename P::State;
  using Options = typename P::Options;
  c10::IValue version;
  TORCH_CHECK(archive.try_read("pytorch_version", version) && version.isString(),
              "The archive does not hold an optimizer checkpoint (no 'pytorch_version' entry).");
  InputArchive state_archive;
  archive.read("state", state_archive);
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> saved_state;
  torch::optim::detail::serialize<State>(state_archive, saved_state);

  InputArchive groups_archive;
  archive.read("param_groups", groups_archive);
  at::Tensor num_groups_t;
  groups_archive.read("param_groups/size", num_groups_t);
  const auto num_groups = static_cast<size_t>(num_groups_t.item<int64_t>());
  auto& groups = opt.param_groups();
  TORCH_CHECK(num_groups == groups.size(), "The checkpoint has ", num_groups,
              " parameter groups but the optimizer has ", groups.size(), ".");
  std::vector<std::vector<uint64_t>> keys(num_groups);
  std::vector<Options> options;
  for (size_t g = 0; g < num_groups; ++g) {
    InputArchive group_archive;
    groups_archive.read("param_groups/" + std::to_string(g), group_archive);
    at::Tensor size_t_;
    group_archive.read("params/size", size_t_);
    const auto size = static_cast<size_t>(size_t_.item<int64_t>());
    TORCH_CHECK(size == groups[g].params().size(), "Parameter group ", g, " of the checkpoint has ",
                size, " parameters but the optimizer's has ", groups[g].params().size(), ".");
    for (size_t i = 0; i < size; ++i) {
      c10::IValue key;
      group_archive.read("params/" + std::to_string(i), key);
      // a parameter's key: the number torch's serializer writes as a string
      uint64_t parsed = 0;
      const std::string* text = key.isString() ? &key.toStringRef() : nullptr;
      const bool ok = text != nullptr && !text->empty() &&
                      [&] {
                        const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), parsed);
                        return ec == std::errc() && end == text->data() + text->size();
                      }();
      TORCH_CHECK_VALUE(ok, "The checkpoint's param_groups/", g, "/params/", i,
                        " must be a parameter key (a number as a string), got ",
                        text != nullptr ? "'" + *text + "'" : std::string(key.tagKind()), ".");
      keys[g].push_back(parsed);
    }
    InputArchive options_archive;
    group_archive.read("options", options_archive);
    const auto& own = static_cast<const Options&>(groups[g].options());
    Options o = own;  // absent keys stay as they are
    o.serialize(options_archive);
    // The optimizer's own precision options win; the loaded state is converted to them.
    o.master_weights(own.master_weights()).master_remainders(own.master_remainders()).state_dtype(own.state_dtype());
    o.stochastic_rounding(own.stochastic_rounding());  // the master form; the seed is the checkpoint's
    if constexpr (!std::is_same_v<Options, SGDOptions>) o.exp_avg_sq_dtype(own.exp_avg_sq_dtype());
    options.push_back(std::move(o));
  }
  // Check every state tensor against its parameter and convert it (the engine), then commit.
  constexpr int kNum = static_cast<int>(P::kStateNames.size());
  std::vector<at::Tensor> ps;
  std::vector<int64_t> group_of, index_of;
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>*> found;
  c10::List<std::optional<at::Tensor>> slots;
  for (size_t g = 0; g < num_groups; ++g) {
    for (size_t i = 0; i < keys[g].size(); ++i) {
      auto it = saved_state.find(reinterpret_cast<void*>(keys[g][i]));
      if (it == saved_state.end()) continue;
      ps.push_back(groups[g].params()[i].detach());
      group_of.push_back(static_cast<int64_t>(g));
      index_of.push_back(static_cast<int64_t>(i));
      found.push_back(&it->second);
      push_slots<P>(slots, static_cast<State&>(*it->second), kNum);
    }
  }
  const auto out = engine::optimizer_state_loaded(
      ps, slots, state_names_of<P>(kNum), group_of, index_of,
      "param_groups()[{g}].params()[{i}]", P::kRestartOnCreate);
  for (size_t g = 0; g < num_groups; ++g) {
    for (const auto& p : groups[g].params()) opt.state().erase(p.unsafeGetTensorImpl());
    static_cast<Options&>(groups[g].options()) = options[g];
  }
  for (size_t j = 0; j < ps.size(); ++j) {
    const auto& p = groups[group_of[j]].params()[index_of[j]];
    auto& s = static_cast<State&>(**found[j]);
    take_slots<P>(s, out, j, kNum);
    // A loaded fp32 master may be a remainder form's (its param rounded ties away from zero).
    if (s.master_param().defined()) reconcile.insert(p.unsafeGetTensorImpl());
    opt.state()[p.unsafeGetTensorImpl()] = std::move(*found[j]);
  }
}

// ---- hyper-parameters: the engine's checks (engine/hyper_checks.h, options named "AdamW: lr") and
// the kind descriptor's values (engine/optimizer_kind.h), both read from the options by name ----
template <typename T>
c10::IValue option_value(const T& v) {
  if constexpr (std::is_same_v<T, c10::ScalarType>) {
    return v == at::ScalarType::Undefined ? c10::IValue() : c10::IValue(detail::dtype_name(v));
  } else if constexpr (std::is_same_v<T, std::tuple<double, double>>) {
    return c10::ivalue::Tuple::create(std::get<0>(v), std::get<1>(v));
  } else {
    return c10::IValue(v);
  }
}

// A group's options by name (the optimizer's own, decoupled_weight_decay, besides its fields).
template <class P>
c10::Dict<std::string, c10::IValue> option_values(const typename P::Options& o) {
  TORCH_CHECK_VALUE(!(o.master_remainders() && o.stochastic_rounding()),
                    "master_remainders and stochastic_rounding exclude each other: a bf16 param keeps a remainder "
                    "or is rounded stochastically; set one of them.");
  auto values = engine::entry_dict();
  P::Options::fields(o, [&](const char* key, const auto& v) { values.insert(key, option_value(v)); });
  P::add_options(values);
  return values;
}

template <typename O>
const O& options_of(const OptimizerOptions& options, const char* optimizer) {
  const auto* o = dynamic_cast<const O*>(&options);
  TORCH_CHECK(o != nullptr, "ampfuse::optim::", optimizer, " needs param group options of type ",
              "ampfuse::optim::", optimizer, "Options (got options of another optimizer).");
  return *o;
}

}  // namespace

// ============================================================================================
// Options: serialisation and comparison over each type's fields() list
// ============================================================================================
namespace {

template <typename T>
c10::IValue to_ivalue(const T& v) {
  if constexpr (std::is_same_v<T, c10::ScalarType>) {
    return c10::IValue(static_cast<int64_t>(v));
  } else {
    return c10::IValue(v);
  }
}

// Option `key` of a checkpoint into `out`, its type checked (a number where a float is kept); a
// value of another type is refused naming the option (torch's IValue casts would assert).
template <typename T>
void from_ivalue(const c10::IValue& v, T& out, const char* key) {
  auto refuse = [&](const char* what) {
    TORCH_CHECK_VALUE(false, "The checkpoint's option '", key, "' must be ", what, ", got ", v.tagKind(), ".");
  };
  if constexpr (std::is_same_v<T, c10::ScalarType>) {
    if (!v.isInt()) refuse("a dtype (an int)");
    out = static_cast<c10::ScalarType>(v.toInt());
  } else if constexpr (std::is_same_v<T, double>) {
    if (!(v.isDouble() || v.isInt())) refuse("a float");
    out = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.isBool()) refuse("a bool");
    out = v.toBool();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (!v.isInt()) refuse("an int");
    out = v.toInt();
  } else {
    try {
      out = v.to<T>();
    } catch (const c10::Error&) {
      refuse("of the option's type");
    }
  }
}

template <typename O>
void write_options(const O& o, OutputArchive& archive) {
  O::fields(o, [&](const char* key, const auto& value) { archive.write(key, to_ivalue(value)); });
}

// Keys absent from the archive keep their current value (a checkpoint of torch's own optimizer
// lacks ampfuse's options).
template <typename O>
void read_options(O& o, InputArchive& archive) {
  O::fields(o, [&](const char* key, auto& value) {
    c10::IValue v;
    if (archive.try_read(key, v)) from_ivalue(v, value, key);
  });
}

template <typename O>
bool equal_options(const O& a, const O& b) {
  std::vector<c10::IValue> va, vb;
  O::fields(a, [&](const char*, const auto& v) { va.push_back(to_ivalue(v)); });
  O::fields(b, [&](const char*, const auto& v) { vb.push_back(to_ivalue(v)); });
  for (size_t i = 0; i < va.size(); ++i) {
    if (!(va[i] == vb[i])) return false;
  }
  return true;
}

// torch's group-option inheritance: a field left at its default-constructed value takes the
// optimizer's default.
template <typename O>
O merge_options(const O& user, const O& defaults) {
  const O fresh;
  O merged = defaults;
  std::vector<c10::IValue> fresh_values;
  O::fields(fresh, [&](const char*, const auto& v) { fresh_values.push_back(to_ivalue(v)); });
  size_t i = 0;
  O::fields(user, [&](const char* key, const auto& v) {
    if (!(to_ivalue(v) == fresh_values[i])) {
      O::fields(merged, [&](const char* k, auto& m) {
        if constexpr (std::is_same_v<std::decay_t<decltype(m)>, std::decay_t<decltype(v)>>) {
          if (std::strcmp(k, key) == 0) m = v;
        }
      });
    }
    ++i;
  });
  return merged;
}

}  // namespace

SGDOptions::SGDOptions(double lr) : lr_(lr) {}
double SGDOptions::get_lr() const { return lr(); }
void SGDOptions::set_lr(const double lr) { this->lr(lr); }
bool operator==(const SGDOptions& a, const SGDOptions& b) { return equal_options(a, b); }
void SGDOptions::serialize(OutputArchive& archive) const { write_options(*this, archive); }
void SGDOptions::serialize(InputArchive& archive) { read_options(*this, archive); }

template <class D>
void AdamOptionsBase<D>::serialize(OutputArchive& archive) const {
  write_options(static_cast<const D&>(*this), archive);
}
template <class D>
void AdamOptionsBase<D>::serialize(InputArchive& archive) {
  read_options(static_cast<D&>(*this), archive);
}
template struct AdamOptionsBase<AdamOptions>;
template struct AdamOptionsBase<AdamWOptions>;
bool operator==(const AdamOptions& a, const AdamOptions& b) { return equal_options(a, b); }
bool operator==(const AdamWOptions& a, const AdamWOptions& b) { return equal_options(a, b); }

// ============================================================================================
// Per-parameter state
// ============================================================================================
void SGDParamState::serialize(OutputArchive& archive) const {
  write_tensor(archive, "step", step());
  write_tensor(archive, "momentum_buffer", momentum_buffer());
  write_tensor(archive, "master_param", master_param());
  write_tensor(archive, "master_remainder", master_remainder());
  write_tensor(archive, "momentum_buffer_absmax", momentum_buffer_absmax());
}
void SGDParamState::serialize(InputArchive& archive) {
  step(read_step(archive));
  momentum_buffer(read_tensor(archive, "momentum_buffer"));
  master_param(read_tensor(archive, "master_param"));
  master_remainder(read_tensor(archive, "master_remainder"));
  momentum_buffer_absmax(read_tensor(archive, "momentum_buffer_absmax"));
}
void AdamParamState::serialize(OutputArchive& archive) const {
  write_tensor(archive, "step", step());
  write_tensor(archive, "exp_avg", exp_avg());
  write_tensor(archive, "exp_avg_sq", exp_avg_sq());
  write_tensor(archive, "max_exp_avg_sq", max_exp_avg_sq());
  write_tensor(archive, "master_param", master_param());
  write_tensor(archive, "master_remainder", master_remainder());
  write_tensor(archive, "exp_avg_absmax", exp_avg_absmax());
  write_tensor(archive, "exp_avg_sq_absmax", exp_avg_sq_absmax());
  write_tensor(archive, "max_exp_avg_sq_absmax", max_exp_avg_sq_absmax());
}
void AdamParamState::serialize(InputArchive& archive) {
  step(read_step(archive));
  exp_avg(read_tensor(archive, "exp_avg"));
  exp_avg_sq(read_tensor(archive, "exp_avg_sq"));
  max_exp_avg_sq(read_tensor(archive, "max_exp_avg_sq"));
  master_param(read_tensor(archive, "master_param"));
  master_remainder(read_tensor(archive, "master_remainder"));
  exp_avg_absmax(read_tensor(archive, "exp_avg_absmax"));
  exp_avg_sq_absmax(read_tensor(archive, "exp_avg_sq_absmax"));
  max_exp_avg_sq_absmax(read_tensor(archive, "max_exp_avg_sq_absmax"));
}

// ============================================================================================
// FusedOptimizer
// ============================================================================================
FusedOptimizer::FusedOptimizer(std::unique_ptr<OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::vector<OptimizerParamGroup>{}, std::move(defaults)),
      internals_(std::make_unique<detail::OptimizerInternals>()) {}

FusedOptimizer::~FusedOptimizer() = default;

detail::OptimizerInternals& FusedOptimizer::internals() const { return *internals_; }

void FusedOptimizer::add_param_group(const OptimizerParamGroup& param_group) {
  // The base class checks leafness and duplicates, and gives the group a copy of the defaults.
  torch::optim::Optimizer::add_param_group(OptimizerParamGroup(param_group.params()));
  if (param_group.has_options()) {
    try {
      param_groups_.back().set_options(merge_group_options(param_group.options()));
    } catch (...) {
      param_groups_.pop_back();
      throw;
    }
  }
  try {
    check_options(param_groups_.back().options());
    check_params(param_groups_.size() - 1);
  } catch (...) {
    param_groups_.pop_back();
    throw;
  }
  internals_->groups_added = param_groups_.size();
}

void FusedOptimizer::check_params(size_t gi) {
  const auto& params = param_groups_[gi].params();
  std::vector<std::pair<const c10::TensorImpl*, c10::ScalarType>> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined(), where(gi, i), " is an undefined tensor.");
    TORCH_CHECK(is_supported(p.scalar_type()), where(gi, i), " has dtype ",
                detail::dtype_name(p.scalar_type()),
                "; ampfuse optimizers support torch.float16, torch.bfloat16 and torch.float32 "
                "parameters.");
    TORCH_CHECK(p.layout() == c10::kStrided, where(gi, i), " is not a strided (dense) tensor.");
    TORCH_CHECK(p.device() == params[0].device(), "param_groups()[", gi, "] has parameters on ",
                params[0].device(), " and on ", p.device(),
                "; ampfuse optimizers need the parameters of one group on one device.");
    auto rec = internals_->param_dtypes.find(p.unsafeGetTensorImpl());
    if (rec == internals_->param_dtypes.end()) {
      seen.emplace_back(p.unsafeGetTensorImpl(), p.scalar_type());
    } else {
      TORCH_CHECK(rec->second == p.scalar_type(), where(gi, i), " has dtype ",
                  detail::dtype_name(p.scalar_type()), " but was ",
                  detail::dtype_name(rec->second),
                  " when the optimizer was built; build the optimizer after converting the model "
                  "(e.g. after model->to(torch::kBFloat16)).");
    }
  }
  for (const auto& [impl, dtype] : seen) internals_->param_dtypes.emplace(impl, dtype);
}

void FusedOptimizer::validate() {
  TORCH_CHECK_VALUE(
      param_groups_.size() == internals_->groups_added, "param_groups()[", internals_->groups_added,
      "] was not added by this optimizer's add_param_group (torch::optim::Optimizer::add_param_group, called "
      "through a base-class reference, gives an ampfuse optimizer's group the defaults, not the options "
      "asked for): add it through the ampfuse optimizer, e.g. static_cast<ampfuse::optim::FusedOptimizer&>(opt)"
      ".add_param_group(group).");
  std::vector<at::Tensor> params, grads, state;
  std::vector<int64_t> owner, groups, indices;
  std::vector<std::string> keys;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    check_options(param_groups_[gi].options());
    check_params(gi);
    const auto& ps = param_groups_[gi].params();
    for (size_t i = 0; i < ps.size(); ++i) {
      at::Tensor g = grad_of(ps[i]);
      if (!g.defined()) continue;
      for (auto& [key, t] : state_tensors(ps[i])) {
        state.push_back(std::move(t));
        owner.push_back(static_cast<int64_t>(params.size()));
        keys.emplace_back(key);
      }
      params.push_back(ps[i]);
      grads.push_back(std::move(g));
      groups.push_back(static_cast<int64_t>(gi));
      indices.push_back(static_cast<int64_t>(i));
    }
  }
  engine::check_step_grads(params, grads, state, owner, keys, groups, indices,
                           "param_groups()[{g}].params()[{i}]");
}

void FusedOptimizer::set_step_scaling(StepScaling scaling) {
  internals_->scaling = std::move(scaling);
}
void FusedOptimizer::clear_step_scaling() { internals_->scaling.reset(); }
const std::optional<StepScaling>& FusedOptimizer::step_scaling() const {
  return internals_->scaling;
}

void FusedOptimizer::set_grad_buffer(const at::Tensor& param, at::Tensor buffer) {
  TORCH_CHECK(param.defined() && buffer.defined(),
              "set_grad_buffer: param and buffer must be defined tensors.");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat, "set_grad_buffer: buffer must be a "
              "torch.float32 tensor, got ", detail::dtype_name(buffer.scalar_type()), ".");
  TORCH_CHECK(buffer.sizes() == param.sizes(), "set_grad_buffer: buffer has shape ",
              buffer.sizes(), " but the parameter has shape ", param.sizes(), ".");
  internals_->grad_buffers[param.unsafeGetTensorImpl()] = std::move(buffer);
}

void FusedOptimizer::remove_grad_buffer(const at::Tensor& param) {
  internals_->grad_buffers.erase(param.unsafeGetTensorImpl());
}

void FusedOptimizer::sync_masters_from_params() {
  std::vector<at::Tensor> params, masters;
  for (const auto& group : param_groups_) {
    for (const auto& p : group.params()) {
      for (auto& [key, t] : state_tensors(p)) {
        if (std::strcmp(key, "master_param") == 0 || std::strcmp(key, "master_remainder") == 0) {
          params.push_back(p);
          masters.push_back(std::move(t));
        }
      }
    }
  }
  internals_->keeper->sync_from_params(params, masters);
}

std::optional<at::Tensor> FusedOptimizer::last_step_skipped() const { return internals_->last_found_inf; }

at::Tensor FusedOptimizer::grad_of(const at::Tensor& param) const {
  const auto& in = *internals_;
  auto it = in.grad_buffers.find(param.unsafeGetTensorImpl());
  if (it != in.grad_buffers.end()) return it->second;
  if (in.grad_source.defined()) {
    if (const at::Tensor* sum = in.grad_source->window_grad(param)) return *sum;
  }
  return param.grad();
}

// ---- the step plan ----------------------------------------------------------------------------------
}  // namespace ampfuse::optim

namespace ampfuse::detail {

struct OptimizerPlan {
  c10::intrusive_ptr<engine::StepPlan> plan;
  c10::intrusive_ptr<engine::AccumulatePlan> source;  // the gradients' source it is bound to
  std::vector<const void*> key;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;  // each group's, as last packed
  int devices = 0;
  bool fp16_grads = false;
};

namespace {

// The micro-batch plan whose sums the next step reads (undefined: the params' .grad()).
c10::intrusive_ptr<engine::AccumulatePlan> source_of(const OptimizerInternals& in) {
  return in.grad_source.defined() ? in.grad_source->plan() : c10::intrusive_ptr<engine::AccumulatePlan>();
}

// After a validated step: the plan of the buckets that step ran and the params it left idle (no
// gradient), for what the optimizer's `key` is now (none for tensor subclasses: they go through
// the ops, which their __torch_dispatch__ routes).
void build_plan(OptimizerInternals& in, const std::vector<StepPlanBucket>& buckets,
                const std::vector<at::Tensor>& idle, bool adam, std::vector<const void*> key) {
  in.plan.reset();
  // A window's sums without its micro-batch plan (several devices) have no native source.
  if (in.grad_source.defined() && !in.grad_source->has_plan()) return;
  for (const auto& b : buckets) {
    for (const auto& p : b.params) {
      if (p.key_set().has(c10::DispatchKey::Python) || p.is_meta()) return;
    }
  }
  auto plan = std::make_shared<OptimizerPlan>();
  plan->plan = c10::make_intrusive<engine::StepPlan>(adam ? "adam" : "sgd");
  std::vector<c10::Device> devices;
  for (const auto& b : buckets) {
    plan->plan->add_bucket(static_cast<int64_t>(b.group), b.params, b.masters, b.states[0],
                           b.states[1], b.states[2], b.steps, b.fp32_grads, b.absmaxes[0],
                           b.absmaxes[1], b.absmaxes[2]);
    const c10::Device d = b.params[0].device();
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
    plan->fp16_grads |= !b.fp32_grads && b.params[0].scalar_type() == at::kHalf;
  }
  if (!idle.empty()) plan->plan->add_idle(idle);
  plan->source = source_of(in);
  if (plan->source.defined()) plan->plan->bind_source(plan->source);
  plan->plan->finalize();
  if (in.keeper.defined()) in.keeper->hold_plan(plan->plan);
  plan->devices = static_cast<int>(devices.size());
  plan->key = std::move(key);
  in.plan = std::move(plan);
}

}  // namespace

std::optional<std::vector<at::Tensor>> plan_check(optim::FusedOptimizer& opt,
                                                  const at::Tensor& scale, bool write,
                                                  bool with_norm, double norm_type,
                                                  std::optional<double> max_norm, bool allow_fp16) {
  if (!opt.has_step_plan()) return std::nullopt;
  const OptimizerPlan& plan = *opt.internals().plan;
  if (plan.fp16_grads && !allow_fp16) return std::nullopt;
  std::vector<at::Tensor> out =
      plan.plan->check(scale, write, with_norm, norm_type, plan.devices <= 1 ? max_norm : std::nullopt);
  if (out.empty()) return std::nullopt;
  return out;
}

}  // namespace ampfuse::detail

namespace ampfuse::optim {

bool FusedOptimizer::has_step_plan() const {
  const auto& in = *internals_;
  return in.plan != nullptr && in.grad_buffers.empty() && in.plan->source == detail::source_of(in) &&
         !(in.grad_source.defined() && !in.grad_source->has_plan()) &&
         plan_key() == in.plan->key;
}

bool FusedOptimizer::step_with_plan() {
  auto& in = *internals_;
  if (!has_step_plan()) {
    in.plan.reset();
    return false;
  }
  set_plan_hyper(*in.plan);
  std::optional<at::Tensor> gs, fi, cc;
  if (const auto& sc = in.scaling) {
    if (sc->grad_scale && sc->grad_scale->defined()) gs = sc->grad_scale;
    if (sc->found_inf && sc->found_inf->defined()) fi = sc->found_inf;
    if (sc->clip_coef && sc->clip_coef->defined()) cc = sc->clip_coef;
  }
  if (in.plan->plan->step(gs, fi, cc) == engine::StepPlan::kOk) return true;
  in.plan.reset();  // something changed: the validated way, which rebuilds the plan
  return false;
}

// ============================================================================================
// Policies and the optimizer template
// ============================================================================================
struct SgdPolicy {
  using Options = SGDOptions;
  using State = SGDParamState;
  static constexpr const char* kName = "SGD";
  static constexpr std::array<const char*, 1> kStateNames = {"momentum_buffer"};
  static constexpr std::array<const char*, 1> kAbsmaxNames = {"momentum_buffer_absmax"};
  static int num_states(const Options& o) { return o.momentum() != 0 ? 1 : 0; }
  static at::Tensor& state(State& s, int) { return s.momentum_buffer(); }
  static at::Tensor& absmax(State& s, int) { return s.momentum_buffer_absmax(); }
  static std::vector<at::ScalarType> state_dtypes(const Options& o, int num) {
    return std::vector<at::ScalarType>(num, o.state_dtype());
  }
  // Momentum switched on mid-run (torch: the buffer is None): the next step taken starts it from
  // the gradient, which the kernel does when the step counter is 0.
  static constexpr bool kRestartOnCreate = true;
  static void add_options(c10::Dict<std::string, c10::IValue>&) {}
  static void run(const Options& o, Bucket& b, const StepScaling& sc) {
    SgdStepOptions so;
    so.lr = o.lr();
    so.momentum = o.momentum();
    so.dampening = o.dampening();
    so.weight_decay = o.weight_decay();
    so.nesterov = o.nesterov();
    so.maximize = o.maximize();
    if (stochastic(o)) so.rounding_seed = o.rounding_seed();
    sgd_step_(b.params, b.grads, b.masters, b.states[0], b.steps, so, sc, b.absmaxes[0]);
  }
};

template <typename O, bool kDecoupled>
struct AdamPolicyT {
  using Options = O;
  using State = AdamParamState;
  static constexpr const char* kName = kDecoupled ? "AdamW" : "Adam";
  static constexpr std::array<const char*, 3> kStateNames = {"exp_avg", "exp_avg_sq",
                                                             "max_exp_avg_sq"};
  static constexpr std::array<const char*, 3> kAbsmaxNames = {"exp_avg_absmax", "exp_avg_sq_absmax",
                                                              "max_exp_avg_sq_absmax"};
  static int num_states(const Options& o) { return o.amsgrad() ? 3 : 2; }
  static at::Tensor& state(State& s, int k) {
    return k == 0 ? s.exp_avg() : (k == 1 ? s.exp_avg_sq() : s.max_exp_avg_sq());
  }
  static at::Tensor& absmax(State& s, int k) {
    return k == 0 ? s.exp_avg_absmax() : (k == 1 ? s.exp_avg_sq_absmax() : s.max_exp_avg_sq_absmax());
  }
  static std::vector<at::ScalarType> state_dtypes(const Options& o, int num) {
    const auto second = o.exp_avg_sq_dtype() == at::ScalarType::Undefined ? o.state_dtype() : o.exp_avg_sq_dtype();
    std::vector<at::ScalarType> out(num, second);
    if (num > 0) out[0] = o.state_dtype();
    return out;
  }
  static constexpr bool kRestartOnCreate = false;
  static void add_options(c10::Dict<std::string, c10::IValue>& values) {
    values.insert("decoupled_weight_decay", kDecoupled);
  }
  static void run(const Options& o, Bucket& b, const StepScaling& sc) {
    AdamStepOptions ao;
    ao.lr = o.lr();
    ao.beta1 = std::get<0>(o.betas());
    ao.beta2 = std::get<1>(o.betas());
    ao.eps = o.eps();
    ao.weight_decay = o.weight_decay();
    ao.amsgrad = o.amsgrad();
    ao.maximize = o.maximize();
    ao.decoupled_weight_decay = kDecoupled;
    if (stochastic(o)) ao.rounding_seed = o.rounding_seed();
    adam_step_(b.params, b.grads, b.masters, b.states[0], b.states[1], b.states[2], b.steps, ao,
               sc, AdamStateAbsmax{b.absmaxes[0], b.absmaxes[1], b.absmaxes[2]});
  }
};
struct AdamPolicy : AdamPolicyT<AdamOptions, false> {};
struct AdamWPolicy : AdamPolicyT<AdamWOptions, true> {};

template <class P>
Fused<P>::Fused(const std::vector<OptimizerParamGroup>& param_groups, Options defaults)
    : FusedOptimizer(std::make_unique<Options>(defaults)) {
  internals().keeper = c10::make_intrusive<engine::MasterKeeper>(P::kName);
  check_options(*defaults_);
  for (const auto& group : param_groups) add_param_group(group);
}

template <class P>
Fused<P>::Fused(std::vector<at::Tensor> params, Options defaults)
    : Fused(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))},
            std::move(defaults)) {}

template <class P>
at::Tensor Fused<P>::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  auto& in = internals();
  const auto& sc = in.scaling;
  std::optional<at::Tensor> found_inf =
      sc && sc->found_inf && sc->found_inf->defined() ? sc->found_inf : std::optional<at::Tensor>();
  if (step_with_plan()) {
    in.last_found_inf = std::move(found_inf);
    return loss;
  }
  std::vector<detail::StepPlanBucket> ran;
  std::vector<at::Tensor> idle;
  fused_step<P>(*this, ran, idle, in.reconcile);
  in.last_found_inf = std::move(found_inf);
  if (in.grad_buffers.empty()) {
    detail::build_plan(in, ran, idle, !std::is_same_v<P, SgdPolicy>, plan_key());
  }
  return loss;
}

template <class P>
std::vector<const void*> Fused<P>::plan_key() const {
  return plan_key_of<P>(*this);
}

// Checked and packed when a group's options changed since the plan last took them.
template <class P>
void Fused<P>::set_plan_hyper(detail::OptimizerPlan& plan) const {
  const auto& groups = param_groups();
  bool same = plan.options.size() == groups.size();
  for (size_t g = 0; same && g < groups.size(); ++g) {
    same = static_cast<const Options&>(*plan.options[g]) == static_cast<const Options&>(groups[g].options());
  }
  if (same) return;
  std::vector<c10::Dict<std::string, c10::IValue>> values;
  for (const auto& group : groups) {  // all of them before the plan holds any
    const auto& o = static_cast<const Options&>(group.options());
    values.push_back(option_values<P>(o));
    engine::check_group_hyper(P::kName, values.back(), P::kName, false);
  }
  plan.options.clear();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& o = static_cast<const Options&>(groups[g].options());
    plan.plan->set_options(static_cast<int64_t>(g), values[g],
                           stochastic(o) ? std::optional<int64_t>(o.rounding_seed()) : std::nullopt, std::nullopt,
                           std::nullopt);
    plan.options.push_back(std::make_unique<Options>(o));
  }
}

template <class P>
void Fused<P>::save(OutputArchive& archive) const {
  fused_save<P>(*this, archive);
}

template <class P>
void Fused<P>::load(InputArchive& archive) {
  fused_load<P>(*this, archive, internals().reconcile);
}

template <class P>
std::unique_ptr<OptimizerOptions> Fused<P>::merge_group_options(const OptimizerOptions& options) const {
  const auto& user = options_of<Options>(options, P::kName);
  return std::make_unique<Options>(merge_options(user, static_cast<const Options&>(*defaults_)));
}

template <class P>
std::vector<std::pair<const char*, at::Tensor>> Fused<P>::state_tensors(const at::Tensor& param) const {
  std::vector<std::pair<const char*, at::Tensor>> out;
  auto& states = const_cast<Fused<P>*>(this)->state();
  auto it = states.find(param.unsafeGetTensorImpl());
  if (it == states.end()) return out;
  auto& s = static_cast<State&>(*it->second);
  auto add = [&](const char* key, const at::Tensor& t) {
    if (t.defined()) out.emplace_back(key, t);
  };
  add("step", s.step());
  for (size_t k = 0; k < P::kStateNames.size(); ++k) add(P::kStateNames[k], P::state(s, static_cast<int>(k)));
  for (size_t k = 0; k < P::kStateNames.size(); ++k) add(P::kAbsmaxNames[k], P::absmax(s, static_cast<int>(k)));
  add("master_param", s.master_param());
  add("master_remainder", s.master_remainder());
  return out;
}

template <class P>
void Fused<P>::check_options(const OptimizerOptions& options) const {
  engine::check_group_hyper(P::kName, option_values<P>(options_of<Options>(options, P::kName)), P::kName, false);
}

template class Fused<SgdPolicy>;
template class Fused<AdamPolicy>;
template class Fused<AdamWPolicy>;

at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder) {
  return engine::join_master(param, remainder);
}

std::tuple<at::Tensor, at::Tensor> split_master(const at::Tensor& master) {
  return engine::split_master(master);
}

}  // namespace ampfuse::optim
