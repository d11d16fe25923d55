// ampfuse::optim::SGD / Adam / AdamW against torch::optim (fp32 params), master weights for
// fp16/bf16 params, skipped steps, param groups, checkpoints and bad input.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/serialize.h>

#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string>

#include "ampfuse/optim.h"
#include "test_utils.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::throws_with;

const std::vector<std::vector<int64_t>> kShapes = {{257}, {5, 7}, {1}, {3, 1, 4}};

std::vector<at::Tensor> make_params(at::ScalarType dtype, uint64_t seed = 0) {
  at::manual_seed(seed);
  std::vector<at::Tensor> params;
  for (const auto& s : kShapes) params.push_back(at::randn(s).to(dtype).set_requires_grad(true));
  return params;
}

std::vector<at::Tensor> copy_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// Deterministic gradients for step `step` in `dtype`.
std::vector<at::Tensor> grads_for(int step, at::ScalarType dtype) {
  at::manual_seed(1000 + step);
  std::vector<at::Tensor> grads;
  for (const auto& s : kShapes) grads.push_back(at::randn(s).to(dtype));
  return grads;
}

void set_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double rtol, double atol,
                  const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const auto diff = (a.to(at::kDouble) - b.to(at::kDouble)).abs();
  const auto bound = atol + rtol * b.to(at::kDouble).abs();
  EXPECT_TRUE((diff <= bound).all().item<bool>())
      << what << ": max abs diff " << diff.max().item<double>();
}

// ---- parity with torch::optim for fp32 params -------------------------------------------------
struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(Optim, SgdMatchesTorchBitwise) {
  for (const auto& c : std::vector<SgdCase>{{0, 0, 0, false}, {0.9, 0.1, 1e-2, false},
                                           {0.9, 0, 1e-2, true}, {0, 0, 0.1, false}}) {
    auto ours_p = make_params(at::kFloat);
    auto ref_p = copy_params(ours_p);
    ampfuse::optim::SGD ours(ours_p, ampfuse::optim::SGDOptions(0.05)
                                          .momentum(c.momentum)
                                          .dampening(c.dampening)
                                          .weight_decay(c.weight_decay)
                                          .nesterov(c.nesterov));
    torch::optim::SGD ref(ref_p, torch::optim::SGDOptions(0.05)
                                     .momentum(c.momentum)
                                     .dampening(c.dampening)
                                     .weight_decay(c.weight_decay)
                                     .nesterov(c.nesterov));
    for (int step = 0; step < 25; ++step) {
      auto g = grads_for(step, at::kFloat);
      set_grads(ours_p, g);
      set_grads(ref_p, g);
      ours.step();
      ref.step();
      for (size_t i = 0; i < ours_p.size(); ++i) {
        ASSERT_TRUE(bitwise_equal(ours_p[i], ref_p[i])) << "momentum " << c.momentum << " step "
                                                        << step << " param " << i;
      }
    }
    if (c.momentum != 0) {
      for (size_t i = 0; i < ours_p.size(); ++i) {
        auto& s = static_cast<ampfuse::optim::SGDParamState&>(
            *ours.state().at(ours_p[i].unsafeGetTensorImpl()));
        auto& r = static_cast<torch::optim::SGDParamState&>(
            *ref.state().at(ref_p[i].unsafeGetTensorImpl()));
        EXPECT_TRUE(bitwise_equal(s.momentum_buffer(), r.momentum_buffer()));
        EXPECT_EQ(s.step().item<float>(), 25.0f);
      }
    }
  }
}

template <typename Ours, typename OursOptions, typename Ref, typename RefOptions>
void adam_parity(double weight_decay, bool amsgrad) {
  auto ours_p = make_params(at::kFloat);
  auto ref_p = copy_params(ours_p);
  Ours ours(ours_p, OursOptions(1e-2)
                        .betas(std::make_tuple(0.8, 0.99))
                        .eps(1e-7)
                        .weight_decay(weight_decay)
                        .amsgrad(amsgrad));
  Ref ref(ref_p, RefOptions(1e-2)
                     .betas(std::make_tuple(0.8, 0.99))
                     .eps(1e-7)
                     .weight_decay(weight_decay)
                     .amsgrad(amsgrad));
  for (int step = 0; step < 50; ++step) {
    auto g = grads_for(step, at::kFloat);
    set_grads(ours_p, g);
    set_grads(ref_p, g);
    ours.step();
    ref.step();
  }
  // torch's CPU sqrt is not correctly rounded: rtol 1e-6, atol 2e-7 (as the Python suite).
  for (size_t i = 0; i < ours_p.size(); ++i) {
    expect_close(ours_p[i], ref_p[i], 1e-6, 2e-7, "param " + std::to_string(i));
    auto& s = static_cast<ampfuse::optim::AdamParamState&>(
        *ours.state().at(ours_p[i].unsafeGetTensorImpl()));
    EXPECT_EQ(s.step().item<float>(), 50.0f);
    EXPECT_EQ(s.step().dim(), 0);
    EXPECT_EQ(s.exp_avg().scalar_type(), at::kFloat);
    EXPECT_EQ(s.max_exp_avg_sq().defined(), amsgrad);
  }
}

TEST(Optim, AdamMatchesTorch) {
  adam_parity<ampfuse::optim::Adam, ampfuse::optim::AdamOptions, torch::optim::Adam,
              torch::optim::AdamOptions>(0.0, false);
  adam_parity<ampfuse::optim::Adam, ampfuse::optim::AdamOptions, torch::optim::Adam,
              torch::optim::AdamOptions>(0.05, true);
}

TEST(Optim, AdamWMatchesTorch) {
  adam_parity<ampfuse::optim::AdamW, ampfuse::optim::AdamWOptions, torch::optim::AdamW,
              torch::optim::AdamWOptions>(1e-2, false);
  adam_parity<ampfuse::optim::AdamW, ampfuse::optim::AdamWOptions, torch::optim::AdamW,
              torch::optim::AdamWOptions>(0.1, true);
}

