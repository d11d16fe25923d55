// The C++ half of the cross-language cases (tests/test_cpp_crosslang.py runs each case through
// the Python API too and requires the same bits and the same messages, apart from how each
// surface names a param and a checkpoint). Writes a dict of tensors, strings and flags with
// torch::pickle_save; inputs the Python side needs are written under "in/".
//
// The cases: exact-tie fp32 masters through master-form switches and through checkpoints of the
// other form; master_weights switched off and on again; a checkpoint loaded into an optimizer
// with other precision options; the step's gradient checks across groups; bad scaler checkpoint
// entries, alone and inside an accumulator checkpoint; bad partial-sum entries of a mid-window
// accumulator checkpoint; bad state entries of an optimizer checkpoint.
//
// Usage: ampfuse_crosslang_cases OUTPUT_FILE
#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

#include "ampfuse/ampfuse.h"

namespace {

using ampfuse::optim::AdamW;
using ampfuse::optim::AdamWOptions;
using ampfuse::optim::SGD;
using ampfuse::optim::SGDOptions;
using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());

void put(const std::string& key, c10::IValue v) { out.insert_or_assign(key, std::move(v)); }

// The message of what `fn` throws ("" when it throws nothing).
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

template <class Opt>
typename Opt::State& state_of(Opt& opt, const at::Tensor& p) {
  return static_cast<typename Opt::State&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

template <class Options>
Options& options_of(torch::optim::Optimizer& opt, size_t group) {
  return static_cast<Options&>(opt.param_groups()[group].options());
}

template <class State>
at::Tensor master_of(const State& s, const at::Tensor& p) {
  return s.master_remainder().defined() ? ampfuse::optim::join_master(p.detach(), s.master_remainder())
                                        : s.master_param().clone();
}

template <class Opt>
void zero_step(Opt& opt, const at::Tensor& p) {
  p.mutable_grad() = at::zeros_like(p);
  opt.step();
}

std::stringstream saved(const std::function<void(OutputArchive&)>& write) {
  OutputArchive archive;
  write(archive);
  std::stringstream buf;
  archive.save_to(buf);
  return buf;
}

void write_scaler_entries(OutputArchive& a, const std::string& key, const c10::IValue& value) {
  auto entry = [&](const char* name, c10::IValue v) { a.write(name, name == key ? value : v); };
  entry("scale", c10::IValue(1024.0));
  entry("growth_factor", c10::IValue(2.0));
  entry("backoff_factor", c10::IValue(0.5));
  entry("growth_interval", c10::IValue(int64_t{100}));
  entry("_growth_tracker", c10::IValue(int64_t{0}));
}

// Bad scaler checkpoint entries, one at a time: the message, and whether the scaler stayed as it was.
void bad_scaler_entries() {
  const std::vector<std::pair<std::string, c10::IValue>> cases = {
      {"backoff_factor", c10::IValue(0.0)}, {"backoff_factor", c10::IValue(-0.5)},
      {"backoff_factor", c10::IValue(std::nan(""))}, {"scale", c10::IValue(std::string("x"))},
      {"growth_interval", c10::IValue(2.5)}, {"scale", c10::IValue(-1.0)},
  };
  for (size_t k = 0; k < cases.size(); ++k) {
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0).growth_interval(7));
    auto buf = saved([&](OutputArchive& a) { write_scaler_entries(a, cases[k].first, cases[k].second); });
    InputArchive in;
    in.load_from(buf);
    put("scaler/" + std::to_string(k) + "/message", message_of([&] { scaler.load(in); }));
    put("scaler/" + std::to_string(k) + "/unchanged",
        scaler.get_scale() == 8.0 && scaler.get_growth_interval() == 7 && scaler.get_backoff_factor() == 0.5);
  }
}

