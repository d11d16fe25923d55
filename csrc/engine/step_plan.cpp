// The persistent step plan (see step_plan.h).
#include "engine/step_plan.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/COW.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <unordered_map>

#include "ops/flatten.h"
#include "ops/op_core.h"
#include "ops/validation.h"

namespace ampfuse::engine {

using ops::Backend;
using ops::device_backend;
namespace core = ops::core;

namespace {

// The dtypes the accumulator sums in fp32 buffers.
bool low_precision(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

// A 1-element scaling tensor as the kernels read it: fp32 on `device` (copied without a sync
// when it is elsewhere, as the Python optimizers do).
at::Tensor scalar_on(const at::Tensor& t, const c10::Device& device) {
  if (t.device() == device && t.scalar_type() == c10::kFloat) return t;
  return t.reshape({}).to(t.options().device(device).dtype(c10::kFloat), /*non_blocking=*/true);
}

std::optional<at::Tensor> scalar_on(const std::optional<at::Tensor>& t,
                                    const c10::Device& device) {
  if (!t) return std::nullopt;
  return scalar_on(*t, device);
}

}  // namespace

StepPlan::StepPlan(const std::string& kind) : kind_(&optimizer_kind(kind)) {}

void StepPlan::set_packed(int64_t group, PackedHyper hyper, std::optional<at::Tensor> lr,
                          std::optional<at::Tensor> momentum) {
  TORCH_CHECK(group >= 0, "StepPlan.set_hyper: group must be >= 0, got ", group, ".");
  TORCH_CHECK(hyper.index() == kind_->packed,
              "StepPlan.set_hyper: a ", kind_->name, " plan takes its own kind's hyper-parameters.");
  TORCH_CHECK(!lr || lr->numel() == 1, "StepPlan.set_hyper: lr must be a 1-element tensor, got "
              "shape ", lr->sizes(), ".");
  TORCH_CHECK(!momentum || momentum->numel() == 1, "StepPlan.set_hyper: momentum must be a 1-element "
              "tensor, got shape ", momentum->sizes(), ".");
  if (static_cast<size_t>(group) >= hyper_.size()) hyper_.resize(group + 1);
  hyper_[group] = GroupHyper{true, std::move(hyper), std::move(lr), std::move(momentum)};
}

std::vector<std::string> StepPlan::hyper_names() const { return kind_->hyper_names(); }

void StepPlan::set_hyper(int64_t group, const c10::Dict<std::string, double>& hyper,
                         std::optional<at::Tensor> lr, std::optional<at::Tensor> momentum) {
  set_packed(group, kind_->pack(kind_->values_by_name(hyper, "StepPlan.set_hyper")), std::move(lr),
             std::move(momentum));
}

void StepPlan::set_options(int64_t group, const c10::Dict<std::string, c10::IValue>& options,
                           std::optional<int64_t> rounding_seed, std::optional<at::Tensor> lr,
                           std::optional<at::Tensor> momentum) {
  set_packed(group, kind_->pack(kind_->values_of_options(options, rounding_seed, "StepPlan.set_options")),
             std::move(lr), std::move(momentum));
}

StepPlan::Span StepPlan::extent_of(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                                    size_t item) {
  int64_t lo = 0, hi = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t extent = (sizes[d] - 1) * strides[d];
    (extent < 0 ? lo : hi) += extent;
  }
  const auto size = static_cast<int64_t>(item);
  return Span{static_cast<uintptr_t>(lo * size), static_cast<uintptr_t>((hi + 1) * size)};
}

StepPlan::Span StepPlan::span_of(const at::Tensor& t) {
  const Span e = extent_of(t.sizes(), t.strides(), t.element_size());
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return Span{base + e.begin, base + e.end};
}

void StepPlan::add_bucket(int64_t group, std::vector<at::Tensor> params,
                          std::vector<at::Tensor> masters, std::vector<at::Tensor> state0,
                          std::vector<at::Tensor> state1, std::vector<at::Tensor> state2,
                          std::vector<at::Tensor> steps, bool fp32_grads,
                          std::vector<at::Tensor> absmax0, std::vector<at::Tensor> absmax1,
                          std::vector<at::Tensor> absmax2) {
  TORCH_CHECK(!finalized_, "StepPlan.add_bucket: the plan is finalized.");
  TORCH_CHECK(!params.empty(), "StepPlan.add_bucket: params must not be empty.");
  TORCH_CHECK(group >= 0, "StepPlan.add_bucket: group must be >= 0, got ", group, ".");
  {
    const std::vector<at::Tensor>* extra[] = {&state0, &state1, &state2, &absmax0, &absmax1, &absmax2};
    for (size_t k = kind_->states.size(); k < 3; ++k) {
      TORCH_CHECK(extra[k]->empty() && extra[k + 3]->empty(), "StepPlan.add_bucket: a ", kind_->name,
                  " plan has ", kind_->states.size(), " state list(s).");
    }
  }
  Bucket b;
  b.group = group;
  b.device = params[0].device();
  b.param_dtype = params[0].scalar_type();
  b.grad_dtype = fp32_grads ? c10::kFloat : b.param_dtype;
  b.param_meta = caffe2::TypeMeta::fromScalarType(b.param_dtype);
  b.grad_meta = caffe2::TypeMeta::fromScalarType(b.grad_dtype);
  b.backend = device_backend(b.device.type());
  TORCH_CHECK(b.backend != nullptr, "ampfuse has no kernels for tensors on ", b.device,
              "; its ops run on CPU and CUDA tensors.");
  // The op's own checks, with the params standing in for gradients of the bucket's dtype.
  std::vector<at::Tensor> probe;
  probe.reserve(params.size());
  for (const auto& p : params) probe.push_back(fp32_grads ? p.to(c10::kFloat) : p);
  b.states[0] = std::move(state0);
  b.states[1] = std::move(state1);
  b.states[2] = std::move(state2);
  b.absmaxes[0] = std::move(absmax0);
  b.absmaxes[1] = std::move(absmax1);
  b.absmaxes[2] = std::move(absmax2);
  const detail::OptimLists l = kind_->lists(params, probe, masters, b.states, b.absmaxes, steps);
  detail::check_optim_args(l, {}, std::nullopt, std::nullopt, std::nullopt);
  for (const auto& p : params) {
    b.geom_at.push_back(b.geom.size());
    b.geom.insert(b.geom.end(), p.sizes().begin(), p.sizes().end());
    b.geom.insert(b.geom.end(), p.strides().begin(), p.strides().end());
    TORCH_CHECK(p.device() == b.device && p.scalar_type() == b.param_dtype,
                "StepPlan.add_bucket: the params of a bucket must share one device and dtype.");
    TORCH_CHECK(!p.key_set().has(c10::DispatchKey::Python) && !p.is_meta(),
                "StepPlan.add_bucket: tensor subclasses (e.g. DTensor) and meta tensors go "
                "through the ops, not a plan.");
    b.data.push_back(p.const_data_ptr());
    b.extent.push_back(extent_of(p.sizes(), p.strides(), c10::elementSize(b.grad_dtype)));
  }
  b.geom_at.push_back(b.geom.size());
  b.params = std::move(params);
  b.masters = std::move(masters);
  b.steps = std::move(steps);
  b.grads.resize(b.params.size());
  b.refs.resize(b.params.size());
  b.spans.resize(b.params.size());
  b.clear_of_written.assign(b.params.size(), Span{});
  b.dtypes = core::optim_dtypes(kind_->lists(b.params, probe, b.masters, b.states, b.absmaxes, b.steps));
  // The rows, when every tensor of every row lies flat in its param's element order.
  bool flat = true;
  for (size_t i = 0; i < b.params.size() && flat; ++i) {
    const at::Tensor& p = b.params[i];
    flat = p.is_non_overlapping_and_dense();
    auto same = [&](const std::vector<at::Tensor>& list) {
      return list.empty() ||
             (list[i].is_non_overlapping_and_dense() && detail::same_layout(p, list[i]));
    };
    flat = flat && same(b.masters) && same(b.states[0]) && same(b.states[1]) && same(b.states[2]);
  }
  if (flat) {
    b.rows.resize(b.params.size());
    for (size_t i = 0; i < b.params.size(); ++i) {
      kernels::OptimTensor& o = b.rows[i];
      o.param = b.params[i].data_ptr();
      o.grad = nullptr;
      o.master = b.masters.empty() ? nullptr : b.masters[i].data_ptr();
      for (int k = 0; k < 3; ++k) o.state[k] = b.states[k].empty() ? nullptr : b.states[k][i].data_ptr();
      for (int k = 0; k < 3; ++k) {
        o.absmax[k] = b.absmaxes[k].empty() ? nullptr : b.absmaxes[k][i].mutable_data_ptr<float>();
      }
      o.step = b.steps[i].mutable_data_ptr<float>();
      o.numel = b.params[i].numel();
      for (const auto* list : {&b.masters, &b.states[0], &b.states[1], &b.states[2], &b.absmaxes[0],
                               &b.absmaxes[1], &b.absmaxes[2], &b.steps}) {
        if (!list->empty()) b.keep.push_back((*list)[i].storage());
      }
    }
    b.rows_ok = true;
  }
  num_params_ += static_cast<int64_t>(b.params.size());
  buckets_.push_back(std::move(b));
}

void StepPlan::add_idle(std::vector<at::Tensor> params) {
  TORCH_CHECK(!finalized_, "StepPlan.add_idle: the plan is finalized.");
  for (auto& p : params) idle_.push_back(std::move(p));
}

void StepPlan::bind_source(c10::intrusive_ptr<AccumulatePlan> source) {
  TORCH_CHECK(!finalized_, "StepPlan.bind_source: the plan is finalized.");
  TORCH_CHECK(source, "StepPlan.bind_source: source must be an AccumulatePlan.");
  std::unordered_map<const c10::TensorImpl*, int64_t> index;
  const auto& buffered = source->buffered_params();
  for (size_t k = 0; k < buffered.size(); ++k) {
    index.emplace(buffered[k].unsafeGetTensorImpl(), static_cast<int64_t>(k));
  }
  auto index_of = [&](const at::Tensor& p) {
    const auto it = index.find(p.unsafeGetTensorImpl());
    return it == index.end() ? int64_t{-1} : it->second;
  };
  for (auto& b : buckets_) {
    b.source_index.clear();
    bool any = false;
    for (const auto& p : b.params) {
      b.source_index.push_back(index_of(p));
      any = any || b.source_index.back() >= 0;
    }
    // The sums are fp32: a bucket reading one reads fp32 gradients.
    TORCH_CHECK(!any || b.grad_dtype == c10::kFloat, "StepPlan.bind_source: a bucket of ",
                b.grad_dtype, " gradients holds a param the source buffers in fp32.");
  }
  idle_source_index_.clear();
  for (const auto& p : idle_) idle_source_index_.push_back(index_of(p));
  source_ = std::move(source);
}

void StepPlan::finalize() {
  TORCH_CHECK(!finalized_, "StepPlan.finalize: the plan is finalized.");
  // Everything the step writes, checked for sharing as the op checks it (naming the tensors).
  detail::OverlapCheck overlap;
  for (const auto& b : buckets_) {
    overlap.add(b.params, "params", true);
    overlap.add(b.masters, "master_params", true);
    for (const auto& s : b.states) overlap.add(s, "state", true);
    for (const auto& s : b.absmaxes) overlap.add(s, "state absmax", true);
    overlap.add(b.steps, "steps", true);
  }
  overlap.check();
  for (const auto& b : buckets_) {
    auto add = [&](const std::vector<at::Tensor>& list) {
      for (const auto& t : list) {
        if (t.numel() > 0 && t.const_data_ptr() != nullptr) written_.push_back(span_of(t));
      }
    };
    add(b.params);
    add(b.masters);
    for (const auto& s : b.states) add(s);
    for (const auto& s : b.absmaxes) add(s);
    add(b.steps);
  }
  std::sort(written_.begin(), written_.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  finalized_ = true;
}

bool StepPlan::touches_written(const at::Tensor& t) const {
  if (t.numel() == 0 || t.const_data_ptr() == nullptr) return false;
  return touches_written(span_of(t));
}

bool StepPlan::touches_written(const Span& s) const {
  // The first written span that ends after s begins; the spans are disjoint and sorted, so their
  // ends are sorted too.
  auto it = std::upper_bound(written_.begin(), written_.end(), s.begin,
                             [](uintptr_t v, const Span& w) { return v < w.end; });
  return it != written_.end() && it->begin < s.end;
}

namespace {

// A tensor's data when it is a plain strided tensor with storage (nullptr when it has no
// elements), read straight from its TensorImpl: the checked accessors cost calls per tensor.
// `mutable_`: the storage is made writable first (a lazily cloned one gets its own memory).
// Returns false when the tensor has no storage one may read.
inline __attribute__((always_inline)) bool raw_data(const c10::TensorImpl* t, bool mutable_,
                                                   const void*& out) {
  const c10::StorageImpl* s = t->unsafe_storage().unsafeGetStorageImpl();
  if (s == nullptr) return false;
  if (t->numel() == 0) {
    out = nullptr;
    return true;
  }
  const void* base = mutable_ ? const_cast<c10::StorageImpl*>(s)->mutable_data() : s->data();
  out = static_cast<const char*>(base) + t->storage_offset() * static_cast<int64_t>(t->itemsize());
  return true;
}

// A tensor's `.grad`, read from its autograd metadata's field: TensorImpl::grad() is a call into
// libc10 and a virtual call per param. Every autograd metadata torch makes is an AutogradMeta.
inline __attribute__((always_inline)) const at::Tensor& grad_field(const c10::TensorImpl* t) {
  static const at::Tensor none;
  const c10::AutogradMetaInterface* meta = t->autograd_meta();
  return meta == nullptr ? none : static_cast<const torch::autograd::AutogradMeta*>(meta)->grad_;
}

inline bool same_ints(c10::IntArrayRef a, const int64_t* b, size_t n) {
  if (a.size() != n) return false;
  for (size_t d = 0; d < n; ++d) {
    if (a[d] != b[d]) return false;
  }
  return true;
}

inline void prefetch_lines(const void* p, int count) {
  for (int k = 0; k < count; ++k) __builtin_prefetch(static_cast<const char*>(p) + 64 * k);
}

// Requests every cache line of the object of type T at p (heap objects are 16-byte aligned, so
// one may span a line more than its size suggests).
template <typename T>
inline void prefetch_object(const T* p) {
  const auto begin = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const auto end = reinterpret_cast<uintptr_t>(p) + sizeof(T);
  for (uintptr_t a = begin; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a));
}

// Requests the lines of a TensorImpl's first fields (vtable, refcounts, storage, autograd
// metadata).
inline void prefetch_head(const c10::TensorImpl* p) {
  __builtin_prefetch(p);
  __builtin_prefetch(reinterpret_cast<const char*>(p) + 31);
}

// The gradient walk's look-ahead, in params per link of the chain (see walk_grads).
constexpr ptrdiff_t kGatherAhead = 4;

// Calls visit(i, grad) for the params [0, n) in order, stopping at the
// first that returns false (then false). grad_of(i): param i's gradient (a reference that stays
// valid during the walk).
//
// The walk is bound by dependent loads, not by its arithmetic: a model's tensors lie scattered
// on the heap, and after the kernels' passes their metadata is no longer cached (param ->
// autograd metadata -> gradient -> the gradient's storage; and param -> its storage). So it is a
// software pipeline: while param i is visited, the links of later params' chains are requested,
// one link per kGatherAhead params:
//   i + 4A: the param's TensorImpl (all of it with `whole_params`, else its first fields);
//   i + 3A: its autograd metadata (and with `whole_params` its storage);
//   i + 2A: its gradient found (kept for the later stages) and the gradient's TensorImpl;
//   i + A:  the gradient's storage.
template <typename GradOf, typename Visit>
bool walk_grads(const at::Tensor* params, ptrdiff_t n, bool whole_params, const GradOf& grad_of,
                const Visit& visit) {
  auto impl = [params](ptrdiff_t i) { return params[i].unsafeGetTensorImpl(); };
  constexpr ptrdiff_t A = kGatherAhead;
  constexpr ptrdiff_t kRing = 16;  // holds the gradients of params i .. i + 2A
  static_assert(2 * A < kRing && (kRing & (kRing - 1)) == 0);
  const at::Tensor* found[kRing];
  for (ptrdiff_t i = -4 * A; i < n; ++i) {
    if (i + 4 * A < n) {
      if (whole_params) {
        prefetch_object(impl(i + 4 * A));
      } else {
        prefetch_head(impl(i + 4 * A));  // its storage and autograd metadata pointers
      }
    }
    if (i + 3 * A >= 0 && i + 3 * A < n) {
      const c10::TensorImpl* p = impl(i + 3 * A);
      if (const auto* meta = p->autograd_meta()) prefetch_lines(meta, 2);
      if (whole_params) {
        if (const auto* st = p->unsafe_storage().unsafeGetStorageImpl()) prefetch_object(st);
      }
    }
    if (i + 2 * A >= 0 && i + 2 * A < n) {
      const at::Tensor& g = grad_of(static_cast<size_t>(i + 2 * A));
      found[(i + 2 * A) & (kRing - 1)] = &g;
      if (g.defined()) prefetch_object(g.unsafeGetTensorImpl());
    }
    if (i + A >= 0 && i + A < n) {
      const at::Tensor& g = *found[(i + A) & (kRing - 1)];
      const c10::StorageImpl* st = g.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
      if (g.defined() && st != nullptr) prefetch_object(st);
    }
    if (i >= 0 && !visit(static_cast<size_t>(i), *found[i & (kRing - 1)])) return false;
  }
  return true;
}

}  // namespace

const at::Tensor& StepPlan::grad_of(const Bucket& b, size_t i) const {
  if (!b.source_index.empty()) {
    const int64_t k = b.source_index[i];
    if (k >= 0) return source_->window_grad(k);
  }
  return grad_field(b.params[i].unsafeGetTensorImpl());
}

// Params per thread below which a walk runs on the calling thread alone (a parallel region
// costs a few microseconds; a param's walk about a tenth of one).
constexpr size_t kParallelWalkMin = 256;

// Runs walk(lo, hi) over the params [0, n): with intra-op threads and enough params, one range
// per thread (the walks are bound by the latency of their loads, so each core waits on its own
// misses). walk returns an outcome, 0 for none; the largest outcome of the ranges is returned.
template <typename Walk>
uint8_t split_walk(size_t n, const Walk& walk) {
  if (at::get_num_threads() < 2 || n < 2 * kParallelWalkMin || at::in_parallel_region()) {
    return walk(size_t{0}, n);
  }
  std::atomic<uint8_t> worst{0};
  at::parallel_for(0, static_cast<int64_t>(n), static_cast<int64_t>(kParallelWalkMin),
                   [&](int64_t lo, int64_t hi) {
                     const uint8_t r = walk(static_cast<size_t>(lo), static_cast<size_t>(hi));
                     uint8_t cur = worst.load();
                     while (r > cur && !worst.compare_exchange_weak(cur, r)) {
                     }
                   });
  return worst.load();
}

// This call's gradients of `b`, walked by walk_grads. The scaler's pass (Want::Refs) reads and
// writes only the gradients: it does not check the params themselves (their dtype, shape and
// memory, which only the step uses), so it reads a third fewer cache lines per param.
//
// The prepared way is walked by split_walk (each param's pointer goes to its own row or ref); a
// gradient it cannot take, or one the scaler's pass would have to copy on write (a storage shared
// copy-on-write: never from two threads), sends the whole walk to the general way on the calling
// thread.
StepPlan::Gathered StepPlan::gather_grads(Bucket& b, Want want, bool write) {
  const bool check_params = want == Want::Rows;
  const size_t n = b.params.size();
  const kernels::DType kdtype = detail::kernel_dtype(b.grad_dtype);
  // What a visit found; a larger value wins over a smaller one between ranges.
  enum : uint8_t { kNext = 0, kGeneral = 1, kStale = 2 };
  auto visit = [&](size_t k, const at::Tensor& g, bool prepared) -> uint8_t {
    const c10::TensorImpl* gi = g.unsafeGetTensorImpl();
    const c10::TensorImpl* pi = b.params[k].unsafeGetTensorImpl();
    const int64_t* geom = b.geom.data() + b.geom_at[k];
    const size_t dim = (b.geom_at[k + 1] - b.geom_at[k]) / 2;
    if (!g.defined() || gi->layout() != c10::kStrided || gi->dtype() != b.grad_meta ||
        gi->key_set().has(c10::DispatchKey::Python) || gi->device() != b.device ||
        !same_ints(gi->sizes(), geom, dim)) {
      return kStale;
    }
    if (check_params) {
      const void* pdata = nullptr;
      if (pi->dtype() != b.param_meta || !same_ints(pi->sizes(), geom, dim) ||
          !same_ints(pi->strides(), geom + dim, dim) || !raw_data(pi, false, pdata) ||
          pdata != b.data[k]) {
        return kStale;
      }
    }
    // A storage shared copy-on-write gets its own memory when written: not from two threads.
    if (prepared && write) {
      const c10::StorageImpl* st = gi->unsafe_storage().unsafeGetStorageImpl();
      if (st != nullptr && c10::impl::cow::is_cow_data_ptr(st->data_ptr())) return kGeneral;
    }
    const void* data = nullptr;
    // A gradient about to be written in place is made writable first, so the memory checked is
    // the memory written.
    if (!raw_data(gi, write, data)) return kStale;
    // Dense in the param's element order (its strides, or one element).
    const bool dense = gi->is_non_overlapping_and_dense();
    const bool in_order = dense && (gi->numel() <= 1 || same_ints(gi->strides(), geom + dim, dim));
    Span s{};
    if (data != nullptr) {
      // Against what the step writes; a range found clear before (that does not change after
      // finalize) is not searched again.
      const auto at = reinterpret_cast<uintptr_t>(data);
      s = in_order && gi->numel() > 1 ? Span{at + b.extent[k].begin, at + b.extent[k].end}
                                      : span_of(g);
      if (!(s == b.clear_of_written[k])) {
        if (touches_written(s)) return kStale;
        b.clear_of_written[k] = s;
      }
    }
    if (want == Want::Refs && write) b.spans[k] = s;  // to check them disjoint
    if (!prepared) {
      b.grads[k] = g;
      return kNext;
    }
    if (want == Want::Rows && in_order) {
      b.rows[k].grad = data;  // walked in the param's element order
      return kNext;
    }
    if (want == Want::Refs && dense) {
      b.refs[k] = {const_cast<void*>(data), gi->numel(), kdtype};  // walked in memory order
      return kNext;
    }
    // A gradient the prepared way cannot take (the step: not in the param's order; the scaler's
    // pass: flattened through a copy).
    return kGeneral;
  };
  // Params [lo, hi): the first outcome that is not kNext, or kNext.
  auto walk = [&](size_t lo, size_t hi, bool prepared) {
    uint8_t out = kNext;
    walk_grads(
        b.params.data() + lo, static_cast<ptrdiff_t>(hi - lo), check_params,
        [&](size_t i) -> const at::Tensor& { return grad_of(b, lo + i); },
        [&](size_t i, const at::Tensor& g) {
          out = visit(lo + i, g, prepared);
          return out == kNext;
        });
    return out;
  };
  b.refs_ok = false;
  if (want == Want::Refs || b.rows_ok) {
    const uint8_t got = split_walk(n, [&](size_t lo, size_t hi) { return walk(lo, hi, true); });
    if (got == kStale) return Gathered::Stale;
    if (got == kNext) {
      b.refs_ok = want == Want::Refs;
      return want == Want::Rows ? Gathered::Rows : Gathered::Lists;
    }
  }
  // The general way: every gradient held as a tensor, on the calling thread.
  b.grads_held = true;
  return walk(0, n, false) == kStale ? Gathered::Stale : Gathered::Lists;
}

void StepPlan::release_grads() {
  for (auto& b : buckets_) {
    if (!b.grads_held) continue;
    std::fill(b.grads.begin(), b.grads.end(), at::Tensor());
    b.grads_held = false;
  }
}

bool StepPlan::idle_unchanged() const {
  for (size_t i = 0; i < idle_.size(); ++i) {
    const int64_t k = idle_source_index_.empty() ? -1 : idle_source_index_[i];
    if ((k >= 0 ? source_->window_grad(k) : idle_[i].grad()).defined()) return false;
  }
  return true;
}

void StepPlan::release_resources() {
  buckets_.clear();
  idle_.clear();
  hyper_.clear();
  source_.reset();
}

int64_t StepPlan::step(const std::optional<at::Tensor>& grad_scale,
                       const std::optional<at::Tensor>& found_inf,
                       const std::optional<at::Tensor>& clip_coef) {
  TORCH_CHECK(finalized_, "StepPlan.step: the plan is not finalized.");
  if (expired_.load(std::memory_order_relaxed)) return kStale;
  // Everything is checked before the first bucket runs.
  for (auto& b : buckets_) {
    TORCH_CHECK(static_cast<size_t>(b.group) < hyper_.size() && hyper_[b.group].set,
                "StepPlan.step: no hyper-parameters were set for group ", b.group, ".");
    const Gathered got = gather_grads(b, Want::Rows, /*write=*/false);
    if (got == Gathered::Stale) {
      release_grads();
      return kStale;
    }
    b.use_rows = got == Gathered::Rows;
  }
  bool stale = !idle_unchanged();
  for (const auto* t : {&grad_scale, &found_inf, &clip_coef}) {
    stale = stale || (*t && touches_written(**t));
  }
  for (const auto& h : hyper_) {
    // an lr (momentum) tensor resized in place: the owner's checks name it
    for (const auto* t : {&h.lr, &h.momentum}) {
      stale = stale || (*t && ((*t)->numel() != 1 || touches_written(**t)));
    }
  }
  if (stale) {
    release_grads();
    return kStale;
  }
  auto lists = [this](Bucket& b) {
    return kind_->lists(b.params, b.grads, b.masters, b.states, b.absmaxes, b.steps);
  };
  for (auto& b : buckets_) {
    kind_->check(hyper_[b.group].packed, lists(b), hyper_[b.group].momentum.has_value());
  }
  for (auto& b : buckets_) {
    const detail::OptimLists l = lists(b);
    const detail::HyperTensors ht{scalar_on(hyper_[b.group].lr, b.device),
                                  scalar_on(hyper_[b.group].momentum, b.device),
                                  kind_->device_tensor};
    const auto gs = scalar_on(grad_scale, b.device);
    const auto fi = scalar_on(found_inf, b.device);
    const auto cc = scalar_on(clip_coef, b.device);
    const auto n = static_cast<int64_t>(b.params.size());
    const PackedHyper& h = hyper_[b.group].packed;
    if (b.use_rows) {
      kind_->step_rows(*b.backend, b.rows.data(), n, b.dtypes, h, b.device, ht, gs, fi, cc);
    } else {
      kind_->step(*b.backend, l, h, b.device, ht, gs, fi, cc);
    }
  }
  release_grads();
  return kOk;
}

std::vector<at::Tensor> StepPlan::check(const at::Tensor& scale, bool write, bool with_norm,
                                        double norm_type, std::optional<double> max_norm) {
  TORCH_CHECK(finalized_, "StepPlan.check: the plan is not finalized.");
  if (expired_.load(std::memory_order_relaxed)) return {};
  if (with_norm) {
    detail::check_norm_args(norm_type, max_norm, std::nullopt, num_params_, scale.device());
  }
  call_spans_.clear();
  bool all_refs = true;
  for (auto& b : buckets_) {
    if (gather_grads(b, Want::Refs, write) == Gathered::Stale) {
      release_grads();
      return {};
    }
    all_refs = all_refs && b.refs_ok;
    if (write) {
      for (const Span& s : b.spans) {
        if (s.end != 0) call_spans_.push_back(s);
      }
    }
  }
  if (!idle_unchanged()) {
    release_grads();
    return {};
  }
  if (write) {
    // Gradients written in place must not share memory with each other or the scale; the ranges
    // of the last call that passed need no sort.
    if (scale.numel() > 0) call_spans_.push_back(span_of(scale));
    if (call_spans_ != disjoint_grads_) {
      std::vector<Span> sorted = call_spans_;
      std::sort(sorted.begin(), sorted.end(),
                [](const Span& x, const Span& y) { return x.begin < y.begin; });
      for (size_t i = 1; i < sorted.size(); ++i) {
        if (sorted[i].begin < sorted[i - 1].end) {
          release_grads();
          return {};
        }
      }
      disjoint_grads_ = call_spans_;
    }
  }
  // One pass per device, in the order of its first bucket, over its buckets' gradients.
  std::vector<c10::Device> devices;
  for (const auto& b : buckets_) {
    if (std::find(devices.begin(), devices.end(), b.device) == devices.end()) {
      devices.push_back(b.device);
    }
  }
  const NormKind norm = with_norm ? detail::norm_kind(norm_type) : NormKind::None;
  const char* op = write ? "unscale_check_" : "check_norm_";
  std::vector<at::Tensor> out;
  for (const auto& device : devices) {
    const Backend* backend = device_backend(device.type());
    at::Tensor found_inf = at::empty({}, scale.options().device(device).dtype(c10::kFloat));
    const at::Tensor s = scalar_on(scale, device);
    const detail::ScaleArg arg{&s, "scale", false};
    std::tuple<at::Tensor, at::Tensor> norm_coef;
    if (all_refs) {
      std::vector<kernels::TensorRef> refs;
      bool norm_fp64 = false;
      for (const auto& b : buckets_) {
        if (b.device != device) continue;
        refs.insert(refs.end(), b.refs.begin(), b.refs.end());
        norm_fp64 |= b.grad_dtype == c10::kDouble;
      }
      norm_coef = core::unscale_check_refs(*backend, refs, norm_fp64, found_inf, arg, write, norm,
                                           max_norm, std::nullopt,
                                           /*overwrite_found_inf=*/true, op);
    } else {
      std::vector<at::Tensor> grads;
      for (const auto& b : buckets_) {
        if (b.device == device) grads.insert(grads.end(), b.grads.begin(), b.grads.end());
      }
      norm_coef = core::unscale_check(*backend, grads, found_inf, arg, write, norm, max_norm,
                                      std::nullopt, /*overwrite_found_inf=*/true, op);
    }
    out.push_back(found_inf);
    if (with_norm) {
      out.push_back(std::get<0>(norm_coef));
      out.push_back(std::get<1>(norm_coef));
    }
  }
  release_grads();
  return out;
}

// ---- the accumulator's plan ------------------------------------------------------------------------

void AccumulatePlan::add(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
                         at::Tensor found_inf) {
  TORCH_CHECK(!finalized_, "AccumulatePlan.add: the plan is finalized.");
  TORCH_CHECK(!params.empty() && params.size() == buffers.size(), "AccumulatePlan.add: expected "
              "one buffer per param and at least one param, got ", params.size(), " params and ",
              buffers.size(), " buffers.");
  // The op's own checks (buffers fp32, one device, found_inf), with the params standing in for
  // their gradients.
  detail::check_accumulate_args(buffers, params, found_inf);
  Entry e;
  e.device = found_inf.device();
  e.backend = device_backend(e.device.type());
  TORCH_CHECK(e.backend != nullptr, "ampfuse has no kernels for tensors on ", e.device,
              "; its ops run on CPU and CUDA tensors.");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& b = buffers[i];
    TORCH_CHECK(!p.key_set().has(c10::DispatchKey::Python) &&
                    !b.key_set().has(c10::DispatchKey::Python),
                "AccumulatePlan.add: tensor subclasses (e.g. DTensor) go through the ops.");
    TORCH_CHECK(b.is_contiguous() && b.sizes().equals(p.sizes()),
                "AccumulatePlan.add: buffer ", i, " must be contiguous with its param's shape.");
    e.acc.push_back(b.mutable_data_ptr<float>());
    e.sizes_at.push_back(e.sizes.size());
    e.sizes.insert(e.sizes.end(), p.sizes().begin(), p.sizes().end());
  }
  e.sizes_at.push_back(e.sizes.size());
  params_.insert(params_.end(), params.begin(), params.end());
  buffers_.insert(buffers_.end(), buffers.begin(), buffers.end());
  has_grad_.resize(params_.size(), 0);
  e.params = std::move(params);
  e.buffers = std::move(buffers);
  e.found_inf = std::move(found_inf);
  num_params_ += static_cast<int64_t>(e.params.size());
  entries_.push_back(std::move(e));
}