TEST(Optim, DefaultsMirrorTorch) {
  EXPECT_EQ(ampfuse::optim::AdamWOptions().weight_decay(),
            torch::optim::AdamWOptions().weight_decay());
  EXPECT_EQ(ampfuse::optim::AdamOptions().weight_decay(),
            torch::optim::AdamOptions().weight_decay());
  EXPECT_EQ(ampfuse::optim::AdamOptions().betas(), torch::optim::AdamOptions().betas());
  EXPECT_EQ(ampfuse::optim::AdamOptions().eps(), torch::optim::AdamOptions().eps());
  EXPECT_EQ(ampfuse::optim::SGDOptions().lr(), 1e-3);
  EXPECT_TRUE(ampfuse::optim::SGDOptions().master_weights());
  EXPECT_FALSE(ampfuse::optim::AdamWOptions().maximize());
}

TEST(Optim, ChainedOptionSettersKeepTheOptionsType) {
  // Adam's and AdamW's options share one declaration; a chain of setters still gives the
  // optimizer's own options type (each starting from its own defaults).
  const ampfuse::optim::AdamWOptions w = ampfuse::optim::AdamWOptions(0.5).eps(1e-6).amsgrad(true);
  const ampfuse::optim::AdamOptions a = ampfuse::optim::AdamOptions(0.5).eps(1e-6).amsgrad(true);
  EXPECT_EQ(w.lr(), 0.5);
  EXPECT_EQ(w.eps(), 1e-6);
  EXPECT_TRUE(w.amsgrad());
  EXPECT_EQ(w.weight_decay(), 1e-2);
  EXPECT_EQ(a.weight_decay(), 0.0);
  EXPECT_FALSE(a == ampfuse::optim::AdamOptions(0.5));
  EXPECT_TRUE(a == ampfuse::optim::AdamOptions(0.5).eps(1e-6).amsgrad(true));
  // a group built with them keeps them (the optimizer clones its options by their own type)
  auto p = at::zeros({2}).set_requires_grad(true);
  ampfuse::optim::AdamW opt({p}, w);
  const auto& kept = static_cast<const ampfuse::optim::AdamWOptions&>(opt.param_groups()[0].options());
  EXPECT_TRUE(kept == w);
  EXPECT_EQ(kept.get_lr(), 0.5);
}

// ---- master weights -------------------------------------------------------------------------------
// A low-precision run keeps fp32 masters that follow exactly the fp32 run fed the same (widened)
// gradients, and its params are the masters rounded to nearest.
template <typename Opt, typename Options>
void masters_follow_fp32(at::ScalarType dtype, Options options) {
  auto low_p = make_params(dtype);
  std::vector<at::Tensor> f32_p;
  for (const auto& p : low_p) f32_p.push_back(p.detach().to(at::kFloat).set_requires_grad(true));
  Opt low(low_p, options);
  Opt f32(f32_p, options);
  for (int step = 0; step < 10; ++step) {
    auto g = grads_for(step, dtype);
    set_grads(low_p, g);
    std::vector<at::Tensor> g32;
    for (const auto& t : g) g32.push_back(t.to(at::kFloat));
    set_grads(f32_p, g32);
    low.step();
    f32.step();
  }
  for (size_t i = 0; i < low_p.size(); ++i) {
    const auto& state = *low.state().at(low_p[i].unsafeGetTensorImpl());
    at::Tensor master;
    if constexpr (std::is_same_v<Opt, ampfuse::optim::SGD>) {
      master = static_cast<const ampfuse::optim::SGDParamState&>(state).master_param();
    } else {
      master = static_cast<const ampfuse::optim::AdamParamState&>(state).master_param();
    }
    ASSERT_TRUE(master.defined());
    EXPECT_EQ(master.scalar_type(), at::kFloat);
    EXPECT_TRUE(bitwise_equal(master, f32_p[i].detach())) << "param " << i;
    EXPECT_TRUE(bitwise_equal(low_p[i].detach(), master.to(dtype))) << "param " << i;
  }
}

TEST(Optim, MastersForHalfAndBFloat16) {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    masters_follow_fp32<ampfuse::optim::SGD>(
        dtype, ampfuse::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-2));
    masters_follow_fp32<ampfuse::optim::Adam>(
        dtype, ampfuse::optim::AdamOptions(1e-2).weight_decay(1e-2).amsgrad(true));
    masters_follow_fp32<ampfuse::optim::AdamW>(dtype, ampfuse::optim::AdamWOptions(1e-2));
  }
}

TEST(Optim, AReplacedParamRestartsItsWholeMaster) {
  for (const bool remainder : {false, true}) {
    at::manual_seed(3);
    at::Tensor p = at::randn({64}).to(at::kBFloat16).set_requires_grad(true);
    ampfuse::optim::AdamW opt(std::vector<at::Tensor>{p},
                              ampfuse::optim::AdamWOptions(1e-2).master_remainders(remainder));
    for (int k = 0; k < 3; ++k) {
      p.mutable_grad() = at::randn({64}).to(at::kBFloat16);
      opt.step();
    }
    const at::Tensor replacement = p.detach().clone();  // the same values, other memory
    p.set_data(replacement);
    auto& o = static_cast<ampfuse::optim::AdamWOptions&>(opt.param_groups()[0].options());
    o.lr(0.0).weight_decay(0.0);
    p.mutable_grad() = at::randn({64}).to(at::kBFloat16);
    opt.step();
    auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    if (remainder) {
      EXPECT_FALSE(s.master_remainder().any().item<bool>());
    } else {
      EXPECT_TRUE(bitwise_equal(s.master_param(), replacement.to(at::kFloat)));
    }
    EXPECT_TRUE(bitwise_equal(p.detach(), replacement));
  }
}