void ties() {
  // fp32 masters that are exact ties between two bf16 values (both signs, even and odd upper
  // halves), and three that are not.
  const at::Tensor masters =
      at::tensor(std::vector<int32_t>{0x3f808000, 0x3f818000, static_cast<int32_t>(0xbf808000),
                                      static_cast<int32_t>(0xbf818000), 0x40008000, 0x3f801234,
                                      0x3f80c000, 0x3c008000})
          .view(at::kFloat);
  put("in/ties", masters.clone());
  at::Tensor p = masters.to(at::kBFloat16).set_requires_grad(true);
  SGD opt(std::vector<at::Tensor>{p}, SGDOptions(0.0));
  zero_step(opt, p);
  state_of(opt, p).master_param().copy_(masters);
  options_of<SGDOptions>(opt, 0).master_remainders(true);
  zero_step(opt, p);
  put("ties/remainder/param", p.detach().clone());
  put("ties/remainder/master", master_of(state_of(opt, p), p));
  options_of<SGDOptions>(opt, 0).master_remainders(false);
  zero_step(opt, p);
  put("ties/back/param", p.detach().clone());
  put("ties/back/master", master_of(state_of(opt, p), p));

  // A remainder form's checkpoint loaded by an fp32-master optimizer, and the reverse.
  for (bool from_remainder : {true, false}) {
    const std::string key = from_remainder ? "ties/load_into_fp32" : "ties/load_into_remainder";
    options_of<SGDOptions>(opt, 0).master_remainders(from_remainder);
    zero_step(opt, p);
    auto buf = saved([&](OutputArchive& a) { opt.save(a); });
    at::Tensor q = p.detach().clone().set_requires_grad(true);
    SGD other(std::vector<at::Tensor>{q}, SGDOptions(0.0).master_remainders(!from_remainder));
    InputArchive in;
    in.load_from(buf);
    other.load(in);
    zero_step(other, q);
    put(key + "/param", q.detach().clone());
    put(key + "/master", master_of(state_of(other, q), q));
  }
}

void master_weights_off_and_on() {
  at::manual_seed(1);
  at::Tensor p = (at::randn({16}) * 0.5).to(at::kBFloat16).set_requires_grad(true);
  put("in/off_on/init", p.detach().clone());
  AdamW opt(std::vector<at::Tensor>{p}, AdamWOptions(1e-2).master_remainders(true));
  for (int k = 0; k < 5; ++k) {
    if (k == 2) options_of<AdamWOptions>(opt, 0).master_weights(false);
    if (k == 4) options_of<AdamWOptions>(opt, 0).master_weights(true);
    const at::Tensor g = at::randn({16}).to(at::kBFloat16);
    put("in/off_on/grad/" + std::to_string(k), g);
    p.mutable_grad() = g.clone();
    opt.step();
  }
  auto& s = state_of(opt, p);
  put("off_on/param", p.detach().clone());
  put("off_on/master", ampfuse::optim::join_master(p.detach(), s.master_remainder()));
  put("off_on/exp_avg", s.exp_avg().clone());
}

void load_keeps_own_options() {
  at::manual_seed(2);
  at::Tensor a = (at::randn({16}) * 0.5).to(at::kBFloat16).set_requires_grad(true);
  put("in/own/init", a.detach().clone());
  AdamW without(std::vector<at::Tensor>{a}, AdamWOptions(0.05).master_weights(false).state_dtype(at::kBFloat16));
  for (int k = 0; k < 2; ++k) {
    const at::Tensor g = at::randn({16}).to(at::kBFloat16);
    put("in/own/grad/" + std::to_string(k), g);
    a.mutable_grad() = g.clone();
    without.step();
  }
  auto buf = saved([&](OutputArchive& ar) { without.save(ar); });
  at::Tensor b = a.detach().clone().set_requires_grad(true);
  AdamW with(std::vector<at::Tensor>{b}, AdamWOptions(1e-3));
  InputArchive in;
  in.load_from(buf);
  with.load(in);
  const at::Tensor g = at::randn({16}).to(at::kBFloat16);
  put("in/own/grad/2", g);
  b.mutable_grad() = g.clone();
  with.step();
  const auto& o = options_of<AdamWOptions>(with, 0);
  auto& s = state_of(with, b);
  put("own/keeps_master", s.master_param().defined());
  put("own/fp32_state", o.state_dtype() == at::kFloat);
  put("own/lr", o.lr());
  put("own/param", b.detach().clone());
  put("own/master", s.master_param().clone());
  put("own/exp_avg", s.exp_avg().clone());
}

