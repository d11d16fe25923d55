// What the op layer keeps for the kernel tables between calls, per device and stream:
//   - a persistent workspace, zeroed once and left zeroed by every kernel that uses it (the
//     kernels reset their counters), so that a call needs no memset launch;
//   - resident metadata tables: host data (e.g. the pointer table of a multi-tensor launch over
//     more tensors than fit in the kernel parameters) copied to device memory once and found
//     again by content, so an unchanged table costs a hash and a compare, not a copy.
// Both are capture-safe: under CUDA-graph capture a call gets fresh workspace that it zeroes on the
// stream (the memset is part of the graph), a resident table used by a capture is never freed,
// and a table that is not resident yet is not uploaded during a capture (the kernels then fall
// back to several launches).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>

#include "ops/kernel_api.h"
#include "ops/op_layer.h"

namespace ampfuse::detail {

class CallResources {
 public:
  // Fills the launch context of one call on `device` (made current by the caller).
  CallResources(const ops::Backend& b, const c10::Device& device);
  CallResources(const CallResources&) = delete;
  CallResources& operator=(const CallResources&) = delete;

  const kernels::LaunchContext& ctx() const { return ctx_; }

  // `bytes` of workspace for the call (null when 0); sets ctx().workspace_zeroed. Kernels of one
  // kind (`kind`: the table entry) share a layout -- which bytes they leave zeroed and which
  // they use as scratch -- so each kind has its own persistent workspace.
  enum class Kind { UnscaleCheck = 0, Optim = 1, kCount = 2 };
  void* workspace(Kind kind, size_t bytes);

  // The call failed: its kernels may have left the persistent workspace dirty; drop it.
  void failed();

 private:
  static const void* resident(void* self, const void* host, size_t bytes);

  kernels::LaunchContext ctx_;
  c10::Device device_;
  bool capturing_;
  int used_persistent_ = -1;  // the kind whose persistent workspace this call used
  at::Tensor fresh_;  // this call's own workspace (during capture), kept alive for the call
};

}  // namespace ampfuse::detail
