// ampfuse::GradScaler: torch's state machine and messages, skipping on inf with torch's and
// ampfuse's optimizers, torch's scale rule, hysteresis/bounds, clipping, checkpoints.
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cfloat>
#include <limits>
#include <sstream>

#include "ampfuse/grad_scaler.h"
#include "ampfuse/optim.h"
#include "test_utils.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::throws_with;

std::vector<at::Tensor> make_params(at::ScalarType dtype, uint64_t seed = 0) {
  at::manual_seed(seed);
  return {at::randn({33}).to(dtype).set_requires_grad(true),
          at::randn({4, 5}).to(dtype).set_requires_grad(true)};
}

std::vector<at::Tensor> copy_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// A loss whose gradient w.r.t. each param is x (times the scale): backward through the scaler.
void backward(ampfuse::GradScaler& scaler, const std::vector<at::Tensor>& params, int step,
              bool overflow = false) {
  at::manual_seed(500 + step);
  at::Tensor loss = at::zeros({});
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor x = at::randn(params[i].sizes());
    if (overflow && i == 1) x.view({-1})[3] = std::numeric_limits<float>::infinity();
    loss = loss + (params[i].to(at::kFloat) * x).sum();
  }
  scaler.scale(loss).backward();
}

void zero_grad(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) p.mutable_grad() = at::Tensor();
}

// ---- construction and pass-through ---------------------------------------------------------
TEST(GradScaler, OptionsAreValidated) {
  using O = ampfuse::GradScalerOptions;
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().growth_factor(1.0)); },
                          "The growth factor must be > 1.0."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().backoff_factor(1.0)); },
                          "The backoff factor must be < 1.0."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().hysteresis(0)); },
                          "hysteresis must be an integer >= 1, got 0."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().min_scale(4.0).max_scale(2.0)); },
                          "min_scale (4.0) must not be greater than max_scale (2.0)."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().min_scale(-1.0)); },
                          "min_scale must be a finite number in [0, 3.40282e+38] (the float32 "
                          "range), got -1."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().min_scale(1e39)); },
                          "(the float32 range), got 1e+39."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().max_scale(0.0)); },
                          "max_scale must be a number > 0"));
  // What update() would refuse after the optimizer stepped is refused here (the same rule), and
  // an init_scale that float32 does not hold is named.
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().growth_interval(0)); },
                          "growth_interval must be an integer in [1, 2147483647], got 0."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().growth_interval(int64_t{1} << 40)); },
                          "growth_interval must be an integer in [1, 2147483647], got 1099511627776."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().backoff_factor(0.0)); },
                          "backoff_factor must be in (0, 1), got 0."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().growth_factor(std::numeric_limits<double>::infinity())); },
                          "growth_factor must be a finite number > 1.0, got inf."));
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler s(O().init_scale(1e39)); },
                          "init_scale must be a positive finite number that float32 holds"));
  ampfuse::GradScaler ok;
  EXPECT_TRUE(throws_with([&] { ok.set_growth_interval(0); }, "growth_interval must be an integer in [1, "));
  EXPECT_EQ(ok.get_growth_interval(), 2000);
  // A disabled scaler does not check the growth/backoff factors (as torch).
  ampfuse::GradScaler disabled(O().enabled(false).growth_factor(0.5));
  EXPECT_FALSE(disabled.is_enabled());
}

TEST(GradScaler, DisabledIsAPassThrough) {
  auto params = make_params(at::kFloat);
  auto ref = copy_params(params);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().enabled(false));
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.1));
  at::Tensor loss = (params[0] * 2).sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  loss.backward();
  (ref[0] * 2).sum().backward();
  scaler.unscale_(opt);
  scaler.step(opt);
  ref_opt.step();
  scaler.update();
  EXPECT_TRUE(bitwise_equal(params[0], ref[0]));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_FALSE(scaler.last_found_inf().has_value());
  // It saves nothing, and an enabled scaler refuses that checkpoint.
  std::stringstream stream;
  torch::save(scaler, stream);
  ampfuse::GradScaler enabled;
  EXPECT_TRUE(throws_with([&] { torch::load(enabled, stream); },
                          "The source state dict is empty, possibly because it was saved from a "
                          "disabled instance of GradScaler."));
}

