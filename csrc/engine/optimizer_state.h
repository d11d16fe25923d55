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
// max_exp_avg_sq), then each state's block absmax (an 8-bit state's per-block fp32 scales, named
// "<state>_absmax"); an absent tensor is None. num_states states take 3 + 2 * num_states slots.
constexpr int64_t kStateSlotsBeforeStates = 3;

// The slots a param's state takes with num_states states.
constexpr int64_t state_width(int64_t num_states) { return kStateSlotsBeforeStates + 2 * num_states; }

// Params with fewer elements keep an 8-bit state dtype's state in fp32 (their state is a small
// share of the memory, and a block of few values is where 8-bit state loses most).
constexpr int64_t kQuantMinNumel = 4096;

// Whether a state holds values >= 0 by definition (Adam's second moments), for which torch.uint8
// uses the unsigned map.
bool state_nonnegative(const std::string& name);

// The dtype param's state is kept in when its group asks for `requested` (torch.float32,
// torch.bfloat16, torch.uint8, torch.float8_e4m3fn or torch.float8_e5m2): an 8-bit dtype only for
// params of at least kQuantMinNumel elements, fp32 below. Refuses another dtype, naming `what`.
at::ScalarType stored_state_dtype(const at::Tensor& param, at::ScalarType requested, const std::string& what);

// The state dtypes a group may ask for, as an error message lists them, and whether `name`
// (torch's repr: "torch.uint8") is one of them.
inline constexpr const char* kStateDtypeChoices =
    "torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn or torch.float8_e5m2";
bool state_dtype_named(const std::string& name);

// Whether `dtype` is one of the 8-bit state dtypes (a state of it has a block absmax).
bool quantized_state_dtype(at::ScalarType dtype);

// How `param`'s fp32 master is kept under `master_weights` ("true", "auto", "false",
// "remainder", "stochastic"): "none" (params that are not float16/bfloat16, "false", and bfloat16
// params under "stochastic", which the step rounds stochastically), "remainder" (bfloat16 params
// under "remainder") or "float".
std::string master_kind(const at::Tensor& param, const std::string& master_weights);

// The state of params[i] (slots[i * state_width(n) ...], n = state_names.size()) brought to the
// group's options: state k in stored_state_dtype(param, state_dtypes[k]) (converted: fp32 and bf16
// rounded to nearest even; to and from 8-bit through dequantize_blocks / quantize_blocks, with the
// absmax slot set or cleared), a 0-dim fp32 step counter on the
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
    const std::vector<std::string>& state_names, const std::vector<at::ScalarType>& state_dtypes,
    const std::string& master_weights, const c10::List<bool>& create, const c10::List<bool>& reconcile,
    bool restart_on_create);

// The checkpoint form of the state of params[i] (the same slots): state tensors as fp32 (bf16
// widens exactly; 8-bit state dequantized, its absmax slot cleared) and a remainder as the fp32
// master_param it stands for (join_master), so that a checkpoint does not depend on the
// precision options. Quantizing a saved 8-bit state again gives back its codes and absmax (each
// block's largest value decodes to exactly its absmax), so a round trip is bitwise. The given
// tensors are not changed; a tensor that needed no change is returned as given.
c10::List<std::optional<at::Tensor>> optimizer_state_saved(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names);

// A checkpoint's state of params[i] (the same slots; state_names name the state slots, `naming`
// the param as step_checks.h's param_name does with groups[i] / indices[i]), all of it checked
// before any tensor is made, then copied onto the param's device as fp32: a step has one
// element (it becomes a 0-dim counter; absent: 0, or under restart_on_create, where the step
// counts from the state's creation as SGD's, 1 where the first state is present: torch's SGD
// saves no counter); every other tensor has the param's shape and a floating dtype; a
// master_remainder, an absmax and a state of an 8-bit dtype are refused (checkpoints hold masters
// as fp32 master_param and state as values). Raises ValueError naming the param and the state.
c10::List<std::optional<at::Tensor>> optimizer_state_loaded(
    const std::vector<at::Tensor>& params, const c10::List<std::optional<at::Tensor>>& slots,
    const std::vector<std::string>& state_names, const std::vector<int64_t>& groups,
    const std::vector<int64_t>& indices, const std::string& naming, bool restart_on_create);

}  // namespace ampfuse::engine
