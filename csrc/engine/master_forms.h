// The two forms of a bf16 param's fp32 master, and the exact conversions between them, once for
// both surfaces (the kernels' elementwise versions are in ops/rules.h):
//   fp32 master:   a float32 tensor; the param holds it rounded to nearest even;
//   remainder:     an int16 tensor r with bits(master) = (bits(param) << 16) + r, the param the
//                  master's upper half rounded to nearest, ties away from zero.
// A master value that is an exact tie between two bf16 values has a param one bf16 ulp apart in
// the two forms, so a switch of form moves such params to the new form's rounding: no master bit
// is lost either way. Registered as ops (join_master, split_master, remainder_of_,
// round_ties_even_, convert_master_; registration.cpp), so Python and DTensor reach the same code.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace ampfuse::engine {

// The fp32 master of bf16 `param` and int16 `remainder` (a new tensor). Where the pair cannot come
// from split_master (a param edited since: zero, inf or NaN with an incompatible remainder), the
// master is the param's value, as the kernels do.
at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder);

// (param, remainder) whose join_master is fp32 `master` bit for bit (NaN stays a quiet NaN with
// remainder 0).
std::tuple<at::Tensor, at::Tensor> split_master(const at::Tensor& master);

// The remainder that with bf16 `param` stands for fp32 `master`, for a switch to the remainder
// form. `param` holds the master rounded either way a form rounds it; where it is the
// round-half-even value of a tie it is moved to the split's (in place). Where it is neither (it
// was edited, or loaded from elsewhere) the param wins and the remainder is 0 there.
at::Tensor remainder_of_(const at::Tensor& param, const at::Tensor& master);

// For a switch to the fp32 form: where bf16 `param` is `master` rounded ties away from zero and
// that differs from round-half-even (an exact tie), `param` is moved (in place) to the
// round-half-even value, which the fp32-master step expects of an unedited param. No-op for
// other param dtypes.
void round_ties_even_(const at::Tensor& param, const at::Tensor& master);

// `param`'s master in the form `kind` ("none", "float": an fp32 master, "remainder": an int16
// remainder, bf16 params only) from the master it has now (`master_param` and/or
// `master_remainder`, or neither: the master is the param), converted exactly with the moves
// above; with `reconcile` (an fp32 master just loaded, perhaps a remainder form's) the param is
// brought to round-half-even. Returns [] for "none" (the master is dropped: a later switch back
// starts from the param, not from a stale master), else [the master tensor] (the one given when
// it already is of the form). A composite of torch ops and the ops above (DTensor sees those).
std::vector<at::Tensor> convert_master_(const at::Tensor& param,
                                        const std::optional<at::Tensor>& master_param,
                                        const std::optional<at::Tensor>& master_remainder,
                                        const std::string& kind, bool reconcile);

}  // namespace ampfuse::engine
