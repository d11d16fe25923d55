// ampfuse::GradAccumulator: fp32 sums, window-level skip, constant scale inside a window, flush,
// LR scheduler, clipping without a scaler, checkpoints inside a window, torch optimizers.
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string_view>

#include "ampfuse/accumulation.h"
#include "ampfuse/grad_scaler.h"
#include "ampfuse/optim.h"
#include "test_utils.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::throws_with;

std::vector<at::Tensor> make_params(at::ScalarType dtype) {
  at::manual_seed(7);
  return {at::randn({129}).to(dtype).set_requires_grad(true),
          at::randn({6, 5}).to(dtype).set_requires_grad(true)};
}

std::vector<at::Tensor> copy_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// Micro-batch k's inputs: the loss is sum_i (p_i * x_i), so d loss / d p_i = x_i.
std::vector<at::Tensor> inputs(int k, bool overflow = false) {
  at::manual_seed(900 + k);
  std::vector<at::Tensor> xs = {at::randn({129}), at::randn({6, 5})};
  if (overflow) xs[1].view({-1})[2] = std::numeric_limits<float>::infinity();
  return xs;
}

at::Tensor loss_of(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& xs) {
  at::Tensor loss = at::zeros({});
  for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i].to(at::kFloat) * xs[i]).sum();
  return loss;
}

at::Tensor master_of(ampfuse::optim::FusedOptimizer& opt, const at::Tensor& p) {
  return static_cast<ampfuse::optim::SGDParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
      .master_param();
}

TEST(GradAccumulator, SumsLowPrecisionGradsInFp32) {
  // SGD with lr 1 and a power-of-two scale: the master moves by exactly the fp32 sum of the
  // micro-batch gradients (each rounded to bf16 by autograd), divided by the scale.
  auto params = make_params(at::kBFloat16);
  auto probe = copy_params(params);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(1.0));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(4));
  std::vector<at::Tensor> sums = {at::zeros({129}), at::zeros({6, 5})};
  std::vector<at::Tensor> masters0;
  for (const auto& p : params) masters0.push_back(p.detach().to(at::kFloat));
  for (int k = 0; k < 4; ++k) {
    auto xs = inputs(k);
    // The same backward on a copy gives the bf16 gradients the accumulator saw.
    (loss_of(probe, xs) / 4 * 1024.0f).backward();
    for (size_t i = 0; i < probe.size(); ++i) {
      sums[i] += probe[i].grad().to(at::kFloat);
      probe[i].mutable_grad() = at::Tensor();
    }
    const bool ended = acc.backward(loss_of(params, xs));
    EXPECT_EQ(ended, k == 3);
    if (k < 3) {
      // Accumulated, not stepped; the scale is constant inside the window.
      EXPECT_EQ(acc.micro_step(), k + 1);
      EXPECT_EQ(scaler.get_scale(), 1024.0);
    }
  }
  EXPECT_EQ(acc.windows(), 1);
  EXPECT_TRUE(acc.window_ended());
  ASSERT_TRUE(acc.last_window_skipped().has_value());
  EXPECT_EQ(acc.last_window_skipped()->item<float>(), 0.0f);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor expected = masters0[i] - sums[i] / 1024.0f;
    EXPECT_TRUE(bitwise_equal(master_of(opt, params[i]), expected)) << i;
    EXPECT_TRUE(bitwise_equal(params[i].detach(), expected.to(at::kBFloat16))) << i;
  }
}

namespace {

int accumulate_op_calls = 0;
int step_op_calls = 0;

std::unique_ptr<at::ObserverContext> count_ops(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  if (name == "ampfuse::accumulate_grads_") ++accumulate_op_calls;
  if (name == "ampfuse::sgd_step_" || name == "ampfuse::adam_step_") ++step_op_calls;
  return nullptr;
}

}  // namespace

