// The one TORCH_LIBRARY(ampfuse, m) block: every ampfuse op's schema, one comment per op.
// Kernels are registered per backend in csrc/cpu/ops_cpu.cpp and csrc/cuda/ops_cuda.cpp.
#include <torch/library.h>

#include "ampfuse/ops.h"
#include "ampfuse/scale_stat.h"

TORCH_LIBRARY(ampfuse, m) {
  // Unscale every tensor in place by inv_scale; found_inf := 1 if any element is inf/NaN (never
  // reset). Same arguments and semantics as torch._amp_foreach_non_finite_check_and_unscale_.
  // Keyword-only extras, as for unscale_check_norm_: scale instead of inv_scale, and
  // overwrite_found_inf.
  m.def(
      "unscale_check_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor? inv_scale, *, "
      "Tensor? scale=None, bool overwrite_found_inf=False) -> ()");
  // unscale_check_ plus global norm (2 or inf; fp32, fp64 when the list holds an fp64 tensor)
  // and clip coefficient in the same pass; optional per-tensor non-finite flags. Either inv_scale
  // or scale (the kernel takes float(1 / double(scale)) itself, as torch's GradScaler computes
  // inv_scale); overwrite_found_inf: found_inf := 0 or 1 instead of only being set, so it needs no
  // zeroing beforehand. Returns (total_norm, clip_coef).
  m.def(
      "unscale_check_norm_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor? inv_scale, *, "
      "float norm_type=2., float? max_norm=None, Tensor(c!)? per_tensor_found_inf=None, "
      "Tensor? scale=None, bool overwrite_found_inf=False) -> (Tensor, Tensor)");
  // Read-only unscale_check_norm_: checks and measures the unscaled values, writes no tensor.
  m.def(
      "check_norm_(Tensor[] tensors, Tensor(b!) found_inf, Tensor? inv_scale, *, "
      "float norm_type=2., float? max_norm=None, Tensor(c!)? per_tensor_found_inf=None, "
      "Tensor? scale=None, bool overwrite_found_inf=False) -> (Tensor, Tensor)");
  // The clip coefficient of a total norm (e.g. one combined across ranks or devices), by the
  // rule of the fused check ops: min(1, max_norm / (total_norm + 1e-6)) -- reciprocal-then-multiply
  // for a float max_norm, a true division for a tensor one, as torch.nn.utils.clip_grad_norm_.
  // Returns a 0-dim float32 tensor on total_norm's device.
  m.def("clip_coef(Tensor total_norm, *, float? max_norm=None, Tensor? max_norm_tensor=None) -> Tensor");
  // Dynamic loss-scale update on device; torch._amp_update_scale_'s arguments plus hysteresis,
  // scale bounds and optional counters.
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, "
      "float scale_growth_factor, float scale_backoff_factor, int growth_interval, *, "
      "int hysteresis=1, Tensor(c!)? hysteresis_tracker=None, bool consecutive_hysteresis=False, "
      "float? min_scale=None, float? max_scale=None, Tensor(d!)? stats=None) -> ()");
  // accumulators[i] += grads[i] in fp32 (grads fp16/bf16/fp32), zeroing grads[i] in the same pass
  // when zero_grads; found_inf := 1 if any sum is inf/NaN (an inf/NaN grad, or an fp32 overflow;
  // never reset).
  m.def(
      "accumulate_grads_(Tensor(a!)[] accumulators, Tensor(b!)[] grads, Tensor(c!) found_inf, *, "
      "bool zero_grads=True) -> ()");
  // The 8-bit block-scaled form of optimizer state (ops/rules.h): fp32 values cut in their flat
  // order into blocks of 256, each with an fp32 absmax and one byte per value (torch.uint8: the
  // dynamic map, signed, or unsigned for nonnegative values; torch.float8_e4m3fn/e5m2: the fp8
  // value of value / absmax scaled to the format's range), nearest encoding. nonnegative (second
  // moments): negative values encode as 0, positive ones never as 0. Returns (codes, absmax) /
  // the fp32 values, fresh tensors of the input's shape.
  m.def("quantize_blocks(Tensor values, ScalarType dtype, *, bool nonnegative=False) -> (Tensor, Tensor)");
  m.def("dequantize_blocks(Tensor codes, Tensor absmax, *, bool nonnegative=False) -> Tensor");
  // Fused SGD step (torch.optim.SGD semantics) over one list, in one pass: grads divided by
  // grad_scale and multiplied by clip_coef; nothing at all changes when found_inf is set; masters
  // (if given: fp32 tensors for fp16/bf16 params, or int16 remainders for bf16 params, which
  // with the param are the fp32 master bit for bit) updated and params written rounded; state
  // fp32 or bf16 (fp32 math, stored rounded to nearest even), or 8-bit block-scaled (every state
  // list torch.uint8 / float8_e4m3fn / float8_e5m2 codes, each with its *_absmax list: one
  // contiguous fp32 tensor per param of ceil(numel / 256) values; second moments use the
  // nonnegative form of quantize_blocks); momentum initialised on the first step actually taken.
  // steps are per-param fp32 counters. rounding_seed: bf16 params without masters are written
  // rounded stochastically (unbiased; the draws a hash of the seed, the param's step count, the
  // element's index and the param's bits before the update: reproducible on every backend), else
  // to nearest. lr_tensor / momentum_tensor (adam_step_: beta1_tensor): 1-element fp32 tensors on
  // the params' device read at the step instead of lr / momentum (beta1), for schedules that write
  // them on the device; a momentum_tensor means momentum buffers (as momentum != 0).
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] momentum_buffers, Tensor(d!)[] steps, *, float lr, Tensor? lr_tensor=None, "
      "float momentum=0., Tensor? momentum_tensor=None, float dampening=0., "
      "float weight_decay=0., bool nesterov=False, bool maximize=False, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, Tensor? clip_coef=None, Tensor(e!)[]? momentum_absmax=None, int? rounding_seed=None) -> ()");
  // Fused Adam/AdamW step (torch.optim.Adam/AdamW semantics), same conventions as sgd_step_.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] master_params, "
      "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, "
      "Tensor(f!)[] steps, *, float lr, Tensor? lr_tensor=None, float beta1=0.9, "
      "Tensor? beta1_tensor=None, float beta2=0.999, float eps=1e-8, float weight_decay=0., bool amsgrad=False, "
      "bool maximize=False, bool decoupled_weight_decay=False, Tensor? grad_scale=None, "
      "Tensor? found_inf=None, Tensor? clip_coef=None, Tensor(g!)[]? exp_avg_absmax=None, "
      "Tensor(h!)[]? exp_avg_sq_absmax=None, Tensor(i!)[]? max_exp_avg_sq_absmax=None, "
      "int? rounding_seed=None) -> ()");
  // The master forms of a bf16 param (csrc/engine/master_forms.h), composite ops of torch ops
  // (every device, Meta included): the fp32 master of a (param, int16 remainder) pair, its
  // inverse split, and the two moves of a form switch (exact both ways, exact ties included):
  // remainder_of_ returns the remainder that with the param stands for an fp32 master (a tie's
  // param moved to the split's rounding), round_ties_even_ moves a remainder form's tie params
  // to round-half-even, as the fp32-master form holds them.
  m.def("join_master(Tensor param, Tensor remainder) -> Tensor");
  m.def("split_master(Tensor master) -> (Tensor, Tensor)");
  m.def("remainder_of_(Tensor(a!) param, Tensor master) -> Tensor");
  m.def("round_ties_even_(Tensor(a!) param, Tensor master) -> ()");
  // A param's master brought to a form ('none', 'float', 'remainder') from the master it has now:
  // [] or [the master tensor]; a composite of the four above (csrc/engine/master_forms.h).
  m.def(
      "convert_master_(Tensor(a!) param, Tensor? master_param, Tensor? master_remainder, str kind, "
      "bool reconcile) -> Tensor[]");
  // A group's per-param state brought to its options (csrc/engine/optimizer_state.h): slots per
  // param [step, master_param, master_remainder, state..., state absmax...], created where
  // create[i] (one kind at a time), converted otherwise; returns the slots. A composite of torch
  // ops, convert_master_ and the block quantization ops.
  m.def(
      "optimizer_state_(Tensor(a!)[] params, Tensor?[] slots, str[] state_names, ScalarType[] state_dtypes, "
      "str master_weights, bool[] create, bool[] reconcile, bool restart_on_create) -> Tensor?[]");
  // The state's checkpoint form, both ways (csrc/engine/optimizer_state.h), same slots: saved
  // (state as fp32 values, a remainder as its fp32 master_param) and loaded (checked against the params,
  // named by `naming` with {g}/{i} replaced by groups[i]/indices[i], then fp32 copies on each
  // param's device). Composites of torch ops and join_master.
  m.def("optimizer_state_saved(Tensor[] params, Tensor?[] slots, str[] state_names) -> Tensor?[]");
  m.def(
      "optimizer_state_loaded(Tensor[] params, Tensor?[] slots, str[] state_names, int[] groups, int[] indices, "
      "str naming, bool restart_on_create) -> Tensor?[]");
  // The optimizers' checks of a step's gradients (csrc/engine/step_checks.h), over every group
  // before any steps: params[k] has gradient grads[k] and is named by `naming` with {g}/{i}
  // replaced by groups[k]/indices[k]; state[j] is a state tensor of params[state_owner[j]]
  // named state_keys[j]. Raises RuntimeError naming the param; writes nothing.
  m.def(
      "step_grads_check(Tensor[] params, Tensor[] grads, Tensor[] state, int[] state_owner, "
      "str[] state_keys, int[] groups, int[] indices, str naming) -> ()");
  // Engine rules without tensors (csrc/engine, registered by engine/bindings.cpp), the one
  // definition both surfaces use.
  // The GradScaler checkpoint's entries checked (types, ranges, absent ampfuse entries taking the
  // given current values); returns the values to apply, by name. `source` names the checkpoint
  // in messages. Raises ValueError naming the entry.
  m.def(
      "scaler_checkpoint_check(Dict(str, Any) entries, int hysteresis, bool consecutive_hysteresis, "
      "float? min_scale, float? max_scale, int[] stats, str source) -> Dict(str, Any)");
  // A GradAccumulator checkpoint's counters (csrc/engine/accumulator_window.h): returns
  // [micro_step, windows, skipped_windows_host (0 when absent)]. Raises ValueError naming the entry.
  m.def("accumulator_counters_check(Dict(str, Any) entries, int steps, str source, str naming) -> int[]");
  // A mid-window checkpoint and the accumulator agree on an enabled scaler (the sums' units).
  m.def("accumulator_sums_scale_check(bool saved_scaled, bool scaled, str source) -> ()");
  // A param group's hyper-parameters (csrc/engine/hyper_checks.h): values by option name, the
  // group's name and whether options are named as Python does (param_groups[0]['lr']) or as C++
  // (AdamW: lr). Raises ValueError naming the option.
  m.def("group_hyper_check(str optimizer, Dict(str, Any) values, str group, bool python_naming) -> ()");
  // An optimizer kind's descriptor (csrc/engine/optimizer_kind.h): its hyper-parameters (names, the
  // group options and pair elements they are read from, types, whether a device tensor may hold
  // one, values of absent options) and states (keys, the options they exist with, their dtype
  // options, their block-absmax arguments).
  m.def(
      "optimizer_kind(str kind) -> (str[] names, str[] options, int[] elements, str[] types, bool[] device, "
      "float[] fallbacks, str[] states, str[] gates, str[] dtype_options, str[] absmax)");
  // The scale bounds' rules (None, or numbers: min_scale finite in [0, FLT_MAX], max_scale > 0 and
  // not below FLT_MIN, min <= max). Raises ValueError.
  m.def("scale_bounds_check(Any min_scale, Any max_scale) -> ()");
  // What a scaler does at its floor ("warn", "raise", "ignore"), and its report of floor hits.
  m.def("on_min_scale_check(str? on_min_scale, str? shown) -> ()");
  m.def("floor_hit_message(int new_hits, float floor) -> str");
  m.def("scaler_options_check(float init_scale, float growth_factor, float backoff_factor, int growth_interval, "
        "int hysteresis) -> ()");
  // The names of update_scale_'s counters in the order of the stats tensor (ampfuse/scale_stat.h):
  // Python's ampfuse.ops.ScaleStat is built from them.
  m.def("scale_stat_names() -> str[]", []() {
    return std::vector<std::string>(std::begin(ampfuse::kScaleStatNames), std::end(ampfuse::kScaleStatNames));
  });
}

namespace ampfuse {

bool ensure_registered() { return true; }

const char* built_with_torch_version() { return AMPFUSE_TORCH_VERSION; }

}  // namespace ampfuse

// For Python: read through ctypes to detect a library built against another torch.
extern "C" __attribute__((visibility("default"))) const char* ampfuse_torch_version() {
  return AMPFUSE_TORCH_VERSION;
}