void AccumulatePlan::add_watched(std::vector<at::Tensor> params) {
  TORCH_CHECK(!finalized_, "AccumulatePlan.add_watched: the plan is finalized.");
  for (auto& p : params) {
    watched_dtypes_.push_back(p.scalar_type());
    watched_.push_back(std::move(p));
  }
}

void AccumulatePlan::add_free(std::vector<at::Tensor> params) {
  TORCH_CHECK(!finalized_, "AccumulatePlan.add_free: the plan is finalized.");
  for (auto& p : params) {
    free_dtypes_.push_back(p.scalar_type());
    free_.push_back(std::move(p));
  }
}

void AccumulatePlan::finalize() {
  TORCH_CHECK(!finalized_, "AccumulatePlan.finalize: the plan is finalized.");
  detail::OverlapCheck overlap;
  for (const auto& e : entries_) {
    overlap.add(e.buffers, "accumulators", true);
    overlap.add(e.found_inf, "found_inf", true);
  }
  overlap.check();
  auto span = [](const at::Tensor& t) {
    const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    return std::make_pair(base, base + static_cast<uintptr_t>(t.numel() * t.element_size()));
  };
  for (const auto& e : entries_) {
    for (const auto& b : e.buffers) {
      if (b.numel() > 0) written_.push_back(span(b));  // contiguous: its span is its elements
    }
    written_.push_back(span(e.found_inf.reshape({})));
  }
  std::sort(written_.begin(), written_.end());
  finalized_ = true;
}

