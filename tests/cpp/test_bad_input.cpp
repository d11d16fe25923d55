// Bad input at the C++ API's entry points (the counterpart of tests/test_bad_input.py): every
// call is refused with a message naming what was wrong, and nothing changes.
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ampfuse/ampfuse.h"
#include "test_utils.h"

namespace {

using ampfuse_test::bitwise_equal;
using ampfuse_test::clone_all;
using ampfuse_test::throws_with;

struct Case {
  std::string name;
  std::function<void()> call;
  std::string needle;
};

// Runs every case, checking its message and that `watched` tensors keep their bytes.
void run_cases(const std::vector<Case>& cases, const std::vector<at::Tensor>& watched) {
  for (const auto& c : cases) {
    const auto before = clone_all(watched);
    EXPECT_TRUE(throws_with(c.call, c.needle)) << c.name;
    for (size_t i = 0; i < watched.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(watched[i], before[i])) << c.name << ": tensor " << i << " changed";
    }
  }
}

TEST(BadInput, Ops) {
  auto a = at::randn({8});
  auto b = at::randn({8}).to(at::kHalf);
  auto fi = at::zeros({1});
  auto inv = at::full({1}, 0.5);
  auto step = at::zeros({});
  auto m = at::zeros({8});
  auto v = at::zeros({8});
  auto acc = at::zeros({8});
  auto scale = at::full({1}, 1024.0);
  auto tracker = at::zeros({1}, at::kInt);
  const auto expanded = at::randn({1}).expand({8});
  run_cases(
      {
          {"int64 tensor", [&] { ampfuse::unscale_check_({a, at::ones({2}, at::kLong)}, fi, inv); },
           "tensors[1] has dtype torch.int64"},
          {"found_inf dtype", [&] { ampfuse::unscale_check_({a}, at::zeros({1}, at::kDouble), inv); },
           "found_inf must be a torch.float32 tensor"},
          {"same tensor twice", [&] { ampfuse::unscale_check_({a, a}, fi, inv); },
           "tensors[0] and tensors[1] share memory"},
          {"expanded", [&] { ampfuse::unscale_check_({a, expanded}, fi, inv); },
           "tensors[1] has internally overlapping memory"},
          {"norm type", [&] { ampfuse::check_norm_({a}, fi, inv, 1.0); },
           "norm_type must be 2.0 or inf, got 1"},
          {"max norm", [&] { ampfuse::check_norm_({a}, fi, inv, 2.0, -1.0); },
           "max_norm must be a positive finite number, got -1"},
          {"accumulate dtype", [&] { ampfuse::accumulate_grads_({b}, {b}, fi); },
           "accumulators[0] has dtype torch.float16"},
          {"accumulate shapes", [&] { ampfuse::accumulate_grads_({acc}, {at::randn({9})}, fi); },
           "accumulators[0] has shape [8] but grads[0] has shape [9]"},
          {"update growth", [&] { ampfuse::update_scale_(scale, tracker, fi, 1.0, 0.5, 10); },
           "growth_factor must be a finite number > 1.0, got 1"},
          {"update hysteresis", [&] {
             ampfuse::UpdateScaleOptions o;
             o.hysteresis = 2;
             ampfuse::update_scale_(scale, tracker, fi, 2.0, 0.5, 10, o);
           },
           "hysteresis_tracker (a 1-element torch.int32 tensor"},
          {"sgd momentum buffers", [&] {
             ampfuse::SgdStepOptions o;
             o.momentum = 0.9;
             ampfuse::sgd_step_({a}, {at::randn({8})}, {}, {}, {step}, o);
           },
           "momentum_buffers must have one tensor per param when momentum != 0"},
          {"adam beta2", [&] {
             ampfuse::AdamStepOptions o;
             o.beta2 = 1.0;
             ampfuse::adam_step_({a}, {at::randn({8})}, {}, {m}, {v}, {}, {step}, o);
           },
           "beta2 must be in [0, 1), got 1"},
          {"adam param is grad", [&] {
             ampfuse::adam_step_({a}, {a}, {}, {m}, {v}, {}, {step}, ampfuse::AdamStepOptions());
           },
           "params[0] and grads[0] share memory"},
      },
      {a, b, fi, step, m, v, acc, scale, tracker});
}