void grad_checks_across_groups() {
  for (int k = 0; k < 2; ++k) {
    at::Tensor p0 = at::ones({4}).to(at::kBFloat16).set_requires_grad(true);
    at::Tensor p1 = at::ones({3}).to(at::kBFloat16).set_requires_grad(true);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{p0});
    groups.emplace_back(std::vector<at::Tensor>{p1});
    AdamW opt(groups, AdamWOptions(0.1));
    p0.mutable_grad() = at::ones({4}).to(at::kBFloat16);
    p1.mutable_grad() = k == 0 ? at::ones({3}).to(at::kHalf) : p1.detach();
    const at::Tensor before = p0.detach().clone();
    put("grads/" + std::to_string(k) + "/message", message_of([&] { opt.step(); }));
    put("grads/" + std::to_string(k) + "/unchanged", same_bits(p0.detach(), before) && opt.state().empty());
  }
}

// An accumulator checkpoint whose scaler entry is bad: refused before the optimizer is loaded.
void accumulator_load_checks_the_scaler_first() {
  const std::vector<c10::IValue> bad = {c10::IValue(-1.0), c10::IValue(std::nan("")),
                                        c10::IValue(std::numeric_limits<double>::infinity()),
                                        c10::IValue(std::string("x"))};
  for (size_t k = 0; k < bad.size(); ++k) {
    at::Tensor a = at::ones({4}).to(at::kBFloat16).set_requires_grad(true);
    AdamW source(std::vector<at::Tensor>{a}, AdamWOptions(0.05));
    for (int s = 0; s < 3; ++s) zero_step(source, a);
    auto buf = saved([&](OutputArchive& ar) {
      ar.write("steps", c10::IValue(int64_t{2}));
      ar.write("micro_step", c10::IValue(int64_t{0}));
      ar.write("windows", c10::IValue(int64_t{3}));
      OutputArchive opt_archive(ar.compilation_unit());
      source.save(opt_archive);
      ar.write("optimizer", opt_archive);
      OutputArchive scaler_archive(ar.compilation_unit());
      write_scaler_entries(scaler_archive, "scale", bad[k]);
      ar.write("scaler", scaler_archive);
    });
    at::Tensor b = at::full({4}, 2.0).to(at::kBFloat16).set_requires_grad(true);
    AdamW target(std::vector<at::Tensor>{b}, AdamWOptions(0.01));
    zero_step(target, b);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0));
    ampfuse::GradAccumulator acc(target, &scaler, ampfuse::GradAccumulatorOptions(2));
    const at::Tensor master = state_of(target, b).master_param().clone();
    InputArchive in;
    in.load_from(buf);
    put("acc/" + std::to_string(k) + "/message", message_of([&] { acc.load(in); }));
    const auto& s = state_of(target, b);
    put("acc/" + std::to_string(k) + "/unchanged",
        options_of<AdamWOptions>(target, 0).lr() == 0.01 && s.step().item<float>() == 1.0f &&
            same_bits(s.master_param(), master) && scaler.get_scale() == 8.0);
  }
}

