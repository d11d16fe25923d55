#include "engine/master_forms.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/validation.h"

namespace ampfuse::engine {
namespace {

constexpr int64_t kU32 = 0xFFFFFFFFLL;

at::Tensor from_uint32(const at::Tensor& u) {
  const at::Tensor wrapped = at::where(u.ge(int64_t{1} << 31), u - (int64_t{1} << 32), u);
  return wrapped.to(at::kInt).view(at::kFloat);
}

at::Tensor bits16(const at::Tensor& bf16) { return bf16.contiguous().view(at::kShort).reshape(bf16.sizes()); }

void check_master_pair(const at::Tensor& param, const at::Tensor& master, const char* op) {
  TORCH_CHECK(param.scalar_type() == at::kBFloat16 && master.is_floating_point(), op,
              " needs a torch.bfloat16 param and a floating-point master, got ",
              detail::dtype_name(param.scalar_type()), " and ", detail::dtype_name(master.scalar_type()), ".");
  TORCH_CHECK(param.sizes() == master.sizes(), op, ": the param has shape ", param.sizes(),
              " but the master has shape ", master.sizes(), ".");
}

}  // namespace

at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK(param.scalar_type() == at::kBFloat16 && remainder.scalar_type() == at::kShort,
              "join_master needs a torch.bfloat16 param and a torch.int16 remainder, got ",
              detail::dtype_name(param.scalar_type()), " and ", detail::dtype_name(remainder.scalar_type()), ".");
  TORCH_CHECK(param.sizes() == remainder.sizes(), "join_master: the param has shape ", param.sizes(),
              " but the remainder has shape ", remainder.sizes(), ".");
  const at::Tensor p = param.contiguous().view(at::kShort).to(at::kLong).bitwise_and(0xFFFF);
  const at::Tensor r = remainder.contiguous().to(at::kLong);
  const at::Tensor mag = p.bitwise_and(0x7FFF);
  const at::Tensor plain = mag.gt(0x7F80)
                               .logical_or(mag.eq(0x7F80).logical_and(r.ge(0)))
                               .logical_or(mag.eq(0).logical_and(r.lt(0)));
  const at::Tensor hi = p * 65536;
  const at::Tensor bits = at::where(plain, hi, (hi + r).bitwise_and(kU32));
  return from_uint32(bits).reshape(param.sizes());
}

std::tuple<at::Tensor, at::Tensor> split_master(const at::Tensor& master) {
  TORCH_CHECK(master.scalar_type() == at::kFloat, "split_master needs a torch.float32 master, got ",
              detail::dtype_name(master.scalar_type()), ".");
  const at::Tensor b = master.contiguous().view(at::kInt).to(at::kLong).bitwise_and(kU32);
  const at::Tensor nan = b.bitwise_and(0x7FFFFFFF).gt(0x7F800000);
  const at::Tensor hi = at::floor_divide(b + 0x8000, 65536);  // nearest, ties away from zero
  const at::Tensor rem = at::where(nan, at::zeros_like(b), b - hi * 65536);
  const at::Tensor p = at::where(nan, at::floor_divide(b, 65536).bitwise_or(0x40), hi).bitwise_and(0xFFFF);
  const at::Tensor p16 = at::where(p.ge(0x8000), p - 0x10000, p).to(at::kShort).view(at::kBFloat16);
  return {p16.reshape(master.sizes()), rem.to(at::kShort).reshape(master.sizes())};
}

at::Tensor remainder_of_(const at::Tensor& param, const at::Tensor& master) {
  check_master_pair(param, master, "remainder_of_");
  at::NoGradGuard no_grad;
  const at::Tensor m = master.to(param.device(), at::kFloat);
  auto [hi, rem] = split_master(m);
  const at::Tensor bits = bits16(param);
  const at::Tensor hi_bits = bits16(hi);
  const at::Tensor rne_bits = bits16(m.to(at::kBFloat16));
  const at::Tensor same = hi_bits.eq(bits).logical_or(rne_bits.eq(bits));
  param.copy_(at::where(same.logical_and(hi_bits.ne(bits)), hi, param));  // ties only
  at::Tensor out = at::zeros_like(param, param.options().dtype(at::kShort), at::MemoryFormat::Preserve);
  return out.copy_(at::where(same, rem, at::zeros_like(rem)));
}

