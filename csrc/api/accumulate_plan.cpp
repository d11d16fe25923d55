// See accumulate_plan.h.
#include "api/accumulate_plan.h"

#include "ops/step_plan.h"

namespace ampfuse::detail {

struct MicroBatchPlan::Impl {
  c10::intrusive_ptr<ops::AccumulatePlan> plan;
  std::unordered_map<const c10::TensorImpl*, int64_t> index;  // buffered param -> its place
};

MicroBatchPlan::MicroBatchPlan(std::vector<at::Tensor> buffered, std::vector<at::Tensor> buffers,
                               at::Tensor found_inf, std::vector<at::Tensor> watched,
                               std::vector<at::Tensor> free, const std::vector<bool>& flags)
    : impl_(std::make_unique<Impl>()) {
  for (size_t k = 0; k < buffered.size(); ++k) {
    impl_->index.emplace(buffered[k].unsafeGetTensorImpl(), static_cast<int64_t>(k));
  }
  impl_->plan = c10::make_intrusive<ops::AccumulatePlan>();
  impl_->plan->add(std::move(buffered), std::move(buffers), std::move(found_inf));
  if (!watched.empty()) impl_->plan->add_watched(std::move(watched));
  if (!free.empty()) impl_->plan->add_free(std::move(free));
  impl_->plan->finalize();
  impl_->plan->set_window_flags(flags);
}

MicroBatchPlan::~MicroBatchPlan() = default;

bool MicroBatchPlan::collect(std::vector<bool>& flags) {
  if (!impl_->plan->collect()) return false;
  const std::vector<uint8_t>& got = impl_->plan->window_flags();
  for (size_t k = 0; k < got.size(); ++k) flags[k] = got[k] != 0;
  return true;
}

bool MicroBatchPlan::same_layout() const { return impl_->plan->same_layout(); }

void MicroBatchPlan::set_flags(const std::vector<bool>& flags) {
  impl_->plan->set_window_flags(flags);
}

const c10::intrusive_ptr<ops::AccumulatePlan>& MicroBatchPlan::native() const {
  return impl_->plan;
}

const at::Tensor* MicroBatchPlan::window_grad(const at::Tensor& param) const {
  const auto it = impl_->index.find(param.unsafeGetTensorImpl());
  return it == impl_->index.end() ? nullptr : &impl_->plan->window_grad(it->second);
}

}  // namespace ampfuse::detail
