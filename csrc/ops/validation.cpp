#include "ops/validation.h"


#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cfloat>
#include <cmath>
#include <algorithm>
#include <limits>
#include <string>

namespace ampfuse::detail {

void check_update_options(double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis) {
  constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();  // the device counters are int32
  TORCH_CHECK(growth_factor > 1.0 && std::isfinite(growth_factor),
              "growth_factor must be a finite number > 1.0, got ", growth_factor, ".");
  TORCH_CHECK(backoff_factor > 0.0 && backoff_factor < 1.0, "backoff_factor must be in (0, 1), got ",
              backoff_factor, ".");
  TORCH_CHECK(growth_interval >= 1 && growth_interval <= kMaxCount, "growth_interval must be an integer in [1, ",
              kMaxCount, "], got ", growth_interval, ".");
  TORCH_CHECK(hysteresis >= 1 && hysteresis <= kMaxCount, "hysteresis must be an integer in [1, ", kMaxCount,
              "], got ", hysteresis, ".");
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kHalf: return "torch.float16";
    case c10::kBFloat16: return "torch.bfloat16";
    case c10::kFloat: return "torch.float32";
    case c10::kDouble: return "torch.float64";
    case c10::kInt: return "torch.int32";
    case c10::kLong: return "torch.int64";
    case c10::kShort: return "torch.int16";
    case c10::kChar: return "torch.int8";
    case c10::kByte: return "torch.uint8";
    case c10::kBool: return "torch.bool";
    case c10::kComplexFloat: return "torch.complex64";
    case c10::kComplexDouble: return "torch.complex128";
    case c10::kComplexHalf: return "torch.complex32";
    default: {  // torch's Python spelling of the rest: the ScalarType's name in lower case
      std::string name = c10::toString(t);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

bool is_supported_float(c10::ScalarType t) {
  return t == c10::kHalf || t == c10::kBFloat16 || t == c10::kFloat || t == c10::kDouble;
}

void check_scalar_tensor(const at::Tensor& t, const char* name, c10::ScalarType dtype,
                         const c10::Device& device) {
  TORCH_CHECK(t.defined(), name, " must be a defined tensor.");
  TORCH_CHECK(t.layout() == c10::kStrided, name, " must be a strided (dense) tensor.");
  TORCH_CHECK(t.sym_numel() == 1, name, " must be a 1-element tensor, got ", t.sym_numel(),
              " elements.");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be a ", dtype_name(dtype),
              " tensor, got ", dtype_name(t.scalar_type()), ".");
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device(), ".");
}

void check_float_list(at::TensorList tensors, const char* name, const c10::Device& device) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), name, "[", i, "] is undefined.");
    TORCH_CHECK(t.layout() == c10::kStrided, name, "[", i, "] has layout ", t.layout(),
                "; only strided (dense) tensors are supported. For a sparse gradient pass its "
                "coalesced values() instead.");
    TORCH_CHECK(is_supported_float(t.scalar_type()), name, "[", i, "] has dtype ",
                dtype_name(t.scalar_type()),
                "; expected torch.float16, torch.bfloat16, torch.float32 or torch.float64.");
    TORCH_CHECK(t.device() == device, name, "[", i, "] is on ", t.device(),
                " but found_inf is on ", device, "; all tensors must be on one device.");
  }
}

ScaleArg check_unscale_args(at::TensorList tensors, const at::Tensor& found_inf,
                            const std::optional<at::Tensor>& inv_scale,
                            const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(found_inf.defined(), "found_inf must be a defined tensor.");
  const c10::Device device = found_inf.device();
  check_scalar_tensor(found_inf, "found_inf", c10::kFloat, device);
  const bool has_inv = inv_scale.has_value() && inv_scale->defined();
  const bool has_scale = scale.has_value() && scale->defined();
  TORCH_CHECK(has_inv != has_scale, "pass exactly one of inv_scale and scale, got ",
              has_inv ? "both" : "neither", ".");
  const ScaleArg arg = has_inv ? ScaleArg{&*inv_scale, "inv_scale", true}
                               : ScaleArg{&*scale, "scale", false};
  check_scalar_tensor(*arg.tensor, arg.name, c10::kFloat, device);
  check_float_list(tensors, "tensors", device);
  return arg;
}

