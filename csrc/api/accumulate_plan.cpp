// See accumulate_plan.h.
#include "api/accumulate_plan.h"

#include "ops/step_plan.h"

namespace ampfuse::detail {

struct MicroBatchPlan::Impl {
  c10::intrusive_ptr<ops::AccumulatePlan> plan;
};

MicroBatchPlan::MicroBatchPlan(std::vector<at::Tensor> buffered, std::vector<at::Tensor> buffers,
                               at::Tensor found_inf, std::vector<at::Tensor> watched,
                               std::vector<at::Tensor> free, const std::vector<bool>& flags)
    : impl_(std::make_unique<Impl>()) {
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

}  // namespace ampfuse::detail