TEST(GradScaler, ScaleIsCreatedLazilyOnTheLossDevice) {
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(8.0));
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_FALSE(scaler.get_scale_async().defined());
  auto out = scaler.scale(at::full({2}, 3.0f));
  EXPECT_TRUE(bitwise_equal(out, at::full({2}, 24.0f)));
  ASSERT_TRUE(scaler.get_scale_async().defined());
  EXPECT_EQ(scaler.get_scale_async().scalar_type(), at::kFloat);
  EXPECT_EQ(scaler.get_scale_async().dim(), 0);
  auto many = scaler.scale(std::vector<at::Tensor>{at::ones({1}), at::full({1}, 2.0f)});
  EXPECT_EQ(many[1].item<float>(), 16.0f);
  EXPECT_EQ(scaler.stats().sum().item<int64_t>(), 0);
}

// ---- the state machine (torch's messages) -------------------------------------------------------
TEST(GradScaler, StateMachineErrors) {
  auto params = make_params(at::kFloat);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler;
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); },
                          "Attempted unscale_ but _scale is None.  This may indicate your script "
                          "did not use scaler.scale(loss or outputs) earlier in the iteration."));
  EXPECT_TRUE(throws_with([&] { scaler.update(); }, "Attempted update but _scale is None."));
  backward(scaler, params, 0);
  EXPECT_TRUE(throws_with([&] { scaler.update(); },
                          "No inf checks were recorded prior to update."));
  scaler.unscale_(opt);
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); },
                          "unscale_() has already been called on this optimizer since the last "
                          "update()."));
  EXPECT_TRUE(throws_with([&] { scaler.unscale_and_clip_(opt, 1.0); },
                          "unscale_() has already been called on this optimizer since the last "
                          "update()."));
  scaler.step(opt);
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); },
                          "unscale_() is being called after step()."));
  EXPECT_TRUE(throws_with([&] { scaler.step(opt); },
                          "step() has already been called since the last update()."));
  scaler.update();
  // A new iteration: all allowed again.
  zero_grad(params);
  backward(scaler, params, 1);
  scaler.unscale_(opt);
  scaler.step(opt);
  scaler.update();
  // No gradients at all: nothing was checked.
  zero_grad(params);
  EXPECT_TRUE(throws_with([&] { scaler.step(opt); },
                          "No inf checks were recorded for this optimizer."));
  EXPECT_TRUE(throws_with([&] { scaler.step(opt, [] { return at::Tensor(); }); },
                          "Closure use is not currently supported if GradScaler is enabled."));
}

TEST(GradScaler, RefusesToUnscaleFp16Gradients) {
  auto params = make_params(at::kHalf);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  backward(scaler, params, 0);
  const auto grads = ampfuse_test::clone_all({params[0].grad(), params[1].grad()});
  EXPECT_TRUE(throws_with([&] { scaler.unscale_(opt); }, "Attempting to unscale FP16 gradients."));
  EXPECT_TRUE(bitwise_equal(params[0].grad(), grads[0]));
  // The fused paths keep the grads scaled and take fp16 gradients.
  scaler.unscale_and_clip_(opt, 10.0);
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.last_found_inf()->item<float>(), 0.0f);
}

// ---- skip on inf -------------------------------------------------------------------------------------
TEST(GradScaler, TorchOptimizerMatchesTorchsRecipeAndSkipsOnInf) {
  // The scaler's loop against the same loop written with ATen's own AMP ops.
  auto params = make_params(at::kFloat);
  auto ref = copy_params(params);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.1).momentum(0.9));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(3));
  at::Tensor ref_scale = at::full({}, 1024.0f);
  at::Tensor ref_tracker = at::zeros({}, at::kInt);
  for (int step = 0; step < 12; ++step) {
    const bool overflow = step == 4 || step == 9;
    zero_grad(params);
    zero_grad(ref);
    backward(scaler, params, step, overflow);
    {
      at::manual_seed(500 + step);
      at::Tensor loss = at::zeros({});
      for (size_t i = 0; i < ref.size(); ++i) {
        at::Tensor x = at::randn(ref[i].sizes());
        if (overflow && i == 1) x.view({-1})[3] = std::numeric_limits<float>::infinity();
        loss = loss + (ref[i].to(at::kFloat) * x).sum();
      }
      (loss * ref_scale).backward();
    }
    auto found = at::zeros({1});
    const auto inv = ref_scale.to(at::kDouble).reciprocal().to(at::kFloat);
    for (auto& p : ref) at::_amp_foreach_non_finite_check_and_unscale_({p.grad()}, found, inv);
    const auto before = ampfuse_test::clone_all(params);
    scaler.step(opt);
    if (found.item<float>() == 0.0f) ref_opt.step();
    scaler.update();
    at::_amp_update_scale_(ref_scale, ref_tracker, found, 2.0, 0.5, 3);
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(bitwise_equal(params[i], ref[i])) << "step " << step << " param " << i;
      if (overflow) ASSERT_TRUE(bitwise_equal(params[i], before[i]));
    }
    ASSERT_TRUE(bitwise_equal(scaler.get_scale_async(), ref_scale)) << step;
    ASSERT_EQ(scaler.get_growth_tracker(), ref_tracker.item<int>()) << step;
    ASSERT_EQ(scaler.last_found_inf()->item<float>(), overflow ? 1.0f : 0.0f) << step;
  }
  const auto stats = scaler.stats();
  EXPECT_EQ(stats[0].item<int64_t>(), 12);  // updates
  EXPECT_EQ(stats[1].item<int64_t>(), 2);   // overflows
  EXPECT_EQ(stats[2].item<int64_t>(), 2);   // backoffs
}