TEST(Optim, AParamSteppedInTurnByTwoOptimizersWithMastersIsRefusedUntilHandedBack) {
  at::Tensor shared = at::randn({4, 4}).to(at::kBFloat16).set_requires_grad(true);
  ampfuse::optim::AdamW first(std::vector<at::Tensor>{shared}, ampfuse::optim::AdamWOptions(1e-3));
  ampfuse::optim::SGD second(std::vector<at::Tensor>{shared}, ampfuse::optim::SGDOptions(1e-3).momentum(0.9));
  shared.mutable_grad() = at::randn({4, 4}).to(at::kBFloat16);
  first.step();
  first.step();  // through the step plan
  second.step();  // takes the param over
  const at::Tensor before = shared.detach().clone();
  EXPECT_TRUE(throws_with([&] { first.step(); },
                          "param_groups()[0].params()[0] of this AdamW (a torch.bfloat16 param of shape (4, 4)) "
                          "was stepped by another ampfuse optimizer, a SGD"));
  EXPECT_TRUE(bitwise_equal(shared.detach(), before));
  first.sync_masters_from_params();
  first.step();
  EXPECT_TRUE(throws_with([&] { second.step(); }, "of this SGD"));
  // Without a master, a second optimizer steps alongside.
  ampfuse::optim::SGD plain(std::vector<at::Tensor>{shared}, ampfuse::optim::SGDOptions(1e-3).master_weights(false));
  plain.step();
}

// The kind descriptor the engine steps each optimizer by reads its hyper-parameters from the
// options by name: each of them is a field of the optimizer's options (AdamW's decoupled weight
// decay is the optimizer's own), and so is each state's dtype option.
template <class Options>
std::set<std::string> option_fields() {
  Options o;
  std::set<std::string> out;
  Options::fields(o, [&](const char* key, const auto&) { out.insert(key); });
  return out;
}

std::vector<std::vector<std::string>> kind_lists(const std::string& kind) {
  const auto& op = c10::Dispatcher::singleton().findSchemaOrThrow("ampfuse::optimizer_kind", "");
  torch::jit::Stack stack{c10::IValue(kind)};
  op.callBoxed(&stack);
  std::vector<std::vector<std::string>> out;
  for (const auto& v : stack) {
    std::vector<std::string> strings;
    if (v.isList()) {
      for (const auto& e : v.toListRef()) strings.push_back(e.isString() ? e.toStringRef() : "");
    }
    out.push_back(strings);
  }
  return out;
}

TEST(Optim, EveryOptionOfTheKindDescriptorIsAnOptionOfTheCppOptimizer) {
  for (const auto& [kind, fields] : {std::pair{std::string("sgd"), option_fields<ampfuse::optim::SGDOptions>()},
                                     std::pair{std::string("adam"), option_fields<ampfuse::optim::AdamWOptions>()}}) {
    const auto lists = kind_lists(kind);
    ASSERT_EQ(lists.size(), 10u);
    const auto& options = lists[1];
    ASSERT_FALSE(options.empty());
    for (const auto& option : options) {
      if (option.empty() || option == "decoupled_weight_decay") continue;
      EXPECT_TRUE(fields.count(option)) << kind << ": " << option;
    }
    for (const auto& gate : lists[7]) EXPECT_TRUE(gate.empty() || fields.count(gate)) << kind << ": " << gate;
    for (const auto& dtype : lists[8]) EXPECT_TRUE(fields.count(dtype)) << kind << ": " << dtype;
  }
}

TEST(Optim, SyncMastersFromParamsAndLastStepSkipped) {
  at::Tensor p = at::randn({8}).to(at::kBFloat16).set_requires_grad(true);
  ampfuse::optim::AdamW opt(std::vector<at::Tensor>{p}, ampfuse::optim::AdamWOptions(1e-2));
  EXPECT_FALSE(opt.last_step_skipped().has_value());
  p.mutable_grad() = at::randn({8}).to(at::kBFloat16);
  const at::Tensor found_inf = at::ones({1});
  opt.set_step_scaling(ampfuse::StepScaling{at::ones({}), found_inf, std::nullopt});
  opt.step();
  ASSERT_TRUE(opt.last_step_skipped().has_value());
  EXPECT_TRUE(opt.last_step_skipped()->is_same(found_inf));
  opt.clear_step_scaling();
  opt.step();
  EXPECT_FALSE(opt.last_step_skipped().has_value());
  {
    at::NoGradGuard no_grad;
    p.fill_(0.5);
  }
  opt.sync_masters_from_params();
  auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
  EXPECT_TRUE(bitwise_equal(s.master_param(), at::full({8}, 0.5)));
}

TEST(Optim, WithoutMastersLowPrecisionParamsAreUpdatedDirectly) {
  auto params = make_params(at::kBFloat16);
  auto before = ampfuse_test::clone_all(params);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2).master_weights(false));
  set_grads(params, grads_for(0, at::kBFloat16));
  opt.step();
  for (size_t i = 0; i < params.size(); ++i) {
    auto& s = static_cast<ampfuse::optim::AdamParamState&>(
        *opt.state().at(params[i].unsafeGetTensorImpl()));
    EXPECT_FALSE(s.master_param().defined());
    EXPECT_EQ(s.exp_avg().scalar_type(), at::kFloat);
    EXPECT_FALSE(bitwise_equal(params[i], before[i])) << i;
  }
}

// ---- scaling hand-off and skipped steps ----------------------------------------------------------
TEST(Optim, FoundInfSkipsEverything) {
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2).amsgrad(true));
  set_grads(params, grads_for(0, at::kBFloat16));
  opt.step();
  auto snapshot = [&] {
    std::vector<at::Tensor> out = ampfuse_test::clone_all(params);
    for (const auto& p : params) {
      auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      for (const auto& t : {s.step(), s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq(), s.master_param()}) {
        out.push_back(t.clone());
      }
    }
    return out;
  };
  const auto before = snapshot();
  ampfuse::StepScaling scaling;
  scaling.grad_scale = at::full({1}, 1024.0f);
  scaling.found_inf = at::ones({1});
  opt.set_step_scaling(scaling);
  set_grads(params, grads_for(1, at::kBFloat16));
  opt.step();
  opt.clear_step_scaling();
  const auto after = snapshot();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i])) << i;
}

