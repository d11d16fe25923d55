#include "engine/accumulator_window.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <unordered_set>

#include "engine/scaler_rules.h"
#include "engine/step_plan.h"

namespace ampfuse::engine {
namespace {

bool is_low(c10::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

void accumulate(const std::vector<at::Tensor>& accs, const std::vector<at::Tensor>& grads,
                const at::Tensor& found_inf) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("ampfuse::accumulate_grads_", "")
                       .typed<void(at::TensorList, at::TensorList, const at::Tensor&, bool)>();
  op.call(accs, grads, found_inf, /*zero_grads=*/false);
}

// The devices of `low` in the order of their first param, and each one's total size.
std::vector<std::pair<c10::Device, int64_t>> sizes_per_device(const std::vector<at::Tensor>& low) {
  std::vector<std::pair<c10::Device, int64_t>> sizes;
  for (const auto& p : low) {
    bool found = false;
    for (auto& [d, n] : sizes) {
      if (d == p.device()) {
        n += p.numel();
        found = true;
      }
    }
    if (!found) sizes.emplace_back(p.device(), p.numel());
  }
  return sizes;
}

std::string named(const std::string& naming, const std::string& entry) {
  const auto pos = naming.find("{}");
  TORCH_CHECK(pos != std::string::npos, "naming must hold '{}', got '", naming, "'.");
  return naming.substr(0, pos) + entry + naming.substr(pos + 2);
}


// A list of integers (or bools) from a list or a 1-d integer/bool tensor; nullopt otherwise.
std::optional<std::vector<int64_t>> integers(const c10::IValue& v) {
  std::vector<int64_t> out;
  if (v.isList() || v.isTuple()) {
    const auto items = v.isList() ? v.toListRef().vec() : v.toTupleRef().elements().vec();
    for (const auto& x : items) {
      if (x.isInt()) {
        out.push_back(x.toInt());
      } else if (x.isBool()) {
        out.push_back(x.toBool() ? 1 : 0);
      } else {
        return std::nullopt;
      }
    }
    return out;
  }
  if (v.isIntList()) return v.toIntVector();
  if (v.isBoolList()) {
    for (bool b : v.toBoolList()) out.push_back(b ? 1 : 0);
    return out;
  }
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.dim() != 1 || t.is_floating_point() || t.is_complex()) return std::nullopt;
    const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
    out.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
    return out;
  }
  return std::nullopt;
}

}  // namespace

AccumulatorWindow::AccumulatorWindow(bool fp32_accumulation, bool per_param)
    : fp32_accumulation_(fp32_accumulation), per_param_(per_param) {}

// ---- layout ---------------------------------------------------------------------------------------
std::vector<at::Tensor> AccumulatorWindow::wanted(const std::vector<at::Tensor>& params) const {
  std::vector<at::Tensor> low;
  if (!fp32_accumulation_) return low;
  for (const auto& p : params) {
    if (is_low(p.scalar_type()) && p.requires_grad()) low.push_back(p);
  }
  return low;
}

at::Tensor& AccumulatorWindow::found_inf_of(const c10::Device& device) {
  for (auto& [d, f] : found_inf_) {
    if (d == device) return f;
  }
  found_inf_.emplace_back(device, at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device)));
  return found_inf_.back().second;
}

const at::Tensor& AccumulatorWindow::found_inf(const c10::Device& device) const {
  for (const auto& [d, f] : found_inf_) {
    if (d == device) return f;
  }
  TORCH_CHECK(false, "AccumulatorWindow: no buffer on ", device, ".");
  return found_inf_.front().second;  // not reached
}