// A mid-window accumulator checkpoint with one bad entry: refused, naming the entry, with nothing
// changed. Case k spoils entry k (none: the good checkpoint, which loads).
void accumulator_checkpoint_entries() {
  for (int k = 0; k < 7; ++k) {
    at::Tensor a = at::ones({4}).to(at::kBFloat16).set_requires_grad(true);
    at::Tensor b = at::ones({3}).set_requires_grad(true);
    AdamW source(std::vector<at::Tensor>{a, b}, AdamWOptions(0.05));
    auto buf = saved([&](OutputArchive& ar) {
      ar.write("steps", c10::IValue(int64_t{2}));
      ar.write("micro_step", c10::IValue(int64_t{1}));
      ar.write("windows", c10::IValue(int64_t{0}));
      OutputArchive opt_archive(ar.compilation_unit());
      source.save(opt_archive);
      ar.write("optimizer", opt_archive);
      if (k != 0) ar.write("buffered", at::tensor(std::vector<int64_t>{k == 1 ? 1 : 0}));
      ar.write("buffers/0", k == 2 ? at::zeros({3}) : at::full({4}, 0.5));
      ar.write("found_inf/0", k == 3 ? at::zeros({2}) : at::zeros({}));
      ar.write("has_grad", at::tensor(k == 4 ? std::vector<int64_t>{1, 0} : std::vector<int64_t>{1}));
      ar.write("grads/1", k == 5 ? at::zeros({2}) : at::full({3}, 0.25));
    });
    at::Tensor c = at::ones({4}).to(at::kBFloat16).set_requires_grad(true);
    at::Tensor d = at::ones({3}).set_requires_grad(true);
    AdamW target(std::vector<at::Tensor>{c, d}, AdamWOptions(0.01));
    ampfuse::GradAccumulator acc(target, nullptr, ampfuse::GradAccumulatorOptions(2));
    InputArchive in;
    in.load_from(buf);
    const std::string key = "acc_checkpoint/" + std::to_string(k);
    put(key + "/message", message_of([&] { acc.load(in); }));
    if (k == 6) {
      put(key + "/loaded", acc.micro_step() == 1 && options_of<AdamWOptions>(target, 0).lr() == 0.05);
      put(key + "/grad", d.grad().clone());
    } else {
      put(key + "/unchanged", acc.micro_step() == 0 && options_of<AdamWOptions>(target, 0).lr() == 0.01 &&
                                  !d.grad().defined());
    }
  }
}

// A GradAccumulator checkpoint with one bad counter (case k; 0: a good one, at a window boundary):
// refused with the entry named, nothing loaded.
const std::vector<std::pair<std::string, c10::IValue>> kBadCounters = {
    {"", c10::IValue()},
    {"steps", c10::IValue(int64_t{5})},
    {"micro_step", c10::IValue(int64_t{2})},
    {"micro_step", c10::IValue(-1.5)},
    {"windows", c10::IValue(int64_t{-3})},
    {"skipped_windows_host", c10::IValue(int64_t{-1})},
};

void accumulator_counter_entries() {
  for (size_t k = 0; k < kBadCounters.size(); ++k) {
    at::Tensor a = at::ones({3}).set_requires_grad(true);
    AdamW source(std::vector<at::Tensor>{a}, AdamWOptions(0.05));
    const auto& [bad_key, bad_value] = kBadCounters[k];
    auto buf = saved([&](OutputArchive& ar) {
      for (const auto& [key, good] : std::vector<std::pair<std::string, c10::IValue>>{
               {"steps", c10::IValue(int64_t{2})}, {"micro_step", c10::IValue(int64_t{0})},
               {"windows", c10::IValue(int64_t{4})}, {"skipped_windows_host", c10::IValue(int64_t{1})}}) {
        ar.write(key, key == bad_key ? bad_value : good);
      }
      OutputArchive opt_archive(ar.compilation_unit());
      source.save(opt_archive);
      ar.write("optimizer", opt_archive);
    });
    at::Tensor b = at::ones({3}).set_requires_grad(true);
    AdamW target(std::vector<at::Tensor>{b}, AdamWOptions(0.01));
    ampfuse::GradAccumulator acc(target, nullptr, ampfuse::GradAccumulatorOptions(2));
    InputArchive in;
    in.load_from(buf);
    const std::string key = "acc_counters/" + std::to_string(k);
    const std::string message = message_of([&] { acc.load(in); });
    if (k == 0) {
      put(key + "/loaded", message.empty() && acc.windows() == 4 && acc.skipped_windows_host() == 1 &&
                               options_of<AdamWOptions>(target, 0).lr() == 0.05);
    } else {
      put(key + "/message", message);
      put(key + "/unchanged", acc.windows() == 0 && options_of<AdamWOptions>(target, 0).lr() == 0.01);
    }
  }
}

