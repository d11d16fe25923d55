#include "engine/master_keeper.h"

#include <ATen/ops/zeros_like.h>
#include <c10/core/DispatchKey.h>

#include <mutex>
#include <sstream>
#include <utility>

#include "engine/step_checks.h"
#include "engine/step_plan.h"
#include "engine/step_plan.h"
#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

using WeakKeeper = c10::weak_intrusive_ptr<MasterKeeper>;
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Claim {
  WeakTensor param;
  WeakKeeper keeper;
};

// Every param's keeper, by identity; holds neither the param nor the keeper alive. Entries whose
// param or keeper is gone are swept when the table has doubled since the last sweep.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Claim> claims;
  size_t swept_at = 64;

  void sweep() {
    if (claims.size() < 2 * swept_at) return;
    for (auto it = claims.begin(); it != claims.end();) {
      it = it->second.param.expired() || it->second.keeper.expired() ? claims.erase(it) : std::next(it);
    }
    swept_at = std::max<size_t>(64, claims.size());
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: keepers may outlive static destruction
  return *r;
}

WeakTensor weak_of(const at::Tensor& t) { return WeakTensor(t.getIntrusivePtr()); }

// Whether weak `w` still refers to the live tensor at `p` (an address may be reused).
bool alive_as(const WeakTensor& w, const c10::TensorImpl* p) {
  auto locked = w.lock();
  return locked.defined() && locked.get() == p;
}

bool without_storage(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || !t.has_storage() || t.is_meta();
}

}  // namespace

MasterKeeper::MasterKeeper(std::string optimizer) : optimizer_(std::move(optimizer)) {}

MasterKeeper::~MasterKeeper() = default;

bool MasterKeeper::keeps(const c10::TensorImpl* p) const {
  auto it = kept_.find(p);
  return it != kept_.end() && alive_as(it->second, p);
}

void MasterKeeper::lose(const c10::TensorImpl* p, const WeakTensor& param) {
  taken_.insert_or_assign(p, param);
  kept_.erase(p);
  expire_plan();
}

void MasterKeeper::expire_plan() {  // under the registry's mutex
  needs_claim_.store(true);
  if (auto plan = plan_.lock(); plan.defined()) plan->expire();
}

void MasterKeeper::release_resources() {
  std::lock_guard<std::mutex> lock(registry().mutex);
  kept_.clear();
  taken_.clear();
  seen_.clear();
  plan_ = c10::weak_intrusive_ptr<StepPlan>(c10::intrusive_ptr<StepPlan>());
}

void MasterKeeper::claim(const std::vector<at::Tensor>& stepping, const std::vector<int64_t>& groups,
                         const std::vector<int64_t>& indices, const std::string& naming,
                         const std::vector<at::Tensor>& kept) {
  TORCH_CHECK(groups.size() == stepping.size() && indices.size() == stepping.size(),
              "MasterKeeper.claim: stepping, groups and indices must have one entry per param.");
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mutex);
  const auto me = WeakKeeper(c10::intrusive_ptr<MasterKeeper>::reclaim_copy(this));
  // Refusals first: nothing changes unless every param may be claimed.
  std::vector<c10::intrusive_ptr<MasterKeeper>> others(stepping.size());
  for (size_t k = 0; k < stepping.size(); ++k) {
    const c10::TensorImpl* p = stepping[k].unsafeGetTensorImpl();
    auto it = reg.claims.find(p);
    if (it == reg.claims.end() || !alive_as(it->second.param, p)) continue;
    auto other = it->second.keeper.lock();
    if (!other.defined() || other.get() == this || !other->keeps(p)) continue;
    auto taken = taken_.find(p);
    if (taken != taken_.end() && alive_as(taken->second, p)) {
      std::ostringstream os;
      os << param_name(naming, groups[k], indices[k]) << " of this " << optimizer_ << " (a "
         << detail::dtype_name(stepping[k].scalar_type()) << " param of shape " << shape_repr(stepping[k])
         << ") was stepped by another ampfuse optimizer, a " << other->optimizer() << " (id "
         << static_cast<const void*>(other.get())
         << "), with its own fp32 master since this one last stepped it; a param's master belongs to one "
            "optimizer (two masters stepped in turn each take the other's updates for edits, and train as if "
            "there were none). Give the param to one optimizer, or build one of them with "
            "master_weights=False; to hand the param back to this one, call its sync_masters_from_params() "
            "first.";
      TORCH_CHECK(false, os.str());
    }
    others[k] = std::move(other);
  }
  for (size_t k = 0; k < stepping.size(); ++k) {
    const c10::TensorImpl* p = stepping[k].unsafeGetTensorImpl();
    const WeakTensor param = weak_of(stepping[k]);
    reg.claims.insert_or_assign(p, Claim{param, me});
    taken_.erase(p);
    if (others[k].defined()) others[k]->lose(p, param);
  }
  kept_.clear();
  for (const auto& t : kept) kept_.emplace(t.unsafeGetTensorImpl(), weak_of(t));
  for (const auto& t : stepping) kept_.emplace(t.unsafeGetTensorImpl(), weak_of(t));
  needs_claim_.store(false);
  reg.sweep();
}

bool MasterKeeper::needs_claim() const { return needs_claim_.load(); }

namespace {

void check_pairs(const char* what, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters) {
  TORCH_CHECK(masters.size() == params.size(), "MasterKeeper.", what,
              ": params and masters must have one entry per param.");
}

// The master (an fp32 master or an int16 remainder) is the param itself.
void restart_from(const at::Tensor& p, const at::Tensor& master) {
  if (master.scalar_type() == at::kShort) {
    master.zero_();
  } else {
    master.copy_(p);
  }
}

}  // namespace

void MasterKeeper::restart_replaced(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters) {
  check_pairs("restart_replaced", params, masters);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& master = masters[i];
    if (without_storage(p)) continue;
    const c10::TensorImpl* key = p.unsafeGetTensorImpl();
    auto it = seen_.find(key);
    const void* now = p.const_data_ptr();
    if (it != seen_.end() && alive_as(it->second.param, key) &&
        alive_as(it->second.master, master.unsafeGetTensorImpl()) && it->second.data != now &&
        master.sizes() == p.sizes()) {
      restart_from(p, master);
    }
    seen_.insert_or_assign(key, Seen{weak_of(p), now, weak_of(master)});
  }
  if (seen_.size() >= 2 * seen_swept_at_) {  // params that left the optimizer
    for (auto it = seen_.begin(); it != seen_.end();) {
      it = it->second.param.expired() || it->second.master.expired() ? seen_.erase(it) : std::next(it);
    }
    seen_swept_at_ = std::max<size_t>(64, seen_.size());
  }
}

void MasterKeeper::sync_from_params(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& masters) {
  check_pairs("sync_from_params", params, masters);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) restart_from(params[i], masters[i]);
  }
  std::lock_guard<std::mutex> lock(registry().mutex);
  taken_.clear();  // the params are this optimizer's again: its next step claims them
  expire_plan();
}

void MasterKeeper::hold_plan(const std::optional<c10::intrusive_ptr<StepPlan>>& plan) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  plan_ = c10::weak_intrusive_ptr<StepPlan>(plan.has_value() ? *plan : c10::intrusive_ptr<StepPlan>());
}

}  // namespace ampfuse::engine