// After a pass that went the validated way (the accumulate op), the micro-batch passes go through
// the native plan; a layer unfrozen mid-window sends one pass the validated way (which widens the
// layout) and the plan is rebuilt. The window's step reads the sums through the optimizer's step
// plan bound to the accumulator's plan: after a validated step per accumulator plan, no step op
// runs. The sums and masters are exact either way.
TEST(GradAccumulator, MicroBatchPassesAndWindowStepsGoThroughTheNativePlans) {
  auto params = make_params(at::kBFloat16);
  params[1].set_requires_grad(false);
  auto probe = copy_params(params);
  probe[1].set_requires_grad(false);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(1.0));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(4));
  EXPECT_FALSE(acc.has_accumulate_plan());
  std::vector<at::Tensor> expected;
  for (const auto& p : params) expected.push_back(p.detach().to(at::kFloat));
  accumulate_op_calls = step_op_calls = 0;
  const auto observer = at::addThreadLocalCallback(
      at::RecordFunctionCallback(count_ops).scopes({at::RecordScope::FUNCTION}));
  std::vector<int> validated;  // the micro-batches whose pass called the accumulate op
  std::vector<int> step_ops;   // per window, the step ops called
  for (int w = 0; w < 3; ++w) {
    std::vector<at::Tensor> sums = {at::zeros({129}), at::zeros({6, 5})};
    const int steps_before = step_op_calls;
    for (int k = 0; k < 4; ++k) {
      if (w == 1 && k == 1) {
        params[1].set_requires_grad(true);
        probe[1].set_requires_grad(true);
      }
      const auto xs = inputs(4 * w + k);
      (loss_of(probe, xs) / 4 * 1024.0f).backward();
      for (size_t i = 0; i < probe.size(); ++i) {
        if (!probe[i].grad().defined()) continue;
        sums[i] += probe[i].grad().to(at::kFloat);
        probe[i].mutable_grad() = at::Tensor();
      }
      const int before = accumulate_op_calls;
      acc.backward(loss_of(params, xs));
      if (accumulate_op_calls != before) validated.push_back(4 * w + k);
      EXPECT_TRUE(acc.has_accumulate_plan()) << w << " " << k;
    }
    step_ops.push_back(step_op_calls - steps_before);
    expected[0] = expected[0] - sums[0] / 1024.0f;
    if (w >= 1) expected[1] = expected[1] - sums[1] / 1024.0f;
    EXPECT_TRUE(bitwise_equal(master_of(opt, params[0]), expected[0])) << w;
    if (w >= 1) EXPECT_TRUE(bitwise_equal(master_of(opt, params[1]), expected[1])) << w;
    EXPECT_FALSE(opt.has_step_plan()) << "the plan is bound to the window's sums only";
  }
  at::removeCallback(observer);
  EXPECT_EQ(validated, (std::vector<int>{0, 5}));
  EXPECT_EQ(step_ops, (std::vector<int>{1, 1, 0}));
}

TEST(GradAccumulator, AnOverflowSkipsTheWholeWindow) {
  auto params = make_params(at::kBFloat16);
  auto twin = copy_params(params);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::optim::AdamW twin_opt(twin, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(1000));
  ampfuse::GradScaler twin_scaler(ampfuse::GradScalerOptions().init_scale(128.0).growth_interval(1000));
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(3));
  ampfuse::GradAccumulator twin_acc(twin_opt, &twin_scaler, ampfuse::GradAccumulatorOptions(3));
  const auto before = ampfuse_test::clone_all(params);
  for (int k = 0; k < 3; ++k) acc.backward(loss_of(params, inputs(k, /*overflow=*/k == 1)));
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], before[i]));
  EXPECT_EQ(opt.state().size(), 2u);  // state exists, untouched
  auto& s = static_cast<ampfuse::optim::AdamParamState&>(*opt.state().at(params[0].unsafeGetTensorImpl()));
  EXPECT_EQ(s.step().item<float>(), 0.0f);
  EXPECT_EQ(s.exp_avg().abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(scaler.get_scale(), 128.0);  // backed off once
  EXPECT_EQ(acc.last_window_skipped()->item<float>(), 1.0f);
  EXPECT_EQ(scaler.last_found_inf()->item<float>(), 1.0f);
  EXPECT_EQ(scaler.stats()[1].item<int64_t>(), 1);
  // The sums were reset: the next window equals a fresh accumulator's first window.
  for (int k = 3; k < 6; ++k) {
    acc.backward(loss_of(params, inputs(k)));
    twin_acc.backward(loss_of(twin, inputs(k)));
  }
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(bitwise_equal(params[i], twin[i])) << i;
  EXPECT_EQ(acc.last_window_skipped()->item<float>(), 0.0f);
}

