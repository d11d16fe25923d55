// The one TORCH_LIBRARY(ampfuse, m) block: every ampfuse op's schema, one comment per op.
// Kernels are registered per backend in csrc/cpu/ops_cpu.cpp and csrc/cuda/ops_cuda.cpp.
#include <torch/library.h>

#include "ampfuse/ops.h"

TORCH_LIBRARY(ampfuse, m) {
  // Unscale every tensor in place by inv_scale; found_inf := 1 if any element is inf/NaN (never
  // reset). Same arguments and semantics as torch._amp_foreach_non_finite_check_and_unscale_.
  m.def("unscale_check_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  // unscale_check_ plus global norm (2 or inf, fp32) and clip coefficient in the same pass;
  // optional per-tensor non-finite flags. Returns (total_norm, clip_coef).
  m.def(
      "unscale_check_norm_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale, *, "
      "float norm_type=2., float? max_norm=None, Tensor(c!)? per_tensor_found_inf=None) "
      "-> (Tensor, Tensor)");
  // Read-only unscale_check_norm_: checks and measures the unscaled values, writes no tensor.
  m.def(
      "check_norm_(Tensor[] tensors, Tensor(b!) found_inf, Tensor inv_scale, *, "
      "float norm_type=2., float? max_norm=None, Tensor(c!)? per_tensor_found_inf=None) "
      "-> (Tensor, Tensor)");
  // Dynamic loss-scale update on device; torch._amp_update_scale_'s arguments plus hysteresis,
  // scale bounds and optional counters.
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, "
      "float scale_growth_factor, float scale_backoff_factor, int growth_interval, *, "
      "int hysteresis=1, Tensor(c!)? hysteresis_tracker=None, bool consecutive_hysteresis=False, "
      "float? min_scale=None, float? max_scale=None, Tensor(d!)? stats=None) -> ()");
}

namespace ampfuse {

bool ensure_registered() { return true; }

const char* built_with_torch_version() { return AMPFUSE_TORCH_VERSION; }

}  // namespace ampfuse

// For Python: read through ctypes to detect a library built against another torch.
extern "C" __attribute__((visibility("default"))) const char* ampfuse_torch_version() {
  return AMPFUSE_TORCH_VERSION;
}
