// ampfuse::optim::SGD / Adam / AdamW for LibTorch: buckets of (device, param dtype, grad dtype,
// master) handed to the sgd_step_/adam_step_ ops, exactly as python/ampfuse/optim.py does.
#include "ampfuse/optim.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

#include <array>
#include <cmath>
#include <string>
#include <utility>

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

at::Tensor zeros_fp32_like(const at::Tensor& p) {
  return at::zeros_like(p, p.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
}

// Lazily created state: a 0-dim fp32 step counter on the param's device.
void ensure_step(at::Tensor& step, const at::Tensor& p) {
  if (!step.defined()) {
    step = at::zeros({}, p.options().dtype(at::kFloat));
  } else if (step.scalar_type() != at::kFloat || step.device() != p.device() || step.dim() != 0) {
    step = step.to(p.device(), at::kFloat).reshape({}).clone();
  }
}

void ensure_fp32(at::Tensor& t, const at::Tensor& p) {
  if (!t.defined()) t = zeros_fp32_like(p);
}

void ensure_master(at::Tensor& master, const at::Tensor& p) {
  if (!master.defined()) {
    master = p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true,
                           at::MemoryFormat::Preserve);
  }
}

// A loaded state tensor, on the param's device in fp32 (masters and state stay fp32 whatever the
// param's dtype).
void adopt_loaded(at::Tensor& t, const at::Tensor& p, const char* key, size_t group, size_t index) {
  if (!t.defined()) return;
  TORCH_CHECK(t.sizes() == p.sizes(), "state '", key, "' of ", where(group, index),
              " in the checkpoint has shape ", t.sizes(), " but the parameter has shape ",
              p.sizes(), ".");
  TORCH_CHECK(t.is_floating_point(), "state '", key, "' of ", where(group, index),
              " in the checkpoint must be a floating-point tensor, got ",
              detail::dtype_name(t.scalar_type()), ".");
}

void adopt_loaded_step(const at::Tensor& t, size_t group, size_t index) {
  if (!t.defined()) return;
  TORCH_CHECK(t.numel() == 1, "state 'step' of ", where(group, index),
              " in the checkpoint must have one element, got shape ", t.sizes(), ".");
}

void move_loaded(at::Tensor& t, const at::Tensor& p) {
  if (t.defined()) t = t.to(p.device(), at::kFloat);
}

// ---- buckets ------------------------------------------------------------------------------------
struct Bucket {
  c10::Device device;
  c10::ScalarType param_dtype;
  c10::ScalarType grad_dtype;
  bool master;
  std::vector<at::Tensor> params, grads, masters, steps;
  std::array<std::vector<at::Tensor>, 3> states;
};

Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, const at::Tensor& g,
                   bool master) {
  for (auto& b : buckets) {
    if (b.device == p.device() && b.param_dtype == p.scalar_type() &&
        b.grad_dtype == g.scalar_type() && b.master == master) {
      return b;
    }
  }
  buckets.push_back(Bucket{p.device(), p.scalar_type(), g.scalar_type(), master, {}, {}, {}, {}, {}});
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

// ---- the three optimizers as policies of one generic step / save / load ---------------------
struct SgdPolicy {
  using Options = SGDOptions;
  using State = SGDParamState;
  static int num_states(const Options& o) { return o.momentum() != 0 ? 1 : 0; }
  static at::Tensor& state(State& s, int) { return s.momentum_buffer(); }
  static constexpr std::array<const char*, 1> kStateNames = {"momentum_buffer"};
  static void run(const Options& o, Bucket& b, const StepScaling& sc) {
    SgdStepOptions so;
    so.lr = o.lr();
    so.momentum = o.momentum();
    so.dampening = o.dampening();
    so.weight_decay = o.weight_decay();
    so.nesterov = o.nesterov();
    so.maximize = o.maximize();
    sgd_step_(b.params, b.grads, b.masters, b.states[0], b.steps, so, sc);
  }
  // torch's SGD has no step counter: a present momentum buffer means momentum was initialised.
  static void adopt_foreign(State& s, const at::Tensor& p) {
    if (!s.step().defined()) {
      s.step(at::full({}, s.momentum_buffer().defined() ? 1.0f : 0.0f, p.options().dtype(at::kFloat)));
    }
  }
};

template <typename O, bool kDecoupled>
struct AdamPolicyT {
  using Options = O;
  using State = AdamParamState;
  static int num_states(const Options& o) { return o.amsgrad() ? 3 : 2; }
  static at::Tensor& state(State& s, int k) {
    return k == 0 ? s.exp_avg() : (k == 1 ? s.exp_avg_sq() : s.max_exp_avg_sq());
  }
  static constexpr std::array<const char*, 3> kStateNames = {"exp_avg", "exp_avg_sq",
                                                             "max_exp_avg_sq"};
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
    adam_step_(b.params, b.grads, b.masters, b.states[0], b.states[1], b.states[2], b.steps, ao,
               sc);
  }
  static void adopt_foreign(State& s, const at::Tensor& p) {
    if (!s.step().defined()) s.step(at::zeros({}, p.options().dtype(at::kFloat)));
  }
};
using AdamPolicy = AdamPolicyT<AdamOptions, false>;
using AdamWPolicy = AdamPolicyT<AdamWOptions, true>;