TEST(GradAccumulator, ScaleChangesOnlyAtWindowEnds) {
  auto params = make_params(at::kHalf);
  ampfuse::optim::Adam opt(params, ampfuse::optim::AdamOptions(1e-3));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0).growth_interval(1));
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(3).max_grad_norm(1.0));
  std::vector<double> scales;
  for (int k = 0; k < 9; ++k) {
    acc.backward(loss_of(params, inputs(k)));
    scales.push_back(scaler.get_scale());
  }
  EXPECT_EQ(scales, (std::vector<double>{64, 64, 128, 128, 128, 256, 256, 256, 512}));
  EXPECT_EQ(scaler.stats()[0].item<int64_t>(), 3);  // one update per window
}

TEST(GradAccumulator, FlushStepsAnIncompleteWindowAsItsMean) {
  // 2 micro-batches of a 4-step window, flushed, equal a 2-step window on the same data.
  auto a = make_params(at::kBFloat16);
  auto b = copy_params(a);
  ampfuse::optim::AdamW oa(a, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::optim::AdamW ob(b, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(512.0));
  ampfuse::GradScaler sb(ampfuse::GradScalerOptions().init_scale(512.0));
  ampfuse::GradAccumulator acc_a(oa, &sa, ampfuse::GradAccumulatorOptions(4));
  ampfuse::GradAccumulator acc_b(ob, &sb, ampfuse::GradAccumulatorOptions(2));
  EXPECT_FALSE(acc_a.flush());  // nothing to step
  for (int k = 0; k < 2; ++k) {
    EXPECT_FALSE(acc_a.backward(loss_of(a, inputs(k))));
    acc_b.backward(loss_of(b, inputs(k)));
  }
  EXPECT_TRUE(acc_a.flush());
  EXPECT_TRUE(acc_a.window_ended());
  EXPECT_EQ(acc_a.micro_step(), 0);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
}

TEST(GradAccumulator, SchedulerAdvancesOnlyOnWindowsThatStepped) {
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.8));
  ampfuse::GradScaler scaler;
  torch::optim::StepLR sched(opt, /*step_size=*/1, /*gamma=*/0.5);
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(2));
  acc.set_lr_scheduler(&sched);
  for (int k = 0; k < 6; ++k) acc.backward(loss_of(params, inputs(k, /*overflow=*/k == 2)));
  EXPECT_EQ(acc.windows(), 3);
  EXPECT_EQ(acc.skipped_windows_host(), 1);
  // Two scheduler steps for three windows.
  auto twin_params = copy_params(params);
  ampfuse::optim::SGD twin(twin_params, ampfuse::optim::SGDOptions(0.8));
  torch::optim::StepLR twin_sched(twin, 1, 0.5);
  twin_sched.step();
  twin_sched.step();
  EXPECT_EQ(opt.param_groups()[0].options().get_lr(), twin.param_groups()[0].options().get_lr());
  twin_sched.step();
  EXPECT_NE(opt.param_groups()[0].options().get_lr(), twin.param_groups()[0].options().get_lr());
}

namespace {

// A window of two micro-batches (inputs 0 and 1) through `acc`; returns the window's mean
// gradient, each param's fp32 sum of torch's gradients of the halved losses on a copy.
std::vector<at::Tensor> window_of_two(ampfuse::GradAccumulator& acc, const std::vector<at::Tensor>& params) {
  auto probe = copy_params(params);
  std::vector<at::Tensor> sums = {at::zeros({129}), at::zeros({6, 5})};
  for (int k = 0; k < 2; ++k) {
    auto xs = inputs(k);
    (loss_of(probe, xs) / 2).backward();
    for (size_t i = 0; i < probe.size(); ++i) {
      sums[i] += probe[i].grad().to(at::kFloat);
      probe[i].mutable_grad() = at::Tensor();
    }
    acc.backward(loss_of(params, xs));
  }
  return sums;
}

}  // namespace

TEST(GradAccumulator, ClipsWithoutAScaler) {
  // bf16 training without loss scaling: the fused step takes the clip coefficient.
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(1.0));
  ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(2).max_grad_norm(0.5));
  std::vector<at::Tensor> masters0;
  for (const auto& p : params) masters0.push_back(p.detach().to(at::kFloat));
  const auto sums = window_of_two(acc, params);
  EXPECT_FALSE(acc.last_window_skipped().has_value());
  EXPECT_FALSE(opt.step_scaling().has_value());
  double sq = 0;
  for (const auto& s : sums) sq += s.to(at::kDouble).pow(2).sum().item<double>();
  const double coef = std::min(1.0, 0.5 / (std::sqrt(sq) + 1e-6));
  ASSERT_LT(coef, 1.0);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(master_of(opt, params[i]), masters0[i] - sums[i] * coef, 1e-6, 1e-6))
        << i;
  }
}