void round_ties_even_(const at::Tensor& param, const at::Tensor& master) {
  if (param.scalar_type() != at::kBFloat16) return;
  check_master_pair(param, master, "round_ties_even_");
  at::NoGradGuard no_grad;
  const at::Tensor m = master.to(param.device(), at::kFloat);
  const at::Tensor hi = std::get<0>(split_master(m));
  const at::Tensor rne = m.to(at::kBFloat16);
  const at::Tensor bits = bits16(param);
  const at::Tensor move = bits16(hi).eq(bits).logical_and(bits16(rne).ne(bits)).logical_and(m.isnan().logical_not());
  param.copy_(at::where(move, rne, param));
}

namespace {

// The master-form ops through the dispatcher, so that a tensor subclass (DTensor) sees them.
at::Tensor dispatch_join(const at::Tensor& param, const at::Tensor& remainder) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampfuse::join_master", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(param, remainder);
}

at::Tensor dispatch_remainder_of(const at::Tensor& param, const at::Tensor& master) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampfuse::remainder_of_", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(param, master);
}

void dispatch_round_ties_even(const at::Tensor& param, const at::Tensor& master) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("ampfuse::round_ties_even_", "")
                             .typed<void(const at::Tensor&, const at::Tensor&)>();
  op.call(param, master);
}

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

}  // namespace

std::vector<at::Tensor> convert_master_(const at::Tensor& param,
                                        const std::optional<at::Tensor>& master_param,
                                        const std::optional<at::Tensor>& master_remainder,
                                        const std::string& kind, bool reconcile) {
  TORCH_CHECK(kind == "none" || kind == "float" || kind == "remainder",
              "convert_master_: kind must be 'none', 'float' or 'remainder', got '", kind, "'.");
  TORCH_CHECK(kind != "remainder" || param.scalar_type() == at::kBFloat16,
              "convert_master_: the remainder form needs a torch.bfloat16 param, got ",
              detail::dtype_name(param.scalar_type()), ".");
  at::NoGradGuard no_grad;
  if (kind == "none") return {};
  if (kind == "float") {
    if (present(master_param)) {
      if (reconcile) dispatch_round_ties_even(param, *master_param);
      return {*master_param};
    }
    at::Tensor master =
        at::empty_like(param, param.options().dtype(at::kFloat), at::MemoryFormat::Preserve);
    if (!present(master_remainder)) return {master.copy_(param)};
    master.copy_(dispatch_join(param, *master_remainder));
    dispatch_round_ties_even(param, master);
    return {master};
  }
  if (present(master_remainder)) return {*master_remainder};
  if (present(master_param)) return {dispatch_remainder_of(param, *master_param)};
  return {at::zeros_like(param, param.options().dtype(at::kShort), at::MemoryFormat::Preserve)};
}

}  // namespace ampfuse::engine

// One kernel for every device (the functions above are torch ops), Meta included.
TORCH_LIBRARY_IMPL(ampfuse, CompositeExplicitAutograd, m) {
  m.impl("join_master", &ampfuse::engine::join_master);
  m.impl("split_master", &ampfuse::engine::split_master);
  m.impl("remainder_of_", &ampfuse::engine::remainder_of_);
  m.impl("round_ties_even_", &ampfuse::engine::round_ties_even_);
}

// Decomposed for every device and tensor subclass into the torch ops and master-form ops it calls.
TORCH_LIBRARY_IMPL(ampfuse, CompositeImplicitAutograd, m) {
  m.impl("convert_master_", &ampfuse::engine::convert_master_);
}