TEST(Optim, GradScaleDividesInTheKernel) {
  // A power-of-two scale divides exactly: stepping on scaled grads with grad_scale equals
  // stepping on the unscaled grads.
  auto a = make_params(at::kFloat);
  auto b = copy_params(a);
  ampfuse::optim::Adam oa(a, ampfuse::optim::AdamOptions(1e-2));
  ampfuse::optim::Adam ob(b, ampfuse::optim::AdamOptions(1e-2));
  for (int step = 0; step < 5; ++step) {
    auto g = grads_for(step, at::kFloat);
    set_grads(a, g);
    std::vector<at::Tensor> scaled;
    for (const auto& t : g) scaled.push_back(t * 4096);
    set_grads(b, scaled);
    oa.step();
    ampfuse::StepScaling s;
    s.grad_scale = at::full({}, 4096.0f);
    ob.set_step_scaling(s);
    ob.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
}

TEST(Optim, SgdMomentumStartsOnFirstStepTaken) {
  auto ours_p = make_params(at::kFloat);
  auto ref_p = copy_params(ours_p);
  ampfuse::optim::SGD ours(ours_p, ampfuse::optim::SGDOptions(0.1).momentum(0.9).dampening(0.5));
  torch::optim::SGD ref(ref_p, torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.5));
  ampfuse::StepScaling skip;
  skip.found_inf = at::ones({});
  ours.set_step_scaling(skip);
  set_grads(ours_p, grads_for(0, at::kFloat));
  ours.step();  // skipped: momentum must stay uninitialised
  ours.clear_step_scaling();
  for (int step = 1; step < 6; ++step) {
    auto g = grads_for(step, at::kFloat);
    set_grads(ours_p, g);
    set_grads(ref_p, g);
    ours.step();
    ref.step();
  }
  for (size_t i = 0; i < ours_p.size(); ++i) EXPECT_TRUE(bitwise_equal(ours_p[i], ref_p[i])) << i;
}

TEST(Optim, ParamsWithoutGradsAreNotStepped) {
  auto params = make_params(at::kFloat);
  auto before = ampfuse_test::clone_all(params);
  ampfuse::optim::AdamW opt(params);
  params[0].mutable_grad() = at::ones_like(params[0]);
  opt.step();
  EXPECT_FALSE(bitwise_equal(params[0], before[0]));
  for (size_t i = 1; i < params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(params[i], before[i]));
    EXPECT_EQ(opt.state().count(params[i].unsafeGetTensorImpl()), 0u);
  }
}

TEST(Optim, ClosureIsCalledWithGradEnabled) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
  bool called = false;
  auto loss = opt.step([&] {
    called = true;
    EXPECT_TRUE(at::GradMode::is_enabled());
    auto l = (params[0] * params[0]).sum();
    l.backward();
    return l;
  });
  EXPECT_TRUE(called);
  ASSERT_TRUE(loss.defined());
  EXPECT_EQ(loss.numel(), 1);
}

// ---- param groups -----------------------------------------------------------------------------------
TEST(Optim, GroupOptionsAreHonouredLikeTorch) {
  auto ours_p = make_params(at::kFloat);
  auto ref_p = copy_params(ours_p);
  std::vector<torch::optim::OptimizerParamGroup> ours_groups, ref_groups;
  ours_groups.emplace_back(std::vector<at::Tensor>{ours_p[0], ours_p[1]});
  ours_groups.emplace_back(std::vector<at::Tensor>{ours_p[2], ours_p[3]},
                           std::make_unique<ampfuse::optim::SGDOptions>(
                               ampfuse::optim::SGDOptions().momentum(0.5)));
  ref_groups.emplace_back(std::vector<at::Tensor>{ref_p[0], ref_p[1]});
  ref_groups.emplace_back(std::vector<at::Tensor>{ref_p[2], ref_p[3]},
                          std::make_unique<torch::optim::SGDOptions>(
                              torch::optim::SGDOptions(1e-3).momentum(0.5)));
  ampfuse::optim::SGD ours(ours_groups, ampfuse::optim::SGDOptions(0.2).weight_decay(0.1));
  torch::optim::SGD ref(ref_groups, torch::optim::SGDOptions(0.2).weight_decay(0.1));
  const auto& g1 = static_cast<const ampfuse::optim::SGDOptions&>(ours.param_groups()[1].options());
  EXPECT_EQ(g1.momentum(), 0.5);
  EXPECT_EQ(g1.lr(), 0.2);  // inherited
  EXPECT_EQ(g1.weight_decay(), 0.1);
  for (int step = 0; step < 5; ++step) {
    auto g = grads_for(step, at::kFloat);
    set_grads(ours_p, g);
    set_grads(ref_p, g);
    ours.step();
    ref.step();
  }
  for (size_t i = 0; i < ours_p.size(); ++i) EXPECT_TRUE(bitwise_equal(ours_p[i], ref_p[i])) << i;
  // add_param_group keeps the group's options too.
  auto extra = at::randn({4}).set_requires_grad(true);
  ours.add_param_group(torch::optim::OptimizerParamGroup(
      {extra}, std::make_unique<ampfuse::optim::SGDOptions>(ampfuse::optim::SGDOptions(0.7))));
  EXPECT_EQ(ours.param_groups().back().options().get_lr(), 0.7);
}