TEST(GradAccumulator, ClipsInAnyNormTheSumsTheStepReads) {
  // bf16 params, fp32 sums: a clip in a norm other than 2 or inf (torch's clip_grad_norm_) scales
  // the sums the step reads, with a scaler or without (it once clipped the emptied .grad()).
  for (const bool with_scaler : {false, true}) {
    for (const double norm_type : {1.0, 3.0}) {
      auto params = make_params(at::kBFloat16);
      ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(1.0));
      ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0));
      ampfuse::GradAccumulator acc(opt, with_scaler ? &scaler : nullptr,
                                   ampfuse::GradAccumulatorOptions(2).max_grad_norm(0.5).norm_type(norm_type));
      std::vector<at::Tensor> masters0;
      for (const auto& p : params) masters0.push_back(p.detach().to(at::kFloat));
      const auto sums = window_of_two(acc, params);
      double total = 0;
      for (const auto& s : sums) total += s.to(at::kDouble).abs().pow(norm_type).sum().item<double>();
      const double coef = std::min(1.0, 0.5 / (std::pow(total, 1.0 / norm_type) + 1e-6));
      ASSERT_LT(coef, 0.5);
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(master_of(opt, params[i]), masters0[i] - sums[i] * coef, 1e-5, 1e-6))
            << with_scaler << " " << norm_type << " " << i;
      }
    }
  }
}

TEST(GradAccumulator, WorksWithTorchOptimizers) {
  // A torch optimizer reads .grad(): it gets the fp32 sums rounded once, unscaled by the scaler.
  auto params = make_params(at::kBFloat16);
  auto probe = copy_params(params);
  auto ref = copy_params(params);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.5));
  torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.5));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0));
  ampfuse::GradAccumulator acc(opt, &scaler, ampfuse::GradAccumulatorOptions(3));
  std::vector<at::Tensor> sums = {at::zeros({129}), at::zeros({6, 5})};
  for (int k = 0; k < 3; ++k) {
    auto xs = inputs(k);
    (loss_of(probe, xs) / 3 * 64.0f).backward();
    for (size_t i = 0; i < probe.size(); ++i) {
      sums[i] += probe[i].grad().to(at::kFloat);
      probe[i].mutable_grad() = at::Tensor();
    }
    acc.backward(loss_of(params, xs));
  }
  auto found = at::zeros({1});
  for (size_t i = 0; i < ref.size(); ++i) {
    ref[i].mutable_grad() = sums[i].to(at::kBFloat16);
    at::_amp_foreach_non_finite_check_and_unscale_({ref[i].mutable_grad()}, found,
                                                   at::full({1}, 1.0f / 64));
  }
  ref_opt.step();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(params[i], ref[i])) << i;
    EXPECT_FALSE(params[i].grad().defined());  // reset after the window
  }
}