namespace {

QuantFormat quant_format(c10::ScalarType dtype, bool nonnegative, const char* name) {
  const auto f = state_quant_format(dtype, nonnegative);
  TORCH_CHECK(f.has_value(), name, " must be torch.uint8, torch.float8_e4m3fn or torch.float8_e5m2, got ",
              dtype_name(dtype), ".");
  return *f;
}

}  // namespace

std::optional<QuantFormat> state_quant_format(c10::ScalarType dtype, bool nonnegative) {
  switch (dtype) {
    case c10::kByte: return nonnegative ? QuantFormat::Dynamic8Unsigned : QuantFormat::Dynamic8Signed;
    case c10::kFloat8_e4m3fn: return QuantFormat::E4M3;
    case c10::kFloat8_e5m2: return QuantFormat::E5M2;
    default: return std::nullopt;
  }
}

QuantFormat check_quantize_args(const at::Tensor& values, c10::ScalarType dtype, bool nonnegative) {
  TORCH_CHECK(values.defined(), "values must be a defined tensor.");
  TORCH_CHECK(values.layout() == c10::kStrided, "values must be a strided (dense) tensor.");
  TORCH_CHECK(values.scalar_type() == c10::kFloat, "values must be a torch.float32 tensor, got ",
              dtype_name(values.scalar_type()), ".");
  return quant_format(dtype, nonnegative, "dtype");
}

QuantFormat check_dequantize_args(const at::Tensor& codes, const at::Tensor& absmax, bool nonnegative) {
  TORCH_CHECK(codes.defined(), "codes must be a defined tensor.");
  TORCH_CHECK(absmax.defined(), "absmax must be a defined tensor.");
  TORCH_CHECK(codes.layout() == c10::kStrided, "codes must be a strided (dense) tensor.");
  const QuantFormat f = quant_format(codes.scalar_type(), nonnegative, "codes' dtype");
  TORCH_CHECK(absmax.layout() == c10::kStrided && absmax.dim() == 1 && absmax.scalar_type() == c10::kFloat,
              "absmax must be a 1-D torch.float32 tensor, got shape ", absmax.sym_sizes(), " and dtype ",
              dtype_name(absmax.scalar_type()), ".");
  const c10::SymInt blocks = (codes.sym_numel() + (kQuantBlock - 1)) / kQuantBlock;
  TORCH_CHECK(absmax.sym_numel() == blocks, "absmax must hold one value per block of ", kQuantBlock,
              " codes (", blocks, " for ", codes.sym_numel(), " codes), got ", absmax.sym_numel(), ".");
  TORCH_CHECK(absmax.device() == codes.device(), "absmax must be on ", codes.device(), " (the codes' device), got ",
              absmax.device(), ".");
  return f;
}

void check_clip_coef_args(const at::Tensor& total_norm, std::optional<double> max_norm,
                          const std::optional<at::Tensor>& max_norm_tensor) {
  TORCH_CHECK(total_norm.defined(), "total_norm must be a defined tensor.");
  TORCH_CHECK(total_norm.layout() == c10::kStrided && total_norm.sym_numel() == 1 &&
                  (total_norm.scalar_type() == c10::kFloat || total_norm.scalar_type() == c10::kDouble),
              "total_norm must be a 1-element torch.float32 or torch.float64 tensor, got shape ",
              total_norm.sym_sizes(), " and dtype ", dtype_name(total_norm.scalar_type()), ".");
  const bool has_tensor = max_norm_tensor.has_value() && max_norm_tensor->defined();
  TORCH_CHECK(max_norm.has_value() != has_tensor, "pass exactly one of max_norm and max_norm_tensor, got ",
              has_tensor ? "both" : "neither", ".");
  if (max_norm) {
    TORCH_CHECK(std::isfinite(*max_norm) && *max_norm > 0, "max_norm must be a positive finite number, got ",
                *max_norm, ".");
  } else {
    check_scalar_tensor(*max_norm_tensor, "max_norm_tensor", c10::kFloat, total_norm.device());
  }
}

