// The optimizers' checks of a step's gradients, once for both surfaces: run over every group
// before the first one steps, so a bad gradient anywhere changes nothing. Each surface names a
// param its own way (Python: param_groups[0]['params'][2], C++: param_groups()[0].params()[2]).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace ampfuse::engine {

// Whether a and b share memory (their element spans intersect in one storage). Tensors without
// data (meta, fake) share nothing.
bool overlaps(const at::Tensor& a, const at::Tensor& b);

// A shape as Python prints a tuple: (2, 3), (4,), ().
std::string shape_repr(const at::Tensor& t);

// `naming` has "{g}" and "{i}" where the group and the param index go.
std::string param_name(const std::string& naming, int64_t group, int64_t index);

// params[k] and its gradient grads[k] (the params that have one), at groups[k] / indices[k]:
// the gradient's dtype (float16/bfloat16/float32: the param's, or float32), shape and device, and
// that it shares memory neither with its param nor with a state tensor of that param
// (state[j] belongs to params[state_owner[j]], under the name state_keys[j]). Sparse gradients are
// refused. Raises RuntimeError naming the param.
void check_step_grads(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& state, const std::vector<int64_t>& state_owner,
                      const std::vector<std::string>& state_keys, const std::vector<int64_t>& groups,
                      const std::vector<int64_t>& indices, const std::string& naming);

}  // namespace ampfuse::engine