TEST(GradAccumulator, SaveLoadInsideAWindow) {
  auto a = make_params(at::kBFloat16);
  auto b = copy_params(a);
  ampfuse::optim::AdamW oa(a, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::optim::AdamW ob(b, ampfuse::optim::AdamWOptions(1e-2));
  ampfuse::GradScaler sa(ampfuse::GradScalerOptions().init_scale(128.0).growth_interval(1));
  ampfuse::GradScaler sb;
  ampfuse::GradAccumulator acc_a(oa, &sa, ampfuse::GradAccumulatorOptions(2));
  ampfuse::GradAccumulator acc_b(ob, &sb, ampfuse::GradAccumulatorOptions(2));
  for (int k = 0; k < 3; ++k) acc_a.backward(loss_of(a, inputs(k)));  // 1.5 windows
  torch::serialize::OutputArchive out;
  acc_a.save(out);
  std::stringstream stream;
  out.save_to(stream);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  acc_b.load(in);
  EXPECT_EQ(acc_b.micro_step(), 1);
  EXPECT_EQ(acc_b.windows(), 1);
  EXPECT_EQ(sb.get_scale(), sa.get_scale());
  for (int k = 3; k < 7; ++k) {
    acc_a.backward(loss_of(a, inputs(k)));
    acc_b.backward(loss_of(b, inputs(k)));
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
  EXPECT_EQ(sb.get_scale(), sa.get_scale());
  // A checkpoint for another window size is refused.
  ampfuse::GradAccumulator other(ob, &sb, ampfuse::GradAccumulatorOptions(3));
  stream.clear();
  stream.seekg(0);
  torch::serialize::InputArchive again;
  again.load_from(stream);
  EXPECT_TRUE(throws_with([&] { other.load(again); },
                          "The checkpoint was saved with steps=2, this accumulator has steps=3."));
}

TEST(GradAccumulator, BadInput) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params);
  EXPECT_TRUE(throws_with([&] { ampfuse::GradAccumulator acc(opt, nullptr, 0); },
                          "steps must be an integer >= 1, got 0."));
  EXPECT_TRUE(throws_with(
      [&] {
        ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(2).max_grad_norm(0.0));
      },
      "max_grad_norm must be a positive finite number or nullopt, got 0."));
  EXPECT_TRUE(throws_with(
      [&] { ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(2).norm_type(0.0)); },
      "norm_type must be a positive number or inf, got 0."));
  ampfuse::GradAccumulator acc(opt, nullptr, 2);
  EXPECT_TRUE(throws_with([&] { acc.backward(at::Tensor()); },
                          "GradAccumulator::backward: loss must be a defined tensor."));
}

TEST(GradAccumulator, DirectStepsReadGradAsUsual) {
  // The accumulator hands its fp32 buffers to the optimizer for its own steps only.
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.5));
  ampfuse::GradAccumulator acc(opt, nullptr, 2);
  EXPECT_FALSE(opt.grad_of(params[0]).defined());
  const at::Tensor before = params[0].detach().clone();
  for (auto& p : params) p.mutable_grad() = at::ones_like(p);
  opt.step();
  EXPECT_TRUE(bitwise_equal(params[0], (before.to(at::kFloat) - 0.5).to(at::kBFloat16)));
}

TEST(GradAccumulator, ParamWithoutGradientInAWindowIsNotStepped) {
  auto params = make_params(at::kBFloat16);
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2).weight_decay(0.1));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
  ampfuse::GradAccumulator acc(opt, &scaler, 2);
  for (int window = 0; window < 3; ++window) {
    const at::Tensor before = params[1].detach().clone();
    for (int k = 0; k < 2; ++k) {
      auto xs = inputs(10 * window + k);
      // params[1] takes part in the first window only
      at::Tensor loss = (params[0].to(at::kFloat) * xs[0]).sum();
      if (window == 0) loss = loss + (params[1].to(at::kFloat) * xs[1]).sum();
      acc.backward(loss);
    }
    EXPECT_EQ(bitwise_equal(before, params[1]), window != 0) << window;
    for (const auto& p : params) EXPECT_FALSE(p.grad().defined());
  }
}

TEST(GradAccumulator, KeepsWorkingAfterAnErrorAtAWindowEnd) {
  auto params = make_params(at::kFloat);
  ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
  ampfuse::GradAccumulator acc(opt, &scaler, 2);
  acc.backward(loss_of(params, inputs(0)));
  // A param whose dtype changed since the optimizer was built: the window's step fails.
  params[0].set_data(params[0].detach().to(at::kDouble));
  EXPECT_TRUE(throws_with([&] { acc.backward(loss_of(params, inputs(1))); },
                          "ampfuse optimizers support torch.float16"));
  params[0].set_data(params[0].detach().to(at::kFloat));
  EXPECT_EQ(acc.micro_step(), 0);
  EXPECT_TRUE(acc.window_ended());
  const at::Tensor before = params[0].detach().clone();
  for (int k = 2; k < 4; ++k) acc.backward(loss_of(params, inputs(k)));
  EXPECT_FALSE(bitwise_equal(before, params[0]));
  EXPECT_EQ(acc.windows(), 2);
}

