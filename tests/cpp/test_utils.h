// Helpers shared by the C++ API tests.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ampfuse_test {

// Same dtype, shape and bytes (NaNs with equal payloads compare equal).
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  if (a.numel() == 0) return true;
  return at::equal(a.contiguous().reshape({-1}).view(at::kByte), b.contiguous().reshape({-1}).view(at::kByte));
}

// Runs `fn`, expecting a c10::Error whose message contains `needle`.
template <typename Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::string& needle) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    if (msg.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "message does not contain \"" << needle
                                         << "\": " << e.msg();
  }
  return ::testing::AssertionFailure() << "no error thrown (expected \"" << needle << "\")";
}

inline std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

}  // namespace ampfuse_test