void check_accumulate_args(at::TensorList accumulators, at::TensorList grads,
                           const at::Tensor& found_inf) {
  TORCH_CHECK(found_inf.defined(), "found_inf must be a defined tensor.");
  const c10::Device device = found_inf.device();
  check_scalar_tensor(found_inf, "found_inf", c10::kFloat, device);
  TORCH_CHECK(accumulators.size() == grads.size(), "accumulators and grads must have the same "
              "length, got ", accumulators.size(), " and ", grads.size(), ".");
  check_float_list(grads, "grads", device);
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& a = accumulators[i];
    TORCH_CHECK(a.defined() && a.layout() == c10::kStrided, "accumulators[", i,
                "] must be a strided tensor.");
    TORCH_CHECK(a.scalar_type() == c10::kFloat, "accumulators[", i, "] has dtype ",
                dtype_name(a.scalar_type()), "; accumulators must be torch.float32.");
    TORCH_CHECK(a.device() == device, "accumulators[", i, "] is on ", a.device(),
                " but found_inf is on ", device, ".");
    TORCH_CHECK(grads[i].scalar_type() != c10::kDouble, "grads[", i, "] has dtype torch.float64; "
                "expected torch.float16, torch.bfloat16 or torch.float32.");
    TORCH_CHECK(a.sym_sizes() == grads[i].sym_sizes(), "accumulators[", i, "] has shape ",
                a.sym_sizes(), " but grads[", i, "] has shape ", grads[i].sym_sizes(), ".");
  }
}

NormKind norm_kind(double norm_type) {
  if (norm_type == 2.0) return NormKind::L2;
  if (std::isinf(norm_type) && norm_type > 0) return NormKind::Inf;
  TORCH_CHECK(false, "norm_type must be 2.0 or inf, got ", norm_type,
              " (other p-norms are not fused; use torch.nn.utils.clip_grad_norm_).");
}

void check_norm_args(double norm_type, std::optional<double> max_norm,
                     const std::optional<at::Tensor>& per_tensor_found_inf, int64_t num_tensors,
                     const c10::Device& device) {
  (void)norm_kind(norm_type);
  if (max_norm) {
    TORCH_CHECK(std::isfinite(*max_norm) && *max_norm > 0, "max_norm must be a positive finite "
                "number, got ", *max_norm, ".");
  }
  if (per_tensor_found_inf) {
    const at::Tensor& f = *per_tensor_found_inf;
    TORCH_CHECK(f.layout() == c10::kStrided && f.dim() == 1 && f.sym_size(0) == num_tensors &&
                    f.is_contiguous(),
                "per_tensor_found_inf must be a contiguous 1-D tensor with one element per "
                "tensor (", num_tensors, "), got shape ", f.sym_sizes(), ".");
    TORCH_CHECK(f.scalar_type() == c10::kFloat, "per_tensor_found_inf must be a torch.float32 "
                "tensor, got ", dtype_name(f.scalar_type()), ".");
    TORCH_CHECK(f.device() == device, "per_tensor_found_inf must be on ", device, ", got ",
                f.device(), ".");
  }
}