void AccumulatorWindow::layout(const std::vector<at::Tensor>& low) {
  bool same = low.size() == low_.size();
  for (size_t k = 0; same && k < low.size(); ++k) same = low[k].is_same(low_[k]);
  if (same) return;
  drop_plan();  // built for the old buffers; its flags come back first
  std::unordered_map<const c10::TensorImpl*, size_t> old;
  for (size_t k = 0; k < low_.size(); ++k) old.emplace(low_[k].unsafeGetTensorImpl(), k);
  const auto sizes = sizes_per_device(low);
  std::vector<c10::Device> devices;
  std::vector<at::Tensor> flats;
  std::vector<int64_t> offsets;
  const at::NoGradGuard no_grad;
  for (const auto& [device, numel] : sizes) {
    devices.push_back(device);
    found_inf_of(device);
    flats.push_back(per_param_ ? at::Tensor()
                               : at::zeros({numel}, at::TensorOptions().dtype(at::kFloat).device(device)));
    offsets.push_back(0);
  }
  std::vector<at::Tensor> buffers;
  std::vector<uint8_t> flags;
  for (const auto& p : low) {
    const auto it = old.find(p.unsafeGetTensorImpl());
    at::Tensor buffer;
    if (per_param_) {
      buffer = it != old.end() ? buffers_[it->second] : at::zeros_like(p, at::kFloat);
    } else {
      size_t d = 0;
      while (devices[d] != p.device()) ++d;
      buffer = flats[d].slice(0, offsets[d], offsets[d] + p.numel()).view(p.sizes());
      offsets[d] += p.numel();
      if (it != old.end()) buffer.copy_(buffers_[it->second]);
    }
    buffers.push_back(std::move(buffer));
    flags.push_back(it != old.end() ? flags_[it->second] : 0);
  }
  low_ = low;
  buffers_ = std::move(buffers);
  flags_ = std::move(flags);
  devices_ = std::move(devices);
  flats_ = std::move(flats);
  index_.clear();
  for (size_t k = 0; k < low_.size(); ++k) index_.emplace(low_[k].unsafeGetTensorImpl(), k);
}

bool AccumulatorWindow::plan_says_same_layout() const { return plan_.defined() && plan_->same_layout(); }

void AccumulatorWindow::start(const std::vector<at::Tensor>& params) {
  if (!plan_says_same_layout()) layout(wanted(params));
}

// ---- a micro-batch ------------------------------------------------------------------------------
bool AccumulatorWindow::collect_planned() { return plan_.defined() && plan_->collect(); }

void AccumulatorWindow::collect(const std::vector<at::Tensor>& params, bool allow_plan) {
  if (collect_planned()) return;
  drop_plan();
  collect_validated(params);
  if (allow_plan) build_plan(params);
}

void AccumulatorWindow::collect_validated(const std::vector<at::Tensor>& params) {
  if (fp32_accumulation_) {
    // A param without a buffer that requires a gradient now (unfrozen inside the window) or got
    // one: summed in fp32 from this micro-batch on. Whether it requires one, not whether this
    // rank's micro-batch gave one, decides: every rank widens its buffers at the same micro-batch,
    // and the window-end collectives keep one size on every rank.
    std::vector<at::Tensor> low = low_;
    for (const auto& p : params) {
      if (is_low(p.scalar_type()) && (p.requires_grad() || p.grad().defined()) &&
          index_.count(p.unsafeGetTensorImpl()) == 0) {
        low.push_back(p);
      }
    }
    if (low.size() != low_.size()) layout(low);
  }
  if (low_.empty()) return;
  std::vector<size_t> taken;
  std::vector<std::pair<c10::Device, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>>> per_device;
  for (size_t k = 0; k < low_.size(); ++k) {
    const at::Tensor g = low_[k].grad();
    if (!g.defined()) continue;
    TORCH_CHECK(!g.is_sparse(), "GradAccumulator does not support sparse gradients.");
    taken.push_back(k);
    bool found = false;
    for (auto& [d, lists] : per_device) {
      if (d == g.device()) {
        lists.first.push_back(buffers_[k]);
        lists.second.push_back(g);
        found = true;
      }
    }
    if (!found) per_device.push_back({g.device(), {{buffers_[k]}, {g}}});
  }
  {
    const at::NoGradGuard no_grad;
    for (auto& [device, lists] : per_device) accumulate(lists.first, lists.second, found_inf_of(device));
  }
  for (size_t k : taken) {
    flags_[k] = 1;
    low_[k].mutable_grad() = at::Tensor();
  }
}

