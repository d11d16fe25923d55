// A fixed sequence of mixed-precision steps through the C++ API, for the cross-language test
// (tests/test_cpp_crosslang.py runs the same sequence through the Python API and compares every
// tensor bitwise). Writes its inputs and results with torch::pickle_save (torch.load reads it).
//
// The sequence, on the CPU: bf16 params, AdamW with fp32 masters, a GradScaler with hysteresis
// and a short growth interval, overflows injected into two iterations, unscale_and_clip_ on some;
// then a GradAccumulator (2 micro-batches, clipping) over three windows with one overflow; then a
// run with remainders and bf16 moments whose mid-window checkpoint is loaded into fresh objects;
// then 8-bit moments (a param past the 8-bit threshold and a small one), an overflow, and an
// optimizer checkpoint loaded into a fresh optimizer.
//
// Usage: ampfuse_crosslang OUTPUT_FILE
#include <ATen/ATen.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>

#include "ampfuse/ampfuse.h"

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{7, 5}, {5}, {33}};
const float kInf = std::numeric_limits<float>::infinity();
const int64_t kMicro3 = 16;
const int64_t kResumeAfter3 = 7;  // inside the third window

at::Tensor loss_of(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& xs) {
  at::Tensor loss = at::zeros({});
  for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i].to(at::kFloat) * xs[i]).sum();
  return loss;
}

// An object's checkpoint through its own save() (an optimizer's, an accumulator's), as bytes, and
// back into another object through its load().
template <typename T>
std::string saved_bytes(T& object) {
  std::ostringstream out;
  torch::serialize::OutputArchive archive;
  object.save(archive);
  archive.save_to(out);
  return out.str();
}

template <typename T>
void load_bytes(T& object, const std::string& bytes) {
  std::istringstream in(bytes);
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  object.load(archive);
}

// Each param and its AdamW state, under `prefix`: the master as "master" (fp32) or "remainder".
void record_params(c10::Dict<std::string, at::Tensor>& out, const std::string& prefix,
                   const std::vector<at::Tensor>& params, const ampfuse::optim::AdamW& opt) {
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& s = static_cast<const ampfuse::optim::AdamParamState&>(
        *opt.state().at(params[i].unsafeGetTensorImpl()));
    const std::string n = std::to_string(i);
    out.insert(prefix + "param/" + n, params[i].detach().clone());
    if (s.master_param().defined()) out.insert(prefix + "master/" + n, s.master_param().clone());
    if (s.master_remainder().defined()) out.insert(prefix + "remainder/" + n, s.master_remainder().clone());
    out.insert(prefix + "exp_avg/" + n, s.exp_avg().clone());
    out.insert(prefix + "exp_avg_sq/" + n, s.exp_avg_sq().clone());
    out.insert(prefix + "step/" + n, s.step().clone());
  }
}

}  // namespace