bool AccumulatePlan::check(const Entry& e, const at::Tensor& g, size_t i, const void*& data) const {
  const c10::TensorImpl* gi = g.unsafeGetTensorImpl();
  const auto t = gi->dtype().toScalarType();
  const int64_t* sizes = e.sizes.data() + e.sizes_at[i];
  if (gi->layout() != c10::kStrided || gi->key_set().has(c10::DispatchKey::Python) ||
      gi->device() != e.device || !(t == c10::kHalf || t == c10::kBFloat16 || t == c10::kFloat) ||
      !same_ints(gi->sizes(), sizes, e.sizes_at[i + 1] - e.sizes_at[i]) ||
      !gi->is_non_overlapping_and_dense() || (gi->numel() > 1 && !gi->is_contiguous()) ||
      !raw_data(gi, false, data)) {
    return false;  // the validated way (copies, or the message)
  }
  if (data == nullptr) return true;  // no elements
  const auto lo = reinterpret_cast<uintptr_t>(data);
  const auto hi = lo + static_cast<uintptr_t>(gi->numel() * static_cast<int64_t>(gi->itemsize()));
  auto it = std::upper_bound(written_.begin(), written_.end(), lo,
                             [](uintptr_t v, const std::pair<uintptr_t, uintptr_t>& w) {
                               return v < w.second;
                             });
  return it == written_.end() || it->first >= hi;
}