TEST(GradScaler, FusedOptimizerSkipsOnTheDevice) {
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
  backward(scaler, params, 0);
  scaler.step(opt);
  scaler.update();
  EXPECT_FALSE(opt.step_scaling().has_value());  // cleared after the step
  auto snapshot = [&] {
    std::vector<at::Tensor> out = ampfuse_test::clone_all(params);
    for (const auto& p : params) {
      auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      for (const auto& t : {s.step(), s.exp_avg(), s.exp_avg_sq(), s.master_param()}) out.push_back(t.clone());
    }
    return out;
  };
  const auto before = snapshot();
  zero_grad(params);
  backward(scaler, params, 1, /*overflow=*/true);
  scaler.step(opt);
  scaler.update();
  const auto after = snapshot();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(bitwise_equal(before[i], after[i])) << i;
  EXPECT_EQ(scaler.get_scale(), 128.0);
  EXPECT_EQ(scaler.last_found_inf()->item<float>(), 1.0f);
  EXPECT_EQ(scaler.stats()[1].item<int64_t>(), 1);
}

TEST(GradScaler, FusedStepEqualsUnscaleThenStep) {
  // With a power-of-two scale, dividing in the optimizer's kernel equals unscaling first.
  auto a = make_params(at::kBFloat16);
  auto b = copy_params(a);
  ampfuse::optim::Adam oa(a, ampfuse::optim::AdamOptions(1e-2));
  ampfuse::optim::Adam ob(b, ampfuse::optim::AdamOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  ampfuse::GradScaler sb(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  for (int step = 0; step < 6; ++step) {
    zero_grad(a);
    zero_grad(b);
    backward(sa, a, step, step == 3);
    backward(sb, b, step, step == 3);
    sa.step(oa);  // grads stay scaled: the kernel divides
    sb.unscale_and_clip_(ob, 1e9);  // read-only check; coefficient 1
    sb.step(ob);
    sa.update();
    sb.update();
    for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(bitwise_equal(a[i], b[i])) << step;
    ASSERT_EQ(sa.get_scale(), sb.get_scale());
  }
}

// ---- clipping ----------------------------------------------------------------------------------------
TEST(GradScaler, UnscaleAndClipMatchesClipGradNorm) {
  auto params = make_params(at::kFloat);
  auto ref = copy_params(params);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0));
  backward(scaler, params, 0);
  std::vector<at::Tensor> ref_grads;
  for (const auto& p : params) ref_grads.push_back(p.grad() / 64.0);
  for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = ref_grads[i];
  const double ref_norm = torch::nn::utils::clip_grad_norm_(ref, 0.5);
  const at::Tensor norm = scaler.unscale_and_clip_(opt, 0.5);
  EXPECT_EQ(norm.scalar_type(), at::kFloat);
  EXPECT_NEAR(norm.item<double>(), ref_norm, 1e-5 * ref_norm);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(params[i].grad(), ref[i].grad(), 1e-6, 1e-7)) << i;
  }
  scaler.step(opt);
  scaler.update();
  // inf norm and the bad-input message.
  zero_grad(params);
  backward(scaler, params, 1);
  EXPECT_TRUE(throws_with([&] { scaler.unscale_and_clip_(opt, -1.0); },
                          "max_norm must be a positive finite number, got -1."));
  const at::Tensor inf_norm =
      scaler.unscale_and_clip_(opt, 1e9, std::numeric_limits<double>::infinity());
  float mx = 0;
  for (const auto& p : params) mx = std::max(mx, p.grad().abs().max().item<float>());
  EXPECT_EQ(inf_norm.item<float>(), mx);
}