TEST(BadInput, GradScaler) {
  using O = ampfuse::GradScalerOptions;
  auto p = at::randn({4}).set_requires_grad(true);
  ampfuse::optim::SGD opt({p}, ampfuse::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler(O().init_scale(8.0));
  scaler.scale((p * 2).sum()).backward();
  scaler.unscale_(opt);
  const at::Tensor grad = p.grad();
  run_cases(
      {
          {"growth factor", [] { ampfuse::GradScaler s(O().growth_factor(1.0)); },
           "The growth factor must be > 1.0."},
          {"hysteresis", [] { ampfuse::GradScaler s(O().hysteresis(0)); },
           "hysteresis must be an integer >= 1, got 0."},
          {"min scale above float range", [] { ampfuse::GradScaler s(O().min_scale(1e39)); },
           "(the float32 range), got 1e+39."},
          {"min above max", [] { ampfuse::GradScaler s(O().min_scale(4.0).max_scale(2.0)); },
           "min_scale (4.0) must not be greater than max_scale (2.0)."},
          {"unscale twice", [&] { scaler.unscale_(opt); },
           "unscale_() has already been called on this optimizer since the last update()."},
          {"clip after unscale", [&] { scaler.unscale_and_clip_(opt, 1.0); },
           "unscale_() has already been called"},
          {"max_norm", [&] {
             ampfuse::GradScaler s(O().init_scale(8.0));
             s.scale(at::ones({}));
             s.unscale_and_clip_(opt, -2.0);
           },
           "max_norm must be a positive finite number, got -2"},
          {"update without checks", [] {
             ampfuse::GradScaler s;
             s.scale(at::ones({}));
             s.update();
           },
           "No inf checks were recorded prior to update."},
          {"closure", [&] { scaler.step(opt, [] { return at::ones({}); }); },
           "Closure use is not currently supported if GradScaler is enabled."},
      },
      {p, grad, scaler.get_scale_async()});
  EXPECT_EQ(scaler.get_scale(), 8.0);
}

TEST(BadInput, GradScalerLoadChecksFirst) {
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(64.0).hysteresis(2));
  scaler.scale(at::ones({}));
  auto load_with = [&](const std::function<void(torch::serialize::OutputArchive&)>& write) {
    torch::serialize::OutputArchive out;
    write(out);
    std::stringstream buf;
    out.save_to(buf);
    torch::serialize::InputArchive in;
    in.load_from(buf);
    scaler.load(in);
  };
  auto base = [](torch::serialize::OutputArchive& out, double scale, int64_t hysteresis) {
    out.write("scale", c10::IValue(scale));
    out.write("growth_factor", c10::IValue(2.0));
    out.write("backoff_factor", c10::IValue(0.5));
    out.write("growth_interval", c10::IValue(int64_t{10}));
    out.write("_growth_tracker", c10::IValue(int64_t{0}));
    out.write("hysteresis", c10::IValue(hysteresis));
  };
  EXPECT_TRUE(throws_with([&] { load_with([&](auto& out) { base(out, 8.0, 0); }); },
                          "hysteresis must be an integer in [1, 2147483647], got 0."));
  EXPECT_TRUE(throws_with([&] { load_with([&](auto& out) { base(out, -1.0, 1); }); },
                          "the checkpoint's scale must be a positive finite number that float32 holds, got -1"));
  EXPECT_TRUE(throws_with([&] {
                load_with([&](auto& out) {
                  base(out, 8.0, 1);
                  out.write("stats", c10::IValue(at::tensor({1, -2, 0, 0}, at::kLong)));
                });
              },
                          "the checkpoint's stats must be 4 non-negative integers, got tensor([1, -2, 0, 0])"));
  EXPECT_EQ(scaler.get_scale(), 64.0);
  EXPECT_EQ(scaler.options().hysteresis(), 2);
}

TEST(BadInput, Optimizers) {
  auto p = at::randn({5}).to(at::kBFloat16).set_requires_grad(true);
  run_cases(
      {
          {"lr", [&] { ampfuse::optim::SGD o({p}, ampfuse::optim::SGDOptions(-1.0)); },
           "lr must be >= 0, got -1"},
          {"betas", [&] {
             ampfuse::optim::Adam o({p}, ampfuse::optim::AdamOptions(1e-3).betas({1.0, 0.9}));
           },
           "betas[0] must be in [0, 1), got 1"},
          {"int param", [&] {
             ampfuse::optim::AdamW o({at::zeros({3}, at::kLong)}, ampfuse::optim::AdamWOptions());
           },
           "has dtype torch.int64; ampfuse optimizers support"},
      },
      {p});
}

TEST(BadInput, Accumulator) {
  auto p = at::randn({5}).to(at::kBFloat16).set_requires_grad(true);
  ampfuse::optim::SGD opt({p}, ampfuse::optim::SGDOptions(0.1));
  ampfuse::GradScaler scaler;
  ampfuse::GradAccumulator acc(opt, &scaler, 3);
  acc.backward((p.to(at::kFloat) * 2).sum());
  run_cases(
      {
          {"steps", [&] { ampfuse::GradAccumulator a(opt, nullptr, 0); },
           "steps must be an integer >= 1, got 0."},
          {"max_grad_norm", [&] {
             ampfuse::GradAccumulator a(opt, nullptr,
                                        ampfuse::GradAccumulatorOptions(2).max_grad_norm(-1.0));
           },
           "max_grad_norm must be a positive finite number"},
          {"undefined loss", [&] { acc.backward(at::Tensor()); },
           "GradAccumulator::backward: loss must be a defined tensor."},
          {"load steps", [&] {
             torch::serialize::OutputArchive out;
             out.write("steps", c10::IValue(int64_t{7}));
             std::stringstream buf;
             out.save_to(buf);
             torch::serialize::InputArchive in;
             in.load_from(buf);
             acc.load(in);
           },
           "The checkpoint was saved with steps=7, this accumulator has steps=3."},
      },
      {p});
  EXPECT_EQ(acc.micro_step(), 1);
}

}  // namespace