// An optimizer checkpoint written entry by entry in torch's layout: one group (lr 0.05) whose
// params are keyed "1", "2", ... with states[i] the entries of param i.
using StateEntries = std::vector<std::pair<std::string, c10::IValue>>;
std::stringstream optimizer_checkpoint(const std::vector<StateEntries>& states) {
  return saved([&](OutputArchive& ar) {
    ar.write("pytorch_version", c10::IValue("1.5.0"));
    OutputArchive state(ar.compilation_unit());
    for (size_t i = 0; i < states.size(); ++i) {
      OutputArchive entries(ar.compilation_unit());
      for (const auto& [key, v] : states[i]) entries.write(key, v);
      state.write(std::to_string(i + 1), entries);
    }
    ar.write("state", state);
    OutputArchive group(ar.compilation_unit());
    group.write("params/size", at::tensor(static_cast<int64_t>(states.size())));
    for (size_t i = 0; i < states.size(); ++i) group.write("params/" + std::to_string(i), c10::IValue(std::to_string(i + 1)));
    OutputArchive options(ar.compilation_unit());
    options.write("lr", c10::IValue(0.05));
    group.write("options", options);
    OutputArchive groups(ar.compilation_unit());
    groups.write("param_groups/size", at::tensor(int64_t{1}));
    groups.write("param_groups/0", group);
    ar.write("param_groups", groups);
  });
}

// A group's bad hyper-parameter: refused with the option named (C++: "AdamW: betas[0]", Python:
// "param_groups[0]['betas'][0]") and the value as Python prints it.
void group_hyper_entries() {
  const at::Tensor p = at::ones({3}).set_requires_grad(true);
  const std::vector<at::Tensor> params{p};
  const std::vector<std::pair<std::string, std::function<void()>>> cases = {
      {"sgd_lr", [&] { SGD o(params, SGDOptions(-1.0)); }},
      {"sgd_momentum", [&] { SGD o(params, SGDOptions(0.1).momentum(-0.5)); }},
      {"sgd_weight_decay", [&] { SGD o(params, SGDOptions(0.1).weight_decay(-1.0)); }},
      {"sgd_nesterov", [&] { SGD o(params, SGDOptions(0.1).nesterov(true)); }},
      {"adam_beta1", [&] { ampfuse::optim::Adam o(params, ampfuse::optim::AdamOptions(0.1).betas({1.0, 0.9})); }},
      {"adam_beta2", [&] { ampfuse::optim::Adam o(params, ampfuse::optim::AdamOptions(0.1).betas({0.9, -0.1})); }},
      {"adamw_eps", [&] { AdamW o(params, AdamWOptions(0.1).eps(-1.0)); }},
      {"adamw_weight_decay", [&] { AdamW o(params, AdamWOptions(0.1).weight_decay(-0.01)); }},
      {"adamw_state_dtype", [&] { AdamW o(params, AdamWOptions(0.1).state_dtype(at::kHalf)); }},
  };
  for (const auto& [name, make] : cases) put("group_hyper/" + name, message_of(make));
}