TEST(GradScaler, UnscaleAndClipLeavesFusedGradsScaled) {
  auto a = make_params(at::kFloat);
  auto b = copy_params(a);
  ampfuse::optim::SGD oa(a, ampfuse::optim::SGDOptions(1.0));
  ampfuse::optim::SGD ob(b, ampfuse::optim::SGDOptions(1.0));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(32.0));
  backward(scaler, a, 0);
  const auto scaled = ampfuse_test::clone_all({a[0].grad(), a[1].grad()});
  const at::Tensor norm = scaler.unscale_and_clip_(oa, 0.25);
  EXPECT_TRUE(bitwise_equal(a[0].grad(), scaled[0]));  // only read
  EXPECT_TRUE(bitwise_equal(a[1].grad(), scaled[1]));
  scaler.step(oa);
  // Reference: the clipped, unscaled gradients through a plain step.
  const double coef = std::min(1.0, 0.25 / (norm.item<double>() + 1e-6));
  for (size_t i = 0; i < b.size(); ++i) b[i].mutable_grad() = scaled[i] / 32.0 * coef;
  ob.step();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::allclose(a[i], b[i], 1e-6, 1e-7)) << i;
}

// ---- the scale rule: hysteresis and bounds -----------------------------------------------------
struct Iteration {
  bool overflow;
  double expected_scale;
};

void run_sequence(ampfuse::GradScalerOptions options, const std::vector<Iteration>& sequence) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.0));
  ampfuse::GradScaler scaler(options);
  for (size_t k = 0; k < sequence.size(); ++k) {
    zero_grad(params);
    backward(scaler, params, static_cast<int>(k), sequence[k].overflow);
    scaler.step(opt);
    scaler.update();
    ASSERT_EQ(scaler.get_scale(), sequence[k].expected_scale) << "iteration " << k;
  }
}

TEST(GradScaler, Hysteresis) {
  // Budget 2: the first overflow is absorbed, the second backs off; growth refills the budget.
  run_sequence(ampfuse::GradScalerOptions().init_scale(16.0).growth_interval(2).hysteresis(2),
               {{true, 16}, {true, 8}, {false, 8}, {false, 16}, {true, 16}, {true, 8}});
  // Without consecutive_hysteresis a clean step does not refill the budget...
  run_sequence(ampfuse::GradScalerOptions().init_scale(16.0).growth_interval(100).hysteresis(2),
               {{true, 16}, {false, 16}, {true, 8}});
  // ...with it, it does.
  run_sequence(ampfuse::GradScalerOptions()
                   .init_scale(16.0)
                   .growth_interval(100)
                   .hysteresis(2)
                   .consecutive_hysteresis(true),
               {{true, 16}, {false, 16}, {true, 16}, {true, 8}});
}

TEST(GradScaler, Bounds) {
  run_sequence(ampfuse::GradScalerOptions().init_scale(4.0).min_scale(2.0),
               {{true, 2}, {true, 2}, {true, 2}});
  run_sequence(ampfuse::GradScalerOptions().init_scale(4.0).growth_interval(1).max_scale(16.0),
               {{false, 8}, {false, 16}, {false, 16}, {true, 8}});
  // No bounds: the scale never falls below the smallest normal float.
  std::vector<Iteration> decay;
  double s = FLT_MIN * 8;
  for (int k = 0; k < 6; ++k) {
    s = std::max<double>(s / 2, FLT_MIN);
    decay.push_back({true, s});
  }
  run_sequence(ampfuse::GradScalerOptions().init_scale(FLT_MIN * 8), decay);
}

// The warnings raised while it is alive, kept.
struct KeptWarnings : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
};

void overflow_loop(ampfuse::GradScaler& scaler, int steps) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
  for (int k = 0; k < steps; ++k) {
    zero_grad(params);
    backward(scaler, params, k, /*overflow=*/true);
    scaler.step(opt);
    scaler.update();
  }
}