template <typename P>
typename P::State& ensure_state(torch::optim::Optimizer& opt, const at::Tensor& p,
                                const typename P::Options& o) {
  auto& states = opt.state();
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    it = states.emplace(p.unsafeGetTensorImpl(), std::make_unique<typename P::State>()).first;
  }
  auto& s = static_cast<typename P::State&>(*it->second);
  ensure_step(s.step(), p);
  for (int k = 0; k < P::num_states(o); ++k) ensure_fp32(P::state(s, k), p);
  if (o.master_weights() && is_low(p.scalar_type())) ensure_master(s.master_param(), p);
  return s;
}

template <typename P>
at::Tensor fused_step(FusedOptimizer& opt, const torch::optim::Optimizer::LossClosure& closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  opt.validate();
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const typename P::Options&>(group.options());
    std::vector<Bucket> buckets;
    for (const auto& p : group.params()) {
      at::Tensor g = opt.grad_of(p);
      if (!g.defined()) continue;
      auto& s = ensure_state<P>(opt, p, o);
      const bool master = o.master_weights() && is_low(p.scalar_type());
      Bucket& b = bucket_for(buckets, p, g, master);
      b.params.push_back(p);
      b.grads.push_back(g);
      b.steps.push_back(s.step());
      if (master) b.masters.push_back(s.master_param());
      for (int k = 0; k < P::num_states(o); ++k) b.states[k].push_back(P::state(s, k));
    }
    for (auto& b : buckets) P::run(o, b, scaling_on(opt.step_scaling(), b.device));
  }
  return loss;
}

// Loads a checkpoint written by save() (or by torch's matching C++ optimizer). Everything is
// read and checked before the optimizer changes.
template <typename P>
void fused_load(torch::optim::Optimizer& opt, InputArchive& archive) {
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
  std::vector<std::vector<std::string>> keys(num_groups);
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
      keys[g].push_back(key.toStringRef());
    }
    InputArchive options_archive;
    group_archive.read("options", options_archive);
    Options o = static_cast<const Options&>(groups[g].options());  // absent keys stay as they are
    o.serialize(options_archive);
    options.push_back(std::move(o));
  }
  // Check every state tensor against its parameter.
  for (size_t g = 0; g < num_groups; ++g) {
    for (size_t i = 0; i < keys[g].size(); ++i) {
      auto it = saved_state.find(reinterpret_cast<void*>(std::stoull(keys[g][i])));
      if (it == saved_state.end()) continue;
      auto& s = static_cast<State&>(*it->second);
      const auto& p = groups[g].params()[i];
      adopt_loaded_step(s.step(), g, i);
      for (size_t k = 0; k < P::kStateNames.size(); ++k) {
        adopt_loaded(P::state(s, static_cast<int>(k)), p, P::kStateNames[k], g, i);
      }
      adopt_loaded(s.master_param(), p, "master_param", g, i);
    }
  }
  // Commit.
  for (size_t g = 0; g < num_groups; ++g) {
    for (size_t i = 0; i < keys[g].size(); ++i) {
      const auto& p = groups[g].params()[i];
      auto it = saved_state.find(reinterpret_cast<void*>(std::stoull(keys[g][i])));
      if (it == saved_state.end()) {
        opt.state().erase(p.unsafeGetTensorImpl());
        continue;
      }
      auto& s = static_cast<State&>(*it->second);
      P::adopt_foreign(s, p);
      if (s.step().defined()) s.step(s.step().to(p.device(), at::kFloat).reshape({}));
      for (size_t k = 0; k < P::kStateNames.size(); ++k) move_loaded(P::state(s, static_cast<int>(k)), p);
      move_loaded(s.master_param(), p);
      opt.state()[p.unsafeGetTensorImpl()] = std::move(it->second);
    }
    static_cast<Options&>(groups[g].options()) = options[g];
  }
}