// An optimizer checkpoint with one bad state entry: refused, naming the param and the entry,
// with nothing changed. Case k spoils entry k (none: the good checkpoint; 6: a step saved as a
// number, which loads). A torch SGD checkpoint has no step: a momentum buffer counts one.
void optimizer_checkpoint_entries() {
  for (int k = 0; k < 7; ++k) {
    const auto bad = [&](int which, c10::IValue good, c10::IValue spoiled) { return k == which ? spoiled : good; };
    const StateEntries a_state = {
        {"step", bad(3, at::full({}, 3.0), at::zeros({2}))},
        {"exp_avg", bad(1, at::full({4}, 0.5), at::zeros({3, 3}))},
        {"exp_avg_sq", at::full({4}, 0.25)},
        {"master_param", bad(5, at::full({4}, 1.5), at::zeros({2}))},
    };
    StateEntries b_state = {
        {"step", bad(6, at::full({}, 3.0), c10::IValue(2.0))},
        {"exp_avg", at::full({3}, 0.5)},
        {"exp_avg_sq", bad(2, at::full({3}, 0.25), at::zeros({3}, at::kLong))},
    };
    StateEntries a_entries = a_state;
    if (k == 4) a_entries.emplace_back("master_remainder", at::zeros({4}, at::kShort));
    auto buf = optimizer_checkpoint({a_entries, b_state});
    at::Tensor a = at::ones({4}).to(at::kBFloat16).set_requires_grad(true);
    at::Tensor b = at::ones({3}).set_requires_grad(true);
    AdamW target(std::vector<at::Tensor>{a, b}, AdamWOptions(0.01));
    a.mutable_grad() = at::zeros_like(a);
    b.mutable_grad() = at::zeros_like(b);
    target.step();
    InputArchive in;
    in.load_from(buf);
    const std::string key = "opt_checkpoint/" + std::to_string(k);
    put(key + "/message", message_of([&] { target.load(in); }));
    auto& sa = state_of(target, a);
    auto& sb = state_of(target, b);
    if (k == 0 || k == 6) {
      put(key + "/loaded", options_of<AdamWOptions>(target, 0).lr() == 0.05);
      put(key + "/a_exp_avg", sa.exp_avg().clone());
      put(key + "/a_master", sa.master_param().clone());
      put(key + "/b_step", sb.step().clone());
    } else {
      put(key + "/unchanged", options_of<AdamWOptions>(target, 0).lr() == 0.01 && sa.step().item<float>() == 1.0f &&
                                  sb.exp_avg_sq().scalar_type() == at::kFloat);
    }
  }
  auto buf = optimizer_checkpoint({{{"momentum_buffer", at::full({4}, 0.5)}}});
  at::Tensor a = at::ones({4}).set_requires_grad(true);
  SGD sgd(std::vector<at::Tensor>{a}, SGDOptions(0.01).momentum(0.9));
  InputArchive in;
  in.load_from(buf);
  sgd.load(in);
  put("opt_checkpoint/sgd_step", state_of(sgd, a).step().clone());
}

// A param that does not step while the options change still has its state converted to them.
void idle_param_state_follows_options() {
  at::manual_seed(3);
  at::Tensor a = (at::randn({16}) * 0.5).to(at::kBFloat16).set_requires_grad(true);
  at::Tensor b = (at::randn({16}) * 0.5).to(at::kBFloat16).set_requires_grad(true);
  put("in/idle/a", a.detach().clone());
  put("in/idle/b", b.detach().clone());
  AdamW opt(std::vector<at::Tensor>{a, b}, AdamWOptions(1e-2));
  for (int k = 0; k < 3; ++k) {
    const at::Tensor ga = at::randn({16}).to(at::kBFloat16);
    put("in/idle/grad_a/" + std::to_string(k), ga);
    a.mutable_grad() = ga.clone();
    if (k < 2) {
      const at::Tensor gb = at::randn({16}).to(at::kBFloat16);
      put("in/idle/grad_b/" + std::to_string(k), gb);
      b.mutable_grad() = gb.clone();
    } else {
      b.mutable_grad() = at::Tensor();
      options_of<AdamWOptions>(opt, 0).state_dtype(at::kBFloat16).master_remainders(true);
    }
    opt.step();
  }
  auto& s = state_of(opt, b);
  put("idle/b_exp_avg", s.exp_avg().clone());
  put("idle/b_remainder_form", s.master_remainder().defined());
  put("idle/b_master", s.master_remainder().defined() ? ampfuse::optim::join_master(b.detach(), s.master_remainder())
                                                      : s.master_param().clone());
}