TEST(GradScaler, OnMinScaleWarnsRaisesOrIgnoresFloorHits) {
  const std::string report =
      "GradScaler: the loss scale hit its floor (4) 1 time(s): gradients keep overflowing even at the smallest "
      "scale. Training has probably diverged (check the learning rate, the data, and whether the model was "
      "pretrained in bf16).";
  {  // 16 -> 8 -> 4, then two backoffs clamped at the floor: each reported once, by the update after it
    KeptWarnings kept;
    c10::WarningUtils::WarningHandlerGuard guard(&kept);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(16.0).min_scale(4.0));
    overflow_loop(scaler, 4);
    EXPECT_EQ(kept.messages, (std::vector<std::string>{report, report}));
    scaler.check_min_scale();  // nothing new
    EXPECT_EQ(kept.messages.size(), 2u);
    EXPECT_EQ(scaler.stats()[static_cast<int64_t>(ampfuse::ScaleStat::kFloorHits)].item<int64_t>(), 2);
  }
  {
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(16.0).min_scale(4.0).on_min_scale("raise"));
    EXPECT_TRUE(throws_with([&] { overflow_loop(scaler, 4); }, "hit its floor (4) 1 time(s)"));
  }
  {
    KeptWarnings kept;
    c10::WarningUtils::WarningHandlerGuard guard(&kept);
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(16.0).min_scale(4.0).on_min_scale("ignore"));
    overflow_loop(scaler, 4);
    scaler.check_min_scale();
    EXPECT_TRUE(kept.messages.empty());
    EXPECT_EQ(scaler.get_scale(), 4.0);
  }
  EXPECT_TRUE(throws_with([] { ampfuse::GradScaler(ampfuse::GradScalerOptions().on_min_scale("loud")); },
                          "on_min_scale must be 'warn', 'raise' or 'ignore', got 'loud'."));
}

TEST(GradScaler, UpdateWithANewScale) {
  auto params = make_params(at::kFloat);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler;
  backward(scaler, params, 0);
  scaler.step(opt);
  scaler.update(3.0);
  EXPECT_EQ(scaler.get_scale(), 3.0);
  zero_grad(params);
  backward(scaler, params, 1);
  scaler.step(opt);
  scaler.update(at::full({1}, 5.0f));
  EXPECT_EQ(scaler.get_scale(), 5.0);
  EXPECT_TRUE(throws_with([&] { scaler.update(at::ones({2})); },
                          "new_scale should be a float or a 1-element"));
}

// ---- checkpoints -----------------------------------------------------------------------------------
// A checkpoint value past what the device state holds (a scale float32 does not hold, a growth
// tracker past int32) is refused, naming the entry, before anything changes: it once passed the
// checks and threw half-way, leaving the new growth factor with the old scale.
TEST(GradScaler, LoadRefusesValuesTheDeviceStateCannotHold) {
  for (const bool big_scale : {true, false}) {
    std::stringstream stream;
    {
      torch::serialize::OutputArchive out;
      out.write("scale", c10::IValue(big_scale ? 1e39 : 8.0));
      out.write("growth_factor", c10::IValue(3.0));
      out.write("backoff_factor", c10::IValue(0.25));
      out.write("growth_interval", c10::IValue(int64_t{10}));
      out.write("_growth_tracker", c10::IValue(big_scale ? int64_t{0} : int64_t{1} << 40));
      out.save_to(stream);
    }
    ampfuse::GradScaler dst(ampfuse::GradScalerOptions().init_scale(16.0));
    torch::serialize::InputArchive in;
    in.load_from(stream);
    EXPECT_TRUE(throws_with([&] { dst.load(in); },
                            big_scale ? "the checkpoint's scale must be a positive finite number that float32 holds"
                                      : "the checkpoint's _growth_tracker must be an integer in [0, 2147483647]"));
    EXPECT_EQ(dst.get_scale(), 16.0);
    EXPECT_EQ(dst.get_growth_factor(), 2.0);
  }
}

// An external inf check's flags are 1-element float32 tensors: another is refused where it is
// recorded (it once failed at step() and kept failing at every update()).
TEST(GradScaler, RecordInfCheckRefusesAFlagThatIsNotOneFloat) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler;
  EXPECT_TRUE(throws_with(
      [&] { scaler.record_inf_check(opt, {{c10::Device("cpu"), at::zeros({3}, at::kLong)}}); },
      "found_inf for cpu must be a 1-element float32 tensor, got Long of shape [3]."));
  scaler.scale(at::ones({}));
  scaler.record_inf_check(opt, {{c10::Device("cpu"), at::zeros({}, at::kFloat)}});
}