TEST(GradAccumulator, MidWindowCheckpointKeepsFp32ParamSums) {
  // A bf16 and an fp32 param: the fp32 one accumulates in .grad(), saved inside a window too.
  auto run = [](int split) {
    at::manual_seed(3);
    std::vector<at::Tensor> params = {at::randn({129}).to(at::kBFloat16).set_requires_grad(true),
                                      at::randn({6, 5}).set_requires_grad(true)};
    auto opt = std::make_unique<ampfuse::optim::AdamW>(params, ampfuse::optim::AdamWOptions(1e-2));
    auto scaler = std::make_unique<ampfuse::GradScaler>(ampfuse::GradScalerOptions().init_scale(64.0));
    auto acc = std::make_unique<ampfuse::GradAccumulator>(*opt, scaler.get(), 3);
    for (int k = 0; k < 9; ++k) {
      if (k == split) {
        std::stringstream buf;
        {
          torch::serialize::OutputArchive out;
          acc->save(out);
          out.save_to(buf);
        }
        auto saved = ampfuse_test::clone_all(params);
        for (size_t i = 0; i < params.size(); ++i) {
          params[i] = saved[i].set_requires_grad(true);
        }
        opt = std::make_unique<ampfuse::optim::AdamW>(params, ampfuse::optim::AdamWOptions(1e-2));
        scaler = std::make_unique<ampfuse::GradScaler>();
        acc = std::make_unique<ampfuse::GradAccumulator>(*opt, scaler.get(), 3);
        torch::serialize::InputArchive in;
        in.load_from(buf);
        acc->load(in);
      }
      acc->backward(loss_of(params, inputs(k)));
    }
    return ampfuse_test::clone_all(params);
  };
  const auto ref = run(-1);
  for (int split : {1, 4, 8}) {
    const auto got = run(split);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(bitwise_equal(ref[i], got[i])) << split;
  }
}

}  // namespace

// A param frozen inside a window is stepped once with that window's gradient,
// then never again (torch's loop clears it with zero_grad() at the window end).
TEST(GradAccumulator, ParamFrozenMidWindowIsSteppedOnce) {
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(0);
    auto a = at::randn({4}).to(dtype).set_requires_grad(true);
    auto b = at::randn({4}).to(dtype).set_requires_grad(true);
    torch::optim::SGD opt({a, b}, torch::optim::SGDOptions(0.1));  // an ordinary optimizer reads .grad()
    ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(2));
    std::vector<at::Tensor> history;
    for (int window = 0; window < 3; ++window) {
      for (int micro = 0; micro < 2; ++micro) {
        at::Tensor loss = (b.to(at::kFloat) * 2).sum();
        if (a.requires_grad()) loss = loss + (a.to(at::kFloat) * 3).sum();
        acc.backward(loss);
        if (window == 0 && micro == 0) a.set_requires_grad(false);
      }
      history.push_back(a.detach().clone());
    }
    EXPECT_FALSE(a.grad().defined());
    EXPECT_TRUE(bitwise_equal(history[1], history[0])) << dtype;
    EXPECT_TRUE(bitwise_equal(history[2], history[0])) << dtype;
  }
}

// A bf16 param frozen when the accumulator was built and unfrozen later (at a
// window start or inside a window) is summed in fp32 like the others.
TEST(GradAccumulator, LayerUnfrozenLaterIsSummedInFp32) {
  for (int unfreeze_at = 0; unfreeze_at < 2; ++unfreeze_at) {
    auto p = at::zeros({3}, at::kBFloat16);
    ampfuse::optim::SGD opt({p}, ampfuse::optim::SGDOptions(1.0));
    ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(4));
    const std::vector<double> coefs = {4.0, 4.0 / 512, 4.0 / 512, 4.0 / 512};
    double expected = 0.0;
    for (int micro = 0; micro < 4; ++micro) {
      if (micro == unfreeze_at) p.set_requires_grad(true);
      at::Tensor loss = p.requires_grad() ? (p.to(at::kFloat) * coefs[micro]).sum()
                                          : at::zeros({}).set_requires_grad(true);
      if (p.requires_grad()) expected -= coefs[micro] / 4;
      acc.backward(loss);
    }
    EXPECT_TRUE(bitwise_equal(master_of(opt, p), at::full({3}, expected, at::kFloat))) << unfreeze_at;
  }
}

