#include "ops/flatten.h"

#include <c10/util/Exception.h>

namespace ampfuse::detail {

kernels::DType kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return kernels::DType::Half;
    case c10::kBFloat16: return kernels::DType::BFloat16;
    case c10::kFloat: return kernels::DType::Float;
    case c10::kDouble: return kernels::DType::Double;
    default: TORCH_INTERNAL_ASSERT(false, "unsupported dtype reached a kernel: ", t);
  }
}

FlatTensor flatten_for_kernel(const at::Tensor& t) {
  FlatTensor out;
  out.original = t;
  if (t.is_non_overlapping_and_dense()) {
    out.flat = t;
  } else {
    out.flat = t.contiguous();
    out.copied = true;
  }
  return out;
}

void* flat_data(const at::Tensor& t, std::vector<FlatTensor>& copies) {
  if (t.is_non_overlapping_and_dense()) return t.data_ptr();
  copies.push_back(flatten_for_kernel(t));
  return copies.back().flat.data_ptr();
}

bool same_layout(const at::Tensor& ref, const at::Tensor& other) {
  return ref.sizes() == other.sizes() && (ref.numel() <= 1 || ref.strides() == other.strides());
}

void flat_pointers(const at::Tensor* const* row, int n, uint32_t read_only, void** out,
                   std::vector<FlatRow>& copies) {
  bool flat = true;
  for (int k = 0; k < n && flat; ++k) {
    flat = row[k]->is_non_overlapping_and_dense() && same_layout(*row[0], *row[k]);
  }
  auto ptr = [&](const at::Tensor& t, int k) -> void* {
    return ((read_only >> k) & 1u) ? const_cast<void*>(t.const_data_ptr()) : t.data_ptr();
  };
  if (flat) {
    for (int k = 0; k < n; ++k) out[k] = ptr(*row[k], k);
    return;
  }
  FlatRow copy;
  copy.read_only = read_only;
  for (int k = 0; k < n; ++k) {
    const at::Tensor& t = *row[k];
    const bool contiguous = t.is_contiguous();
    copy.tensors.push_back(FlatTensor{contiguous ? t : t.contiguous(), t, !contiguous});
    out[k] = ptr(copy.tensors.back().flat, k);
  }
  copies.push_back(std::move(copy));
}

void row_pointers(const OptimLists& l, size_t i, void** out, std::vector<FlatRow>& copies) {
  const at::Tensor* row[kRowPointers];
  int slot[kRowPointers];
  int n = 0;
  auto add = [&](const at::Tensor& t, int s) {
    row[n] = &t;
    slot[n++] = s;
  };
  add(l.params[i], 0);
  add(l.grads[i], 1);
  if (!l.masters.empty()) add(l.masters[i], 2);
  for (size_t k = 0; k < l.states.size(); ++k) {
    if (!l.states[k].empty()) add(l.states[k][i], 3 + static_cast<int>(k));
  }
  void* ptrs[kRowPointers];
  flat_pointers(row, n, /*read_only=*/1u << 1, ptrs, copies);
  for (int k = 0; k < kRowPointers; ++k) out[k] = nullptr;
  for (int k = 0; k < n; ++k) out[slot[k]] = ptrs[k];
}

}  // namespace ampfuse::detail
