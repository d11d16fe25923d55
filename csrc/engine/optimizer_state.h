// The optimizers' per-param state model, once for both surfaces: which tensors a param's state
// holds for its group's options, how missing ones are created and how existing ones are brought
// to changed options (a state dtype, a master form), and the state's checkpoint form both ways.
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

// The checkpoint form of the state of params[i] (the same slots): state tensors as fp32 (bf16
// widens exactly) and a remainder as the fp32 master_param it stands for (join_master), so that
// a checkpoint does not depend on the precision options. The given tensors are not changed; a
// tensor that needed no change is returned as given.
c10::List<std::optional<at::Tensor>> optimizer_state_saved(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    int64_t num_states);

// A checkpoint's state of params[i] (the same slots; state_names name the state slots, `naming`
// the param as step_checks.h's param_name does with groups[i] / indices[i]), all of it checked
// before any tensor is made, then copied onto the param's device as fp32: a step has one
// element (it becomes a 0-dim counter; absent: 0, or under restart_on_create, where the step
// counts from the state's creation as SGD's, 1 where the first state is present: torch's SGD
// saves no counter); every other tensor has the param's shape and a floating dtype; a
// master_remainder is refused (checkpoints hold masters as fp32 master_param). Raises ValueError
// naming the param and the state.
c10::List<std::optional<at::Tensor>> optimizer_state_loaded(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names, const std::vector<int64_t>& groups,
    const std::vector<int64_t>& indices, const std::string& naming, bool restart_on_create);

}  // namespace ampfuse::engine