// torch::optim::Optimizer::add_param_group is not virtual: called through a base reference it
// gives an ampfuse optimizer's group the defaults (lr 0.5 asked, 0.001 applied, silently). The
// next step refuses, naming the group, with nothing changed; through the ampfuse type it works.
TEST(Optim, AGroupAddedThroughTheBaseClassIsRefusedAtTheNextStep) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-3));
  auto extra = at::randn({4}).set_requires_grad(true);
  torch::optim::Optimizer& base = opt;
  base.add_param_group(torch::optim::OptimizerParamGroup(
      {extra}, std::make_unique<ampfuse::optim::AdamWOptions>(ampfuse::optim::AdamWOptions(0.5).weight_decay(0.25))));
  set_grads(params, grads_for(0, at::kFloat));
  extra.mutable_grad() = at::ones({4});
  const auto before = copy_params(params);
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "param_groups()[1] was not added by this optimizer's add_param_group"));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i])) << i;
  opt.param_groups().pop_back();
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {extra}, std::make_unique<ampfuse::optim::AdamWOptions>(ampfuse::optim::AdamWOptions(0.5).weight_decay(0.25))));
  EXPECT_EQ(opt.param_groups().back().options().get_lr(), 0.5);
  opt.step();
}

// ---- checkpoints ---------------------------------------------------------------------------------
template <typename Opt, typename Options>
void round_trip(at::ScalarType dtype, Options options) {
  auto a = make_params(dtype);
  Opt oa(a, options);
  for (int step = 0; step < 4; ++step) {
    set_grads(a, grads_for(step, dtype));
    oa.step();
  }
  std::stringstream stream;
  torch::save(oa, stream);
  auto b = copy_params(a);
  Opt ob(b, Options(123.0));  // options come from the checkpoint
  torch::load(ob, stream);
  EXPECT_EQ(ob.param_groups()[0].options().get_lr(), options.lr());
  for (int step = 4; step < 9; ++step) {
    auto g = grads_for(step, dtype);
    set_grads(a, g);
    set_grads(b, g);
    oa.step();
    ob.step();
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
  }
  // Every state tensor matches bitwise.
  std::stringstream s1, s2;
  torch::save(oa, s1);
  torch::save(ob, s2);
  torch::serialize::InputArchive r1, r2;
  r1.load_from(s1);
  r2.load_from(s2);
  torch::serialize::InputArchive st1, st2;
  r1.read("state", st1);
  r2.read("state", st2);
  for (size_t i = 0; i < a.size(); ++i) {
    torch::serialize::InputArchive p1, p2;
    st1.read(std::to_string(reinterpret_cast<size_t>(a[i].unsafeGetTensorImpl())), p1);
    st2.read(std::to_string(reinterpret_cast<size_t>(b[i].unsafeGetTensorImpl())), p2);
    for (const auto& key : p1.keys()) {
      c10::IValue v1, v2;
      p1.read(key, v1);
      p2.read(key, v2);
      EXPECT_TRUE(bitwise_equal(v1.toTensor(), v2.toTensor())) << key << " of param " << i;
    }
    EXPECT_FALSE(p1.keys().empty());
  }
}

TEST(Optim, SaveLoadRoundTripsBitwise) {
  round_trip<ampfuse::optim::AdamW>(at::kBFloat16,
                                    ampfuse::optim::AdamWOptions(1e-2).amsgrad(true));
  round_trip<ampfuse::optim::Adam>(at::kHalf, ampfuse::optim::AdamOptions(1e-2));
  round_trip<ampfuse::optim::SGD>(at::kBFloat16, ampfuse::optim::SGDOptions(0.1).momentum(0.9));
  round_trip<ampfuse::optim::SGD>(at::kFloat, ampfuse::optim::SGDOptions(0.1).nesterov(true).momentum(0.5));
}

TEST(Optim, LoadsTorchAdamWCheckpoint) {
  auto a = make_params(at::kFloat);
  torch::optim::AdamW ref(a, torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    set_grads(a, grads_for(step, at::kFloat));
    ref.step();
  }
  std::stringstream stream;
  torch::save(ref, stream);
  auto b = copy_params(a);
  ampfuse::optim::AdamW ours(b, ampfuse::optim::AdamWOptions(1.0).master_weights(false));
  torch::load(ours, stream);
  const auto& o = static_cast<const ampfuse::optim::AdamWOptions&>(ours.param_groups()[0].options());
  EXPECT_EQ(o.lr(), 1e-2);
  EXPECT_FALSE(o.master_weights());  // absent from torch's checkpoint: kept
  for (size_t i = 0; i < a.size(); ++i) {
    auto& s = static_cast<ampfuse::optim::AdamParamState&>(*ours.state().at(b[i].unsafeGetTensorImpl()));
    auto& r = static_cast<torch::optim::AdamWParamState&>(*ref.state().at(a[i].unsafeGetTensorImpl()));
    EXPECT_EQ(s.step().item<float>(), 3.0f);
    EXPECT_EQ(s.step().scalar_type(), at::kFloat);
    EXPECT_TRUE(bitwise_equal(s.exp_avg(), r.exp_avg()));
    EXPECT_TRUE(bitwise_equal(s.exp_avg_sq(), r.exp_avg_sq()));
  }
  auto g = grads_for(3, at::kFloat);
  set_grads(a, g);
  set_grads(b, g);
  ref.step();
  ours.step();
  for (size_t i = 0; i < a.size(); ++i) expect_close(b[i], a[i], 1e-6, 2e-7, "param");
}