TEST(GradScaler, SaveLoadRoundTripsBitwise) {
  const auto options = ampfuse::GradScalerOptions()
                           .init_scale(512.0)
                           .growth_interval(2)
                           .hysteresis(3)
                           .min_scale(1.0)
                           .max_scale(1e6);
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.0));
  ampfuse::GradScaler a(options);
  for (int k = 0; k < 5; ++k) {
    zero_grad(params);
    backward(a, params, k, k == 1 || k == 4);
    a.step(opt);
    a.update();
  }
  std::stringstream stream;
  torch::save(a, stream);
  // Into a fresh scaler with other options, and into one whose device state exists.
  ampfuse::GradScaler fresh(ampfuse::GradScalerOptions().init_scale(1.0));
  ampfuse::GradScaler live(ampfuse::GradScalerOptions().init_scale(1.0));
  live.scale(at::ones({}));
  torch::load(fresh, stream);
  stream.clear();
  stream.seekg(0);
  torch::load(live, stream);
  EXPECT_EQ(fresh.get_scale(), a.get_scale());
  EXPECT_EQ(fresh.options().hysteresis(), 3);
  EXPECT_EQ(fresh.options().min_scale(), std::optional<double>(1.0));
  EXPECT_EQ(fresh.get_growth_interval(), 2);
  for (auto* s : {&fresh, &live}) {
    EXPECT_TRUE(bitwise_equal(s->stats(), a.stats()));
    EXPECT_EQ(s->get_growth_tracker(), a.get_growth_tracker());
  }
  // Continue all three identically (the hysteresis budget travelled too).
  for (int k = 5; k < 12; ++k) {
    const bool overflow = k == 6 || k == 7 || k == 8;
    for (auto* s : {&a, &fresh, &live}) {
      zero_grad(params);
      backward(*s, params, k, overflow);
      s->step(opt);
      s->update();
    }
    ASSERT_TRUE(bitwise_equal(fresh.get_scale_async(), a.get_scale_async())) << k;
    ASSERT_TRUE(bitwise_equal(live.get_scale_async(), a.get_scale_async())) << k;
    ASSERT_EQ(fresh.get_growth_tracker(), a.get_growth_tracker());
  }
  EXPECT_TRUE(bitwise_equal(fresh.stats(), a.stats()));
  EXPECT_TRUE(bitwise_equal(live.stats(), a.stats()));
}

TEST(GradScaler, LoadRunsBeforeApplyBetweenTheCheckAndTheChange) {
  ampfuse::GradScaler saved(ampfuse::GradScalerOptions().init_scale(512.0).growth_interval(3));
  saved.scale(at::ones({}));
  std::stringstream stream;
  torch::save(saved, stream);
  auto archive = [&] {
    stream.clear();
    stream.seekg(0);
    torch::serialize::InputArchive in;
    in.load_from(stream);
    return in;
  };
  ampfuse::GradScaler target(ampfuse::GradScalerOptions().init_scale(8.0));
  // before_apply throws: the checked checkpoint is not applied.
  auto in = archive();
  EXPECT_TRUE(throws_with([&] { target.load(in, [] { TORCH_CHECK(false, "refused"); }); },
                          "refused"));
  EXPECT_EQ(target.get_scale(), 8.0);
  EXPECT_EQ(target.get_growth_interval(), 2000);
  // A checkpoint the check refuses: before_apply is not run.
  torch::serialize::OutputArchive bad_out;
  saved.save(bad_out);
  bad_out.write("scale", c10::IValue(-1.0));
  std::stringstream bad_stream;
  bad_out.save_to(bad_stream);
  torch::serialize::InputArchive bad;
  bad.load_from(bad_stream);
  bool ran = false;
  EXPECT_ANY_THROW(target.load(bad, [&] { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_EQ(target.get_scale(), 8.0);
  // Otherwise before_apply runs once, then the checkpoint is applied.
  int runs = 0;
  in = archive();
  target.load(in, [&] {
    ++runs;
    EXPECT_EQ(target.get_scale(), 8.0);
  });
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(target.get_scale(), 512.0);
  EXPECT_EQ(target.get_growth_interval(), 3);
}

}  // namespace
