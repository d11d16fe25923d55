// The optimizers' per-param state model, once for both surfaces: which tensors a param's state
// holds for its group's options, how missing ones are created and how existing ones are brought
// to changed options (a state dtype, a master form) or from a checkpoint.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>

#include <string>
#include <vector>

namespace ampfuse::engine {

// A param's state as a run of slots, in this order: step, master_param, master_remainder, then
// the optimizer's state tensors in its order (SGD: momentum_buffer; Adam: exp_avg, exp_avg_sq,
// max_exp_avg_sq); an absent tensor is None.
constexpr int64_t kStateSlotsBeforeStates = 3;

// How `param`'s fp32 master is kept under `master_weights` ("true", "auto", "false",
// "remainder"): "none" (params that are not float16/bfloat16, or "false"), "remainder" (bfloat16
// params under "remainder") or "float".
std::string master_kind(const at::Tensor& param, const std::string& master_weights);

// The state of params[i] (slots[i * (3 + num_states) ...]) brought to the group's options: state
// tensors of `state_dtype` (converted: rounded to nearest even), a 0-dim fp32 step counter on the
// param's device, the master in master_kind's form (convert_master_, with reconcile[i]). Where
// create[i], missing tensors are created (zero; the master from the param), one kind at a time
// over the params: every step, then every master, then each state in turn, so that the
// allocator lays each kind out as one run in param order (the step streams over each kind);
// with restart_on_create a state tensor created for a param resets its step counter (SGD: a
// momentum buffer switched on restarts from the gradient). Where not create[i] (a param that
// does not step now) only the tensors it has are converted. Returns the slots; a tensor that
// needed no change is returned as given.
c10::List<std::optional<at::Tensor>> optimizer_state_(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    int64_t num_states, at::ScalarType state_dtype, const std::string& master_weights,
    const c10::List<bool>& create, const c10::List<bool>& reconcile, bool restart_on_create);

}  // namespace ampfuse::engine