// Seeded random scenarios (window lengths, params frozen and
// unfrozen at random micro-batches, a zero-size param, a param without gradients, overflowing
// micro-batches, mid-window checkpoints) against torch's own loop with an ordinary optimizer and
// fp32 sums kept by hand for the bf16 param.
TEST(GradAccumulator, MatchesTorchsLoopOnRandomScenarios) {
  for (int seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    auto coin = [&] { return (rng() & 1u) != 0; };
    const int64_t steps = 1 + static_cast<int64_t>(rng() % 3);
    at::manual_seed(seed);
    std::vector<at::Tensor> ours = {at::randn({3}), at::randn({4}).to(at::kBFloat16), at::randn({0}),
                                    at::randn({2})};
    std::vector<at::Tensor> ref;
    for (auto& t : ours) {
      t.set_requires_grad(true);
      ref.push_back(t.detach().clone().set_requires_grad(true));
    }
    torch::optim::SGD opt(ours, torch::optim::SGDOptions(0.05).momentum(0.5));
    torch::optim::SGD ref_opt(ref, torch::optim::SGDOptions(0.05).momentum(0.5));
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(4.0));
    ampfuse::GradScaler ref_scaler(ampfuse::GradScalerOptions().init_scale(4.0));
    auto acc = std::make_unique<ampfuse::GradAccumulator>(opt, &scaler, ampfuse::GradAccumulatorOptions(steps));
    at::Tensor sum_b;  // the reference's fp32 sum of the bf16 param's gradients
    int64_t micro = 0;
    const int n = 1 + static_cast<int>(rng() % 9);
    for (int k = 0; k < n; ++k) {
      const int which = static_cast<int>(rng() % 2);  // a or b
      if (coin()) {
        const bool on = coin();
        ours[which].set_requires_grad(on);
        ref[which].set_requires_grad(on);
      }
      const bool overflow = rng() % 5 == 0;
      auto loss_of = [&](const std::vector<at::Tensor>& ps) {
        at::Tensor l = ps[2].sum();  // the zero-size param: always a (zero-size) gradient
        if (ps[0].requires_grad()) l = l + ps[0].pow(2).sum();
        if (ps[1].requires_grad()) l = l + (ps[1].to(at::kFloat) * 0.75).sum();
        return overflow ? l * std::numeric_limits<float>::infinity() : l;
      };
      (ref_scaler.scale(loss_of(ref) / steps)).backward();
      if (ref[1].grad().defined()) {
        sum_b = sum_b.defined() ? sum_b + ref[1].grad().to(at::kFloat) : ref[1].grad().to(at::kFloat);
        ref[1].mutable_grad() = at::Tensor();
      }
      acc->backward(loss_of(ours));
      if (++micro == steps) {
        micro = 0;
        if (sum_b.defined()) ref[1].mutable_grad() = sum_b.to(at::kBFloat16);
        sum_b = at::Tensor();
        ref_scaler.step(ref_opt);
        ref_scaler.update();
        ref_opt.zero_grad();
      } else if (coin()) {
        std::stringstream stream;
        {
          torch::serialize::OutputArchive out;
          acc->save(out);
          out.save_to(stream);
        }
        torch::serialize::InputArchive in;
        in.load_from(stream);
        acc->load(in);
      }
      for (size_t i = 0; i < ours.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(ours[i].detach(), ref[i].detach())) << "seed " << seed << " k " << k << " i " << i;
      }
    }
    EXPECT_EQ(scaler.get_scale(), ref_scaler.get_scale()) << seed;
  }
}

namespace {

// Through torch::save / torch::load, as an application saves its optimizer and scaler.
std::string save_to_string(const ampfuse::GradAccumulator& acc) {
  std::stringstream buf;
  torch::save(acc, buf);
  return buf.str();
}

void load_from_string(ampfuse::GradAccumulator& acc, const std::string& bytes) {
  std::stringstream buf(bytes);
  torch::load(acc, buf);
}

}  // namespace