ScaleRuleParams check_update_scale_args(const at::Tensor& scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& found_inf, double growth_factor,
                                        double backoff_factor, int64_t growth_interval,
                                        int64_t hysteresis,
                                        const std::optional<at::Tensor>& hysteresis_tracker,
                                        bool consecutive_hysteresis,
                                        std::optional<double> min_scale,
                                        std::optional<double> max_scale,
                                        const std::optional<at::Tensor>& stats) {
  TORCH_CHECK(scale.defined(), "scale must be a defined tensor.");
  const c10::Device device = scale.device();
  check_scalar_tensor(scale, "scale", c10::kFloat, device);
  check_scalar_tensor(growth_tracker, "growth_tracker", c10::kInt, device);
  check_scalar_tensor(found_inf, "found_inf", c10::kFloat, device);
  check_update_options(growth_factor, backoff_factor, growth_interval, hysteresis);
  if (hysteresis_tracker) {
    check_scalar_tensor(*hysteresis_tracker, "hysteresis_tracker", c10::kInt, device);
  } else {
    TORCH_CHECK(hysteresis == 1 && !consecutive_hysteresis,
                "hysteresis_tracker (a 1-element torch.int32 tensor holding the remaining "
                "overflows tolerated) is required when hysteresis > 1 or consecutive_hysteresis "
                "is set.");
  }
  float floor = FLT_MIN;
  float ceiling = FLT_MAX;
  if (min_scale) {
    TORCH_CHECK(std::isfinite(*min_scale) && *min_scale >= 0,
                "min_scale must be a finite number >= 0, got ", *min_scale, ".");
    floor = std::max(floor, static_cast<float>(*min_scale));
  }
  if (max_scale) {
    TORCH_CHECK(!std::isnan(*max_scale) && *max_scale > 0, "max_scale must be > 0, got ",
                *max_scale, ".");
    if (std::isfinite(*max_scale)) ceiling = static_cast<float>(*max_scale);
  }
  if (min_scale && max_scale) {
    TORCH_CHECK(*min_scale <= *max_scale, "min_scale (", *min_scale,
                ") must not be greater than max_scale (", *max_scale, ").");
  }
  TORCH_CHECK(floor <= ceiling, "max_scale (", ceiling,
              ") is below the smallest normal float32 scale (", FLT_MIN, ").");
  if (stats) {
    const at::Tensor& st = *stats;
    TORCH_CHECK(st.layout() == c10::kStrided && st.dim() == 1 &&
                    st.sym_numel() == kNumScaleStats && st.is_contiguous(),
                "stats must be a contiguous 1-D tensor of ", static_cast<int>(kNumScaleStats),
                " elements, got shape ", st.sym_sizes(), ".");
    TORCH_CHECK(st.scalar_type() == c10::kLong, "stats must be a torch.int64 tensor, got ",
                dtype_name(st.scalar_type()), ".");
    TORCH_CHECK(st.device() == device, "stats must be on ", device, ", got ", st.device(), ".");
  }
  return ScaleRuleParams{growth_factor, backoff_factor, growth_interval,
                         static_cast<int32_t>(hysteresis), consecutive_hysteresis, floor,
                         ceiling};
}