// ---- hyper-parameter checks (torch's rules, full sentences) ----------------------------------
void check_lr(const char* opt, double lr) {
  TORCH_CHECK(lr >= 0.0, opt, ": lr must be >= 0, got ", lr, ".");
}
void check_weight_decay(const char* opt, double wd) {
  TORCH_CHECK(wd >= 0.0, opt, ": weight_decay must be >= 0, got ", wd, ".");
}
template <typename O>
void check_adam_options(const char* name, const O& o) {
  check_lr(name, o.lr());
  TORCH_CHECK(o.eps() >= 0.0, name, ": eps must be >= 0, got ", o.eps(), ".");
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  TORCH_CHECK(b1 >= 0.0 && b1 < 1.0, name, ": betas[0] must be in [0, 1), got ", b1, ".");
  TORCH_CHECK(b2 >= 0.0 && b2 < 1.0, name, ": betas[1] must be in [0, 1), got ", b2, ".");
  check_weight_decay(name, o.weight_decay());
}

// torch's group-option inheritance: a field left at its default-constructed value takes the
// optimizer's default.
#define AMPFUSE_MERGE_FIELD(field) \
  if (!(user.field() == fresh.field())) merged.field(user.field())

template <typename O>
const O& options_of(const OptimizerOptions& options, const char* optimizer, const char* expected) {
  const auto* o = dynamic_cast<const O*>(&options);
  TORCH_CHECK(o != nullptr, optimizer, " needs param group options of type ", expected,
              " (got options of another optimizer).");
  return *o;
}

}  // namespace

// ============================================================================================
// Options
// ============================================================================================
SGDOptions::SGDOptions(double lr) : lr_(lr) {}
double SGDOptions::get_lr() const { return lr(); }
void SGDOptions::set_lr(const double lr) { this->lr(lr); }
bool operator==(const SGDOptions& a, const SGDOptions& b) {
  return a.lr() == b.lr() && a.momentum() == b.momentum() && a.dampening() == b.dampening() &&
         a.weight_decay() == b.weight_decay() && a.nesterov() == b.nesterov() &&
         a.maximize() == b.maximize() && a.master_weights() == b.master_weights();
}
void SGDOptions::serialize(OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("momentum", c10::IValue(momentum()));
  archive.write("dampening", c10::IValue(dampening()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("nesterov", c10::IValue(nesterov()));
  archive.write("maximize", c10::IValue(maximize()));
  archive.write("master_weights", c10::IValue(master_weights()));
}
void SGDOptions::serialize(InputArchive& archive) {
  read_if_present(archive, "lr", lr_);
  read_if_present(archive, "momentum", momentum_);
  read_if_present(archive, "dampening", dampening_);
  read_if_present(archive, "weight_decay", weight_decay_);
  read_if_present(archive, "nesterov", nesterov_);
  read_if_present(archive, "maximize", maximize_);
  read_if_present(archive, "master_weights", master_weights_);
}

#define AMPFUSE_ADAM_OPTIONS_IMPL(Name)                                                        \
  Name::Name(double lr) : lr_(lr) {}                                                           \
  double Name::get_lr() const { return lr(); }                                                 \
  void Name::set_lr(const double lr) { this->lr(lr); }                                         \
  bool operator==(const Name& a, const Name& b) {                                              \
    return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&                 \
           a.weight_decay() == b.weight_decay() && a.amsgrad() == b.amsgrad() &&               \
           a.maximize() == b.maximize() && a.master_weights() == b.master_weights();           \
  }                                                                                            \
  void Name::serialize(OutputArchive& archive) const {                                         \
    archive.write("lr", c10::IValue(lr()));                                                    \
    archive.write("betas", c10::IValue(betas()));                                              \
    archive.write("eps", c10::IValue(eps()));                                                  \
    archive.write("weight_decay", c10::IValue(weight_decay()));                                \
    archive.write("amsgrad", c10::IValue(amsgrad()));                                          \
    archive.write("maximize", c10::IValue(maximize()));                                        \
    archive.write("master_weights", c10::IValue(master_weights()));                            \
  }                                                                                            \
  void Name::serialize(InputArchive& archive) {                                                \
    read_if_present(archive, "lr", lr_);                                                       \
    read_if_present(archive, "betas", betas_);                                                 \
    read_if_present(archive, "eps", eps_);                                                     \
    read_if_present(archive, "weight_decay", weight_decay_);                                   \
    read_if_present(archive, "amsgrad", amsgrad_);                                             \
    read_if_present(archive, "maximize", maximize_);                                           \
    read_if_present(archive, "master_weights", master_weights_);                               \
  }

AMPFUSE_ADAM_OPTIONS_IMPL(AdamOptions)
AMPFUSE_ADAM_OPTIONS_IMPL(AdamWOptions)
#undef AMPFUSE_ADAM_OPTIONS_IMPL

// ============================================================================================
// Per-parameter state
// ============================================================================================
void SGDParamState::serialize(OutputArchive& archive) const {
  write_tensor(archive, "step", step());
  write_tensor(archive, "momentum_buffer", momentum_buffer());
  write_tensor(archive, "master_param", master_param());
}
void SGDParamState::serialize(InputArchive& archive) {
  step(read_step(archive));
  momentum_buffer(read_tensor(archive, "momentum_buffer"));
  master_param(read_tensor(archive, "master_param"));
}
void AdamParamState::serialize(OutputArchive& archive) const {
  write_tensor(archive, "step", step());
  write_tensor(archive, "exp_avg", exp_avg());
  write_tensor(archive, "exp_avg_sq", exp_avg_sq());
  write_tensor(archive, "max_exp_avg_sq", max_exp_avg_sq());
  write_tensor(archive, "master_param", master_param());
}
void AdamParamState::serialize(InputArchive& archive) {
  step(read_step(archive));
  exp_avg(read_tensor(archive, "exp_avg"));
  exp_avg_sq(read_tensor(archive, "exp_avg_sq"));
  max_exp_avg_sq(read_tensor(archive, "max_exp_avg_sq"));
  master_param(read_tensor(archive, "master_param"));
}

// ============================================================================================
// FusedOptimizer
// ============================================================================================
FusedOptimizer::FusedOptimizer(std::unique_ptr<OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::vector<OptimizerParamGroup>{}, std::move(defaults)) {}

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
    auto rec = param_dtypes_.find(p.unsafeGetTensorImpl());
    if (rec == param_dtypes_.end()) {
      seen.emplace_back(p.unsafeGetTensorImpl(), p.scalar_type());
    } else {
      TORCH_CHECK(rec->second == p.scalar_type(), where(gi, i), " has dtype ",
                  detail::dtype_name(p.scalar_type()), " but was ",
                  detail::dtype_name(rec->second),
                  " when the optimizer was built; build the optimizer after converting the model "
                  "(e.g. after model->to(torch::kBFloat16)).");
    }
  }
  for (const auto& [impl, dtype] : seen) param_dtypes_.emplace(impl, dtype);
}

