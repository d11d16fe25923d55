// The persistent step plan: the tensors of an optimizer's fused steps, validated once and held in
// C++, so that a step (and the loss scaler's check before it) crosses into native code once,
// whatever the number of parameters.
//
// A plan is built from the buckets of an optimizer (one per param group, device, param dtype,
// gradient dtype and master kind: params, masters, state lists, step counters), after the same
// step went through the validated ops once. It holds the tensors themselves, so it sees what is
// done to them in place. Per call it checks only what can change between steps without the
// owner knowing: each gradient's presence, dtype, layout, shape, device and memory (against the
// tensors the step writes), and each param's dtype, shape and data (a `.data` swap or `to()`).
// When one of these differs from what the plan was built for, the call changes nothing and
// returns kStale: the owner then goes the validated way (which names what is wrong, or rebuilds
// the plan). What the owner changes itself (param groups, optimizer state, options) it must
// answer by dropping the plan.
//
// Used by ampfuse.optim (Python, as torch.classes.ampfuse.StepPlan), ampfuse.GradScaler's
// checks, and the C++ optimizers and scaler (csrc/api). The engine's: the op layer (csrc/ops)
// knows nothing of it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/kernel_api.h"
#include "ops/op_core.h"
#include "ops/rules.h"
#include "engine/optimizer_kind.h"

namespace ampfuse::engine {

class AccumulatePlan;

class StepPlan : public torch::CustomClassHolder {
 public:
  static constexpr int64_t kOk = 0;
  static constexpr int64_t kStale = 1;

  // kind: "sgd" or "adam".
  explicit StepPlan(const std::string& kind);

  // The hyper-parameters of param group `group`, kept until set again: typed (the C++ surface) or
  // by name (Python: `hyper_names()` of the kind, each exactly once; flags as 0 or 1). `lr`: the
  // group's lr tensor (1 element, read at every step), or none (hyper.lr is used); `momentum`:
  // likewise SGD's momentum / Adam's beta1.
  void set_packed(int64_t group, PackedHyper hyper, std::optional<at::Tensor> lr,
                  std::optional<at::Tensor> momentum = std::nullopt);
  void set_hyper(int64_t group, const c10::Dict<std::string, double>& hyper,
                 std::optional<at::Tensor> lr, std::optional<at::Tensor> momentum);
  std::vector<std::string> hyper_names() const;
  // The hyper-parameters of group `group` read from its options by option name, as both surfaces
  // hold them (OptimizerKind::values_of_options); stochastic rounding with `rounding_seed` when
  // given.
  void set_options(int64_t group, const c10::Dict<std::string, c10::IValue>& options,
                   std::optional<int64_t> rounding_seed, std::optional<at::Tensor> lr,
                   std::optional<at::Tensor> momentum);

  // One bucket of param group `group`: same device, param dtype, gradient dtype (the params' own,
  // or fp32 when `fp32_grads`) and master kind. masters and each state list empty or one tensor
  // per param; states: sgd {momentum}, adam {exp_avg, exp_avg_sq, max_exp_avg_sq}; absmaxN: the
  // block absmax of 8-bit stateN, one per param (empty otherwise). Validated as the step op
  // validates them.
  void add_bucket(int64_t group, std::vector<at::Tensor> params, std::vector<at::Tensor> masters,
                  std::vector<at::Tensor> state0, std::vector<at::Tensor> state1,
                  std::vector<at::Tensor> state2, std::vector<at::Tensor> steps,
                  bool fp32_grads, std::vector<at::Tensor> absmax0 = {},
                  std::vector<at::Tensor> absmax1 = {}, std::vector<at::Tensor> absmax2 = {});
  // Params the plan steps only while they have no gradient (none when it was built).
  void add_idle(std::vector<at::Tensor> params);
  // Reads the gradients of the params `source` buffers from it (GradAccumulator's window step,
  // `step(grads=...)` with its fp32 sums): a buffered param's gradient is its sum while the window
  // holds one, else none (its `.grad` is not read, as a `grads` mapping overrides it). Before
  // finalize.
  void bind_source(c10::intrusive_ptr<AccumulatePlan> source);
  // Done adding: checks that no tensor the step writes shares memory with another.
  void finalize();

  // One fused step of every bucket (kOk), or nothing at all (kStale), with each group's
  // hyper-parameters as last set. The scaling tensors are moved to each bucket's device (no sync).
  int64_t step(const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf,
               const std::optional<at::Tensor>& clip_coef);