c10::Device check_optim_args(const OptimLists& l, const HyperTensors& hyper_tensors,
                             const std::optional<at::Tensor>& grad_scale,
                             const std::optional<at::Tensor>& found_inf,
                             const std::optional<at::Tensor>& clip_coef) {
  const size_t n = l.params.size();
  TORCH_CHECK(l.grads.size() == n, "grads must have one tensor per param (", n, "), got ",
              l.grads.size(), ".");
  TORCH_CHECK(l.steps.size() == n, "steps must have one tensor per param (", n, "), got ",
              l.steps.size(), ".");
  TORCH_CHECK(l.masters.empty() || l.masters.size() == n, "master_params must be empty or have "
              "one tensor per param (", n, "), got ", l.masters.size(), ".");
  for (size_t k = 0; k < l.states.size(); ++k) {
    TORCH_CHECK(l.states[k].empty() || l.states[k].size() == n, l.state_names[k],
                " must be empty or have one tensor per param (", n, "), got ", l.states[k].size(),
                ".");
  }
  std::optional<c10::Device> device;
  if (n > 0) device = l.params[0].device();
  else if (found_inf) device = found_inf->device();
  else device = c10::Device(c10::kCPU);
  const auto pdtype = n ? l.params[0].scalar_type() : c10::kFloat;
  const auto gdtype = n ? l.grads[0].scalar_type() : c10::kFloat;
  TORCH_CHECK(pdtype == c10::kHalf || pdtype == c10::kBFloat16 || pdtype == c10::kFloat,
              "params[0] has dtype ", dtype_name(pdtype),
              "; expected torch.float16, torch.bfloat16 or torch.float32.");
  TORCH_CHECK(gdtype == c10::kHalf || gdtype == c10::kBFloat16 || gdtype == c10::kFloat,
              "grads[0] has dtype ", dtype_name(gdtype),
              "; expected torch.float16, torch.bfloat16 or torch.float32.");
  TORCH_CHECK(gdtype == pdtype || gdtype == c10::kFloat, "grads[0] has dtype ",
              dtype_name(gdtype), " but params[0] has dtype ", dtype_name(pdtype),
              "; grads must have the params' dtype or be torch.float32 (e.g. fp32 sums of an "
              "accumulator).");
  // The common case is checked with cheap comparisons; the detailed checks (and their messages)
  // run only for a tensor that fails them.
  auto check_tensor = [&](const at::Tensor& t, const char* name, size_t i, c10::ScalarType dtype,
                          const at::Tensor& param) {
    if (t.defined() && t.layout() == c10::kStrided && t.device() == *device &&
        t.scalar_type() == dtype && t.sym_sizes() == param.sym_sizes()) {
      return;
    }
    TORCH_CHECK(t.defined(), name, "[", i, "] is undefined.");
    TORCH_CHECK(t.layout() == c10::kStrided, name, "[", i, "] has layout ", t.layout(),
                "; fused optimizers support strided (dense) tensors only (sparse gradients: use "
                "torch.optim.SparseAdam).");
    TORCH_CHECK(t.device() == *device, name, "[", i, "] is on ", t.device(), " but params[0] is on ",
                *device, "; all tensors of one call must be on one device.");
    TORCH_CHECK(t.scalar_type() == dtype, name, "[", i, "] has dtype ", dtype_name(t.scalar_type()),
                "; expected ", dtype_name(dtype), " (one dtype per list in a call).");
    TORCH_CHECK(false, name, "[", i, "] has shape ", t.sym_sizes(), " but params[", i,
                "] has shape ", param.sym_sizes(), ".");
  };
  // Masters: fp32 tensors (fp16/bf16 params), or int16 remainders (bf16 params; ops/rules.h).
  const auto mdtype = (n && !l.masters.empty()) ? l.masters[0].scalar_type() : c10::kFloat;
  if (n && !l.masters.empty()) {
    TORCH_CHECK(pdtype != c10::kFloat, "master_params were given for torch.float32 params, which "
                "are their own masters; pass master_params=[].");
    TORCH_CHECK(mdtype == c10::kFloat || (mdtype == c10::kShort && pdtype == c10::kBFloat16),
                "master_params[0] has dtype ", dtype_name(mdtype), "; expected torch.float32 "
                "masters", pdtype == c10::kBFloat16 ? " or torch.int16 remainders (bf16 params)" : "",
                ".");
  }
  // State: fp32 or bf16 (stored rounded; the math is fp32), one dtype for every state list; or
  // every state list 8-bit (each list of its own format), with its block absmax list.
  std::vector<c10::ScalarType> sdtypes(l.states.size(), c10::kFloat);
  const char* first = nullptr;
  c10::ScalarType first_dtype = c10::kFloat;
  bool quantized = false;
  for (size_t k = 0; k < l.states.size() && n; ++k) {
    if (l.states[k].empty()) continue;
    const auto d = l.states[k][0].scalar_type();
    const bool q = state_quant_format(d, false).has_value();
    if (first == nullptr) {
      TORCH_CHECK(q || d == c10::kFloat || d == c10::kBFloat16, l.state_names[k], "[0] has dtype ",
                  dtype_name(d), "; optimizer state must be torch.float32, torch.bfloat16 or 8-bit "
                  "(torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2).");
      first = l.state_names[k];
      first_dtype = d;
      quantized = q;
    } else {
      TORCH_CHECK(q == quantized, l.state_names[k], "[0] has dtype ", dtype_name(d), " but ", first,
                  "[0] has dtype ", dtype_name(first_dtype), "; the state lists of a call are all 8-bit "
                  "or all of one dtype (torch.float32 or torch.bfloat16).");
    }
    sdtypes[k] = quantized ? d : first_dtype;
  }
  for (size_t k = 0; k < l.absmaxes.size() && n; ++k) {
    const bool needed = quantized && !l.states[k].empty();
    TORCH_CHECK(l.absmaxes[k].size() == (needed ? n : 0), l.absmax_names[k], " must ",
                needed ? "have one tensor per param (" + std::to_string(n) + ") when " +
                             l.state_names[k] + " are 8-bit"
                       : std::string("be empty when ") + l.state_names[k] + " are not 8-bit",
                ", got ", l.absmaxes[k].size(), ".");
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = l.params[i];
    check_tensor(p, "params", i, pdtype, p);
    check_tensor(l.grads[i], "grads", i, gdtype, p);
    if (!l.masters.empty()) check_tensor(l.masters[i], "master_params", i, mdtype, p);
    for (size_t k = 0; k < l.states.size(); ++k) {
      if (l.states[k].empty()) continue;
      const at::Tensor& st = l.states[k][i];
      check_tensor(st, l.state_names[k], i, sdtypes[k], p);
      if (!quantized) continue;
      TORCH_CHECK(st.is_contiguous(), l.state_names[k], "[", i, "] is 8-bit state and must be contiguous "
                  "(its blocks follow the flat element order).");
      const at::Tensor& a = l.absmaxes[k][i];
      // sizes as SymInts: the Meta kernel runs this under torch.compile's symbolic shapes
      const c10::SymInt blocks = (p.sym_numel() + (kQuantBlock - 1)) / kQuantBlock;
      if (!(a.defined() && a.layout() == c10::kStrided && a.scalar_type() == c10::kFloat &&
            a.device() == *device && a.dim() == 1 && a.sym_numel() == blocks && a.is_contiguous())) {
        TORCH_CHECK(false, l.absmax_names[k], "[", i, "] must be a contiguous 1-D torch.float32 tensor on ",
                    *device, " with one value per block of ", kQuantBlock, " elements of params[", i, "] (",
                    blocks, "), got ", a.defined() ? "shape " : "an undefined tensor",
                    a.defined() ? c10::str(a.sym_sizes(), ", dtype ", dtype_name(a.scalar_type()), " on ", a.device())
                                : std::string(), ".");
      }
    }
    const at::Tensor& st = l.steps[i];
    if (!(st.defined() && st.layout() == c10::kStrided && st.sym_numel() == 1 &&
          st.scalar_type() == c10::kFloat && st.device() == *device)) {
      const std::string step_name = "steps[" + std::to_string(i) + "]";
      check_scalar_tensor(st, step_name.c_str(), c10::kFloat, *device);
    }
  }
  if (hyper_tensors.lr) check_scalar_tensor(*hyper_tensors.lr, "lr_tensor", c10::kFloat, *device);
  if (hyper_tensors.momentum) {
    check_scalar_tensor(*hyper_tensors.momentum, hyper_tensors.momentum_name, c10::kFloat, *device);
  }
  if (grad_scale) check_scalar_tensor(*grad_scale, "grad_scale", c10::kFloat, *device);
  if (found_inf) check_scalar_tensor(*found_inf, "found_inf", c10::kFloat, *device);
  if (clip_coef) check_scalar_tensor(*clip_coef, "clip_coef", c10::kFloat, *device);
  return *device;
}