// ---- precision options -----------------------------------------------------------------------
// master_remainders: the masters equal master_weights' bit for bit over many steps (with skipped
// steps and a checkpoint round trip), params equal except at exact ties; state_dtype bf16 keeps
// bf16 moments; checkpoints hold fp32 state and an fp32 master_param.
template <class Opt, class Options>
void remainder_parity(Options options) {
  auto a = make_params(at::kBFloat16);
  auto b = copy_params(a);
  Opt plain(a, options);
  auto ob = std::make_unique<Opt>(b, Options(options).master_remainders(true));
  for (int step = 0; step < 200; ++step) {
    auto g = grads_for(step, at::kBFloat16);
    set_grads(a, g);
    set_grads(b, g);
    const bool skip = step % 37 == 5;
    ampfuse::StepScaling sc;
    sc.found_inf = at::full({}, skip ? 1.0f : 0.0f);
    plain.set_step_scaling(sc);
    ob->set_step_scaling(sc);
    plain.step();
    ob->step();
    if (step == 100) {  // checkpoint round trip into a fresh optimizer
      std::stringstream stream;
      torch::save(*ob, stream);
      ob = std::make_unique<Opt>(b, Options(options).master_remainders(true));
      torch::load(*ob, stream);
    }
  }
  for (size_t i = 0; i < a.size(); ++i) {
    auto& sa = static_cast<typename Opt::State&>(*plain.state().at(a[i].unsafeGetTensorImpl()));
    auto& sb = static_cast<typename Opt::State&>(*ob->state().at(b[i].unsafeGetTensorImpl()));
    ASSERT_TRUE(sb.master_remainder().defined());
    EXPECT_EQ(sb.master_remainder().scalar_type(), at::kShort);
    EXPECT_FALSE(sb.master_param().defined());
    const at::Tensor master = ampfuse::optim::join_master(b[i].detach(), sb.master_remainder());
    EXPECT_TRUE(bitwise_equal(master, sa.master_param())) << "master " << i;
    const at::Tensor ties = sa.master_param().view(at::kInt).bitwise_and(0xFFFF).eq(0x8000);
    EXPECT_TRUE(a[i].detach().eq(b[i].detach()).logical_or(ties).all().item<bool>()) << "param " << i;
  }
}

TEST(Optim, RemainderMastersEqualFp32MastersBitwise) {
  remainder_parity<ampfuse::optim::AdamW>(ampfuse::optim::AdamWOptions(1e-2));
  remainder_parity<ampfuse::optim::SGD>(ampfuse::optim::SGDOptions(0.05).momentum(0.9));
}

TEST(Optim, Bf16StateAndFp32Checkpoints) {
  auto a = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(a, ampfuse::optim::AdamWOptions(1e-2).master_remainders(true).state_dtype(at::kBFloat16));
  for (int step = 0; step < 3; ++step) {
    set_grads(a, grads_for(step, at::kBFloat16));
    opt.step();
  }
  auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(s.exp_avg().scalar_type(), at::kBFloat16);
  EXPECT_EQ(s.exp_avg_sq().scalar_type(), at::kBFloat16);
  const at::Tensor master = ampfuse::optim::join_master(a[0].detach(), s.master_remainder());
  std::stringstream stream;
  torch::save(opt, stream);
  // the live state is unchanged by save()
  EXPECT_EQ(s.exp_avg().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(s.master_remainder().defined());
  // a default-precision optimizer loads it: fp32 state, the fp32 master bit for bit
  auto b = copy_params(a);
  ampfuse::optim::AdamW plain(b, ampfuse::optim::AdamWOptions(1.0));
  torch::load(plain, stream);
  const auto& o = static_cast<const ampfuse::optim::AdamWOptions&>(plain.param_groups()[0].options());
  // the optimizer's own precision options win (the state is converted to them); lr and the
  // other hyper-parameters come from the checkpoint, as torch's do
  EXPECT_FALSE(o.master_remainders());
  EXPECT_EQ(o.state_dtype(), at::kFloat);
  EXPECT_EQ(o.lr(), 1e-2);
  auto& l = static_cast<ampfuse::optim::AdamParamState&>(*plain.state().at(b[0].unsafeGetTensorImpl()));
  EXPECT_EQ(l.exp_avg().scalar_type(), at::kFloat);
  EXPECT_TRUE(bitwise_equal(l.exp_avg(), s.exp_avg().to(at::kFloat)));
  EXPECT_TRUE(bitwise_equal(l.master_param(), master));
}

TEST(Optim, PrecisionOptionsMergeAndCheck) {
  auto p = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(std::vector<at::Tensor>{p[0]}, ampfuse::optim::AdamWOptions(1e-3).state_dtype(at::kBFloat16));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {p[1]}, std::make_unique<ampfuse::optim::AdamWOptions>(ampfuse::optim::AdamWOptions(5e-3).master_remainders(true))));
  const auto& g1 = static_cast<const ampfuse::optim::AdamWOptions&>(opt.param_groups()[1].options());
  EXPECT_EQ(g1.lr(), 5e-3);
  EXPECT_TRUE(g1.master_remainders());
  EXPECT_EQ(g1.state_dtype(), at::kBFloat16);  // inherited from the defaults
  EXPECT_TRUE(throws_with(
      [&] { ampfuse::optim::AdamW bad(std::vector<at::Tensor>{p[2]}, ampfuse::optim::AdamWOptions().state_dtype(at::kHalf)); },
      "AdamW: state_dtype must be torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn or "
      "torch.float8_e5m2, got torch.float16"));
}

TEST(Optim, StochasticRoundingKeepsNoMasterAndIsReproducible) {
  auto run = [](int64_t seed) {
    auto a = make_params(at::kBFloat16);
    ampfuse::optim::AdamW opt(a, ampfuse::optim::AdamWOptions(1e-3).stochastic_rounding(true).rounding_seed(seed));
    for (int step = 0; step < 3; ++step) {
      set_grads(a, grads_for(step, at::kBFloat16));
      opt.step();
    }
    const auto& s = static_cast<const ampfuse::optim::AdamParamState&>(*opt.state().at(a[0].unsafeGetTensorImpl()));
    EXPECT_FALSE(s.master_param().defined());
    EXPECT_FALSE(s.master_remainder().defined());
    return a;
  };
  const auto x = run(5), y = run(5), z = run(6);
  EXPECT_TRUE(bitwise_equal(x[0], y[0]));
  EXPECT_FALSE(bitwise_equal(x[0], z[0]));
  auto p = make_params(at::kBFloat16);
  EXPECT_TRUE(throws_with(
      [&] {
        ampfuse::optim::SGD bad(p, ampfuse::optim::SGDOptions(0.1).master_remainders(true).stochastic_rounding(true));
      },
      "master_remainders and stochastic_rounding exclude each other"));
  EXPECT_TRUE(throws_with(
      [&] { ampfuse::optim::AdamW bad(p, ampfuse::optim::AdamWOptions().stochastic_rounding(true).rounding_seed(-2)); },
      "AdamW: rounding_seed must be an integer in [0, 2**53), got -2"));
}