void FusedOptimizer::validate() {
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    check_options(param_groups_[gi].options());
    check_params(gi);
    const auto& params = param_groups_[gi].params();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const at::Tensor g = grad_of(p);
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), where(gi, i),
                  " has a sparse gradient; ampfuse optimizers do not support sparse gradients.");
      TORCH_CHECK(is_supported(g.scalar_type()), where(gi, i), " has a gradient of dtype ",
                  detail::dtype_name(g.scalar_type()),
                  "; expected torch.float16, torch.bfloat16 or torch.float32.");
      TORCH_CHECK(g.sizes() == p.sizes(), where(gi, i), " has a gradient of shape ", g.sizes(),
                  " but the parameter has shape ", p.sizes(), ".");
      TORCH_CHECK(g.device() == p.device(), where(gi, i), " is on ", p.device(),
                  " but its gradient is on ", g.device(), ".");
    }
  }
}

void FusedOptimizer::set_step_scaling(StepScaling scaling) { scaling_ = std::move(scaling); }
void FusedOptimizer::clear_step_scaling() { scaling_.reset(); }
const std::optional<StepScaling>& FusedOptimizer::step_scaling() const { return scaling_; }

void FusedOptimizer::set_grad_buffer(const at::Tensor& param, at::Tensor buffer) {
  TORCH_CHECK(param.defined() && buffer.defined(),
              "set_grad_buffer: param and buffer must be defined tensors.");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat, "set_grad_buffer: buffer must be a "
              "torch.float32 tensor, got ", detail::dtype_name(buffer.scalar_type()), ".");
  TORCH_CHECK(buffer.sizes() == param.sizes(), "set_grad_buffer: buffer has shape ",
              buffer.sizes(), " but the parameter has shape ", param.sizes(), ".");
  grad_buffers_[param.unsafeGetTensorImpl()] = std::move(buffer);
}

void FusedOptimizer::remove_grad_buffer(const at::Tensor& param) {
  grad_buffers_.erase(param.unsafeGetTensorImpl());
}