// The plan of the buffered params (one device, plain tensors), watching the other fp16/bf16
// params (a gradient on one widens the layout) and the fp32 ones' dtypes.
void AccumulatorWindow::build_plan(const std::vector<at::Tensor>& params) {
  if (low_.empty() || per_param_) return;
  const c10::Device device = low_[0].device();
  for (const auto& p : low_) {
    if (p.device() != device || p.key_set().has(c10::DispatchKey::Python)) return;
  }
  std::vector<at::Tensor> watched, free;
  for (const auto& p : params) {
    if (!is_low(p.scalar_type())) {
      free.push_back(p);
    } else if (index_.count(p.unsafeGetTensorImpl()) == 0) {
      watched.push_back(p);
    }
  }
  auto plan = c10::make_intrusive<AccumulatePlan>();
  plan->add(low_, buffers_, found_inf_of(device));
  if (!watched.empty()) plan->add_watched(std::move(watched));
  if (!free.empty()) plan->add_free(std::move(free));
  plan->finalize();
  plan->set_window_flags(std::vector<bool>(flags_.begin(), flags_.end()));
  plan_ = std::move(plan);
  ++plan_id_;
}

void AccumulatorWindow::drop_plan() {
  if (!plan_.defined()) return;
  flags_ = plan_->window_flags();
  plan_.reset();
}

bool AccumulatorWindow::plan_says_no_grads() const { return plan_.defined() && plan_->no_grads(); }

// ---- the window's end ---------------------------------------------------------------------------
void AccumulatorWindow::scale(double factor) {
  const at::NoGradGuard no_grad;
  std::vector<at::Tensor> sums;
  if (per_param_) {
    const auto flags = this->flags();
    for (size_t k = 0; k < buffers_.size(); ++k) {
      if (flags[k]) sums.push_back(buffers_[k]);
    }
  } else {
    sums = flats_;
  }
  if (!sums.empty()) at::_foreach_mul_(sums, factor);
}

void AccumulatorWindow::end(const std::optional<std::vector<at::Tensor>>& params) {
  TORCH_CHECK(params.has_value() || plan_.defined(), "AccumulatorWindow.end: params are required without a plan.");
  const at::NoGradGuard no_grad;
  for (auto& f : flats_) {
    if (f.defined()) f.zero_();
  }
  if (per_param_) {
    for (auto& b : buffers_) b.zero_();
  }
  for (auto& [d, f] : found_inf_) f.zero_();
  flags_.assign(low_.size(), 0);
  if (plan_.defined()) plan_->set_window_flags(std::vector<bool>(low_.size(), false));
  if (params.has_value()) {
    for (const auto& p : *params) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  } else {
    plan_->clear_grads();
  }
}

// ---- what the window holds ----------------------------------------------------------------------
std::vector<bool> AccumulatorWindow::flags() const {
  const std::vector<uint8_t>& f = plan_.defined() ? plan_->window_flags() : flags_;
  return std::vector<bool>(f.begin(), f.end());
}

void AccumulatorWindow::set_flags(const std::vector<bool>& flags) {
  TORCH_CHECK(flags.size() == low_.size(), "AccumulatorWindow.set_flags: expected ", low_.size(),
              " flags, got ", flags.size(), ".");
  flags_.assign(flags.begin(), flags.end());
  if (plan_.defined()) plan_->set_window_flags(flags);
}

const at::Tensor* AccumulatorWindow::window_grad(const at::Tensor& param) const {
  const auto it = index_.find(param.unsafeGetTensorImpl());
  if (it == index_.end()) return nullptr;
  static const at::Tensor none;
  const bool has = plan_.defined() ? plan_->window_flags()[it->second] != 0 : flags_[it->second] != 0;
  return has ? &buffers_[it->second] : &none;
}

c10::List<bool> AccumulatorWindow::flags_list() const {
  c10::List<bool> out;
  for (bool f : flags()) out.push_back(f);
  return out;
}

void AccumulatorWindow::set_flags_list(const c10::List<bool>& flags) {
  set_flags(std::vector<bool>(flags.begin(), flags.end()));
}

std::vector<std::string> AccumulatorWindow::device_names() const {
  std::vector<std::string> out;
  for (const auto& d : devices_) out.push_back(d.str());
  return out;
}