  // The loss scaler's pass over the gradients the step reads, one per device: divided by `scale`
  // (in place when `write`, else read only), found_inf written (0 or 1), and with `norm_type`
  // 2 or inf (`with_norm`) the total norm and clip coefficient (`max_norm`, if given). Returns
  // per device [found_inf] or [found_inf, total_norm, clip_coef]; empty when stale.
  std::vector<at::Tensor> check(const at::Tensor& scale, bool write, bool with_norm,
                                double norm_type, std::optional<double> max_norm);

  // From now on every step() and check() is stale (the owner's master keeper lost a param; may
  // be called from another thread).
  void expire() { expired_.store(true, std::memory_order_relaxed); }
  // When the last owner lets go (a weak reference may keep the object): the tensors go now.
  void release_resources() override;

  int64_t num_params() const { return num_params_; }
  std::string kind() const { return kind_->name; }
  const OptimizerKind& kind_descriptor() const { return *kind_; }

 private:
  struct GroupHyper {
    bool set = false;
    PackedHyper packed;
    std::optional<at::Tensor> lr;
    std::optional<at::Tensor> momentum;
  };
  std::vector<GroupHyper> hyper_;

  struct Span {
    uintptr_t begin = 0, end = 0;
    bool operator==(const Span& o) const { return begin == o.begin && end == o.end; }
  };
  struct Bucket {
    int64_t group = 0;
    c10::Device device{c10::kCPU};
    const ops::Backend* backend = nullptr;
    c10::ScalarType param_dtype = c10::kFloat;
    c10::ScalarType grad_dtype = c10::kFloat;
    caffe2::TypeMeta param_meta, grad_meta;  // the same, as TensorImpl holds them
    std::vector<at::Tensor> params, masters, steps;
    std::vector<at::Tensor> states[3];
    std::vector<at::Tensor> absmaxes[3];
    // Each param's shape and strides when the plan was built, side by side in one array (dims
    // sizes then dims strides from geom_at[i]), and its data.
    std::vector<int64_t> geom;
    std::vector<size_t> geom_at;
    std::vector<const void*> data;
    // Per param, the bytes a gradient with its shape and strides spans, relative to the
    // gradient's data (begin wraps below zero for negative strides).
    std::vector<Span> extent;
    std::vector<at::Tensor> grads;  // this call's gradients (the general way)
    bool grads_held = false;        // whether `grads` holds any
    // Per param, the memory of the last gradient found not to touch anything the step writes
    // (what the step writes does not change after finalize, so the same range needs no search).
    std::vector<Span> clear_of_written;
    // This call's gradients for the scaler's pass, when every one is dense (`refs_ok`).
    std::vector<kernels::TensorRef> refs;
    bool refs_ok = false;
    // A scaler's pass that writes: per param, its gradient's memory this call (empty: no
    // elements).
    std::vector<Span> spans;
    // The kernel rows, prepared once when every row's tensors lie flat in the param's element
    // order (`rows_ok`): a call fills in the gradients' pointers only. `keep` holds the storage
    // of every master, state and step counter the rows point into.
    bool rows_ok = false;
    bool use_rows = false;  // this call
    std::vector<kernels::OptimTensor> rows;
    ops::core::OptimDTypes dtypes;
    std::vector<c10::Storage> keep;
    // Per param, its index in the bound source, or -1 (`.grad`); empty without a source.
    std::vector<int64_t> source_index;
  };
  enum class Gathered { Stale, Rows, Lists };
  enum class Want { Rows, Refs };

  // This call's gradients of `b`, checked. For the step (Want::Rows): Rows (the prepared rows
  // hold their pointers) or Lists (b.grads holds them: a gradient is not flat in the param's
  // order). For the scaler's pass (Want::Refs): b.grads holds them, and b.refs too when every
  // one is dense (b.refs_ok). Or Stale.
  // `write`: the scaler's pass writes the gradients in place.
  Gathered gather_grads(Bucket& b, Want want, bool write);
  // The gradient the step reads for param i of `b`: `.grad`, or the bound source's sum.
  const at::Tensor& grad_of(const Bucket& b, size_t i) const;
  void release_grads();
  bool idle_unchanged() const;
  bool touches_written(const at::Tensor& t) const;
  bool touches_written(const Span& s) const;
  static Span span_of(const at::Tensor& t);
  // The bytes a tensor of these sizes and strides spans, relative to its data (begin wraps
  // below zero for negative strides).
  static Span extent_of(c10::IntArrayRef sizes, c10::IntArrayRef strides, size_t item);