// A param replaced between steps (set_data, as torch::load(module, ...) does) restarts its whole
// master from the new value, in both master forms.
void replaced_param_restarts_master() {
  for (const bool remainder : {false, true}) {
    const std::string key = remainder ? "replaced/remainder" : "replaced/float";
    at::manual_seed(5);
    at::Tensor p = at::randn({64}).to(at::kBFloat16).set_requires_grad(true);
    put("in/" + key + "/init", p.detach().clone());
    AdamW opt(std::vector<at::Tensor>{p}, AdamWOptions(1e-2).master_remainders(remainder));
    for (int k = 0; k < 3; ++k) {
      const at::Tensor g = at::randn({64}).to(at::kBFloat16);
      put("in/" + key + "/grad/" + std::to_string(k), g);
      p.mutable_grad() = g.clone();
      opt.step();
    }
    p.set_data(p.detach().clone());  // the same values, other memory
    const at::Tensor g = at::randn({64}).to(at::kBFloat16);
    put("in/" + key + "/grad/3", g);
    p.mutable_grad() = g.clone();
    opt.step();
    put(key + "/param", p.detach().clone());
    put(key + "/master", master_of(state_of(opt, p), p));
  }
}

// Two optimizers stepping one bf16 param in turn, each with a master: the step of the one the
// param was taken from is refused (nothing changes) until its sync_masters_from_params().
void two_keepers_of_one_master() {
  at::manual_seed(6);
  at::Tensor shared = at::randn({4, 4}).to(at::kBFloat16).set_requires_grad(true);
  at::Tensor own = at::randn({3}).to(at::kBFloat16).set_requires_grad(true);
  put("in/keepers/shared", shared.detach().clone());
  put("in/keepers/own", own.detach().clone());
  AdamW first(std::vector<at::Tensor>{own, shared}, AdamWOptions(1e-3));
  SGD second(std::vector<at::Tensor>{shared}, SGDOptions(1e-3).momentum(0.9));
  const at::Tensor gs = at::randn({4, 4}).to(at::kBFloat16), go = at::randn({3}).to(at::kBFloat16);
  put("in/keepers/grad_shared", gs);
  put("in/keepers/grad_own", go);
  shared.mutable_grad() = gs.clone();
  own.mutable_grad() = go.clone();
  first.step();
  first.step();
  second.step();
  const at::Tensor before = shared.detach().clone(), master = state_of(first, shared).master_param().clone();
  put("keepers/message", message_of([&] { first.step(); }));
  put("keepers/unchanged", same_bits(shared.detach(), before) &&
                               same_bits(state_of(first, shared).master_param(), master));
  second.step();
  first.sync_masters_from_params();
  first.step();
  put("keepers/back_message", message_of([&] { second.step(); }));
  put("keepers/shared", shared.detach().clone());
  put("keepers/master", state_of(first, shared).master_param().clone());
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_FILE\n", argv[0]);
    return 2;
  }
  // A case that throws is recorded as such (the Python side fails that case alone).
  const std::vector<std::pair<const char*, void (*)()>> cases = {
      {"ties", ties},
      {"master_weights_off_and_on", master_weights_off_and_on},
      {"load_keeps_own_options", load_keeps_own_options},
      {"grad_checks_across_groups", grad_checks_across_groups},
      {"bad_scaler_entries", bad_scaler_entries},
      {"accumulator_load_checks_the_scaler_first", accumulator_load_checks_the_scaler_first},
      {"idle_param_state_follows_options", idle_param_state_follows_options},
      {"accumulator_checkpoint_entries", accumulator_checkpoint_entries},
      {"optimizer_checkpoint_entries", optimizer_checkpoint_entries},
      {"group_hyper_entries", group_hyper_entries},
      {"accumulator_counter_entries", accumulator_counter_entries},
      {"replaced_param_restarts_master", replaced_param_restarts_master},
      {"two_keepers_of_one_master", two_keepers_of_one_master},
  };
  for (const auto& [name, run] : cases) put(std::string("error/") + name, message_of(run));
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(out));
  std::ofstream file(argv[1], std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) {
    std::fprintf(stderr, "could not write %s\n", argv[1]);
    return 1;
  }
  return 0;
}