bool AccumulatePlan::collect() {
  TORCH_CHECK(finalized_, "AccumulatePlan.collect: the plan is not finalized.");
  // A watched fp16/bf16 param that got a gradient or now requires one (unfrozen): the validated
  // collect buffers it.
  for (const auto& p : watched_) {
    if (p.grad().defined() || (p.requires_grad() && low_precision(p.scalar_type()))) return false;
  }
  taken_.clear();
  size_t k = 0;
  for (auto& e : entries_) {
    // Walked by split_walk into per-param slots (numel -1: no gradient), then gathered in order.
    const size_t n = e.params.size();
    e.found.resize(n);
    const uint8_t stale = split_walk(n, [&](size_t lo, size_t hi) -> uint8_t {
      const bool ok = walk_grads(
          e.params.data() + lo, static_cast<ptrdiff_t>(hi - lo), false,
          [&](size_t i) -> const at::Tensor& {
            return grad_field(e.params[lo + i].unsafeGetTensorImpl());
          },
          [&](size_t i, const at::Tensor& g) {
            kernels::TensorRef& r = e.found[lo + i];
            if (!g.defined()) {
              r.numel = -1;
              return true;
            }
            const void* data = nullptr;
            if (!check(e, g, lo + i, data)) return false;
            r = kernels::TensorRef{const_cast<void*>(data), g.numel(),
                                   detail::kernel_dtype(g.scalar_type())};
            return true;
          });
      return ok ? 0 : 1;
    });
    if (stale != 0) return false;
    e.grads.clear();
    e.acc_taken.clear();
    for (size_t i = 0; i < n; ++i) {
      if (e.found[i].numel < 0) continue;
      e.grads.push_back(e.found[i]);
      e.acc_taken.push_back(e.acc[i]);
      taken_.push_back(k + i);
    }
    k += n;
  }
  for (auto& e : entries_) {
    core::accumulate_rows(*e.backend, e.acc_taken.data(), e.grads.data(),
                          static_cast<int64_t>(e.grads.size()), /*zero_grads=*/false, e.found_inf);
  }
  // The sums hold the gradients now: as the validated way, `.grad = None`.
  for (size_t t : taken_) {
    has_grad_[t] = 1;
    params_[t].mutable_grad() = at::Tensor();
  }
  return true;
}