std::vector<at::Tensor> AccumulatorWindow::found_infs() const {
  std::vector<at::Tensor> out;
  for (const auto& d : devices_) out.push_back(found_inf(d));
  return out;
}

std::vector<int64_t> AccumulatorWindow::indices_of_buffered(const std::vector<at::Tensor>& params) const {
  std::vector<int64_t> place(low_.size(), -1);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto it = index_.find(params[i].unsafeGetTensorImpl());
    if (it != index_.end()) place[it->second] = static_cast<int64_t>(i);
  }
  for (int64_t i : place) TORCH_CHECK(i >= 0, "AccumulatorWindow: a buffered param left the optimizer.");
  return place;
}

// ---- checkpoints --------------------------------------------------------------------------------
void check_window_sums_scale(bool saved_scaled, bool scaled, const std::string& source) {
  TORCH_CHECK_VALUE(saved_scaled == scaled, source, " was saved inside a window ", saved_scaled ? "with" : "without",
                    " an enabled GradScaler, and this accumulator has ", scaled ? "one" : "none",
                    ": its partial sums are ", saved_scaled ? "" : "not ",
                    "multiplied by the loss scale. Load it into an accumulator ", saved_scaled ? "with" : "without",
                    " one, or save at a window boundary.");
}

std::vector<int64_t> check_accumulator_counters(const c10::Dict<std::string, c10::IValue>& entries, int64_t steps,
                                                const std::string& source, const std::string& naming) {
  const auto entry = [&](const char* key) { return entries.contains(key) ? entries.at(key) : c10::IValue(); };
  const auto name = [&](const char* key) { return named(naming, key); };
  const c10::IValue saved = entry("steps");
  TORCH_CHECK_VALUE(saved.isInt() && saved.toInt() == steps, source, " was saved with steps=", repr(saved),
                    ", this accumulator has steps=", steps, ".");
  const c10::IValue micro = entry("micro_step");
  TORCH_CHECK_VALUE(micro.isInt() && micro.toInt() >= 0 && micro.toInt() < steps, name("micro_step"),
                    " must be an integer in [0, ", steps, "), got ", repr(micro), ".");
  const c10::IValue windows = entry("windows");
  TORCH_CHECK_VALUE(windows.isInt() && windows.toInt() >= 0, name("windows"), " must be an integer >= 0, got ",
                    repr(windows), ".");
  const c10::IValue skipped = entry("skipped_windows_host");
  TORCH_CHECK_VALUE(skipped.isNone() || (skipped.isInt() && skipped.toInt() >= 0), name("skipped_windows_host"),
                    " must be an integer >= 0, got ", repr(skipped), ".");
  return {micro.toInt(), windows.toInt(), skipped.isNone() ? 0 : skipped.toInt()};
}