TEST(Optim, LoadChecksBeforeChangingAnything) {
  auto a = make_params(at::kFloat);
  ampfuse::optim::Adam oa(a, ampfuse::optim::AdamOptions(1e-2));
  set_grads(a, grads_for(0, at::kFloat));
  oa.step();
  std::stringstream stream;
  torch::save(oa, stream);
  // Same number of params, one of another shape.
  auto b = copy_params(a);
  b[1] = at::randn({7, 5}).set_requires_grad(true);
  ampfuse::optim::Adam ob(b, ampfuse::optim::AdamOptions(0.5));
  set_grads(b, grads_for(5, at::kFloat));
  // grads_for(5) has shape [5, 7] for param 1: give it a matching one.
  b[1].mutable_grad() = at::randn({7, 5});
  ob.step();
  std::stringstream before;
  torch::save(ob, before);
  EXPECT_TRUE(throws_with([&] { torch::load(ob, stream); },
                          "state 'exp_avg' of param_groups()[0].params()[1] has shape (5, 7) but the "
                          "parameter has shape (7, 5)."));
  EXPECT_EQ(ob.param_groups()[0].options().get_lr(), 0.5);
  std::stringstream after;
  torch::save(ob, after);
  EXPECT_EQ(before.str(), after.str());
  // A different number of params.
  auto c = copy_params(a);
  c.pop_back();
  ampfuse::optim::Adam oc(c);
  stream.clear();
  stream.seekg(0);
  EXPECT_TRUE(throws_with([&] { torch::load(oc, stream); },
                          "Parameter group 0 of the checkpoint has 4 parameters but the "
                          "optimizer's has 3."));
}

TEST(Optim, LoadRefusesAStepThatIsNotACount) {
  auto a = make_params(at::kFloat);
  ampfuse::optim::Adam oa(a, ampfuse::optim::AdamOptions(1e-2));
  set_grads(a, grads_for(0, at::kFloat));
  oa.step();
  auto& state = static_cast<ampfuse::optim::AdamParamState&>(*oa.state().at(a[1].unsafeGetTensorImpl()));
  state.step().fill_(std::numeric_limits<float>::quiet_NaN());
  std::stringstream stream;
  torch::save(oa, stream);
  auto b = copy_params(a);
  ampfuse::optim::Adam ob(b, ampfuse::optim::AdamOptions(0.5));
  std::stringstream before;
  torch::save(ob, before);
  EXPECT_TRUE(throws_with([&] { torch::load(ob, stream); },
                          "state 'step' of param_groups()[0].params()[1] must be a finite count >= 0, got nan."));
  std::stringstream after;
  torch::save(ob, after);
  EXPECT_EQ(before.str(), after.str());
}

// ---- bad input ------------------------------------------------------------------------------------
TEST(Optim, BadInputNamesTheArgument) {
  auto p64 = at::randn({3}, at::kDouble).set_requires_grad(true);
  EXPECT_TRUE(throws_with([&] { ampfuse::optim::SGD({p64}); },
                          "param_groups()[0].params()[0] has dtype torch.float64"));
  auto p = at::randn({3}).set_requires_grad(true);
  EXPECT_TRUE(throws_with([&] { ampfuse::optim::SGD({p}, ampfuse::optim::SGDOptions(-1)); },
                          "SGD: lr must be >= 0, got -1.0."));
  EXPECT_TRUE(throws_with(
      [&] { ampfuse::optim::SGD({p}, ampfuse::optim::SGDOptions(0.1).nesterov(true)); },
      "SGD: nesterov momentum requires a momentum > 0 and zero dampening."));
  EXPECT_TRUE(throws_with(
      [&] {
        ampfuse::optim::AdamW({p}, ampfuse::optim::AdamWOptions().betas(std::make_tuple(1.0, 0.9)));
      },
      "AdamW: betas[0] must be in [0, 1), got 1.0."));
  EXPECT_TRUE(throws_with([&] { ampfuse::optim::Adam({p}, ampfuse::optim::AdamOptions().eps(-1)); },
                          "Adam: eps must be >= 0, got -1.0."));
  // Group options of another optimizer type.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p}, std::make_unique<torch::optim::SGDOptions>(0.1));
  EXPECT_TRUE(throws_with([&] { ampfuse::optim::SGD opt(groups); },
                          "ampfuse::optim::SGD needs param group options of type "
                          "ampfuse::optim::SGDOptions"));

  ampfuse::optim::Adam opt({p});
  p.mutable_grad() = at::ones({4});
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "param_groups()[0].params()[0] has a gradient of shape (4,) but the "
                          "parameter has shape (3,)."));
  p.mutable_grad() = at::ones({3}, at::kDouble);
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "param_groups()[0].params()[0] has a gradient of dtype torch.float64"));
  EXPECT_EQ(opt.state().size(), 0u);  // nothing happened
  // A model converted after the optimizer was built.
  p.mutable_grad() = at::Tensor();
  {
    at::NoGradGuard no_grad;
    p.set_data(p.detach().to(at::kHalf));
  }
  p.mutable_grad() = at::ones({3}, at::kHalf);
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "param_groups()[0].params()[0] has dtype torch.float16 but was "
                          "torch.float32 when the optimizer was built"));
}

}  // namespace