void AccumulatePlan::set_window_flags(const std::vector<bool>& flags) {
  TORCH_CHECK(flags.size() == has_grad_.size(), "AccumulatePlan.set_window_flags: expected ",
              has_grad_.size(), " flags (one per buffered param), got ", flags.size(), ".");
  for (size_t k = 0; k < has_grad_.size(); ++k) has_grad_[k] = flags[k] ? 1 : 0;
}

void AccumulatePlan::clear_grads() {
  for (auto* list : {&params_, &watched_, &free_}) {
    for (auto& p : *list) {
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();
    }
  }
}

bool AccumulatePlan::no_grads() const {
  for (const auto* list : {&params_, &watched_, &free_}) {
    for (const auto& p : *list) {
      if (p.grad().defined()) return false;
    }
  }
  return true;
}

bool AccumulatePlan::same_layout() const {
  for (const auto& p : params_) {
    if (!p.requires_grad() || !low_precision(p.scalar_type())) return false;
  }
  for (size_t i = 0; i < watched_.size(); ++i) {
    const at::Tensor& p = watched_[i];
    if (p.requires_grad() && low_precision(p.scalar_type())) return false;
    if (p.scalar_type() != watched_dtypes_[i]) return false;
  }
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].scalar_type() != free_dtypes_[i]) return false;
  }
  return true;
}

}  // namespace ampfuse::engine