at::Tensor FusedOptimizer::grad_of(const at::Tensor& param) const {
  auto it = grad_buffers_.find(param.unsafeGetTensorImpl());
  return it != grad_buffers_.end() ? it->second : param.grad();
}

// ============================================================================================
// SGD / Adam / AdamW
// ============================================================================================
#define AMPFUSE_OPTIMIZER_IMPL(Name, Policy)                                                    \
  Name::Name(const std::vector<OptimizerParamGroup>& param_groups, Name##Options defaults)      \
      : FusedOptimizer(std::make_unique<Name##Options>(defaults)) {                             \
    check_options(*defaults_);                                                                  \
    for (const auto& group : param_groups) add_param_group(group);                              \
  }                                                                                             \
  Name::Name(std::vector<at::Tensor> params, Name##Options defaults)                            \
      : Name(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))},          \
             std::move(defaults)) {}                                                            \
  at::Tensor Name::step(LossClosure closure) { return fused_step<Policy>(*this, closure); }     \
  void Name::save(OutputArchive& archive) const {                                               \
    torch::optim::serialize<Policy::State, Name##Options>(archive, *this);                      \
  }                                                                                             \
  void Name::load(InputArchive& archive) { fused_load<Policy>(*this, archive); }

AMPFUSE_OPTIMIZER_IMPL(SGD, SgdPolicy)
AMPFUSE_OPTIMIZER_IMPL(Adam, AdamPolicy)
AMPFUSE_OPTIMIZER_IMPL(AdamW, AdamWPolicy)
#undef AMPFUSE_OPTIMIZER_IMPL

std::unique_ptr<OptimizerOptions> SGD::merge_group_options(const OptimizerOptions& options) const {
  const auto& user = options_of<SGDOptions>(options, "ampfuse::optim::SGD", "ampfuse::optim::SGDOptions");
  const SGDOptions fresh;
  SGDOptions merged = static_cast<const SGDOptions&>(*defaults_);
  AMPFUSE_MERGE_FIELD(lr);
  AMPFUSE_MERGE_FIELD(momentum);
  AMPFUSE_MERGE_FIELD(dampening);
  AMPFUSE_MERGE_FIELD(weight_decay);
  AMPFUSE_MERGE_FIELD(nesterov);
  AMPFUSE_MERGE_FIELD(maximize);
  AMPFUSE_MERGE_FIELD(master_weights);
  return std::make_unique<SGDOptions>(merged);
}

void SGD::check_options(const OptimizerOptions& options) const {
  const auto& o = options_of<SGDOptions>(options, "ampfuse::optim::SGD", "ampfuse::optim::SGDOptions");
  check_lr("SGD", o.lr());
  TORCH_CHECK(o.momentum() >= 0.0, "SGD: momentum must be >= 0, got ", o.momentum(), ".");
  check_weight_decay("SGD", o.weight_decay());
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
              "SGD: nesterov momentum requires a momentum > 0 and zero dampening.");
}

#define AMPFUSE_ADAM_GROUP_IMPL(Name)                                                           \
  std::unique_ptr<OptimizerOptions> Name::merge_group_options(const OptimizerOptions& options)  \
      const {                                                                                   \
    const auto& user = options_of<Name##Options>(options, "ampfuse::optim::" #Name,             \
                                                 "ampfuse::optim::" #Name "Options");           \
    const Name##Options fresh;                                                                  \
    Name##Options merged = static_cast<const Name##Options&>(*defaults_);                       \
    AMPFUSE_MERGE_FIELD(lr);                                                                    \
    AMPFUSE_MERGE_FIELD(betas);                                                                 \
    AMPFUSE_MERGE_FIELD(eps);                                                                   \
    AMPFUSE_MERGE_FIELD(weight_decay);                                                          \
    AMPFUSE_MERGE_FIELD(amsgrad);                                                               \
    AMPFUSE_MERGE_FIELD(maximize);                                                              \
    AMPFUSE_MERGE_FIELD(master_weights);                                                        \
    return std::make_unique<Name##Options>(merged);                                             \
  }                                                                                             \
  void Name::check_options(const OptimizerOptions& options) const {                             \
    check_adam_options(#Name, options_of<Name##Options>(options, "ampfuse::optim::" #Name,      \
                                                        "ampfuse::optim::" #Name "Options"));   \
  }

AMPFUSE_ADAM_GROUP_IMPL(Adam)
AMPFUSE_ADAM_GROUP_IMPL(AdamW)
#undef AMPFUSE_ADAM_GROUP_IMPL
#undef AMPFUSE_MERGE_FIELD

}  // namespace ampfuse::optim