// Params stepped `steps` times through a GradScaler of `init_scale` on the inputs `inputs(step)`
// (recorded as "<tag>/<step>/<i>"); after step `checkpoint_after` the optimizer's checkpoint is
// loaded into a fresh optimizer, `build(params, false)`, over copies of the params. Returns it.
template <class Build, class Inputs>
auto scaled_run_with_checkpoint(c10::Dict<std::string, at::Tensor>& out, const std::string& tag,
                                std::vector<at::Tensor>& params, const Build& build, double init_scale, int steps,
                                int checkpoint_after, const Inputs& inputs) {
  auto opt = build(params, true);
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(init_scale));
  for (int step = 0; step < steps; ++step) {
    const std::vector<at::Tensor> xs = inputs(step);
    for (size_t i = 0; i < xs.size(); ++i) out.insert(tag + "/" + std::to_string(step) + "/" + std::to_string(i), xs[i]);
    scaler.scale(loss_of(params, xs)).backward();
    scaler.step(*opt);
    scaler.update();
    opt->zero_grad();
    if (step == checkpoint_after) {
      const std::string saved = saved_bytes(*opt);
      std::vector<at::Tensor> fresh;
      for (const auto& p : params) fresh.push_back(p.detach().clone().set_requires_grad(true));
      params = fresh;
      opt = build(params, false);
      load_bytes(*opt, saved);
    }
  }
  return opt;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_FILE\n", argv[0]);
    return 2;
  }
  c10::Dict<std::string, at::Tensor> out;
  at::manual_seed(0);
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    params.push_back((at::randn(kShapes[i]) * 0.5).to(at::kBFloat16).set_requires_grad(true));
    out.insert("init/" + std::to_string(i), params.back().detach().clone());
  }
  ampfuse::optim::AdamW opt(params, ampfuse::optim::AdamWOptions(1e-2)
                                        .betas(std::make_tuple(0.9, 0.99))
                                        .eps(1e-6)
                                        .weight_decay(0.05));
  ampfuse::GradScaler scaler(
      ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(2).hysteresis(2));

  // Phase 1: scaler + optimizer, 8 iterations.
  for (int step = 0; step < 8; ++step) {
    std::vector<at::Tensor> xs;
    for (size_t i = 0; i < kShapes.size(); ++i) xs.push_back(at::randn(kShapes[i]) * 4);
    if (step == 3 || step == 4) xs[1].view({-1})[2] = kInf;
    if (step == 6) xs[2].view({-1})[0] = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i < xs.size(); ++i) {
      out.insert("x/" + std::to_string(step) + "/" + std::to_string(i), xs[i]);
    }
    scaler.scale(loss_of(params, xs)).backward();
    if (step % 3 == 1) {
      out.insert("norm/" + std::to_string(step), scaler.unscale_and_clip_(opt, 0.5).clone());
    }
    scaler.step(opt);
    scaler.update();
    out.insert("scale/" + std::to_string(step), scaler.get_scale_async().clone());
    out.insert("found_inf/" + std::to_string(step), scaler.last_found_inf()->clone());
    opt.zero_grad();
  }

  // Phase 2: accumulation, 2 micro-batches per window, clipping, an overflow in window 2.
  {
    ampfuse::GradAccumulator acc(opt, &scaler,
                                 ampfuse::GradAccumulatorOptions(2).max_grad_norm(1.0));
    for (int k = 0; k < 6; ++k) {
      std::vector<at::Tensor> xs;
      for (size_t i = 0; i < kShapes.size(); ++i) xs.push_back(at::randn(kShapes[i]) * 4);
      if (k == 2) xs[0].view({-1})[4] = -kInf;
      for (size_t i = 0; i < xs.size(); ++i) {
        out.insert("x2/" + std::to_string(k) + "/" + std::to_string(i), xs[i]);
      }
      acc.backward(loss_of(params, xs));
      out.insert("scale2/" + std::to_string(k), scaler.get_scale_async().clone());
    }
  }

  // Phase 3: a resumed run. bf16 params with 16-bit remainders and bf16 moments, windows of 3
  // micro-batches with overflows at seeded places; a checkpoint taken inside a window is loaded
  // into a fresh optimizer, scaler and accumulator, which carry on.
  {
    std::vector<at::Tensor> p3;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      p3.push_back((at::randn(kShapes[i]) * 0.5).to(at::kBFloat16).set_requires_grad(true));
      out.insert("init3/" + std::to_string(i), p3.back().detach().clone());
    }
    const auto options = ampfuse::optim::AdamWOptions(3e-3)
                             .weight_decay(0.01)
                             .master_remainders(true)
                             .state_dtype(at::kBFloat16);
    const auto acc_options = ampfuse::GradAccumulatorOptions(3).max_grad_norm(0.7);
    const auto scaler_options = ampfuse::GradScalerOptions().init_scale(256.0).growth_interval(2);
    // Per micro-batch: 0 nothing, 1 an inf, 2 a NaN in one gradient.
    const at::Tensor faults = (at::rand({kMicro3}) < 0.2).to(at::kLong) * at::randint(1, 3, {kMicro3});
    faults[6] = 2;  // the checkpoint is taken inside a window that has overflowed
    out.insert("faults3", faults);
    auto opt3 = std::make_unique<ampfuse::optim::AdamW>(p3, options);
    auto scaler3 = std::make_unique<ampfuse::GradScaler>(scaler_options);
    auto acc3 = std::make_unique<ampfuse::GradAccumulator>(*opt3, scaler3.get(), acc_options);
    for (int64_t k = 0; k < kMicro3; ++k) {
      std::vector<at::Tensor> xs;
      for (size_t i = 0; i < kShapes.size(); ++i) xs.push_back(at::randn(kShapes[i]) * 4);
      const int64_t fault = faults[k].item<int64_t>();
      if (fault != 0) {
        xs[k % kShapes.size()].view({-1})[1] =
            fault == 1 ? kInf : std::numeric_limits<float>::quiet_NaN();
      }
      for (size_t i = 0; i < xs.size(); ++i) {
        out.insert("x3/" + std::to_string(k) + "/" + std::to_string(i), xs[i]);
      }
      acc3->backward(loss_of(p3, xs));
      out.insert("scale3/" + std::to_string(k), scaler3->get_scale_async().clone());
      if (k == kResumeAfter3) {
        const std::string saved = saved_bytes(*acc3);
        acc3.reset();
        scaler3.reset();
        opt3.reset();
        std::vector<at::Tensor> fresh;
        for (const auto& p : p3) fresh.push_back(p.detach().clone().set_requires_grad(true));
        p3 = fresh;
        opt3 = std::make_unique<ampfuse::optim::AdamW>(p3, options);
        scaler3 = std::make_unique<ampfuse::GradScaler>(scaler_options);
        acc3 = std::make_unique<ampfuse::GradAccumulator>(*opt3, scaler3.get(), acc_options);
        load_bytes(*acc3, saved);
      }
    }
    record_params(out, "out3/", p3, *opt3);
    out.insert("out3/scale", scaler3->get_scale_async().clone());
    out.insert("out3/stats", scaler3->stats().clone());
    out.insert("out3/windows", at::scalar_tensor(acc3->windows(), at::kLong));
  }

  // Phase 4: 8-bit moments (uint8 first moment, e5m2 second) with remainders, one param of
  // 5,120 elements (8-bit) and one of 33 (fp32 state), an overflow at step 2, and the
  // optimizer's checkpoint after step 3 loaded into a fresh optimizer.
  {
    const std::vector<std::vector<int64_t>> shapes = {{80, 64}, {33}};
    std::vector<at::Tensor> p4;
    for (size_t i = 0; i < shapes.size(); ++i) {
      p4.push_back((at::randn(shapes[i]) * 0.5).to(at::kBFloat16).set_requires_grad(true));
      out.insert("init4/" + std::to_string(i), p4.back().detach().clone());
    }
    const auto options = ampfuse::optim::AdamWOptions(1e-2)
                             .weight_decay(0.01)
                             .master_remainders(true)
                             .state_dtype(at::kByte)
                             .exp_avg_sq_dtype(at::kFloat8_e5m2);
    const auto opt4 = scaled_run_with_checkpoint(
        out, "x4", p4, [&](std::vector<at::Tensor>& ps, bool) { return std::make_unique<ampfuse::optim::AdamW>(ps, options); },
        512.0, 6, 3, [&](int step) {
          std::vector<at::Tensor> xs;
          for (size_t i = 0; i < shapes.size(); ++i) {
            xs.push_back(at::randn(shapes[i]) * at::logspace(-3, 1, at::randn(shapes[i]).numel()).reshape(shapes[i]));
          }
          if (step == 2) xs[0].view({-1})[100] = kInf;
          return xs;
        });
    for (size_t i = 0; i < p4.size(); ++i) {
      const auto& s = static_cast<const ampfuse::optim::AdamParamState&>(
          *opt4->state().at(p4[i].unsafeGetTensorImpl()));
      const std::string n = std::to_string(i);
      out.insert("out4/param/" + n, p4[i].detach().clone());
      out.insert("out4/remainder/" + n, s.master_remainder().clone());
      out.insert("out4/exp_avg/" + n, s.exp_avg().view(at::kByte).clone());
      out.insert("out4/exp_avg_sq/" + n, s.exp_avg_sq().view(at::kByte).clone());
      if (s.exp_avg_absmax().defined()) out.insert("out4/exp_avg_absmax/" + n, s.exp_avg_absmax().clone());
      if (s.exp_avg_sq_absmax().defined()) {
        out.insert("out4/exp_avg_sq_absmax/" + n, s.exp_avg_sq_absmax().clone());
      }
      out.insert("out4/step/" + n, s.step().clone());
    }
  }

  // Phase 5: SGD with momentum on bf16 params rounded stochastically (no master), seed 123, an
  // overflow at step 1, and the optimizer's checkpoint after step 2 loaded into a fresh optimizer
  // built with another seed (the checkpoint's seed is used).
  {
    const std::vector<std::vector<int64_t>> shapes = {{300, 40}, {7}};
    std::vector<at::Tensor> p5;
    for (size_t i = 0; i < shapes.size(); ++i) {
      p5.push_back((at::randn(shapes[i]) * 0.5).to(at::kBFloat16).set_requires_grad(true));
      out.insert("init5/" + std::to_string(i), p5.back().detach().clone());
    }
    const auto options = ampfuse::optim::SGDOptions(1e-3).momentum(0.9).stochastic_rounding(true);
    const auto opt5 = scaled_run_with_checkpoint(
        out, "x5", p5,
        [&](std::vector<at::Tensor>& ps, bool first) {
          return std::make_unique<ampfuse::optim::SGD>(ps, ampfuse::optim::SGDOptions(options).rounding_seed(first ? 123 : 0));
        },
        256.0, 5, 2, [&](int step) {
          std::vector<at::Tensor> xs;
          for (const auto& shape : shapes) xs.push_back(at::randn(shape));
          if (step == 1) xs[1].view({-1})[3] = kInf;
          return xs;
        });
    for (size_t i = 0; i < p5.size(); ++i) {
      const auto& s = static_cast<const ampfuse::optim::SGDParamState&>(*opt5->state().at(p5[i].unsafeGetTensorImpl()));
      const std::string n = std::to_string(i);
      out.insert("out5/param/" + n, p5[i].detach().clone());
      out.insert("out5/momentum_buffer/" + n, s.momentum_buffer().clone());
      out.insert("out5/step/" + n, s.step().clone());
    }
  }

  record_params(out, "out/", params, opt);
  out.insert("out/scale", scaler.get_scale_async().clone());
  out.insert("out/growth_tracker", at::scalar_tensor(scaler.get_growth_tracker(), at::kLong));
  out.insert("out/stats", scaler.stats().clone());

  const std::vector<char> bytes = torch::pickle_save(c10::IValue(out));
  std::ofstream file(argv[1], std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) {
    std::fprintf(stderr, "could not write %s\n", argv[1]);
    return 1;
  }
  return 0;
}