namespace {
// The seed of stochastic rounding's draws: an integer in [0, 2**53) (a double holds it exactly).
void check_rounding_seed(bool stochastic, int64_t seed) {
  TORCH_CHECK(!stochastic || (seed >= 0 && seed < (int64_t{1} << 53)), "rounding_seed must be in [0, 2**53), got ",
              seed, ".");
}
}  // namespace

void check_sgd_hyper(const SgdHyper& h, const OptimLists& l, bool momentum_tensor) {
  TORCH_CHECK(h.lr >= 0.0, "lr must be >= 0, got ", h.lr, ".");
  check_rounding_seed(h.stochastic_rounding, h.rounding_seed);
  TORCH_CHECK(h.momentum >= 0.0, "momentum must be >= 0, got ", h.momentum, ".");
  TORCH_CHECK(h.weight_decay >= 0.0, "weight_decay must be >= 0, got ", h.weight_decay, ".");
  const bool has_momentum = momentum_tensor || h.momentum != 0.0;
  TORCH_CHECK(!h.nesterov || ((momentum_tensor || h.momentum > 0.0) && h.dampening == 0.0),
              "nesterov momentum requires a momentum > 0 and zero dampening.");
  const bool need_buffers = has_momentum && !l.params.empty();
  TORCH_CHECK(!need_buffers || !l.states[0].empty(),
              "momentum_buffers must have one tensor per param when momentum != 0 or momentum_tensor is "
              "given.");
}