void AccumulatorWindow::check_checkpoint(const std::vector<at::Tensor>& params, const c10::IValue& buffered,
                                         const c10::Dict<std::string, c10::IValue>& buffers,
                                         const c10::Dict<std::string, c10::IValue>& found_infs,
                                         const c10::IValue& has_grad, const c10::Dict<int64_t, c10::IValue>& grads,
                                         const std::string& naming, bool device_keys) {
  pending_.reset();
  Pending p;
  // The params the saved buffers hold, in order.
  TORCH_CHECK_VALUE(!buffered.isNone(), named(naming, "buffered"),
                    " is missing: a mid-window checkpoint lists the params its buffers hold (the indices of "
                    "their parameters).");
  const auto idx = integers(buffered);
  std::unordered_set<int64_t> seen;
  bool valid = idx.has_value() && !buffered.isBoolList() &&
               !(buffered.isTensor() && buffered.toTensor().scalar_type() == at::kBool);
  for (size_t k = 0; valid && k < idx->size(); ++k) {
    const int64_t i = (*idx)[k];
    valid = i >= 0 && i < static_cast<int64_t>(params.size()) && is_low(params[i].scalar_type()) &&
            seen.insert(i).second;
    if (valid) p.low.push_back(params[i]);
  }
  TORCH_CHECK_VALUE(valid, named(naming, "buffered"),
                    " must list distinct indices of fp16/bf16 parameters of this accumulator's optimizer, got ",
                    repr(buffered), ".");
  const auto sizes = sizes_per_device(p.low);
  for (size_t d = 0; d < sizes.size(); ++d) {
    const std::string key = device_keys ? sizes[d].first.str() : std::to_string(d);
    const std::string quoted = device_keys ? "['" + key + "']" : "/" + key;
    const auto b = buffers.find(key);
    const bool b_ok = b != buffers.end() && b->value().isTensor() &&
                      b->value().toTensor().scalar_type() == at::kFloat &&
                      b->value().toTensor().sizes() == at::IntArrayRef{sizes[d].second};
    TORCH_CHECK_VALUE(b_ok, named(naming, "buffers" + quoted), " must be a float32 tensor of shape [",
                      sizes[d].second, "], got ", b == buffers.end() ? "nothing" : repr(b->value()), ".");
    const auto f = found_infs.find(key);
    const bool f_ok = f != found_infs.end() && f->value().isTensor() && f->value().toTensor().numel() == 1;
    TORCH_CHECK_VALUE(f_ok, named(naming, "found_inf" + quoted), " must be a 1-element tensor, got ",
                      f == found_infs.end() ? "nothing" : repr(f->value()), ".");
    p.flats.push_back(b->value().toTensor());
    p.found_infs.push_back(f->value().toTensor());
  }
  const auto flags = has_grad.isNone() ? std::optional<std::vector<int64_t>>(std::vector<int64_t>(p.low.size(), 0))
                                       : integers(has_grad);
  TORCH_CHECK_VALUE(flags.has_value() && flags->size() == p.low.size(), named(naming, "has_grad"),
                    " must hold one flag per buffered parameter (", p.low.size(), "), got ", repr(has_grad), ".");
  for (int64_t f : *flags) p.flags.push_back(f != 0 ? 1 : 0);
  std::unordered_set<const c10::TensorImpl*> in_low;
  for (const auto& q : p.low) in_low.insert(q.unsafeGetTensorImpl());
  for (const auto& entry : grads) {
    const int64_t i = entry.key();
    const std::string name = named(naming, device_keys ? "grads[" + std::to_string(i) + "]" : "grads/" + std::to_string(i));
    TORCH_CHECK_VALUE(i >= 0 && i < static_cast<int64_t>(params.size()) &&
                          in_low.count(params[i].unsafeGetTensorImpl()) == 0,
                      name, " does not name an unbuffered parameter of this accumulator's optimizer.");
    TORCH_CHECK_VALUE(entry.value().isTensor() && entry.value().toTensor().sizes() == params[i].sizes(), name,
                      " must be a tensor of shape ", params[i].sizes(), ", got ", repr(entry.value()), ".");
    p.grads.emplace(params[i].unsafeGetTensorImpl(), entry.value().toTensor());
  }
  pending_ = std::move(p);
}

void AccumulatorWindow::load(const std::vector<at::Tensor>& params, bool mid_window) {
  Pending p;
  if (mid_window) {
    TORCH_CHECK(pending_.has_value(), "AccumulatorWindow.load: no checked checkpoint to load.");
    p = std::move(*pending_);
  } else {
    p.low = wanted(params);
  }
  pending_.reset();
  drop_plan();
  layout(p.low);
  const at::NoGradGuard no_grad;
  for (auto& [d, f] : found_inf_) f.zero_();
  for (size_t d = 0; d < flats_.size(); ++d) {
    if (per_param_) continue;
    if (d < p.flats.size()) {
      flats_[d].copy_(p.flats[d]);
      found_inf_of(devices_[d]).copy_(p.found_infs[d].reshape({}));
    } else {
      flats_[d].zero_();
    }
  }
  if (per_param_) {
    for (auto& b : buffers_) b.zero_();
  }
  flags_ = p.flags.empty() ? std::vector<uint8_t>(low_.size(), 0) : p.flags;
  for (const auto& q : params) {
    if (index_.count(q.unsafeGetTensorImpl()) != 0) continue;
    const auto it = p.grads.find(q.unsafeGetTensorImpl());
    q.mutable_grad() = it != p.grads.end() ? it->second.to(q.device(), q.scalar_type()).clone() : at::Tensor();
  }
}

}  // namespace ampfuse::engine
