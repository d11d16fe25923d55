// A complete mixed-precision training program with ampfuse's C++ API: an MLP learns a random
// teacher network from synthetic data with low-precision weights (fp16 on CUDA, bf16 on the CPU),
// fp32 master weights kept by the fused AdamW, dynamic loss scaling and gradient accumulation.
// Two bad micro-batches (a loss of inf) are injected to show windows being skipped.
//
// Usage: train_mlp [windows]   (default 150). Exits non-zero if training did not converge or the
// skipped windows do not match the injected overflows.
#include <ampfuse/ampfuse.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>

int main(int argc, char** argv) {
  const int64_t windows = argc > 1 ? std::atoll(argv[1]) : 150;
  const int64_t accumulation_steps = 4;
  const int64_t batch = 64, in_features = 32, hidden = 64;
  const std::set<int64_t> bad_windows = {windows / 4, windows / 2};

  const bool cuda = torch::cuda::is_available();
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const torch::Dtype dtype = cuda ? torch::kHalf : torch::kBFloat16;
  torch::manual_seed(0);

  // The task: regress a fixed random teacher network (fp32).
  torch::nn::Sequential teacher(torch::nn::Linear(in_features, hidden), torch::nn::Tanh(),
                                torch::nn::Linear(hidden, 1));
  teacher->to(device);
  auto make_batch = [&](int64_t n) {
    torch::NoGradGuard no_grad;
    auto x = torch::randn({n, in_features}, device);
    return std::make_pair(x, teacher->forward(x));
  };

  // The student, in fp16/bf16. ampfuse's AdamW keeps fp32 masters and fp32 moments.
  torch::nn::Sequential model(torch::nn::Linear(in_features, hidden), torch::nn::ReLU(),
                              torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                              torch::nn::Linear(hidden, 1));
  model->to(device, dtype);
  ampfuse::optim::AdamW optimizer(model->parameters(),
                                  ampfuse::optim::AdamWOptions(3e-3).weight_decay(1e-4));
  ampfuse::GradScaler scaler(ampfuse::GradScalerOptions().init_scale(1024.0).growth_interval(50));
  ampfuse::GradAccumulator accumulator(
      optimizer, &scaler,
      ampfuse::GradAccumulatorOptions(accumulation_steps).max_grad_norm(1.0));

  auto [x_eval, y_eval] = make_batch(1024);
  auto evaluate = [&] {
    torch::NoGradGuard no_grad;
    return torch::mse_loss(model->forward(x_eval.to(dtype)).to(torch::kFloat), y_eval)
        .item<double>();
  };
  const double initial = evaluate();
  std::printf("ampfuse %s, torch %s, device %s, weights %s, fp32 masters, %lld micro-batches per step\n",
              "C++ API", ampfuse::built_with_torch_version(), cuda ? "cuda" : "cpu",
              cuda ? "fp16" : "bf16", static_cast<long long>(accumulation_steps));
  std::printf("%8s %12s %10s %10s\n", "window", "train loss", "scale", "skipped");

  torch::Tensor window_loss = torch::zeros({}, device);
  for (int64_t window = 0; window < windows; ++window) {
    for (int64_t micro = 0; micro < accumulation_steps; ++micro) {
      auto [x, y] = make_batch(batch);
      torch::Tensor loss = torch::mse_loss(model->forward(x.to(dtype)).to(torch::kFloat), y);
      window_loss += loss.detach();
      if (micro == 1 && bad_windows.count(window) != 0) {
        loss = loss * std::numeric_limits<float>::infinity();  // a bad batch: overflow
      }
      accumulator.backward(loss);  // steps (or skips) at the end of the window
    }
    if ((window + 1) % 25 == 0 || window == 0) {
      // Host reads for the report only; the training step itself never waits for the device.
      std::printf("%8lld %12.5f %10.0f %10lld\n", static_cast<long long>(window + 1),
                  window_loss.item<double>() / accumulation_steps, scaler.get_scale(),
                  static_cast<long long>(
                      scaler.stats()[static_cast<int64_t>(ampfuse::ScaleStat::kOverflows)]
                          .item<int64_t>()));
    }
    window_loss.zero_();
  }

  const double final_loss = evaluate();
  const int64_t skipped =
      scaler.stats()[static_cast<int64_t>(ampfuse::ScaleStat::kOverflows)].item<int64_t>();
  auto first = model->parameters()[0];
  auto& state = static_cast<ampfuse::optim::AdamParamState&>(
      *optimizer.state().at(first.unsafeGetTensorImpl()));
  const bool masters_ok = state.master_param().scalar_type() == torch::kFloat &&
                          torch::equal(state.master_param().to(dtype), first.detach());
  std::printf("eval loss %.5f -> %.5f, skipped windows %lld (injected %zu), final scale %.0f, "
              "params == masters rounded: %s\n",
              initial, final_loss, static_cast<long long>(skipped), bad_windows.size(),
              scaler.get_scale(), masters_ok ? "yes" : "no");
  if (!(final_loss < 0.25 * initial) || skipped != static_cast<int64_t>(bad_windows.size()) ||
      !masters_ok) {
    std::printf("FAILED\n");
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