void check_adam_hyper(const AdamHyper& h, const OptimLists& l) {
  TORCH_CHECK(h.lr >= 0.0, "lr must be >= 0, got ", h.lr, ".");
  check_rounding_seed(h.stochastic_rounding, h.rounding_seed);
  TORCH_CHECK(h.eps >= 0.0, "eps must be >= 0, got ", h.eps, ".");
  TORCH_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "beta1 must be in [0, 1), got ", h.beta1, ".");
  TORCH_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "beta2 must be in [0, 1), got ", h.beta2, ".");
  TORCH_CHECK(h.weight_decay >= 0.0, "weight_decay must be >= 0, got ", h.weight_decay, ".");
  if (!l.params.empty()) {
    TORCH_CHECK(!l.states[0].empty() && !l.states[1].empty(),
                "exp_avgs and exp_avg_sqs must have one tensor per param.");
    TORCH_CHECK(h.amsgrad == !l.states[2].empty(), "max_exp_avg_sqs must have one tensor per "
                "param when amsgrad is set, and be empty otherwise.");
  }
}

// ---- memory overlap --------------------------------------------------------------------------------
namespace {

std::string describe(const char* name, int64_t index) {
  return index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
}

}  // namespace

void OverlapCheck::add(const at::Tensor& t, const char* name, bool written) {
  const size_t before = spans_.size();
  add(at::TensorList(&t, 1), name, written);
  if (spans_.size() > before) spans_.back().index = -1;
}

void OverlapCheck::add(const std::optional<at::Tensor>& t, const char* name, bool written) {
  if (t && t->defined()) add(*t, name, written);
}

void OverlapCheck::add(at::TensorList list, const char* name, bool written) {
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    if (t.is_meta() || t.numel() == 0) continue;  // meta tensors: no memory to check
    const auto* data = static_cast<const char*>(t.const_data_ptr());
    if (data == nullptr) continue;
    if (written && t.dim() > 0 && !t.is_non_overlapping_and_dense()) {
      TORCH_CHECK(at::has_internal_overlap(t) != at::MemOverlap::Yes, describe(name, i),
                  " has internally overlapping memory (an expanded or stride-0 view: several of "
                  "its elements are one memory location), but the kernel writes it; pass a "
                  "tensor that owns its elements (e.g. .clone()).");
    }
    int64_t lo = 0, hi = 0;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t extent = (t.size(d) - 1) * t.stride(d);
      (extent < 0 ? lo : hi) += extent;
    }
    const auto item = static_cast<int64_t>(t.element_size());
    const auto base = reinterpret_cast<uintptr_t>(data);
    spans_.push_back(Span{base + lo * item, base + (hi + 1) * item, &t, name,
                          static_cast<int64_t>(i), written});
  }
}

void OverlapCheck::check() const {
  std::vector<const Span*> order(spans_.size());
  for (size_t i = 0; i < spans_.size(); ++i) order[i] = &spans_[i];
  std::sort(order.begin(), order.end(),
            [](const Span* a, const Span* b) { return a->begin < b->begin; });
  for (size_t i = 0; i < order.size(); ++i) {
    const Span& a = *order[i];
    for (size_t j = i + 1; j < order.size() && order[j]->begin < a.end; ++j) {
      const Span& b = *order[j];
      if (!a.written && !b.written) continue;
      // Byte ranges intersect; views that interleave without sharing an element (TooHard) pass.
      const at::MemOverlapStatus status = at::get_overlap_status(*a.tensor, *b.tensor);
      // Named in the order they were added, whatever their addresses.
      const Span& x = order[i] < order[j] ? a : b;
      const Span& y = order[i] < order[j] ? b : a;
      TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
                  describe(x.name, x.index), " and ", describe(y.name, y.index),
                  " share memory (the same tensor twice, or overlapping views), and the kernel "
                  "writes ", x.written ? describe(x.name, x.index) : describe(y.name, y.index),
                  "; pass every tensor once, each with its own memory.");
    }
  }
}

}  // namespace ampfuse::detail