  const OptimizerKind* kind_;
  bool finalized_ = false;
  std::atomic<bool> expired_{false};
  int64_t num_params_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> idle_;
  std::vector<int64_t> idle_source_index_;  // as Bucket::source_index
  c10::intrusive_ptr<AccumulatePlan> source_;
  std::vector<Span> written_;  // sorted, disjoint: the memory the step writes
  // The gradients and scale of the last check() that wrote in place, found not to share memory:
  // the same ranges need no sort.
  std::vector<Span> disjoint_grads_;
  std::vector<Span> call_spans_;  // this check()'s gradients' ranges
};

// The accumulator's plan (GradAccumulator, fp32 accumulation): fp16/bf16 params and their fp32
// buffers, validated once. A micro-batch's pass is one call: every param with a gradient has it
// added into its buffer (fp32, inf/NaN into the device's found_inf) and its `.grad` set to None.
// Per call it checks each gradient (dtype, layout, shape, device, memory against the buffers) and
// that the params it does not buffer have no gradient; otherwise it changes nothing and reports
// stale, and the owner goes the validated way.
class AccumulatePlan : public torch::CustomClassHolder {
 public:
  AccumulatePlan() = default;
  // The params of one device, their fp32 buffers (one per param, its shape, contiguous) and
  // the device's found_inf (1-element fp32).
  void add(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers, at::Tensor found_inf);
  // Params whose gradient the owner must see (not buffered): a gradient on one is stale.
  void add_watched(std::vector<at::Tensor> params);
  // The owner's other params (fp32 ones, whose `.grad` sums itself): only their dtype is watched.
  void add_free(std::vector<at::Tensor> params);
  void finalize();
  // One micro-batch: each buffered param with a gradient has it summed and cleared, and is
  // marked as holding one this window. False when stale (nothing done).
  bool collect();

  // The window: per buffered param (in the order added) whether its buffer holds a gradient.
  const std::vector<uint8_t>& window_flags() const { return has_grad_; }
  void set_window_flags(const std::vector<bool>& flags);
  // No param of the owner's (buffered, watched, free) has a `.grad`.
  void clear_grads();
  // Whether none of the owner's params (buffered, watched, free) has a `.grad`.
  bool no_grads() const;
  // Whether the owner would buffer the same params now: every buffered param still requires
  // grad, every watched one does not, and each param kept its dtype.
  bool same_layout() const;

  // For StepPlan::bind_source: the buffered params in the order added, and the gradient the
  // window holds for the k-th (its buffer, or an undefined tensor).
  const std::vector<at::Tensor>& buffered_params() const { return params_; }
  const at::Tensor& window_grad(int64_t k) const {
    static const at::Tensor none;
    return has_grad_[static_cast<size_t>(k)] ? buffers_[static_cast<size_t>(k)] : none;
  }

 private:
  struct Entry {
    c10::Device device{c10::kCPU};
    const ops::Backend* backend = nullptr;
    std::vector<at::Tensor> params, buffers;
    at::Tensor found_inf;
    std::vector<float*> acc;                // the buffers' data
    std::vector<int64_t> sizes;             // the params' shapes, side by side
    std::vector<size_t> sizes_at;           // param i's from sizes_at[i] to sizes_at[i + 1]
    std::vector<kernels::TensorRef> found;  // this call's, per param (numel -1: no gradient)
    std::vector<kernels::TensorRef> grads;  // this call's
    std::vector<float*> acc_taken;          // this call's
  };
  // Whether gradient g of param i of e can be summed as it lies (then its data in `data`).
  bool check(const Entry& e, const at::Tensor& g, size_t i, const void*& data) const;
  std::vector<Entry> entries_;
  std::vector<at::Tensor> watched_, free_;
  std::vector<c10::ScalarType> watched_dtypes_, free_dtypes_;
  // Every entry's params and buffers in the order added, and per param whether its buffer holds
  // a gradient this window.
  std::vector<at::Tensor> params_, buffers_;
  std::vector<uint8_t> has_grad_;
  std::vector<size_t> taken_;  // this call's: the params whose gradients were summed
  std::vector<std::pair<uintptr_t, uintptr_t>> written_;  // sorted, disjoint
  int64_t num_params_ = 0;
  bool finalized_ = false;
};

}  // namespace ampfuse::engine
