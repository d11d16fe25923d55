// The two registrations that run no kernel:
//   Meta: validation only, with the outputs' shapes and dtypes. torch.compile and FakeTensorMode
//     use it, so a call that a real kernel would reject fails while tracing, with the same message
//     (one source of truth for the checks: ops/validation.cpp).
//   CompositeExplicitAutograd: what the dispatcher runs when no tensor argument names a backend
//     (an optimizer step over empty lists: validated, then nothing to do) and for devices ampfuse
//     has no kernels for (validated, then a clear error naming the device).
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "ops/op_layer.h"

namespace ampfuse::ops {
namespace {

kernels::LaunchContext no_kernels(const c10::Device& device) {
  TORCH_CHECK(false, "ampfuse has no kernels for tensors on ", device,
              "; its ops run on CPU and CUDA tensors.");
}

const kernels::KernelTable& no_table() {
  TORCH_CHECK(false, "ampfuse has no kernels for this device; its ops run on CPU and CUDA tensors.");
}

constexpr Backend kMeta{nullptr, nullptr, nullptr};
constexpr Backend kNoKernels{&no_table, &no_kernels, nullptr};

}  // namespace
}  // namespace ampfuse::ops

TORCH_LIBRARY_IMPL(ampfuse, Meta, m) { ampfuse::ops::register_kernels<ampfuse::ops::kMeta>(m); }

TORCH_LIBRARY_IMPL(ampfuse, CompositeExplicitAutograd, m) {
  ampfuse::ops::register_kernels<ampfuse::ops::kNoKernels>(m);
}
