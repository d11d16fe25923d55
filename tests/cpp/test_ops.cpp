// The ops called from C++ through ampfuse/ops.h (the dispatcher), against ATen's reference ops.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <limits>

#include "ampfuse/ops.h"

namespace {

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         (a.numel() == 0 || at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte)));
}

std::vector<at::Tensor> sample(bool nonfinite) {
  at::manual_seed(0);
  std::vector<at::Tensor> ts = {
      at::randn({1000}) * 100,
      (at::randn({33, 17}) * 100).to(at::kHalf).t(),
      (at::randn({4097}) * 100).to(at::kBFloat16),
      (at::randn({5}) * 100).to(at::kDouble),
      at::randn({0, 4}),
      (at::randn({64}) * 100).slice(0, 0, 64, 2),  // non-dense
  };
  if (nonfinite) ts[2].view({-1})[17] = std::numeric_limits<float>::infinity();
  return ts;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.clone());
  return out;
}

TEST(Ops, UnscaleCheckMatchesATen) {
  for (bool nonfinite : {false, true}) {
    auto ours = sample(nonfinite);
    auto ref = clone_all(ours);
    auto fi = at::zeros({1});
    auto fi_ref = at::zeros({1});
    auto inv = at::full({1}, 1.0 / 1024);
    ampfuse::unscale_check_(ours, fi, inv);
    for (auto& t : ref) at::_amp_foreach_non_finite_check_and_unscale_(t, fi_ref, inv);
    for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(bitwise_equal(ours[i], ref[i])) << i;
    EXPECT_EQ(fi.item<float>(), nonfinite ? 1.0f : 0.0f);
    EXPECT_TRUE(bitwise_equal(fi, fi_ref));
  }
}

TEST(Ops, NormAndClipCoefficient) {
  auto ts = sample(false);
  auto before = clone_all(ts);
  auto fi = at::zeros({1});
  auto inv = at::full({1}, 0.5);
  auto [norm, coef] = ampfuse::check_norm_(ts, fi, inv, 2.0, 1.0);
  double expected = 0;
  for (const auto& t : before) expected += (t.to(at::kDouble) * 0.5).pow(2).sum().item<double>();
  expected = std::sqrt(expected);
  EXPECT_NEAR(norm.item<float>(), expected, 1e-5 * expected);
  EXPECT_FLOAT_EQ(coef.item<float>(), std::min(1.0f, 1.0f / (norm.item<float>() + 1e-6f)));
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(bitwise_equal(ts[i], before[i]));  // read-only
  auto [inf_norm, unused] = ampfuse::unscale_check_norm_(ts, fi, inv, INFINITY);
  float mx = 0;
  for (const auto& t : before) {
    if (t.numel()) mx = std::max(mx, (t.to(at::kFloat) * 0.5f).abs().max().item<float>());
  }
  EXPECT_EQ(inf_norm.item<float>(), mx);
}

TEST(Ops, UpdateScaleMatchesATen) {
  auto s = at::full({1}, 1024.0f);
  auto g = at::zeros({1}, at::kInt);
  auto s_ref = s.clone();
  auto g_ref = g.clone();
  for (int step = 0; step < 500; ++step) {
    auto found = at::full({1}, (step % 7 == 3 || step % 11 == 0) ? 1.0f : 0.0f);
    ampfuse::update_scale_(s, g, found, 2.0, 0.5, 3);
    at::_amp_update_scale_(s_ref, g_ref, found, 2.0, 0.5, 3);
    ASSERT_TRUE(bitwise_equal(s, s_ref)) << step;
    ASSERT_TRUE(bitwise_equal(g, g_ref)) << step;
  }
}

TEST(Ops, UpdateScaleFloorAndHysteresis) {
  auto s = at::full({1}, 4.0f);
  auto g = at::zeros({1}, at::kInt);
  auto h = at::full({1}, 2, at::kInt);
  auto stats = at::zeros({4}, at::kLong);
  ampfuse::UpdateScaleOptions o;
  o.hysteresis = 2;
  o.hysteresis_tracker = h;
  o.min_scale = 1.0;
  o.stats = stats;
  auto inf = at::ones({1});
  ampfuse::update_scale_(s, g, inf, 2.0, 0.5, 100, o);  // budget 2 -> 1: no backoff
  EXPECT_EQ(s.item<float>(), 4.0f);
  ampfuse::update_scale_(s, g, inf, 2.0, 0.5, 100, o);  // budget exhausted: 4 -> 2
  EXPECT_EQ(s.item<float>(), 2.0f);
  ampfuse::update_scale_(s, g, inf, 2.0, 0.5, 100, o);  // 2 -> 1
  ampfuse::update_scale_(s, g, inf, 2.0, 0.5, 100, o);  // clamped at min_scale
  EXPECT_EQ(s.item<float>(), 1.0f);
  auto st = stats.contiguous();
  EXPECT_EQ(st[0].item<int64_t>(), 4);  // updates
  EXPECT_EQ(st[1].item<int64_t>(), 4);  // overflows
  EXPECT_EQ(st[2].item<int64_t>(), 3);  // backoffs
  EXPECT_EQ(st[3].item<int64_t>(), 1);  // floor hits
}

TEST(Ops, DefaultFloorIsSmallestNormal) {
  auto s = at::full({1}, FLT_MIN * 4);
  auto g = at::zeros({1}, at::kInt);
  for (int i = 0; i < 10; ++i) ampfuse::update_scale_(s, g, at::ones({1}), 2.0, 0.5, 100);
  EXPECT_EQ(s.item<float>(), FLT_MIN);
}

TEST(Ops, BadInputNamesTheArgument) {
  auto ts = sample(false);
  ts.push_back(at::ones({3}, at::kLong));
  auto before = clone_all(ts);
  auto fi = at::zeros({1});
  try {
    ampfuse::unscale_check_(ts, fi, at::full({1}, 0.5));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensors[6] has dtype torch.int64"), std::string::npos)
        << e.what();
  }
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(bitwise_equal(ts[i], before[i]));
  EXPECT_THROW(ampfuse::update_scale_(at::ones({1}), at::zeros({1}, at::kInt), fi, 0.5, 0.5, 1),
               c10::Error);
}

}  // namespace