// ---- the step plan ------------------------------------------------------------------------------
// After a validated step the optimizer holds a step plan and the following steps go through it;
// a grad buffer keeps an optimizer on the validated way, so the two must agree bit for bit, also
// across the changes that send a step back the validated way.
TEST(Optim, StepPlanMatchesTheValidatedWayBitwise) {
  for (int change = 0; change < 5; ++change) {
    auto pa = make_params(at::kFloat);
    auto pb = copy_params(pa);
    ampfuse::optim::AdamW a(pa, ampfuse::optim::AdamWOptions(1e-2));
    ampfuse::optim::AdamW b(pb, ampfuse::optim::AdamWOptions(1e-2));
    std::vector<at::Tensor> buffers;
    for (const auto& p : pb) buffers.push_back(at::zeros_like(p));
    for (size_t i = 0; i < pb.size(); ++i) b.set_grad_buffer(pb[i], buffers[i]);
    for (int step = 0; step < 5; ++step) {
      auto g = grads_for(step, at::kFloat);
      set_grads(pa, g);
      for (size_t i = 0; i < pb.size(); ++i) buffers[i].copy_(g[i]);
      if (change == 0 && step == 4) b.set_grad_buffer(pb[1], buffers[1]);
      if (step == 3) {
        switch (change) {
          case 0:  // a param without a gradient this step
            pa[1].mutable_grad() = at::Tensor();
            b.remove_grad_buffer(pb[1]);
            break;
          case 1:  // a structural option switched on
            a.param_groups()[0].options().set_lr(0.5);
            static_cast<ampfuse::optim::AdamWOptions&>(a.param_groups()[0].options()).amsgrad(true);
            b.param_groups()[0].options().set_lr(0.5);
            static_cast<ampfuse::optim::AdamWOptions&>(b.param_groups()[0].options()).amsgrad(true);
            break;
          case 2: {  // a state tensor replaced through the state map
            for (auto* o : {&a, &b}) {
              auto& params = o == &a ? pa : pb;
              auto& s = static_cast<ampfuse::optim::AdamParamState&>(
                  *o->state().at(params[2].unsafeGetTensorImpl()));
              s.exp_avg(at::zeros_like(s.exp_avg()));
            }
            break;
          }
          case 3:  // the param's data swapped (same shape)
            pa[0].set_data(pa[0].detach().clone());
            pb[0].set_data(pb[0].detach().clone());
            break;
          default:  // a hyper-parameter only: the plan stays
            a.param_groups()[0].options().set_lr(3e-3);
            b.param_groups()[0].options().set_lr(3e-3);
        }
      }
      a.step();
      b.step();
      EXPECT_TRUE(a.has_step_plan()) << "change " << change << " step " << step;
      EXPECT_FALSE(b.has_step_plan());
      for (size_t i = 0; i < pa.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(pa[i], pb[i])) << "change " << change << " step " << step << " param " << i;
      }
    }
  }
}

TEST(Optim, StepPlanRefusesWhatTheValidatedWayRefuses) {
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(params);
  for (int step = 0; step < 2; ++step) {
    set_grads(params, grads_for(step, at::kBFloat16));
    opt.step();
  }
  ASSERT_TRUE(opt.has_step_plan());
  auto before = ampfuse_test::clone_all(params);
  params[1].mutable_grad() = params[1].detach();  // the param's own memory
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "shares memory with the parameter"));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i]));
}

// A checkpoint whose options or parameter keys have the wrong type is refused naming the entry,
// before anything changes (torch's IValue casts asserted "please report a bug to PyTorch", and a
// key that is not a number gave a bare std::invalid_argument).
TEST(Optim, LoadNamesAWrongTypedOptionOrKey) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-3));
  auto checkpoint = [&](const std::function<void(torch::serialize::OutputArchive&)>& options,
                        c10::IValue key) {
    torch::serialize::OutputArchive out;
    out.write("pytorch_version", c10::IValue(std::string("2")));
    torch::serialize::OutputArchive state(out.compilation_unit()), groups(out.compilation_unit()),
        group(out.compilation_unit()), opts(out.compilation_unit());
    out.write("state", state);
    groups.write("param_groups/size", at::tensor(int64_t{1}));
    group.write("params/size", at::tensor(static_cast<int64_t>(params.size())));
    for (size_t i = 0; i < params.size(); ++i) {
      group.write("params/" + std::to_string(i), i == 0 ? key : c10::IValue(std::to_string(100 + i)));
    }
    options(opts);
    group.write("options", opts);
    groups.write("param_groups/0", group);
    out.write("param_groups", groups);
    std::stringstream buf;
    out.save_to(buf);
    return buf.str();
  };
  auto load = [&](const std::string& bytes) {
    std::stringstream buf(bytes);
    torch::serialize::InputArchive in;
    in.load_from(buf);
    opt.load(in);
  };
  const c10::IValue good_key(std::string("99"));
  EXPECT_TRUE(throws_with([&] { load(checkpoint([](auto& o) { o.write("lr", c10::IValue(std::string("x"))); }, good_key)); },
                          "The checkpoint's option 'lr' must be a float, got String."));
  EXPECT_TRUE(throws_with([&] { load(checkpoint([](auto& o) { o.write("amsgrad", c10::IValue(int64_t{1})); }, good_key)); },
                          "The checkpoint's option 'amsgrad' must be a bool, got Int."));
  EXPECT_TRUE(throws_with([&] { load(checkpoint([](auto& o) { o.write("rounding_seed", c10::IValue(1.5)); }, good_key)); },
                          "The checkpoint's option 'rounding_seed' must be"));
  EXPECT_TRUE(throws_with(
      [&] { load(checkpoint([](auto& o) { o.write("betas", c10::IValue(std::vector<double>{0.9, 0.99})); }, good_key)); },
      "The checkpoint's option 'betas' must be"));
  EXPECT_TRUE(throws_with([&] { load(checkpoint([](auto&) {}, c10::IValue(int64_t{7}))); },
                          "The checkpoint's param_groups/0/params/0 must be a parameter key (a number as a string), got Int."));
  EXPECT_TRUE(throws_with([&] { load(checkpoint([](auto&) {}, c10::IValue(std::string("abc")))); },
                          "must be a parameter key (a number as a string), got 'abc'."));
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 1e-3);
  load(checkpoint([](auto& o) { o.write("lr", c10::IValue(int64_t{2})); }, good_key));  // an int where a float is kept
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 2.0);
}
