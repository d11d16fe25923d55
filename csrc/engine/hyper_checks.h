// A param group's hyper-parameters, checked once for both surfaces before any group steps: the
// bounds the kernels take and the types a Python group may hold (a C++ options object can only
// hold numbers). The ops check their own arguments again (ops/validation.cpp: RuntimeError, named
// by the op's arguments), as every op does whoever calls it.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <string>

namespace ampfuse::engine {

// The options of one group of `optimizer` ("SGD", "Adam" or "AdamW"), by option name, each one
// present checked (SGD's four together, Adam's three together): lr (a
// number or a 1-element tensor), weight_decay, state_dtype; SGD's momentum, dampening, nesterov;
// Adam's betas (a pair) and eps; state_dtype as its name ("torch.bfloat16"). `group` names the group and `python_naming` how an option of it is
// named: Python `param_groups[0]['betas'][1]`, C++ `AdamW: betas[1]`. Raises c10::ValueError.
void check_group_hyper(const std::string& optimizer, const c10::Dict<std::string, c10::IValue>& values,
                       const std::string& group, bool python_naming);

// The same as an op (registration.cpp: group_hyper_check), for Python.
inline void group_hyper_op(std::string optimizer, c10::Dict<std::string, c10::IValue> values, std::string group,
                           bool python_naming) {
  check_group_hyper(optimizer, values, group, python_naming);
}

}  // namespace ampfuse::engine