// Checkpoints: a bf16 param unfrozen inside a window is buffered from then on,
// after the others (buffers in the order [b, a]); a checkpoint taken then records which params
// the buffers hold, so an accumulator built afterwards (which would buffer [a, b]) loads the sums
// into the right params.
TEST(GradAccumulator, MidWindowCheckpointRecordsTheBufferedParams) {
  auto run = [](bool checkpoint) {
    at::manual_seed(5);
    auto a = at::randn({4}).to(at::kBFloat16);
    auto b = at::randn({4}).to(at::kBFloat16).set_requires_grad(true);
    ampfuse::optim::SGD opt({a, b}, ampfuse::optim::SGDOptions(0.5));
    auto acc = std::make_unique<ampfuse::GradAccumulator>(opt, nullptr, ampfuse::GradAccumulatorOptions(4));
    for (int micro = 0; micro < 4; ++micro) {
      if (micro == 1) a.set_requires_grad(true);
      if (micro == 2 && checkpoint) {
        const std::string bytes = save_to_string(*acc);
        acc = std::make_unique<ampfuse::GradAccumulator>(opt, nullptr, ampfuse::GradAccumulatorOptions(4));
        load_from_string(*acc, bytes);
      }
      at::Tensor loss = (b.to(at::kFloat) * (micro + 5)).sum();
      if (a.requires_grad()) loss = loss + (a.to(at::kFloat) * (micro + 1) * 64).sum();
      acc->backward(loss);
    }
    return std::vector<at::Tensor>{master_of(opt, a).clone(), master_of(opt, b).clone()};
  };
  const auto ref = run(false);
  const auto got = run(true);
  EXPECT_TRUE(bitwise_equal(ref[0], got[0]));
  EXPECT_TRUE(bitwise_equal(ref[1], got[1]));
}

// A mid-window checkpoint must list the params its buffers hold; one without "buffered" is
// refused with nothing changed.
TEST(GradAccumulator, MidWindowCheckpointWithoutTheBufferedParamsIsRefused) {
  at::manual_seed(6);
  auto g = at::randn({3}).set_requires_grad(true);
  auto b = at::randn({4}).to(at::kBFloat16).set_requires_grad(true);
  ampfuse::optim::SGD opt({g, b}, ampfuse::optim::SGDOptions(0.5));
  ampfuse::GradAccumulator acc(opt, nullptr, ampfuse::GradAccumulatorOptions(2));
  std::stringstream buf;
  {
    torch::serialize::OutputArchive out;
    out.write("steps", c10::IValue(int64_t{2}));
    out.write("micro_step", c10::IValue(int64_t{1}));
    out.write("windows", c10::IValue(int64_t{0}));
    torch::serialize::OutputArchive optimizer_archive(out.compilation_unit());
    opt.save(optimizer_archive);
    out.write("optimizer", optimizer_archive);
    out.write("buffers/0", c10::IValue(at::full({4}, 1.5f)));
    out.write("found_inf/0", c10::IValue(at::zeros({})));
    out.write("has_grad", c10::IValue(at::ones({1}, at::kLong)));
    out.write("grads/0", c10::IValue(at::full({3}, 1.0f)));
    out.save_to(buf);
  }
  torch::serialize::InputArchive in;
  in.load_from(buf);
  EXPECT_TRUE(throws_with([&] { acc.load(in); }, "the checkpoint's buffered entry is missing"));
  EXPECT_EQ(acc.micro_step(), 0);
  EXPECT_FALSE(g.grad().defined());
}

// The partial sums of a window are multiplied by the loss scale when a scaler is on: a
// mid-window checkpoint and an accumulator that disagree on the scaler are refused, nothing
// changed (the sums would be off by the scale); at a window boundary either way loads.
TEST(GradAccumulator, MidWindowCheckpointAndAccumulatorDisagreeingOnTheScalerIsRefused) {
  for (const bool saved_with : {true, false}) {
    auto params = make_params(at::kBFloat16);
    ampfuse::optim::SGD opt(params, ampfuse::optim::SGDOptions(0.1));
    ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(256.0));
    ampfuse::GradAccumulator acc(opt, saved_with ? &scaler : nullptr, ampfuse::GradAccumulatorOptions(2));
    acc.backward(loss_of(params, inputs(0)));
    const std::string bytes = save_to_string(acc);
    ampfuse::GradScaler other_scaler(ampfuse::GradScalerOptions().init_scale(256.0));
    ampfuse::GradAccumulator other(opt, saved_with ? nullptr : &other_scaler, ampfuse::GradAccumulatorOptions(2));
    EXPECT_TRUE(throws_with([&] { load_from_string(other, bytes); },
                            saved_with ? "saved inside a window with an enabled GradScaler, and this accumulator has none"
                                       : "saved inside a window without an enabled GradScaler, and this accumulator has one"));
    EXPECT_EQ(other.micro_step(), 0);
    acc.backward(loss_of(params, inputs(1)));
    EXPECT_TRUE(acc.window_ended());
    load_from_string(other, save_to_string(acc));  // a window boundary: no sums
  }
}
