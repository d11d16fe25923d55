// Flattening: the data of tensors as flat arrays for the kernels (ops/kernel_api.h), with
// contiguous copies for layouts a kernel cannot walk directly, written back after the kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "ops/kernel_api.h"
#include "ops/validation.h"

namespace ampfuse::detail {

// The kernels' element type of a (validated) floating-point dtype.
kernels::DType kernel_dtype(c10::ScalarType t);

// A tensor whose elements occupy exactly [data_ptr, data_ptr + numel) in memory, so that a kernel
// may treat it as a flat array: the tensor itself when it is non-overlapping and dense (contiguous,
// transposed, channels-last, ...), otherwise a contiguous copy that `finish()` writes back.
struct FlatTensor {
  at::Tensor flat;
  at::Tensor original;
  bool copied = false;
  void finish() const {
    if (copied) const_cast<at::Tensor&>(original).copy_(flat);
  }
};
FlatTensor flatten_for_kernel(const at::Tensor& t);

// The data of `t` as a flat array: t's own storage when it is non-overlapping and dense, else a
// contiguous copy kept in `copies` (call finish() on each to write mutated copies back).
void* flat_data(const at::Tensor& t, std::vector<FlatTensor>& copies);

// True when every tensor of `group` has the same sizes and strides as `ref` (elementwise kernels
// over several lists may then walk all of them as flat arrays in the same order).
bool same_layout(const at::Tensor& ref, const at::Tensor& other);

// Copies made for a row of tensors that a kernel walks in one common element order (see
// flat_pointers); finish() writes the mutated ones back.
struct FlatRow {
  std::vector<FlatTensor> tensors;
  uint32_t read_only = 0;  // bit k set: tensors[k] is not written back
  void finish() const {
    for (size_t k = 0; k < tensors.size(); ++k) {
      if (!((read_only >> k) & 1u)) tensors[k].finish();
    }
  }
};

// Data pointers of n same-shaped tensors that an elementwise kernel walks in one element order:
// the tensors' own data when all are non-overlapping and dense with the first one's strides,
// otherwise contiguous copies, kept (and later written back, except the read_only ones) in
// `copies`.
void flat_pointers(const at::Tensor* const* row, int n, uint32_t read_only, void** out,
                   std::vector<FlatRow>& copies);

// Pointers of optimizer row i: out[0] param, out[1] grad, out[2] master (null if none), out[3 + k]
// state k (null if absent), through flat_pointers (the grad is read-only).
constexpr int kRowPointers = 6;
void row_pointers(const OptimLists& l, size_t i, void** out, std::vector<FlatRow>& copies);

}  // namespace ampfuse::detail
